"""OpenAI request fields -> `SamplingParams`, shared by `/v1/chat/completions` and `/v1/completions`: each field's
type and range check (a 400 naming `param`), the check that a body holds only fields its route knows, and the
server's sampling defaults.

Fields a route does not list are a 400 naming the field (`check_fields`), so nothing a client sends is silently
ignored; the few fields accepted on purpose without effect are listed in each route's docstring
(`openai_protocol`) and in docs/serving.md. A few known fields the server does not implement get a 400 with the
reason, unless sent as null or false (their "off" value).

Sampling defaults (`SAMPLING_DEFAULT_KEYS`, e.g. a model's generation_config.json, `ServerState.sampling_defaults`)
fill the fields a request leaves unset (absent or null); a value in the request always wins, as vLLM does.
`max_tokens` from the defaults replaces the route's own default (the rest of the context for chat, 16 for
completions) and is still capped to the room the context leaves.

Structured output (`grammar_spec`), on both routes: `response_format` `{"type": "json_object"}` or `{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}` (`{"type": "text"}` is no constraint; TGI's `{"type":
"json" | "regex" | ..., "value": ...}` too), vLLM's `structured_outputs` (one of json, regex, choice, grammar,
json_object) and its older `guided_json` (a schema object or its JSON text), `guided_regex`, `guided_choice` (a list
of strings) and `guided_grammar` (Lark, or GBNF as llama.cpp writes it) become `SamplingParams.grammar`, a
`GrammarSpec` whose `param` names the field. At most one of them per request (a second is a 400 naming it). The shape
is checked here; the engine compiles the grammar (`Engine.compile_grammar`; a grammar that does not compile is a 400
naming the field).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

import attrs

from astrai.inference.params import MAX_N, GrammarSpec, SamplingParams
from astrai.serve.common import APIError

SAMPLING_DEFAULT_KEYS = frozenset({"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"})
"""The SamplingParams fields a server-wide default may set (the keys vLLM takes from generation_config.json)."""

BUILTIN_DEFAULTS: Mapping[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                                       "repetition_penalty": 1.0}  # fmt: skip
"""What an unset sampling field means without server defaults (OpenAI's and vLLM's values)."""

# accepted by both OpenAI routes; each route adds its own (openai_protocol)
SAMPLING_FIELDS = frozenset({
    "model", "stream", "stream_options", "n", "best_of", "max_tokens", "temperature", "top_p", "frequency_penalty",
    "presence_penalty", "logit_bias", "seed", "stop", "response_format",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "min_tokens", "skip_special_tokens",
    "include_stop_str_in_output", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "structured_outputs", "priority", "return_tokens_as_token_ids", "prompt_logprobs", "cache_salt",
})  # fmt: skip

# known fields this server does not implement: a 400 with the reason unless null / false
UNSUPPORTED = {"use_beam_search": "no beam search", "structural_tag": "no structural tags (response_format and "
               "guided_json / guided_regex / guided_choice / guided_grammar are supported)",
               "allowed_token_ids": "no allowed-token lists", "bad_words": "no bad-word lists",
               "truncate_prompt_tokens": "prompts are never truncated", "logits_processors": "no custom logits "
               "processors"}  # fmt: skip

_STREAM_OPTIONS = {"include_usage", "include_obfuscation", "continuous_usage_stats"}


def bad(param: str | None, message: str) -> APIError:
    """A 400 naming `param`."""
    return APIError(400, message, param=param)


def show(value: Any) -> str:
    """A short JSON rendering of a client value, for error messages."""
    return json.dumps(value)[:60]


def check_fields(body: dict, allowed: frozenset[str], unsupported: Mapping[str, str]) -> None:
    """400 for the first field of `body` that is neither in `allowed` nor an `unsupported` field left null/false."""
    for key, value in body.items():
        if key in unsupported:
            if value is not None and value is not False:
                raise bad(key, f"{key} is not supported by this server ({unsupported[key]})")
        elif key not in allowed:
            raise bad(key, f"unknown field {key!r}: this route accepts {', '.join(sorted(allowed))} "
                           "(docs/serving.md says what each does)")  # fmt: skip


# ---- single fields ------------------------------------------------------------------------------------------
def number(body: dict, key: str, default: Any, lo: float | None, hi: float | None, *, integer: bool = False) -> Any:
    """body[key] checked to be a number (an int if `integer`) in [lo, hi]; `default` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float) or value != value:
        raise bad(key, f"{key} must be {'an integer' if integer else 'a number'}, got {show(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"<= {hi}" if lo is None else f"in [{lo}, {hi}]"
        raise bad(key, f"{key} must be {bounds}, got {value}")
    return value


def integer(body: dict, key: str, default: Any, lo: int | None, hi: int | None) -> Any:
    """`number` for integers."""
    return number(body, key, default, lo, hi, integer=True)


def flag(body: dict, key: str, default: bool = False) -> bool:
    """body[key] checked to be a boolean; `default` when absent or null."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(key, f"{key} must be a boolean, got {show(value)}")
    return value


def prompt_logprobs_top(body: dict, most: int) -> int | None:
    """vLLM's `prompt_logprobs`: alternatives per prompt token (0: the prompt token's own log-prob only), or None.

    Refused beside `stream` (as vLLM's chat route does): the scores come whole, before the first token."""
    top = integer(body, "prompt_logprobs", None, 0, most)
    if top is not None and flag(body, "stream"):
        raise bad("prompt_logprobs", "prompt_logprobs are not available when stream is true")
    return top


def is_token_id(value: Any) -> bool:
    """An int that is not a bool (JSON true/false arrive as bool, a subclass of int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"stop must be a non-empty string or a list of them, got {show(body['stop'])}")
    return tuple(stop)


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(is_token_id(i) for i in ids):
        raise bad("stop_token_ids", f"stop_token_ids must be a list of token ids (integers), got {show(ids)}")
    return tuple(ids)


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias") or {}
    try:
        if not isinstance(bias, dict) or any(isinstance(v, bool) for v in bias.values()):
            raise TypeError
        return tuple((int(k), float(v)) for k, v in bias.items())
    except (TypeError, ValueError):
        raise bad("logit_bias", f"logit_bias must map token ids (strings) to numbers, got {show(bias)}") from None


def common_checks(body: dict) -> None:
    """`model`, `stream_options` and `best_of`, which both routes take alike."""
    if not isinstance(body.get("model", ""), str):
        raise bad("model", f"model must be a string, got {show(body['model'])}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or not flag(body, "stream"):
            raise bad("stream_options", "stream_options must be an object, and only given when stream is true")
        for key in options:
            if key not in _STREAM_OPTIONS:
                raise bad(f"stream_options.{key}", f"stream_options.{key} is not supported (include_usage is)")
        flag(options, "include_usage")
        if flag(options, "continuous_usage_stats"):
            raise bad("stream_options.continuous_usage_stats", "usage is sent once, at the end of the stream")
    best_of = integer(body, "best_of", None, 1, MAX_N)
    if best_of is not None and best_of != integer(body, "n", 1, 1, MAX_N):
        raise bad("best_of", "best_of must equal n (no server-side best-of selection)")


def include_usage(body: dict) -> bool:
    """Whether a stream ends with a usage chunk (`stream_options.include_usage`)."""
    return bool((body.get("stream_options") or {}).get("include_usage"))


# ---- structured output --------------------------------------------------------------------------------------
GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar")  # fmt: skip
# vLLM's `structured_outputs` (0.10.2+, which replaced guided_*): key -> the guided_* field it means
STRUCTURED_OUTPUTS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                      "grammar": "guided_grammar", "json_object": None}  # fmt: skip
# its options that tune vLLM's own backends' output; astrai's grammar engine has no such knobs: a 400 if set
_STRUCTURED_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                       "whitespace_pattern", "structural_tag")  # fmt: skip
"""The request fields that constrain the output; at most one per request."""


def _response_format(fmt: Any) -> GrammarSpec | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad("response_format", f"response_format must be an object with a type, got {show(fmt)}")
    kind = fmt["type"]
    if kind == "text":
        return None
    if "value" in fmt:  # TGI's grammar shape, as huggingface_hub's InferenceClient sends it
        return _value_format(kind, fmt["value"])
    if kind == "json_object":
        return GrammarSpec(kind="json_object", param="response_format")
    if kind != "json_schema":
        raise bad("response_format.type", f"response_format type must be text, json_object or json_schema, got "
                                          f"{show(kind)}")  # fmt: skip
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("response_format.json_schema", "response_format json_schema needs a json_schema object "
                                                 "({'name': ..., 'schema': {...}})")  # fmt: skip
    if not isinstance(spec.get("name", ""), str):
        raise bad("response_format.json_schema.name", "json_schema.name must be a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad("response_format.json_schema.strict", "json_schema.strict must be a boolean")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return GrammarSpec(kind="json_object", param="response_format")
    if not isinstance(schema, dict):
        raise bad("response_format.json_schema.schema", f"json_schema.schema must be an object, got {show(schema)}")
    return GrammarSpec(kind="json_schema", source=json.dumps(schema), param="response_format")


def _value_format(kind: str, value: Any) -> GrammarSpec:
    """TGI's `{"type": "json" | "json_object" | "json_schema", "value": schema}` (a schema object or its JSON
    text) or `{"type": "regex", "value": pattern}`: the schema under `value` constrains the output."""
    if kind == "regex":
        spec = _guided("guided_regex", value)
    elif kind in ("json", "json_object", "json_schema"):
        if isinstance(value, dict) and isinstance(value.get("schema"), dict):  # {"name", "schema"} under value
            value = value["schema"]
        spec = _guided("guided_json", value)
    else:
        raise bad("response_format.type", f"response_format with a value takes type json, json_object, "
                                          f"json_schema or regex, got {show(kind)}")  # fmt: skip
    return attrs.evolve(spec, param="response_format")


def _structured_outputs(value: Any) -> GrammarSpec:
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object (true)."""
    if not isinstance(value, dict):
        raise bad("structured_outputs", f"structured_outputs must be an object, got {show(value)}")
    for key, option in value.items():
        if key in _STRUCTURED_OPTIONS and option not in (None, False):
            raise bad(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported by this server's "
                                                   "grammar engine")  # fmt: skip
        if key not in STRUCTURED_OUTPUTS and key not in _STRUCTURED_OPTIONS:
            raise bad(f"structured_outputs.{key}", f"unknown structured_outputs field {key!r}: give one of "
                                                   f"{', '.join(STRUCTURED_OUTPUTS)}")  # fmt: skip
    given = [k for k in STRUCTURED_OUTPUTS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad("structured_outputs", f"structured_outputs needs exactly one of {', '.join(STRUCTURED_OUTPUTS)}, "
                                        f"got {len(given)}")  # fmt: skip
    key = given[0]
    if key == "json_object":
        if value[key] is not True:
            raise bad("structured_outputs.json_object", "structured_outputs.json_object must be true")
        return GrammarSpec(kind="json_object", param="structured_outputs.json_object")
    try:
        spec = _guided(STRUCTURED_OUTPUTS[key], value[key])
    except APIError as err:  # name the field the client sent
        raise bad(f"structured_outputs.{key}", err.message.replace(STRUCTURED_OUTPUTS[key],
                                                                   f"structured_outputs.{key}")) from None  # fmt: skip
    return attrs.evolve(spec, param=f"structured_outputs.{key}")


def _guided(key: str, value: Any) -> GrammarSpec:
    if key == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise bad(key, f"guided_json must be a JSON schema (an object or its JSON text): {err}") from None
        if not isinstance(value, dict):
            raise bad(key, f"guided_json must be a JSON schema object, got {show(value)}")
        return GrammarSpec(kind="json_schema", source=json.dumps(value), param=key)
    if key == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad(key, f"guided_choice must be a non-empty list of non-empty strings, got {show(value)}")
        return GrammarSpec(kind="choice", source=tuple(value), param=key)
    if not isinstance(value, str) or not value:
        raise bad(key, f"{key} must be a non-empty string, got {show(value)}")
    return GrammarSpec(kind="regex" if key == "guided_regex" else "lark", source=value, param=key)


def grammar_spec(body: dict) -> GrammarSpec | None:
    """The request's output constraint (module docstring), or None; 400 naming the field for a bad shape or a
    second constraint."""
    specs = []
    for key in GRAMMAR_FIELDS:
        value = body.get(key)
        if value is None:
            continue
        if key == "response_format":
            spec = _response_format(value)
        else:
            spec = _structured_outputs(value) if key == "structured_outputs" else _guided(key, value)
        if spec is None:
            continue
        if specs:
            first = specs[0].param.partition(".")[0]
            raise bad(key, f"{key} and {first} both constrain the output: give at most one of "
                           f"{', '.join(GRAMMAR_FIELDS)}")  # fmt: skip
        specs.append(spec)
    return specs[0] if specs else None


# ---- SamplingParams -----------------------------------------------------------------------------------------
_PARAMS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
           "repetition_penalty", "logit_bias", "seed", "n", "top_logprobs", "stop", "stop_token_ids",
           "min_tokens", "priority", "cache_salt", *GRAMMAR_FIELDS,
           *(f"structured_outputs.{k}" for k in STRUCTURED_OUTPUTS)}  # fmt: skip


