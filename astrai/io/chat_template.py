"""Chat templates: render Hugging Face jinja2 chat templates exactly as transformers does.

A chat template is untrusted code shipped with a checkpoint (a jinja2 program in ``tokenizer_config.json`` or
``chat_template.jinja``). We render it in jinja2's ``ImmutableSandboxedEnvironment``, with resource limits added
(``astrai.io.template_limits``: value sizes, loop iterations and output per render), and the same environment
transformers builds in ``transformers.utils.chat_template_utils`` (``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``; a ``tojson`` filter that does not HTML-escape; the globals ``raise_exception``,
``strftime_now``, a restricted ``dict`` and ``namespace``; a no-op ``{% generation %}`` tag) and prepare the
inputs the same way (messages, tools and documents rebuilt from plain JSON types, ``None``-valued message keys
dropped, reasoning fields aliased), so the rendered text is byte-identical to
``tokenizer.apply_chat_template(..., tokenize=False)``.

``LiteralMarker`` keeps track of client text through a render: it hides given literals (special-token text) in
the inputs behind unforgeable markers and, after rendering, puts them back and reports where they landed, so the
tokenizer can encode them as plain text (``Tokenizer.encode_chat``).

Not here: callables as tools (transformers turns a Python function's docstring into a JSON schema; pass the
schema yourself), assistant-token masks (``{% generation %}`` renders its body but tracks nothing) and batches of
conversations. Tokenising the rendered text is ``astrai.io.tokenizer``'s job.

Errors: any failure to compile or render a template (a syntax error, ``raise_exception``, a sandbox refusal, a
resource limit, or a Python error inside the template such as an OverflowError) is one ``ChatTemplateError``, a
ValueError carrying the template's message, so that callers (the server's 400 path) need to catch only that.

Reference: https://huggingface.co/docs/transformers/main/en/chat_templating
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np

from astrai.io.errors import CheckpointError
from astrai.io.template_limits import BoundedEnvironment, bounded_filter, check_value, counting

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# Names a message's reasoning is passed under; transformers copies the first one found into all of them so that
# Qwen3-style templates (reading `reasoning_content`) and gpt-oss templates (reading `thinking`) both see it.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers appends this to the final message for `continue_final_message` and cuts the render there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class ChatTemplateError(ValueError):
    """A chat template failed to compile or render; the message is the template's (or the limit it passed)."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body; transformers uses it to mask assistant tokens."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateDict:
    """A ``dict`` global that cannot be used to reach the real type's attributes (as transformers does)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` that refuses underscore-prefixed attribute names (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 -- jinja's trick so `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, check_value(value, f"namespace attribute {name!r}"))

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson HTML-escapes `<`, `>`, `&` and `'`, which would change what the model sees.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=64)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses (cached by template text), with
    astrai's resource limits (`astrai.io.template_limits`).

    Raises:
        ChatTemplateError: the template is not a string or not valid jinja2.
    """
    if not isinstance(template, str):
        raise ChatTemplateError(f"a chat template must be a string, got {type(template).__name__}")
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = bounded_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template is not valid jinja2 (line {e.lineno}): {e.message}") from e
    except Exception as e:  # noqa: BLE001 -- whatever jinja's compiler raises is the template's fault
        raise ChatTemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from e


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON types so the sandbox never sees objects with dangerous methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy strings) carry extra methods: strip to the base type
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):  # np.bool_(False) would otherwise become a truthy placeholder
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):  # pydantic models, e.g. OpenAI SDK messages
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"  # templates only test media keys for presence, never read them


