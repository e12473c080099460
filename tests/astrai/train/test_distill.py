"""Knowledge distillation (`astrai.train.distill` through `astrai train`): the loss equals TRL's GKD loss with beta 0
(forward KL(teacher || student)) and not its reverse, the chunked step equals the loss on full `forward` logits, a
student's KL to a teacher folder falls over a short run, the `distill` recipe runs from the CLI with the teacher's
tokenizer, bad teachers and combinations are refused with clear errors, and the config round-trips through
config.json.

Independent reference: TRL 1.16.0's `GKDTrainer.generalized_jsd_loss` (trl.experimental.gkd), whose beta = 0 branch
is `F.kl_div(student_log_probs, teacher_log_probs, log_target=True)` = KL(teacher || student) summed over the
vocabulary and averaged over positions whose label is not -100, at temperature T, without the T^2 factor.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F

from astrai.cli.main import main as astrai_main
from astrai.configs.models import tiny
from astrai.configs.recipes import RECIPES
from astrai.data.batch import LMBatch
from astrai.io.model import Model, load, save
from astrai.io.tokenizer import Tokenizer
from astrai.models.decoder import forward, init_params
from astrai.train import distill, loop
from astrai.train.config import DPOConfig, GRPOConfig, TrainConfig, config_from_dict, config_to_dict, load_config
from astrai.train.distill import DistillConfig, distill_loss, distill_train_loss
from astrai.train.metrics import read_metrics
from astrai.train.optim import AdamWConfig
from astrai.train.schedule import ScheduleConfig
from astrai.train.step import StepOptions
from astrai.tree import leaves, tree_map
from helpers import assert_close


def _gkd_loss():
    """TRL's `GKDTrainer.generalized_jsd_loss` (its experimental-API import warning silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer", reason="trl is the GKD reference (dev extra)")
    return gkd.GKDTrainer.generalized_jsd_loss


def _random_case(seed: int = 0, shape=(3, 7), vocab: int = 50):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(*shape, vocab, generator=g) * 2
    teacher = torch.randn(*shape, vocab, generator=g) * 3
    targets = torch.randint(0, vocab, shape, generator=g)
    mask = (torch.rand(shape, generator=g) > 0.3).float()
    mask[0, 0] = 1.0
    labels = torch.where(mask > 0, targets, -100)  # TRL's (and HF's) way of marking untrained positions
    return student, teacher, targets, mask, labels


# ---- (a) the loss against TRL ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_kl_equals_trl_gkd_with_beta_0_forward_kl(temperature):
    gkd = _gkd_loss()
    student, teacher, targets, mask, labels = _random_case()
    student.requires_grad_(True)
    loss, metrics = distill_loss(student, teacher, targets, mask, temperature=temperature, alpha=1.0)
    want = gkd(student, teacher, labels=labels, beta=0.0, temperature=temperature)
    assert_close(metrics["kl"], want, atol=1e-5, rtol=1e-5)
    assert_close(loss, temperature**2 * want, atol=1e-5, rtol=1e-5)  # Hinton's T^2 on the loss, not the metric
    (ours,) = torch.autograd.grad(loss, student)
    (theirs,) = torch.autograd.grad(temperature**2 * want, student)
    assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
    # negative control: beta 1 is the reverse KL(student || teacher), a different number
    reverse = gkd(student, teacher, labels=labels, beta=1.0, temperature=temperature)
    assert (reverse - want).abs() > 0.05


def test_alpha_mixes_in_torch_cross_entropy_with_label_smoothing():
    gkd = _gkd_loss()
    student, teacher, targets, mask, labels = _random_case(seed=1)
    alpha, temperature, eps = 0.3, 2.0, 0.1
    loss, metrics = distill_loss(student, teacher, targets, mask, temperature=temperature, alpha=alpha,
                                 label_smoothing=eps)  # fmt: skip
    ce = F.cross_entropy(student.reshape(-1, 50), labels.reshape(-1), ignore_index=-100, label_smoothing=eps)
    kl = gkd(student, teacher, labels=labels, beta=0.0, temperature=temperature)
    assert_close(metrics["ce"], ce, atol=1e-5, rtol=1e-5)
    assert_close(loss, alpha * temperature**2 * kl + (1 - alpha) * ce, atol=1e-5, rtol=1e-5)


def test_loss_is_zero_when_the_student_is_the_teacher_and_masked_positions_do_not_count():
    student, _, targets, mask, _ = _random_case(seed=2)
    loss, metrics = distill_loss(student, student.clone(), targets, mask, temperature=1.5)
    assert abs(loss.item()) < 1e-6 and abs(metrics["kl"].item()) < 1e-6
    other = student.clone()
    other[mask == 0] = torch.randn_like(other[mask == 0]) * 10  # teacher differs only where nothing trains
    assert abs(distill_loss(student, other, targets, mask)[0].item()) < 1e-6


