"""The host training loop behind `astrai train`: data, schedule, progress, eval, checkpoints, resume, signals.

Never compiled itself; each optimiser step calls `TrainStep` (whose loss is compiled), eval calls `eval_sums`;
both get the trees they read as arguments from the run. Order per step:
sample a global batch → accumulate micro-batch gradients → all-reduce → clip → AdamW (or Muon + AdamW) → log
the *post-clip* step's metrics → eval when due → checkpoint when due (the checkpoint holds the weights *after*
that step, so resuming from step N replays exactly steps N+1...). SIGTERM/SIGINT finish the current step, save,
and return.

Resume picks the newest checkpoint that verifies against its manifest (`astrai.train.checkpoint`), warning
about and setting aside newer corrupt ones, or exactly `TrainConfig.resume_from`; a run already at its last
step returns at once. A NaN/inf loss or gradient norm (read on the host with the step's other metrics, so no
sync is added to the step) or non-finite weights at a checkpoint raise `NonFiniteError` before anything of
that step is saved (`TrainConfig.stop_on_nonfinite`).

With `TrainConfig.dpo` the step is `astrai.train.dpo.DPOStep` on DPO pairs; the reference log-probs come from the
start weights (`astrai.train.dpo.make_reference`, set up before a resume loads newer weights) and are filled into
each micro-batch before the step. With `TrainConfig.grpo` the step is `astrai.train.grpo.GRPOStep` on rollout
batches: `astrai.train.rollout.Rollouts` (set up from the start weights like the DPO reference) generates them with
an `Engine` serving the trainer's own tensors, and drops the engine's prefix cache after every optimizer step.
With `TrainConfig.distill` the step is `astrai.train.distill.DistillStep`, with the teacher folder loaded (and its
vocabulary checked against the student's) before anything else; a named student takes the teacher's vocabulary.

With `TrainConfig.tp` > 1 (`astrai.train.tp`) each rank trains its tensor-parallel shard: the ranks of one TP
group read the same data shard, checkpoints and the final model are gathered into the full model (a collective).
With `--fsdp` alone each rank writes only its shards into checkpoints (`astrai.train.sharded_checkpoint`); the final
model is gathered.

The base model is a `ModelConfig` (random init) or `TrainConfig.model` as a folder; resolving a name such as
"tiny" to a `ModelConfig` is the caller's job (the CLI reads `configs/models.py`: the library never imports it).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import attrs
import torch

from astrai.data.batch import LMBatch
from astrai.io.checkpoint import write_json
from astrai.io.errors import CheckpointError
from astrai.io.lora import load_lora, save_lora
from astrai.io.model import Model, load, save
from astrai.io.tokenizer import Tokenizer
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams, init_params
from astrai.models.tp import shard_params, unshard_params
from astrai.nn.lora import apply_lora, init_lora, merge_lora
from astrai.train import distributed
from astrai.train.checkpoint import (
    MANIFEST,
    Resumable,
    check_weights_match,
    checkpoint_dirs,
    checkpoint_step,
    latest_checkpoint,
    newest_valid_checkpoint,
    open_checkpoint,
    save_checkpoint,
    set_aside,
    set_rng_state,
)
from astrai.train.config import TrainConfig, config_to_dict
from astrai.train.data import DPOBatch, TrainData, open_data
from astrai.train.distill import DistillStep, check_teacher, draft_config, load_teacher
from astrai.train.dpo import DPOStep, batch_rows, make_reference
from astrai.train.fsdp import BlockGather, full_tree, load_into_shards_, make_mesh, shard_tree
from astrai.train.grpo import GRPOStep
from astrai.train.metrics import MetricsLog
from astrai.train.optim import adamw_state_dict, init_optimizer, load_optimizer_state, uses_muon
from astrai.train.plot import loss_curve_png
from astrai.train.progress import TrainProgress
from astrai.train.rollout import Rollouts, make_rollouts
from astrai.train.schedule import lr_at
from astrai.train.sharded_checkpoint import all_finite, load_sharded_, save_sharded_checkpoint
from astrai.train.signals import StopRequest
from astrai.train.step import StepOptions, TrainState, TrainStep, eval_sums, full_params, init_train_state
from astrai.train.tp import TPTrain, check_tp_run, make_layout, shard_adamw, unshard_adamw
from astrai.tree import from_named_tensors, leaves, named_tensors, replace, to_device

_log = logging.getLogger("astrai.train")  # unconfigured, a warning prints as its bare message on stderr


class NonFiniteError(RuntimeError):
    """A step's loss or gradient norm, or the weights about to be checkpointed, are NaN or infinite."""


