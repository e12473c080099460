"""The quickstart's character-level tokenizer: 100 ids, built locally with no training and no downloads.

One token per character of printable ASCII (space to ``~``) plus newline, and four special tokens:
``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>`` (end of turn = eos) and ``<|unk|>`` (any other
character). A tiny vocabulary keeps the embedding table and the LM head small, so the quickstart model spends
its parameters on the transformer blocks; character tokens make arithmetic digit-by-digit.

The backend is a ``tokenizers`` BPE model with no merges and no pre-tokenizer, so every character is its own
token, and a ``Fuse`` decoder, so decoding concatenates them (no spaces inserted). The chat template is the
bundled ChatML one (``astrai/io/templates/chatml.jinja``). ``save_tokenizer`` writes the Hugging Face folder
layout (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``) that both
``astrai.io.tokenizer.Tokenizer.from_dir`` and transformers' ``AutoTokenizer`` load.

Not here: non-ASCII text (each such character becomes ``<|unk|>``; decoding drops it as a special token).
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models

from astrai.io.templates import chatml_template
from astrai.io.tokenizer import Tokenizer

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|endoftext|>", "<|im_end|>", "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN, UNK_TOKEN)  # ids 0..3
ALPHABET = "\n" + "".join(chr(c) for c in range(0x20, 0x7F))  # newline + the 95 printable ASCII characters
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(ALPHABET)  # 100


def build_tokenizer() -> Tokenizer:
    """The character-level tokenizer with the ChatML template; eos ``<|im_end|>``, pad ``<|endoftext|>``."""
    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    backend.decoder = decoders.Fuse()  # the default decoder would join tokens with spaces
    # Added specials are matched before the model runs, so "<|im_end|>" in text is one token, not ten characters.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "unk_token": UNK_TOKEN, "bos_token": None}
    return Tokenizer(backend, special_tokens=special, chat_template=chatml_template())


def save_tokenizer(folder: str | Path, tokenizer: Tokenizer | None = None) -> Path:
    """Write the tokenizer files (default: ``build_tokenizer()``) into ``folder``; returns the folder.

    ``tokenizer_config.json`` holds the chat template and the named special tokens (``bos_token`` null);
    ``special_tokens_map.json`` repeats the named tokens for older loaders.
    """
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    folder = Path(folder)
    tokenizer.save(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["bos_token"] = None  # stated, not left out: prompts start with <|im_start|>, never a BOS
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    special_map = tokenizer.special_tokens_map
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    return folder
