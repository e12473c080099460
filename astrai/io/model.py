"""`Model`: the (config, params, tokenizer) bundle behind `astrai.load` / `astrai.save`.

A plain frozen holder, not a pytree: the params tree is what compiled steps take; the bundle is what users
pass around in notebooks and CLIs.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import torch

from astrai.io.checkpoint import CheckpointError, atomic_dir, read_config, read_json, save_params, write_json
from astrai.io.hub import resolve_model
from astrai.io.tokenizer import Tokenizer
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, check_params
from astrai.models.quantize import check_quantize, is_quantized, quantize_params
from astrai.tree import count, named_tensors, nbytes


@attrs.frozen(eq=False)
class Model:
    """A loaded language model.

    Attributes:
        config: static hyperparameters.
        params: the parameter tree (plain tensors).
        tokenizer: the tokenizer, or None when the folder has no tokenizer.json.
        eos_token_ids: ids that end generation (generation_config.json, config.json, tokenizer).
        generation_defaults: the sampling defaults of the folder's generation_config.json, by SamplingParams
            name (`read_generation_defaults`); the server applies them to requests that leave a field unset.
    """

    config: ModelConfig
    params: DecoderParams
    tokenizer: Tokenizer | None = None
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: dict[str, Any] = attrs.field(factory=dict)

    @property
    def device(self) -> torch.device:
        """Device of the parameters."""
        return self.params.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the parameters (of activations and the KV cache; an int8-quantized model's weights are int8)."""
        return self.params.norm.weight.dtype

    @property
    def quantization(self) -> str | None:
        """`"int8"` when the weights are int8 weight-only quantized (`load(..., quantize="int8")`), else None."""
        return "int8" if is_quantized(self.params) else None

    @property
    def num_parameters(self) -> int:
        """Total parameter count (tied embeddings counted once; quantization scales are not parameters)."""
        return count(self.params) - sum(t.numel() for n, t in named_tensors(self.params).items() if _is_scale(n))

    @property
    def nbytes(self) -> int:
        """Bytes held by the parameters."""
        return nbytes(self.params)

    def __repr__(self) -> str:
        """One line (family, size, dtype, device, tokenizer): the default attrs repr printed every tensor."""
        cfg = self.config
        family = getattr(cfg, "model_type", None) or type(cfg).__name__
        size = _human(self.num_parameters, 1000, ["", "K", "M", "B"])
        memory = _human(self.nbytes, 1024, [" B", " KiB", " MiB", " GiB"])
        dtype = str(self.dtype).removeprefix("torch.") + (f", {self.quantization} weights" if self.quantization else "")
        tokenizer = "yes" if self.tokenizer is not None else "no"
        return (f"Model({family}, {cfg.num_hidden_layers} layers, {size} parameters, {dtype}, {self.device}, "
                f"{memory}, tokenizer={tokenizer})")  # fmt: skip


def _is_scale(name: str) -> bool:
    return name.endswith("scale")


def _human(n: int, base: int, units: list[str]) -> str:
    """`n` in the largest unit it reaches, one decimal past the first (1234567, 1000, ["", "K", "M"] -> "1.2M")."""
    value, i = float(n), 0
    while value >= base and i + 1 < len(units):
        value, i = value / base, i + 1
    return f"{value:.1f}{units[i]}" if i else f"{n}{units[0]}"


