"""Budget-aware closing: a grammar-constrained output that reaches its token budget still parses (issue 14, item 6).

vLLM and SGLang return truncated JSON when `max_tokens` runs out inside a constrained output (a weak model can
write digits or string characters forever). Here a constrained sequence near the end of its budget is steered
onto a short way to finish its grammar, so it ends complete, with finish_reason "stop":

- `closing_path(matcher, limit, prefix)` rolls a copy of the matcher forward greedily: at each step, of the tokens
  the grammar allows, EOS when it may end, else the one whose first byte closes most in the current lexical state
  of the JSON text (tracked over the output's bytes): inside a string the closing quote; outside, `}`, `]`, then
  `:` and `,` towards the next required key, then the shortest values (a digit, `""`), openers last, and no
  further digit after a digit; shorter tokens first among equals. That is how a minimal completion reads: close
  the string, stop the number, close the brackets, write the keys the schema requires (forced by the grammar)
  with minimal values. The path's length is the tokens that finishing needs from here. (For a regex or Lark
  grammar that is not JSON the same preferences apply; a path that does not finish is None: no steering.)
  A grammar's free-text regions (a qwen3_coder tool call's text value) end with a closer string the grammar
  names (`GrammarSpec.closers`); outside a JSON string the rollout writes it first: the token that continues a
  closer already begun, else the longest allowed token that starts one.
- `Steering.next_token` is None while the budget is ample. Near the end of a budget (its window) it computes that
  path, and once the remaining tokens (this one included) no longer exceed the path by `MARGIN`, it returns the
  path's next token and keeps following the path (the runner makes that token the only one allowed). `MARGIN`
  covers what one freely sampled token can add to the path (a token that opens an object or starts a new key).
  Until steering starts the path is recomputed every step once it is near, and more sparsely while the budget
  still exceeds it by a lot (every `slack / (GROWTH + 1)` tokens, assuming a free token adds at most `GROWTH`
  tokens to it, and reserving one jump of the shortest document's length, as when one token starts a further
  tool call), so a sequence pays a handful of rollouts, not one per step.

Once the rest of a path is only EOS the output is complete. A JSON document's grammar then finishes it at once
("stop"). A complete output that may go on is left to the model, except where going on means a whole further
tool call (one token, `,` in a list of calls or a new tag, adds a call to the path): when the grammar's shortest
document is more than EOS (forced tool calls) and the remaining budget is within that document's length plus
`MARGIN`, EOS is forced, since a further call would not fit. Free text (tool_choice "auto", whose shortest
document is EOS alone) is never ended early.

Reserved budget, in short: steering starts when `remaining <= len(path) + MARGIN`, so at most `MARGIN` tokens of the
budget go unused, or, after a complete forced call, the shortest call's length plus `MARGIN`. The window is
`WINDOW` tokens, or twice the grammar's shortest document plus `MARGIN` when that is longer (measured once, at the
sequence's first token). Limits: a budget smaller than the shortest document, an ending that grows past the window
while the model writes (deep nesting opened late), or a grammar whose every path grows (no way to finish), can
still be cut by `max_tokens` (then "length", as before). Under tool_choice "auto" a further call begun in the
last tokens of the budget can still be cut (the parser then gives it back as text). The rollout is host work: a
mask per path token, for each constrained row inside its window; a step outside every window pays nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from astrai.inference.grammar import Matcher, TokenizerView, allocate_bitmask, bitmask_allowed

WINDOW = 64  # the last tokens of a budget in which the closing path is computed
MARGIN = 8  # tokens beyond the closing path at which steering starts
GROWTH = 4  # tokens one freely sampled token is assumed to add to the path at most, to space the recomputations

# Preference of a token by its first byte, in each lexical state of JSON text (the rollout tracks it): inside a
# string the closing quote comes first; outside, the end, then closing brackets, then the separators that lead to
# the next required key, then the shortest values (a digit, an empty string), openers last; right after a digit,
# another digit (or `.`, `e`) is what keeps a number going for ever, so it comes last.
_OUTSIDE = {ord("}"): 100, ord("]"): 90, ord(":"): 60, ord(","): 50, ord('"'): 30, ord("["): 10, ord("{"): 5}
_OUTSIDE.update({d: 40 for d in b"0123456789"} | {c: 20 for c in b"tfn"})
_AFTER_DIGIT = {**_OUTSIDE, **{d: -50 for d in b"0123456789.eE+-"}}
_STRING = {ord('"'): 100}
_PLAIN = 1  # letters and other characters (a string that must grow before it may close)


def _table(prefs: dict[int, int]) -> torch.Tensor:
    table = torch.full((257,), float(_PLAIN))
    for byte, score in prefs.items():
        table[byte] = score
    table[256] = -1e6  # special tokens (no text): only when nothing else is allowed
    return table


_TABLES = {"outside": _table(_OUTSIDE), "digit": _table(_AFTER_DIGIT), "string": _table(_STRING)}


class _Lexer:
    """JSON's lexical state over the chosen tokens' bytes: inside a string (and after a backslash), after a digit."""

    def __init__(self) -> None:
        self.in_string, self.escaped, self.last = False, False, 0

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif b == 0x5C:  # backslash
                    self.escaped = True
                elif b == 0x22:  # quote
                    self.in_string = False
            elif b == 0x22:
                self.in_string = True
            self.last = b

    @property
    def state(self) -> str:
        if self.in_string:
            return "string"
        return "digit" if chr(self.last) in "0123456789.eE+-" else "outside"


EXPANSIONS = 2000  # matcher steps one search for a patterned string's end may take (~10-20 us each at 150k tokens)
CANDIDATES = 4096  # per lexical state, the best-scoring tokens checked first (a full scan only when none is allowed)


class _Preferences:
    """Per view: every token's score in each lexical state, and the best `CANDIDATES` tokens of each in order."""

    def __init__(self, view: TokenizerView) -> None:
        first = torch.full((view.vocab_size,), 256, dtype=torch.long)
        length = torch.zeros(view.vocab_size)
        for i, b in enumerate(view.token_bytes):
            if b:
                first[i], length[i] = b[0], len(b)
        self.score = {state: table[first] - 0.01 * length for state, table in _TABLES.items()}  # shorter first
        self.order = {}
        for state, score in self.score.items():
            ids = torch.sort(-score, stable=True).indices[:CANDIDATES].numpy()  # best first; ties: the lower id
            self.order[state] = (ids, ids >> 5, (ids & 31).astype(np.int32))

    def best(self, state: str, row: torch.Tensor, vocab_size: int) -> int | None:
        """The best-scoring token the bitmask `row` allows in `state` (None: nothing allowed). numpy on the
        candidates: a few microseconds, where torch's per-op overhead cost tens."""
        ids, words, shifts = self.order[state]
        bits = (row.numpy()[words] >> shifts) & 1
        k = int(bits.argmax())
        if bits[k]:
            return int(ids[k])
        allowed = bitmask_allowed(row.unsqueeze(0), vocab_size)[0]
        if not bool(allowed.any()):
            return None
        return int(torch.where(allowed, self.score[state], float("-inf")).argmax())


