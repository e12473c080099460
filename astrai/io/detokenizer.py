"""Incremental detokenizer: turn a stream of generated token ids into text deltas for streaming.

Decoding each token on its own is wrong twice over: a byte-level token can hold half of a UTF-8 character
(an emoji is often 2-4 tokens), and sentencepiece-style decoders drop the leading space of the *first* token
they see. Decoding the whole sequence on every step is right but costs O(length) per token.

We use the prefix-offset / read-offset scheme of Hugging Face's TGI and vLLM (``detokenize_incrementally``):
keep two offsets into the token list; decode the short window ``ids[prefix:]`` and the already-emitted part
``ids[prefix:read]``; emit the difference only when it does not end in U+FFFD (an incomplete character). Both
decodes start at the same token, so whatever the decoder does to a window's first token (strip a space) cancels
out. Cost per token is O(window), and the window is a few tokens long.

One addition: with sentencepiece ``byte_fallback`` the decoder turns a run of ``<0xNN>`` tokens into text only
if the *whole run* is valid UTF-8 (else one U+FFFD per byte), so a later byte token can change text that looked
complete. We hold text while the newest token is a byte token; the run is then final when a non-byte token (or
``flush``) arrives. The invariant the tests check: ``"".join(deltas) + flush() == tokenizer.decode(ids)``.

References: https://github.com/huggingface/text-generation-inference (``decode_token``),
https://github.com/vllm-project/vllm (``vllm/transformers_utils/detokenizer_utils.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# How many prompt tokens seed the window, so the first generated token decodes in context (vLLM uses 5).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class TextDecoder(Protocol):
    """What the detokenizer reads from a tokenizer (``astrai.io.tokenizer.Tokenizer`` is one)."""

    @property
    def byte_fallback_ids(self) -> frozenset[int]: ...  # ``<0xNN>`` ids the decoder fuses into characters

    @property
    def special_token_ids(self) -> frozenset[int]: ...  # what ``skip_special_tokens`` drops

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one delta per call, never splitting a UTF-8 character.

    Attributes:
        tokenizer: the tokenizer whose ``decode`` defines the text.
        skip_special_tokens: drop special tokens from the text (as ``Tokenizer.decode``).
    """

    def __init__(
        self, tokenizer: TextDecoder, *, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ) -> None:
        """Start a stream.

        Args:
            tokenizer: an ``astrai.io.tokenizer.Tokenizer`` (anything with its ``decode``, ``byte_fallback_ids``
                and ``special_token_ids``).
            skip_special_tokens: drop special tokens from the emitted text.
            prompt_ids: the prompt the generated tokens follow; its last few tokens give the first generated
                token its context (e.g. whether a sentencepiece ``▁word`` starts with a space). Its text is
                never emitted.
        """
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._byte_ids = tokenizer.byte_fallback_ids
        self._skipped_ids = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        self._ids = list(prompt_ids)
        self._prompt_len = len(self._ids)
        self._read = len(self._ids)  # tokens before this are emitted
        self._prefix = max(self._read - _PROMPT_CONTEXT, 0)  # the decode window starts here
        self._prefix_text = self._decode(self._prefix, self._read)  # text of ids[prefix:read], cached
        self._pieces: list[str] = []

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:stop], skip_special_tokens=self.skip_special_tokens)

    def _advance(self, *, final: bool) -> str:
        text = self._decode(self._prefix)
        if not final and (len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT)):
            return ""  # nothing new yet, or the newest character is still incomplete
        delta = text[len(self._prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._prefix, self._read)
        if delta:
            self._pieces.append(delta)
        return delta

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the newly completed text ("" while a character is incomplete)."""
        return self.add_many((token_id,))

    def add_many(self, ids: Sequence[int]) -> str:
        """Append several tokens; returns the newly completed text (one decode for the lot)."""
        self._ids.extend(ids)
        last = next((i for i in reversed(ids) if i not in self._skipped_ids), None)
        if last is None or last in self._byte_ids:
            # A skipped special token adds no text, and the decoder joins the byte runs on either side of it;
            # a byte token may still be turned into U+FFFD by the next byte token. Either way: wait.
            return ""
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character comes out as U+FFFD, as ``decode`` gives)."""
        return self._advance(final=True)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens added so far (prompt excluded)."""
        return self._ids[self._prompt_len :]
