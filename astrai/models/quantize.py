"""int8 weight-only quantization of a decoder's parameter tree (`astrai.load(path, quantize="int8")`).

Every projection's weight becomes int8 with one fp scale per output row (`astrai.ops.quant`); activations,
norms, biases and the KV cache keep the model's dtype. The quantized tree is an ordinary parameter tree: the
same `forward`, engine and compiled steps run it, because `linear()` and `embed()` read the `scale` leaf
beside an int8 weight. Decode streams a quarter of fp32's weight bytes (half of bf16's); on a 2-core CPU a single
stream decodes 1.5-2.4x as fast as astrai's compiled fp32 (9 scripted runs of `benchmarks/bench_quant.py`), while
batched steps of 16-32 rows run 0.8-1.06x the fp32 step's speed (4 runs; docs/benchmarks.md).

What stays in the model's dtype, and why:
- RMSNorm weights and biases: tiny, and precision there matters more than bytes.
- The MoE router (`gate`) and the shared-expert gate: routing decisions flip on small logit changes.
- MLA's `kv_b_proj`: decode multiplies its per-head slices into the query and output ("absorbed" MLA), which
  reads the weight tensor directly rather than through `linear()`.
- The embedding and LM head when `embeddings=False` (a tied head shares the embedding's int8 table).

A quantized tree is for inference: training, LoRA and `astrai.save` refuse it (dequantize or reload instead).
"""

from __future__ import annotations

from typing import Any

import attrs
from torch import Tensor

from astrai.models.decoder import DecoderParams
from astrai.nn.embedding import EmbeddingParams
from astrai.nn.linear import LinearParams, LoRALinearParams
from astrai.nn.moe import ExpertsParams
from astrai.ops.quant import dequantize_int8, quantize_int8
from astrai.tree import replace

QUANTIZE_MODES = ("int8",)

# attribute names of projections that stay in the model's dtype (module docstring)
_KEPT = frozenset({"gate", "shared_expert_gate", "kv_b_proj"})


def check_quantize(mode: str | None) -> None:
    """Raise ValueError naming the accepted values unless `mode` is None or one of `QUANTIZE_MODES`."""
    if mode is not None and mode not in QUANTIZE_MODES:
        raise ValueError(f"quantize must be one of {list(QUANTIZE_MODES)} (or None), got {mode!r}")


def quantize_params(params: DecoderParams, mode: str = "int8", *, embeddings: bool = True) -> DecoderParams:
    """A copy of `params` with its projections quantized (int8 weight-only, per output row).

    Args:
        params: a float parameter tree (not LoRA, not already quantized).
        mode: `"int8"`, the one mode there is.
        embeddings: also quantize the token embedding and the LM head (on by default: on a small model they are
            a large share of the bytes, e.g. 21% of SmolLM2-135M's).

    Raises:
        ValueError: an unknown mode, a LoRA tree, an already quantized tree, or a weight holding NaN/inf.
    """
    check_quantize(mode)
    if is_quantized(params):
        raise ValueError("the parameters are already quantized")
    kept = _KEPT if embeddings else _KEPT | {"lm_head"}

    def walk(node: Any, name: str) -> Any:
        if isinstance(node, LoRALinearParams):
            raise ValueError("LoRA adapters are attached: merge them into the weights before quantizing")
        if isinstance(node, LinearParams):
            if name in kept:
                return node
            q, scale = quantize_int8(node.weight)
            return replace(node, weight=q, scale=scale)
        if isinstance(node, EmbeddingParams):
            if not embeddings:
                return node
            q, scale = quantize_int8(node.weight)
            return replace(node, weight=q, scale=scale)
        if isinstance(node, ExpertsParams):
            (gq, gs), (uq, us), (dq, ds) = (quantize_int8(t) for t in (node.gate_proj, node.up_proj, node.down_proj))
            return replace(node, gate_proj=gq, up_proj=uq, down_proj=dq, gate_scale=gs, up_scale=us, down_scale=ds)
        if isinstance(node, tuple):
            return tuple(walk(item, name) for item in node)
        if attrs.has(type(node)):
            return replace(node, **{f.name: walk(getattr(node, f.name), f.name) for f in attrs.fields(type(node))})
        return node

    return walk(params, "")


def dequantize_params(params: DecoderParams) -> DecoderParams:
    """The float tree a quantized one stands for (int8 * scale in the scale's dtype); float trees come back as is."""

    def walk(node: Any) -> Any:
        if isinstance(node, LinearParams | EmbeddingParams) and node.scale is not None:
            return replace(node, weight=dequantize_int8(node.weight, node.scale), scale=None)
        if isinstance(node, ExpertsParams) and node.gate_scale is not None:
            stacks = zip((node.gate_proj, node.up_proj, node.down_proj), _expert_scales(node), strict=True)
            g, u, d = (dequantize_int8(q, s) for q, s in stacks)
            return replace(node, gate_proj=g, up_proj=u, down_proj=d, gate_scale=None, up_scale=None, down_scale=None)
        if isinstance(node, tuple):
            return tuple(walk(item) for item in node)
        if attrs.has(type(node)):
            return replace(node, **{f.name: walk(getattr(node, f.name)) for f in attrs.fields(type(node))})
        return node

    return walk(params)


def is_quantized(params: Any) -> bool:
    """True when any projection, embedding or expert stack of the tree holds int8 weights."""
    if isinstance(params, LinearParams | EmbeddingParams):
        return params.scale is not None
    if isinstance(params, ExpertsParams):
        return params.gate_scale is not None
    if isinstance(params, tuple):
        return any(is_quantized(item) for item in params)
    if attrs.has(type(params)):
        return any(is_quantized(getattr(params, f.name)) for f in attrs.fields(type(params)))
    return False


def _expert_scales(p: ExpertsParams) -> tuple[Tensor, Tensor, Tensor]:
    return p.gate_scale, p.up_scale, p.down_scale
