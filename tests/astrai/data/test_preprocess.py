"""`preprocess`: counted skips of malformed input, atomic output, and each kind's arrays against the tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from astrai.data import preprocess as preprocess_module
from astrai.data.config import config_from_dict
from astrai.data.preprocess import preprocess
from astrai.data.shards import open_shards, token_dtype

SECTIONS = [{"field": "messages", "action": "$role", "template": True}]


def _chat(user: str, assistant: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def _config(tmp_path, tok_dir, kind="sft", **kw):
    data = {"kind": kind, "inputs": [str(tmp_path / "in.jsonl")], "tokenizer": str(tok_dir)}
    data["output"] = str(tmp_path / "out")
    if kind in ("sft", "pretrain"):
        data["sections"] = SECTIONS if kind == "sft" else [{"field": "text"}]
    return config_from_dict({**data, **kw})


def test_malformed_records_are_skipped_and_counted(tmp_path, tok_dir, write_jsonl):
    lines = [
        _chat("hello", "world"),
        "",
        "{bad json",
        "[" * 100_000 + "]" * 100_000,
        b"\xff\xfe not utf-8",
        "[1, 2]",
        {"messages": "just a string"},
        {"other": 1},
        _chat("a", ""),  # 1 character: too short
        _chat("x" * 50, "y" * 50),  # too long
        {"messages": []},
        {"messages": [{"role": "user", "content": "only a question"}]},
        {"messages": [{"role": "wizard", "content": "abracadabra"}]},
        "   ",
        '{"messages": [{"role": "user", "content": "lone \\ud800 surrogate"}]}',
        {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": [{"text": "a list"}]}]},
        _chat("the fox", "the lazy dog"),
    ]
    write_jsonl(tmp_path / "in.jsonl", lines)
    cfg = _config(tmp_path, tok_dir, preprocessing={"min_chars": 2, "max_chars": 60})
    report = preprocess(cfg)
    assert report.records == 15 and report.kept == 2
    assert dict(report.skipped) == {
        "bad_json": 2,
        "bad_encoding": 2,
        "not_an_object": 1,
        "wrong_type": 1,
        "missing_field": 1,
        "too_short": 1,
        "too_long": 1,
        "empty": 1,
        "no_trained_tokens": 1,
        "template_error": 2,
    }
    assert report.samples["bad_json"][0].startswith(f"{tmp_path / 'in.jsonl'}:3: ")
    assert report.samples["template_error"][0].startswith(f"{tmp_path / 'in.jsonl'}:13: ")
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["counts"]["skipped"] == dict(report.skipped) and meta["counts"]["kept"] == 2


def test_failed_run_leaves_nothing_and_keeps_the_previous_output(tmp_path, tok_dir, write_jsonl, monkeypatch):
    write_jsonl(tmp_path / "in.jsonl", [_chat(f"hello {i}", "world") for i in range(6)])
    cfg = _config(tmp_path, tok_dir, preprocessing={"max_tokens_per_shard": 30})
    first = preprocess(cfg)
    assert first.shards > 1
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="exists and is not empty"):
        preprocess(cfg)

    real, calls = preprocess_module.write_shard, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kwargs)

    monkeypatch.setattr(preprocess_module, "write_shard", failing)
    with pytest.raises(OSError, match="disk full"):
        preprocess(cfg, overwrite=True)
    after = {p.name: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    assert after == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out"]  # no temp folder left behind


def test_nothing_usable_writes_nothing(tmp_path, tok_dir, write_jsonl):
    write_jsonl(tmp_path / "in.jsonl", ["{", {"messages": 1}])
    with pytest.raises(ValueError, match=r"no record was usable \(2 read; bad_json: 1, wrong_type: 1\)"):
        preprocess(_config(tmp_path, tok_dir))
    assert not (tmp_path / "out").exists()


def test_missing_inputs_and_tokenizer_are_clear_errors(tmp_path, tok_dir):
    with pytest.raises(FileNotFoundError, match="in.jsonl does not exist"):
        preprocess(_config(tmp_path, tok_dir))
    (tmp_path / "in.jsonl").write_text("")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        preprocess(_config(tmp_path, tmp_path))


def test_pretrain_stream_is_documents_then_eos(tmp_path, tokenizer, tok_dir, write_jsonl):
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "", "tiny"]
    write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    report = preprocess(_config(tmp_path, tok_dir, "pretrain", preprocessing={"max_seq_len": 6}))
    eos = tokenizer.eos_token_id
    docs = [tokenizer.encode(t) for t in texts if t]
    expected = [(d[:5] if len(d) >= 6 else d) + [eos] for d in docs]  # truncated to 6 tokens, EOS kept
    meta, (shard,) = open_shards(tmp_path / "out", "pretrain")
    assert shard.arrays["tokens"].dtype == np.uint16
    assert shard.arrays["tokens"].tolist() == [t for d in expected for t in d]
    assert np.diff(shard.arrays["doc_offsets"]).tolist() == [len(d) for d in expected]
    assert report.skipped == {"empty": 1} and report.truncated == 1 and meta["eos_id"] == eos


def test_sft_rows_are_packed_documents(tmp_path, tokenizer, tok_dir, write_jsonl):
    records = [_chat("hello", "world"), _chat("the quick brown fox", "jumps"), _chat("a", "b")]
    write_jsonl(tmp_path / "in.jsonl", records)
    preprocess(_config(tmp_path, tok_dir, preprocessing={"max_packed_len": 64}))
    _, (shard,) = open_shards(tmp_path / "out", "sft")
    tokens, positions = shard.arrays["tokens"], shard.arrays["positions"]
    starts = np.flatnonzero(positions == 0).tolist() + [len(tokens)]
    found = sorted(tokens[a:b].tolist() for a, b in zip(starts[:-1], starts[1:], strict=True))
    rendered = [
        tokenizer.apply_chat_template(r["messages"], add_generation_prompt=False, tokenize=True) for r in records
    ]
    assert found == sorted(rendered)
    assert all(
        b - a <= 64 for a, b in zip(shard.arrays["row_offsets"][:-1], shard.arrays["row_offsets"][1:], strict=True)
    )


def test_dpo_pairs_reject_partial_records(tmp_path, tokenizer, tok_dir, write_jsonl):
    good = {"prompt": "hello", "chosen": "the fox", "rejected": "the dog"}
    write_jsonl(tmp_path / "in.jsonl", [good, {"prompt": "hi", "chosen": "yes"}, {**good, "rejected": ""}])
    roles = [("prompt", "user", "mask"), ("chosen", "assistant", "train"), ("rejected", "assistant", "train")]
    kw = {f: [{"field": f, "template": True, "role": r, "action": a}] for f, r, a in roles}
    report = preprocess(_config(tmp_path, tok_dir, "dpo", **kw))
    assert report.kept == 1 and report.skipped == {"missing_field": 1, "no_trained_tokens": 1}
    _, (shard,) = open_shards(tmp_path / "out", "dpo")
    for side in ("chosen", "rejected"):
        messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": good[side]}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
        assert shard.arrays[side].tolist() == ids
        trained = shard.arrays[side][shard.arrays[f"{side}_mask"] == 1].tolist()
        assert tokenizer.decode(trained, skip_special_tokens=False) == good[side] + "<|im_end|>\n"


def test_grpo_prompts_end_with_the_generation_prompt(tmp_path, tokenizer, tok_dir, write_jsonl):
    write_jsonl(tmp_path / "in.jsonl", [{"q": "hello", "a": "42"}, {"q": "no answer"}, {"q": "fox", "a": "7"}])
    kw = {"prompt": [{"field": "q", "template": True, "role": "user"}], "answer_field": "a"}
    report = preprocess(_config(tmp_path, tok_dir, "grpo", **kw))
    assert report.kept == 2 and report.skipped == {"missing_field": 1}
    _, (shard,) = open_shards(tmp_path / "out", "grpo")
    ends = shard.arrays["prompt_offsets"]
    first = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    assert shard.arrays["prompt"][ends[0] : ends[1]].tolist() == first and shard.answers == ["42", "7"]


def test_max_items_stops_early(tmp_path, tok_dir, write_jsonl):
    write_jsonl(tmp_path / "in.jsonl", [_chat(f"q{i}", "a") for i in range(10)])
    report = preprocess(_config(tmp_path, tok_dir, preprocessing={"max_items": 3, "batch_size": 2}))
    assert report.kept == 3 and report.rows >= 1


def test_token_dtype_widens_past_65536_ids(tmp_path, write_jsonl):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    from astrai.data.datasets import PretrainDataset
    from astrai.io.tokenizer import Tokenizer

    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
    vocab = {f"w{i}": i for i in range(70_000)} | {"<eos>": 70_000}
    backend = Backend(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = Tokenizer(backend, special_tokens={"eos_token": "<eos>"})
    write_jsonl(tmp_path / "in.jsonl", [{"text": "w69999 w3 w65536 w65535"}])
    preprocess(_config(tmp_path, tmp_path, "pretrain"), tokenizer=tok)
    _, (shard,) = open_shards(tmp_path / "out", "pretrain")
    assert shard.arrays["tokens"].dtype == np.uint32
    item = PretrainDataset(tmp_path / "out", 4)[0]
    assert item["tokens"].tolist() == [69999, 3, 65536, 65535] and item["targets"].tolist() == [3, 65536, 65535, 70000]


@pytest.mark.parametrize(
    ("strategy", "mode", "kept"),
    [("bfd", "keep_start", 0), ("bfd", "keep_end", 1), ("none", "keep_end", 1), ("bfd_split", "keep_start", 1)],
)
def test_long_documents_by_strategy(tmp_path, tokenizer, tok_dir, write_jsonl, strategy, mode, kept):
    record = _chat("the quick brown fox jumps over the lazy dog " * 8, "hello")
    write_jsonl(tmp_path / "in.jsonl", [record, _chat("hi", "world")])
    pre = {"max_packed_len": 64, "packing_strategy": strategy, "truncation_mode": mode}
    report = preprocess(_config(tmp_path, tok_dir, preprocessing=pre))
    ids = tokenizer.apply_chat_template(record["messages"], add_generation_prompt=False, tokenize=True)
    short = tokenizer.apply_chat_template(_chat("hi", "world")["messages"], add_generation_prompt=False, tokenize=True)
    assert len(ids) > 2 * 64 and len(short) < 64 and report.kept == 1 + kept
    _, (shard,) = open_shards(tmp_path / "out", "sft")
    tokens, positions = shard.arrays["tokens"].tolist(), shard.arrays["positions"].tolist()
    assert max(np.diff(shard.arrays["row_offsets"])) <= 64
    if strategy == "bfd_split":  # every token survives, in chunks whose positions restart at 0
        assert report.truncated == 0 and report.tokens == len(ids) + len(short)
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(tokens)]
        chunks = {tuple(tokens[a:b]) for a, b in zip(starts[:-1], starts[1:], strict=True)}
        assert chunks == {tuple(ids[i : i + 64]) for i in range(0, len(ids), 64)} | {tuple(short)}
    elif kept:  # truncated to the row length, keeping the end (the trained answer)
        assert report.truncated == 1 and (tokens[:64] == ids[-64:] or tokens[-64:] == ids[-64:])
    else:
        assert report.skipped == {"no_trained_tokens": 1}
