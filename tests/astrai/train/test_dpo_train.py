"""The DPO trainer (`astrai.train.dpo` through `astrai train`): start loss log 2, loss and gradient equal to
`dpo_loss` on log-probs from a plain transformers forward of the same weights, rewards rise, LoRA's reference is
the base (no weight copy), resume equals an uninterrupted run, and the `dpo-tiny` recipe runs from the CLI.

Independent reference for the step: the run's initial weights are saved as a Hugging Face folder, loaded into
`transformers` (eager, fp32), and each sequence's log-prob is summed from its *unpadded* logits
(log_softmax + gather over the completion tokens); `dpo_loss` on those (policy = reference at the start) gives the
loss, and autograd through the transformers model gives the gradient, mapped back to our names by `astrai.io.hf`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import transformers

from astrai.cli.main import main as astrai_main
from astrai.configs.models import tiny
from astrai.data.config import config_from_dict
from astrai.data.datasets import DPODataset
from astrai.data.preprocess import preprocess
from astrai.io.hf import astrai_to_hf_name
from astrai.io.model import load, save
from astrai.nn.lora import LoRAConfig
from astrai.quickstart.task import make_problems
from astrai.quickstart.vocab import save_tokenizer
from astrai.train import loop
from astrai.train.config import DPOConfig, TrainConfig, config_to_dict
from astrai.train.data import dpo_batch
from astrai.train.dpo import REFERENCE_FILE, FrozenReference, PrecomputedReference, load_reference, pair_logprobs
from astrai.train.metrics import read_metrics
from astrai.train.optim import AdamWConfig
from astrai.train.preference import dpo_loss
from astrai.train.schedule import ScheduleConfig
from astrai.train.step import StepOptions
from astrai.tree import leaves, named_tensors

LOG2 = math.log(2.0)


@pytest.fixture(scope="module")
def dpo_data(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer folder, DPO shard folder): 8 addition questions, chosen = the right sum, rejected = a wrong one."""
    root = tmp_path_factory.mktemp("dpo_data")
    tokenizer = save_tokenizer(root / "tokenizer")
    with open(root / "pairs.jsonl", "w", encoding="utf-8") as f:
        for i, p in enumerate(make_problems("add2", 8, seed=1)):
            wrong = str(int(p.answer) + 1 + i % 7)
            f.write(json.dumps({"prompt": p.question, "chosen": p.answer, "rejected": wrong}) + "\n")
    cfg = config_from_dict({
        "kind": "dpo", "inputs": [str(root / "pairs.jsonl")], "tokenizer": str(tokenizer),
        "output": str(root / "shards"),
        "prompt": [{"field": "prompt", "template": True, "role": "user", "action": "mask"}],
        "chosen": [{"field": "chosen", "template": True, "role": "assistant", "action": "train"}],
        "rejected": [{"field": "rejected", "template": True, "role": "assistant", "action": "train"}],
        "preprocessing": {"max_seq_len": 64},
    })  # fmt: skip
    preprocess(cfg)
    return tokenizer, root / "shards"


