"""Multi-head Latent Attention (MLA, DeepSeek-V2/V3): dense causal form and the absorbed paged form.

Each token is compressed to a latent `c_kv = RMSNorm(x W_DKV)` [R] plus one shared rotary key `k_pe` [Dr].
Per head h, the keys and values are up-projections of the latent through `kv_b_proj` (W_UK [H, Dn, R] and
W_UV [H, Dv, R] interleaved per head in its rows):
    k_h = [W_UK_h c_kv ; k_pe],  v_h = W_UV_h c_kv,  q_h = [q_nope_h ; rope(q_pe_h)]
- `mla_dense` materialises k_h and v_h and runs causal SDPA, exactly as transformers' DeepseekV3Attention
  (training and parity tests).
- The paged form caches only [c_kv ; rope(k_pe)] per token (R + Dr elements per layer: 576 for DeepSeek-V3,
  one shared "head") and absorbs W_UK into the query, q_lat_h = W_UK_h^T q_nope_h [R], so the scores are
  q_lat_h . c_kv + q_pe_h . k_pe; the attention output stays in latent space and W_UV is applied after it.
  That is MQA with key [c_kv ; k_pe] and value c_kv over the latent pool; no per-head K/V is ever built.

Rope layout: DeepSeek checkpoints rotate interleaved pairs (transformers V2 always; V3 with
`rope_interleave=True`, whose kernel writes the rotated pairs de-interleaved: a permutation of q and k alike,
so scores are unchanged). The softmax scale is (Dn + Dr)^-0.5 times mscale(factor, mscale_all_dim)^2 under
yarn (`mla_softmax_scale`); the cos/sin tables carry the separate mscale/mscale_all_dim ratio (astrai.nn.rope).

Used by the decoder when `ModelConfig.attn_type == "mla"` (the engine allocates the pool with `init_mla_cache`).
Not here (see docs/mla.md): a Triton extend kernel (extend runs the torch path on every device), LoRA on kv_b_proj
(the absorbed form reads its base weight only).
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from astrai.nn.linear import LinearParams, init_linear, linear
from astrai.nn.norm import RMSNormParams, init_rms_norm, rms_norm
from astrai.nn.rope import RopeConfig, _yarn_mscale
from astrai.ops.attention import AttnMeta, dense_attention
from astrai.ops.mla import mla_paged_attention, mla_store_latent_
from astrai.ops.rotary import rotary
from astrai.tree import pytree

__all__ = [
    "MLAConfig",
    "MLAParams",
    "init_mla",
    "init_mla_cache",
    "mla",
    "mla_absorbed_weights",
    "mla_dense",
    "mla_paged",
    "mla_softmax_scale",
]


@attrs.frozen(kw_only=True)
class MLAConfig:
    """Static shape of one MLA layer (HF DeepseekV2/V3 config names)."""

    num_heads: int
    """H, query heads."""
    q_lora_rank: int | None
    """Rank of the query bottleneck (q_a_proj -> q_a_layernorm -> q_b_proj); None: one full-rank q_proj."""
    kv_lora_rank: int
    """R, width of the cached latent c_kv."""
    qk_nope_head_dim: int
    """Dn, per-head query/key dims without rotation."""
    qk_rope_head_dim: int
    """Dr, rotated dims: per head for q, one shared head for k."""
    v_head_dim: int
    """Dv, per-head value dims."""
    norm_eps: float = 1e-6
    """Epsilon of q_a_layernorm and kv_a_layernorm (transformers uses 1e-6 here whatever rms_norm_eps says)."""
    interleaved_rope: bool = True
    """Rotate adjacent pairs (DeepSeek checkpoints) rather than halves (V3 with rope_interleave=False)."""

    @property
    def qk_head_dim(self) -> int:
        """Dn + Dr, the per-head query/key width of the dense form."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """R + Dr, elements cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@pytree
