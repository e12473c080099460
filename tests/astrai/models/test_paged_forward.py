"""Prefill and decode through the paged KV cache reproduce the dense full-sequence forward."""

import random

import pytest
import torch

from astrai.inference.cache import init_kv_cache, make_attn_meta
from astrai.io.model import load
from astrai.models.decoder import forward
from astrai.ops.attention import pages_needed
from helpers import assert_close, save_hf, tiny_hf_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # sliding window 6 makes the window path matter for sequences of ~20 tokens
    hf = tiny_hf_model("qwen3", head_dim=16, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    return load(save_hf(hf, tmp_path_factory.mktemp("m")))


def _shuffled_pages(lengths, page_size, seed):
    # non-contiguous page assignment (page 0 is the null page)
    counts = [pages_needed(n, page_size) for n in lengths]
    free = list(range(1, sum(counts) + 1))
    random.Random(seed).shuffle(free)
    out, i = [], 0
    for c in counts:
        out.append(free[i : i + c])
        i += c
    return out, sum(counts) + 1


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_then_decode_matches_dense(model, page_size):
    cfg, params = model.config, model.params
    lengths = [3, 19, 11]
    seqs = [torch.randint(0, 256, (n,)) for n in lengths]
    dense = [forward(params, cfg, s[None])[0] for s in seqs]  # [n, V] each
    pages, num_pages = _shuffled_pages(lengths, page_size, seed=page_size)
    cache = init_kv_cache(cfg, num_pages, page_size, dtype=model.dtype, device="cpu")
    # chunk 1: [0, half); chunk 2 (extend over a cached prefix): [half, n-1); then decode token n-1
    bounds = [[(0, max(1, n // 2)), (max(1, n // 2), n - 1)] for n in lengths]
    for phase in range(2):
        rows = [i for i in range(len(seqs)) if bounds[i][phase][1] > bounds[i][phase][0]]
        starts = [bounds[i][phase][0] for i in rows]
        ends = [bounds[i][phase][1] for i in rows]
        meta = make_attn_meta(
            [pages[i] for i in rows],
            starts,
            [e - s for s, e in zip(starts, ends, strict=True)],
            page_size=page_size,
            device="cpu",
        )
        tokens = torch.cat([seqs[i][s:e] for i, s, e in zip(rows, starts, ends, strict=True)])
        logits = forward(params, cfg, tokens, meta=meta, cache=cache)
        expected = torch.cat([dense[i][s:e] for i, s, e in zip(rows, starts, ends, strict=True)])
        assert_close(logits, expected, atol=1e-4, msg=f"phase {phase}")
    done = [n - 1 for n in lengths]
    # decode the last token of every sequence in one batch
    meta = make_attn_meta(pages, done, [1] * len(seqs), page_size=page_size, device="cpu", decode=True)
    tokens = torch.stack([s[-1] for s in seqs])
    logits = forward(params, cfg, tokens, meta=meta, cache=cache)
    assert_close(logits, torch.stack([d[-1] for d in dense]), atol=1e-4, msg="decode")


def test_prefill_logits_positions(model):
    cfg, params = model.config, model.params
    seqs = [torch.randint(0, 256, (n,)) for n in (5, 8)]
    cache = init_kv_cache(cfg, 3, 16, dtype=model.dtype, device="cpu")
    meta = make_attn_meta([[1], [2]], [0, 0], [5, 8], page_size=16, device="cpu")
    rows = meta.cu_seqlens_q[1:].long() - 1
    logits = forward(params, cfg, torch.cat(seqs), meta=meta, cache=cache, logits_positions=rows)
    expected = torch.stack([forward(params, cfg, s[None])[0, -1] for s in seqs])
    assert logits.shape == (2, 256)
    assert_close(logits, expected, atol=1e-4)


def test_padding_slot_is_skipped(model):
    # a negative slot must not write anywhere
    from astrai.ops.kv_store import kv_store_

    k_cache, v_cache = torch.zeros(8, 2, 4), torch.zeros(8, 2, 4)
    k, v = torch.ones(2, 2, 4), torch.ones(2, 2, 4) * 2
    kv_store_(k_cache, v_cache, k, v, torch.tensor([5, -1]))
    assert k_cache[5].eq(1).all() and v_cache[5].eq(2).all()
    assert k_cache.sum() == 8 and v_cache.sum() == 16
