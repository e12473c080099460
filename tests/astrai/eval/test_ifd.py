"""`astrai eval ifd`: each sample's IFD equals ppl(answer | instruction) / ppl(answer) computed with transformers
on the same token ids (fp32, rel 1e-4), independent of the batch size; field detection and skipping."""

from __future__ import annotations

import json
import math

import pytest
import torch

import astrai
from astrai.eval import ifd
from helpers import tiny_model_dir

ROWS = [
    {"instruction": "say hello", "output": "hello world, this is a tiny corpus"},
    {"instruction": "describe the fox", "input": "quick brown", "output": "the quick brown fox jumps over the dog"},
    {"prompt": "the lazy", "response": "dog"},
    {"question": "what does the fox do?", "answer": "it jumps over the lazy dog, again and again and again"},
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(tmp_path_factory.mktemp("ifd"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, astrai.load(folder), hf


def _ce(hf, context: list[int], answer: list[int]) -> float:
    """Mean cross-entropy of `answer` after `context` under transformers (labels -100 on the context)."""
    ids = torch.tensor([context + answer])
    labels = ids.clone()
    labels[0, : len(context)] = -100
    with torch.no_grad():
        return float(hf(ids, labels=labels).loss)


def test_ifd_equals_transformers(tiny, tmp_path):
    folder, model, hf = tiny
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    report = ifd.evaluate(ifd.Config(model=folder, data=data, batch_size=3), model)
    tok, eos = model.tokenizer, model.eos_token_ids[0]
    assert tok.bos_token_id is None  # the unconditional context is then the EOS token (lm-eval's rule)
    expected = []
    for row, sample in zip(ROWS, report.samples, strict=True):
        instruction = row.get("instruction") or row.get("prompt") or row["question"]
        if row.get("input"):
            instruction += "\n" + row["input"]
        answer = tok.encode(row.get("output") or row.get("response") or row["answer"], add_special_tokens=False)
        answer.append(eos)
        cond, alone = _ce(hf, tok.encode(instruction + "\n"), answer), _ce(hf, [eos], answer)
        assert sample["tokens"] == len(answer)
        assert sample["ce_conditional"] == pytest.approx(cond, rel=1e-4)
        assert sample["ce_alone"] == pytest.approx(alone, rel=1e-4)
        assert sample["ifd"] == pytest.approx(math.exp(cond) / math.exp(alone), rel=1e-4)
        assert sample["ifd_ce"] == pytest.approx(cond / alone, rel=1e-4)
        expected.append(math.exp(cond) / math.exp(alone))
    assert report.metrics["ifd"] == pytest.approx(sum(expected) / len(expected), rel=1e-4)
    assert report.metrics["frac_ifd_above_1"] == sum(v > 1 for v in expected) / len(expected)
    one_by_one = ifd.evaluate(ifd.Config(model=folder, data=data, batch_size=1), model)
    assert [s["ifd"] for s in one_by_one.samples] == pytest.approx([s["ifd"] for s in report.samples], rel=1e-5)


def test_ifd_chat_prefix_and_skips(tiny, tmp_path):
    folder, model, hf = tiny
    rows = [{"instruction": "say hello", "output": "hello world"}, {"instruction": "nothing", "output": ""}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ifd.Config(model=folder, data=data, chat=True, prefix="the", append_eos=False)
    report = ifd.evaluate(cfg, model)
    tok = model.tokenizer
    answer = tok.encode("hello world", add_special_tokens=False)
    cond = _ce(hf, tok.encode_chat([{"role": "user", "content": "say hello"}]), answer)
    alone = _ce(hf, tok.encode("the"), answer)
    assert report.samples[0]["ifd"] == pytest.approx(math.exp(cond - alone), rel=1e-4)
    assert report.samples[1] == {"where": f"{data}:2", "skipped": "empty answer"}
    assert report.metrics["samples"] == 1 and report.metrics["skipped"] == 1


def test_ifd_field_errors(tiny, tmp_path):
    folder, model, _ = tiny
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n" + json.dumps({"text": "z"}) + "\n")
    with pytest.raises(ifd.DataError, match=r"bad.jsonl:2: missing field 'instruction' or 'prompt' or 'question'"):
        ifd.evaluate(ifd.Config(model=folder, data=data), model)