@attrs.frozen(eq=False)
class MLAParams:
    """Projections of one MLA layer (HF DeepSeek names, so checkpoints map 1:1).

    Either `q_proj` (full rank) or the `q_a_proj`/`q_a_layernorm`/`q_b_proj` bottleneck is present.
    """

    kv_a_proj_with_mqa: LinearParams  # [R + Dr, E]
    kv_a_layernorm: RMSNormParams  # [R]
    kv_b_proj: LinearParams  # [H * (Dn + Dv), R], rows per head: Dn key rows then Dv value rows
    o_proj: LinearParams  # [E, H * Dv]
    q_proj: LinearParams | None = None  # [H * (Dn + Dr), E]
    q_a_proj: LinearParams | None = None  # [Rq, E]
    q_a_layernorm: RMSNormParams | None = None  # [Rq]
    q_b_proj: LinearParams | None = None  # [H * (Dn + Dr), Rq]


def init_mla(
    dim: int,
    cfg: MLAConfig,
    *,
    attention_bias: bool = False,
    std: float = 0.02,
    out_std: float | None = None,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> MLAParams:
    """Normal-initialised projections; `attention_bias` adds biases where HF does (q_a, kv_a, o)."""
    kw = dict(std=std, generator=generator, dtype=dtype)
    heads, q_out = cfg.num_heads, cfg.num_heads * cfg.qk_head_dim
    low_rank = cfg.q_lora_rank is not None
    return MLAParams(
        kv_a_proj_with_mqa=init_linear(dim, cfg.latent_dim, bias=attention_bias, **kw),
        kv_a_layernorm=init_rms_norm(cfg.kv_lora_rank, dtype=dtype),
        kv_b_proj=init_linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), **kw),
        o_proj=init_linear(
            heads * cfg.v_head_dim,
            dim,
            bias=attention_bias,
            std=std if out_std is None else out_std,
            generator=generator,
            dtype=dtype,
        ),  # fmt: skip
        q_proj=None if low_rank else init_linear(dim, q_out, **kw),
        q_a_proj=init_linear(dim, cfg.q_lora_rank, bias=attention_bias, **kw) if low_rank else None,
        q_a_layernorm=init_rms_norm(cfg.q_lora_rank, dtype=dtype) if low_rank else None,
        q_b_proj=init_linear(cfg.q_lora_rank, q_out, **kw) if low_rank else None,
    )


def mla_softmax_scale(cfg: MLAConfig, rope: RopeConfig) -> float:
    """(Dn + Dr)^-0.5, times mscale(factor, mscale_all_dim)^2 for scaled rope (transformers' yarn_apply_mscale)."""
    scale = cfg.qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        scale *= _yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def init_mla_cache(
    cfg: MLAConfig, num_layers: int, num_slots: int, *, dtype: torch.dtype, device: torch.device | str
) -> tuple[Tensor, ...]:
    """Zeroed latent pools, one [S, R + Dr] tensor per layer (slot layout as in astrai.inference.cache)."""
    return tuple(torch.zeros(num_slots, cfg.latent_dim, dtype=dtype, device=device) for _ in range(num_layers))


def _project(p: MLAParams, x: Tensor, cos: Tensor, sin: Tensor, cfg: MLAConfig) -> tuple[Tensor, ...]:
    """x [..., E] -> q_nope [N, H, Dn], rotated q_pe [N, H, Dr], c_kv [N, R], rotated k_pe [N, Dr] (N tokens)."""
    heads = cfg.num_heads
    if p.q_proj is not None:
        q = linear(p.q_proj, x)
    else:
        q = linear(p.q_b_proj, rms_norm(p.q_a_layernorm, linear(p.q_a_proj, x), eps=cfg.norm_eps))
    q = q.reshape(-1, heads, cfg.qk_head_dim)  # [N, H, Dn + Dr]
    q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
    ckv = linear(p.kv_a_proj_with_mqa, x).reshape(-1, cfg.latent_dim)  # [N, R + Dr]
    c_kv, k_pe = ckv.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    c_kv = rms_norm(p.kv_a_layernorm, c_kv, eps=cfg.norm_eps)
    # k_pe is one shared head: [N, 1, Dr] for the rotary op
    q_pe, k_pe = rotary(q_pe, k_pe[:, None, :], cos, sin, interleaved=cfg.interleaved_rope)
    return q_nope, q_pe, c_kv, k_pe[:, 0, :]


