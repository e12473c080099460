"""rotary_kv_store_ (Triton; interpreted on CPU) against the unfused kernels and the reference.

The kernel must leave exactly what `rotary` then `kv_store_` leave: the same rotated q, and the same pools
(rotated k and v at their slots, every other slot untouched, padding rows writing nothing). Inputs are strided
views of one fused [T, H + 2K, D] projection, as the engine passes them. Negative control: a swapped slot
mapping gives other pools.
"""

from __future__ import annotations

import pytest
import torch

from astrai.triton_kernels import rotary_kv_store as rotary_kv_store_module
from astrai.triton_kernels.kv_store import kv_store_
from astrai.triton_kernels.rotary import rotary
from astrai.triton_kernels.rotary_kv_store import rotary_kv_store_, rotary_kv_store_ref_
from helpers import AOT_PRELUDE, DEVICE, TOLERANCES, assert_close, assert_compiles_for_gpu

# (H, K, D): GQA 4, MQA, MHA, and a head dim whose half is not a power of two
SHAPES = [(8, 2, 64), (4, 1, 32), (3, 3, 10)]
SLOTS = [17, -1, 0, 45, 3, -1, 30]  # shuffled, with padding rows and slot 0 next to one


def _inputs(heads, kv_heads, head_dim, dtype, slots=SLOTS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = len(slots)
    fused = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    q, k, v = fused.split([heads, kv_heads, kv_heads], dim=1)  # views: token stride (H + 2K) * D
    angles = torch.rand(tokens, head_dim // 2, generator=gen).to(DEVICE) * 6.3
    pools = [torch.randn(48, kv_heads, head_dim, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    return q, k, v, angles.cos(), angles.sin(), pools, torch.tensor(slots, dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_equals_rotary_then_store(shape, interleaved, dtype):
    q, k, v, cos, sin, (k_pool, v_pool), slots = _inputs(*shape, dtype)
    kc, vc = k_pool.clone(), v_pool.clone()
    q_out = rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots, interleaved)
    # the unfused kernels: exactly the same pools, and the same q
    q_two, k_two = rotary(q, k, cos, sin, interleaved=interleaved)
    kc2, vc2 = k_pool.clone(), v_pool.clone()
    kv_store_(kc2, vc2, k_two, v, slots)
    assert torch.equal(q_out, q_two) and torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # the specification, within the rotary tolerance (fp32 math, FMA contraction may differ)
    kc3, vc3 = k_pool.clone(), v_pool.clone()
    q_ref = rotary_kv_store_ref_(q, k, v, cos, sin, kc3, vc3, slots, interleaved)
    atol, rtol = TOLERANCES[dtype]
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, msg="q")
    assert_close(kc, kc3, atol=atol, rtol=rtol, msg="k pool")
    assert torch.equal(vc, vc3)
    untouched = torch.ones(48, dtype=torch.bool, device=kc.device)
    untouched[[s for s in SLOTS if s >= 0]] = False
    assert torch.equal(kc[untouched], k_pool[untouched]) and torch.equal(vc[untouched], v_pool[untouched])


def test_only_padding_rows_and_no_rows_write_nothing():
    q, k, v, cos, sin, (k_pool, v_pool), slots = _inputs(4, 2, 16, torch.float32, slots=[-1, -1, -1])
    kc, vc = k_pool.clone(), v_pool.clone()
    q_out = rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots)
    assert torch.equal(kc, k_pool) and torch.equal(vc, v_pool)
    assert_close(q_out, rotary(q, k, cos, sin)[0], atol=0, msg="q")
    empty = rotary_kv_store_(q[:0], k[:0], v[:0], cos[:0], sin[:0], kc, vc, slots[:0])
    assert empty.shape == (0, 4, 16) and torch.equal(kc, k_pool)


def test_a_different_slot_mapping_gives_different_pools():
    """Negative control: the comparison above would notice rows written to the wrong slots."""
    q, k, v, cos, sin, (k_pool, v_pool), slots = _inputs(4, 2, 16, torch.float32)
    kc, vc, kc2, vc2 = k_pool.clone(), v_pool.clone(), k_pool.clone(), v_pool.clone()
    rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots)
    rotary_kv_store_(q, k, v, cos, sin, kc2, vc2, slots.flip(0))
    assert not torch.equal(kc, kc2) and not torch.equal(vc, vc2)


def test_refusals_name_the_argument():
    q, k, v, cos, sin, (kc, vc), slots = _inputs(4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots.to(torch.int32))
    with pytest.raises(ValueError, match="cos and sin"):
        rotary_kv_store_(q, k, v, cos[:-1], sin[:-1], kc, vc, slots)
    with pytest.raises(ValueError, match="pools"):
        rotary_kv_store_(q, k, v, cos, sin, kc[:, :1], vc[:, :1], slots)
    with pytest.raises(ValueError, match="k and v"):
        rotary_kv_store_(q, k, v[:, :1], cos, sin, kc, vc, slots)
    # a second device: "meta" on a CPU-only machine (the op itself would dispatch a meta input to its fake
    # implementation, so the launcher's check is called directly)
    with pytest.raises(ValueError, match="slot_mapping not on q's device"):
        rotary_kv_store_module._check(q, k, v, cos, sin, kc, vc, slots.to("meta"))


def test_opcheck():
    q, k, v, cos, sin, (kc, vc), slots = _inputs(4, 2, 16, torch.float32)
    torch.library.opcheck(torch.ops.astrai.rotary_kv_store_.default, (q, k, v, cos, sin, kc, vc, slots, False),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
    gains = _gains(16, torch.float32)
    torch.library.opcheck(torch.ops.astrai.rotary_kv_store_.default,
                          (q, k, v, cos, sin, kc, vc, slots, False, *gains, 1e-6),
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def _gains(head_dim, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return tuple((0.5 + torch.rand(head_dim, generator=gen)).to(DEVICE, dtype) for _ in range(2))


@pytest.mark.parametrize("gain_dtype", ["q's", "float32"])
@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_qk_norm_equals_the_reference(shape, interleaved, dtype, gain_dtype):
    """qwen3's per-head q/k RMSNorm in the same launch: the reference normalises with `nn.norm.rms_norm`'s math
    first. Negative control: without the gains the kernel gives another q and k pool."""
    q, k, v, cos, sin, (k_pool, v_pool), slots = _inputs(*shape, dtype)
    q_norm, k_norm = _gains(shape[2], dtype if gain_dtype == "q's" else torch.float32)
    kc, vc, kc_ref, vc_ref = k_pool.clone(), v_pool.clone(), k_pool.clone(), v_pool.clone()
    q_out = rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots, interleaved, q_norm, k_norm, 1e-6)
    q_ref = rotary_kv_store_ref_(q, k, v, cos, sin, kc_ref, vc_ref, slots, interleaved, q_norm, k_norm, 1e-6)
    atol, rtol = TOLERANCES[dtype]
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, msg="q")
    assert_close(kc, kc_ref, atol=atol, rtol=rtol, msg="k pool")
    assert torch.equal(vc, vc_ref)  # v is copied, never normalised
    kc_plain = k_pool.clone()
    q_plain = rotary_kv_store_(q, k, v, cos, sin, kc_plain, v_pool.clone(), slots, interleaved)
    assert not torch.allclose(q_plain.float(), q_out.float(), atol=atol, rtol=rtol)
    assert not torch.allclose(kc_plain.float(), kc.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_norm_reference_is_the_models_rms_norm(dtype):
    from astrai.nn.norm import RMSNormParams, rms_norm

    x = torch.randn(5, 3, 16).to(dtype)
    for weight in (_gains(16, dtype)[0].cpu(), _gains(16, torch.float32)[0].cpu()):
        assert torch.equal(rotary_kv_store_module.rms_norm_ref(x, weight, 1e-6),
                           rms_norm(RMSNormParams(weight=weight), x, eps=1e-6))  # fmt: skip


def test_norm_refusals_name_the_argument():
    q, k, v, cos, sin, (kc, vc), slots = _inputs(4, 2, 16, torch.float32)
    q_norm, k_norm = _gains(16, torch.float32)
    with pytest.raises(ValueError, match="both gains or neither"):
        rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots, False, q_norm, None, 1e-6)
    with pytest.raises(ValueError, match=r"q_norm and k_norm \[16\]"):
        rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots, False, q_norm[:8], k_norm[:8], 1e-6)
    with pytest.raises(ValueError, match="norm gains in q's dtype"):
        half = (q_norm.half(), k_norm.half())
        rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots, False, *half, 1e-6)
    with pytest.raises(ValueError, match="contiguous"):
        wide = torch.ones(32, device=q.device)[::2]
        rotary_kv_store_(q, k, v, cos, sin, kc, vc, slots, False, wide, wide, 1e-6)


