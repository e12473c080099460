"""Attention: dense (causal or bidirectional, no cache) and paged (prefill/extend and decode over the KV pool).

`AttnMeta` is the explicit batch metadata tree of a paged step; `KVCache` holds the per-layer pool tensors
(`LatentCache` is the MLA pool: one latent tensor per layer, used by `astrai.nn.mla`).
Dense attention always runs torch SDPA (flash/efficient kernels on CUDA). Paged attention dispatches per
`astrai.ops.backend`: Triton kernels on CUDA, their plain-torch references (`triton_kernels.<op>.<op>_ref`,
vectorised and compile-friendly) on CPU, or the CUDA references. CPU decode takes the hand-written kernel
`astrai.cpu_kernels.decode_attention` where it runs (AVX-512; fp32 or bf16): it reads the pages in place, where
the reference gathers them into a padded fp32 copy for SDPA; CPU prefill and mixed steps run the extend
reference's loop with the kernel for their decoding rows. `pages_needed` is the one page round-up.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor

from astrai.cpu_kernels import decode_attention as cpu_attention
from astrai.ops.backend import Backend, attn_backend
from astrai.tree import pytree, static


@pytree
@attrs.frozen(eq=False)
class AttnMeta:
    """Metadata of one paged step over B requests and T new tokens (flattened, request-major).

    Attributes:
        positions: [T] int64 absolute position of each new token.
        slot_mapping: [T] int64 pool slot where each new token's K/V is written (negative: padding, skipped).
        cu_seqlens_q: [B+1] int32 offsets of each request's new tokens (qo_indptr).
        seq_lens: [B] int32 tokens in the cache per request after this step (prefix + new).
        block_table: [B, P] int32 pages of each request, in order.
        page_size: tokens per page (N).
        decode: True when every request has exactly one new token (T == B): selects the decode kernel.
    """

    positions: Tensor
    slot_mapping: Tensor
    cu_seqlens_q: Tensor
    seq_lens: Tensor
    block_table: Tensor
    page_size: int = static()
    decode: bool = static(default=False)


def pages_needed(num_tokens: int, page_size: int) -> int:
    """Pages that hold `num_tokens` tokens (ceil division)."""
    return -(-num_tokens // page_size)


@pytree
@attrs.frozen(eq=False)
class KVCache:
    """The paged KV pool: one K and one V tensor per layer, each [S, K, D] with S = pages * page_size."""

    k: tuple[Tensor, ...]
    v: tuple[Tensor, ...]


@pytree
@attrs.frozen(eq=False)
class LatentCache:
    """The paged MLA pool: one [S, R + Dr] tensor per layer of [c_kv ; k_pe] rows (astrai.nn.mla)."""

    latent: tuple[Tensor, ...]


def dense_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    window: int = 0,
    doc_ids: Tensor | None = None,
    causal: bool = True,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Attention over full sequences: causal (the LM) or bidirectional (the encoder), optionally per document.

    Args:
        q: [B, T, H, D]; k, v: [B, T, K, D].
        scale: softmax scale.
        window: sliding window in tokens (0: none); bidirectional, a key is kept when |i - j| < window.
        doc_ids: [B, T] int document index of each token (packed training rows); a query attends only to
            keys of the same document. None: one document per row (the fast `is_causal` path).
        causal: a query attends only to keys at or before it; False: to every key (embedding encoders).
        key_padding_mask: [B, T] bool, True for real tokens; padded keys are never attended. A query with no
            key left (a row that is all padding) attends to every key instead, so no row is NaN.

    Returns:
        [B, T, H, D].
    """
    seq = q.shape[1]
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
    gqa = qh.shape[1] != kh.shape[1]
    windowed = 0 < window < seq
    if not windowed and doc_ids is None and key_padding_mask is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)
    pos = torch.arange(seq, device=q.device)
    if causal:
        mask = pos[None, :] <= pos[:, None]  # [T, T]
    else:
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device)
    if windowed:
        mask = mask & (pos[None, :] > pos[:, None] - window)
        if not causal:
            mask = mask & (pos[None, :] < pos[:, None] + window)
    if doc_ids is not None:
        mask = mask & (doc_ids[:, :, None] == doc_ids[:, None, :])  # [B, T, T]
    if key_padding_mask is not None:
        mask = mask & key_padding_mask.bool()[:, None, :]  # [B, T, T]
        mask = mask | ~mask.any(-1, keepdim=True)  # a query with no key left attends to all: finite, never NaN
    if mask.dim() == 3:
        mask = mask[:, None]  # broadcast over heads
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2)


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttnMeta, *, scale: float, window: int = 0
) -> Tensor:
    """Attention of new tokens over the paged pool (their own K/V must already be stored).

    Args:
        q: [T, H, D] new-token queries.
        k_cache, v_cache: [S, K, D] pool tensors of this layer.
        meta: batch metadata (decode when every request has one new token).
        scale: softmax scale.
        window: sliding window in tokens (0: none).

    Returns:
        [T, H, D].
    """
    backend = attn_backend(q)
    if meta.decode and backend == "torch" and cpu_attention.supports(q, k_cache, v_cache):
        # CPU decode: the hand-written kernel reads the pages in place (the reference gathers them into fp32)
        args = (q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.page_size, scale, window)
        if torch.compiler.is_compiling():
            return torch.ops.astrai.cpu_decode_attention(*args)
        return cpu_attention.decode_attention(*args[:5], page_size=meta.page_size, scale=scale, window=window)
    if backend == "torch" and cpu_attention.supports(q, k_cache, v_cache):
        # CPU prefill and mixed steps: the reference's loop, whose batched call for the decoding rows runs the kernel
        args = (q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_table, meta.page_size, scale, window)
        return torch.ops.astrai.cpu_extend_attention(*args) if torch.compiler.is_compiling() else _cpu_extend(*args)
    impl = _paged_impl(meta.decode, backend)
    if meta.decode:
        args = (q, k_cache, v_cache, meta.block_table, meta.seq_lens)
    else:
        args = (q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_table)
    return impl(*args, page_size=meta.page_size, scale=scale, window=window)