@attrs.frozen
class TrainResult:
    """What a finished (or stopped) run produced.

    Attributes:
        run_dir: the run folder.
        model_dir: the final model (None when stopped early).
        steps: the step reached.
        stopped_early: a signal stopped the run before its last step.
        final_loss: the last step's train loss (None when no step ran).
        eval_loss: the last eval loss (None without eval data or when no step ran).
        already_finished: `resume` found the run at its last step with its final model: nothing was done.
    """

    run_dir: Path
    model_dir: Path | None
    steps: int
    stopped_early: bool
    final_loss: float | None
    eval_loss: float | None
    already_finished: bool = False


def _base_model(
    cfg: TrainConfig, model_cfg: ModelConfig | None, device: torch.device, teacher: Model | None = None
) -> tuple[ModelConfig, DecoderParams, Tokenizer | None, tuple]:
    """(config, fp32 params on device, tokenizer, eos ids): a random init of `model_cfg` or the folder `cfg.model`
    (with a distillation `teacher`, a random init is its draft: `astrai.train.distill.draft_config`)."""
    tokenizer = Tokenizer.from_dir(cfg.tokenizer) if cfg.tokenizer is not None else None
    if model_cfg is not None:
        if teacher is not None:
            model_cfg, tokenizer = draft_config(model_cfg, teacher, tokenizer)
        elif tokenizer is not None:
            eos = tokenizer.eos_token_ids
            model_cfg = attrs.evolve(model_cfg, vocab_size=len(tokenizer), eos_token_id=eos, bos_token_id=None)
        params = init_params(attrs.evolve(model_cfg, dtype="float32"), seed=cfg.seed, device=device)
        return model_cfg, params, tokenizer, tuple(model_cfg.eos_token_id)
    try:  # a folder or a model id in the local HF cache
        model = load(cfg.model, dtype=torch.float32, device=device)
    except CheckpointError as err:
        raise CheckpointError(f"{err} (for a named config, pass its ModelConfig)") from None
    return model.config, model.params, tokenizer or model.tokenizer, model.eos_token_ids


