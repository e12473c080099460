"""A cheap lower bound on a text's token count, so an over-long prompt is refused before the chat template renders
or the tokenizer runs.

One token covers at most `TextBound.chars_per_token` characters of input: the longest vocabulary entry (added and
special tokens included) in characters, times what the normalizer can shrink text by. A byte-level BPE vocabulary
spells each byte as one character, so an entry's length is its bytes, never fewer than the characters it decodes
to; a SentencePiece `<0x41>` byte token is longer than the one byte it covers. So `ceil(chars / chars_per_token)`
never exceeds the true count: a text over `context * chars_per_token` characters cannot fit, and `check_text_fits`
refuses it without tokenizing, in the routes' context-overflow shape (code `context_length_exceeded`).

Where the tokenizer can drop characters without a token, the count leaves them out (`TextBound.count`): whitespace,
when a pre-tokenizer splits it off (BERT, `Whitespace`) or an added token strips its neighbours (`lstrip`/`rstrip`).
Where one token can cover an unbounded run, or characters can vanish, there is no bound (`text_bound` is None) and
nothing is refused early: unknown characters without byte tokens (dropped by a BPE without an unknown token, fused
into one by Unigram or a `fuse_unk` BPE, a whole unsplittable word as WordPiece's [UNK]), a word-level model, a
normalizer that deletes or regex-replaces text. The facts are computed once per tokenizer (`text_bound`, cached)
from its serialized pipeline.

Chat prompts: templates may drop parts of a conversation (Qwen3 drops earlier turns' reasoning), so the first,
pre-render check counts only text every template renders: the user turns and the pre-fill (`user_texts`). When the
body's strings as a whole could exceed the bound, the conversation is rendered (cheap: string concatenation) and
the rendered text is checked before it is tokenized (`chat_prompt.encode_messages`).
"""

from __future__ import annotations

import json
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenizers import pre_tokenizers

from astrai.serve.common import APIError
from astrai.serve.sampling_fields import CONTEXT_LENGTH_EXCEEDED

if TYPE_CHECKING:
    from astrai.io.tokenizer import Tokenizer

