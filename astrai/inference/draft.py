"""Speculative decoding's `draft` method: a smaller model that shares the tokenizer guesses k tokens per round.

The draft runs on its own `ModelRunner` (its own compiled steps and KV tensors) but over the *target's* pages:
its KV pool has one page for each of the target's, indexed by the same page ids, so a sequence's page table,
its rollback after a rejection, preemption and the radix prefix cache hold for both models at once. The draft's
K/V at a position is valid exactly when the target's is, because every token the target computes the draft
computes too:

- `fill` (before the target's forward): for each speculating entry (its last token t at position p, k guesses
  to find) the draft runs k + 1 batched greedy decode steps: t -> d1, d1 -> d2, ..., d(k-1) -> dk, and dk (its
  draw unused), so its K/V covers p .. p + k, the very positions the verify step writes for the target. The steps
  feed each other on the device; the guesses come back to the host once. Compiled, the k_max + 1 steps are one
  graph (`chained_steps`): a draft step of a small model is mostly the cost of a call (guards, launch, host
  metadata), which the graph pays once per round, not k + 1 times. An entry with fewer guesses to find sits out
  the steps past its k + 1st as a padding row (null page, attends to nothing), so one graph per batch size serves
  every k, and `warm_up` compiles them all before serving.
- `shadow` (after the target's forward): one draft forward over the step's other entries (prefill chunks, plain
  decodes), the same tokens at the same positions, for their K/V only.

Guesses are the draft's argmax: a deterministic proposal, so the engine's coupled verification
(`speculative.coupled_accept`) keeps the output *the very tokens* of a run without speculation, greedy and seeded
sampling alike (accepting a guess d with probability p(d), as Leviathan et al.'s rule does with q one-hot).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import Tensor

from astrai.inference.cache import kv_bytes_per_token, make_attn_meta
from astrai.inference.grammar import valid_prefix
from astrai.inference.plan import SampledToken, ScheduledSeq
from astrai.inference.runner import ModelRunner, StepInputs, mark_dynamic, table_width
from astrai.inference.sampling_batch import upload
from astrai.inference.speculative import PENDING, SpeculativeConfig
from astrai.inference.step import decode_step
from astrai.inference.thread_count import compile_served
from astrai.io.model import Model, load
from astrai.models.config import ModelConfig
from astrai.models.decoder import DecoderParams
from astrai.ops.attention import AttnMeta, KVCache
from astrai.ops.pointwise import inference_kernels
from astrai.tree import tree_map


def load_draft(path: str | Path, target: Model) -> Model:
    """The draft model at `path` in the target's dtype and on its device, checked against the target.

    Raises:
        ValueError: the folder cannot be loaded, its tokenizer (or, without tokenizers, its vocabulary size)
            differs from the target's, or it is not smaller than the target (each message names the problem).
    """
    try:
        draft = load(path, dtype=target.dtype, device=target.device)
    except Exception as err:  # CheckpointError and friends: one line naming the folder
        raise ValueError(f"speculative config: cannot load the draft model {str(path)!r}: {err}") from None
    check_draft(draft, target)
    return draft


def check_draft(draft: Model, target: Model) -> None:
    """Refuse a draft that does not share the target's vocabulary or is not smaller than it.

    Raises:
        ValueError: naming the mismatch.
    """
    if draft.tokenizer is not None and target.tokenizer is not None:
        if draft.tokenizer.backend.get_vocab(with_added_tokens=True) != target.tokenizer.backend.get_vocab(
            with_added_tokens=True
        ):
            raise ValueError("speculative config: the draft model's tokenizer differs from the target's; a draft "
                             "must share the target's vocabulary (the same tokenizer.json)")  # fmt: skip
    elif draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"speculative config: the draft model's vocabulary ({draft.config.vocab_size}) differs "
                         f"from the target's ({target.config.vocab_size})")  # fmt: skip
    if draft.num_parameters >= target.num_parameters:
        raise ValueError(f"speculative config: the draft model ({draft.num_parameters:,} parameters) is not "
                         f"smaller than the target ({target.num_parameters:,})")  # fmt: skip


def draft_kv_bytes(draft: Model | None) -> int:
    """Bytes of the draft's K/V per token (0 without a draft): the engine sizes its pool for both models."""
    return kv_bytes_per_token(draft.config, draft.dtype) if draft is not None else 0


