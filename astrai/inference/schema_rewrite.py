"""JSON Schema as validators read it, before llguidance compiles it: ECMA-262 classes and validator-safe formats.

Two gaps between llguidance and the validators that check a constrained output (pydantic, jsonschema's
FormatChecker), closed by rewriting the schema or pattern text before it is compiled (issue 41, item 6):

- Regex classes. JSON Schema patterns are ECMA-262 regexes, where `\\d` is `[0-9]` and `\\w` is `[0-9A-Za-z_]`;
  llguidance reads patterns with Rust `regex` semantics, where both are Unicode classes (`\\d` admits '٣', a
  digit that `int()` and pydantic's ASCII parsers reject). `ecma_regex` spells them out as ASCII classes (and
  `\\D`, `\\W` as their negations), inside and outside brackets; other escapes (`\\\\d` is a backslash and a `d`)
  are left as they are. It applies to schema `pattern`s, `patternProperties` keys, and `guided_regex`.
- Formats. llguidance's own `date`, `time` and `date-time` regexes admit year 0000, February 29 of every year and
  second 60 (pydantic's `date`/`datetime`/`time` refuse all three), and its `email` admits a domain without a dot
  (`a@b`, which email-validator, behind pydantic's `EmailStr`, refuses). Those four formats are replaced by the
  patterns below: years 0001-9999, the days of each month with February 29 only in leap years, seconds 00-59,
  at most 6 fraction digits (microseconds, what Python's `datetime` keeps), `T` and `Z` upper case, and an email
  whose domain has a dot and a letters-only top-level label. Each admits a subset of what RFC 3339 / RFC 5321
  allow, so a schema's meaning only narrows, and budget-aware closing (`closing.py`), whose shortest completion
  follows the grammar, fills such a string with a value the validators take (`0001-01-01`, `a@a.aa`). A node that
  has its own `pattern` too keeps both: the format's pattern joins it in an `allOf`. Other formats llguidance
  knows (`uri`, `uuid`, `duration`, `hostname`, `ipv4`, `ipv6`) keep its regexes; a format it does not know is
  dropped, as JSON Schema reads unknown formats: an annotation, not an error (llguidance would refuse the schema,
  so pydantic's `SecretStr` or `Path` fields were a 400).

Only schema positions are rewritten (`properties`, `items`, `anyOf`, `$defs`, ...): `const`, `enum`, `default`
and `examples` values are data and stay as they are.
"""

from __future__ import annotations

from typing import Any

_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001-9999
_LEAP = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"  # 0000 excluded
_MONTH_DAY = ("(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
              "|02-(?:0[1-9]|1[0-9]|2[0-8]))")  # fmt: skip
_DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP}-02-29)"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_ATOM = "[a-zA-Z0-9_+-]+"
_LABEL = "[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?"
_EMAIL = rf"{_ATOM}(?:\.{_ATOM})*@(?:{_LABEL}\.)+[a-zA-Z]{{2,}}"

FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "email": f"^{_EMAIL}$",
}


def _other_words(words: tuple[str, ...], first: str, rest: str) -> str:
    """A regex of the strings of one `first` character then `rest` characters, other than `words` (lower case;
    matched without case), built over the words' trie, since Rust regex has no lookahead."""

    def chars(pool: str, but: str) -> str:
        kept = "".join(c for c in pool if c.lower() not in but)
        return "[" + kept.replace("-", "") + ("-" if "-" in kept else "") + "]"

    def node(prefix: str) -> str:
        kids = "".join(sorted({w[len(prefix)] for w in words if w.startswith(prefix) and len(w) > len(prefix)}))
        alts = [chars(rest if prefix else first, kids) + chars(rest, "") + "*"]
        alts += [f"{k}{node(prefix + k)}" for k in kids]
        end = "" if prefix in words or not prefix else "|"  # a word's own prefix is a scheme of its own
        return "(?:" + "|".join(alts) + end + ")"

    return "(?i:" + node("") + ")"


# pydantic's AnyUrl (the WHATWG URL parser) needs a host after a special scheme, where RFC 3986 takes `http:`
# alone: a `uri` keeps llguidance's format and gains this pattern (in an `allOf`): such a scheme is followed by
# `//` and the host's first character (a letter, digit or `[`); any other scheme by its `:`.
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
_SPECIAL = ("http", "https", "ws", "wss", "ftp")
_OTHER_SCHEME = _other_words(_SPECIAL, _LETTERS, _LETTERS + "0123456789+.-")
URI_GUARD = rf"^(?:(?i:https?|wss?|ftp)://[a-zA-Z0-9\[]|{_OTHER_SCHEME}:)"
# formats llguidance compiles itself (parser/src/json/formats.rs); any other is dropped as an annotation
LLGUIDANCE_FORMATS = frozenset({"uri", "uuid", "duration", "hostname", "ipv4", "ipv6", "unknown"})

_ASCII = {"d": "0-9", "w": "0-9A-Za-z_"}


def ecma_regex(pattern: str) -> str:
    """`pattern` with ECMA-262's ASCII `\\d`, `\\D`, `\\w`, `\\W` spelled out for Rust regex semantics.

    Outside brackets `\\d` becomes `[0-9]` and `\\D` `[^0-9]`; inside, `[\\da-f]` becomes `[0-9a-f]` and `[\\D]` a
    nested `[^0-9]` (Rust regex nests classes). Every other escape, an escaped backslash included, is copied."""
    out: list[str] = []
    depth, i, n = 0, 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            i += 2
            if e.lower() in _ASCII:
                chars = _ASCII[e.lower()]
                out.append((f"[{chars}]" if depth == 0 else chars) if e.islower() else f"[^{chars}]")
            else:
                out.append(c + e)
            continue
        if c == "[":
            depth += 1
            out.append(c)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":  # a leading `]` is a literal (Rust regex)
                out.append("]")
                i += 1
            continue
        if c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


_SCHEMA = ("items", "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems",
           "contains", "propertyNames", "not", "if", "then", "else")  # fmt: skip
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")


def rewrite_schema(schema: Any) -> Any:
    """A copy of `schema` with ECMA-262 patterns and validator-safe formats (the module's docstring); `schema`
    itself is not changed. Anything that is not a schema object (a boolean schema) is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = rewrite_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [rewrite_schema(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: rewrite_schema(s) for name, s in out[key].items()}
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {ecma_regex(p): rewrite_schema(s) for p, s in out["patternProperties"].items()}
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ecma_regex(out["pattern"])
    fmt = out.get("format")
    if fmt == "uri":
        out["allOf"] = [*(out["allOf"] if isinstance(out.get("allOf"), list) else []), {"pattern": URI_GUARD}]
    if isinstance(fmt, str) and fmt not in LLGUIDANCE_FORMATS:
        del out["format"]
        pattern = FORMAT_PATTERNS.get(fmt)
        if pattern is not None and "pattern" in out:
            out["allOf"] = [*(out["allOf"] if isinstance(out.get("allOf"), list) else []), {"pattern": pattern}]
        elif pattern is not None:
            out["pattern"] = pattern
    return out