def _paged_impl(decode: bool, backend: Backend) -> Callable[..., Tensor]:
    """The decode or extend implementation of `backend`, imported on first use (importing astrai stays light)."""
    if backend == "cuda_ref":
        import astrai.cuda_ref as cuda_ref

        return cuda_ref.decode_attention if decode else cuda_ref.extend_attention
    if decode:
        from astrai.triton_kernels import decode_attention as kernel

        return kernel.decode_attention if backend == "triton" else kernel.decode_attention_ref
    from astrai.triton_kernels import extend_attention as kernel

    return kernel.extend_attention if backend == "triton" else kernel.extend_attention_ref


# bf16 requests of at most this many new tokens in a CPU extend step run as one query per token through the decode
# kernel; longer ones, and fp32 ones of more than one token, keep the extend reference's per-request SDPA. Per token,
# each query re-reads its keys where SDPA's blocks share their loads. An in-process A/B over the 30 layers of
# SmolLM2-135M on the 2-core Xeon (3 alternating prefill calls each after a warm-up, ms per call, per token vs SDPA):
# bf16 16 x 128 tokens 195 vs 231, 4 x 256 157 vs 146, 2 x 512 264 vs 214; fp32 16 x 128 258 vs 242. The engine's
# 64 x 128-token bf16 batch, whose chunked prefill makes prefix-hit extends (the reference's masked SDPA), spent 2.42
# against 2.96 s in prefill steps.
PER_TOKEN_MAX_NEW = {torch.bfloat16: 128}


def _cpu_extend(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, block_table: Tensor,
    page_size: int, scale: float, window: int,
) -> Tensor:  # fmt: skip
    """Extend (prefill) attention on CPU: the decoding rows, and bf16 requests of up to `PER_TOKEN_MAX_NEW` new tokens
    (short prompts, chunked-prefill continuations), through the decode kernel, each token one query over the keys it
    may see (its request's prefix and its own chunk up to itself), in one call; the others through
    `extend_per_request`.
    Rows past the last request's tokens stay zero, as in `extend_attention_ref`."""
    from astrai.triton_kernels.extend_attention import extend_per_request

    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    short = counts <= PER_TOKEN_MAX_NEW.get(q.dtype, 1)  # fp32: the decoding rows only
    if bool(short.all()):
        out = q.new_zeros(q.shape)
    else:  # the long requests; the short ones get length 0 there, which the reference skips
        lens = torch.where(short, torch.zeros_like(seq_lens), seq_lens)
        out = extend_per_request(q, k_cache, v_cache, cu_seqlens_q, lens, block_table, page_size, scale, window,
                                 decode_rows=cpu_attention.decode_attention)  # fmt: skip
    requests = short.nonzero().flatten()
    if requests.numel():
        owner = torch.repeat_interleave(requests, counts[requests])  # the request of each of their tokens
        first = torch.cumsum(counts[requests], 0) - counts[requests]  # each request's first token among them
        offset = torch.arange(owner.shape[0]) - torch.repeat_interleave(first, counts[requests])
        rows = cu_seqlens_q[:-1].long()[owner] + offset
        # keys each token sees: its request's cached prefix and its chunk up to itself (a padding request, of length
        # 0, sees none and gets zeros)
        lens = ((seq_lens.long() - counts)[owner] + offset + 1).clamp_(min=0).int()
        out[rows] = cpu_attention.decode_attention(q[rows], k_cache, v_cache, block_table[owner], lens,
                                                   page_size=page_size, scale=scale, window=window)  # fmt: skip
    return out


@torch.library.custom_op("astrai::cpu_extend_attention", mutates_args=())
def _cpu_extend_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor, block_table: Tensor,
    page_size: int, scale: float, window: int,
) -> Tensor:  # fmt: skip
    """`_cpu_extend` as an opaque op of compiled CPU prefill steps (it reads the lengths on the host, as
    `astrai::extend_attention_ref` does)."""
    return _cpu_extend(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, page_size, scale, window)


@_cpu_extend_op.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, page_size, scale, window):
    return q.new_empty(q.shape)