class _Run:
    """The state of one run on one rank (host objects; tensors live in `state`)."""

    def __init__(self, cfg: TrainConfig, model_cfg: ModelConfig | None) -> None:
        self.cfg = cfg
        check_tp_run(cfg.tp, model_cfg)  # before joining the process group: a bad launch fails on every rank
        self.dist = distributed.setup(cfg.device)
        self.device = self.dist.device
        self.run_dir = Path(cfg.out_dir)
        torch.manual_seed(cfg.seed)
        self.teacher = None  # distillation: the frozen teacher, loaded first (a bad folder fails before anything)
        if cfg.distill is not None:
            self.teacher = load_teacher(cfg.distill, self.device, bf16=cfg.precision == "bf16")
        self.model_cfg, self.base, self.tokenizer, self.eos = _base_model(cfg, model_cfg, self.device, self.teacher)
        if self.teacher is not None:
            check_teacher(self.teacher, cfg.distill.teacher, self.model_cfg, self.tokenizer)
        check_tp_run(cfg.tp, self.model_cfg, self.dist.world_size)
        # TP x DP (astrai.train.tp): the ranks of one TP group read the same data shard (the dp index)
        self.layout = make_layout(cfg.tp, self.dist.rank, self.dist.world_size, self.device)
        self.tp = self.layout.tp
        self.data: TrainData = open_data(cfg, rank=self.layout.dp_rank, world_size=self.layout.dp_size,
                                         tokenizer=self.tokenizer, vocab_size=self.model_cfg.vocab_size)  # fmt: skip
        # trainable: what the optimiser updates; frozen + to_params: how the forward's tree is built from it
        self.lora_cfg = cfg.lora
        if cfg.lora is None:
            trainable, self.frozen, self.to_params = self.base, None, full_params
        else:
            trainable = init_lora(self.base, cfg.lora, seed=cfg.seed)
            self.frozen, self.to_params = self.base, apply_lora
        if self.tp is not None:  # this rank's shard; the full tree is not kept (TrainConfig refuses LoRA/DPO/GRPO)
            trainable, self.base = shard_params(self.base, self.model_cfg, self.tp), None
        self.sharded = cfg.fsdp and self.layout.dp_size > 1  # ZeRO-3 over the (data-parallel) ranks
        self.collective_save = self.sharded or self.tp is not None  # the full model is gathered by every rank
        if self.sharded:
            mesh = self.layout.dp_mesh if self.tp is not None else make_mesh(self.device)
            trainable = shard_tree(trainable, mesh)
            if cfg.lora is not None:  # the frozen base is sharded too (TrainConfig refuses DPO + LoRA + FSDP)
                self.frozen, self.base = shard_tree(self.base, mesh), None
        self.state: TrainState = init_train_state(trainable, cfg.optim)
        self.tp_train = None if self.tp is None else TPTrain(self.model_cfg, self.tp, sharded=self.sharded)
        self.opts = StepOptions(
            max_grad_norm=cfg.max_grad_norm,
            neftune_alpha=cfg.neftune_alpha,
            checkpoint_blocks=cfg.activation_checkpointing,
            autocast_dtype=torch.bfloat16 if cfg.precision == "bf16" else None,
            label_smoothing=cfg.label_smoothing,
            compile=cfg.compile,
        )
        if cfg.dpo is not None:
            self.step_fn: TrainStep = DPOStep(
                self.model_cfg, self.opts, cfg.optim, cfg.dpo, trainable=self.state.trainable,
                to_params=self.to_params, sharded=self.sharded,
            )  # fmt: skip
        elif cfg.grpo is not None:
            self.step_fn = GRPOStep(
                self.model_cfg, self.opts, cfg.optim, cfg.grpo, trainable=self.state.trainable,
                to_params=self.to_params, sharded=self.sharded,
            )  # fmt: skip
        elif cfg.distill is not None:
            self.step_fn = DistillStep(self.model_cfg, self.opts, cfg.optim, cfg.distill, teacher=self.teacher,
                                       trainable=self.state.trainable, to_params=self.to_params)  # fmt: skip
        else:
            self.step_fn = TrainStep(
                self.model_cfg, self.opts, cfg.optim, trainable=self.state.trainable, to_params=self.to_params,
                sharded=self.sharded, fsdp_unit=cfg.fsdp_unit,
                fsdp_param_dtype=torch.bfloat16 if cfg.fsdp_gather_dtype == "bf16" else None,
                fsdp_prefetch=cfg.fsdp_prefetch, tp=self.tp_train, dp_group=self.layout.dp_group,
            )  # fmt: skip
        self.reference = None  # DPO: batch -> [2, B] reference log-probs (`prepare_reference`)
        self.rollouts: Rollouts | None = None  # GRPO: the engine, rewards and reference (`prepare_reference`)
        self.schedule = cfg.schedule if cfg.schedule.total_steps else attrs.evolve(cfg.schedule, total_steps=cfg.steps)
        self.step, self.tokens_seen = 0, 0

    def prepare_reference(self, resuming: bool) -> None:
        """DPO: set up the reference log-probs from the start weights (call before `resume` changes them); GRPO:
        the rollouts and their reference (a copy of the start weights, or the LoRA base: no copy)."""
        if self.cfg.grpo is not None:
            self.rollouts = make_rollouts(
                self.cfg.grpo, start=self.base, shared=self.lora_cfg is not None, model_cfg=self.model_cfg,
                policy=self.to_params(self.frozen, self.state.trainable), tokenizer=self.tokenizer, eos=self.eos,
                opts=self.opts, seq_len=self.cfg.seq_len, prompts_per_step=self.cfg.batch_size * self.cfg.grad_accum,
                seed=self.cfg.seed, device=self.device,
            )  # fmt: skip
        if self.cfg.dpo is None:
            return
        self.reference = make_reference(
            self.cfg.dpo, self.base, shared=self.lora_cfg is not None, data=self.data.train, run_dir=self.run_dir,
            resuming=resuming, cfg=self.model_cfg, opts=self.opts, batch_size=self.cfg.batch_size,
            seq_len=self.cfg.seq_len, device=self.device, rank=self.dist.rank, world_size=self.dist.world_size,
        )  # fmt: skip

    # ---- weights ------------------------------------------------------------------------------------------
    def params(self) -> DecoderParams:
        """The full parameter tree (LoRA merged) as plain detached tensors; collective when sharded."""
        trainable = full_tree(self.state.trainable) if self.sharded else self.state.trainable
        if self.tp is not None:
            trainable = unshard_params(trainable, self.model_cfg, self.tp)  # collective over the TP group
        if self.lora_cfg is None:
            return trainable
        return merge_lora(full_tree(self.frozen) if self.sharded else self.base, trainable)

    def model(self) -> Model:
        params = to_device(self.params(), "cpu")
        params = from_named_tensors(params, {k: v.detach() for k, v in named_tensors(params).items()})
        return Model(config=self.model_cfg, params=params, tokenizer=self.tokenizer, eos_token_ids=self.eos)

    # ---- checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        state = {"tokens_seen": self.tokens_seen, "sampler": self.data.sampler.state_dict(),
                 "config": config_to_dict(self.cfg)}  # fmt: skip
        if self.sharded and self.tp is None:  # each rank writes its own shards: no full copy anywhere
            if self.cfg.stop_on_nonfinite and not all_finite(self.state.trainable):
                raise NonFiniteError(_nonfinite_message(self, "the updated weights are not finite"))
            save_sharded_checkpoint(self.run_dir, self.step, trainable=self.state.trainable, opt=self.state.opt,
                                    state=state, keep_last=self.cfg.keep_last, model_cfg=self.model_cfg,
                                    eos=self.eos, lora=self.lora_cfg, tokenizer=self.tokenizer)  # fmt: skip
            distributed.barrier()
            return
        # TP: sharded weights and moments are gathered on every rank (a collective), then rank 0 writes them
        model = self.model() if self.lora_cfg is None and (self.dist.is_main or self.collective_save) else None
        adapters = None  # LoRA: the adapters to write, gathered on every rank when sharded
        if self.lora_cfg is not None:
            adapters = full_tree(self.state.trainable) if self.sharded else self.state.trainable
        gathered = adapters
        if gathered is None:
            gathered = model.params if self.collective_save else self.state.trainable
        # the same verdict on every rank: replicas are identical, and sharded runs check the gathered weights
        if self.cfg.stop_on_nonfinite and not _all_finite(gathered):
            raise NonFiniteError(_nonfinite_message(self, "the updated weights are not finite"))
        opt = full_tree(self.state.opt) if self.sharded else self.state.opt
        # TP: the full model's moments (collective), as a 1-process run saves them: resumable on any --tp
        optimizer = adamw_state_dict(opt if self.tp is None else unshard_adamw(opt, self.model_cfg, self.tp))
        if self.dist.is_main:

            def write_model(folder: Path) -> None:
                if self.lora_cfg is not None:
                    save_lora(adapters, self.lora_cfg, folder)
                else:
                    save(model, folder)

            save_checkpoint(
                self.run_dir,
                self.step,
                write_model=write_model,
                optimizer=optimizer,
                state=state,
                keep_last=self.cfg.keep_last,
            )
        distributed.barrier()

    def resume(self, found: Resumable) -> None:
        """Load checkpoint `found` (weights read in full before anything is replaced)."""
        path, state = found.path, found.state
        if found.sharded:  # per-rank shards of an --fsdp run, read one full tensor at a time on any world size
            if self.tp is not None:
                raise CheckpointError(f"{path}: a sharded --fsdp checkpoint resumes without --tp (export it first)")
            load_sharded_(path, self.state.trainable, self.state.opt)
        else:
            self._load_gathered(path, found.optimizer)
        self.data.sampler.load_state_dict(state["sampler"])
        set_rng_state(found.rng)
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    def _load_gathered(self, path: Path, optimizer: dict[str, torch.Tensor]) -> None:
        """Weights from `path/model` and the full model's optimizer tensors, into this rank's (sharded) trees."""
        if self.lora_cfg is not None:
            lora, _ = load_lora(path / "model", self.base if self.base is not None else self.frozen)
            weights = named_tensors(lora)
        else:
            full = load(path / "model", dtype=torch.float32, device=self.device).params
            weights = named_tensors(full if self.tp is None else shard_params(full, self.model_cfg, self.tp))
        check_weights_match(path / "model", weights, named_tensors(self.state.trainable))
        load_into_shards_(self.state.trainable, weights, named_tensors(self.state.trainable))
        if self.tp is not None:  # the checkpoint holds the full model's moments: take this rank's shard of them
            template = init_optimizer(full, self.cfg.optim)
            opt = shard_adamw(load_optimizer_state(template, optimizer), self.model_cfg, self.tp)
            load_into_shards_(self.state.opt, named_tensors(opt), named_tensors(self.state.opt))
        elif self.sharded:
            full_opt = load_optimizer_state(full_tree(self.state.opt), optimizer)
            load_into_shards_(self.state.opt, named_tensors(full_opt), named_tensors(self.state.opt))
        else:
            opt = load_optimizer_state(self.state.opt, optimizer)
            self.state = TrainState(trainable=self.state.trainable, opt=to_device(opt, self.device))

    # ---- eval ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_loss(self) -> float | None:
        batches = self.data.eval_batches(self.cfg.eval_batches, self.cfg.batch_size)
        if not batches:
            return None
        batches = [to_device(batch, self.device) for batch in batches]
        # sharded: one unit (embedding, block, head) gathered at a time, as in the train step
        total, count = eval_sums(
            self.state.trainable, self.frozen, batches, cfg=self.model_cfg, opts=self.opts,
            to_params=self.to_params, run_unit=BlockGather() if self.sharded else None, tp=self.tp_train,
        )  # fmt: skip
        if self.layout.dp_size > 1:
            both = torch.stack([total, count])
            torch.distributed.all_reduce(both, group=self.layout.dp_group)
            total, count = both[0], both[1]
        return (total / count.clamp(min=1)).item()


