"""Render JSONL records into token ids and per-token loss masks, many records per tokenizer call.

A record becomes one or more *sides* (SFT: one document; DPO: prompt+chosen and prompt+rejected; GRPO: the
prompt), each built from its sections in order. A text section is one string tokenized on its own. Consecutive
template sections form one conversation, rendered ONCE through the tokenizer's chat template, so a side's ids
equal `tokenizer.apply_chat_template(messages, tokenize=True)` exactly (a per-message rendering, as the
reference system did, repeats template preambles such as a default system prompt and differs from it).

Each message's loss mask is attributed by re-rendering prefixes: message i owns the characters between the
render of messages[:i] and the render of messages[:i+1]. Before an assistant message, the text that
`add_generation_prompt=True` would add (the assistant header, e.g. `<|im_start|>assistant\\n`) is masked, since
the model never has to produce it; this matches transformers' `{% generation %}` assistant masks. A token takes
the mask of the character it starts at. Template preambles go to the first message. When a prefix render is
not a prefix of the whole (ChatML closes a run of tool results only after the last one), the message ends where
the two stop agreeing; if a message's content then is not inside its span (templates that rewrite earlier turns
once later turns exist, e.g. dropping old reasoning), the record is rejected as `template_not_prefix`.

Every problem with a record raises `RecordError(reason, detail)`; the caller counts reasons and never crashes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from astrai.data.config import DataConfig, SectionConfig
from astrai.io.tokenizer import Tokenizer

Segments = list[tuple[int, int, bool]]  # (start char, end char, trained)


class RecordError(Exception):
    """A record cannot be used. `reason` is the counted category, `detail` says what was wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@attrs.frozen
class TextPart:
    """A string tokenized on its own, trained or masked as a whole."""

    text: str
    trained: bool
    add_special_tokens: bool


@attrs.frozen
class ChatPart:
    """A conversation rendered through the chat template; `trained[i]` is message i's action."""

    messages: list[dict[str, Any]]
    trained: list[bool]
    generation_prompt: bool = False


@attrs.frozen(eq=False)
class Doc:
    """One rendered side: ids [N] int64 and mask [N] uint8 (1 where the token is trained)."""

    ids: np.ndarray
    mask: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)


def _messages(value: Any, section: SectionConfig) -> list[dict[str, Any]]:
    if isinstance(value, str):
        if section.role is None:
            raise RecordError("wrong_type", f"field {section.field!r} is a string; give its section a 'role'")
        return [{"role": section.role, "content": value}] if value.strip() else []
    if not isinstance(value, list):
        raise RecordError("wrong_type", f"field {section.field!r} must be a list of messages or a string")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise RecordError("wrong_type", f"field {section.field!r}[{i}] is not a message with a string 'role'")
        if not isinstance(m.get("content"), str | list | type(None)):
            raise RecordError("wrong_type", f"field {section.field!r}[{i}].content must be a string")
    return [dict(m) for m in value]


def _action(section: SectionConfig, role: str, cfg: DataConfig) -> bool:
    action = cfg.mask.get(role, cfg.mask_default) if section.action == "$role" else section.action
    return action == "train"


def plan_side(
    record: Mapping[str, Any], sections: Sequence[SectionConfig], cfg: DataConfig, *, generation_prompt: bool = False
) -> list[TextPart | ChatPart]:
    """The parts of one side of `record`; blank strings (text or one-message) and empty conversations are left out.

    Raises:
        RecordError: missing_field (a required field is absent or null), wrong_type.
    """
    parts: list[TextPart | ChatPart] = []
    for section in sections:
        value = record.get(section.field)
        if value is None:
            if section.optional:
                continue
            raise RecordError("missing_field", f"no field {section.field!r}")
        if section.template:
            messages = _messages(value, section)
            trained = [_action(section, m["role"], cfg) for m in messages]
            if not messages:
                continue
            if parts and isinstance(parts[-1], ChatPart):  # consecutive template sections: one conversation
                last = parts.pop()
                messages, trained = last.messages + messages, last.trained + trained
            parts.append(ChatPart(messages, trained))
        elif isinstance(value, str):
            if value.strip():
                first = section.add_special_tokens if section.add_special_tokens is not None else not parts
                parts.append(TextPart(value, section.action == "train", first))
        else:
            raise RecordError("wrong_type", f"field {section.field!r} must be a string, got {type(value).__name__}")
    if generation_prompt and parts and isinstance(parts[-1], ChatPart):
        parts[-1] = attrs.evolve(parts[-1], generation_prompt=True)
    return parts


def record_chars(record: Mapping[str, Any], sections: Sequence[SectionConfig]) -> int:
    """Characters of text in the distinct fields `sections` read (strings and string message contents)."""
    total = 0
    for field in dict.fromkeys(s.field for s in sections):
        value = record.get(field)
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, list):
            total += sum(
                len(m["content"]) for m in value if isinstance(m, Mapping) and isinstance(m.get("content"), str)
            )
    return total


