"""`torch.compile(fullgraph=True)` of the decode and prefill steps runs on CPU and matches eager."""

import pytest
import torch

from astrai.inference.cache import init_kv_cache, make_attn_meta
from astrai.inference.step import compile_step, decode_step, prefill_step
from astrai.io.model import load
from helpers import assert_close, save_hf, tiny_hf_model


@pytest.mark.slow  # 26 s on 2 cores; in CI, test_compiled_prefill and test_engine's compiled decode cover both steps
def test_compiled_steps_match_eager(tmp_path):
    model = load(save_hf(tiny_hf_model("qwen3", head_dim=16), tmp_path))
    cfg, params = model.config, model.params
    page_size, lengths = 4, [5, 9]
    pages = [[1, 2, 3], [4, 5, 6]]
    prompts = torch.randint(0, 256, (sum(lengths),))

    def run(prefill, decode):
        cache = init_kv_cache(cfg, 7, page_size, dtype=model.dtype, device="cpu")
        meta = make_attn_meta(pages, [0, 0], lengths, page_size=page_size, device="cpu")
        first = prefill(params, prompts, meta, cache, meta.cu_seqlens_q[1:].long() - 1)
        outs = [first]
        tokens = first.argmax(-1)
        for step in range(3):
            cached = [n + step for n in lengths]
            meta = make_attn_meta(pages, cached, [1, 1], page_size=page_size, device="cpu", decode=True)
            logits = decode(params, tokens, meta, cache)
            outs.append(logits)
            tokens = logits.argmax(-1)
        return torch.stack(outs), cache

    eager, eager_cache = run(lambda *a: prefill_step(*a, cfg=cfg), lambda *a: decode_step(*a, cfg=cfg))
    compiled, compiled_cache = run(compile_step(prefill_step, cfg=cfg), compile_step(decode_step, cfg=cfg))
    assert_close(compiled, eager, atol=1e-4)
    # the in-place KV writes happened in the compiled run too
    assert_close(compiled_cache.k[1], eager_cache.k[1], atol=1e-5)