def _micro_batches(run: _Run, batches: Iterator[list[LMBatch] | list[DPOBatch]]) -> list[LMBatch] | list[DPOBatch]:
    micro = [to_device(mb, run.device) for mb in next(batches)]
    if run.reference is not None:
        micro = [replace(mb, ref=run.reference(mb)) for mb in micro]
    return micro


def _all_finite(tree: Any) -> bool:
    return bool(torch.stack([torch.isfinite(x).all() for x in leaves(tree)]).all())


def _nonfinite_message(run: _Run, what: str) -> str:
    last = latest_checkpoint(run.run_dir)
    where = f"the last good checkpoint is {last}" if last is not None else "no checkpoint was saved before it"
    return (
        f"step {run.step}: {what}; stopped without saving this step ({where}). Resume with --resume, e.g. with a "
        "lower --optim.lr or --max-grad-norm, or pass --no-stop-on-nonfinite to train on regardless"
    )


def _resume_point(cfg: TrainConfig) -> Resumable | None:
    """The checkpoint to resume from, None for a fresh run; refuses to start over checkpoints without resume."""
    if cfg.resume_from is not None:  # exactly this one: no fallback
        found = open_checkpoint(cfg.resume_from)
    elif cfg.resume:
        found = newest_valid_checkpoint(cfg.out_dir, warn=_warn)
    else:
        previous = latest_checkpoint(cfg.out_dir)
        if previous is not None:
            raise ValueError(
                f"{cfg.out_dir} already has checkpoints (newest: {previous.name}); pass --resume to continue it "
                "or choose another --out-dir"
            )
        return None
    if found is not None and not found.verified:
        _warn(f"warning: {found.path} has no {MANIFEST} (saved before checksums): resuming without verifying it")
    return found