def _cache_salt(body: dict) -> str | None:
    """vLLM's `cache_salt`: a non-empty string (its length is checked by `SamplingParams.check`), or None."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise bad("cache_salt", f"cache_salt must be a non-empty string, got {show(salt)}")
    return salt


def sampling_params(body: dict, vocab_size: int, *, max_tokens: int, top_logprobs: int | None,
                    defaults: Mapping[str, Any]) -> SamplingParams:  # fmt: skip
    """SamplingParams from the request fields, validated; unset fields from `defaults`, then `BUILTIN_DEFAULTS`.

    `top_logprobs` None: no logprobs. Raises APIError 400 naming the field.
    """
    d = {**BUILTIN_DEFAULTS, **defaults}
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", d["temperature"], 0.0, 2.0),
        top_p=number(body, "top_p", d["top_p"], 0.0, 1.0),
        top_k=integer(body, "top_k", d["top_k"], -1, None),
        min_p=number(body, "min_p", d["min_p"], 0.0, 1.0),
        frequency_penalty=number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=number(body, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=number(body, "repetition_penalty", d["repetition_penalty"], 0.0, None),
        logit_bias=_logit_bias(body),
        seed=integer(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        n=integer(body, "n", 1, 1, MAX_N),
        logprobs=top_logprobs is not None,
        top_logprobs=top_logprobs or 0,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body),
        ignore_eos=flag(body, "ignore_eos"),
        min_tokens=integer(body, "min_tokens", 0, 0, None),
        skip_special_tokens=flag(body, "skip_special_tokens", True),
        include_stop_str_in_output=flag(body, "include_stop_str_in_output"),
        grammar=grammar_spec(body),
        priority=integer(body, "priority", 0, -(1 << 63), (1 << 63) - 1),
        cache_salt=_cache_salt(body),
    )
    try:
        params.check(vocab_size)
    except ValueError as err:  # EngineInputError: `param` names the field
        field = getattr(err, "param", None)
        raise bad(field if field in _PARAMS else None, str(err)) from None
    return params


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""OpenAI's error `code` for a prompt (plus completion) longer than the context: clients key on it (litellm maps it,
with the "maximum context length" wording, to its ContextWindowExceededError, which drives its fallbacks)."""


