"""Reading the JSON side files of a Hugging Face tokenizer folder (`Tokenizer.from_dir`'s helpers).

`tokenizer_config.json` / `special_tokens_map.json` store special tokens as strings or AddedToken dicts;
`generation_config.json` / `config.json` store the stop ids as one int or a list (multimodal checkpoints nest the
language model's under `text_config`). A missing file reads as `{}`; a corrupt one is a CheckpointError naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from astrai.io.errors import CheckpointError


def read_side_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when the file is absent. Raises CheckpointError naming a corrupt file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    except RecursionError:  # json's recursive parser on `[[[[...` thousands deep
        raise CheckpointError(f"{path}: JSON nested too deeply") from None
    except OSError as e:  # permissions, a directory
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(value).__name__}")
    return value


def token_str(value: Any) -> str | None:
    """A special-token entry as a string: configs store a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any) -> list[int]:
    """An id field as a list: configs store one int or a list of them."""
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def eos_ids_from_model_files(folder: Path) -> list[int]:
    """Stop ids from ``generation_config.json`` then ``config.json`` (top level, else ``text_config``)."""
    ids = _as_id_list(read_side_json(folder / "generation_config.json").get("eos_token_id"))
    model_config = read_side_json(folder / "config.json")
    text_config = model_config.get("text_config")  # multimodal checkpoints nest the LM config
    nested = text_config.get("eos_token_id") if isinstance(text_config, dict) else None
    value = model_config.get("eos_token_id", nested)
    return ids + _as_id_list(value)