def _normalize_messages(messages: Sequence[Any]) -> list[dict]:
    """Plain dicts with ``None``-valued keys dropped (APIs send ``content=None``; templates expect absence)."""
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise TypeError(f"chat messages must be dicts, got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:  # key order matters to templates that iterate items: match transformers
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tag_final_message(messages: list[dict], field: str, template: str) -> str:
    """Append the continuation tag to the final message's ``field``; returns the original final text."""
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
        fields = [f for f in _REASONING_FIELDS if messages[-1].get(f) == messages[-1].get(field)]
    final = messages[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue')
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}", which the chat template never reads')
    if isinstance(final, list | tuple):
        for block in reversed(final):
            if "text" in block:
                text, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return text
        raise ValueError("continue_final_message is set but the final message has no text to continue")
    for f in fields:
        messages[-1][f] = messages[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_continue_tag(rendered: str, final: str) -> str:
    if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message is set but the chat template dropped part of the final message")
    loc = rendered.rindex(_CONTINUE_TAG.strip())
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()  # the template trimmed trailing space after the message


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    **variables: Any,
) -> str:
    """Render one conversation with a chat template, matching ``apply_chat_template(..., tokenize=False)``.

    Args:
        template: the jinja2 chat template source.
        messages: dicts with ``role`` and usually ``content``; ``None``-valued keys are dropped first.
        tools: JSON schemas of the callable tools (``{"type": "function", "function": {...}}``), or None.
        documents: RAG documents (dicts, typically ``title`` and ``text``), or None.
        add_generation_prompt: append the header that opens an assistant turn.
        continue_final_message: leave the final message open so the model continues it (an assistant prefill);
            a string names the field to continue (default ``"content"``). Incompatible with
            ``add_generation_prompt``.
        **variables: extra template variables; ``Tokenizer.apply_chat_template`` passes the special tokens
            (``bos_token``, ``eos_token``, ...) here as strings.

    Returns:
        The rendered prompt text.

    Raises:
        ChatTemplateError: (a ValueError) the template is not a string, does not compile, calls
            ``raise_exception``, is refused by the sandbox, passes a resource limit, or fails in any other way
            while rendering (the template's message is kept).
        ValueError: empty conversation, non-dict tools, or an invalid ``continue_final_message`` request.
        TypeError: a message or document that is not a dict.
    """
    if not messages:
        raise ValueError("cannot apply a chat template to an empty conversation")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ValueError("tools must be JSON-schema dicts; convert Python functions to schemas first")
    if documents is not None and not all(isinstance(d, Mapping) for d in documents):
        raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
    chat = _normalize_messages(messages)
    if not isinstance(template, str):  # before the cache: a dict is not even hashable
        raise ChatTemplateError(f"a chat template must be a string, got {type(template).__name__}")
    compiled = compile_chat_template(template)
    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = _tag_final_message(chat, field, template)
    try:
        with counting():
            rendered = compiled.render(
                messages=chat,
                tools=_plain(list(tools)) if tools is not None else None,
                documents=_plain(list(documents)) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **_plain(variables),
            )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e.message or e}") from e
    except Exception as e:  # noqa: BLE001 -- OverflowError, RecursionError, TypeError...: the template's fault
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from e
    return _cut_at_continue_tag(rendered, final) if final is not None else rendered


def select_chat_template(
    templates: str | Mapping[str, str] | None, *, name: str | None = None, tools: object = None
) -> str:
    """Pick the template to render, with transformers' rules for checkpoints that ship several.

    Args:
        templates: one template, a ``{name: template}`` dict, or None.
        name: a template name from ``templates``, or a whole template source to use instead.
        tools: when given and a ``"tool_use"`` template exists, that one is the default.

    Raises:
        ValueError: there is no template, or several and none named ``"default"``.
    """
    if isinstance(templates, Mapping):
        if name is not None:
            return templates.get(name, name)
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ValueError(f"this tokenizer has several chat templates and no default; pick one of {sorted(templates)}")
    if name is not None:
        return name
    if templates is None:
        raise ValueError(
            "this tokenizer has no chat template (no 'chat_template' in tokenizer_config.json and no "
            "chat_template.jinja); pass chat_template=... or format the prompt yourself"
        )
    return templates


# ---- client text through a render ---------------------------------------------------------------------------
_SCAN_CHUNK = 1 << 15  # characters per regex search: one C call on hostile text ("<|<|<|...") holds the GIL briefly


@functools.lru_cache(maxsize=16)
def _literal_pattern(literals: tuple[str, ...]) -> re.Pattern[str]:
    # longest first: where several literals start at one position the longest wins, as the tokenizer's
    # leftmost-longest added-token matching does
    return re.compile("|".join(re.escape(s) for s in sorted(literals, key=len, reverse=True)))


def find_literals(text: str, literals: tuple[str, ...]) -> Iterator[re.Match[str]]:
    """Leftmost non-overlapping occurrences of ``literals`` in ``text`` (the longest where several start at one
    position), searched a chunk at a time so that no single regex call holds the GIL for long."""
    pattern, overlap, pos = _literal_pattern(literals), max(map(len, literals)) - 1, 0
    while pos < len(text):
        match = pattern.search(text, pos, pos + _SCAN_CHUNK + overlap)
        if match is None or match.start() >= pos + _SCAN_CHUNK:  # a later match may cross the window's end
            pos += _SCAN_CHUNK
            continue
        yield match
        pos = match.end()