# what each normalizer can shrink a text by (None: unbounded); NFC/NFKC compose at most 4 characters into one
# (U+1F87 is 4 canonically), decompositions, lowercasing and prefixes only add characters
_NORMALIZER_SHRINK = {"NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1, "NFC": 4, "NFKC": 4}
# pre-tokenizers that keep every character (the others, e.g. Whitespace or BertPreTokenizer, may drop whitespace)
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


@dataclass(frozen=True)
class TextBound:
    """How many input characters one token can cover at most, and whether whitespace may vanish untokenized."""

    chars_per_token: int
    drops_whitespace: bool = False

    def count(self, text: str) -> int:
        """The characters of `text` that some token must cover (all of them, or those that are not whitespace)."""
        if not self.drops_whitespace:
            return len(text)
        # str.split drops every str.isspace character, a superset of the Unicode White_Space tokenizers drop
        return len("".join(text.split()))

    def min_tokens(self, chars: int) -> int:
        """The fewest tokens `chars` counted characters can encode to."""
        return math.ceil(chars / self.chars_per_token)


def _normalizer_shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind == "Replace":  # a literal pattern replaced by a non-empty content shrinks by at most their ratio
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if not literal or not content:
            return None
        return max(1, math.ceil(len(literal) / len(content)))
    return _NORMALIZER_SHRINK.get(kind)


def _pre_tokenizer_drops(spec: dict | None) -> bool:
    if spec is None:
        return False
    kind = spec.get("type")
    if kind == "Sequence":
        return any(_pre_tokenizer_drops(p) for p in spec.get("pretokenizers", []))
    if kind == "Split":
        return spec.get("behavior") == "Removed"
    return kind not in _KEEPING_PRE_TOKENIZERS


def _covers_bytes(vocab: dict[str, int], pre: dict | None, model: dict) -> bool:
    """Whether every byte has a token: byte-fallback `<0xXX>` tokens, or a byte-level vocabulary's 256 characters."""
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True
    return "ByteLevel" in json.dumps(pre) and all(c in vocab for c in pre_tokenizers.ByteLevel.alphabet())


def _model_reach(model: dict, vocab: dict[str, int], pre: dict | None) -> int | None:
    """Characters one token of the model can cover beyond its vocabulary entries (0: none; None: unbounded)."""
    kind = model.get("type")
    if _covers_bytes(vocab, pre, model):
        return 0  # an unknown character becomes its bytes' tokens
    if kind == "BPE":  # an unknown character is one unknown token, fused runs of them are one, or it is dropped
        return 0 if model.get("unk_token") is not None and not model.get("fuse_unk") else None
    return None  # WordPiece: an unsplittable word of any length is one [UNK]; Unigram fuses unknowns; WordLevel


def compute_text_bound(tokenizer: Tokenizer) -> TextBound | None:
    """The tokenizer's `TextBound` from its serialized pipeline and vocabulary, or None when it has none."""
    spec = json.loads(tokenizer.backend.to_str())
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    shrink = _normalizer_shrink(spec.get("normalizer"))
    reach = _model_reach(spec.get("model", {}), vocab, spec.get("pre_tokenizer"))
    if shrink is None or reach is None:
        return None
    longest = max((len(t) for t in vocab), default=1)
    added = spec.get("added_tokens") or []
    strips = any(t.get("lstrip") or t.get("rstrip") for t in added)
    drops = strips or _pre_tokenizer_drops(spec.get("pre_tokenizer"))
    return TextBound(max(longest, reach, 1) * shrink, drops)


_BOUNDS: weakref.WeakKeyDictionary[Any, TextBound | None] = weakref.WeakKeyDictionary()


def text_bound(tokenizer: Tokenizer | None) -> TextBound | None:
    """`compute_text_bound`, computed once per tokenizer object (None without a tokenizer)."""
    if tokenizer is None:
        return None
    try:
        return _BOUNDS[tokenizer]
    except KeyError:
        bound = _BOUNDS[tokenizer] = compute_text_bound(tokenizer)
        return bound


def tokens_over(texts: str | list[str] | tuple[str, ...], tokenizer: Tokenizer | None, context: int, *,
                generate: bool = True) -> int | None:  # fmt: skip
    """The least number of tokens `texts` encode to when that is already more than `context` holds (less one for
    the completion when `generate`), else None (they may fit, or the tokenizer has no bound)."""
    bound = text_bound(tokenizer)
    if bound is None:
        return None
    items = [texts] if isinstance(texts, str) else texts
    if bound.min_tokens(sum(len(t) for t in items)) <= context - generate:  # fits on raw length: the usual case
        return None
    least = bound.min_tokens(sum(bound.count(t) for t in items))
    return least if least > context - generate else None


def check_text_fits(texts: str | list[str] | tuple[str, ...], tokenizer: Tokenizer | None, context: int, param: str,
                    *, what: str | None = None, generate: bool = True) -> None:  # fmt: skip
    """Refuse `texts` before tokenizing when their characters alone need more tokens than `context` holds.

    Args:
        texts: the input text(s) that must all be encoded together (one prompt, or one conversation's user turns).
        tokenizer: the served tokenizer (None, or one without a `TextBound`: nothing is checked).
        context: tokens one sequence may hold.
        param: the field the error names (`messages`, `prompt`, `input`).
        what: the prompt's name in the message (default `param`; `prompt[2]` for a list item).
        generate: a completion follows, so a prompt of exactly `context` tokens is already too long.

    Raises:
        APIError: 400 with code `context_length_exceeded` in `sampling_fields.context_exceeded`'s wording, giving
            the lower bound ("at least N tokens") as the prompt's count.
    """
    least = tokens_over(texts, tokenizer, context, generate=generate)
    if least is not None:
        what = what or param
        chars = sum(len(t) for t in ([texts] if isinstance(texts, str) else texts))
        raise APIError(400, f"This model's maximum context length is {context} tokens. However, your {what} "
                            f"resulted in at least {least} tokens (counted from its {chars} characters without "
                            f"tokenizing). Please reduce the length of the {what}.",
                       param=param, code=CONTEXT_LENGTH_EXCEEDED)  # fmt: skip


def string_chars(value: Any) -> int:
    """Characters in every string of a JSON value (keys included): what a template could render of it at most
    once over (templates may repeat a string, which only adds tokens)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(k) + string_chars(v) for k, v in value.items() if isinstance(k, str))
    if isinstance(value, list | tuple):
        return sum(string_chars(v) for v in value)
    return 0


def user_texts(messages: list[dict]) -> list[str]:
    """The user turns' text: what every chat template renders whole (others may drop earlier turns' reasoning,
    a system message or tool results), so what the pre-render check may count."""
    out = []
    for m in messages:
        content = m.get("content")
        if m.get("role") == "user" and isinstance(content, str):
            out.append(content)
        elif m.get("role") == "user" and isinstance(content, list):  # Anthropic-style text blocks
            out.extend(b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    return out


def could_exceed(tokenizer: Tokenizer | None, chars: int, context: int, *, generate: bool = True) -> bool:
    """Whether `chars` characters could, by the bound, be too many for `context` (False: certainly fit, and no
    check after rendering is needed)."""
    bound = text_bound(tokenizer)
    return bound is not None and bound.min_tokens(chars) > context - generate