def mla_dense(
    p: MLAParams, x: Tensor, cos: Tensor, sin: Tensor, *, cfg: MLAConfig, scale: float, doc_ids: Tensor | None = None
) -> Tensor:
    """Causal MLA over full sequences with per-head K/V materialised (transformers' DeepseekV3Attention).

    Args:
        p: layer parameters.
        x: [B, T, E] activations.
        cos, sin: [B*T, Dr/2] float32 rotation tables of the tokens in row-major order.
        cfg: layer shape.
        scale: softmax scale (`mla_softmax_scale`).
        doc_ids: [B, T] document index per token (packed rows: no attention across documents).

    Returns:
        [B, T, E].
    """
    lead, heads = x.shape[:-1], cfg.num_heads
    q_nope, q_pe, c_kv, k_pe = _project(p, x, cos, sin, cfg)
    kv = linear(p.kv_b_proj, c_kv).view(-1, heads, cfg.qk_nope_head_dim + cfg.v_head_dim)  # [N, H, Dn + Dv]
    k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1)], dim=-1)  # [N, H, Dn + Dr]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [N, H, Dn + Dr]
    out = dense_attention(
        q.view(*lead, heads, cfg.qk_head_dim),
        k.view(*lead, heads, cfg.qk_head_dim),
        v.reshape(*lead, heads, cfg.v_head_dim),
        scale=scale,
        doc_ids=doc_ids,
    )  # [B, T, H, Dv]
    return linear(p.o_proj, out.reshape(*lead, heads * cfg.v_head_dim))


def mla_absorbed_weights(p: MLAParams, cfg: MLAConfig) -> tuple[Tensor, Tensor]:
    """(W_UK [H, Dn, R], W_UV [H, Dv, R]): views of kv_b_proj's weight split per head."""
    w = p.kv_b_proj.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]


def mla_paged(
    p: MLAParams, x: Tensor, cos: Tensor, sin: Tensor, cache: Tensor, meta: AttnMeta, *, cfg: MLAConfig, scale: float
) -> Tensor:
    """Absorbed MLA of a paged step: stores the new latents, attends in latent space, then up-projects.

    Args:
        p: layer parameters.
        x: [T, E] flattened new tokens of the batch (request-major, as AttnMeta).
        cos, sin: [T, Dr/2] float32 rotation tables of those tokens.
        cache: [S, R + Dr] latent pool of this layer, written in place.
        meta: paged-step metadata.
        cfg: layer shape.
        scale: softmax scale (`mla_softmax_scale`).

    Returns:
        [T, E].
    """
    q_nope, q_pe, c_kv, k_pe = _project(p, x, cos, sin, cfg)
    mla_store_latent_(cache, c_kv, k_pe, meta.slot_mapping)
    w_uk, w_uv = mla_absorbed_weights(p, cfg)
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk.to(q_nope.dtype))  # [T, H, R]
    q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1).to(cache.dtype)  # [T, H, R + Dr]
    o_lat = mla_paged_attention(q, cache, meta, kv_lora_rank=cfg.kv_lora_rank, scale=scale)  # [T, H, R]
    out = torch.einsum("thr,hvr->thv", o_lat.to(x.dtype), w_uv.to(x.dtype))  # [T, H, Dv]
    return linear(p.o_proj, out.reshape(-1, cfg.num_heads * cfg.v_head_dim))


def mla(
    p: MLAParams,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    cfg: MLAConfig,
    scale: float,
    meta: AttnMeta | None = None,
    cache: Tensor | None = None,
    doc_ids: Tensor | None = None,
) -> Tensor:
    """MLA with `astrai.nn.attention.attention`'s calling convention: dense without a cache, paged with one."""
    if cache is None:
        return mla_dense(p, x, cos, sin, cfg=cfg, scale=scale, doc_ids=doc_ids)
    if meta is None:
        raise ValueError("paged MLA needs AttnMeta together with the latent cache")
    return mla_paged(p, x, cos, sin, cache, meta, cfg=cfg, scale=scale)
