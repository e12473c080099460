"""The JSON preprocessing config: defaults, strict types, and errors that name the bad field."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from astrai.data.config import ConfigError, config_from_dict, load_config

BASE = {"kind": "sft", "inputs": ["a.jsonl"], "sections": [{"field": "messages", "action": "$role", "template": True}]}
CONFIGS = Path(__file__).parents[3] / "configs" / "data"


def test_defaults_follow_the_reference():
    cfg = config_from_dict(BASE)
    pre = cfg.preprocessing
    assert (pre.max_seq_len, pre.max_chars, pre.batch_size, pre.max_packed_len) == (2048, 2_000_000, 256, 8192)
    assert (pre.truncation_mode, pre.packing_strategy, pre.max_tokens_per_shard) == ("keep_start", "bfd", 100_000_000)
    assert cfg.mask["assistant"] == "train" and cfg.mask["user"] == "mask" and cfg.mask_default == "mask"


def _set(path: str, value):
    def edit(d):
        *parents, last = path.split(".")
        for p in parents:
            d = d[int(p)] if p.isdigit() else d.setdefault(p, {})
        d[int(last) if last.isdigit() else last] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set("sections.0.action", "bad"), "config.sections[0].action: 'bad' is not one of"),
        (_set("kind", "rlhf"), "config.kind: 'rlhf' is not one of"),
        (lambda d: d.pop("kind"), "config.kind: required field missing"),
        (_set("bogus", 1), "config: unknown field(s) ['bogus']"),
        (_set("sections.0.field", 3), "config.sections[0].field: expected str, got int 3"),
        (_set("sections.0.template", "yes"), "config.sections[0].template: expected bool, got str"),
        (_set("preprocessing.max_seq_len", -1), "config.preprocessing: max_seq_len must be > 0, got -1"),
        (_set("preprocessing.max_seq_len", True), "config.preprocessing.max_seq_len: expected int, got bool"),
        (_set("preprocessing.packing", "bfd"), "config.preprocessing: unknown field(s) ['packing']"),
        (_set("preprocessing", []), "config.preprocessing: expected a JSON object, got list"),
        (_set("mask", {"user": "tr"}), "config.mask['user']: 'tr' is not one of 'train', 'mask'"),
        (_set("inputs", "a.jsonl"), "config.inputs: expected a JSON list, got str"),
        (_set("inputs", []), "config.inputs: give at least one"),
        (_set("prompt", [{"field": "p"}]), "config.prompt: not used by kind 'sft'"),
        (_set("sections.0.template", False), "config.sections[0].action: '$role' needs template: true"),
        (_set("sections", []), "config.sections: kind 'sft' needs at least one section"),
        (_set("answer_field", "a"), "config.answer_field: only kind 'grpo'"),
        (_set("version", 2), "config.version: only version 1 exists"),
    ],
)
def test_errors_name_the_field(edit, message):
    data = copy.deepcopy(BASE)
    edit(data)
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert message in str(err.value)


def test_pretrain_sections_must_be_trained_text():
    data = {**BASE, "kind": "pretrain", "sections": [{"field": "text", "action": "mask"}]}
    with pytest.raises(ConfigError, match="pretrain documents are plain text"):
        config_from_dict(data)


def test_load_config_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config file"):
        load_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="bad.json: not valid JSON"):
        load_config(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({**BASE, "kind": 1}))
    with pytest.raises(ConfigError, match=r"wrong.json: config.kind: 1 is not one of"):
        load_config(wrong)


@pytest.mark.parametrize("name", ["sft_chat", "pretrain_text", "dpo_pairs", "grpo_prompts"])
def test_example_configs_are_valid(name):
    cfg = load_config(CONFIGS / f"{name}.json")
    assert cfg.kind == name.split("_")[0] and cfg.inputs and cfg.output and cfg.tokenizer