def _cfg(dpo_data, out: Path, **kw) -> TrainConfig:
    tokenizer, shards = dpo_data
    base = dict(
        data=shards, tokenizer=tokenizer, out_dir=out, model="tiny", seq_len=48, batch_size=4, grad_accum=2, steps=4,
        optim=AdamWConfig(lr=3e-3, weight_decay=0.0), schedule=ScheduleConfig(kind="constant"), compile=False,
        save_every=2, keep_last=3, dpo=DPOConfig(),
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _run(cfg: TrainConfig):
    return loop.train(cfg, tiny())


def _metrics(run_dir: Path) -> list[dict]:
    return read_metrics(run_dir / "metrics.jsonl", "train")


# ---- (1) the first step against a transformers forward -------------------------------------------------------------


def _hf_logprob(hf, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum over completion tokens of log p(token | prefix) from transformers' logits of the unpadded sequence."""
    logits = hf(ids[None]).logits[0].float()  # [n, V]
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[1:, None])[:, 0]  # [n - 1]
    return (logp * mask[1:].float()).sum()


def test_first_step_is_log2_and_matches_transformers(dpo_data, tmp_path):
    """The compiled DPO loss on the run's first micro-batch: log 2, and loss and gradient equal to `dpo_loss` on
    sequence log-probs of a transformers forward of the same start weights (precomputed reference)."""
    cfg = _cfg(dpo_data, tmp_path / "run", grad_accum=1)
    run = loop._Run(cfg, tiny())
    run.prepare_reference(resuming=False)
    assert isinstance(run.reference, PrecomputedReference) and (cfg.out_dir / REFERENCE_FILE).is_file()
    (mb,) = loop._micro_batches(run, run.data.train_batches(cfg.batch_size, cfg.grad_accum))
    norm = torch.tensor(float(cfg.batch_size))
    loss, _, stats = run.step_fn.micro_loss(run.state.trainable, run.frozen, mb, norm)
    ours = torch.autograd.grad(loss, leaves(run.state.trainable))
    assert abs(loss.item() - LOG2) < 1e-5 and abs(stats["rewards/margins"].item()) < 1e-5

    folder = save(run.model(), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    data = DPODataset(cfg.data)
    logps = {"chosen": [], "rejected": []}
    for i in mb.index.tolist():
        item = data[i]
        for side in logps:
            logps[side].append(_hf_logprob(hf, item[side], item[f"{side}_mask"]))
    pc, pr = torch.stack(logps["chosen"]), torch.stack(logps["rejected"])
    assert torch.allclose(mb.ref, torch.stack([pc, pr]).detach(), atol=1e-4)  # the precomputed reference
    want, _ = dpo_loss(pc, pr, pc.detach(), pr.detach(), beta=cfg.dpo.beta)
    assert abs(want.item() - LOG2) < 1e-6 and abs(loss.item() - want.item()) < 1e-5
    want.backward()
    hf_grads = dict(hf.named_parameters())
    for (name, _), g in zip(named_tensors(run.state.trainable).items(), ours, strict=True):
        ref = hf_grads[astrai_to_hf_name(name, run.model_cfg.model_type)].grad
        ref = ref if ref.shape == g.shape else ref.T
        assert torch.allclose(g, ref, atol=1e-5, rtol=1e-3), name


# ---- (2) training raises the margins; (4) resume equals uninterrupted ----------------------------------------------


def test_steps_raise_margins_and_resume_equals_uninterrupted(dpo_data, tmp_path, monkeypatch):
    full = _cfg(dpo_data, tmp_path / "full", steps=4, save_every=2, batch_size=2)  # 4 of the 8 pairs per step
    _run(full)
    rows = _metrics(full.out_dir)
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert abs(rows[0]["loss"] - LOG2) < 1e-5
    assert rows[0]["rewards/margins"] == 0 and rows[0]["rewards/accuracies"] == 0  # policy == reference
    # the trained model against the stored reference on all 8 pairs: positive margins, mostly correct
    model = load(full.out_dir / "model", dtype=torch.float32)
    data = DPODataset(full.data)
    batch = dpo_batch([data[i] for i in range(len(data))], range(len(data)), pad_id=data.pad_id, seq_len=full.seq_len)
    with torch.no_grad():
        policy = pair_logprobs(model.params, batch.pairs, cfg=model.config, opts=StepOptions(compile=False))
    ref = load_reference(full.out_dir / REFERENCE_FILE, len(data))
    _, after = dpo_loss(policy[0], policy[1], ref[0], ref[1], beta=full.dpo.beta)
    assert after["rewards/margins"] > 0.05 and after["rewards/accuracies"] >= 0.75, after
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "grad_norm"} <= set(rows[-1])

    part = attrs.evolve(full, out_dir=tmp_path / "part", steps=2)
    _run(part)

    def no_recompute(*args, **kwargs):
        raise AssertionError("resume must read the stored reference log-probs, not recompute them")

    monkeypatch.setattr("astrai.train.dpo.precompute_reference", no_recompute)
    _run(attrs.evolve(full, out_dir=part.out_dir, resume=True))
    resumed = _metrics(part.out_dir)
    assert [r["step"] for r in resumed] == list(range(1, 5))
    for a, b in zip(rows, resumed, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and abs(a["rewards/margins"] - b["rewards/margins"]) < 1e-6
    want = named_tensors(load(full.out_dir / "model", dtype=torch.float32).params)
    got = named_tensors(load(part.out_dir / "model", dtype=torch.float32).params)
    for name, t in want.items():
        assert torch.equal(t, got[name]), name


# ---- (3) LoRA: the reference is the base with adapters off ---------------------------------------------------------


@pytest.mark.parametrize("reference", ["frozen", "precomputed"])
def test_lora_reference_is_the_base_without_a_copy(dpo_data, tmp_path, reference):
    cfg = _cfg(dpo_data, tmp_path / "lora", grad_accum=1, lora=LoRAConfig(r=4), dpo=DPOConfig(reference=reference))
    run = loop._Run(cfg, tiny())
    base_ptrs = {t.data_ptr() for t in leaves(run.base)}
    before = _storages(run)
    run.prepare_reference(resuming=False)
    assert _storages(run) == before  # no new weight-sized storage anywhere in the run
    if reference == "frozen":
        assert isinstance(run.reference, FrozenReference) and run.reference.params is run.frozen
        assert {t.data_ptr() for t in leaves(run.reference.params)} == base_ptrs
    (mb,) = loop._micro_batches(run, run.data.train_batches(cfg.batch_size, cfg.grad_accum))
    norm = torch.tensor(float(cfg.batch_size))
    loss, _, _ = run.step_fn.micro_loss(run.state.trainable, run.frozen, mb, norm)
    assert abs(loss.item() - LOG2) < 1e-5  # B = 0 adapters: policy == base == reference
    # training moves only the adapters; the frozen reference still is the untouched base
    run.step_fn(run.state, [mb], 1e-2, run.frozen)
    if reference == "frozen":
        _, _, stats = run.step_fn.micro_loss(run.state.trainable, run.frozen, mb, norm)
        assert abs(stats["rewards/margins"].item()) > 0 and torch.allclose(mb.ref, run.reference(mb))


def _storages(run) -> set[int]:
    """Data pointers of every weight-sized tensor the run holds (base, trainable tree, reference)."""
    trees = [run.base, run.frozen, run.state.trainable, getattr(run.reference, "params", None)]
    tensors = [t for tree in trees if tree is not None for t in leaves(tree) if t.numel() > 1024]
    return {t.untyped_storage().data_ptr() for t in tensors}


# ---- (5) the recipe from the CLI -------------------------------------------------------------------------------------


def test_dpo_tiny_recipe_runs_from_the_cli(dpo_data, tmp_path, capsys):
    tokenizer, shards = dpo_data
    out = tmp_path / "cli"
    astrai_main(["train", "dpo-tiny", "--data", str(shards), "--tokenizer", str(tokenizer), "--out-dir", str(out),
                 "--steps", "2", "--seq-len", "48", "--batch-size", "2", "--dpo.beta", "0.2",
                 "--dpo.reference", "frozen", "--schedule.warmup-steps", "1", "--no-compile"])  # fmt: skip
    assert "done: 2 steps" in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())
    assert saved["dpo"] == {"beta": 0.2, "loss_type": "sigmoid", "label_smoothing": 0.0, "reference": "frozen"}
    rows = _metrics(out)
    assert len(rows) == 2 and abs(rows[0]["loss"] - LOG2) < 1e-5 and (out / "model").is_dir()


# ---- gradient accumulation and data parallel give the big-batch step ----------------------------------------------


def test_two_gloo_ranks_match_one_process_with_accumulation(dpo_data, tmp_path):
    """Global batch 4: one process with 2 accumulated micro-batches of 2 pairs == 2 gloo ranks x 2 pairs (the
    reference pass split over the ranks too)."""
    base = _cfg(dpo_data, tmp_path / "single", steps=2, batch_size=2, grad_accum=2, save_every=0)
    loop.train(base, tiny())
    cfg = attrs.evolve(base, out_dir=tmp_path / "ddp", grad_accum=1)
    (tmp_path / "ddp.json").write_text(json.dumps(config_to_dict(cfg)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "-m", "astrai.cli.main", "train", str(tmp_path / "ddp.json")]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single, ddp = _metrics(base.out_dir), _metrics(cfg.out_dir)
    for name in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen"):
        assert [r[name] for r in ddp] == pytest.approx([r[name] for r in single], abs=1e-5), name
    want = named_tensors(load(base.out_dir / "model", dtype=torch.float32).params)
    got = named_tensors(load(cfg.out_dir / "model", dtype=torch.float32).params)
    for name, t in want.items():
        assert torch.allclose(got[name], t, atol=1e-5), name
