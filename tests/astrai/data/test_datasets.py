"""Datasets over shards: targets, loss masks and positions of packed rows against the separate documents."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from astrai.data.batch import document_ids
from astrai.data.config import config_from_dict
from astrai.data.datasets import (
    DPODataset,
    GRPODataset,
    PretrainDataset,
    SFTDataset,
    collate,
    collate_pairs,
)
from astrai.data.preprocess import preprocess
from astrai.data.render import RecordError, render_batch
from astrai.data.shards import ShardError

SECTIONS = [{"field": "messages", "action": "$role", "template": True}]
WORDS = "hello world the quick brown fox jumps over lazy dog tiny corpus".split()


def _chat(i: int) -> dict:
    rng = np.random.default_rng(i)
    text = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    messages = []
    for _ in range(1 + i % 3):
        messages += [{"role": "user", "content": text(1 + i % 4)}, {"role": "assistant", "content": text(1 + i % 5)}]
    return {"messages": messages}


def _build(tmp_path, tok_dir, kind, records, **kw):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    base = {"kind": kind, "inputs": [str(tmp_path / "in.jsonl")], "tokenizer": str(tok_dir)}
    cfg = config_from_dict({**base, "output": str(tmp_path / kind), **kw})
    preprocess(cfg)
    return cfg, tmp_path / kind


@pytest.fixture(scope="module")
def sft(tmp_path_factory, tok_dir):
    records = [_chat(i) for i in range(24)]
    pre = {"max_packed_len": 160, "max_tokens_per_shard": 600}
    cfg, path = _build(tmp_path_factory.mktemp("sft"), tok_dir, "sft", records, sections=SECTIONS, preprocessing=pre)
    return cfg, path, records


def test_sft_rows_decompose_into_the_separate_documents(sft, tokenizer):
    cfg, path, records = sft
    data = SFTDataset(path, 170)
    assert data.pad_id == tokenizer.pad_token_id and len(data.records.shards) > 1
    docs = {}
    for result in render_batch(tokenizer, records, cfg, [cfg.sections]):
        assert not isinstance(result, RecordError)
        assert len(result[0]) <= 160  # nothing truncated, so rows hold the whole documents
        docs[tuple(result[0].ids.tolist())] = result[0].mask
    seen = []
    for i in range(len(data)):
        item = data[i]
        tokens, targets, loss_mask, positions = item["tokens"], item["targets"], item["loss_mask"], item["positions"]
        assert tokens.shape == targets.shape == loss_mask.shape == positions.shape == (170,)
        doc_of = document_ids(positions[None])[0]
        for d in doc_of.unique().tolist():
            idx = torch.nonzero(doc_of == d).flatten()
            ids = tuple(tokens[idx].tolist())
            if ids in docs:  # a real document: positions count up, targets are its next tokens
                assert positions[idx].tolist() == list(range(len(idx)))
                mask = docs[ids]
                expected = np.append(mask[1:], 0).astype(np.float32)  # the last token's target is not trained
                assert loss_mask[idx].numpy().tolist() == expected.tolist()
                assert targets[idx[:-1]].tolist() == list(ids[1:])
                seen.append(ids)
            else:  # padding: single pad tokens at position 0, never trained
                assert len(idx) == 1 and ids == (data.pad_id,) and positions[idx].item() == 0
                assert loss_mask[idx].item() == 0 and idx.item() >= int((positions != 0).nonzero().max())
    assert sorted(seen) == sorted(docs)


def test_collate_stacks_into_an_lm_batch(sft):
    _, path, _ = sft
    data = SFTDataset(path, 170)
    batch = collate([data[0], data[1]])
    assert batch.tokens.shape == (2, 170) and batch.tokens.dtype == torch.int64
    assert batch.loss_mask.dtype == torch.float32 and batch.positions.dtype == torch.int64
    assert torch.equal(batch.targets[1], data[1]["targets"]) and batch.num_loss_tokens > 0
    with pytest.raises(ValueError, match="different lengths"):
        collate([data[0], {k: v[:5] for k, v in data[1].items()}])


def test_sft_seq_len_shorter_than_rows_is_an_error(sft):
    _, path, _ = sft
    with pytest.raises(ShardError, match="preprocess with max_packed_len <= 20"):
        SFTDataset(path, 20)


def test_pretrain_windows(tmp_path, tokenizer, tok_dir):
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(8)]
    _, path = _build(tmp_path, tok_dir, "pretrain", [{"text": t} for t in texts], sections=[{"field": "text"}])
    stream = [t for text in texts for t in tokenizer.encode(text) + [tokenizer.eos_token_id]]
    data = PretrainDataset(path, 16)
    assert len(data) == (len(stream) - 1) // 16
    for k in (0, len(data) - 1, -1):
        item = data[k]
        start = (k % len(data)) * 16
        assert item["tokens"].tolist() == stream[start : start + 16]
        assert item["targets"].tolist() == stream[start + 1 : start + 17]
        assert torch.equal(item["positions"], torch.arange(16)) and bool((item["loss_mask"] == 1).all())
    with pytest.raises(IndexError):
        data[len(data)]


@pytest.fixture(scope="module")
def dpo(tmp_path_factory, tok_dir):
    records = [
        {"prompt": "hello", "chosen": "the quick brown fox", "rejected": "dog"},
        {"prompt": "the lazy dog jumps over", "chosen": "yes", "rejected": "no it does not"},
    ]
    roles = [("prompt", "user", "mask"), ("chosen", "assistant", "train"), ("rejected", "assistant", "train")]
    kw = {f: [{"field": f, "template": True, "role": r, "action": a}] for f, r, a in roles}
    _, path = _build(tmp_path_factory.mktemp("dpo"), tok_dir, "dpo", records, **kw)
    return path, records


def test_dpo_items_and_collate_pairs(dpo, tokenizer):
    path, records = dpo
    data = DPODataset(path)
    items = [data[0], data[1]]
    assert items[0]["chosen_mask"].dtype == torch.bool
    pad = 299  # deliberately not 0: padding is told by the mask, never by the id
    batch = collate_pairs(items, pad_id=pad)
    length = max(len(it[s]) for it in items for s in ("chosen", "rejected"))
    for side in ("chosen", "rejected"):
        lm = getattr(batch, side)
        assert lm.tokens.shape == (2, length)
        for b, item in enumerate(items):
            ids, mask, n = item[side], item[f"{side}_mask"], len(item[side])
            assert lm.tokens[b, :n].tolist() == ids.tolist() and bool((lm.tokens[b, n:] == pad).all())
            assert lm.targets[b, : n - 1].tolist() == ids[1:].tolist()
            assert lm.loss_mask[b].tolist() == mask[1:].float().tolist() + [0.0] * (length - n + 1)
            assert lm.positions[b, :n].tolist() == list(range(n)) and bool((lm.positions[b, n:] == 0).all())
            trained = lm.targets[b][lm.loss_mask[b] == 1].tolist()
            assert tokenizer.decode(trained, skip_special_tokens=False) == records[b][side] + "<|im_end|>\n"


def test_grpo_items(tmp_path, tokenizer, tok_dir):
    records = [{"q": "hello", "a": "1"}, {"q": "fox", "a": "2"}]
    kw = {"prompt": [{"field": "q", "template": True, "role": "user"}], "answer_field": "a"}
    _, path = _build(tmp_path, tok_dir, "grpo", records, **kw)
    data = GRPODataset(path)
    item = data[1]
    assert item["answer"] == "2"
    assert item["prompt"].tolist() == tokenizer.apply_chat_template([{"role": "user", "content": "fox"}], tokenize=True)


def test_shard_folder_errors(tmp_path, dpo):
    path, _ = dpo
    with pytest.raises(ShardError, match="no such shard folder"):
        SFTDataset(tmp_path / "nope", 8)
    with pytest.raises(ShardError, match="holds 'dpo' data, not 'sft'"):
        SFTDataset(path, 8)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match="no meta.json"):
        DPODataset(tmp_path / "empty")
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    (broken / "shard_0000" / "rejected_mask.bin").unlink()
    with pytest.raises(ShardError, match="array 'rejected_mask' is missing"):
        DPODataset(broken)
    meta = json.loads((broken / "meta.json").read_text())
    del meta["shards"][0]["arrays"]["rejected_mask"]
    (broken / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ShardError, match="lists no array 'rejected_mask'"):
        DPODataset(broken)
    shutil.rmtree(broken)
    shutil.copytree(path, broken)
    with open(broken / "shard_0000" / "chosen.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(ShardError, match="chosen.bin: .* bytes, meta.json says"):
        DPODataset(broken)
    with pytest.raises(ValueError, match="seq_len must be a positive int"):
        PretrainDataset(path, 0)


def test_fully_trained_documents_stop_training_at_their_last_token(tmp_path, tokenizer, tok_dir):
    texts = ["hello world", "the quick brown fox", "lazy dog", "tiny corpus here"]
    sections = [{"field": "text", "action": "train"}]
    _, path = _build(tmp_path, tok_dir, "sft", [{"text": t} for t in texts], sections=sections,
                     preprocessing={"max_packed_len": 64})  # fmt: skip
    item = SFTDataset(path, 64)[0]  # everything fits one row
    lengths = [len(tokenizer.encode(t)) for t in texts]
    n = sum(lengths)
    starts = [s for s in torch.nonzero(item["positions"] == 0).flatten().tolist() if s < n]  # then padding
    assert sorted(b - a for a, b in zip(starts, starts[1:] + [n], strict=True)) == sorted(lengths)
    expected = torch.ones(64)
    expected[[s - 1 for s in starts[1:]] + list(range(n - 1, 64))] = 0  # last token of each document, padding
    assert torch.equal(item["loss_mask"], expected)


@pytest.mark.parametrize(
    ("content", "match"), [("[1]", "format 'list'"), ("{}", "format None"), ("{", "not valid JSON")]
)
def test_foreign_meta_json(tmp_path, content, match):
    (tmp_path / "meta.json").write_text(content)
    with pytest.raises(ShardError, match=match):
        GRPODataset(tmp_path)
