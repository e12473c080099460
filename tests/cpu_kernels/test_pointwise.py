"""cpu_kernels.pointwise: one-pass RMSNorm, SiLU(gate) * up and rotary + KV store equal the torch code they stand in
for (bit for bit where that code's order is fixed), and `astrai.ops` takes them only in eager CPU inference.

Skipped on CPUs without AVX-512 (bf16: AVX512-BF16).
"""

import pytest
import torch
import torch.nn.functional as F

from astrai.cpu_kernels import pointwise as cpu_pointwise
from astrai.ops import pointwise
from astrai.ops.rotary import rotary_kv_store_
from astrai.triton_kernels.kv_store import kv_store_ref_
from astrai.triton_kernels.rotary import rotary_ref
from helpers import assert_close

DTYPES = [torch.float32, torch.bfloat16]


def _needs(dtype: torch.dtype) -> None:
    if not cpu_pointwise.supports(dtype):
        pytest.skip(f"no CPU pointwise kernels for {dtype} here")


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of the dtype lie between a and b (same-sign finite values)."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[a.dtype]
    return (a.view(bits).long() - b.view(bits).long()).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "width"), [(1, 16), (7, 40), (130, 576)])
def test_rms_norm_matches_the_torch_code(dtype, rows, width):
    _needs(dtype)
    gen = torch.Generator().manual_seed(rows * width)
    wide = (torch.randn(rows, width + 24, generator=gen) * 3).to(dtype)
    x = wide[:, 5 : 5 + width]  # strided rows, as views of a wider tensor are
    weight = torch.randn(width, generator=gen).to(dtype)
    out = cpu_pointwise.rms_norm(x, weight, 1e-5)
    expected = _rms_norm_torch(x, weight, 1e-5)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    # only the sum of squares runs in another order: a few units in the last place of fp32, at most one of bf16 (rarely)
    assert _ulps(out, expected).max() <= (1 if dtype == torch.bfloat16 else 8)
    assert dtype == torch.float32 or (out != expected).float().mean() < 0.01
    # negative controls: the gain and eps are applied
    assert not torch.allclose(out.float(), _rms_norm_torch(x, torch.ones_like(weight), 1e-5).float(), atol=1e-2)
    small = x * 1e-3
    assert not torch.allclose(cpu_pointwise.rms_norm(small, weight, 1.0).float(),
                              _rms_norm_torch(small, weight, 1e-5).float(), atol=1e-2)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_the_torch_code(dtype):
    _needs(dtype)
    gen = torch.Generator().manual_seed(0)
    fused = (torch.randn(300, 2 * 136, generator=gen) * 4).to(dtype)
    fused[0, :8] = torch.tensor([0.0, -0.0, 1e4, -1e4, 90.0, -90.0, float("inf"), float("-inf")]).to(dtype)
    fused[1, 0] = float("nan")
    gate, up = fused.split(136, dim=-1)  # strided views of one fused projection, as the MLP's are
    out = cpu_pointwise.silu_mul(gate, up)
    expected = F.silu(gate) * up
    assert out.dtype == dtype and out.shape == gate.shape
    assert out[1, 0].isnan() and expected[1, 0].isnan()
    finite = expected.isfinite() & out.isfinite()
    assert torch.equal(finite, expected.isfinite())  # the same infinities (inf * up) and no new ones
    # exp within ~1 ulp of torch's: a bf16 result may differ by one unit where the fp32 value lies near a boundary
    assert _ulps(out[finite], expected[finite]).max() <= (1 if dtype == torch.bfloat16 else 8)
    assert dtype == torch.float32 or (out[finite] != expected[finite]).float().mean() < 0.01
    # negative control: gate and up are not interchangeable
    assert not torch.allclose(cpu_pointwise.silu_mul(up, gate).float().nan_to_num(), expected.float().nan_to_num())