def _preferences(view: TokenizerView) -> _Preferences:
    cached = getattr(view, "_closing_preferences", None)
    if cached is None:
        cached = view._closing_preferences = _Preferences(view)
    return cached


def _by_bytes(view: TokenizerView) -> dict[bytes, int]:
    cached = getattr(view, "_closing_by_bytes", None)
    if cached is None:
        cached = view._closing_by_bytes = {b: i for i, b in reversed(list(enumerate(view.token_bytes))) if b}
    return cached


def _closer_token(tail: bytes, closers: tuple[bytes, ...], row: torch.Tensor, by_bytes: dict[bytes, int]) -> int | None:
    """The allowed token that writes on a closer: continuing one whose start `tail` ends with (longest start
    first), else starting one; the longest such token. None: no closer fits here."""
    for done in range(max(map(len, closers)) - 1, -1, -1):
        for closer in closers:
            if done >= len(closer) or not tail.endswith(closer[:done]):
                continue
            rest = closer[done:]
            for size in range(len(rest), 0, -1):
                token = by_bytes.get(rest[:size])
                if token is not None and (int(row[token >> 5]) >> (token & 31)) & 1:
                    return token
    return None


def _allows(row: torch.Tensor, ids: np.ndarray) -> bool:
    """Whether the bitmask `row` allows any of `ids` (a handful: a few Python reads beat numpy's overhead)."""
    words = row.numpy()
    return any((int(words[t >> 5]) >> (t & 31)) & 1 for t in ids.tolist())


def _quote_ids(view: TokenizerView) -> np.ndarray:
    """The tokens whose allowance says a JSON string may close here: the quote alone (or, in a vocabulary
    without it, every token that starts with a quote), and EOS (a regex grammar may end in what the lexer reads
    as a string)."""
    cached = getattr(view, "_closing_quotes", None)
    if cached is None:
        quote = _by_bytes(view).get(b'"')
        ids = [quote] if quote is not None else [i for i, b in enumerate(view.token_bytes) if b[:1] == b'"']
        ids += list(view.eos_token_ids)
        cached = view._closing_quotes = np.array([i for i in ids if i < view.vocab_size], dtype=np.int64)
    return cached


