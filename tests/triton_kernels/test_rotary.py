"""Rotary embedding: Triton kernel vs `rotary_ref`, the ref vs transformers, and autograd of the custom op."""

from __future__ import annotations

import pytest
import torch

from astrai.triton_kernels.rotary import rotary, rotary_ref
from helpers import AOT_PRELUDE, TOLERANCES, assert_close, assert_compiles_for_gpu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = list(TOLERANCES)
# (T, H, K, D): GQA 4 and 8, MHA, MQA, a single decode token, and a head dim whose half is not a power of two.
SHAPES = [(7, 8, 2, 64), (5, 8, 1, 128), (1, 4, 4, 64), (9, 6, 2, 10)]


def make_inputs(tokens, heads, kv_heads, head_dim, dtype, *, table_rows=None):
    """q, k and fp32 cos/sin tables with `table_rows` rows (default: one row per token)."""
    q = torch.randn(tokens, heads, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device=DEVICE).to(dtype)
    angles = torch.rand(table_rows or tokens, head_dim // 2, device=DEVICE) * 6.3
    return q, k, angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_ref(shape, interleaved: bool, dtype: torch.dtype) -> None:
    q, k, cos, sin = make_inputs(*shape, dtype)
    q_out, k_out = rotary(q, k, cos, sin, interleaved=interleaved)
    q_ref, k_ref = rotary_ref(q, k, cos, sin, interleaved=interleaved)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    atol, rtol = TOLERANCES[dtype]
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, msg="q")
    assert_close(k_out, k_ref, atol=atol, rtol=rtol, msg="k")


@pytest.mark.parametrize("interleaved", [False, True])
def test_table_positions_match_per_token_rows(interleaved: bool) -> None:
    q, k, cos, sin = make_inputs(11, 4, 2, 64, torch.float32, table_rows=40)
    positions = torch.randint(0, 40, (11,), device=DEVICE)
    q_out, k_out = rotary(q, k, cos, sin, positions, interleaved=interleaved)
    q_rows, k_rows = rotary(q, k, cos[positions], sin[positions], interleaved=interleaved)
    assert_close(q_out, q_rows, atol=0, msg="q")
    assert_close(k_out, k_rows, atol=0, msg="k")
    q_ref, k_ref = rotary_ref(q, k, cos, sin, positions, interleaved=interleaved)
    assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6, msg="q vs ref")
    assert_close(k_out, k_ref, atol=1e-6, rtol=1e-6, msg="k vs ref")


def test_position_outside_table_gives_nan() -> None:
    q, k, cos, sin = make_inputs(4, 2, 1, 16, torch.float32, table_rows=5)
    positions = torch.tensor([4, 5, -1, 0], device=DEVICE)
    q_out, k_out = rotary(q, k, cos, sin, positions)
    bad = torch.tensor([False, True, True, False], device=DEVICE)
    for out in (q_out, k_out):
        assert out[bad].isnan().all() and not out[~bad].isnan().any()


def test_ref_matches_transformers() -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin = make_inputs(6, 4, 2, 64, torch.float32)
    full_cos, full_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # [1, T, D]
    # HF layout is [B, heads, T, D]: [T, heads, D] -> [1, heads, T, D].
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], full_cos, full_sin)
    q_ref, k_ref = rotary_ref(q, k, cos, sin)
    assert_close(q_ref, q_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6, msg="q")
    assert_close(k_ref, k_hf[0].transpose(0, 1), atol=1e-6, rtol=1e-6, msg="k")
    q_out, _ = rotary(q, k, cos, sin)
    assert_close(q_out, q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5, msg="kernel q")


def test_interleaved_is_permuted_half_layout() -> None:
    # Independent check of the interleaved ref: de-interleaving dims turns it into the half layout.
    q, k, cos, sin = make_inputs(5, 2, 1, 16, torch.float32)
    perm = torch.cat([torch.arange(0, 16, 2), torch.arange(1, 16, 2)])  # even dims first, then odd
    q_inter, k_inter = rotary_ref(q, k, cos, sin, interleaved=True)
    q_half, k_half = rotary_ref(q[..., perm], k[..., perm], cos, sin)
    assert_close(q_inter[..., perm], q_half, atol=1e-6, msg="q")
    assert_close(k_inter[..., perm], k_half, atol=1e-6, msg="k")


@pytest.mark.parametrize("interleaved", [False, True])
def test_ref_gradcheck(interleaved: bool) -> None:
    q, k, cos, sin = make_inputs(3, 2, 1, 8, torch.float64, table_rows=6)
    positions = torch.tensor([5, 0, 3], device=DEVICE)
    q.requires_grad_()
    k.requires_grad_()

    def fn(q, k):
        return rotary_ref(q, k, cos.double(), sin.double(), positions, interleaved=interleaved)

    assert torch.autograd.gradcheck(fn, (q, k))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("with_positions", [False, True])
def test_grads_match_ref(interleaved: bool, with_positions: bool) -> None:
    q, k, cos, sin = make_inputs(6, 4, 2, 32, torch.float32, table_rows=12 if with_positions else None)
    positions = torch.randint(0, 12, (6,), device=DEVICE) if with_positions else None
    grad_q, grad_k = torch.randn_like(q), torch.randn_like(k)
    grads = []
    for fn in (rotary, rotary_ref):
        qi, ki = q.clone().requires_grad_(), k.clone().requires_grad_()
        q_out, k_out = fn(qi, ki, cos, sin, positions, interleaved=interleaved)
        torch.autograd.backward((q_out, k_out), (grad_q, grad_k))
        grads.append((qi.grad, ki.grad))
    assert_close(grads[0][0], grads[1][0], atol=1e-5, rtol=1e-5, msg="dq")
    assert_close(grads[0][1], grads[1][1], atol=1e-5, rtol=1e-5, msg="dk")


