"""Online GRPO rollouts in the training process: prompts -> astrai's `Engine` -> rewards -> `GRPOBatch`es.

`Rollouts` owns one `Engine` that serves the trainer's own parameter tensors (the trainable tree, or the LoRA base
with the live adapters through `apply_lora`): nothing is copied or reloaded. The optimizer updates those tensors in
place, and `after_step` then drops the engine's prefix cache (`Engine.update_params`), so no K/V computed with old
weights is ever reused. Each rank rolls out its own share of prompts (the sampler's), with its own engine.

Compiled rollouts: the engine compiles its decode step and sampler when the run compiles (`TrainConfig.compile`,
on by default and in the recipes; the RL quickstart's short runs keep it off). Its compiled steps do not guard on
the parameters, so the optimizer's in-place updates (and the LoRA adapters inside the tree `apply_lora` built
once) never recompile them; tests/astrai/train/test_rollout_compiled.py counts the compiles over several steps.

Per rollout (one optimizer step's prompts on this rank, all micro-batches together so continuous batching fills
the engine): each prompt is one request with n = G (the G sequences share the prompt's K/V), sampled at the
recipe's temperature / top-p / top-k with raw per-token log-probs returned; the seed of a prompt's request depends
only on (run seed, step, dataset index), so the completions do not depend on the ranks or the micro-batch split.
Then the rewards (`astrai.train.rewards.score`; failures are counted skips), group advantages
(`astrai.train.preference.group_advantages`), the reference log-probs when beta > 0 (a no-grad forward of the
frozen start weights, or of the LoRA base) and, above one iteration, the old-policy log-probs: the engine's, which
equal a teacher-forced forward in fp32 at temperature 1 (tested), else a no-grad forward of the current weights
(another temperature, or bf16 training). With `num_iterations` mu the same micro-batches feed mu optimizer steps.

Metrics (global over ranks): `reward`, `reward_std` (mean within-group std), `frac_reward_zero_std`,
`rewards/NAME/mean`, `rewards/skipped`, `completions/mean_length`, `completions/clipped_ratio`, and this rank's
`rollout_s`, `reward_s`, `reference_s` (0 on the steps that reuse a rollout).

Not here: asynchronous (off-policy) generation overlapping the train step, a separate generation server, dynamic
sampling (DAPO's refill of zero-std groups).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch import Tensor

from astrai.inference.engine import Engine, EngineConfig
from astrai.inference.outputs import Completion
from astrai.inference.params import MAX_N, SamplingParams
from astrai.io.model import Model
from astrai.io.tokenizer import Tokenizer
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams
from astrai.ops.attention import pages_needed
from astrai.train.config import GRPOConfig
from astrai.train.data import PromptBatch
from astrai.train.grpo import GRPOBatch, completion_logprobs
from astrai.train.preference import group_advantages
from astrai.train.rewards import resolve_reward, score
from astrai.train.step import StepOptions
from astrai.tree import tree_map

PAGE_SIZE = 16


def request_seed(seed: int, step: int, index: int) -> int:
    """The sampling seed of dataset item `index`'s request at `step` (independent of ranks and batch splits)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