# The GPU variants (16-bit and fp32 q/k/v into pools of their dtype, half and interleaved rotation, a padded head
# dim, the block sizes the launcher picks for one decode row and for a prefill chunk) compiled to PTX/cubin for
# sm_80 and sm_90 without a device: the CPU suite otherwise only runs the interpreter, which accepts programs
# the compiler rejects. Names the kernel and variant that fails.
_AOT_SCRIPT = (
    AOT_PRELUDE
    + """
from astrai.triton_kernels.rotary import block_sizes
from astrai.triton_kernels.rotary_kv_store import _rotary_kv_store_kernel as fn

for dt, interleaved, tokens, heads, kv_heads, dim, gains in [
    ("bf16", False, 1, 9, 3, 64, None), ("fp16", True, 512, 32, 8, 128, None), ("fp32", False, 7, 4, 4, 10, None),
    ("bf16", True, 3, 16, 1, 80, None), ("bf16", False, 1, 16, 8, 128, "bf16"),
    ("bf16", False, 256, 16, 8, 128, "fp32"), ("fp16", True, 5, 4, 2, 10, "fp16"),
]:
    block_t, block_h = block_sizes(tokens, heads, kv_heads, dim)
    types = {n: "*" + dt for n in ("q_ptr", "k_ptr", "v_ptr", "qo_ptr", "kc_ptr", "vc_ptr")}
    types.update(cos_ptr="*fp32", sin_ptr="*fp32", slot_ptr="*i64", eps="fp32",
                 qn_ptr="*" + (gains or "fp32"), kn_ptr="*" + (gains or "fp32"))
    consts = dict(INTERLEAVED=interleaved, HALF=dim // 2, HALF_PAD=triton.next_power_of_2(dim // 2),
                  BLOCK_T=block_t, BLOCK_H=block_h, HAS_NORM=gains is not None, ROUND_NORM=gains == dt)
    build(fn, types, consts, num_warps=4, enable_fp_fusion=True)
"""
)


def test_compiles_for_gpu_targets():
    assert_compiles_for_gpu(_AOT_SCRIPT)
