"""`astrai serve --enable-lora --lora-modules ...` (issue 44): vLLM's two spellings of an adapter, the LoRA flags
reaching the EngineConfig, and one clear error (no traceback) for each mistake, a bad adapter folder included."""

from __future__ import annotations

import json

import attrs
import httpx
import pytest
import torch

import astrai
from astrai.cli._common import parse
from astrai.cli.serve import LoRAModule, ServeConfig, engine_config, lora_modules, main
from astrai.io.lora import save_lora
from astrai.nn.lora import LoRAConfig, init_lora
from helpers import tiny_model_dir
from tests.astrai.cli.test_cli import _ServeProcess


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("serve_lora") / "m")


@pytest.fixture(scope="module")
def adapter_dirs(model_dir, tmp_path_factory):
    """Two adapter folders of the tiny model: `good` (r=4) and `wide` (r=32, above the default --max-lora-rank)."""
    params, out = astrai.load(model_dir).params, tmp_path_factory.mktemp("adapters")
    for name, r in (("good", 4), ("wide", 32)):
        cfg = LoRAConfig(r=r, alpha=r, targets=("all-linear",))
        lora = {k: attrs.evolve(v, lora_b=torch.ones_like(v.lora_b) * 0.01) for k, v in init_lora(params, cfg).items()}
        save_lora(lora, cfg, out / name)
    return out


def _cfg(*args: str) -> ServeConfig:
    return parse(ServeConfig, ["some-model", *args])


def test_both_spellings_of_an_adapter_and_the_engine_flags():
    entry = json.dumps({"name": "b", "path": "/p/b", "base_model_name": "some-model"})
    cfg = _cfg("--enable-lora", "--lora-modules", "a=/p/a", entry, "--max-loras", "3", "--max-lora-rank", "32",
               "--max-cpu-loras", "6")  # fmt: skip
    assert lora_modules(cfg, ("some-model",)) == [LoRAModule("a", "/p/a"), LoRAModule("b", "/p/b", "some-model")]
    engine = engine_config(cfg)
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras) == (True, 3, 32, 6)
    assert engine_config(_cfg()).enable_lora is False
    assert lora_modules(_cfg(), ("some-model",)) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--lora-modules", "a=/p"], "--lora-modules needs --enable-lora"),
        (["--enable-lora-runtime-updates"], "--enable-lora-runtime-updates needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "expected name=path or a JSON object"),
        (["--enable-lora", "--lora-modules", "=/p"], "expected name=path"),
        (["--enable-lora", "--lora-modules", '{"name": "a"'], "is not valid JSON"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], '"name" and "path" must be non-empty strings'),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/p", "rank": 4}'], "unknown keys ['rank']"),
        (["--enable-lora", "--lora-modules", "a=/p", "a=/q"], "the name 'a' is given twice"),
        (["--enable-lora", "--lora-modules", "some-model=/p"], "the base model is served under that name"),
        (["--enable-lora", "--lora-modules", '{"name": "a", "path": "/p", "base_model_name": "gpt"}'],
         "base_model_name 'gpt' is not a served model name"),
        (["--enable-lora", "--lora-root", "/no/such/folder"], "is not a folder"),
    ],
)  # fmt: skip
def test_each_mistake_is_one_clear_error(args, says):
    with pytest.raises(ValueError) as err:
        lora_modules(_cfg(*args), ("some-model",))
    assert says in str(err.value)


def test_a_bad_adapter_stops_the_start_with_one_error_line(model_dir, adapter_dirs, capsys):
    for path, says in ((adapter_dirs / "wide", "rank"), (adapter_dirs / "missing", "missing")):
        with pytest.raises(SystemExit) as exit_info:
            main(parse(ServeConfig, [str(model_dir), "--port", "0", "--no-compile", "--enable-lora",
                                     "--lora-modules", f"good={adapter_dirs / 'good'}", f"bad={path}"]))  # fmt: skip
        err = " ".join(capsys.readouterr().err.split())
        assert exit_info.value.code == 2 and f"--lora-modules bad={path}" in err and says in err.lower(), err
        assert "Traceback" not in err


def test_serve_loads_the_adapters_before_serving(model_dir, adapter_dirs):
    """End to end: `astrai serve BASE --enable-lora --lora-modules good=PATH` lists the adapter and serves it."""
    with _ServeProcess(model_dir, "--enable-lora", "--lora-modules", f"good={adapter_dirs / 'good'}") as server:
        cards = httpx.get(f"{server.base_url}/v1/models").json()["data"]
        reply = httpx.post(f"{server.base_url}/v1/completions", json={"model": "good", "prompt": "hi", "max_tokens": 2})
    assert [c["id"] for c in cards] == ["m", "good"] and cards[1]["parent"] == "m", cards
    assert reply.status_code == 200 and reply.json()["model"] == "good", reply.text
    assert "LoRA adapter good loaded" in server.out, server.out
