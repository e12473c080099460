"""`Model`: the (config, params, tokenizer) bundle behind `astrai.load` / `astrai.save`.

A plain frozen holder, not a pytree: the params tree is what compiled steps take; the bundle is what users
pass around in notebooks and CLIs.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import torch

from astrai.io.checkpoint import CheckpointError, atomic_dir, read_config, read_json, save_params, write_json
from astrai.io.tokenizer import Tokenizer
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, check_params
from astrai.tree import count, nbytes


@attrs.frozen(eq=False)
class Model:
    """A loaded language model.

    Attributes:
        config: static hyperparameters.
        params: the parameter tree (plain tensors).
        tokenizer: the tokenizer, or None when the folder has no tokenizer.json.
        eos_token_ids: ids that end generation (generation_config.json, config.json, tokenizer).
    """

    config: ModelConfig
    params: DecoderParams
    tokenizer: Tokenizer | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def device(self) -> torch.device:
        """Device of the parameters."""
        return self.params.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the parameters."""
        return self.params.embed_tokens.weight.dtype

    @property
    def num_parameters(self) -> int:
        """Total parameter count (tied embeddings counted once)."""
        return count(self.params)

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
        dtype = str(self.dtype).removeprefix("torch.")
        tokenizer = "yes" if self.tokenizer is not None else "no"
        return (f"Model({family}, {cfg.num_hidden_layers} layers, {size} parameters, {dtype}, {self.device}, "
                f"{memory}, tokenizer={tokenizer})")  # fmt: skip


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


def resolve_device(device: torch.device | str | None) -> torch.device | str | None:
    """`device`, with "auto" resolved: CUDA when torch sees a GPU, else CPU (None stays None: the CPU default)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device


def load(path: str | Path, dtype: torch.dtype | str | None = None, device: torch.device | str | None = None) -> Model:
    """Load a HF-format folder (config.json + safetensors [+ tokenizer files]).

    Args:
        path: the model folder.
        dtype: parameter dtype (torch dtype or name such as "bfloat16"); default: the checkpoint's.
        device: where to put the parameters; default CPU; "auto": CUDA when available, else CPU.

    Raises:
        CheckpointError: the folder is missing, unsupported, incomplete or corrupt (the message says which).
    """
    from astrai.io.checkpoint import load_params
    from astrai.models.config import DTYPES

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such model folder")
    cfg = read_config(folder)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype]
    params = load_params(folder, cfg, dtype=dtype, device=resolve_device(device))
    if dtype is not None:
        cfg = attrs.evolve(cfg, dtype=next(name for name, d in DTYPES.items() if d == dtype))
    tokenizer = Tokenizer.from_dir(folder) if (folder / "tokenizer.json").is_file() else None
    return Model(config=cfg, params=params, tokenizer=tokenizer, eos_token_ids=_eos_ids(folder, cfg, tokenizer))


def save(model: Model, out_dir: str | Path) -> Path:
    """Write `model` as a HF-format folder that both `astrai.load` and transformers load; atomic.

    Returns:
        The absolute output path.
    """
    check_params(model.params, model.config)

    def write(tmp: Path) -> None:
        save_params(tmp, model.config, model.params)
        cfg = model.config
        gen = {"bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id}
        eos = list(model.eos_token_ids or cfg.eos_token_id)
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        write_json(tmp / "generation_config.json", {k: v for k, v in gen.items() if v is not None})
        if model.tokenizer is not None:
            model.tokenizer.save(tmp)

    return atomic_dir(out_dir, write)
