"""`TrainConfig`: everything a training run needs, as one typed tree (tyro flags, recipes, the run's config.json).

Named recipes in `configs/recipes.py` return a `TrainConfig`; `astrai train RECIPE --optim.lr 3e-4` overrides
fields with tyro; every run writes its resolved config to `RUN/config.json`, and `astrai train RUN/config.json`
re-runs (or `--resume`s) it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import attrs
import cattrs
from cattrs.v import format_exception

from astrai.nn.lora import LoRAConfig
from astrai.train.distill import DistillConfig
from astrai.train.optim import OptimConfig, as_optim_config, uses_muon
from astrai.train.schedule import ScheduleConfig


@attrs.frozen(kw_only=True)
class DPOConfig:
    """Direct preference optimisation on `dpo` shards (`astrai.train.dpo`; losses in `astrai.train.preference`)."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward (the IPO regulariser tau for loss_type ipo)."""
    loss_type: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    """sigmoid (DPO; cDPO with label_smoothing > 0), ipo (length-normalised, as TRL) or hinge (SLiC)."""
    label_smoothing: float = 0.0
    """cDPO's probability that a preference label is flipped, in [0, 0.5); sigmoid only."""
    reference: Literal["precomputed", "frozen"] = "precomputed"
    """precomputed: one no-grad pass over the training pairs with the start weights before step 1, stored as
    RUN/reference_logps.safetensors (read back on resume); frozen: the start weights compute them per batch (a
    second copy of the weights, except with LoRA, whose reference is the base itself)."""

    def __attrs_post_init__(self) -> None:
        if self.beta <= 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"dpo.label_smoothing applies to loss_type sigmoid only, not {self.loss_type}")


