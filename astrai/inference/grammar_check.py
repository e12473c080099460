"""Admission check of a grammar: it must admit a complete output, or the request is a 400 naming its field.

llguidance checks a grammar's syntax when it compiles, not whether the grammar can ever end. A grammar that accepts
no finite string either fails on its first mask (`{"$ref": "#"}`: nothing can start it; llguidance's error state
then allows only EOS) or lets the model write for ever without reaching an accepting state (`start: "a" start`,
an array whose items must again be such arrays); some grammars also exhaust llguidance's resource limits on the
way (`a{1000000}`). Served, such a request used to end the engine thread (the closing path of an errored matcher is
empty) or return invalid output labelled complete. `check_grammar` runs before a request is queued:

1. The closing rollout (`closing.rollout`, the path budget-aware closing steers a sequence onto near the end of its
   budget) from the start state, up to `SEARCH_LIMIT` tokens. A path that ends in EOS proves a complete output
   exists; its length is kept on the `Grammar` (`shortest`), which also marks the cached grammar as checked.
2. Otherwise a static analysis of the grammar text (`never_completes`): the least fixpoint of productive rules
   (Lark, also GBNF, converted by llguidance's own converter) and of productive schemas (JSON schema `$ref`
   targets, also the `%json` schemas of tool grammars). A rule or schema is productive when one of its
   alternatives needs only terminals and productive parts; a grammar whose start is not productive accepts no
   finite string. Anything the analysis does not model (a template, a remote `$ref`, an unknown keyword) counts as
   productive, so it never refuses a grammar that can end.
3. A rollout that stopped on a matcher error (a resource limit, or no token at the first step) also refuses the
   grammar, with llguidance's reason: the first sequence to take that path would fail the same way.
A grammar whose rollout merely ran past the limit and that the analysis cannot prove empty is served; should a
sequence's matcher fail later anyway, only that request ends with an error (docs/serving.md).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from astrai.inference import closing
from astrai.inference.grammar import (
    Grammar,
    GrammarError,
    TokenizerView,
    compile_grammar,
    error_summary,
    new_matcher,
)

SEARCH_LIMIT = 4 * closing.WINDOW  # tokens of the start-state rollout (as far as Steering measures the shortest)
_MAX_ROUNDS = 256  # fixpoint rounds before the analysis gives up (then: productive, nothing refused)


def compile_checked(view: TokenizerView, source: str, closers: tuple[str, ...] = ()) -> Grammar:
    """`compile_grammar`, then `check_grammar` once per cached grammar; a grammar that fails is dropped from the
    cache (a later request compiles it afresh: llguidance's lazily built lexer is shared by the copies of one
    compiled grammar, so its resource limits are spent by all of them together).

    Raises:
        GrammarError: the grammar does not compile, or admits no complete output (the message says why).
    """
    grammar = compile_grammar(view, source)
    if grammar.shortest is None:
        try:
            check_grammar(grammar, closers)
        except GrammarError:
            grammar.forget()
            raise
    return grammar


def check_grammar(grammar: Grammar, closers: tuple[str, ...] = ()) -> int:
    """Refuse a grammar that admits no complete output (see the module); returns (and stores as
    `grammar.shortest`) the tokens of the complete output the rollout found, 0 when none within `SEARCH_LIMIT`.

    Raises:
        GrammarError: the grammar accepts no finite string, or its matcher fails on the way to the first one.
    """
    path, error, steps = closing.rollout(new_matcher(grammar), SEARCH_LIMIT, b"", closers)
    if path is not None:
        grammar.shortest = len(path)
        return len(path)
    why = never_completes(grammar.source)
    if why is not None:
        raise GrammarError(f"the grammar accepts no complete output: {why}")
    if error is not None:
        if steps == 0:
            raise GrammarError(f"the grammar allows no output at all: {error_summary(error)}")
        raise GrammarError(f"the grammar engine fails on the way to this grammar's shortest output, after {steps} "
                           f"token(s): {error_summary(error)}")  # fmt: skip
    grammar.shortest = 0
    return 0


# ---- static analysis: does the grammar's start derive a finite string? -----------------------------------------
def never_completes(source: str) -> str | None:
    """Why the llguidance grammar text `source` accepts no finite string, or None (it does, or it is beyond what
    the analysis models). `source` is what `grammar.grammar_source` returns: a JSON object of `grammars` (a JSON
    schema or Lark text each), or Lark text."""
    try:
        top = json.loads(source) if source.lstrip().startswith("{") else None
    except ValueError:
        top = None
    try:
        if isinstance(top, dict) and isinstance(top.get("grammars"), list) and top["grammars"]:
            first = top["grammars"][0]  # the start grammar; others are named sub-grammars
            if isinstance(first, dict) and "json_schema" in first and first["json_schema"] is not None:
                return None if _schema_productive(first["json_schema"]) else _SCHEMA_WHY
            if isinstance(first, dict) and isinstance(first.get("lark_grammar"), str):
                return _lark_why(first["lark_grammar"])
            return None
        return _lark_why(source)
    except RecursionError:  # a schema nested past Python's stack: not modelled
        return None


_SCHEMA_WHY = ("every value the JSON schema allows must contain another such value (a `$ref` cycle through "
               "required properties, minItems or allOf), so no finite JSON document matches it")  # fmt: skip


def _schema_productive(schema: Any) -> bool:
    """Whether some finite JSON value matches `schema` (least fixpoint over its local `$ref` targets)."""
    targets: dict[str, bool] = {}
    _collect_refs(schema, targets)
    for _ in range(_MAX_ROUNDS):
        changed = False
        for ref in targets:
            if not targets[ref]:
                node = _resolve(schema, ref)
                if _node_ok(node, targets):
                    targets[ref], changed = True, True
        if not changed:
            return _node_ok(schema, targets)
    return True


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `$ref` ("#", "#/$defs/a", JSON pointer escapes) names; True (anything) when not found."""
    node = root
    for part in ref[2:].split("/") if ref.startswith("#/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return True
    return node


def _collect_refs(node: Any, targets: dict[str, bool]) -> None:
    """Every local `$ref` in the tree (a target is itself in the tree, so walking the tree reaches its refs)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            targets[ref] = False
        for value in node.values():
            _collect_refs(value, targets)
    elif isinstance(node, list):
        for value in node:
            _collect_refs(value, targets)


def _node_ok(node: Any, refs: dict[str, bool]) -> bool:
    """One schema node, with `refs` saying which local `$ref` targets are known productive so far."""
    if node is False:
        return False
    if not isinstance(node, dict) or "const" in node or node.get("enum"):
        return True  # true, {}, a value to write as it is, or something not modelled

    def ok(sub: Any) -> bool:
        return _node_ok(sub, refs)

    ref = node.get("$ref")
    if isinstance(ref, str) and not refs.get(ref, True):  # a remote or anchor ref is not modelled: productive
        return False
    if isinstance(node.get("allOf"), list) and not all(map(ok, node["allOf"])):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and node[key] and not any(map(ok, node[key])):
            return False
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list):
        return True  # no type: a scalar will do
    return any(_type_ok(t, node, ok) for t in types)


def _type_ok(kind: Any, node: dict, ok: Callable[[Any], bool]) -> bool:
    if kind == "array":
        need = node.get("minItems", 0)
        items = node.get("items", True)
        prefix = node.get("prefixItems", items if isinstance(items, list) else [])
        rest = node.get("additionalItems", True) if isinstance(items, list) else items
        if not isinstance(need, int) or not isinstance(prefix, list):
            return True
        if not all(map(ok, prefix[:need])) or (need > len(prefix) and not ok(rest)):
            return False
        return "contains" not in node or node.get("minContains", 1) == 0 or ok(node["contains"])
    if kind == "object":
        props, required = node.get("properties", {}), node.get("required", [])
        if not isinstance(props, dict) or not isinstance(required, list) or node.get("patternProperties"):
            return True
        extra = node.get("additionalProperties", True)
        return all(ok(props.get(name, extra)) for name in required if isinstance(name, str))
    return True  # null, boolean, number, integer, string (their own constraints are llguidance's to check)


# ---- Lark (llguidance's dialect) ------------------------------------------------------------------------------
_LARK_TOKEN = re.compile(
    r"""(?P<skip>[ \t\f\r]+|\\\n|//[^\n]*)
      | (?P<nl>\n)
      | (?P<string>"(?:\\.|[^"\\])*"i?)
      | (?P<regex>/(?:\\.|[^/\\\n])+/[imslux]*)
      | (?P<special><[^<>\s]*>)
      | (?P<directive>%[A-Za-z_]+)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<number>\d+)
      | (?P<op>->|\.\.|[:|()\[\]?*+~{},.&=!-])""",
    re.X,
)


class _Unmodelled(Exception):
    """Lark the analysis does not read (a template, a nested grammar): the grammar counts as productive."""


def _lark_tokens(text: str) -> list[tuple[str, Any]]:
    """(kind, value) pairs; `%json` / `%regex` / `%llguidance` take the JSON object that follows them whole."""
    out: list[tuple[str, Any]] = []
    at, decoder = 0, json.JSONDecoder()
    while at < len(text):
        m = _LARK_TOKEN.match(text, at)
        if m is None:
            raise _Unmodelled(f"unexpected {text[at : at + 10]!r}")
        at = m.end()
        kind = m.lastgroup
        if kind == "skip":
            continue
        if kind == "directive" and m.group() in ("%json", "%regex", "%llguidance"):
            while at < len(text) and text[at] in " \t":
                at += 1
            value, at = decoder.raw_decode(text, at)
            out.append((m.group(), value))
            continue
        out.append((kind, m.group()))
    return out


def _lark_why(text: str) -> str | None:
    try:
        rules = _lark_rules(_lark_tokens(text))
    except (_Unmodelled, ValueError, IndexError):
        return None
    if "start" not in rules:
        return None
    productive: set[str] = set()
    names = list(reversed(rules))  # grammars are written top-down: bottom-up converges in fewer rounds
    for _ in range(_MAX_ROUNDS):
        grown = {n for n in names if n not in productive and _expr_ok(rules[n], productive, rules)}
        if not grown:
            break
        productive |= grown
    else:
        return None
    if "start" in productive:
        return None
    dead = sorted(n for n in rules if n not in productive and n[0].islower())
    named = ", ".join(dead[:5]) + (", ..." if len(dead) > 5 else "")
    return (f"no way through the rule(s) {named} ends (each of their alternatives needs one of them again), and "
            "start is one of them, so every output goes on for ever")  # fmt: skip


def _lark_rules(tokens: list[tuple[str, Any]]) -> dict[str, Any]:
    """Rule name -> expression tree, from the statements of the grammar (a statement starts on a new line, except
    a line that starts with `|`, which continues the alternatives; newlines inside brackets continue too)."""
    statements: list[list[tuple[str, Any]]] = [[]]
    depth = 0
    for i, (kind, value) in enumerate(tokens):
        if kind == "nl":
            nxt = tokens[i + 1] if i + 1 < len(tokens) else None
            if depth == 0 and not (nxt is not None and nxt == ("op", "|")):
                statements.append([])
            continue
        depth += value in ("(", "[") if kind == "op" else 0
        depth -= value in (")", "]") if kind == "op" else 0
        statements[-1].append((kind, value))
    rules: dict[str, Any] = {}
    for st in filter(None, statements):
        if st[0][0] in ("directive", "%llguidance"):
            continue  # %ignore, %import (its names stay unknown: productive), %llguidance options
        if st[0][0] != "name":
            raise _Unmodelled("a statement that is not a rule")
        at = 1
        if st[at] == ("op", "."):  # priority
            at += 2
        if st[at] == ("op", "["):  # attributes: [lazy], [stop="..."], [max_tokens=N]
            while st[at] != ("op", "]"):
                at += 1
            at += 1
        if st[at] != ("op", ":"):
            raise _Unmodelled("a rule head the analysis does not read")
        expr, end = _alternatives(st, at + 1)
        if end != len(st):
            raise _Unmodelled("trailing tokens")
        rules[st[0][1]] = ("term",) if st[0][1].isupper() else expr  # a terminal is a lexeme: llguidance's part
    return rules


def _alternatives(st: list, at: int) -> tuple[Any, int]:
    alts = []
    while True:
        seq, at = _sequence(st, at)
        alts.append(seq)
        if at < len(st) and st[at] == ("op", "|"):
            at += 1
            continue
        return ("alt", alts), at


def _sequence(st: list, at: int) -> tuple[Any, int]:
    items = []
    while at < len(st) and st[at] not in (("op", "|"), ("op", ")"), ("op", "]")):
        if st[at] == ("op", "->"):  # an alias names the alternative
            at += 2
            continue
        if st[at] in (("op", "&"), ("op", "~")):  # lexeme intersection / negation: regular, llguidance's part
            at += 1
            continue
        item, at = _atom(st, at)
        items.append(item)
    return ("seq", items), at


def _atom(st: list, at: int) -> tuple[Any, int]:
    kind, value = st[at]
    if (kind, value) in (("op", "("), ("op", "[")):
        inner, at = _alternatives(st, at + 1)
        if st[at] != ("op", ")" if value == "(" else "]"):
            raise _Unmodelled("unbalanced brackets")
        item, at = (inner if value == "(" else ("term",)), at + 1
    elif kind == "name":
        item, at = ("ref", value), at + 1
    elif kind == "%json":
        item, at = (("term",) if _schema_productive(value) else ("dead",)), at + 1
    elif kind in ("string", "regex", "special", "%regex"):
        item, at = ("term",), at + 1
        if at + 1 < len(st) and st[at] == ("op", "..") and st[at + 1][0] == "string":  # a character range
            at += 2
    else:
        raise _Unmodelled(f"unexpected {value!r}")
    while at < len(st):  # postfix repetitions: may the item appear zero times?
        kind, value = st[at]
        if (kind, value) in (("op", "?"), ("op", "*")):
            item, at = ("term",), at + 1
        elif (kind, value) == ("op", "+"):
            at += 1
        elif (kind, value) == ("op", "~") and at + 1 < len(st) and st[at + 1][0] == "number":
            item = ("term",) if int(st[at + 1][1]) == 0 else item
            at += 4 if at + 2 < len(st) and st[at + 2] == ("op", "..") else 2
        elif (kind, value) == ("op", "{") and at + 1 < len(st) and st[at + 1][0] in ("number", "op"):
            low = st[at + 1][1] if st[at + 1][0] == "number" else "0"
            item = ("term",) if int(low) == 0 else item
            while st[at] != ("op", "}"):
                at += 1
            at += 1
        else:
            break
    return item, at


def _expr_ok(expr: Any, productive: set[str], rules: dict[str, Any]) -> bool:
    tag = expr[0]
    if tag == "term":
        return True
    if tag == "dead":
        return False
    if tag == "ref":
        return expr[1] in productive or expr[1] not in rules  # an undefined (imported) name: not modelled
    if tag == "seq":
        return all(_expr_ok(e, productive, rules) for e in expr[1])
    return any(_expr_ok(e, productive, rules) for e in expr[1])  # alt