def _eos_ids(folder: Path, cfg: ModelConfig, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    if tokenizer is not None:
        return tokenizer.eos_token_ids
    ids: list[int] = []
    gen = folder / "generation_config.json"
    if gen.is_file():
        value = read_json(gen).get("eos_token_id")
        ids += [value] if isinstance(value, int) else list(value or [])
    ids += list(cfg.eos_token_id)
    return tuple(dict.fromkeys(ids))


# generation_config.json key -> (SamplingParams name, type, lowest value); the keys vLLM takes from the file
_GENERATION_KEYS = {"temperature": ("temperature", float, 0.0), "top_p": ("top_p", float, 0.0),
                    "top_k": ("top_k", int, -1), "min_p": ("min_p", float, 0.0),
                    "repetition_penalty": ("repetition_penalty", float, 0.0),
                    "max_new_tokens": ("max_tokens", int, 1)}  # fmt: skip


def read_generation_defaults(folder: str | Path) -> dict[str, Any]:
    """Sampling defaults from `folder/generation_config.json`, keyed by SamplingParams field names.

    The keys vLLM applies (`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`, and `max_new_tokens`
    as `max_tokens`); absent or null keys are left out, and a folder without the file gives `{}`. As in vLLM,
    `do_sample` is not consulted: a file with `temperature: 0.6` samples at 0.6 even when `do_sample` is false.

    Raises:
        CheckpointError: the file is not a JSON object, or one of those keys holds a value of the wrong type,
            a non-finite number or one below its range (the message names the file and key).
    """
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}
    data, out = read_json(path), {}
    for key, (name, kind, lowest) in _GENERATION_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        ok_type = isinstance(value, int) if kind is int else isinstance(value, int | float)
        if isinstance(value, bool) or not ok_type or not math.isfinite(value) or value < lowest:
            raise CheckpointError(f"{path}: {key} must be {'an integer' if kind is int else 'a finite number'} >= "
                                  f"{lowest}, got {value!r}")  # fmt: skip
        out[name] = kind(value)
    return out


def resolve_device(device: torch.device | str | None) -> torch.device | str | None:
    """`device`, with "auto" resolved: CUDA when torch sees a GPU, else CPU (None stays None: the CPU default)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device


def load(path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None, *,
         revision: str | None = None, quantize: str | None = None) -> Model:  # fmt: skip
    """Load a HF-format folder (config.json + safetensors [+ tokenizer files]), or a model id from the HF cache.

    Args:
        path: the model folder, or a Hugging Face model id (`Qwen/Qwen3-0.6B`) already in the local Hugging Face
            cache (`astrai.io.hub.resolve_model`: no network access, a message saying how to download it).
        dtype: parameter dtype (torch dtype or name such as "bfloat16"); default: the checkpoint's.
        device: where to put the parameters; default CPU; "auto": CUDA when available, else CPU.
        revision: branch, tag or commit of a model id (default `main`).
        quantize: `"int8"`: int8 weight-only quantization of the projections, embedding and LM head, one scale
            per output row (`astrai.models.quantize`); activations and the KV cache stay in `dtype`.

    Raises:
        CheckpointError: the folder is missing, unsupported, incomplete or corrupt (the message says which).
        ValueError: an unknown `dtype` or `quantize` value.
    """
    from astrai.io.checkpoint import load_params
    from astrai.models.config import DTYPES

    check_quantize(quantize)
    folder = resolve_model(path, revision)
    cfg = read_config(folder)
    defaults = read_generation_defaults(folder)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    params = load_params(folder, cfg, dtype=dtype, device=resolve_device(device))
    if quantize is not None:
        params = quantize_params(params, quantize)
    if dtype is not None:
        cfg = attrs.evolve(cfg, dtype=next(name for name, d in DTYPES.items() if d == dtype))
    tokenizer = Tokenizer.from_dir(folder) if (folder / "tokenizer.json").is_file() else None
    return Model(config=cfg, params=params, tokenizer=tokenizer, eos_token_ids=_eos_ids(folder, cfg, tokenizer),
                 generation_defaults=defaults)  # fmt: skip


def save(model: Model, out_dir: str | Path) -> Path:
    """Write `model` as a HF-format folder that both `astrai.load` and transformers load; atomic.

    Returns:
        The absolute output path.

    Raises:
        ValueError: the model is int8-quantized (an inference-only form; save the float model instead).
    """
    if model.quantization is not None:
        raise ValueError(f"this model's weights are {model.quantization}-quantized, an inference-only form: save "
                         "the model loaded without quantize (or dequantize_params of this one)")  # fmt: skip
    check_params(model.params, model.config)

    def write(tmp: Path) -> None:
        save_params(tmp, model.config, model.params)
        cfg = model.config
        gen = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id}
        eos = list(model.eos_token_ids or cfg.eos_token_id)
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        hf_names = {name: key for key, (name, _, _) in _GENERATION_KEYS.items()}
        gen.update({hf_names[k]: v for k, v in model.generation_defaults.items() if k in hf_names})
        write_json(tmp / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
        if model.tokenizer is not None:
            model.tokenizer.save(tmp)

    return atomic_dir(out_dir, write)
