"""`astrai eval ifeval`: instruction following with verifiable instructions (IFEval, Zhou et al. 2023,
https://arxiv.org/abs/2311.07911).

Input is the public IFEval format, one JSON object per line: `key`, `prompt`, `instruction_id_list` and
`kwargs` (one dict of arguments per instruction). Responses are generated greedily through the engine (the
prompt as the user turn of the model's chat template when it has one, else the raw prompt), or read from
`--responses FILE.jsonl` (`prompt`, `response`: how published IFEval numbers are usually re-checked).

The verifiers are Google's, as lm-evaluation-harness ships them (`lm_eval.tasks.ifeval`: the instruction
registry and its strict / loose checks, reused unchanged so the numbers match `lm_eval --tasks ifeval`); they are
an optional dependency: `pip install "lm-eval[ifeval]"` (lm-eval, langdetect, immutabledict, nltk). Strict
checks the response as it is; loose also accepts it when any of eight variants passes (the response with its
first line, last line or both removed, each with and without `*` characters), the official upper bound. Metrics
use lm-eval's names: prompt-level accuracy (every instruction of a prompt followed) and instruction-level
accuracy (over all instructions), strict and loose; per-instruction accuracy is the groups table.

`language:response_language` and the lowercase / capital checks call langdetect, which is random unless seeded;
its seed is fixed to 0 here, so a score does not change between runs. Two instructions need NLTK data that is
downloaded separately (`python -m nltk.downloader punkt punkt_tab`): `length_constraints:number_sentences` and
`change_case:capital_word_frequency`. lm-eval tries to download it when imported; here that download is
suppressed (an evaluation never touches the network) and a record that needs the data fails with that command
in the message.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console

from astrai.eval.common import EvalConfig, first, load_model
from astrai.eval.data import DataError, Record, read_records, text_field
from astrai.eval.engine_batch import generate_all
from astrai.eval.report import Report
from astrai.inference.params import SamplingParams
from astrai.io.model import Model

INSTALL_HINT = 'pip install "lm-eval[ifeval]"  (lm-eval, langdetect, immutabledict, nltk)'
NLTK_HINT = "python -m nltk.downloader punkt punkt_tab"


@attrs.frozen(kw_only=True)
class Config(EvalConfig):
    """IFEval: verifiable instruction following, strict and loose, prompt and instruction level."""

    # the shared options (model, revision, dtype, device, limit, out) are EvalConfig's

    data: Path
    """IFEval input file (JSONL: key, prompt, instruction_id_list, kwargs)."""
    responses: Path | None = None
    """Score these responses instead of generating (JSONL: prompt, response); --model is then only a label."""
    batch_size: int = 64
    """Most sequences generated at once."""
    max_tokens: int = 1280
    """Most new tokens per response (lm-eval's max_gen_toks for ifeval)."""
    raw_prompt: bool = False
    """Give the prompt as raw text even when the model has a chat template."""


@attrs.frozen
class Item:
    """One IFEval record."""

    key: int
    prompt: str
    instruction_ids: tuple[str, ...]
    kwargs: tuple[dict[str, Any], ...]
    where: str


def verifiers() -> Any:
    """lm-eval's `lm_eval.tasks.ifeval.utils` (strict / loose checks over the instruction registry), imported
    without its NLTK download and its prints.

    Raises:
        ValueError: lm-eval or one of its IFEval dependencies is missing (the message says what to install).
    """
    try:
        import nltk
    except ImportError:
        raise ValueError(f"IFEval's verifiers need lm-eval and its ifeval extras: {INSTALL_HINT}") from None
    download, nltk.download = nltk.download, lambda *args, **kwargs: False  # no network from an evaluation
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from lm_eval.tasks.ifeval import utils
    except ImportError as err:
        raise ValueError(f"IFEval's verifiers need lm-eval and its ifeval extras ({err}): {INSTALL_HINT}") from None
    finally:
        nltk.download = download
    import langdetect

    langdetect.DetectorFactory.seed = 0  # langdetect samples at random; a fixed seed makes scores reproducible
    return utils


def read_items(path: str | Path, known: Sequence[str] | None = None) -> list[Item]:
    """The records of an IFEval input file, checked.

    Args:
        path: the JSONL file.
        known: the instruction ids the verifiers know (None: not checked).

    Raises:
        FileNotFoundError: no such file.
        DataError: a malformed record or unknown instruction id (file and line named), or no records.
    """
    items = []
    for record in read_records(path):
        items.append(_item(record, known))
    return items


def _item(record: Record, known: Sequence[str] | None) -> Item:
    data, where = record.data, record.where
    prompt = text_field(record, "prompt", allow_empty=False)
    ids, kwargs = data.get("instruction_id_list"), data.get("kwargs")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise DataError(f"{where}: instruction_id_list must be a non-empty list of strings")
    if not isinstance(kwargs, list) or len(kwargs) != len(ids) or not all(isinstance(k, dict) for k in kwargs):
        raise DataError(f"{where}: kwargs must be a list of {len(ids)} objects, one per instruction")
    unknown = [i for i in ids if known is not None and i not in known]
    if unknown:
        raise DataError(f"{where}: unknown instruction id {unknown[0]!r}")
    key = data.get("key", 0)
    if isinstance(key, bool) or not isinstance(key, int):
        raise DataError(f"{where}: key must be an integer, got {key!r}")
    return Item(key=key, prompt=prompt, instruction_ids=tuple(ids), kwargs=tuple(kwargs), where=where)


def read_responses(path: str | Path) -> dict[str, str]:
    """Responses by prompt from a JSONL file of `{"prompt", "response"}` records (a later duplicate wins)."""
    return {text_field(r, "prompt"): text_field(r, "response") for r in read_records(path)}


def generate_responses(model: Model, items: Sequence[Item], cfg: Config, console: Console | None = None) -> list[str]:
    """Greedy responses through the engine: the chat template's user turn when the model has one (and not
    `cfg.raw_prompt`), else the raw prompt."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(f"{cfg.model} has no tokenizer (tokenizer.json): IFEval needs text prompts")
    chat = tokenizer.chat_template is not None and not cfg.raw_prompt
    context = model.config.max_position_embeddings
    prompts, params = [], []
    for item in items:
        if chat:
            ids = tokenizer.encode_chat([{"role": "user", "content": item.prompt}])
        else:
            ids = tokenizer.encode_prompt(item.prompt)
        room = min(cfg.max_tokens, context - len(ids))
        if room < 1:
            raise ValueError(f"{item.where}: the prompt has {len(ids)} tokens, the model's context is {context}")
        prompts.append(ids)
        params.append(SamplingParams(max_tokens=room, temperature=0.0))
    done = generate_all(model, prompts, params, batch_size=cfg.batch_size, console=console,
                        description="ifeval: generating")  # fmt: skip
    return [c.outputs[0].text for c in done]


def check(utils: Any, item: Item, response: str) -> tuple[list[bool], list[bool]]:
    """(strict, loose) instruction-following flags of one response, one per instruction.

    Raises:
        ValueError: a verifier failed on this record (its arguments do not fit the instruction, or NLTK data is
            missing); the record's line and the instruction are named.
    """
    inp = utils.InputExample(key=item.key, instruction_id_list=list(item.instruction_ids), prompt=item.prompt,
                             kwargs=[dict(k) for k in item.kwargs])  # fmt: skip
    try:
        strict = utils.test_instruction_following_strict(inp, response).follow_instruction_list
        loose = utils.test_instruction_following_loose(inp, response).follow_instruction_list
    except (TypeError, ValueError, KeyError) as err:  # KeyError before LookupError, its base class
        raise DataError(f"{item.where}: the verifiers of {list(item.instruction_ids)} rejected the record's "
                        f"kwargs: {type(err).__name__}: {err}") from None  # fmt: skip
    except LookupError:  # nltk's "Resource punkt not found"
        raise ValueError(f"{item.where}: an instruction of {list(item.instruction_ids)} needs NLTK data that is "
                         f"not installed: {NLTK_HINT}") from None  # fmt: skip
    return strict, loose


def _mean(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags)


def evaluate(cfg: Config, model: Model | None = None, console: Console | None = None, *,
             responses: Mapping[str, str] | None = None) -> Report:  # fmt: skip
    """Run IFEval: generate (or take) one response per prompt and check its instructions, strict and loose.

    Args:
        cfg: the options.
        model: an already loaded model (default: load `cfg.model`); not needed with responses.
        console: where the generation progress bar goes (default stderr).
        responses: responses by prompt to score instead of generating (as `cfg.responses`).

    Returns:
        a Report with prompt- and instruction-level accuracy (strict and loose), the counts, per-instruction
        accuracy as groups, and one sample record per prompt.
    """
    utils = verifiers()
    from lm_eval.tasks.ifeval.instructions_registry import INSTRUCTION_DICT

    items = first(read_items(cfg.data, known=list(INSTRUCTION_DICT)), cfg.limit)
    if responses is None and cfg.responses is not None:
        responses = read_responses(cfg.responses)
    if responses is not None:
        missing = next((item for item in items if item.prompt not in responses), None)
        if missing is not None:
            raise DataError(f"no response for the prompt of {missing.where} in the given responses")
        texts = [responses[item.prompt] for item in items]
    else:
        model = model if model is not None else load_model(cfg, "ifeval")
        texts = generate_responses(model, items, cfg, console)
    samples, strict_all, loose_all = [], [], []
    per_id: dict[str, list[tuple[bool, bool]]] = {}
    for item, text in zip(items, texts, strict=True):
        strict, loose = check(utils, item, text)
        strict_all.append(strict)
        loose_all.append(loose)
        for instruction, s, lo in zip(item.instruction_ids, strict, loose, strict=True):
            per_id.setdefault(instruction, []).append((s, lo))
        samples.append({"key": item.key, "prompt": item.prompt, "response": text,
                        "instruction_id_list": list(item.instruction_ids), "strict": strict, "loose": loose,
                        "prompt_strict": all(strict), "prompt_loose": all(loose)})  # fmt: skip
    metrics = {
        "prompts": len(items),
        "instructions": sum(map(len, strict_all)),
        "prompt_level_strict_acc": _mean([all(s) for s in strict_all]),
        "inst_level_strict_acc": _mean([f for s in strict_all for f in s]),
        "prompt_level_loose_acc": _mean([all(s) for s in loose_all]),
        "inst_level_loose_acc": _mean([f for s in loose_all for f in s]),
    }
    groups = {name: {"count": len(v), "strict": _mean([s for s, _ in v]), "loose": _mean([lo for _, lo in v])}
              for name, v in sorted(per_id.items())}  # fmt: skip
    return Report(task="ifeval", model=cfg.model, metrics=metrics, samples=samples, groups=groups)