def context_exceeded(param: str, context: int, prompt_len: int, completion: int | None = None,
                     what: str = "messages") -> APIError:  # fmt: skip
    """The 400 for a request the context cannot hold, in OpenAI's wording and `code`, with the numbers.

    Args:
        param: the field to shorten (`messages`, `prompt` or `max_tokens`).
        context: tokens one sequence may hold, prompt and completion together.
        prompt_len: the prompt's tokens.
        completion: the completion tokens asked for; None when the prompt alone leaves no room to generate.
        what: the prompt's name in the message (`messages`, `prompt`, `prompt[2]`).
    """
    head = f"This model's maximum context length is {context} tokens. However, "
    if completion is None:
        room = " (no room is left for the completion)" if prompt_len == context else ""
        tail = f"your {what} resulted in {prompt_len} tokens{room}. Please reduce the length of the {what}."
    else:
        tail = (f"you requested {prompt_len + completion} tokens ({prompt_len} in the {what}, {completion} in the "
                f"completion). Please reduce the length of the {what} or completion.")  # fmt: skip
    return APIError(400, head + tail, param=param, code=CONTEXT_LENGTH_EXCEEDED)


def max_tokens(body: dict, keys: tuple[str, ...], prompt_len: int, default: int | None, prompt_param: str,
               context: int) -> int:  # fmt: skip
    """The first of `keys` given, else `default` (capped to the room left), else the rest of the `context`.

    Raises:
        APIError: 400 with code `context_length_exceeded` when the prompt leaves no room, or the explicit value
            does not fit beside it.
    """
    if prompt_len >= context:
        raise context_exceeded(prompt_param, context, prompt_len, what=prompt_param)
    for key in keys:
        value = integer(body, key, None, 1, None)
        if value is not None:
            if prompt_len + value > context:
                raise context_exceeded(key, context, prompt_len, value, what=prompt_param)
            return value
    return context - prompt_len if default is None else min(default, context - prompt_len)


REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces: it goes into logs and ids verbatim


def response_id(body: dict, prefix: str) -> str:
    """The reply's id: `prefix-` + vLLM's `request_id` field when given (so a client can find its request in the
    server's log), else a random hex id; 400 naming `request_id` for anything but 1-128 printable ASCII characters."""
    value = body.get("request_id")
    if value is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    if not isinstance(value, str) or not REQUEST_ID.fullmatch(value):
        raise bad(
            "request_id", f"request_id must be 1-128 printable ASCII characters without spaces, got {show(value)}"
        )
    return f"{prefix}-{value}"


def check_defaults(defaults: Mapping[str, Any]) -> None:
    """ValueError unless `defaults` maps only `SAMPLING_DEFAULT_KEYS` to numbers (ints for top_k, max_tokens)."""
    for key, value in defaults.items():
        if key not in SAMPLING_DEFAULT_KEYS:
            raise ValueError(f"sampling default {key!r} is not one of {sorted(SAMPLING_DEFAULT_KEYS)}")
        kind = int if key in ("top_k", "max_tokens") else int | float
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ValueError(f"sampling default {key} must be {'an integer' if kind is int else 'a number'}, "
                             f"got {value!r}")  # fmt: skip