def _rotary_inputs(dtype, tokens=37, heads=8, kv_heads=2, dim=64, pool=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)  # one fused projection
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim // 2, generator=gen) * 10
    slots = torch.randperm(pool, generator=gen)[:tokens]
    slots[3] = slots[11] = -1  # padding tokens write nothing
    pools = [torch.randn(pool, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    return q, k, v, angles.cos(), angles.sin(), pools, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [64, 128])
def test_rotary_kv_store_matches_the_reference_bit_for_bit(dtype, dim):
    _needs(dtype)
    q, k, v, cos, sin, (k_pool, v_pool), slots = _rotary_inputs(dtype, dim=dim)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    want_q, rotated_k = rotary_ref(q, k, cos, sin)
    kv_store_ref_(want_k, want_v, rotated_k, v, slots)
    out = cpu_pointwise.rotary_kv_store_(q, k, v, cos, sin, k_pool, v_pool, slots)
    # the same fp32 products and sums, each rounded, then the same rounding to the dtype
    assert torch.equal(out, want_q) and torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    # negative control: the halves rotate in opposite senses (sin's sign matters)
    assert not torch.equal(cpu_pointwise.rotary_kv_store_(q, k, v, cos, -sin, k_pool.clone(), v_pool.clone(), slots),
                           want_q)  # fmt: skip


def test_a_slot_past_the_pool_writes_nothing_and_names_the_problem():
    _needs(torch.float32)
    q, k, v, cos, sin, (k_pool, v_pool), slots = _rotary_inputs(torch.float32)
    before = k_pool.clone(), v_pool.clone()
    slots[-1] = k_pool.shape[0]
    with pytest.raises(IndexError, match="past the pool"):
        cpu_pointwise.rotary_kv_store_(q, k, v, cos, sin, k_pool, v_pool, slots)
    assert torch.equal(k_pool, before[0]) and torch.equal(v_pool, before[1])
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_pointwise.rotary_kv_store_(q[..., :48], k[..., :48], v[..., :48], cos[:, :24], sin[:, :24],
                                       k_pool[..., :48], v_pool[..., :48], slots)  # fmt: skip


def test_ops_take_the_kernels_only_in_eager_inference(monkeypatch):
    """`astrai.ops` runs RMSNorm's and SiLU's kernels only inside `inference_kernels()` (the engine's eager steps), and
    there not with a gradient or inside `torch.compile` (where inductor fuses the torch code); rotary + KV store, bit
    for bit the torch code, wherever no gradient is needed."""
    _needs(torch.float32)
    calls = []
    for name in ("rms_norm", "silu_mul", "rotary_kv_store_"):
        real = getattr(cpu_pointwise, name)
        monkeypatch.setattr(cpu_pointwise, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    x, weight = torch.randn(6, 32), torch.randn(32)
    gate, up = torch.randn(6, 40), torch.randn(6, 40)
    q, k, v, cos, sin, pools, slots = _rotary_inputs(torch.float32)
    with torch.no_grad():
        pointwise.rms_norm(x, weight, 1e-6), pointwise.silu_mul(gate, up)  # outside the engine: the torch code
        rotary_kv_store_(q, k, v, cos, sin, tuple(p.clone() for p in pools), slots)
        assert calls == ["rotary_kv_store_"]
        calls.clear()
        with pointwise.inference_kernels():
            pointwise.rms_norm(x, weight, 1e-6), pointwise.silu_mul(gate, up)
        assert calls == ["rms_norm", "silu_mul"]
    calls.clear()
    # a gradient: the torch code, which backpropagates
    w = weight.clone().requires_grad_()
    with pointwise.inference_kernels():
        pointwise.rms_norm(x, w, 1e-6).sum().backward()
    assert w.grad is not None and calls == []
    # compiled: traced torch code, fused by inductor (no opaque kernel call in the graph)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b, c, d: (pointwise.rms_norm(a, b, 1e-6), pointwise.silu_mul(c, d)))
    with torch.no_grad(), pointwise.inference_kernels():
        norm, product = compiled(x, weight, gate, up)
    assert calls == []
    assert_close(norm, _rms_norm_torch(x, weight, 1e-6), atol=1e-5)
    assert_close(product, F.silu(gate) * up, atol=1e-5)


def test_a_compiled_step_does_not_depend_on_which_thread_entered_inference_kernels():
    """The engine warms its compiled steps on the caller's thread, which may have run an eager step under
    `inference_kernels()`, and steps them on its own thread, which may not have: a graph that read the thread-local
    flag would be guarded on it and recompile there (seen with the compiled prefill of a speculating engine)."""
    import threading

    def block(x, weight, gate, up):
        return pointwise.rms_norm(x, weight, 1e-6) + pointwise.silu_mul(gate, up)

    step = torch.compile(block, fullgraph=True)
    args = (torch.randn(3, 8), torch.ones(8), torch.randn(3, 8), torch.randn(3, 8))
    with pointwise.inference_kernels():
        pass  # this thread has entered the block once: the flag exists here, set back to off
    want = step(*args)
    results: list = []

    def other_thread():
        with torch.compiler.set_stance("fail_on_recompile"):
            results.append(step(*args))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=60)
    assert len(results) == 1, "the compiled block recompiled (or failed) on a thread that never entered the block"
    torch.testing.assert_close(results[0], want)