def _warn(message: str) -> None:
    if distributed.env_rank() == 0:
        _log.warning(message)


def train(cfg: TrainConfig, model_cfg: ModelConfig | None = None) -> TrainResult:
    """Run (or resume) training as configured; returns where the results are. Rank 0 writes all files.

    Args:
        cfg: the run.
        model_cfg: the base model's shape for a random init (`cfg.model` is then only its name, kept in the
            run's config.json; vocabulary and eos follow `cfg.tokenizer` when one is given). None: `cfg.model`
            is a model folder to fine-tune. The CLI resolves names from `configs/models.py` to a ModelConfig.

    Raises:
        CheckpointError: resuming, no checkpoint is valid (or `cfg.resume_from` is not).
        NonFiniteError: a step diverged (`cfg.stop_on_nonfinite`); nothing of that step was saved.
    """
    found = _resume_point(cfg)
    final_dir = Path(cfg.out_dir) / "model"
    if found is not None and found.step >= cfg.steps and final_dir.is_dir():
        return TrainResult(Path(cfg.out_dir), final_dir.resolve(), found.step, False, None, None, already_finished=True)
    run = _Run(attrs.evolve(cfg, resume_from=None), model_cfg)  # the run's saved config never pins a checkpoint
    try:
        return _train(run, found)
    finally:
        distributed.teardown()