# the byte classes a string search branches on, one token per class (the first allowed), in this order; every
# other printable byte but the quote and the backslash (JSON escapes) is a class of its own
_CLASSES = [bytes(range(ord("a"), ord("z") + 1)), b"0123456789", bytes(range(ord("A"), ord("Z") + 1))]
_CLASSES += [bytes([b]) for b in range(0x20, 0x7F) if not any(b in c for c in _CLASSES) and b not in b'"\\']


def _class_tokens(view: TokenizerView) -> tuple[np.ndarray, np.ndarray]:
    """The single-byte tokens of `_CLASSES`' bytes, class by class (in byte order), and each one's class."""
    cached = getattr(view, "_closing_classes", None)
    if cached is None:
        by_bytes = _by_bytes(view)
        pairs = [(t, k) for k, c in enumerate(_CLASSES) for b in c if (t := by_bytes.get(bytes([b]))) is not None]
        cached = view._closing_classes = (np.array([t for t, _ in pairs], dtype=np.int64),
                                          np.array([k for _, k in pairs], dtype=np.int64))  # fmt: skip
    return cached


def _branches(words: np.ndarray, ids: np.ndarray, classes: np.ndarray) -> list[int]:
    """The first token of each byte class that the bitmask `words` allows, in class order."""
    allowed = ((words[ids >> 5] >> (ids & 31)) & 1).astype(bool)
    _, first = np.unique(classes[allowed], return_index=True)
    return ids[allowed][first].tolist()


def _skeleton(data: bytes) -> bytes:
    """The punctuation of a string's text, in order: where a patterned string stands in its structure."""
    return bytes(b for b in data if not (48 <= b <= 57 or 65 <= b <= 90 or 97 <= b <= 122))


def _finish_string(matcher, row: torch.Tensor, view: TokenizerView, limit: int) -> list[int] | None:
    """The shortest token sequence (at most `limit`) after which a string the grammar holds open may close.

    The greedy rollout would loop in a patterned string (`[a-z]+@...` writes the lowest letter for ever), so here a
    breadth-first search runs over copies of the llguidance matcher `matcher` (whose mask is `row`): each state
    branches on the first allowed single-byte token of each byte class (a letter, a digit, a capital, each
    punctuation byte) and on the greedy choice; a child whose mask equals a sibling's is dropped (`!` where `a`
    does the same), and so is a state whose mask and punctuation (`_skeleton`) another state of its depth has.
    The first state that allows a closing quote (or EOS) ends it: `a@a.aa` for an email, `0001-01-01` for a
    date. At most `EXPANSIONS` matcher steps; None when no end is found within them (the greedy rollout goes on)."""
    prefs, classes, quotes = _preferences(view), _class_tokens(view), _quote_ids(view)
    layer = [(matcher, row.clone(), [], b"")]
    steps = 0
    for _ in range(limit):
        seen: set[tuple[bytes, bytes]] = set()
        nxt = []
        for node, mask, tokens, skeleton in layer:
            branches = _branches(mask.numpy(), *classes)
            best = prefs.best("string", mask, view.vocab_size)
            if best is not None and best not in branches:
                branches.append(best)
            siblings: set[bytes] = set()
            for token in branches:
                steps += 1
                if steps > EXPANSIONS:
                    return None
                child = node.deep_copy()
                if not child.consume_token(token) or child.is_error():
                    continue
                child_mask = allocate_bitmask(1, view.vocab_size)[0]
                child.unsafe_compute_mask_ptr(child_mask.data_ptr(), child_mask.numel() * 4)
                if child.is_error():
                    continue
                if child.is_stopped() or _allows(child_mask, quotes):
                    return [*tokens, token]
                key = child_mask.numpy().tobytes()
                shape = skeleton + _skeleton(view.token_bytes[token])
                if key in siblings or (key, shape) in seen:
                    continue
                siblings.add(key)
                seen.add((key, shape))
                nxt.append((child, child_mask, [*tokens, token], shape))
        if not nxt:
            return None
        layer = nxt
    return None


def closing_path(matcher: Matcher, limit: int, prefix: bytes = b"", closers: tuple[str, ...] = ()) -> list[int] | None:
    """The greedy closing path from `matcher`'s state (ending with EOS, or where the grammar stops), at most
    `limit` tokens; None when it does not finish within `limit`, or the matcher fails on the way (or already has).

    `prefix`: the output's text so far, to know whether the rollout starts inside a string or a number.
    `closers`: the strings that end the grammar's free-text regions (`GrammarSpec.closers`)."""
    return rollout(matcher, limit, prefix, closers)[0]