class Rollouts:
    """The engine, rewards and reference of a GRPO run on one rank (host object)."""

    def __init__(
        self,
        grpo: GRPOConfig,
        *,
        model_cfg: ModelConfig,
        policy: DecoderParams,
        tokenizer: Tokenizer,
        eos: Sequence[int],
        reference: DecoderParams | None,
        opts: StepOptions,
        seq_len: int,
        prompts_per_step: int,
        seed: int,
        device: torch.device,
    ) -> None:
        """
        Args:
            policy: the tree the forward runs on, made of the trainer's tensors (served in place by the engine).
            reference: the frozen reference tree (needed when grpo.beta > 0).
            prompts_per_step: prompts this rank rolls out per optimizer step (batch_size * grad_accum).
        """
        if grpo.beta > 0 and reference is None:
            raise ValueError("grpo.beta > 0 needs a reference tree")
        self.grpo, self.cfg, self.opts, self.seq_len = grpo, model_cfg, opts, seq_len
        self.tokenizer, self.reference, self.seed, self.device = tokenizer, reference, seed, device
        self.fns = {name: resolve_reward(name) for name in grpo.rewards}
        self.weights = tuple(grpo.reward_weights) or (1.0,) * len(self.fns)
        rows = prompts_per_step * grpo.num_generations
        config = EngineConfig(
            page_size=PAGE_SIZE, kv_budget_tokens=rows * pages_needed(seq_len, PAGE_SIZE) * PAGE_SIZE,
            max_running=min(rows, 256), max_waiting=max(1024, rows), max_model_len=seq_len, compile=opts.compile,
            seed=seed, background=False,
        )  # fmt: skip
        model = Model(config=model_cfg, params=policy, tokenizer=tokenizer, eos_token_ids=tuple(eos))
        self.engine = Engine(model, config)
        self.metrics: dict[str, float] = {}

    # ---- the loop's hooks ----------------------------------------------------------------------------------------
    def batches(self, prompts: Iterator[list[PromptBatch]], start_step: int) -> Iterator[list[GRPOBatch]]:
        """Endless: a rollout of the next prompts, then its micro-batches once per optimizer step (num_iterations)."""
        step = start_step
        while True:
            micro = self.rollout(next(prompts), step)
            for i in range(self.grpo.num_iterations):
                if i:
                    self.metrics.update(rollout_s=0.0, reward_s=0.0, reference_s=0.0)
                yield micro
                step += 1

    def after_step(self) -> None:
        """The optimizer changed the served tensors in place: drop every prefix cached with the old weights."""
        self.engine.update_params()

    # ---- one rollout -----------------------------------------------------------------------------------------------
    def generate(self, items: Sequence[dict], indices: Sequence[int], step: int) -> list[Completion]:
        """G completions of each prompt, with token ids and raw log-probs (one request per prompt, n = G)."""
        g = self.grpo
        n = g.num_generations if g.num_generations <= MAX_N else 1
        params = SamplingParams(max_tokens=g.max_completion_tokens, temperature=g.temperature, top_p=g.top_p,
                                top_k=g.top_k, n=n, logprobs=True)  # fmt: skip
        prompts, plist = [], []
        for item, index in zip(items, indices, strict=True):
            seed = request_seed(self.seed, step, index)
            for k in range(0, g.num_generations, n):  # n < G only when G > MAX_N: one request per completion
                prompts.append(item["prompt"].tolist())
                plist.append(attrs.evolve(params, seed=seed + k))
        done = self.engine.generate(prompts, plist)
        if n == g.num_generations:
            return done
        per = g.num_generations
        return [_merge(done[i * per : (i + 1) * per]) for i in range(len(items))]

    def rollout(self, prompt_batches: list[PromptBatch], step: int) -> list[GRPOBatch]:
        """Generate, score and pack this rank's prompts for `step` into micro-batches (sets `self.metrics`)."""
        g = self.grpo.num_generations
        t0 = time.perf_counter()
        items = [item for pb in prompt_batches for item in pb.items]
        indices = [i for pb in prompt_batches for i in pb.indices]
        done = self.generate(items, indices, step)
        t1 = time.perf_counter()
        outputs = [out for completion in done for out in completion.outputs]  # prompt-major, G each
        records = [{} if item["answer"] is None else {"answer": item["answer"]} for item in items for _ in range(g)]
        prompt_text = [self.tokenizer.decode(item["prompt"].tolist()) for item in items for _ in range(g)]
        scores = score(self.fns, self.weights, prompt_text, [o.text for o in outputs], records)
        rewards = torch.tensor(scores.total, dtype=torch.float32)
        advantages = group_advantages(rewards, g, scale_rewards=self.grpo.scale_rewards)
        t2 = time.perf_counter()
        micro, start = [], 0
        for pb in prompt_batches:
            rows = len(pb.items) * g
            prompts = [item["prompt"] for item in pb.items for _ in range(g)]
            micro.append(self._pack(prompts, outputs[start : start + rows], advantages[start : start + rows]))
            start += rows
        t3 = time.perf_counter()
        self.metrics = self._metrics(rewards, scores, outputs)
        self.metrics.update(rollout_s=t1 - t0, reward_s=t2 - t1, reference_s=t3 - t2)
        return micro

    def _pack(self, prompts: list[Tensor], outputs: list, advantages: Tensor) -> GRPOBatch:
        """Right-padded rows, masks and log-probs of some completions (+ reference / old log-probs as needed)."""
        n, t = len(prompts), self.seq_len
        tokens = torch.zeros(n, t, dtype=torch.int64)
        mask = torch.zeros(n, t)
        old = torch.zeros(n, t)
        for i, (prompt, out) in enumerate(zip(prompts, outputs, strict=True)):
            p, c = len(prompt), len(out.token_ids)
            tokens[i, :p] = prompt
            tokens[i, p : p + c] = torch.tensor(out.token_ids, dtype=torch.int64)
            mask[i, p - 1 : p + c - 1] = 1.0  # target t is token t + 1: the completion's tokens
            old[i, p - 1 : p + c - 1] = torch.tensor(out.logprobs, dtype=torch.float32)
        tokens, mask, old = tokens.to(self.device), mask.to(self.device), old.to(self.device)
        ref = torch.zeros_like(old)
        with torch.no_grad():
            if self.grpo.beta > 0:
                ref = self._logprobs(self.reference, tokens) * mask
            engine_exact = self.grpo.temperature == 1.0 and self.opts.autocast_dtype is None
            if self.grpo.num_iterations > 1 and not engine_exact:
                old = self._logprobs(self.engine.model.params, tokens) * mask
        return GRPOBatch(tokens=tokens, mask=mask, advantages=advantages.to(self.device), old_logps=old,
                         ref_logps=ref)  # fmt: skip

    def _logprobs(self, params: DecoderParams, tokens: Tensor) -> Tensor:
        return completion_logprobs(params, tokens, cfg=self.cfg, opts=self.opts, temperature=self.grpo.temperature)

    def _metrics(self, rewards: Tensor, scores: Any, outputs: list) -> dict[str, float]:
        """Global (all-rank) reward and length statistics of this rollout."""
        g = self.grpo.num_generations
        groups = rewards.view(-1, g)
        std = groups.std(dim=1)
        names = list(self.fns)
        sums = [
            rewards.sum(), std.sum(), (std < 1e-6).sum(), torch.tensor(groups.shape[0]), torch.tensor(len(outputs)),
            torch.tensor(sum(len(o.token_ids) for o in outputs)),
            torch.tensor(sum(o.finish_reason == "length" for o in outputs)),
            *[torch.tensor(sum(scores.per_function[name])) for name in names],
            torch.tensor(sum(scores.skipped.values())),
        ]  # fmt: skip
        both = torch.stack([s.double() for s in sums]).to(self.device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(both)
        v = both.tolist()
        count, prompts = max(v[4], 1.0), max(v[3], 1.0)
        out = {"reward": v[0] / count, "reward_std": v[1] / prompts, "frac_reward_zero_std": v[2] / prompts,
               "completions/mean_length": v[5] / count, "completions/clipped_ratio": v[6] / count}  # fmt: skip
        for k, name in enumerate(names):
            out[f"rewards/{name}/mean"] = v[7 + k] / count
        out["rewards/skipped"] = v[-1]
        return out


def make_rollouts(
    grpo: GRPOConfig,
    *,
    start: DecoderParams,
    shared: bool,
    model_cfg: ModelConfig,
    policy: DecoderParams,
    tokenizer: Tokenizer | None,
    eos: Sequence[int],
    opts: StepOptions,
    seq_len: int,
    prompts_per_step: int,
    seed: int,
    device: torch.device,
) -> Rollouts:
    """A run's `Rollouts`; call before any step (or resume) changes the weights.

    Args:
        start: the start weights: the reference when beta > 0.
        shared: `start` is never updated in place (the LoRA base): used as is; otherwise the reference is a copy.
        policy: the forward's tree made of the trainer's tensors (`to_params(frozen, trainable)`).
    """
    if tokenizer is None:
        raise ValueError("GRPO scores completions as text: give the run a tokenizer (--tokenizer)")
    reference = None
    if grpo.beta > 0:
        reference = start if shared else tree_map(lambda t: t.detach().clone(), start)
    return Rollouts(
        grpo, model_cfg=model_cfg, policy=policy, tokenizer=tokenizer, eos=eos, reference=reference, opts=opts,
        seq_len=seq_len, prompts_per_step=prompts_per_step, seed=seed, device=device,
    )  # fmt: skip


def _merge(parts: Sequence[Completion]) -> Completion:
    """One Completion holding the single outputs of several n = 1 requests of the same prompt."""
    outputs = tuple(attrs.evolve(p.outputs[0], index=i) for i, p in enumerate(parts))
    return attrs.evolve(parts[0], outputs=outputs)
