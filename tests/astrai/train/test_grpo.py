"""The online GRPO trainer (`astrai.train.grpo`, `astrai.train.rollout`, the engine's weight updates) through
`astrai train`.

Independent references:
- rollout log-probs: a plain transformers forward (eager, fp32) of the same weights over prompt + completion,
  log_softmax + gather (temperature 1, no top-k/top-p, so the engine samples from the model's distribution);
- the packed batches and the accumulated / multi-rank normalisation: `grpo_loss` (itself checked against TRL's
  `GRPOTrainer._compute_loss` per loss type in test_grpo_loss.py) on the whole batch at once;
- stale prefix cache: after an in-place weight change the engine's cache is empty and the same prompt is
  recomputed, its log-probs equal to the *new* weights' forward;
- data parallel: two gloo ranks against one process with the same global batch.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import transformers

from astrai.api import forward
from astrai.cli.main import main as astrai_main
from astrai.configs.models import tiny
from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.params import SamplingParams
from astrai.io.model import Model, load, save
from astrai.io.tokenizer import Tokenizer
from astrai.models.decoder import init_params
from astrai.nn.lora import LoRAConfig
from astrai.quickstart.task import make_problems
from astrai.quickstart.vocab import save_tokenizer
from astrai.train import loop
from astrai.train.config import GRPOConfig, TrainConfig, config_to_dict
from astrai.train.grpo import GRPOBatch, GRPOStep
from astrai.train.metrics import read_metrics
from astrai.train.optim import AdamWConfig
from astrai.train.preference import grpo_loss, token_logprobs_of
from astrai.train.rewards import register_reward
from astrai.train.schedule import ScheduleConfig
from astrai.train.step import StepOptions
from astrai.tree import leaves, named_tensors

DIGIT = r"regex:(?s).*\d.*"  # a built-in reward that varies on a random model's completions (a digit or not)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> tuple[Path, Path]:
    """(tokenizer folder, JSONL of 16 addition prompts with answers)."""
    root = tmp_path_factory.mktemp("grpo_data")
    tokenizer = save_tokenizer(root / "tokenizer")
    with open(root / "prompts.jsonl", "w", encoding="utf-8") as f:
        for p in make_problems("add2", 16, seed=3):
            f.write(json.dumps({"prompt": p.question, "answer": p.answer}) + "\n")
    return tokenizer, root / "prompts.jsonl"


def _cfg(prompts, out: Path, grpo: dict | None = None, **kw) -> TrainConfig:
    tokenizer, jsonl = prompts
    base = dict(
        data=jsonl, tokenizer=tokenizer, out_dir=out, model="tiny", seq_len=64, batch_size=2, grad_accum=1, steps=2,
        optim=AdamWConfig(lr=3e-3, weight_decay=0.0), schedule=ScheduleConfig(kind="constant"), compile=False,
        save_every=0,
        grpo=GRPOConfig(**{"num_generations": 4, "max_completion_tokens": 8, "rewards": (DIGIT,), **(grpo or {})}),
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def _model(tokenizer_dir: Path, seed: int = 0) -> Model:
    tok = Tokenizer.from_dir(tokenizer_dir)
    cfg = attrs.evolve(tiny(), vocab_size=len(tok), eos_token_id=tok.eos_token_ids, bos_token_id=None)
    return Model(config=cfg, params=init_params(cfg, seed=seed), tokenizer=tok, eos_token_ids=tok.eos_token_ids)


def _engine(model: Model) -> Engine:
    return Engine(model, EngineConfig(compile=False, background=False, kv_budget_tokens=4096, max_model_len=128))


# ---- the engine: rollout log-probs, weight updates -----------------------------------------------------------------


def test_rollout_logprobs_equal_a_transformers_forward(prompts, tmp_path):
    tokenizer, _ = prompts
    model = _model(tokenizer)
    hf = transformers.AutoModelForCausalLM.from_pretrained(save(model, tmp_path / "hf"), dtype=torch.float32,
                                                           attn_implementation="eager")  # fmt: skip
    prompt = model.tokenizer.encode_prompt("What is 47 + 85?")
    params = SamplingParams(max_tokens=12, temperature=1.0, n=4, seed=5, logprobs=True)
    (done,) = _engine(model).run_batch([prompt], params)
    assert len(done.outputs) == 4 and len({o.token_ids for o in done.outputs}) > 1  # sampled, not greedy
    for out in done.outputs:
        ids = torch.tensor(prompt + list(out.token_ids))
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids[None]).logits[0].float(), dim=-1)[:-1].gather(1, ids[1:, None])[:, 0]
        want = logp[len(prompt) - 1 :]  # the completion tokens
        assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-4), (out.logprobs, want)


def test_weight_update_leaves_no_stale_prefix_cache(prompts):
    tokenizer, _ = prompts
    model = _model(tokenizer)
    engine = _engine(model)
    prompt = model.tokenizer.encode_prompt("What is 47 + 85? Please answer with the sum only.")  # several pages
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1, logprobs=True)
    engine.run_batch([prompt], params)
    assert engine.stats().kv_pages_cached > 0
    (hit,) = engine.run_batch([prompt], params)
    assert hit.cached_tokens > 0  # without an update, the prompt's pages are reused

    with torch.no_grad():  # an optimizer step: the served tensors change in place
        for t in leaves(model.params):
            t.add_(torch.randn_like(t) * 0.05)
    engine.update_params()
    assert engine.radix.num_cached_pages == 0 and engine.stats().kv_pages_cached == 0
    (fresh,) = engine.run_batch([prompt], params)
    assert fresh.cached_tokens == 0  # recomputed with the new weights
    ids = torch.tensor([prompt + list(fresh.outputs[0].token_ids)])
    with torch.no_grad():
        want = token_logprobs_of(model.params, model.config, ids)[0, len(prompt) - 1 : -1]
    assert torch.allclose(torch.tensor(fresh.outputs[0].logprobs), want, atol=1e-4)

    other = init_params(model.config, seed=1)  # update_params(tree): other tensors, same shapes, no copy
    engine.update_params(other)
    assert engine.model.params is other and engine.radix.num_cached_pages == 0
    with pytest.raises(ValueError, match="shapes"):
        engine.update_params(init_params(attrs.evolve(model.config, hidden_size=32), seed=0))


# ---- the step --------------------------------------------------------------------------------------------------------


def test_rollout_batches_and_one_step_lowers_the_loss(prompts, tmp_path):
    """Two optimizer steps on one rollout (num_iterations 2): packed old log-probs equal a teacher-forced forward,
    the second step's loss on the same batch is lower, and every step empties the engine's prefix cache."""
    cfg = _cfg(prompts, tmp_path / "run", grpo={"num_iterations": 2, "beta": 0.1}, optim=AdamWConfig(lr=1e-2))
    run = loop._Run(cfg, tiny())
    run.prepare_reference(resuming=False)
    assert run.rollouts.engine.model.params is run.state.trainable  # the trainer's own tensors, no copy
    batches = run.rollouts.batches(run.data.train_batches(cfg.batch_size, cfg.grad_accum), 0)
    (mb,) = next(batches)
    assert mb.tokens.shape == (cfg.batch_size * 4, cfg.seq_len) and mb.mask.sum() > 0
    with torch.no_grad():
        want = token_logprobs_of(run.state.trainable, run.model_cfg, mb.tokens)
    assert torch.allclose(mb.old_logps, want * mb.mask, atol=1e-4)  # the engine's = teacher-forced (fp32, T = 1)
    assert torch.allclose(mb.ref_logps, want * mb.mask, atol=1e-4)  # the reference is the start weights
    assert mb.advantages.abs().sum() > 0  # the digit reward varies within groups

    first = loop._step(run, iter([[mb]]))
    assert run.rollouts.engine.radix.num_cached_pages == 0
    second = loop._step(run, iter([[mb]]))
    assert second["loss"] < first["loss"] - 1e-4, (first["loss"], second["loss"])
    assert second["kl"] > 0 and first["kl"] < 1e-6
    for name in ("reward", "reward_std", "rewards/skipped", "completions/mean_length", "rollout_s", "train_s"):
        assert name in second


def test_temperature_logprobs_and_more_than_max_n_generations(prompts, tmp_path):
    """At temperature 0.7 the trained (and, above one iteration, old) log-probs are log_softmax(logits / 0.7) of a
    plain forward; G = 18 > MAX_N goes out as 18 single requests of one prompt and comes back as one group."""
    cfg = _cfg(prompts, tmp_path / "t", grpo={"temperature": 0.7, "num_iterations": 2, "num_generations": 18,
                                              "max_completion_tokens": 3}, batch_size=1)  # fmt: skip
    run = loop._Run(cfg, tiny())
    run.prepare_reference(resuming=False)
    (mb,) = next(run.rollouts.batches(run.data.train_batches(cfg.batch_size, cfg.grad_accum), 0))
    assert mb.tokens.shape[0] == 18 and len({tuple(r) for r in mb.tokens.tolist()}) > 1  # 18 different samples
    with torch.no_grad():
        logits = forward(Model(config=run.model_cfg, params=run.state.trainable), mb.tokens).float()
    want = torch.log_softmax(logits / 0.7, dim=-1)[:, :-1].gather(-1, mb.tokens[:, 1:, None])[..., 0]
    assert torch.allclose(mb.old_logps[:, :-1], want * mb.mask[:, :-1], atol=1e-4)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_accumulated_micro_batches_equal_grpo_loss_on_the_whole_batch(prompts, loss_type):
    torch.manual_seed(0)
    model = _model(prompts[0])
    n, t = 6, 24
    tokens = torch.randint(0, model.config.vocab_size, (n, t))
    mask = torch.zeros(n, t)
    for i in range(n):
        mask[i, 8 : 8 + 3 + 2 * i] = 1.0  # completions of different lengths
    with torch.no_grad():
        logps = token_logprobs_of(model.params, model.config, tokens)
    old = (logps + 0.3 * torch.randn(n, t)) * mask  # an older policy: some ratios are clipped
    ref = (logps + 0.2 * torch.randn(n, t)) * mask
    adv = torch.randn(n)
    grpo = GRPOConfig(num_generations=2, max_completion_tokens=16, beta=0.05, num_iterations=2, loss_type=loss_type)
    step = GRPOStep(model.config, StepOptions(compile=False), AdamWConfig(), grpo, trainable=model.params)
    parts = [slice(0, 2), slice(2, 6)]
    micro = [GRPOBatch(tokens=tokens[p], mask=mask[p], advantages=adv[p], old_logps=old[p], ref_logps=ref[p])
             for p in parts]  # fmt: skip
    norm = torch.stack([step.counts(mb) for mb in micro]).sum(0)[0]
    got = sum(step.micro_loss(model.params, None, mb, norm)[0] for mb in micro)
    kw = dict(epsilon_low=0.2, epsilon_high=0.2, beta=0.05, loss_type=loss_type, max_completion_length=16)
    if loss_type == "bnpo":  # TRL: the mean of the micro-batches' token means
        want = sum(grpo_loss(logps[p], old[p], ref[p], adv[p], mask[p], **kw)[0] for p in parts) / 2
    else:
        want, _ = grpo_loss(logps, old, ref, adv, mask, **kw)
    assert abs(got.item() - want.item()) < 1e-6


# ---- the whole run ---------------------------------------------------------------------------------------------------


@pytest.mark.slow  # ~30 s on 2 cores: torchrun starts two interpreters
def test_two_gloo_ranks_match_one_process(prompts, tmp_path):
    """Global batch 4 prompts x G 4: one process with 2 accumulated micro-batches == 2 gloo ranks x 2 prompts
    (each rank rolls out its own prompts with its own engine; reference and rewards on each rank)."""
    base = _cfg(prompts, tmp_path / "single", grad_accum=2, grpo={"beta": 0.1, "loss_type": "grpo"})
    loop.train(base, tiny())
    cfg = attrs.evolve(base, out_dir=tmp_path / "ddp", grad_accum=1)
    (tmp_path / "ddp.json").write_text(json.dumps(config_to_dict(cfg)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
           "-m", "astrai.cli.main", "train", str(tmp_path / "ddp.json")]  # fmt: skip
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    single = read_metrics(base.out_dir / "metrics.jsonl", "train")
    ddp = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    assert len(single) == len(ddp) == 2 and single[0]["reward_std"] > 0
    for name in ("loss", "kl", "reward", "reward_std", "completions/mean_length", "clip_ratio/region_mean"):
        assert [r[name] for r in ddp] == pytest.approx([r[name] for r in single], abs=1e-5), name
    want = named_tensors(load(base.out_dir / "model", dtype=torch.float32).params)
    got = named_tensors(load(cfg.out_dir / "model", dtype=torch.float32).params)
    for name, t in want.items():
        assert torch.allclose(got[name], t, atol=1e-5), name


def test_resume_equals_uninterrupted(prompts, tmp_path):
    """Rollout seeds depend on (seed, step, prompt), so a resumed run samples what the uninterrupted one did."""
    full = _cfg(prompts, tmp_path / "full", steps=2, grpo={"beta": 0.1})
    loop.train(full, tiny())
    part = attrs.evolve(full, out_dir=tmp_path / "part", steps=1)
    loop.train(part, tiny())
    loop.train(attrs.evolve(full, out_dir=part.out_dir, resume=True), tiny())
    rows, resumed = (read_metrics(c.out_dir / "metrics.jsonl", "train") for c in (full, part))
    assert [r["step"] for r in resumed] == [1, 2] and (full.out_dir / "loss.png").is_file()
    for name in ("loss", "reward", "kl"):
        assert [r[name] for r in resumed] == pytest.approx([r[name] for r in rows], abs=1e-6), name
    want = named_tensors(load(full.out_dir / "model", dtype=torch.float32).params)
    got = named_tensors(load(part.out_dir / "model", dtype=torch.float32).params)
    for name, t in want.items():
        assert torch.allclose(got[name], t, atol=1e-6), name


def _raises(prompt, completion, **record):
    raise RuntimeError("reward server down")


def test_bad_input_counted_skips_and_clear_errors(prompts, tmp_path, caplog):
    with pytest.raises(ValueError, match="num_generations must be >= 2"):
        GRPOConfig(num_generations=1)
    with pytest.raises(ValueError, match="no room for the prompt"):
        _cfg(prompts, tmp_path / "x", seq_len=8)
    register_reward("test_always_raises", _raises)
    cfg = _cfg(prompts, tmp_path / "skip", steps=1, grpo={"rewards": ("test_always_raises", DIGIT)})
    with caplog.at_level(logging.WARNING, logger="astrai.train"):
        result = loop.train(cfg, tiny())
    assert result.steps == 1 and result.model_dir is not None  # the run finished and saved
    (row,) = read_metrics(cfg.out_dir / "metrics.jsonl", "train")
    assert row["rewards/skipped"] == 8 and row["rewards/test_always_raises/mean"] == 0.0
    assert any("test_always_raises" in r.getMessage() and "reward server down" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_lora_rollouts_serve_the_adapters_and_the_reference_is_the_base(prompts, tmp_path):
    cfg = _cfg(prompts, tmp_path / "lora", lora=LoRAConfig(r=4), grpo={"beta": 0.1})
    run = loop._Run(cfg, tiny())
    run.prepare_reference(resuming=False)
    assert run.rollouts.reference is run.base  # no copy of the weights
    served = {t.data_ptr() for t in leaves(run.rollouts.engine.model.params)}
    assert {t.data_ptr() for t in leaves(run.base)} <= served  # the base, shared
    assert {t.data_ptr() for t in leaves(run.state.trainable)} <= served  # the live adapters


def test_grpo_tiny_recipe_runs_from_the_cli(prompts, tmp_path, capsys):
    tokenizer, jsonl = prompts
    out = tmp_path / "cli"
    astrai_main(["train", "grpo-tiny", "--data", str(jsonl), "--tokenizer", str(tokenizer), "--out-dir", str(out),
                 "--steps", "1", "--seq-len", "64", "--batch-size", "2", "--grpo.num-generations", "4",
                 "--grpo.max-completion-tokens", "6", "--grpo.rewards", "exact_match", DIGIT, "--grpo.beta", "0.02",
                 "--no-compile"])  # fmt: skip
    assert "done: 1 steps" in capsys.readouterr().out
    saved = json.loads((out / "config.json").read_text())["grpo"]
    assert saved["num_generations"] == 4 and saved["rewards"] == ["exact_match", DIGIT] and saved["beta"] == 0.02
    (row,) = read_metrics(out / "metrics.jsonl", "train")
    assert row["completions/mean_length"] <= 6 and (out / "model").is_dir()
    assert (out / "prompts" / "meta.json").is_file()  # the JSONL was rendered once into the run folder