def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    except Exception as err:  # the template is third-party code run on arbitrary data: any failure is the record's
        raise RecordError("template_error", str(err) or type(err).__name__) from None
    assert isinstance(text, str)
    return text


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (binary search over C-speed slice compares)."""
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def render_conversation(tokenizer: Tokenizer, part: ChatPart) -> tuple[str, Segments]:
    """The whole conversation's text and the character spans of each message with its trained flag.

    Message i ends where the render of messages[:i+1] stops agreeing with the whole render (usually its full
    length; less when a template closes a block only at the end, e.g. ChatML's run of tool results).

    Raises:
        RecordError: template_error (the template raised), template_not_prefix (a message's content is not
            inside the span attributed to it; see the module docstring).
    """
    full = _render(tokenizer, part.messages, part.generation_prompt)
    segments: Segments = []
    start, n = 0, len(part.messages)
    for i, message in enumerate(part.messages):
        if i > 0 and message["role"] == "assistant":
            header = _render(tokenizer, part.messages[:i], True)
            if full.startswith(header) and len(header) > start:
                segments.append((start, len(header), False))
                start = len(header)
        last = i == n - 1 and not part.generation_prompt
        end = len(full) if last else _common_prefix(_render(tokenizer, part.messages[: i + 1], False), full)
        content = message.get("content")
        if end < start or (isinstance(content, str) and content.strip() not in full[start:end]):
            raise RecordError("template_not_prefix", f"cannot find message {i}'s rendering inside the conversation")
        segments.append((start, end, part.trained[i]))
        start = end
    if start < len(full):  # the generation prompt
        segments.append((start, len(full), False))
    return full, segments


def token_mask(offsets: Sequence[tuple[int, int]], segments: Segments) -> np.ndarray:
    """[N] uint8: 1 where the token's first character lies in a trained segment."""
    starts = np.fromiter((s for s, _ in offsets), dtype=np.int64, count=len(offsets))
    bounds = np.array([end for _, end, _ in segments], dtype=np.int64)
    trained = np.array([t for _, _, t in segments] + [False], dtype=np.uint8)
    return trained[np.searchsorted(bounds, starts, side="right")]


@attrs.define
class _Pending:
    text: str
    special: bool
    segments: Segments | None  # None: a text part trained or masked as a whole
    trained: bool = False
    result: tuple[np.ndarray, np.ndarray] | None = None


def _pending(tokenizer: Tokenizer, parts: list[TextPart | ChatPart]) -> list[_Pending]:
    out = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append(_Pending(part.text, part.add_special_tokens, None, part.trained))
        else:
            text, segments = render_conversation(tokenizer, part)
            out.append(_Pending(text, False, segments))
        try:  # JSON can carry lone surrogates ("\ud800"), which the Rust tokenizer rejects for the whole batch
            out[-1].text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RecordError("bad_encoding", f"text is not valid Unicode ({err.reason})") from None
    return out


def _tokenize(tokenizer: Tokenizer, pending: list[_Pending]) -> None:
    # Two Rust batch calls in all (with and without the post-processor's special tokens).
    for special in (True, False):
        todo = [p for p in pending if p.special == special]
        if not todo:
            continue
        encodings = tokenizer.backend.encode_batch([p.text for p in todo], add_special_tokens=special)
        for p, enc in zip(todo, encodings, strict=True):
            ids = np.asarray(enc.ids, dtype=np.int64)
            if p.segments is None:
                mask = np.full(len(ids), p.trained, dtype=np.uint8)
                if special:  # tokens the post-processor added (BOS/EOS) are never trained
                    mask[np.asarray(enc.special_tokens_mask, dtype=bool)] = 0
            else:
                mask = token_mask(enc.offsets, p.segments)
            p.result = (ids, mask)


def render_batch(
    tokenizer: Tokenizer,
    records: Sequence[Mapping[str, Any]],
    cfg: DataConfig,
    sides: Sequence[Sequence[SectionConfig]],
) -> list[list[Doc] | RecordError]:
    """Render each record's `sides` (with one tokenizer batch call) into Docs, or the RecordError that stopped it.

    A GRPO config gets a generation prompt after its prompt conversation. Records whose text is outside
    [min_chars, max_chars] are too_short / too_long; a side with no tokens is empty.
    """
    pre = cfg.preprocessing
    gen = cfg.kind == "grpo"
    all_sections = [s for side in sides for s in side]
    plans: list[list[list[_Pending]] | RecordError] = []
    for record in records:
        try:
            parts = [plan_side(record, side, cfg, generation_prompt=gen) for side in sides]
            if not all(parts):
                raise RecordError("empty", "no text to render (blank strings or empty conversations)")
            chars = record_chars(record, all_sections)
            if chars < pre.min_chars:
                raise RecordError("too_short", f"{chars} characters < min_chars {pre.min_chars}")
            if chars > pre.max_chars:
                raise RecordError("too_long", f"{chars} characters > max_chars {pre.max_chars}")
            plans.append([_pending(tokenizer, p) for p in parts])
        except RecordError as err:
            plans.append(err)
    _tokenize(tokenizer, [p for plan in plans if not isinstance(plan, RecordError) for side in plan for p in side])
    return [plan if isinstance(plan, RecordError) else _assemble(plan) for plan in plans]


def _assemble(plan: list[list[_Pending]]) -> list[Doc] | RecordError:
    docs = []
    for side in plan:
        results = [p.result for p in side if p.result is not None]
        ids = np.concatenate([r[0] for r in results]) if results else np.zeros(0, np.int64)
        if len(ids) == 0:
            return RecordError("empty", "nothing left to tokenize after rendering")
        docs.append(Doc(ids, np.concatenate([r[1] for r in results])))
    return docs


def truncate(doc: Doc, max_len: int | None, mode: str) -> tuple[Doc, bool]:
    """`doc` cut to `max_len` tokens keeping its start or end; returns (doc, whether it was cut)."""
    if max_len is None or len(doc) <= max_len:
        return doc, False
    cut = slice(0, max_len) if mode == "keep_start" else slice(len(doc) - max_len, None)
    return Doc(doc.ids[cut], doc.mask[cut]), True
