"""The declarative preprocessing config (`DataConfig`), read from JSON with cattrs into frozen attrs classes.

A config names the output kind (pretrain, sft, dpo, grpo), the JSONL inputs, the tokenizer folder, which record
fields become which parts of a document (`sections`), how each part is loss-masked, and the length limits,
packing and sharding options. `load_config` rejects unknown keys, wrong types (no silent str/int/bool coercion)
and bad values with a message that names the field, e.g. `config.preprocessing.max_seq_len: must be > 0, got -1`.

Relative `inputs`, `tokenizer` and `output` paths are relative to the working directory, like command-line
paths. See docs/data.md for the format and full examples.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs
import cattrs.gen
from cattrs.errors import ForbiddenExtraKeysError, IterableValidationError, IterableValidationNote

Kind = Literal["pretrain", "sft", "dpo", "grpo"]
Action = Literal["train", "mask", "$role"]
Mask = Literal["train", "mask"]
Packing = Literal["bfd", "bfd_split", "none"]
Truncation = Literal["keep_start", "keep_end"]

DEFAULT_ROLE_MASK: dict[str, Mask] = {"system": "mask", "user": "mask", "assistant": "train", "tool": "mask"}


class ConfigError(ValueError):
    """A preprocessing config is unreadable or invalid; the message names the field at fault."""


def _positive(inst: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value}")


def _non_negative(inst: Any, attribute: attrs.Attribute, value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value}")


@attrs.frozen(kw_only=True)
class SectionConfig:
    """One part of a document, taken from one field of a JSONL record.

    A text section tokenizes a string field. A template section (`template: true`) takes a list of chat
    messages (or a string, which becomes one message of `role`); consecutive template sections form one
    conversation rendered once through the tokenizer's chat template.
    """

    field: str
    """Top-level key of the JSONL record."""
    action: Action = "train"
    """Loss mask: "train" (1), "mask" (0), or "$role" (each message's role looked up in `DataConfig.mask`)."""
    template: bool = False
    """Render the field as chat messages through the tokenizer's chat template."""
    role: str | None = None
    """Template sections only: the role of a string-valued field (e.g. "user" for a plain `prompt` string)."""
    add_special_tokens: bool | None = None
    """Text sections: apply the tokenizer's post-processor (e.g. BOS). Default: only for a document's first part."""
    optional: bool = False
    """A missing, null or empty field is skipped instead of rejecting the record."""


@attrs.frozen(kw_only=True)
class PreprocessingConfig:
    """Length limits, batching, packing and sharding."""

    max_seq_len: int | None = attrs.field(default=2048, validator=_positive)
    """Longest document in tokens; longer ones are truncated (`truncation_mode`). null: no limit."""
    min_chars: int = attrs.field(default=0, validator=_non_negative)
    """Records whose text (strings and message contents, summed) is shorter are skipped as too_short."""
    max_chars: int = attrs.field(default=2_000_000, validator=_positive)
    """Records whose text is longer are skipped as too_long."""
    max_items: int | None = attrs.field(default=None, validator=_positive)
    """Stop after this many kept records (null: all)."""
    batch_size: int = attrs.field(default=256, validator=_positive)
    """Records rendered and tokenized together (one `encode_batch` call)."""
    truncation_mode: Truncation = "keep_start"
    """Which end of an over-long document survives."""
    packing_strategy: Packing = "bfd"
    """SFT rows: best-fit-decreasing packing, the same after splitting long documents, or one document per row."""
    max_packed_len: int = attrs.field(default=8192, validator=_positive)
    """SFT: longest packed row in tokens (use the training seq_len)."""
    max_tokens_per_shard: int = attrs.field(default=100_000_000, validator=_positive)
    """Start a new shard once this many tokens are buffered."""


@attrs.frozen(kw_only=True)
class DataConfig:
    """A whole preprocessing run: inputs, rendering, masking, limits and output."""

    kind: Kind
    """pretrain (EOS-separated token stream), sft (packed masked rows), dpo (chosen/rejected pairs), grpo."""
    inputs: tuple[str, ...]
    """JSONL files, or folders whose *.jsonl files are read in sorted order."""
    tokenizer: str | None = None
    """Folder with tokenizer.json (+ tokenizer_config.json for the chat template)."""
    output: str | None = None
    """Output folder (written atomically)."""
    sections: tuple[SectionConfig, ...] = ()
    """pretrain / sft: the parts of each document, in order."""
    prompt: tuple[SectionConfig, ...] = ()
    """dpo / grpo: the prompt parts."""
    chosen: tuple[SectionConfig, ...] = ()
    """dpo: the preferred response parts (appended to the prompt)."""
    rejected: tuple[SectionConfig, ...] = ()
    """dpo: the dispreferred response parts (appended to the prompt)."""
    answer_field: str | None = None
    """grpo: a string field kept per prompt in answers.json (a reference answer for the reward)."""
    mask: dict[str, Mask] = attrs.field(factory=lambda: dict(DEFAULT_ROLE_MASK))
    """role -> "train" | "mask", used by "$role" sections."""
    mask_default: Mask = "mask"
    """Action for roles missing from `mask`."""
    preprocessing: PreprocessingConfig = attrs.field(factory=PreprocessingConfig)
    version: int = 1
    """Config format version (only 1 exists)."""


def _strict(kind: type) -> Any:
    # cattrs would turn 3 into "3" and true into 1; a config typo should be an error instead.
    def hook(value: Any, _: Any) -> Any:
        if type(value) is kind or (kind is float and type(value) is int):
            return value
        raise TypeError(f"expected {kind.__name__}, got {type(value).__name__} {value!r}")

    return hook


def _list_to_tuple(converter: cattrs.Converter) -> Any:
    def factory(tp: Any) -> Any:
        (item,) = [a for a in typing.get_args(tp) if a is not Ellipsis]
        inner = converter.get_structure_hook(item)

        def hook(value: Any, _: Any) -> tuple:
            if not isinstance(value, list):
                raise TypeError(f"expected a JSON list, got {type(value).__name__} {value!r}")
            out, errors = [], []
            for i, v in enumerate(value):
                try:
                    out.append(inner(v, item))
                except Exception as err:  # collected so the message carries the index, as cattrs does
                    err.__notes__ = [*getattr(err, "__notes__", []), IterableValidationNote(f"@ index {i}", i, item)]
                    errors.append(err)
            if errors:
                raise IterableValidationError(f"While structuring {tp!r}", errors, tp)
            return tuple(out)

        return hook

    return factory


def _literal(tp: Any) -> Any:
    choices = typing.get_args(tp)

    def hook(value: Any, _: Any) -> Any:
        if value in choices and type(value) is str:
            return value
        raise ValueError(f"{value!r} is not one of {', '.join(map(repr, choices))}")

    return hook


def _object(converter: cattrs.Converter) -> Any:
    def factory(tp: Any) -> Any:
        inner = cattrs.gen.make_dict_structure_fn(tp, converter, _cattrs_forbid_extra_keys=True)

        def hook(value: Any, _: Any) -> Any:
            if not isinstance(value, dict):
                raise TypeError(f"expected a JSON object, got {type(value).__name__} {value!r}")
            return inner(value, tp)

        return hook

    return factory


def _format(exc: BaseException, tp: Any) -> str:
    if isinstance(exc, ForbiddenExtraKeysError):
        return f"unknown field(s) {sorted(exc.extra_fields)}"
    if isinstance(exc, KeyError):
        return "required field missing"
    if isinstance(exc, TypeError | ValueError | cattrs.errors.CattrsError) and str(exc):
        return str(exc)
    return cattrs.v.format_exception(exc, tp)


def make_converter() -> cattrs.Converter:
    """A cattrs converter that forbids unknown keys and coercions."""
    converter = cattrs.Converter(forbid_extra_keys=True)
    for kind in (str, int, bool, float):
        converter.register_structure_hook(kind, _strict(kind))
    converter.register_structure_hook_factory(lambda t: typing.get_origin(t) is tuple, _list_to_tuple(converter))
    converter.register_structure_hook_factory(lambda t: typing.get_origin(t) is Literal, _literal)
    converter.register_structure_hook_factory(attrs.has, _object(converter))
    return converter


def _check_sections(name: str, sections: tuple[SectionConfig, ...]) -> None:
    for i, s in enumerate(sections):
        where = f"config.{name}[{i}]"
        if s.action == "$role" and not s.template:
            raise ConfigError(f"{where}.action: '$role' needs template: true (text has no role)")
        if s.role is not None and not s.template:
            raise ConfigError(f"{where}.role: only template sections have a role")


def validate(cfg: DataConfig) -> DataConfig:
    """Check the cross-field rules of `cfg` (which sections each kind needs); returns it unchanged."""
    if cfg.version != 1:
        raise ConfigError(f"config.version: only version 1 exists, got {cfg.version}")
    if not cfg.inputs:
        raise ConfigError("config.inputs: give at least one JSONL file or folder")
    needed = {"pretrain": ("sections",), "sft": ("sections",), "dpo": ("prompt", "chosen", "rejected")}
    needed["grpo"] = ("prompt",)
    for name in ("sections", "prompt", "chosen", "rejected"):
        sections = getattr(cfg, name)
        if name in needed[cfg.kind] and not sections:
            raise ConfigError(f"config.{name}: kind {cfg.kind!r} needs at least one section")
        if name not in needed[cfg.kind] and sections:
            raise ConfigError(f"config.{name}: not used by kind {cfg.kind!r} (it uses {', '.join(needed[cfg.kind])})")
        _check_sections(name, sections)
    if cfg.kind == "pretrain" and any(s.action != "train" or s.template for s in cfg.sections):
        raise ConfigError("config.sections: pretrain documents are plain text trained everywhere (use kind 'sft')")
    if cfg.answer_field is not None and cfg.kind != "grpo":
        raise ConfigError(f"config.answer_field: only kind 'grpo' keeps answers, not {cfg.kind!r}")
    return cfg


def config_from_dict(data: Any) -> DataConfig:
    """Structure and validate a parsed JSON config.

    Raises:
        ConfigError: naming each bad field, e.g. `config.sections[0].action: ...`.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config: expected a JSON object, got {type(data).__name__}")
    try:
        cfg = make_converter().structure(data, DataConfig)
    except cattrs.BaseValidationError as err:
        problems = cattrs.transform_error(err, path="config", format_exception=_format)
        raise ConfigError("; ".join(_flip(p) for p in problems)) from None
    except (TypeError, ValueError) as err:  # a hook raised outside a class (e.g. a top-level list)
        raise ConfigError(f"config: {err}") from None
    return validate(cfg)


def _flip(problem: str) -> str:
    # cattrs writes "message @ path"; lead with the path so the field is the first thing read.
    message, sep, path = problem.rpartition(" @ ")
    return f"{path}: {message}" if sep else problem


def load_config(path: str | Path) -> DataConfig:
    """Read a JSON preprocessing config file.

    Raises:
        FileNotFoundError: no such file.
        ConfigError: invalid JSON or an invalid field (the message names it).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no config file {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    try:
        return config_from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