def _set_aside_newer(run: _Run, found: Resumable) -> None:
    """Rename the run's checkpoints newer than the resumed one (corrupt, or abandoned by `resume_from`)."""
    distributed.barrier()  # every rank has read the checkpoint before rank 0 renames folders
    if not run.dist.is_main:
        return
    for path in checkpoint_dirs(run.run_dir):
        if checkpoint_step(path) > found.step:
            moved = set_aside(path, "corrupt" if path in found.skipped else "abandoned")
            _warn(f"warning: {path} is newer than the resumed step {found.step}: set aside as {moved.name}")


def _step(run: _Run, batches: Iterator[list[LMBatch] | list[DPOBatch]]) -> dict[str, Any]:
    """One optimiser step; its metrics as host numbers (the step's only sync, shared by logging and checks)."""
    t0 = time.perf_counter()
    micro = _micro_batches(run, batches)
    optim = run.cfg.optim
    lr = lr_at(run.schedule, optim.lr, run.step)
    muon_lr = lr_at(run.schedule, optim.muon.lr, run.step) if uses_muon(optim) and optim.muon.lr is not None else None
    t1 = time.perf_counter()
    metrics = run.step_fn(run.state, micro, lr, run.frozen, muon_lr=muon_lr)
    run.step += 1
    values: dict[str, Any] = {k: v.item() for k, v in metrics.items()}
    if run.rollouts is not None:
        run.rollouts.after_step()  # the weights changed in place: no prefix K/V of the old ones may be reused
        values.update(run.rollouts.metrics, train_s=time.perf_counter() - t1)
    run.tokens_seen += int(values.pop("tokens"))
    values["lr"] = lr
    values["tok_s"] = batch_rows(micro) * run.layout.dp_size / (time.perf_counter() - t0)
    return values


def _train(run: _Run, found: Resumable | None) -> TrainResult:
    cfg, main = run.cfg, run.dist.is_main
    run.prepare_reference(resuming=found is not None)  # from the start weights: before resume replaces them
    if found is not None:
        run.resume(found)
        _set_aside_newer(run, found)
    if main:
        run.run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run.run_dir / "config.json", config_to_dict(cfg))
    log_cm = MetricsLog(run.run_dir / "metrics.jsonl", resume_step=run.step) if main else nullcontext()
    batches = run.data.train_batches(cfg.batch_size, cfg.grad_accum)
    if run.rollouts is not None:
        batches = run.rollouts.batches(batches, run.step)
    last_loss = last_eval = None
    stopped = False
    with log_cm as log, StopRequest() as stop, TrainProgress(cfg.steps, start=run.step, enabled=main) as progress:
        while run.step < cfg.steps:
            values = _step(run, batches)
            last_loss = values["loss"]
            if log is not None:
                log.log("train", run.step, values)
            progress.update(run.step, values)
            if cfg.stop_on_nonfinite and not (math.isfinite(last_loss) and math.isfinite(values["grad_norm"])):
                raise NonFiniteError(_nonfinite_message(run, f"loss {last_loss}, grad norm {values['grad_norm']}"))
            if cfg.eval_every and run.step % cfg.eval_every == 0 or run.step == cfg.steps:
                last_eval = run.eval_loss()
                if last_eval is not None:
                    progress.note(f"step {run.step}: eval loss {last_eval:.4f}")
                    if log is not None:
                        log.log("eval", run.step, {"loss": last_eval})
            stop_now = stop.requested and run.step < cfg.steps  # at the last step the run just finishes
            if stop_now or run.step == cfg.steps or (cfg.save_every and run.step % cfg.save_every == 0):
                run.save_checkpoint()
            if stop_now:
                stopped = True
                progress.note(f"{stop.signal_name}: saved checkpoint at step {run.step}; resume with --resume")
                break
    model_dir = None
    final = run.model() if not stopped and (main or run.collective_save) else None  # collective when sharded/TP
    if main:
        if log is not None:
            loss_curve_png(run.run_dir / "metrics.jsonl", run.run_dir / "loss.png")
        if final is not None:
            model_dir = save(final, run.run_dir / "model")
    distributed.barrier()
    return TrainResult(run.run_dir, model_dir, run.step, stopped, last_loss, last_eval)
