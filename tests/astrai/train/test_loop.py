"""The train loop end to end: outputs, SIGTERM + resume == uninterrupted, refusal to overwrite, LoRA, CLI."""

import signal

import attrs
import pytest
import torch

from astrai.configs.models import tiny
from astrai.io.model import load
from astrai.models.decoder import forward
from astrai.nn.lora import LoRAConfig
from astrai.train import loop
from astrai.train.checkpoint import checkpoint_dirs
from astrai.train.metrics import read_metrics
from astrai.tree import named_tensors
from helpers import assert_close


def test_run_writes_metrics_plot_checkpoints_and_a_transformers_loadable_model(train_cfg):
    import transformers

    result = loop.train(train_cfg, tiny())
    run = train_cfg.out_dir
    assert result.steps == 6 and not result.stopped_early and result.model_dir == (run / "model").resolve()
    train_rows = read_metrics(run / "metrics.jsonl", kind="train")
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    assert all({"loss", "lr", "grad_norm", "tok_s"} <= r.keys() for r in train_rows)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl", kind="eval")] == [3, 6]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in checkpoint_dirs(run)] == ["step_00000003", "step_00000006"]
    model = load(result.model_dir)
    tokens = torch.tensor([[5, 17, 33, 8, 2]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert_close(forward(model.params, model.config, tokens), hf(tokens).logits, atol=1e-4)
    assert model.tokenizer is not None and model.eos_token_ids == (2,)


def _stop_at(monkeypatch, stop_step):
    """Send ourselves SIGTERM right after `stop_step` (through the real signal handler)."""
    original = loop.TrainProgress.update

    def update(self, step, metrics):
        original(self, step, metrics)
        if step == stop_step:
            signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(loop.TrainProgress, "update", update)


def test_sigterm_then_resume_replays_the_uninterrupted_trajectory(train_cfg, tmp_path, monkeypatch):
    cfg = attrs.evolve(train_cfg, neftune_alpha=5.0)  # random noise each step: the RNG state must resume too
    full = loop.train(attrs.evolve(cfg, out_dir=tmp_path / "full"), tiny())
    _stop_at(monkeypatch, 2)
    stopped = loop.train(cfg, tiny())
    assert stopped.stopped_early and stopped.steps == 2 and stopped.model_dir is None
    assert checkpoint_dirs(cfg.out_dir)[-1].name == "step_00000002"
    monkeypatch.undo()
    resumed = loop.train(attrs.evolve(cfg, resume=True), tiny())
    assert resumed.steps == 6
    losses = [r["loss"] for r in read_metrics(cfg.out_dir / "metrics.jsonl", kind="train")]
    expected = [r["loss"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl", kind="train")]
    assert losses == pytest.approx(expected, abs=1e-6) and len(losses) == 6
    ours, ref = named_tensors(load(resumed.model_dir).params), named_tensors(load(full.model_dir).params)
    for name in ref:
        assert_close(ours[name], ref[name], atol=1e-6, msg=name)


def test_existing_checkpoints_are_never_overwritten_without_resume(train_cfg):
    loop.train(attrs.evolve(train_cfg, steps=3), tiny())
    with pytest.raises(ValueError, match="already has checkpoints .* --resume"):
        loop.train(train_cfg, tiny())


def test_a_model_name_needs_its_config_from_the_caller(train_cfg):
    # the library never reads configs/models.py: a name is only a label for the ModelConfig passed in
    with pytest.raises(ValueError, match=r"tiny: no such model folder.*\(for a named config, pass its ModelConfig"):
        loop.train(train_cfg)


def test_lora_run_trains_adapters_and_saves_a_merged_model(train_cfg):
    cfg = attrs.evolve(train_cfg, lora=LoRAConfig(r=4, alpha=8, targets=("q_proj", "v_proj")), steps=3)
    result = loop.train(cfg, tiny())
    ckpt = checkpoint_dirs(cfg.out_dir)[-1] / "model"
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
    from astrai.models.decoder import init_params

    base = named_tensors(init_params(attrs.evolve(tiny(vocab_size=100), dtype="float32"), seed=cfg.seed))
    merged = named_tensors(load(result.model_dir).params)
    changed = {name for name in base if not torch.equal(base[name], merged[name])}
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed)


def test_cli_runs_a_recipe_and_resumes_from_its_config(train_cfg, capsys):
    from astrai.cli.main import main

    tokenizer, shards = train_cfg.tokenizer, train_cfg.data
    out = train_cfg.out_dir
    common = ["--seq-len", "64", "--batch-size", "2", "--val-fraction", "0", "--no-compile", "--save-every", "1"]
    main(["train", "sft-tiny", "--data", str(shards), "--tokenizer", str(tokenizer), "--out-dir", str(out),
          "--steps", "2", "--optim.lr", "1e-3", "--schedule.warmup-steps", "1", *common])  # fmt: skip
    assert "done: 2 steps" in capsys.readouterr().out
    main(["train", str(out / "config.json"), "--steps", "3", "--resume"])
    text = capsys.readouterr().out
    assert "done: 3 steps" in text and f"astrai serve --model {out.resolve() / 'model'}" in text.replace("\n", "")
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl", kind="train")] == [1, 2, 3]


def test_cli_names_unknown_recipes(capsys):
    from astrai.cli.main import main

    with pytest.raises(SystemExit) as err:
        main(["train", "no-such-recipe"])
    assert err.value.code == 2 and "unknown recipe 'no-such-recipe'" in capsys.readouterr().err
