"""Memory-bounded LM-head losses: cross-entropy and per-token log-probs without materialising [N, V] logits.

The LM head of a large-vocabulary model turns N tokens into N x V fp32 logits (16k tokens x 150k vocab = 9.8 GB)
and autograd would keep them for backward. Both functions here walk the rows `chunk_size` at a time, so at most
one [chunk_size, V] fp32 block exists at once and nothing of size [N, V] is saved for backward:

- `chunked_cross_entropy` follows Liger-Kernel's fused linear cross-entropy: the loss is a scalar, so its
  gradients are computed in the forward pass chunk by chunk (softmax minus the smoothed one-hot) and backward only
  scales them by the incoming scalar grad. One GEMM forward, two for the gradients, no recomputation. Under
  no_grad (or when no input requires grad) only the loss is computed.
- `token_logprobs` returns a vector whose upstream gradient is unknown in forward, so backward recomputes each
  chunk's logits from the saved inputs and per-row log-sum-exp (activation checkpointing of the LM head).

Numerics: logits come from `F.linear` in the input dtype (fp32 accumulation inside the GEMM, like the model's own
LM head) and are upcast to fp32 before any softmax arithmetic. The weight gradient is accumulated across chunks
with `addmm_` in the weight's dtype (as Liger does), so no fp32 copy of a [V, E] matrix is ever made.

Mechanics: each chunk loop is a `torch.library.custom_op` (opaque to torch.compile, see the notes below) with
registered autograd, and eager calls go through an `autograd.Function` in the `setup_context` form, so the losses
work under `.backward()`, `torch.func.grad` and `torch.compile` (fullgraph included). Double backward is not
supported.

Not here: vocab-parallel (sharded V) losses, z-loss, a fused Triton kernel.
References: Liger-Kernel `fused_linear_cross_entropy` (https://github.com/linkedin/Liger-Kernel);
Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models".
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def _check_inputs(
    hidden: Tensor, weight: Tensor, targets: Tensor, bias: Tensor | None, chunk_size: int, mask: Tensor | None
) -> None:
    """Shape and dtype checks on the host (no device sync)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [N, E], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be [V, E] with E={hidden.shape[1]}, got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != weight.dtype):
        got = f"hidden {hidden.dtype}, weight {weight.dtype}" + ("" if bias is None else f", bias {bias.dtype}")
        raise ValueError(f"hidden, weight and bias must share a dtype (cast outside autocast), got {got}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must be [N]=[{hidden.shape[0]}], got shape {tuple(targets.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if mask is not None and mask.shape != hidden.shape[:1]:
        raise ValueError(f"mask must be [N]=[{hidden.shape[0]}], got shape {tuple(mask.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias must be [V]=[{weight.shape[0]}], got shape {tuple(bias.shape)}")
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """[C, E] rows -> [C, V] fp32 logits (GEMM in the input dtype, like the model's LM head)."""
    return F.linear(h, weight, bias).float()


def _needs(*tensors: Tensor | None) -> tuple[bool, ...]:
    """Which inputs need a gradient (False everywhere under no_grad)."""
    enabled = torch.is_grad_enabled()
    return tuple(enabled and t is not None and t.requires_grad for t in tensors)


# ---- the chunk loops as opaque custom ops ---------------------------------------------------------------------
# Opaque to torch.compile on purpose: inlined, AOTAutograd's CSE merges the backward's recomputed chunk logits with
# the forward's and the partitioner then saves every [C, V] block (N x V in total); opaque ops also pin the chunk
# order, so at most one block is alive. Unneeded gradients come back as empty tensors (ops cannot return None).


@torch.library.custom_op("astrai::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    mask: Tensor,
    chunk_size: int,
    label_smoothing: float,
    need_h: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(sum_i mask_i * CE_i, d/dhidden, d/dweight, d/dbias): the gradients are built in the same pass."""
    n, vocab = hidden.shape[0], weight.shape[0]
    loss = hidden.new_zeros((), dtype=torch.float32)
    grad_h = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
    grad_w = torch.zeros_like(weight) if need_w else weight.new_empty(0)
    grad_b = weight.new_zeros(vocab, dtype=torch.float32) if need_b else weight.new_empty(0)
    for start in range(0, n, chunk_size):
        h = hidden[start : start + chunk_size]  # [C, E]
        t = targets[start : start + chunk_size, None].long()  # [C, 1]
        m = mask[start : start + chunk_size, None].float()  # [C, 1]
        z = _chunk_logits(h, weight, bias)  # [C, V] fp32
        lse = torch.logsumexp(z, dim=-1, keepdim=True)  # [C, 1]
        row = lse - (1.0 - label_smoothing) * z.gather(1, t)
        if label_smoothing:
            row = row - label_smoothing * z.mean(dim=-1, keepdim=True)
        loss += (row * m).sum()
        if not (need_h or need_w or need_b):
            continue
        # d loss_i / d z_i = m_i * (softmax(z_i) - (1 - eps) * onehot(t_i) - eps / V), built in place in z
        g = z.sub_(lse).exp_()
        if label_smoothing:
            g.sub_(label_smoothing / vocab)
        g.scatter_add_(1, t, g.new_full(t.shape, -(1.0 - label_smoothing)))
        g.mul_(m)
        if need_b:
            grad_b += g.sum(dim=0)
        g = g.to(hidden.dtype)
        if need_h:
            grad_h[start : start + chunk_size] = g @ weight  # [C, V] @ [V, E]
        if need_w:
            grad_w.addmm_(g.t(), h)  # [V, C] @ [C, E]; the GEMM accumulates in fp32 before rounding
    if need_b:
        grad_b = grad_b.to(bias.dtype)
    return loss, grad_h, grad_w, grad_b


@_linear_cross_entropy.register_fake
def _(hidden, weight, bias, targets, mask, chunk_size, label_smoothing, need_h, need_w, need_b):
    return (
        hidden.new_empty((), dtype=torch.float32),
        torch.empty_like(hidden) if need_h else hidden.new_empty(0),
        torch.empty_like(weight) if need_w else weight.new_empty(0),
        torch.empty_like(bias) if need_b else weight.new_empty(0),
    )


@torch.library.custom_op("astrai::linear_logprobs", mutates_args=())
def _linear_logprobs(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """([N] log p(target), [N] log-sum-exp) in fp32."""
    n = hidden.shape[0]
    logp = hidden.new_empty(n, dtype=torch.float32)
    lse = hidden.new_empty(n, dtype=torch.float32)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        z = _chunk_logits(hidden[start:end], weight, bias)  # [C, V] fp32
        lse[start:end] = torch.logsumexp(z, dim=-1)
        logp[start:end] = z.gather(1, targets[start:end, None].long()).squeeze(1) - lse[start:end]
    return logp, lse


@_linear_logprobs.register_fake
def _(hidden, weight, bias, targets, chunk_size):
    return hidden.new_empty(hidden.shape[0], dtype=torch.float32), hidden.new_empty(
        hidden.shape[0], dtype=torch.float32
    )


@torch.library.custom_op("astrai::linear_logprobs_backward", mutates_args=())
def _linear_logprobs_backward(
    grad_logp: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    lse: Tensor,
    chunk_size: int,
    need_h: bool,
    need_w: bool,
    need_b: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of sum_i grad_i * logp_i, recomputing one chunk of logits at a time."""
    grad_h = torch.empty_like(hidden) if need_h else hidden.new_empty(0)
    grad_w = torch.zeros_like(weight) if need_w else weight.new_empty(0)
    grad_b = weight.new_zeros(weight.shape[0], dtype=torch.float32) if need_b else weight.new_empty(0)
    for start in range(0, hidden.shape[0], chunk_size):
        end = min(start + chunk_size, hidden.shape[0])
        h = hidden[start:end]  # [C, E]
        gl = grad_logp[start:end, None].float()  # [C, 1]
        # d logp_i / d z_i = onehot(t_i) - softmax(z_i), scaled by the upstream grad; built in place
        g = _chunk_logits(h, weight, bias).sub_(lse[start:end, None]).exp_().mul_(-gl)
        g.scatter_add_(1, targets[start:end, None].long(), gl)
        if need_b:
            grad_b += g.sum(dim=0)
        g = g.to(hidden.dtype)
        if need_h:
            grad_h[start:end] = g @ weight  # [C, V] @ [V, E]
        if need_w:
            grad_w.addmm_(g.t(), h)  # [V, C] @ [C, E]
    if need_b:
        grad_b = grad_b.to(bias.dtype)
    return grad_h, grad_w, grad_b


@_linear_logprobs_backward.register_fake
def _(grad_logp, hidden, weight, bias, targets, lse, chunk_size, need_h, need_w, need_b):
    return (
        torch.empty_like(hidden) if need_h else hidden.new_empty(0),
        torch.empty_like(weight) if need_w else weight.new_empty(0),
        torch.empty_like(bias) if need_b else weight.new_empty(0),
    )


# ---- autograd ---------------------------------------------------------------------------------------------------
# One setup_context/backward pair per op serves two front ends: eager calls go through an autograd.Function in the
# setup_context form (so torch.func.grad works too); traced calls use the op's own registered autograd, because
# Dynamo's tracing of an autograd.Function instantiates `torch.autograd.Function()` and trips a DeprecationWarning.


def _ce_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    _, grad_h, grad_w, grad_b = output
    ctx.needs = inputs[-3:]
    ctx.save_for_backward(grad_h, grad_w, grad_b)


def _ce_backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    """The gradients were built in forward; scale them by the incoming scalar grad."""
    grads = [g * grad_loss if need else None for g, need in zip(ctx.saved_tensors, ctx.needs, strict=True)]
    return (*grads, None, None, None, None, None, None, None)


def _lp_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    hidden, weight, bias, targets, chunk_size = inputs
    ctx.chunk_size = chunk_size
    ctx.save_for_backward(hidden, weight, bias, targets, output[1])


def _lp_backward(ctx: Any, grad_logp: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    """Recompute each chunk's logits from the saved inputs and log-sum-exp."""
    hidden, weight, bias, targets, lse = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[:3])
    with torch.no_grad():  # first-order only; also keeps torch.func away from the op's autograd fallback
        grads = _linear_logprobs_backward(grad_logp, hidden, weight, bias, targets, lse, ctx.chunk_size, *needs)
    return (*(g if need else None for g, need in zip(grads, needs, strict=True)), None, None)


_linear_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)
_linear_logprobs.register_autograd(_lp_backward, setup_context=_lp_setup)


class _LinearCrossEntropy(torch.autograd.Function):
    """Eager front end of `astrai::linear_cross_entropy`."""

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return _linear_cross_entropy(*args)

    setup_context = staticmethod(_ce_setup)
    backward = staticmethod(_ce_backward)


class _TokenLogprobs(torch.autograd.Function):
    """Eager front end of `astrai::linear_logprobs`."""

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, Tensor]:
        return _linear_logprobs(*args)

    setup_context = staticmethod(_lp_setup)
    backward = staticmethod(_lp_backward)


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    mask: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 4096,
    label_smoothing: float = 0.0,
) -> Tensor:
    """Masked SUM of token cross-entropies of the LM head, never holding more than one [chunk_size, V] block.

    Returning the sum (not the mean) lets the caller divide by the global count of trained tokens, which is exact
    under gradient accumulation and data parallelism. Label smoothing follows `F.cross_entropy`:
    (1 - eps) * NLL + eps * mean over the vocabulary of -log p.

    Args:
        hidden: [N, E] final-norm hidden states (any float dtype).
        weight: [V, E] LM-head weight (same dtype as `hidden`).
        targets: [N] int next-token ids; must be valid ids in [0, V) even where `mask` is 0.
        mask: [N] float per-token weight (1.0 trained, 0.0 ignored).
        bias: [V] optional LM-head bias.
        chunk_size: rows per block; peak extra memory is about chunk_size * V * 4 bytes.
        label_smoothing: eps in [0, 1).

    Returns:
        fp32 scalar: sum_i mask_i * CE_i.
    """
    _check_inputs(hidden, weight, targets, bias, chunk_size, mask)
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    args = (hidden, weight, bias, targets, mask, chunk_size, float(label_smoothing), *_needs(hidden, weight, bias))
    loss, *_ = _linear_cross_entropy(*args) if torch.compiler.is_compiling() else _LinearCrossEntropy.apply(*args)
    return loss


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    chunk_size: int = 4096,
) -> Tensor:
    """Per-token log p(target) under the LM head, chunked like `chunked_cross_entropy` (for DPO/GRPO).

    Args:
        hidden: [N, E] final-norm hidden states.
        weight: [V, E] LM-head weight.
        targets: [N] int ids in [0, V).
        bias: [V] optional LM-head bias.
        chunk_size: rows per block.

    Returns:
        [N] fp32 log-probabilities; backward recomputes one [chunk_size, V] block at a time.
    """
    _check_inputs(hidden, weight, targets, bias, chunk_size, None)
    args = (hidden, weight, bias, targets, chunk_size)
    logp, _ = _linear_logprobs(*args) if torch.compiler.is_compiling() else _TokenLogprobs.apply(*args)
    return logp