def test_config_checks_its_values():
    with pytest.raises(ValueError, match="distill.temperature must be > 0"):
        DistillConfig(teacher=Path("t"), temperature=0.0)
    with pytest.raises(ValueError, match=r"distill.alpha must be in \[0, 1\]"):
        DistillConfig(teacher=Path("t"), alpha=1.5)


# ---- the step's loss: chunks and teacher forward --------------------------------------------------------------------


def _small(vocab: int):
    """A 1-layer student, half the width of `tiny`."""
    return attrs.evolve(tiny(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=1, head_dim=16)


def test_chunked_step_loss_equals_distill_loss_on_full_forward_logits(monkeypatch):
    teacher_cfg, student_cfg = attrs.evolve(tiny(60), num_hidden_layers=2), _small(60)
    teacher, student = init_params(teacher_cfg, seed=1), init_params(student_cfg, seed=2)
    student = tree_map(lambda t: t.detach().requires_grad_(True), student)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 60, (2, 12), generator=g)
    targets = torch.randint(0, 60, (2, 12), generator=g)
    mask = (torch.rand(2, 12, generator=g) > 0.25).float()
    batch = LMBatch(tokens=tokens, targets=targets, loss_mask=mask, positions=torch.arange(12).expand(2, 12))
    want, parts = distill_loss(forward(student, student_cfg, tokens), forward(teacher, teacher_cfg, tokens), targets,
                               mask, temperature=2.0, alpha=0.7)  # fmt: skip
    (want_grad,) = torch.autograd.grad(want, student.blocks[0].mlp.up_proj.weight)
    norm = mask.sum()
    # one chunk; 5 checkpointed chunks of rows (the last one short); chunks of 7 rows from the logits bound
    for chunk, most_logits in ((4096, 2**26), (5, 2**26), (4096, 7 * 60)):
        monkeypatch.setattr(distill, "CHUNK_LOGITS", most_logits)
        opts = StepOptions(compile=False, ce_chunk=chunk)
        loss, task, stats = distill_train_loss(student, None, teacher, batch, norm, False, cfg=student_cfg,
                                               teacher_cfg=teacher_cfg, opts=opts, temperature=2.0,
                                               alpha=0.7)  # fmt: skip
        assert_close(loss, want, atol=1e-5, rtol=1e-5)
        assert_close(task / norm, want, atol=1e-5, rtol=1e-5)
        assert_close(stats["kl"] / norm, parts["kl"], atol=1e-5, rtol=1e-5)
        assert_close(stats["ce"] / norm, parts["ce"], atol=1e-5, rtol=1e-5)
        (grad,) = torch.autograd.grad(loss, student.blocks[0].mlp.up_proj.weight)
        assert_close(grad, want_grad, atol=1e-6, rtol=1e-4)
    assert all(t.grad is None for t in leaves(teacher)) and not any(t.requires_grad for t in leaves(teacher))


# ---- (b) end to end -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def teacher_dir(sft_data, tmp_path_factory) -> Path:
    """A 2-layer `tiny` teacher with the quickstart tokenizer: random weights with a sharpened head (so its
    next-token distributions are far from the student's start), saved with its tokenizer."""
    tokenizer = Tokenizer.from_dir(sft_data[0])
    cfg = attrs.evolve(tiny(len(tokenizer)), num_hidden_layers=2, eos_token_id=tokenizer.eos_token_ids)
    params = init_params(cfg, seed=7)
    params.lm_head.weight.mul_(8.0)
    model = Model(config=cfg, params=params, tokenizer=tokenizer, eos_token_ids=tokenizer.eos_token_ids)
    return save(model, tmp_path_factory.mktemp("teacher") / "model")