@attrs.frozen(kw_only=True)
class GRPOConfig:
    """Online GRPO: rollouts from astrai's `Engine` on `grpo` prompts, rewards, group advantages and TRL's clipped
    objective (`astrai.train.grpo`, `astrai.train.rollout`; losses in `astrai.train.preference`)."""

    num_generations: int = 8
    """G: completions sampled per prompt (>= 2; `batch_size` counts prompts, so a micro-batch has batch_size * G
    rows)."""
    max_completion_tokens: int = 64
    """Tokens generated per completion at most (prompt + this must fit in seq_len)."""
    temperature: float = 1.0
    """Sampling temperature; the trained log-probs are softmax(logits / temperature), as TRL."""
    top_p: float = 1.0
    """Nucleus sampling mass (1: off)."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    beta: float = 0.0
    """k3 KL coefficient to the reference (the start weights, or the LoRA base); 0 skips the reference."""
    epsilon_low: float = 0.2
    """Lower clip range: the ratio is clipped at 1 - epsilon_low."""
    epsilon_high: float = 0.2
    """Upper clip range: 1 + epsilon_high (DAPO's clip-higher uses 0.28)."""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """Normalisation: grpo (per-sequence mean), bnpo (per-micro-batch token mean), dr_grpo (over batch *
    max_completion_tokens), dapo (over the global batch's completion tokens); TRL's names and default."""
    scale_rewards: bool = True
    """Divide advantages by the group's reward std (False: Dr. GRPO)."""
    num_iterations: int = 1
    """Optimizer steps per rollout batch (mu); above 1 the ratio uses the log-probs recorded at rollout time."""
    rewards: tuple[str, ...] = ("exact_match",)
    """Reward function names (`astrai.train.rewards`: exact_match, exact_match:RULE, format, regex:PATTERN, code,
    or package.module:function)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per reward (empty: all 1)."""

    def __attrs_post_init__(self) -> None:
        from astrai.train.rewards import resolve_reward

        if self.num_generations < 2:
            raise ValueError(f"grpo.num_generations must be >= 2 (G = 1 has no group to compare with: every "
                             f"advantage would be 0), got {self.num_generations}")  # fmt: skip
        for name in ("max_completion_tokens", "num_iterations"):
            if getattr(self, name) < 1:
                raise ValueError(f"grpo.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            raise ValueError(f"grpo.temperature must be > 0 (GRPO needs diverse samples), got {self.temperature}")
        if self.beta < 0 or self.epsilon_low < 0 or self.epsilon_high < 0:
            raise ValueError("grpo.beta, grpo.epsilon_low and grpo.epsilon_high must be >= 0")
        if not self.rewards:
            raise ValueError("grpo.rewards: give at least one reward function")
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"grpo.reward_weights has {len(self.reward_weights)} weights for "
                             f"{len(self.rewards)} rewards")  # fmt: skip
        for name in self.rewards:
            resolve_reward(name)  # an unknown name fails here, before any rollout


@attrs.frozen(kw_only=True)
class TrainConfig:
    """One training run."""

    data: Path
    """Preprocessed shard folder (`astrai preprocess` output): pretraining text, packed SFT rows, DPO pairs or GRPO
    prompts (GRPO also reads a JSONL file of prompts)."""
    out_dir: Path = Path("runs/train")
    """Run folder: config.json, metrics.jsonl, loss.png, checkpoints/, model/ (the final weights)."""
    model: str = "tiny"
    """A named config from configs/models.py (random init) or a model folder to fine-tune."""
    tokenizer: Path | None = None
    """Folder with tokenizer.json saved next to the weights (default: the model folder, if it has one)."""
    val_data: Path | None = None
    """Held-out shard folder for eval loss (default: `val_fraction` of `data`)."""
    val_fraction: float = 0.0
    """Share of `data` items held out for eval loss when `val_data` is not given."""
    seq_len: int = 512
    """Tokens per row (DPO: per prompt + response side; GRPO: prompt + completion; rows are padded to it)."""
    batch_size: int = 8
    """Rows per micro-batch on each rank (GRPO: prompts, each giving num_generations rows)."""
    grad_accum: int = 1
    """Micro-batches per optimiser step (global batch = batch_size * grad_accum * ranks)."""
    steps: int = 1000
    """Optimiser steps."""
    optim: OptimConfig = attrs.field(default=OptimConfig(), converter=as_optim_config)
    """Optimizer: AdamW (torch.optim) hyperparameters, and `name` muon for Muon on the blocks' matrices (`muon.*`)
    with AdamW on the rest (an `AdamWConfig` given here means AdamW)."""
    schedule: ScheduleConfig = ScheduleConfig()
    """Learning-rate schedule (total_steps 0 = `steps`)."""
    max_grad_norm: float | None = 1.0
    """Global-norm gradient clipping (None: off)."""
    precision: Literal["fp32", "bf16"] = "fp32"
    """bf16: autocast compute with fp32 master weights and optimizer state."""
    neftune_alpha: float = 0.0
    """NEFTune embedding-noise scale (0: off)."""
    label_smoothing: float = 0.0
    """Cross-entropy label smoothing."""
    activation_checkpointing: bool = False
    """Recompute each block in backward (less memory, ~30% more compute)."""
    lora: LoRAConfig | None = None
    """Train LoRA adapters on a frozen base instead of all weights."""
    dpo: DPOConfig | None = None
    """Train with the DPO loss on `dpo` shards (None: the causal-LM loss on pretraining/SFT shards)."""
    grpo: GRPOConfig | None = None
    """Train online GRPO on `grpo` prompt shards, or a JSONL of {"prompt" or "messages", "answer"} records."""
    distill: DistillConfig | None = None
    """Distil a teacher model folder into this model on pretraining/SFT shards: KL(teacher || student) on the
    teacher's logits at every trained token, mixed with the cross-entropy (`astrai.train.distill`); e.g. a draft
    model for speculative decoding. Not with dpo, grpo, fsdp, tp or neftune."""
    eval_every: int = 0
    """Steps between eval-loss passes (0: only at the end when there is eval data)."""
    eval_batches: int = 8
    """Micro-batches per eval pass."""
    save_every: int = 0
    """Steps between checkpoints (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept."""
    seed: int = 0
    """Seed for the initial weights, data order and dropout-like noise."""
    device: str | None = None
    """cpu, cuda, cuda:1 ... (default: cuda when available, else cpu; LOCAL_RANK picks the GPU under torchrun)."""
    compile: bool = True
    """torch.compile the loss (forward + backward)."""
    fsdp: bool = False
    """Under torchrun: shard weights, gradients and AdamW state across ranks (ZeRO-3 with DTensor, FSDP2-style)."""
    fsdp_unit: Literal["block", "model"] = "block"
    """With fsdp: all-gather each unit (embedding, each block, final norm + LM head) only while it runs and again
    for its backward (peak: the largest unit; the loss runs eager), or the whole model per micro-batch (a full
    copy; the loss compiles). DPO and GRPO steps always gather the whole model."""
    tp: int = 1
    """Under torchrun: tensor-parallel group size (Megatron layout, `astrai.train.tp`): ranks [k tp, (k + 1) tp)
    split every weight matrix; WORLD_SIZE / tp data-parallel replicas (with --fsdp, each TP shard is also sharded
    over them, 2-D). Not with lora, dpo, grpo, distill or muon."""
    fsdp_gather_dtype: Literal["fp32", "bf16"] = "fp32"
    """With fsdp: dtype of the all-gathered weights (bf16 halves gather traffic and memory; needs precision bf16);
    gradients are reduce-scattered in fp32 and the shards stay fp32."""
    fsdp_prefetch: bool = True
    """With fsdp per block: issue the next block's all-gather before the current block computes (and, in the
    backward, the previous block's re-gather), overlapping communication with compute; peak: two blocks."""
    resume: bool = False
    """Continue from the newest valid checkpoint in out_dir, falling back past corrupt ones with a warning (a
    run never overwrites checkpoints without it); a run already at `steps` says so and does nothing."""
    resume_from: Path | None = None
    """Continue from exactly this checkpoint folder (implies resume; a corrupt one is an error, no fallback;
    the run's newer checkpoints are renamed aside). Never saved in the run's config.json."""
    stop_on_nonfinite: bool = True
    """Stop with an error at the first NaN/inf loss or gradient norm (and refuse to checkpoint non-finite
    weights), saving nothing of that step; False: log it and train on."""

    def __attrs_post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "keep_last", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "save_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.fsdp_unit not in ("block", "model"):
            raise ValueError(f"fsdp_unit must be block or model, got {self.fsdp_unit!r}")
        if self.fsdp_gather_dtype not in ("fp32", "bf16"):
            raise ValueError(f"fsdp_gather_dtype must be fp32 or bf16, got {self.fsdp_gather_dtype!r}")
        if self.fsdp_gather_dtype == "bf16" and self.precision != "bf16":
            raise ValueError("fsdp_gather_dtype bf16 needs precision bf16 (the gathered weights compute)")
        if self.fsdp and self.lora is not None and self.dpo is not None:
            raise ValueError("dpo with lora and fsdp is not supported yet: drop --fsdp (the adapters are small)")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.tp > 1:
            _check_tp_combinations(self)
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}")
        if self.dpo is not None and (self.val_data is not None or self.val_fraction > 0):
            raise ValueError("DPO runs have no eval pass yet: drop val_data and set val_fraction 0")
        if self.distill is not None:
            _check_distill_combinations(self)
        if self.grpo is not None:
            if self.dpo is not None:
                raise ValueError("a run trains either dpo or grpo, not both")
            if self.val_data is not None or self.val_fraction > 0:
                raise ValueError("GRPO runs have no eval pass yet: drop val_data and set val_fraction 0")
            if self.fsdp:
                raise ValueError("grpo with fsdp is not supported: the rollout engine reads whole weights")
            if self.grpo.max_completion_tokens >= self.seq_len:
                raise ValueError(f"grpo.max_completion_tokens {self.grpo.max_completion_tokens} leaves no room for "
                                 f"the prompt in seq_len {self.seq_len}")  # fmt: skip


