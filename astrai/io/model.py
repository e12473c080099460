"""`Model`: the (config, params, tokenizer) bundle behind `astrai.load` / `astrai.save`.

A plain frozen holder, not a pytree: the params tree is what compiled steps take; the bundle is what users
pass around in notebooks and CLIs.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import attrs
import torch

from astrai.io.checkpoint import (
    MODEL_FOLDER_ENTRIES,
    CheckpointError,
    atomic_dir,
    read_config,
    read_json,
    save_params,
    write_json,
)
from astrai.io.hub import resolve_model
from astrai.io.model_files import check_model_files
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


def _check_eos_ids(folder: Path, ids: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """`ids`, or a CheckpointError for a stop id the model can never produce (or a non-integer one).

    config.json's own ids are checked with the config; this catches generation_config.json's and the tokenizer's
    eos_token, which the engine would otherwise wait for forever.
    """
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise CheckpointError(f"{folder}: eos token id {i!r} (generation_config.json eos_token_id or the "
                                  f"tokenizer's eos_token) is outside the vocabulary [0, {vocab_size})")  # fmt: skip
    return ids


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


def resolve_device(device: torch.device | str | int | None) -> torch.device | str | int | None:
    """`device`, checked usable, with "auto" resolved: CUDA when torch sees a GPU, else CPU (None stays None).

    Checked before any weight is read, so a CPU-only torch asked for "cuda" fails with one clear line instead of
    torch's assertion from deep inside the load.

    Raises:
        ValueError: not a device name torch knows ("gpu"), or a device this torch build or machine lacks.
    """
    if device is None:
        return None
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {device!r} is not a device name torch knows (use 'cpu', 'cuda', 'cuda:N' or "
                         "'auto')") from None  # fmt: skip
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not count:
            raise ValueError(f"device {str(device)!r} requested but CUDA is not available (use 'cpu' or 'auto')")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"device {str(device)!r} requested but only {count} CUDA device(s) are visible")
    elif dev.type not in ("cpu", "meta"):
        try:  # mps, xpu, ...: whether this build and machine have it
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as err:
            raise ValueError(f"device {str(device)!r} is not available in this torch build or machine "
                             f"({str(err).split('. ')[0]}); use 'cpu' or 'auto'") from None  # fmt: skip
    return device


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # the CLI's (vLLM's) spellings


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """The parameter dtype `load` casts to, or None for the checkpoint's own.

    Accepts a torch dtype, a name (`"bfloat16"`, `"torch.float16"`), the CLI's spellings `"half"` / `"float"`, and
    `"auto"` (transformers' meaning: the checkpoint's dtype, as None).

    Raises:
        ValueError: anything else, e.g. torch.float64 or torch.int8 (the message lists the valid names).
    """
    from astrai.models.config import DTYPES

    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        name = _DTYPE_ALIASES.get(name, name)
        if name in DTYPES:
            return DTYPES[name]
    valid = sorted([*DTYPES, *_DTYPE_ALIASES, "auto"])
    raise ValueError(f"dtype must be one of {valid} (or the torch dtype of one), got {dtype!r}")


def load(path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None, *,
         revision: str | None = None, quantize: str | None = None,
         allow_outside_files: bool = False) -> Model:  # fmt: skip
    """Load a HF-format folder (config.json + safetensors [+ tokenizer files]), or a model id from the HF cache.

    Args:
        path: the model folder, or a Hugging Face model id (`Qwen/Qwen3-0.6B`) already in the local Hugging Face
            cache (`astrai.io.hub.resolve_model`: no network access, a message saying how to download it).
        dtype: parameter dtype: float32, bfloat16 or float16, as a torch dtype or a name ("bfloat16", and the
            CLI's "half" / "float"); None or "auto": the checkpoint's.
        device: where to put the parameters; default CPU; "auto": CUDA when available, else CPU; checked usable
            before anything is read (`resolve_device`).
        revision: branch, tag or commit of a model id (default `main`).
        quantize: `"int8"`: int8 weight-only quantization of the projections, embedding and LM head, one scale
            per output row (`astrai.models.quantize`); activations and the KV cache stay in `dtype`.
        allow_outside_files: read files that resolve outside the folder (symlinks, `../` shards); off by default
            (`astrai.io.model_files`); a Hugging Face cache snapshot's links into its repo's blobs are always fine.

    Raises:
        CheckpointError: the folder is missing, unsupported, incomplete or corrupt (the message says which):
            also a config.json value out of range (named), integer-typed or non-finite weights, or an eos id
            outside the vocabulary.
        ValueError: an unknown `dtype` or `quantize` value, or an unknown or unavailable `device`.
    """
    from astrai.io.checkpoint import load_params
    from astrai.models.config import DTYPES

    check_quantize(quantize)
    dtype, device = resolve_dtype(dtype), resolve_device(device)  # before reading anything
    folder = resolve_model(path, revision)
    check_model_files(folder, allow_outside_files)
    cfg = read_config(folder)
    defaults = read_generation_defaults(folder)
    params = load_params(folder, cfg, dtype=dtype, device=device)
    if quantize is not None:
        params = quantize_params(params, quantize)
    if dtype is not None:
        cfg = attrs.evolve(cfg, dtype=next(name for name, d in DTYPES.items() if d == dtype))
    # lexists: a dangling or unreadable tokenizer.json is an error (from_dir says which), not a model without one
    tokenizer = Tokenizer.from_dir(folder) if os.path.lexists(folder / "tokenizer.json") else None
    eos = _check_eos_ids(folder, _eos_ids(folder, cfg, tokenizer), cfg.vocab_size)
    return Model(config=cfg, params=params, tokenizer=tokenizer, eos_token_ids=eos, generation_defaults=defaults)


def save(model: Model, out_dir: str | Path) -> Path:
    """Write `model` as a HF-format folder that both `astrai.load` and transformers load; atomic.

    `out_dir` may be new, empty, or a previous model folder, which is replaced once the new one is complete. The
    save replaces the whole folder, so anything else is refused before a byte is written, naming what is in the
    way: a file, or a folder holding entries other than HF model files (config.json, generation_config.json,
    *.safetensors and their index, tokenizer and chat-template files: `astrai.io.checkpoint.MODEL_FOLDER_ENTRIES`)
    such as a README.md, source files or subfolders. No user file is ever deleted.

    Returns:
        The absolute output path.

    Raises:
        ValueError: the model is int8-quantized (an inference-only form; save the float model instead).
        FileExistsError: `out_dir` is a file, or a folder holding entries a model folder does not (named).
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

    return atomic_dir(out_dir, write, replaces=MODEL_FOLDER_ENTRIES, kind="model folder")
