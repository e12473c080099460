"""`astrai eval ppl` and the batched scorer: parity with transformers (fp32, rel 1e-4) with and without sliding
windows (transformers' perplexity-guide loop is the reference), padding independence, chunking."""

from __future__ import annotations

import json
import math

import pytest
import torch

import astrai
from astrai.eval import ppl
from astrai.eval.scoring import Request, score
from helpers import tiny_model_dir

TEXTS = [
    "hello world, this is a tiny corpus",
    "the quick brown fox jumps over the lazy dog. " * 3,
    "a",
    "Unicode: héllo wörld — 世界 🙂 and some numbers 12345.",
    "the lazy dog sleeps; the quick fox runs, and the world says hello to this tiny corpus again",
]
LONG = " ".join(f"the {w} fox {i} jumps over the lazy dog" for i, w in enumerate(["quick", "brown", "lazy"] * 12))


def shared_tiny_dir(tmp_path_factory) -> str:
    """One tiny model folder per test session, shared by the eval test modules (built on first use)."""
    folder = tmp_path_factory.getbasetemp() / "eval_tiny_model"
    if not (folder / "config.json").is_file():
        tiny_model_dir(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = shared_tiny_dir(tmp_path_factory)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    return folder, astrai.load(folder), hf, AutoTokenizer.from_pretrained(folder)


def guide_nll(hf, ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """transformers' perplexity guide loop over one text ([1, T] ids): (total NLL, predicted tokens).

    As the guide, except that each window's mean loss is weighted by the number of labels the model actually
    scored (the guide's `num_valid_tokens - batch_size` is one short for every window after the first).
    """
    nll, count, prev_end, seq_len = 0.0, 0, 0, ids.size(1)
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        input_ids = ids[:, begin:end]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        scored = int((target_ids[:, 1:] != -100).sum())
        if scored:
            with torch.no_grad():
                nll += float(hf(input_ids, labels=target_ids).loss) * scored
            count += scored
        prev_end = end
        if end == seq_len:
            break
    return nll, count


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_ppl_equals_transformers_whole_texts(tiny, tmp_path):
    folder, model, hf, tok = tiny
    data = write_jsonl(tmp_path / "texts.jsonl", TEXTS)
    report = ppl.evaluate(ppl.Config(model=folder, data=data, batch_size=3), model)
    nll = count = 0
    for text, sample in zip(TEXTS, report.samples, strict=True):
        ids = torch.tensor([tok(text)["input_ids"]])
        n, c = guide_nll(hf, ids, max_length=10_000, stride=10_000)
        assert sample["tokens"] == c == ids.size(1) - 1
        if c:
            assert sample["nll"] == pytest.approx(n, rel=1e-4)
        nll, count = nll + n, count + c
    assert report.metrics["tokens"] == count
    assert report.metrics["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert report.samples[2]["ppl"] is None  # "a": one token, nothing to predict


@pytest.mark.parametrize(("max_length", "stride"), [(32, 12), (32, 32), (17, 5)])
def test_ppl_sliding_windows_equal_the_guide(tiny, tmp_path, max_length, stride):
    folder, model, hf, tok = tiny
    texts = [LONG, TEXTS[1]]
    data = write_jsonl(tmp_path / "long.jsonl", texts)
    cfg = ppl.Config(model=folder, data=data, max_length=max_length, stride=stride, batch_size=4)
    report = ppl.evaluate(cfg, model)
    nll = count = 0
    for text, sample in zip(texts, report.samples, strict=True):
        ids = torch.tensor([tok(text)["input_ids"]])
        n, c = guide_nll(hf, ids, max_length, stride)
        assert sample["tokens"] == c
        assert sample["nll"] == pytest.approx(n, rel=1e-4)
        nll, count = nll + n, count + c
    assert report.metrics["ppl"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert report.metrics["windows"] > len(texts)  # the long text really was windowed
    whole = ppl.evaluate(ppl.Config(model=folder, data=data, max_length=2048), model)
    assert whole.metrics["ppl"] != pytest.approx(report.metrics["ppl"], rel=1e-4)  # context length matters


def test_txt_file_is_one_text(tiny, tmp_path):
    folder, model, hf, tok = tiny
    text = "\n\n".join(TEXTS[:2]) + "\n"
    (tmp_path / "corpus.txt").write_text(text)
    report = ppl.evaluate(ppl.Config(model=folder, data=tmp_path / "corpus.txt"), model)
    ids = torch.tensor([tok(text)["input_ids"]])
    n, c = guide_nll(hf, ids, 10_000, 10_000)
    assert report.metrics["texts"] == 1 and report.metrics["tokens"] == c
    assert report.metrics["ppl"] == pytest.approx(math.exp(n / c), rel=1e-4)


def test_windows_predict_every_token_once():
    for n in range(0, 40):
        for length in range(2, 12):
            for stride in range(1, length):  # overlapping windows: tokens 1..n-1, each once
                got = [t for _, end, first in ppl.windows(n, length, stride) for t in range(first, end)]
                assert got == list(range(1, n)), (n, length, stride)
                assert all(end - begin <= length for begin, end, _ in ppl.windows(n, length, stride))


def test_padding_never_changes_a_score(tiny):
    _, model, _, tok = tiny
    short = Request(tok(TEXTS[0])["input_ids"], 1)
    long = Request(tok(LONG)["input_ids"][:200], 1)
    alone = score(model, [short])[0]
    batched = score(model, [long, short, long], batch_size=3)[1]
    assert len(long.tokens) > 4 * len(short.tokens)
    torch.testing.assert_close(batched.logprobs, alone.logprobs, rtol=0, atol=2e-6)
    assert torch.equal(batched.greedy, alone.greedy)


def test_scores_equal_log_softmax_of_forward_and_do_not_depend_on_chunking(tiny):
    _, model, _, tok = tiny
    ids = tok(LONG)["input_ids"][:80]
    candidates = (5, 17, 40)
    req = Request(ids, 30, candidates)
    logits = astrai.forward(model, torch.tensor([ids]))[0]  # [T, V]
    expected = torch.log_softmax(logits, -1)[29:-1].gather(1, torch.tensor(ids[30:])[:, None]).squeeze(1)
    for chunk in (1, 7, 4096):
        got = score(model, [req], chunk_size=chunk)[0]
        torch.testing.assert_close(got.logprobs, expected, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.candidates, torch.log_softmax(logits[29], -1)[list(candidates)], rtol=0,
                                   atol=1e-5)  # fmt: skip
        assert torch.equal(got.greedy, logits[29:-1].argmax(-1) == torch.tensor(ids[30:]))


def test_request_validation():
    with pytest.raises(ValueError, match="start"):
        Request([1, 2, 3], 0)
    with pytest.raises(ValueError, match="start"):
        Request([1, 2, 3], 3)
