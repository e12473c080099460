"""Fixtures for the data pipeline tests: a tiny local BPE tokenizer with a ChatML template, saved to a folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astrai.io.templates import chatml_template
from astrai.io.tokenizer import Tokenizer, train_tokenizer

CORPUS = ["hello world, this is a tiny corpus", "the quick brown fox jumps over the lazy dog", "user assistant"] * 4

# The bundled ChatML template with the plain assistant turn's content wrapped in {% generation %}, so that
# transformers' return_assistant_tokens_mask gives an independent reference for our assistant masks.
_PLAIN = "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
_TAGGED = (
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{{- (message.content or '') + '<|im_end|>\\n' }}{% endgeneration %}{%- else %}" + _PLAIN + "{%- endif %}"
)


def generation_template() -> str:
    template = chatml_template()
    assert _PLAIN in template
    return template.replace(_PLAIN, _TAGGED)


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    """A tokenizer folder (vocab 300, eos <|im_end|>, pad <|endoftext|>) with the generation-tagged ChatML."""
    folder = tmp_path_factory.mktemp("tok")
    train_tokenizer(CORPUS, vocab_size=300, chat_template=generation_template()).save(folder)
    return folder


@pytest.fixture(scope="session")
def tokenizer(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def _write_jsonl(path: Path, records: list) -> Path:
    with open(path, "wb") as f:
        for r in records:
            line = r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode()
            f.write(line + b"\n")
    return path


@pytest.fixture
def write_jsonl():
    """`write_jsonl(path, records)`: one record per line (dicts as JSON; str/bytes lines written raw)."""
    return _write_jsonl
