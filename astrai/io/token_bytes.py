"""The bytes one token contributes to the text, for logprobs (OpenAI's `bytes` field, per-token `token` text).

Decoding a token alone with ``Tokenizer.decode`` is wrong for this: a byte-level token can hold part of a UTF-8
character (decode gives U+FFFD), and sentencepiece-style decoders strip a leading space. Here each token's bytes
come from its vocabulary piece, by the decoder family:
- byte-level BPE (GPT-2, Llama-3, Qwen): the piece is written in GPT-2's byte alphabet (printable bytes stand for
  themselves, the others for ``chr(256 + k)``); map each character back to its byte;
- sentencepiece ``byte_fallback``: a ``<0xNN>`` piece is that one byte;
- sentencepiece-style pieces (a ``Metaspace`` decoder, or Llama-2's ``Replace("▁", " ")``): ``▁`` is a space;
- added tokens: their content; anything else: ``decode([token])``.
The bytes of a sequence's tokens concatenate to its UTF-8 text (sentencepiece-style: with the leading space of the
first word, which ``decode`` strips).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astrai.io.tokenizer import Tokenizer


def _byte_decoder() -> dict[str, int]:
    # GPT-2's byte-level alphabet: printable bytes stand for themselves, the rest map to chr(256 + k)
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + k): b for k, b in enumerate(extra)}


_BYTE_DECODER = _byte_decoder()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    """Each token's own bytes and text over one tokenizer, cached per token id.

    Attributes:
        tokenizer: the tokenizer, or None (a model served without one: every token is ``b""``).
        as_ids: every token's text is ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``, for clients that
            need the ids of tokens that do not decode on their own); ``bytes`` are that text's, as in vLLM.
    """

    def __init__(self, tokenizer: Tokenizer | None, *, as_ids: bool = False) -> None:
        self.tokenizer, self._bytes, self.as_ids = tokenizer, {}, as_ids
        decoder = tokenizer.backend.decoder if tokenizer is not None else None
        state = decoder.__getstate__() if decoder is not None else b""
        self._byte_level = b'"ByteLevel"' in state
        self._word_marker = b'"Metaspace"' in state or "\u2581".encode() in state  # the decoder turns ▁ into " "
        self._added = tokenizer.backend.get_added_tokens_decoder() if tokenizer is not None else {}

    def bytes(self, token: int) -> bytes:
        """The UTF-8 bytes token `token` contributes to the text (with `as_ids`, those of `token_id:N`)."""
        if self.as_ids:
            return f"token_id:{token}".encode()
        if token not in self._bytes:
            self._bytes[token] = self._compute(token)
        return self._bytes[token]

    def text(self, token: int) -> str:
        """The token as text (an incomplete UTF-8 character comes out as U+FFFD)."""
        return self.bytes(token).decode("utf-8", errors="replace")

    def _compute(self, token: int) -> bytes:
        if self.tokenizer is None:
            return b""
        if token in self._added:
            return self._added[token].content.encode()
        piece = self.tokenizer.id_to_token(token) or ""
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        if (match := _BYTE_TOKEN.fullmatch(piece)) is not None:
            return bytes([int(match.group(1), 16)])
        if self._word_marker:
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token], skip_special_tokens=False).encode()
