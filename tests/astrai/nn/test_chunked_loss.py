"""Chunked LM-head losses vs F.cross_entropy / log_softmax on full fp32 logits, and their memory property."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from astrai.nn.chunked_loss import chunked_cross_entropy, token_logprobs
from helpers import assert_close

N, E, V = 67, 16, 97  # N not a multiple of the chunk sizes below
CHUNK = 32  # for the memory tests: E < CHUNK, so a saved [V, E] weight is smaller than one [CHUNK, V] logits block


def _inputs(dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(N, E, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, E, generator=g) * 0.5).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    mask = (torch.rand(N, generator=g) > 0.3).float()
    mask[3] = 0.5  # a fractional weight is a weight, not a boolean
    return hidden, weight, b, targets, mask


def _ref_ce(hidden, weight, bias, targets, mask, eps):
    logits = F.linear(hidden, weight, bias).float()  # [N, V] fp32, the thing the chunked version avoids
    return (F.cross_entropy(logits, targets, reduction="none", label_smoothing=eps) * mask).sum()


def _ref_logprobs(hidden, weight, bias, targets):
    return F.log_softmax(F.linear(hidden, weight, bias).float(), dim=-1).gather(1, targets[:, None]).squeeze(1)


def _names(bias):
    return ("hidden", "weight") + (("bias",) if bias is not None else ())


def _grads(out, tensors, grad_out=None):
    return torch.autograd.grad(out, [t for t in tensors if t is not None], grad_out)


@pytest.mark.parametrize("chunk_size", [1, 16, 4096])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_cross_entropy_matches_full_logits(chunk_size, eps, bias):
    hidden, weight, b, targets, mask = _inputs(bias=bias)
    loss = chunked_cross_entropy(hidden, weight, targets, mask, bias=b, chunk_size=chunk_size, label_smoothing=eps)
    ref = _ref_ce(hidden, weight, b, targets, mask, eps)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert_close(loss, ref, atol=1e-4, rtol=1e-6, msg="loss")
    for name, got, want in zip(
        _names(b), _grads(loss, (hidden, weight, b)), _grads(ref, (hidden, weight, b)), strict=True
    ):
        assert_close(got, want, atol=1e-5, rtol=1e-5, msg=name)


def test_cross_entropy_scales_with_upstream_grad():
    hidden, weight, b, targets, mask = _inputs()
    loss = chunked_cross_entropy(hidden, weight, targets, mask, bias=b, chunk_size=16)
    ref = _ref_ce(hidden, weight, b, targets, mask, 0.0)
    for got, want in zip(
        _grads(loss * 0.25, (hidden, weight, b)), _grads(ref * 0.25, (hidden, weight, b)), strict=True
    ):
        assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_cross_entropy_only_requested_grads():
    hidden, weight, _, targets, mask = _inputs(bias=False)
    frozen = weight.detach()  # e.g. a frozen LM head under LoRA: only the hidden states need a gradient
    loss = chunked_cross_entropy(hidden, frozen, targets, mask, chunk_size=16)
    (got,) = torch.autograd.grad(loss, hidden)
    (want,) = torch.autograd.grad(_ref_ce(hidden, frozen, None, targets, mask, 0.0), hidden)
    assert_close(got, want, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        value = chunked_cross_entropy(hidden, weight, targets, mask, chunk_size=16)
    assert not value.requires_grad
    assert_close(value, _ref_ce(hidden, weight, None, targets, mask, 0.0), atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("chunk_size", [1, 16, 4096])
@pytest.mark.parametrize("bias", [True, False])
def test_token_logprobs_matches_log_softmax(chunk_size, bias):
    hidden, weight, b, targets, _ = _inputs(bias=bias)
    upstream = torch.randn(N)
    logp = token_logprobs(hidden, weight, targets, bias=b, chunk_size=chunk_size)
    ref = _ref_logprobs(hidden, weight, b, targets)
    assert logp.shape == (N,) and logp.dtype == torch.float32
    assert_close(logp, ref, atol=1e-5, rtol=1e-6)
    got = _grads(logp, (hidden, weight, b), upstream)
    want = _grads(ref, (hidden, weight, b), upstream)
    for name, x, y in zip(_names(b), got, want, strict=True):
        assert_close(x, y, atol=1e-5, rtol=1e-5, msg=name)


def test_bf16_inputs_compute_in_fp32():
    hidden, weight, b, targets, mask = _inputs(torch.bfloat16)
    loss = chunked_cross_entropy(hidden, weight, targets, mask, bias=b, chunk_size=16, label_smoothing=0.1)
    ref = _ref_ce(hidden, weight, b, targets, mask, 0.1)  # bf16 GEMM, fp32 softmax: the same numerics
    assert loss.dtype == torch.float32
    assert_close(loss, ref, atol=1e-3, rtol=1e-5)
    got, want = _grads(loss, (hidden, weight, b)), _grads(ref, (hidden, weight, b))
    for name, x, y in zip(_names(b), got, want, strict=True):
        assert x.dtype == torch.bfloat16, name
        assert_close(x, y, atol=2e-2, rtol=2e-2, msg=name)
    logp = token_logprobs(hidden, weight, targets, bias=b, chunk_size=16)
    assert logp.dtype == torch.float32
    assert_close(logp, _ref_logprobs(hidden, weight, b, targets), atol=1e-5, rtol=1e-6)


def _saved_numels(fn):
    """Run fn() and its backward; return the element counts of every tensor autograd saved for backward."""
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return numels


def test_no_saved_tensor_as_large_as_the_logits():
    hidden, weight, b, targets, mask = _inputs()
    upstream = torch.randn(N)
    unchunked = _saved_numels(lambda: _ref_ce(hidden, weight, b, targets, mask, 0.1))
    assert max(unchunked) >= N * V  # the check can fail: plain autograd keeps the [N, V] logits
    for fn in (
        lambda: chunked_cross_entropy(hidden, weight, targets, mask, bias=b, chunk_size=CHUNK, label_smoothing=0.1),
        lambda: (token_logprobs(hidden, weight, targets, bias=b, chunk_size=CHUNK) * upstream).sum(),
    ):
        saved = _saved_numels(fn)
        assert saved and max(saved) < CHUNK * V, saved  # not even one [CHUNK, V] block of logits


def test_compiled_matches_eager_and_keeps_memory_bound():
    hidden, weight, b, targets, mask = _inputs()
    upstream = torch.randn(N)

    def step(h, w, bias):
        h = torch.tanh(h)  # something before the loss, as in a model
        ce = chunked_cross_entropy(h, w, targets, mask, bias=bias, chunk_size=CHUNK, label_smoothing=0.1)
        return ce + (token_logprobs(h, w, targets, bias=bias, chunk_size=CHUNK) * upstream).sum()

    def ref(h, w, bias):
        h = torch.tanh(h)
        return _ref_ce(h, w, bias, targets, mask, 0.1) + (_ref_logprobs(h, w, bias, targets) * upstream).sum()

    compiled = torch.compile(step, fullgraph=True)
    numels = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (numels.append(t.numel()), t)[1], lambda t: t):
        out = compiled(hidden, weight, b)
    want = ref(hidden, weight, b)
    assert_close(out, want, atol=1e-4, rtol=1e-6)
    # AOTAutograd must not save any chunk of logits (it would if it CSE'd the backward's recomputation)
    assert numels and max(numels) < CHUNK * V, numels
    for x, y in zip(_grads(out, (hidden, weight, b)), _grads(want, (hidden, weight, b)), strict=True):
        assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_torch_func_grad():
    hidden, weight, b, targets, mask = _inputs()
    h, w, bias = hidden.detach(), weight.detach(), b.detach()
    upstream = torch.randn(N)

    def fn(w, bias):
        ce = chunked_cross_entropy(h, w, targets, mask, bias=bias, chunk_size=16)
        return ce + (token_logprobs(h, w, targets, bias=bias, chunk_size=16) * upstream).sum()

    got = torch.func.grad(fn, argnums=(0, 1))(w, bias)
    want = _grads(
        _ref_ce(h, weight, b, targets, mask, 0.0) + (_ref_logprobs(h, weight, b, targets) * upstream).sum(), (weight, b)
    )
    for x, y in zip(got, want, strict=True):
        assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_inputs_are_not_modified():
    hidden, weight, b, targets, mask = _inputs()
    before = [t.detach().clone() for t in (hidden, weight, b, targets, mask)]
    loss = chunked_cross_entropy(hidden, weight, targets, mask, bias=b, chunk_size=16, label_smoothing=0.1)
    loss.backward()
    token_logprobs(hidden, weight, targets, bias=b, chunk_size=16).sum().backward()
    for x, y in zip((hidden, weight, b, targets, mask), before, strict=True):
        assert torch.equal(x.detach(), y)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden=torch.randn(2, N, E)), "hidden must be"),
        (dict(weight=torch.randn(V, E + 1)), "weight must be"),
        (dict(targets=torch.zeros(N + 1, dtype=torch.int64)), "targets must be"),
        (dict(targets=torch.zeros(N)), "integer"),
        (dict(mask=torch.ones(N - 1)), "mask must be"),
        (dict(bias=torch.zeros(V + 1)), "bias must be"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(weight=torch.randn(V, E, dtype=torch.bfloat16)), "share a dtype"),
        (dict(label_smoothing=1.0), "label_smoothing"),
    ],
)
def test_bad_input_raises(change, match):
    hidden, weight, b, targets, mask = _inputs()
    kwargs = dict(hidden=hidden, weight=weight, targets=targets, mask=mask, bias=b, chunk_size=16)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(**kwargs)
    if "mask" not in change and "label_smoothing" not in change:
        kwargs.pop("mask")
        kwargs.pop("label_smoothing", None)
        with pytest.raises(ValueError, match=match):
            token_logprobs(**kwargs)


def test_custom_ops_pass_opcheck():
    hidden, weight, b, targets, mask = _inputs()
    ops = torch.ops.astrai
    torch.library.opcheck(ops.linear_cross_entropy, (hidden, weight, b, targets, mask, 16, 0.1, True, True, True))
    torch.library.opcheck(ops.linear_cross_entropy, (hidden, weight, None, targets, mask, 16, 0.0, False, True, False))
    torch.library.opcheck(ops.linear_logprobs, (hidden, weight, b, targets, 16))
    lse = torch.logsumexp(F.linear(hidden, weight, b).detach(), dim=-1)
    args = (torch.randn(N), hidden.detach(), weight.detach(), b.detach(), targets, lse, 16, True, True, True)
    torch.library.opcheck(ops.linear_logprobs_backward, args)