def test_grad_through_one_output() -> None:
    # Only q's output feeds the loss: k gets a zero gradient, q the transposed rotation of ones.
    q, k, cos, sin = make_inputs(4, 2, 2, 16, torch.float32)
    q.requires_grad_()
    k.requires_grad_()
    rotary(q, k, cos, sin)[0].sum().backward()
    expected, _ = rotary_ref(torch.ones_like(q), torch.ones_like(k), cos, -sin)
    assert_close(q.grad, expected, atol=1e-6, msg="dq")
    assert not k.grad.any()


@pytest.mark.parametrize("interleaved", [False, True])
def test_strided_views_of_fused_qkv(interleaved: bool) -> None:
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 32
    qkv = torch.randn(tokens, (heads + 2 * kv_heads + 1) * head_dim, device=DEVICE)  # one spare head of padding
    qkv_heads = qkv.view(tokens, heads + 2 * kv_heads + 1, head_dim)  # [T, H + 2K + 1, D]
    q, k = qkv_heads[:, :heads], qkv_heads[:, heads : heads + kv_heads]
    assert not q.is_contiguous() and not k.is_contiguous()
    _, _, cos, sin = make_inputs(tokens, heads, kv_heads, head_dim, torch.float32)
    before = qkv.clone()
    q_out, k_out = rotary(q, k, cos, sin, interleaved=interleaved)
    q_ref, k_ref = rotary_ref(q.contiguous(), k.contiguous(), cos, sin, interleaved=interleaved)
    assert_close(q_out, q_ref, atol=1e-6, rtol=1e-6, msg="q")
    assert_close(k_out, k_ref, atol=1e-6, rtol=1e-6, msg="k")
    assert torch.equal(qkv, before), "the fused input was modified"


def test_inputs_unchanged() -> None:
    q, k, cos, sin = make_inputs(6, 4, 2, 64, torch.bfloat16, table_rows=9)
    positions = torch.randint(0, 9, (6,), device=DEVICE)
    inputs = (q, k, cos, sin, positions)
    before = [t.clone() for t in inputs]
    rotary(*inputs, interleaved=True)
    for name, t, saved in zip(("q", "k", "cos", "sin", "positions"), inputs, before, strict=True):
        assert torch.equal(t, saved), f"{name} was modified"


def test_rejects_non_contiguous_head_dim() -> None:
    q, k, cos, sin = make_inputs(4, 2, 2, 16, torch.float32)
    with pytest.raises(AssertionError, match="contiguous last dim"):
        rotary(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin)


@pytest.mark.parametrize("with_positions", [False, True])
def test_opcheck(with_positions: bool) -> None:
    q, k, cos, sin = make_inputs(3, 4, 2, 16, torch.float32, table_rows=7)
    positions = torch.tensor([6, 0, 2], device=DEVICE) if with_positions else None
    if not with_positions:
        cos, sin = cos[:3], sin[:3]
    q.requires_grad_()
    k.requires_grad_()
    torch.library.opcheck(torch.ops.astrai.rotary.default, (q, k, cos, sin, positions, True, False))


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_int64_token_offsets(interleaved: bool) -> None:
    # q with more than 2**31 elements: token * stride overflows int32 in the last rows.
    heads, head_dim = 64, 128
    tokens = 2**31 // (heads * head_dim) + 1000
    q = torch.randn(tokens, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(tokens, 8, head_dim, dtype=torch.bfloat16, device="cuda")
    angles = torch.rand(tokens, head_dim // 2, device="cuda") * 6.3
    q_out, k_out = rotary(q, k, angles.cos(), angles.sin(), interleaved=interleaved)
    tail = slice(tokens - 2000, tokens)
    q_ref, k_ref = rotary_ref(q[tail], k[tail], angles[tail].cos(), angles[tail].sin(), interleaved=interleaved)
    atol, rtol = TOLERANCES[torch.bfloat16]
    assert_close(q_out[tail], q_ref, atol=atol, rtol=rtol, msg="q tail")
    assert_close(k_out[tail], k_ref, atol=atol, rtol=rtol, msg="k tail")


# The GPU variants (16-bit and fp32, half and interleaved, forward and inverse, with and without a positions
# table, a padded head dim) compiled to PTX/cubin for sm_80 and sm_90 without a device: the interpreter accepts
# programs the compiler rejects.
_AOT_SCRIPT = (
    AOT_PRELUDE
    + """
from astrai.triton_kernels.rotary import _rotary_kernel as fn, block_sizes

for dt, interleaved, inverse, positions, tokens, dim in [("bf16", False, False, True, 1, 64),
                                                         ("fp16", True, True, False, 512, 128),
                                                         ("fp32", False, True, True, 7, 10)]:
    block_t, block_h = block_sizes(tokens, 8, 2, dim)
    types = {n: "*" + dt for n in ("q_ptr", "k_ptr", "qo_ptr", "ko_ptr")}
    types.update(cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64")
    consts = dict(HAS_POSITIONS=positions, INTERLEAVED=interleaved, INVERSE=inverse, HALF=dim // 2,
                  HALF_PAD=triton.next_power_of_2(dim // 2), BLOCK_T=block_t, BLOCK_H=block_h)
    build(fn, types, consts, num_warps=4, enable_fp_fusion=True)
"""
)


def test_compiles_for_gpu_targets() -> None:
    assert_compiles_for_gpu(_AOT_SCRIPT)
