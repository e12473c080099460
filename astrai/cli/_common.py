"""Shared CLI plumbing: the model flags of generate/chat/serve, loading a model with a friendly error, and rich
console helpers."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal, NoReturn, TypeVar

import attrs
import tyro
from rich.console import Console

if TYPE_CHECKING:
    from astrai.io.model import Model

T = TypeVar("T")
console = Console()
err_console = Console(stderr=True)

# Errors users can cause (bad paths, unsupported checkpoints, bad arguments): one red line, no traceback.
USER_ERRORS = (FileNotFoundError, ValueError, KeyError, OSError)

Dtype = Literal["auto", "float32", "bfloat16", "float16", "half", "float"]
Quantize = Annotated[Literal["int8"] | None, tyro.conf.arg(aliases=("--quantization", "-q"))]
"""`--quantize int8` (vLLM's `--quantization` / `-q` spelling works too): int8 weight-only weights."""
_DTYPE_ALIASES = {"auto": None, "half": "float16", "float": "float32"}  # vLLM's spellings -> ours (auto: None)

ModelName = Annotated[str, tyro.conf.arg(metavar="MODEL"), tyro.conf.Positional]
"""A model folder or Hugging Face model id, given as the first argument (or `--model MODEL`)."""

MODEL_COMMANDS = frozenset({"info", "generate", "chat", "serve"})
"""Subcommands whose first positional argument is the model (`--model MODEL` is rewritten to it)."""


@attrs.frozen(kw_only=True)
class ModelArgs:
    """The model flags shared by `astrai generate`, `chat` and `serve` (vLLM's names)."""

    model: ModelName
    """Model folder (HF format) or Hugging Face model id found in the local HF cache (`--model MODEL` works too)."""
    revision: str | None = None
    """Branch, tag or commit of a Hugging Face model id (unset: main)."""
    dtype: Dtype = "auto"
    """Parameter dtype; auto: the checkpoint's (half = float16, float = float32)."""
    device: str = "auto"
    """Device: auto (CUDA when available, else CPU), cuda, cuda:N or cpu."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens (unset: the model's max_position_embeddings)."""
    seed: int | None = None
    """Seed for reproducible sampling (requests that set no seed get one drawn from it); unset: random."""
    chat_template: str | None = None
    """A Jinja chat template file, or the template itself inline, used instead of the tokenizer's."""
    quantize: Quantize = None
    """int8: int8 weight-only quantization at load (per output row; activations and KV cache stay in --dtype);
    about half the decode time on CPU, a quarter of fp32's weight memory (docs/inference.md)."""
    tensor_parallel_size: Annotated[int, tyro.conf.arg(aliases=("-tp",))] = 1
    """Split the model over N rank processes (heads, MLP columns, experts, vocab): rank r on cuda:r when there
    are N GPUs, else all on the CPU. The checkpoint is read once, on the CPU, and sharded."""
    allow_outside_model_files: bool = False
    """Read model files (config, shards, tokenizer, chat template) that symlinks or `../` place outside the
    model folder; off: such a folder is refused (a Hugging Face cache snapshot's links always load)."""


def model_flag_to_positional(args: Sequence[str]) -> list[str]:
    """`args` of a MODEL_COMMANDS subcommand with `--model X` / `--model=X` moved to the front as positional X.

    tyro cannot give one field both a positional and a flag spelling; vLLM and our older docs use `--model`.
    Arguments after `--` are left alone.
    """
    args = list(args)
    end = args.index("--") if "--" in args else len(args)
    models, rest, i = [], [], 0
    while i < end:
        if args[i] == "--model" and i + 1 < end:
            models.append(args[i + 1])
            i += 2
            continue
        if args[i].startswith("--model="):
            models.append(args[i].removeprefix("--model="))
        else:
            rest.append(args[i])
        i += 1
    return models + rest + args[end:]


def parse(cls: type[T], args: Sequence[str] | None = None, prog: str | None = None) -> T:
    """tyro-parse `args` (default sys.argv[1:]) into `cls`, accepting `--model X` for the positional MODEL."""
    args = sys.argv[1:] if args is None else args
    return tyro.cli(cls, args=model_flag_to_positional(args), prog=prog)


def fail(message: str) -> NoReturn:
    """Print `error: message` to stderr and exit with status 2."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    sys.exit(2)


def run_guarded(fn: Callable[[], T]) -> T:
    """Run `fn`, turning user errors into `fail` instead of a traceback."""
    try:
        return fn()
    except USER_ERRORS as err:
        fail(str(err) if not isinstance(err, KeyError) else f"missing key {err}")


def dtype_name(dtype: str | None) -> str | None:
    """Our dtype name for a `--dtype` value: None for auto (the checkpoint's), vLLM's half/float mapped."""
    return _DTYPE_ALIASES.get(dtype, dtype) if dtype is not None else None


def read_chat_template(value: str) -> str:
    """The template named by `--chat-template`: a file's text, else `value` itself when it looks like Jinja.

    As vLLM: a value that is not a readable file but holds `{`, `}` or a newline is the template inline, with
    backslash escapes (`\\n`) decoded.

    Raises:
        ValueError: `value` looks like a path (no Jinja characters) but cannot be read.
    """
    path = Path(value).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as err:
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r} looks like a file path but cannot be read: {err}") from None
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def served_name(model: str) -> str:
    """The model id to report: a folder's name, or the Hugging Face model id as given."""
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else model


def served_names(model: str, given: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The names a request's `model` may use, the reported one first: `given` (`--served-model-name`), else the
    `served_name` of `model` and `model` as typed (a client configured with the path a user started it with)."""
    return given or tuple(dict.fromkeys((served_name(model), model)))


def load_model(args: ModelArgs) -> Model:
    """`astrai.load` of `args.model` (folder or HF id) with a friendly error; says which device it chose (`auto`:
    CUDA if present); `--chat-template` replaces the tokenizer's template."""
    from astrai.io.model import load, resolve_device

    template = None if args.chat_template is None else run_guarded(lambda: read_chat_template(args.chat_template))
    chosen = run_guarded(lambda: resolve_device(args.device))  # an unusable device: one error line
    if args.tensor_parallel_size > 1:  # the engine shards the CPU copy and moves each shard to its rank's device
        from astrai.inference.tp import tp_devices

        devices = sorted({str(d) for d in tp_devices(args.tensor_parallel_size)})
        console.print(f"tensor parallel: {args.tensor_parallel_size} ranks on {', '.join(devices)}", highlight=False)
        chosen = resolve_device("cpu")
    else:
        console.print(f"device: {chosen}" + (" (auto)" if args.device == "auto" else ""), highlight=False)
    model = run_guarded(lambda: load(args.model, dtype=dtype_name(args.dtype), device=chosen, revision=args.revision,
                                     quantize=args.quantize,
                                     allow_outside_files=args.allow_outside_model_files))  # fmt: skip
    if model.quantization is not None:
        console.print(f"weights: {model.quantization} weight-only, {model.nbytes / 2**20:.1f} MiB", highlight=False)
    if template is not None:
        if model.tokenizer is None:
            fail(f"{args.model} has no tokenizer.json; --chat-template needs a tokenizer")
        model = attrs.evolve(model, tokenizer=model.tokenizer.with_chat_template(template))
    return model


def interactive_engine(model: Model, args: ModelArgs, *, compile: bool, speculative: str | None = None):
    """A small engine for `generate` / `chat` (a few sequences, 256 MiB of KV on CPU); `speculative`: vLLM's
    `--speculative-config` JSON (a bad one is a clean error)."""
    from astrai.inference.engine import Engine, EngineConfig

    def build() -> Engine:
        config = EngineConfig(max_running=4, compile=compile, kv_budget_bytes=256 << 20, seed=args.seed,
                              max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
                              speculative=speculative)  # fmt: skip
        return Engine(model, config)

    return run_guarded(build)
