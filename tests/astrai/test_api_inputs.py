"""Argument validation of the notebook API: `astrai.forward` ids and positions, `astrai.chat` message shapes, and
`astrai.generate_ids` prompts each fail with a ValueError saying what is wrong (not an IndexError or
AttributeError from inside torch or jinja), and the well-formed spellings work (positive controls)."""

from pathlib import Path

import pytest
import torch

import astrai
from helpers import tiny_model_dir


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return astrai.load(tiny_model_dir(Path(tmp_path_factory.mktemp("tiny")) / "model"))


def test_forward_accepts_tensors_and_lists(model):
    ids = [[1, 2, 3], [4, 5, 6]]
    logits = astrai.forward(model, torch.tensor(ids))
    assert logits.shape == (2, 3, model.config.vocab_size)
    assert torch.equal(astrai.forward(model, ids), logits)
    positions = torch.tensor([[5, 6, 7], [0, 1, 2]])
    assert astrai.forward(model, ids, positions=positions).shape == (2, 3, 300)


@pytest.mark.parametrize(("ids", "match"), [
    (torch.tensor([[99999]]), r"input_ids outside \[0, 300\) \(the vocabulary\): \[99999\]"),
    (torch.tensor([[1, -1]]), r"input_ids outside \[0, 300\).*\[-1\]"),
    ([[1, 300]], r"input_ids outside \[0, 300\)"),
    ([[1, 2], [3]], "equal-length lists of ints"),
    ([["a"]], "equal-length lists of ints"),
    ([[1.5]], "input_ids must be integers, got torch.float32"),
    (torch.tensor([[True]]), "must be integers, got torch.bool"),
    (torch.tensor([1, 2]), "1-D tensor of shape"),
    (torch.zeros(1, 2, 3, dtype=torch.long), r"non-empty \[B, T\] batch, got shape \(1, 2, 3\)"),
    (torch.zeros(1, 0, dtype=torch.long), r"got shape \(1, 0\)"),
    ("hello", "got str"),
    (7, "got int"),
])  # fmt: skip
def test_forward_rejects_bad_ids(model, ids, match):
    with pytest.raises(ValueError, match=match):
        astrai.forward(model, ids)


def test_forward_rejects_bad_positions(model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"positions has shape \(1, 2\), input_ids \(1, 3\)"):
        astrai.forward(model, ids, positions=torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match="positions must be an integer tensor, got a torch.float32 tensor"):
        astrai.forward(model, ids, positions=torch.zeros(1, 3))


@pytest.mark.parametrize(("messages", "match"), [
    ([{"content": "hi"}], r"message 0 needs a 'role' string .* got no 'role'"),
    ([{"role": 5, "content": "hi"}], "message 0 needs a 'role' string .* got role 5"),
    ([{"role": "user"}], r"message 0 \(role 'user'\) has no 'content'"),
    ([{"role": "user", "content": None}], "has no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}], "message 1 'content' must be a string"),
    ([[{"role": "user", "content": "a"}], [{"role": "user"}]], "conversation 1 message 0 .* has no 'content'"),
])  # fmt: skip
def test_chat_rejects_malformed_messages(model, messages, match):
    with pytest.raises(ValueError, match=match):
        astrai.chat(model, messages, max_tokens=2)


def test_chat_accepts_well_formed_messages(model):
    reply = astrai.chat(model, [{"role": "user", "content": "hello world"}], max_tokens=2)
    assert isinstance(reply, str)


@pytest.mark.parametrize(("prompts", "match"), [
    ([1, 2, 3], r"prompts\[0\] must be a string or a list of token ids, got int \(one prompt's ids go in a list"),
    ([["5", "6"]], r"prompts\[0\] holds '5', not an integer token id"),
    ([[1], [5.7]], r"prompts\[1\] holds 5.7, not an integer token id"),
    ([[True]], "holds True"),
    (5, "prompts must be a string, a list of strings or a list of token-id lists, got int"),
])  # fmt: skip
def test_generate_ids_rejects_malformed_prompts(model, prompts, match):
    with pytest.raises(ValueError, match=match):
        astrai.generate_ids(model, prompts, max_tokens=2)


def test_generate_ids_accepts_lists_and_tensors(model):
    out = astrai.generate_ids(model, torch.tensor([[1, 2], [3, 4]]), max_tokens=2)
    assert out == astrai.generate_ids(model, [[1, 2], [3, 4]], max_tokens=2)
    assert len(out) == 2