def _cfg(sft_data, teacher: Path, out: Path, **kw) -> TrainConfig:
    _, shards = sft_data
    base = dict(
        data=shards, out_dir=out, model="small", seq_len=64, batch_size=4, steps=30,
        optim=AdamWConfig(lr=3e-3, weight_decay=0.0), schedule=ScheduleConfig(kind="constant"), compile=False,
        val_fraction=0.1, eval_batches=2, distill=DistillConfig(teacher=teacher),
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


def test_a_smaller_student_learns_the_teacher(sft_data, teacher_dir, tmp_path):
    cfg = _cfg(sft_data, teacher_dir, tmp_path / "run")  # no --tokenizer: the teacher's is used
    result = loop.train(cfg, _small(512))  # the vocabulary follows the teacher (100), not the 512 here
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl", kind="train")
    kl = [r["kl"] for r in rows]
    assert len(kl) == 30 and all({"kl", "ce", "loss", "grad_norm"} <= r.keys() for r in rows)
    assert all(abs(r["loss"] - r["kl"]) < 1e-4 for r in rows)  # alpha 1, T 1: the loss is the KL
    assert sum(kl[-5:]) / 5 < 0.25 * kl[0], kl
    assert result.eval_loss is not None  # the eval pass is the student's plain cross-entropy
    draft, teacher = load(result.model_dir), load(teacher_dir)
    assert draft.config.vocab_size == teacher.config.vocab_size == 100
    assert draft.config.num_hidden_layers == 1 and draft.eos_token_ids == teacher.eos_token_ids
    assert draft.tokenizer.backend.get_vocab() == teacher.tokenizer.backend.get_vocab()
    assert load_config(tmp_path / "run") == cfg  # (d) the run's config.json round-trips


def test_distill_recipe_runs_from_the_cli(sft_data, teacher_dir, tmp_path, capsys):
    assert RECIPES["distill"]().distill is not None
    args = ["--data", str(sft_data[1]), "--distill.teacher", str(teacher_dir), "--model", "tiny", "--out-dir",
            str(tmp_path / "run"), "--steps", "2", "--seq-len", "64", "--batch-size", "2", "--no-compile",
            "--schedule.warmup-steps", "0", "--distill.temperature", "2.0", "--distill.alpha", "0.5"]  # fmt: skip
    astrai_main(["train", "distill", *args])  # no --tokenizer: the student takes the teacher's
    assert "done: 2 steps" in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["distill"] == {"teacher": str(teacher_dir), "temperature": 2.0, "alpha": 0.5}
    assert load(tmp_path / "run" / "model").config.vocab_size == 100


# ---- (c) clear errors -----------------------------------------------------------------------------------------------


def test_missing_teacher_folder_is_a_clear_error(sft_data, tmp_path):
    cfg = _cfg(sft_data, tmp_path / "nope", tmp_path / "run")
    with pytest.raises(ValueError, match=r"distill.teacher .*nope: cannot load the teacher model .*no such model"):
        loop.train(cfg, _small(100))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"distill.teacher .*empty: cannot load the teacher model .*config.json"):
        loop.train(_cfg(sft_data, tmp_path / "empty", tmp_path / "run"), _small(100))


def test_a_student_folder_with_another_vocabulary_is_refused(sft_data, teacher_dir, tmp_path):
    student = save(Model(config=tiny(512), params=init_params(tiny(512), seed=0)), tmp_path / "student")
    cfg = _cfg(sft_data, teacher_dir, tmp_path / "run", model=str(student), tokenizer=sft_data[0])
    with pytest.raises(ValueError, match=r"its vocab_size is 100, the student's 512: .*same vocabulary"):
        loop.train(cfg, None)


def test_a_tokenizer_with_other_ids_is_refused(sft_data, teacher_dir, tmp_path):
    other = tmp_path / "tokenizer"
    Tokenizer.from_dir(sft_data[0]).save(other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    cfg = _cfg(sft_data, teacher_dir, tmp_path / "run", tokenizer=other)
    with pytest.raises(ValueError, match=r"the student's tokenizer differs from the teacher's \(2 tokens"):
        loop.train(cfg, _small(100))


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"dpo": DPOConfig()}, "distill with dpo is not supported"),
        ({"grpo": GRPOConfig()}, "distill with grpo is not supported"),
        ({"fsdp": True}, "distill with fsdp is not supported"),
        ({"tp": 2}, "--tp 2 with distill is not supported"),
        ({"neftune_alpha": 5.0}, "distill with neftune_alpha > 0 is not supported"),
    ],
)
def test_combinations_are_refused(tmp_path, extra, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(data=tmp_path, distill=DistillConfig(teacher=tmp_path), **extra)


# ---- (d) config round trip ------------------------------------------------------------------------------------------


def test_config_round_trips_and_names_bad_fields(tmp_path):
    cfg = TrainConfig(data=tmp_path, distill=DistillConfig(teacher=tmp_path / "t", temperature=2.0, alpha=0.25))
    data = json.loads(json.dumps(config_to_dict(cfg)))
    assert data["distill"] == {"teacher": str(tmp_path / "t"), "temperature": 2.0, "alpha": 0.25}
    assert config_from_dict(data) == cfg
    assert config_from_dict(config_to_dict(attrs.evolve(cfg, distill=None))).distill is None
    data["distill"]["alpha"] = 2.0
    with pytest.raises(ValueError, match=r"distill.alpha must be in \[0, 1\]"):
        config_from_dict(data)