class LiteralMarker:
    """Carries literals found in client strings through a chat-template render, remembering where they end up.

    ``hide`` replaces each occurrence of a literal in every string (and dict key) of a value by a marker
    ``[astrai-<random nonce>:<k>]``: ASCII, so ``tojson`` keeps it; not whitespace, so ``trim`` keeps it; and
    unforgeable, since the nonce is drawn per instance. ``reveal`` puts the literals back into the rendered text
    and returns the character spans they occupy. Strings without a literal are passed through unchanged (``hits``
    stays 0), so rendering their conversation gives exactly the text it gave before.

    Footgun: a template that cuts client text (``content[:n]``) may cut a marker; the cut part stays as text.

    Attributes:
        literals: the strings to track (e.g. the tokenizer's special tokens).
        hits: how many occurrences ``hide`` has replaced so far.
    """

    def __init__(self, literals: Sequence[str]) -> None:
        self.literals = tuple(dict.fromkeys(s for s in literals if s))
        self.hits = 0
        self._index = {s: k for k, s in enumerate(self.literals)}
        self._open = f"[astrai-{secrets.token_hex(12)}:"

    def hide(self, value: Any) -> Any:
        """``value`` (str, dict, list or tuple, nested) with every literal inside a string replaced by a marker."""
        if isinstance(value, str):
            return self._hide_text(value)
        if isinstance(value, Mapping):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self.hide(v) for v in value)
        return value

    def _hide_text(self, text: str) -> str:
        if not self.literals:
            return text
        pieces, pos = [], 0
        for match in find_literals(text, self.literals):
            pieces += [text[pos : match.start()], f"{self._open}{self._index[match.group()]}]"]
            pos = match.end()
        self.hits += len(pieces) // 2
        return "".join(pieces) + text[pos:] if pieces else text

    def reveal(self, text: str) -> tuple[str, list[int], list[int]]:
        """``text`` with the markers replaced by their literals, and where the literals start and end in it.

        Flat lists of ints, not ``(start, end)`` tuples: hostile text yields hundreds of thousands of spans, and
        that many live tuples make each full garbage-collector pass stall every thread for ~0.1 s.
        """
        out, starts, ends, pos, size = [], [], [], 0, 0
        for match in re.finditer(re.escape(self._open) + r"(\d+)\]", text):
            literal = self.literals[int(match.group(1))]
            out += [text[pos : match.start()], literal]
            size += match.start() - pos
            starts.append(size)
            size += len(literal)
            ends.append(size)
            pos = match.end()
        return "".join(out) + text[pos:], starts, ends


def load_chat_templates(folder: str | Path, tokenizer_config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """Read a checkpoint's chat template(s) as transformers does.

    ``chat_template.jinja`` (the default) and ``additional_chat_templates/<name>.jinja`` take priority over
    ``tokenizer_config.json["chat_template"]``, which may be a string or a list of ``{"name", "template"}``.

    Returns:
        A single template string, a ``{name: template}`` dict when there are several, or None.

    Raises:
        CheckpointError: ``tokenizer_config.json``'s ``chat_template`` is neither a string, a list of
            ``{"name": str, "template": str}`` nor null, or a template file is not UTF-8 (rendering would fail on
            every request; the message names the file).
    """
    folder = Path(folder)
    files: dict[str, str] = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = _read_template(folder / CHAT_TEMPLATE_FILE)
    extra_dir = folder / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            files[path.stem] = _read_template(path)
    if files:
        return files["default"] if list(files) == ["default"] else files
    value = tokenizer_config.get("chat_template")
    where = f"{folder / 'tokenizer_config.json'}: chat_template"
    if isinstance(value, list):
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):  # fmt: skip
                raise CheckpointError(f"{where}[{i}] must be {{'name': str, 'template': str}}, got {entry!r:.80}")
        return {entry["name"]: entry["template"] for entry in value}
    if value is not None and not isinstance(value, str):
        raise CheckpointError(f"{where} must be a string, a list of {{'name', 'template'}} objects or null, got "
                              f"{type(value).__name__} {value!r:.80}")  # fmt: skip
    return value


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: a chat template must be UTF-8 text ({e})") from None
    except OSError as e:  # permissions, a directory
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