def _check_distill_combinations(cfg: TrainConfig) -> None:
    """ValueErrors naming --distill.* with what distillation does not combine with."""
    for name in ("dpo", "grpo"):
        if getattr(cfg, name) is not None:
            raise ValueError(f"distill with {name} is not supported: a run trains one objective (distillation runs "
                             f"on pretraining/SFT shards; drop --distill.* or the {name} config)")  # fmt: skip
    if cfg.fsdp:
        raise ValueError("distill with fsdp is not supported yet: the teacher runs whole on each rank (drop --fsdp; "
                         "plain data parallelism under torchrun works)")  # fmt: skip
    if cfg.neftune_alpha > 0:
        raise ValueError("distill with neftune_alpha > 0 is not supported: the student and the teacher must see the "
                         "same embeddings (set --neftune-alpha 0)")  # fmt: skip


def _check_tp_combinations(cfg: TrainConfig) -> None:
    """ValueErrors naming --tp for what tensor-parallel training does not support (yet)."""
    refused = {
        "lora": "the adapters are not split across ranks yet (train LoRA with data parallelism, or --fsdp)",
        "dpo": "the DPO step and its reference pass run the whole model on each rank",
        "grpo": "the rollout engine reads whole weights",
        "distill": "the teacher runs whole on each rank",
    }
    for name, why in refused.items():
        if getattr(cfg, name) is not None:
            raise ValueError(f"--tp {cfg.tp} with {name} is not supported: {why}")
    if uses_muon(cfg.optim):
        raise ValueError(
            f"--tp {cfg.tp} with --optim.name muon is not supported: Muon's Newton-Schulz orthogonalises each "
            "whole matrix, and a rank holds only a slice of it (use AdamW)"
        )


_converter = cattrs.Converter(forbid_extra_keys=True)
_converter.register_unstructure_hook(Path, str)
_converter.register_structure_hook(Path, lambda value, _: Path(value))


def _strict_int(value: Any, _: type) -> int:
    # cattrs' default is int(value): `true` would become 1 and 1e30 or 64.7 a silently different int
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an int, got {value!r}")
    return value


def _strict_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):  # registered because bool is an int subclass: the int hook would catch it
        raise ValueError(f"expected true or false, got {value!r}")
    return value


_converter.register_structure_hook(int, _strict_int)
_converter.register_structure_hook(bool, _strict_bool)


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """JSON-ready dict of `cfg`."""
    return _converter.unstructure(cfg)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Inverse of `config_to_dict`; names the offending field on bad input."""
    if not isinstance(data, dict):  # cattrs would fail with an AttributeError deep in its generated code
        raise ValueError(f"invalid train config: expected a JSON object of fields, got {type(data).__name__}")
    try:
        return _converter.structure(data, TrainConfig)
    except cattrs.BaseValidationError as err:
        details = "; ".join(cattrs.transform_error(err, format_exception=_format))
        raise ValueError(f"invalid train config: {details}") from None


def _format(exc: BaseException, type_: type | None) -> str:
    # a class's own check (e.g. "batch_size must be >= 1") says more than cattrs' generic "invalid value"
    if type_ is None and type(exc) is ValueError:
        return str(exc)
    return format_exception(exc, type_)


def load_config(path: str | Path) -> TrainConfig:
    """Read a run's config.json (or a run folder containing one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such train config") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON ({err})") from None
    return config_from_dict(data)