def rollout(matcher: Matcher, limit: int, prefix: bytes = b"",
            closers: tuple[str, ...] = ()) -> tuple[list[int] | None, str | None, int]:  # fmt: skip
    """`closing_path`, and why it found none: (path or None, llguidance's error if a copy of the matcher failed on
    the way, else None; tokens rolled before it stopped). `grammar_check` reads the error (a grammar that fails on
    its own shortest path is refused); a matcher already in an error state fails at once, with 0 tokens."""
    view = matcher.grammar.view
    prefs = _preferences(view)
    lexer = _Lexer()
    lexer.feed(prefix)
    ends = tuple(c.encode() for c in closers if c)
    tail = prefix[-max(map(len, ends)) :] if ends else b""
    m = matcher.ll.deep_copy()
    row = allocate_bitmask(1, view.vocab_size)
    path: list[int] = []
    while len(path) < limit:
        if m.is_error():  # an errored matcher's mask allows EOS alone: that is no way to finish
            return None, m.get_error(), len(path)
        if m.is_stopped():
            return path, None, len(path)
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if m.is_error():  # e.g. no token continues the output (an empty language), or a resource limit
            return None, m.get_error(), len(path)
        eos = [t for t in view.eos_token_ids if t < view.vocab_size and (int(row[0, t >> 5]) >> (t & 31)) & 1]
        if eos:
            return [*path, eos[0]], None, len(path)
        if lexer.state == "string" and not _allows(row[0], _quote_ids(view)):  # a patterned string: search its end
            rest = _finish_string(m, row[0], view, limit - len(path))
            if rest:
                for token in rest:
                    m.consume_token(token)  # taken on a copy along the same path: it cannot fail here
                    path.append(token)
                    lexer.feed(view.token_bytes[token])
                continue
        token = _closer_token(tail, ends, row[0], _by_bytes(view)) if ends and lexer.state != "string" else None
        token = prefs.best(lexer.state, row[0], view.vocab_size) if token is None else token
        if token is None:
            return None, None, len(path)
        path.append(token)
        data = view.token_bytes[token] if token < len(view.token_bytes) else b""
        lexer.feed(data)
        tail = (tail + data)[-max(map(len, ends)) :] if ends else b""
        if not m.consume_token(token):
            return None, m.get_error() or "the grammar refused its own allowed token", len(path)
    return None, None, len(path)


class Steering:
    """One constrained sequence's closing state: the path it follows once steering started.

    Attributes:
        steered: a token was forced (the completion's `stop_reason` says "budget").
    """

    __slots__ = ("path", "start", "steered", "window", "shortest", "next_check")

    def __init__(self) -> None:
        self.path: list[int] = []
        self.start = 0  # tokens the sequence had produced when `path` was computed
        self.steered = False
        self.window: int | None = None  # WINDOW, or twice the grammar's shortest document + MARGIN if longer
        self.shortest = 0  # tokens of the grammar's shortest document (1: it may end at once, as free text may)
        self.next_check = 0  # tokens produced at which the path is computed again

    def next_token(self, matcher: Matcher, produced: int, remaining: int, prefix: bytes = b"",
                   closers: tuple[str, ...] = ()) -> int | None:  # fmt: skip
        """The token to force now (None: sample freely).

        Args:
            matcher: the sequence's matcher (at `produced` tokens).
            produced: tokens generated so far.
            remaining: tokens the budget still allows, this one included.
            prefix: the bytes of the tokens generated so far (`closing_path`'s lexical state).
            closers: the grammar's closers (`GrammarSpec.closers`).
        """
        eos = matcher.grammar.view.eos_token_ids
        step = produced - self.start
        if self.path and 0 < step < len(self.path) and self.path[step] not in eos:
            return self.path[step]  # following the path: the tokens before were its own
        if self.window is None:  # once per sequence: a grammar whose shortest document is long opens it earlier
            shortest = len(closing_path(matcher, 4 * WINDOW, prefix, closers) or ()) if produced == 0 else 0
            self.shortest, self.window = shortest, max(WINDOW, 2 * shortest + MARGIN)
        if remaining > self.window or produced < self.next_check:
            return None
        # past the budget too: the shortest is still best
        path = closing_path(matcher, remaining + WINDOW, prefix, closers)
        if path is not None and not path:  # the grammar already stopped: nothing to force (the scheduler ends it)
            return None
        if path is not None and path[0] in eos:  # complete as it stands
            self.path = []
            if self.shortest > 1 and remaining <= self.shortest + MARGIN:  # a further call would not fit: end here
                self.steered = True
                return path[0]
            return None  # free text (tool_choice "auto"), or room for more: a cut would not break it
        if path is None or len(path) + MARGIN < remaining:
            # far from the end: the path can grow by at most GROWTH a token, plus one jump of a whole further call
            # where the grammar repeats (reserved as its shortest document), so check again when it could matter
            jump = self.shortest if self.shortest > 1 else 0
            slack = remaining - MARGIN - jump - (len(path) if path is not None else 0)
            self.path, self.next_check = [], produced + max(1, slack // (GROWTH + 1))
            return None
        self.path, self.start, self.steered = path, produced, True
        return path[0]