def chained_steps(params: DecoderParams, tokens: Tensor, metas: Sequence[AttnMeta], cache: KVCache,
                  vocab_size: int, *, cfg: ModelConfig) -> Tensor:  # fmt: skip
    """`len(metas)` greedy decode steps, each fed the previous one's argmax: tokens [B] -> draws [steps, B]."""
    draws = []
    for meta in metas:
        tokens = decode_step(params, tokens, meta, cache, cfg=cfg)[:, :vocab_size].argmax(dim=-1)
        draws.append(tokens)
    return torch.stack(draws)


@attrs.define
class DraftStats:
    """Draft-model work since start: proposal rounds, draft decode steps, shadow forwards."""

    rounds: int = 0
    decode_steps: int = 0
    shadow_steps: int = 0


class DraftProposer:
    """Runs the draft model beside the target: `fill` makes the guesses, `shadow` keeps its K/V in step."""

    def __init__(self, runner: ModelRunner, vocab_size: int, k_max: int, max_batch: int) -> None:
        self.runner, self.vocab_size, self.k_max, self.max_batch = runner, vocab_size, k_max, max_batch
        self.stats = DraftStats()
        self.chained = None  # the k_max + 1 steps as one compiled graph, where the draft's steps are compiled
        if runner.compiled_decode is not None:
            self.chained = compile_served(chained_steps, cfg=runner.cfg, device=runner.device, eager=self._eager)

    @classmethod
    def start(cls, draft: Model | None, runner_kw: dict, vocab_size: int, config: SpeculativeConfig | None,
              max_batch: int) -> DraftProposer | None:  # fmt: skip
        """A proposer of up to `config.num_speculative_tokens` guesses for up to `max_batch` entries, running
        `draft` with the target runner's settings (`runner_kw`: pages, compile, ...) but no CUDA graphs (its
        steps run eagerly or compiled); None without a draft."""
        if draft is None or config is None:
            return None
        runner = ModelRunner(draft, **{**runner_kw, "cuda_graphs": False})
        return cls(runner, vocab_size, config.num_speculative_tokens, max_batch)

    def _eager(self, *args: Any, **kwargs: Any) -> Tensor:
        """The chained steps uncompiled (a call the compiled graph cannot take: `thread_count.AnyThreadCount`)."""
        with inference_kernels():
            return chained_steps(*args, cfg=self.runner.cfg, **kwargs)

    @torch.inference_mode()
    def warm_up(self) -> dict[str, list]:
        """Compile the draft's steps now (before serving), as `ModelRunner.warm_up` does for the target, and the
        chained graph at the same batch sizes (padding rows only)."""
        done = self.runner.warm_up()
        if self.chained is not None:
            sizes = sorted({min(rows, self.max_batch) for rows in self.runner.decode_warm_sizes()})
            for rows in sizes:
                self._run_chained(torch.zeros(rows, dtype=torch.int64), [
                    make_attn_meta([], [], [], page_size=self.runner.page_size, device="cpu", decode=True, rows=rows,
                                   width=2) for _ in range(self.k_max + 1)])  # fmt: skip
            done["chained"] = sizes
        return done

    def execute(self, plan: list[ScheduledSeq], target: ModelRunner, vocab_size: int
                ) -> tuple[list[ScheduledSeq], dict[int, SampledToken]]:  # fmt: skip
        """One speculative step: the guesses (`fill`), the target's verify forward and draws, the draft's K/V for
        the other entries (`shadow`). Returns the filled plan and the target's draws."""
        plan = self.fill(plan)
        sampled = target.execute(plan, vocab_size=vocab_size)
        self.shadow(plan)
        return plan, sampled

    @torch.inference_mode()
    def fill(self, plan: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """`plan` with every `PENDING` guess replaced by the draft's greedy guess."""
        entries = [i for i, item in enumerate(plan) if item.draft and item.draft[0] == PENDING]
        if not entries:
            return plan
        items = [plan[i] for i in entries]
        guesses = self._propose(items)
        plan = list(plan)
        for i, item, draft in zip(entries, items, guesses, strict=True):
            if item.seq.matcher is not None:  # a constrained sequence keeps the guesses its grammar allows
                kept = valid_prefix(item.seq.matcher, draft)
                item.seq.num_computed -= len(draft) - kept  # planned for all k
                item, draft = attrs.evolve(item, num_new=1 + kept), draft[:kept]
            plan[i] = attrs.evolve(item, draft=tuple(draft))
        self.stats.rounds += 1
        return plan

    def _propose(self, items: Sequence[ScheduledSeq]) -> list[list[int]]:
        """Each entry's k guesses: from the chained graph where it is compiled, else step by step."""
        if self.chained is not None:  # k <= k_max: the scheduler plans at most num_speculative_tokens
            return self._propose_chained(items)
        return self._propose_stepwise(items)

    def _propose_chained(self, items: Sequence[ScheduledSeq]) -> list[list[int]]:
        """k_max + 1 steps in one graph over every entry; rows in descending k, so the entries still guessing at a
        step are the first rows and the rest are padding rows (`make_attn_meta(rows=...)`)."""
        order = sorted(range(len(items)), key=lambda r: -len(items[r].draft))
        ks = [len(items[r].draft) for r in order]
        width = table_width(max(len(item.seq.pages) for item in items))
        metas = []
        for step in range(self.k_max + 1):
            live = [items[r] for r, k in zip(order, ks, strict=True) if step <= k]
            metas.append(make_attn_meta([item.seq.pages for item in live], [item.start + step for item in live],
                                        [1] * len(live), page_size=self.runner.page_size, device="cpu",
                                        decode=True, rows=len(items), width=width))  # fmt: skip
        first = [items[r].seq.tokens(items[r].start, items[r].start + 1)[0] for r in order]
        draws = self._run_chained(torch.tensor(first, dtype=torch.int64), metas).tolist()
        self.stats.decode_steps += self.k_max + 1
        guesses: list[list[int]] = [[] for _ in items]
        for row, (r, k) in enumerate(zip(order, ks, strict=True)):
            guesses[r] = [draws[step][row] for step in range(k)]
        return guesses

    def _run_chained(self, tokens: Tensor, metas: list[AttnMeta]) -> Tensor:
        tokens = upload(tokens, self.runner.device)
        metas = [tree_map(lambda t: upload(t, self.runner.device), meta) for meta in metas]
        for meta in metas:
            mark_dynamic(tokens, meta)
        return self.chained(self.runner.model.params, tokens, metas, self.runner.cache, self.vocab_size)

    def _propose_stepwise(self, items: Sequence[ScheduledSeq]) -> list[list[int]]:
        """k + 1 batched greedy decode steps (k per entry; an entry leaves the batch after its k + 1st step)."""
        ks = [len(item.draft) for item in items]
        tokens = torch.tensor([item.seq.tokens(item.start, item.start + 1)[0] for item in items], dtype=torch.int64)
        active = list(range(len(items)))
        draws: list[torch.Tensor] = []  # per step: [len(active at that step)] device tensor
        steps_active: list[list[int]] = []
        for step in range(max(ks) + 1):
            active_now = [r for r in active if step <= ks[r]]
            if not active_now:
                break
            if len(active_now) < len(active):  # rows that are done drop out: keep the others' previous draws
                keep = torch.tensor([active.index(r) for r in active_now], device=tokens.device)
                tokens = tokens.index_select(0, keep)
            active = active_now
            pages = [items[r].seq.pages for r in active]
            meta = make_attn_meta(pages, [items[r].start + step for r in active], [1] * len(active),
                                  page_size=self.runner.page_size, device="cpu", decode=True,
                                  width=table_width(max(len(p) for p in pages)))  # fmt: skip
            logits = self.runner.run(StepInputs("decode", tokens, meta, len(active)))
            tokens = logits[:, : self.vocab_size].argmax(dim=-1)
            draws.append(tokens)
            steps_active.append(active)
            self.stats.decode_steps += 1
        guesses: list[list[int]] = [[] for _ in items]
        for step, (drawn, rows) in enumerate(zip(draws, steps_active, strict=True)):
            for value, r in zip(drawn.tolist(), rows, strict=True):
                if step < ks[r]:
                    guesses[r].append(value)
        return guesses

    @torch.inference_mode()
    def shadow(self, plan: Sequence[ScheduledSeq]) -> None:
        """Compute the draft's K/V for the step's entries that did not speculate (same tokens, same positions)."""
        items = [attrs.evolve(item, sample=True) for item in plan if not item.draft]
        if not items:
            return
        step = self.runner.plan_step(items, list(range(len(items))))
        self.runner.run(step)
        self.stats.shadow_steps += 1
