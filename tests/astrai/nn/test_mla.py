"""MLA layer: dense form against transformers' DeepseekV3/V2Attention; absorbed paged form against the dense form."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from astrai.inference.cache import make_attn_meta
from astrai.nn.mla import MLAConfig, init_mla, init_mla_cache, mla, mla_dense, mla_softmax_scale
from astrai.nn.rope import RopeConfig, rope_cos_sin
from astrai.ops.attention import pages_needed
from astrai.ops.mla import mla_extend_ref, mla_paged_attention
from astrai.tree import from_named_tensors, named_tensors
from astrai.triton_kernels.mla_decode import mla_decode_ref
from helpers import assert_close

E, H, RQ, R, DN, DR, DV, MAX_POS = 32, 4, 24, 32, 16, 8, 12, 128
YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
    beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8,
)  # fmt: skip
DEFAULT = dict(rope_type="default", rope_theta=10000.0)


def _rope(params: dict, interleaved: bool) -> RopeConfig:
    kw = {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    return RopeConfig(rope_type=params["rope_type"], theta=params["rope_theta"], interleaved=interleaved, **kw)


def _cfg(q_lora_rank: int | None, interleaved: bool = True) -> MLAConfig:
    return MLAConfig(
        num_heads=H, q_lora_rank=q_lora_rank, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR,
        v_head_dim=DV, interleaved_rope=interleaved,
    )  # fmt: skip


def _hf_attention(version: int, q_lora_rank: int | None, rope_params: dict, interleave: bool, bias: bool):
    """A standalone transformers DeepSeek attention layer with perturbed norms and biases, plus its rotary module."""
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    kw = dict(
        vocab_size=64, hidden_size=E, intermediate_size=48, num_hidden_layers=1, num_attention_heads=H,
        num_key_value_heads=H, q_lora_rank=q_lora_rank, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR,
        v_head_dim=DV, max_position_embeddings=MAX_POS, attention_bias=bias, rope_parameters=dict(rope_params),
    )  # fmt: skip
    if version == 3:
        config = transformers.DeepseekV3Config(rope_interleave=interleave, **kw)
        attn_cls, rot_cls = v3.DeepseekV3Attention, v3.DeepseekV3RotaryEmbedding
    else:
        config = transformers.DeepseekV2Config(**kw)
        attn_cls, rot_cls = v2.DeepseekV2Attention, v2.DeepseekV2RotaryEmbedding
    config._attn_implementation = "eager"
    attn = attn_cls(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return attn, rot_cls(config)


def _params_from_hf(attn, cfg: MLAConfig, bias: bool):
    template = init_mla(E, cfg, attention_bias=bias)
    state = {k: v.detach().clone() for k, v in attn.state_dict().items()}
    assert set(state) == set(named_tensors(template)), "tree names must equal HF names"
    return from_named_tensors(template, state)


CASES = [  # (version, q_lora_rank, rope, interleave, bias)
    (3, RQ, YARN, True, False),
    (3, None, YARN, False, False),
    (3, None, DEFAULT, True, True),
    (3, RQ, DEFAULT, False, True),
    (2, RQ, YARN, True, False),
    (2, None, DEFAULT, True, False),
]


@pytest.mark.parametrize(("version", "q_lora_rank", "rope_params", "interleave", "bias"), CASES)
def test_dense_matches_transformers(version, q_lora_rank, rope_params, interleave, bias) -> None:
    attn, rotary = _hf_attention(version, q_lora_rank, rope_params, interleave, bias)
    cfg, rope = _cfg(q_lora_rank, interleave), _rope(rope_params, interleave)
    params = _params_from_hf(attn, cfg, bias)
    batch, seq = 2, 40  # past original_max_position_embeddings (32): the yarn ramp matters
    x = torch.randn(batch, seq, E)
    position_ids = torch.arange(seq)[None].expand(batch, -1)
    cos, sin = rope_cos_sin(position_ids.reshape(-1), rope=rope, head_dim=DR, max_position_embeddings=MAX_POS)

    # our tables equal the ones transformers feeds its layer (cos/sin halves, or the complex freqs_cis for V2)
    hf_pos = rotary(x, position_ids)
    if version == 3:
        hf_cos, hf_sin = (t[..., : DR // 2].reshape(-1, DR // 2) for t in hf_pos)
    else:
        hf_cos, hf_sin = hf_pos.real.reshape(-1, DR // 2), hf_pos.imag.reshape(-1, DR // 2)
    assert_close(cos, hf_cos, atol=1e-6)
    assert_close(sin, hf_sin, atol=1e-6)
    assert mla_softmax_scale(cfg, rope) == pytest.approx(attn.scaling, rel=1e-12)
    if rope_params is YARN:
        assert attn.scaling != pytest.approx(cfg.qk_head_dim**-0.5)  # the mscale^2 factor is really exercised

    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]  # additive causal mask
    with torch.no_grad():
        if version == 3:
            expected = attn(x, position_embeddings=hf_pos, attention_mask=mask)[0]
        else:
            expected = attn(x, attention_mask=mask, position_embeddings=hf_pos)[0]
    out = mla_dense(params, x, cos, sin, cfg=cfg, scale=mla_softmax_scale(cfg, rope))
    assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert_close(mla(params, x, cos, sin, cfg=cfg, scale=attn.scaling), expected, atol=1e-5, rtol=1e-5)


def test_dense_doc_ids_isolate_documents() -> None:
    cfg = _cfg(RQ)
    params = init_mla(E, cfg, generator=torch.Generator().manual_seed(1), std=0.2)
    x = torch.randn(1, 9, E)
    cos, sin = rope_cos_sin(torch.arange(9), rope=RopeConfig(interleaved=True), head_dim=DR, max_position_embeddings=64)
    doc_ids = torch.tensor([[0] * 4 + [1] * 5])
    out = mla_dense(params, x, cos, sin, cfg=cfg, scale=0.2, doc_ids=doc_ids)
    first = mla_dense(params, x[:, :4], cos[:4], sin[:4], cfg=cfg, scale=0.2)
    assert_close(out[:, :4], first, atol=1e-6)
    # the second document's tokens see only themselves: perturbing the first document leaves them unchanged
    x2 = x.clone()
    x2[:, :4] += 1.0
    assert_close(mla_dense(params, x2, cos, sin, cfg=cfg, scale=0.2, doc_ids=doc_ids)[:, 4:], out[:, 4:], atol=1e-6)


def _step(params, cfg, x_rows: list[Tensor], cache, pages, cached, *, page_size, rope, decode) -> list[Tensor]:
    """One paged step over requests whose new tokens are x_rows[b] ([n_b, E]); returns per-request outputs."""
    new = [len(r) for r in x_rows]
    meta = make_attn_meta(pages, cached, new, page_size=page_size, device="cpu", decode=decode)
    cos, sin = rope_cos_sin(meta.positions, rope=rope, head_dim=DR, max_position_embeddings=MAX_POS)
    out = mla(params, torch.cat(x_rows), cos, sin, cfg=cfg, scale=mla_softmax_scale(cfg, rope), meta=meta, cache=cache)
    return list(out.split(new))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("q_lora_rank", "page_size"), [(RQ, 4), (None, 1), (RQ, 16)])
def test_paged_prefill_then_decode_matches_dense(backend, q_lora_rank, page_size, monkeypatch) -> None:
    monkeypatch.setenv("ASTRAI_ATTN_BACKEND", backend)  # triton: decode steps run the mla_decode kernel
    cfg, rope = _cfg(q_lora_rank), _rope(YARN, True)
    params = init_mla(E, cfg, attention_bias=True, std=0.2, generator=torch.Generator().manual_seed(2))
    lengths, prompts, chunks = [10, 7], [3, 5], [2, 1]  # prefill, an extend chunk over a prefix, then decode
    xs = [torch.randn(n, E) for n in lengths]
    expected = []
    for x in xs:
        cos, sin = rope_cos_sin(torch.arange(len(x)), rope=rope, head_dim=DR, max_position_embeddings=MAX_POS)
        expected.append(mla_dense(params, x[None], cos, sin, cfg=cfg, scale=mla_softmax_scale(cfg, rope))[0])
    need = [pages_needed(n, page_size) for n in lengths]
    num_pages = sum(need) + 2
    (cache,) = init_mla_cache(cfg, 1, num_pages * page_size, dtype=torch.float32, device="cpu")
    perm = torch.randperm(num_pages - 1) + 1  # page 0 is the null page; pages are non-contiguous per request
    pages = [perm[: need[0]].tolist(), perm[need[0] : need[0] + need[1]].tolist()]
    got: list[list[Tensor]] = [[], []]
    cached = [0, 0]
    kw = dict(page_size=page_size, rope=rope)
    for sizes in (prompts, chunks):
        rows = [xs[b][cached[b] : cached[b] + sizes[b]] for b in range(2)]
        for b, o in enumerate(_step(params, cfg, rows, cache, pages, cached, decode=False, **kw)):
            got[b].append(o)
        cached = [c + s for c, s in zip(cached, sizes, strict=True)]
    while any(c < n for c, n in zip(cached, lengths, strict=True)):
        live = [b for b in range(2) if cached[b] < lengths[b]]  # finished requests leave the batch
        rows = [xs[b][cached[b] : cached[b] + 1] for b in live]
        outs = _step(params, cfg, rows, cache, [pages[b] for b in live], [cached[b] for b in live], decode=True, **kw)
        for b, o in zip(live, outs, strict=True):
            got[b].append(o)
            cached[b] += 1
    for b in range(2):
        assert_close(torch.cat(got[b]), expected[b], atol=1e-5, rtol=1e-5, msg=f"request {b}")


def test_cache_holds_only_latent_and_rope_key() -> None:
    cfg = _cfg(RQ)
    assert cfg.latent_dim == R + DR
    caches = init_mla_cache(cfg, 3, 64, dtype=torch.bfloat16, device="cpu")
    assert len(caches) == 3
    for c in caches:
        assert c.shape == (64, R + DR) and c.numel() * c.element_size() == 64 * (R + DR) * 2
    # the stored row of a token is exactly [RMSNorm(c_kv) ; rope(k_pe)], computed here independently
    params = init_mla(E, cfg, std=0.2, generator=torch.Generator().manual_seed(3))
    rope = RopeConfig(interleaved=True)
    x = torch.randn(5, E)
    meta = make_attn_meta([[2, 3]], [0], [5], page_size=4, device="cpu")
    cos, sin = rope_cos_sin(meta.positions, rope=rope, head_dim=DR, max_position_embeddings=MAX_POS)
    cache = torch.zeros(16, R + DR)
    mla(params, x, cos, sin, cfg=cfg, scale=0.3, meta=meta, cache=cache)
    lat = x @ params.kv_a_proj_with_mqa.weight.T
    c_kv = lat[:, :R] / lat[:, :R].pow(2).mean(-1, keepdim=True).add(cfg.norm_eps).sqrt()
    c_kv = c_kv * params.kv_a_layernorm.weight
    pe = lat[:, R:].view(5, DR // 2, 2)
    k_pe = torch.stack([pe[..., 0] * cos - pe[..., 1] * sin, pe[..., 1] * cos + pe[..., 0] * sin], -1).view(5, DR)
    assert_close(cache[meta.slot_mapping], torch.cat([c_kv, k_pe], -1), atol=1e-5)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[meta.slot_mapping] = False
    assert not cache[untouched].any()


def test_store_skips_padding_rows() -> None:
    cfg = _cfg(None)
    params = init_mla(E, cfg, std=0.2)
    meta = make_attn_meta([[1]], [0], [3], page_size=4, device="cpu")
    slots = meta.slot_mapping.clone()
    slots[1] = -1
    cache = torch.zeros(8, R + DR)
    cos, sin = rope_cos_sin(meta.positions, rope=RopeConfig(interleaved=True), head_dim=DR, max_position_embeddings=64)
    from astrai.tree import replace

    mla(params, torch.randn(3, E), cos, sin, cfg=cfg, scale=0.3, meta=replace(meta, slot_mapping=slots), cache=cache)
    assert cache[4].any() and cache[6].any() and not cache[5].any()


def _pool(lens: list[int], new: list[int], page_size: int, width: int):
    num_pages = sum(pages_needed(n, page_size) for n in lens) + 3
    perm = (torch.randperm(num_pages - 1) + 1).tolist()
    pages, at = [], 0
    for n in lens:
        k = max(1, pages_needed(n, page_size))
        pages.append(perm[at : at + k])
        at += k
    meta = make_attn_meta(pages, [n - m for n, m in zip(lens, new, strict=True)], new, page_size=page_size,
                          device="cpu", decode=all(m == 1 for m in new))  # fmt: skip
    cache = torch.randn(num_pages * page_size, width)
    return meta, cache


def _latent_oracle(q: Tensor, cache: Tensor, meta, rows, page_size: int, scale: float) -> Tensor:
    """Independent formulation: token by token, gather its visible latents and softmax by hand.

    rows: (request, absolute position) of each new token, in order.
    """
    out = torch.zeros(*q.shape[:2], R)
    for t, (b, p) in enumerate(rows):
        slots = [int(meta.block_table[b, j // page_size]) * page_size + j % page_size for j in range(p + 1)]
        ent = cache[slots]  # [p+1, R + Dr]
        out[t] = torch.softmax(q[t] @ ent.T * scale, dim=-1) @ ent[:, :R]  # [H, R]
    return out


def _rows(lens: list[int], new: list[int]) -> list[tuple[int, int]]:
    return [(b, p) for b, (n, m) in enumerate(zip(lens, new, strict=True)) for p in range(n - m, n)]


@pytest.mark.parametrize("page_size", [1, 4])
def test_torch_paged_paths_match_oracle(page_size: int) -> None:
    lens, new = [9, 4, 13], [3, 4, 1]  # ragged extend: prefix + new, fresh, one token
    meta, cache = _pool(lens, new, page_size, R + DR)
    q = torch.randn(8, H, R + DR)
    kw = dict(kv_lora_rank=R, scale=0.2)
    expected = _latent_oracle(q, cache, meta, _rows(lens, new), page_size, 0.2)
    assert_close(mla_paged_attention(q, cache, meta, **kw), expected, atol=1e-5)
    # decode: both references and the dispatched torch path match the oracle
    lens, new = [9, 1, 13], [1, 1, 1]
    meta, cache = _pool(lens, new, page_size, R + DR)
    q = torch.randn(3, H, R + DR)
    expected = _latent_oracle(q, cache, meta, _rows(lens, new), page_size, 0.2)
    ref = mla_decode_ref(q, cache, meta.block_table, meta.seq_lens, page_size=page_size, **kw)
    ext = mla_extend_ref(q, cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_table, page_size=page_size, **kw)
    assert_close(ref, expected, atol=1e-5)
    assert_close(ext, expected, atol=1e-5)
    assert_close(mla_paged_attention(q, cache, meta, **kw), expected, atol=1e-5)


def test_extend_ref_against_explicit_softmax() -> None:
    page_size = 2
    meta, cache = _pool([5, 3], [2, 3], page_size, R + DR)
    q = torch.randn(5, H, R + DR)
    out = mla_extend_ref(q, cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_table, kv_lora_rank=R,
                         page_size=page_size, scale=0.5)  # fmt: skip
    rows = [(0, 3), (0, 4), (1, 0), (1, 1), (1, 2)]  # (request, absolute position) of each new token
    assert_close(out, _latent_oracle(q, cache, meta, rows, page_size, 0.5), atol=1e-5)


def test_paged_decode_compiles_fullgraph() -> None:
    cfg, rope = _cfg(RQ), RopeConfig(interleaved=True)
    params = init_mla(E, cfg, std=0.2)
    meta = make_attn_meta([[1, 2], [3]], [5, 2], [1, 1], page_size=4, device="cpu", decode=True)
    cos, sin = rope_cos_sin(meta.positions, rope=rope, head_dim=DR, max_position_embeddings=MAX_POS)
    x = torch.randn(2, E)
    cache = torch.randn(16, R + DR)
    cache2 = cache.clone()

    def step(x, cache):
        return mla(params, x, cos, sin, cfg=cfg, scale=0.3, meta=meta, cache=cache)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    before = cache.clone()
    assert_close(compiled(x, cache), step(x, cache2), atol=1e-5)
    assert_close(cache, cache2, atol=1e-6)  # the in-place store happened in both
    assert not torch.equal(cache, before)
