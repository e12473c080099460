"""The device side of the engine: turns a scheduled step into one forward + one sampling call.

A step whose sequences all feed exactly one token and all sample is a *decode* step: it runs `decode_step`
(compiled with a symbolic batch size; on CUDA replayed from per-bucket CUDA graphs, `astrai.inference.graphs`,
whose padding rows write to the null page and attend to nothing). Any other step (prefill chunks, prefix-hit
extends, mixed with decodes) runs `prefill_step` over the flattened tokens with `logits_positions` = the rows
that sample; with `compile_prefill` (by default on CUDA only) compiled with symbolic token, request and
sampled-row counts, at start (`warm_prefill`). So that one graph serves every prefill step, the host then pads
those counts past the sizes `torch.compile` would specialise on: at least 2
requests (0 and 1 are specialised; a padding request feeds one token that writes nowhere and attends to nothing)
and more than `ops.linear.MAX_REDUCE_ROWS` tokens and sampled rows (the few-row matvec branch; extra sampled
rows repeat row 0 and are dropped). Sampling is a separate (compiled) call on the sampled rows only.

Grammar-constrained rows: after the forward is launched and before the sampler runs, the host fills the bitmask
rows of the sampled sequences that hold a matcher (llguidance's thread pool, GIL released; unconstrained rows are
all ones, and a step without a constrained row builds no bitmask at all) and sends it with the sampling batch. The
mask depends only on tokens already accepted, so on CUDA, where the forward (or the replayed decode graph) runs
asynchronously, the fill overlaps with it; on CPU the forward is synchronous and the fill follows it. The sampler
is outside the CUDA graphs, so graphs are unaffected.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from astrai.inference import fast_paths
from astrai.inference.cache import init_kv_cache, logits_rows, make_attn_meta
from astrai.inference.grammar import allocate_bitmask, fill_bitmask_after, fill_bitmask_batch
from astrai.inference.graphs import DecodeGraphs
from astrai.inference.layout import layout_difference
from astrai.inference.lora_step import lora_rows, padding_rows
from astrai.inference.plan import SampledToken, ScheduledSeq
from astrai.inference.sampler import SampleOutput
from astrai.inference.sampler_variants import SamplerVariants
from astrai.inference.sampling_batch import make_sampling_batch, upload
from astrai.inference.seq import Seq, needs_outputs
from astrai.inference.steer import guarded_steering
from astrai.inference.step import LoRARows, decode_step, prefill_step
from astrai.inference.thread_count import compile_served
from astrai.io.model import Model
from astrai.models.decoder import projection_groups, projection_weights
from astrai.nn.lora_slots import slot_linears
from astrai.ops.attention import AttnMeta, pages_needed
from astrai.ops.collectives import TensorParallel
from astrai.ops.linear import MAX_REDUCE_ROWS, kernel_rows, reduce_rows
from astrai.ops.moe import fused_experts_enabled
from astrai.ops.packed_linear import is_group_packed, pack_group, packable, repack
from astrai.ops.pointwise import inference_kernels
from astrai.tree import tree_map

logger = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
PREFILL_MIN_ROWS = MAX_REDUCE_ROWS + 1  # a compiled prefill step pads its tokens and sampled rows to at least this


def mark_dynamic(tokens: Tensor, meta: AttnMeta, lora: LoRARows | None = None) -> None:
    # batch size and block-table width change from step to step: compile them as symbolic sizes from the start,
    # instead of recompiling once per new size
    rows = [t for t in lora or () if t is not None]
    for t in (tokens, meta.positions, meta.slot_mapping, meta.seq_lens, meta.cu_seqlens_q, meta.block_table, *rows):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    torch._dynamo.maybe_mark_dynamic(meta.block_table, 1)


def prefill_padding(num_requests: int, num_tokens: int, min_rows: int = PREFILL_MIN_ROWS) -> int:
    """Padding requests a compiled prefill step adds (one token each): to at least 2 requests and `min_rows` tokens
    (`ModelRunner.prefill_min_rows`), so every step matches one graph (see the module docstring)."""
    return max(0, 2 - num_requests, min_rows - num_tokens)


def bucket(n: int, limit: int) -> int:
    """Smallest decode bucket >= n (batch sizes are padded up to it, so each bucket's CUDA graph is reused)."""
    return next((b for b in DECODE_BUCKETS if b >= n), max(n, limit))


class StepInputs(NamedTuple):
    """The host inputs of one forward, as `ModelRunner.plan_step` builds them (and tensor parallel broadcasts).

    `kind`: "graph" (decode replayed from the bucket's CUDA graph; tokens/meta padded to the bucket, `rows` the
    real batch size), "decode" (`rows` the batch size) or "prefill" (`rows` [M] the token rows to sample).
    `lora`: multi-LoRA serving, each row's adapter slot (`lora_step`); None when no row has an adapter.
    """

    kind: str
    tokens: Tensor
    meta: AttnMeta
    rows: Tensor | int
    lora: LoRARows | None = None


class Launched(NamedTuple):
    """A step whose forward and sampling are queued on the device (`ModelRunner.launch`); `collect` reads it.

    `rows[seq]` is the row of `tokens` (the sampled ids, on the device) that holds `seq`'s token: a next step
    planned before this one is collected feeds that row (a placeholder `-1 - row`, resolved on the device).
    `spans[j]`: the sampled rows of `sampling[j]`, in order (1, or k + 1 for an entry with k guesses).
    """

    sampling: list[int]
    rows: dict[Seq, int]
    tokens: Tensor | None
    host: SampleOutput | None
    ready: torch.cuda.Event | None
    spans: list[int] | None = None


def table_width(need: int) -> int:
    """Block-table width for a step whose longest page list is `need`: the smallest power of two that fits (the CPU
    path gathers the whole width, so it should stay small; with symbolic sizes a new width costs no recompile), at
    least 2 (a width of 1 would get its own specialised graph)."""
    return max(2, 1 << max(0, need - 1).bit_length())


def resolve_placeholders(tokens: Tensor, previous: Tensor) -> Tensor:
    """Token ids with each placeholder `-1 - j` replaced by `previous[j]`, on the device (no host sync)."""
    return torch.where(tokens < 0, previous[(-1 - tokens).clamp(min=0)], tokens)


def graphs_supported(model: Model) -> bool:
    """CUDA graphs need a decode step with no host sync. GQA and MLA decode kernels have none; MoE layers have
    none through the fused Triton experts (`astrai.ops.moe`), but the grouped loop that `ASTRAI_ATTN_BACKEND=torch`
    selects reads the expert counts on the host."""
    return model.config.ffn_type == "mlp" or fused_experts_enabled()


def _available_memory() -> int | None:
    """Bytes the kernel reports as available (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pack_cpu_weights(model: Model) -> bool:
    """oneDNN packs of the model's projection weights (`astrai.ops.packed_linear`), unless the copy would take
    more than half the available memory (then a warning, and the products stay on `F.linear`)."""
    groups = [g for g in projection_groups(model.params) if all(packable(w) for w in g)]
    need = sum(w.numel() * w.element_size() for g in groups if not is_group_packed(g) for w in g)
    free = _available_memory()
    if free is not None and need > free // 2:
        why = "EngineConfig.pack_weights=False silences this"
        logger.warning("not packing the CPU weights for oneDNN: %.1f GiB would take over half of the %.1f GiB "
                       "available (%s)", need / 2**30, free / 2**30, why)  # fmt: skip
        return False
    for group in groups:
        pack_group(group)
    return True


class ModelRunner:
    """Owns the KV pool tensors and the compiled steps; executes scheduled steps."""

    def __init__(
        self,
        model: Model,
        *,
        num_pages: int,
        page_size: int,
        compile: bool,
        max_running: int,
        max_model_len: int,
        cuda_graphs: bool = True,
        pack_weights: bool = False,
        compile_prefill: bool | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        # under tensor parallel `model` is this rank's shard with its local config (astrai.models.tp), and the
        # steps run eagerly: the collectives are not traced by torch.compile yet
        compile_steps = compile and (tp is None or tp.size == 1)
        self.model, self.cfg, self.tp = model, model.config, tp
        self.device, self.page_size, self.max_running = model.device, page_size, max_running
        self.max_width = pages_needed(max_model_len, page_size)
        self.cache = init_kv_cache(self.cfg, num_pages, page_size, dtype=model.dtype, device=self.device)
        self.cuda = self.device.type == "cuda"
        self.lora = bool(slot_linears(model.params))  # the served tree holds adapter slots (multi-LoRA)
        self.pack_weights = pack_weights and self.device.type == "cpu"
        if self.pack_weights:
            pack_cpu_weights(model)
        self.eager_prefill = functools.partial(prefill_step, cfg=self.cfg, tp=tp)
        self.eager_decode = functools.partial(decode_step, cfg=self.cfg, tp=tp)
        # symbolic batch and table sizes (mark_dynamic): one compile for every size, CUDA graphs per bucket; no
        # guards on the parameters (set_model checks a new tree) nor size asserts (`step.SERVED_STEP_OPTIONS`); on
        # CPU no global-state guard either: `thread_count.AnyThreadCount` runs it at any thread count up to this one
        self.compiled_decode = None
        if compile_steps:
            self.compiled_decode = compile_served(decode_step, cfg=self.cfg, device=self.device,
                                                  eager=self._eager_decode)  # fmt: skip
        auto_prefill = compile_prefill is None  # the default: on CUDA, unless it fails its start check
        if compile_prefill is None:  # on CPU the compiled prefill measured no faster and takes long to compile
            compile_prefill = fast_paths.on_gpu(self.device)
        self.compiled_prefill = None
        if compile_steps and compile_prefill:
            self.compiled_prefill = compile_served(prefill_step, cfg=self.cfg, device=self.device,
                                                   eager=self._eager_prefill)  # fmt: skip
        self._sampler = SamplerVariants(compiled=compile)  # a fixed set of compiled variants (sampler_variants)
        if self.compiled_prefill is not None:  # warmed up; the default is checked on CUDA, eager if it fails
            self.compiled_prefill = fast_paths.warm_prefill(self, check=auto_prefill)
        self.graphs = None
        if self.cuda and cuda_graphs and graphs_supported(model):
            self.graphs = self.make_decode_graphs(capture=True)
            self.graphs.capture_all([b for b in DECODE_BUCKETS if b < self.graphs.max_rows] + [self.graphs.max_rows])

    def set_model(self, model: Model) -> None:
        """Run `model` (same shapes, new weight tensors) from now on; CUDA graphs bound the old ones: recapture.

        Raises:
            ValueError: `model`'s tree differs from the served one in structure, shape, stride, dtype or device
                (the compiled steps do not guard on the parameters, `step.without_param_guards`).
        """
        if (why := layout_difference(self.model.params, model.params)) is not None:
            raise ValueError(f"the engine's compiled steps cannot serve this tree: {why}")
        self.model = model
        if self.pack_weights:
            pack_cpu_weights(model)
        if self.graphs is not None:
            self.graphs = self.make_decode_graphs(capture=True)
            self.graphs.capture_all([b for b in DECODE_BUCKETS if b < self.graphs.max_rows] + [self.graphs.max_rows])

    def refresh_weights(self) -> None:
        """The served tensors were changed in place: rebuild their CPU packs (CUDA graphs read them directly)."""
        if self.pack_weights:
            repack(projection_weights(self.model.params))

    def make_decode_graphs(self, *, capture: bool) -> DecodeGraphs:
        """Decode over preallocated per-bucket rows; `capture` replays CUDA graphs (tests use False on CPU)."""
        decode, params, cache = self.compiled_decode or self.eager_decode, self.model.params, self.cache

        def step(tokens: Tensor, meta: AttnMeta, lora: LoRARows | None = None) -> Tensor:
            if self.compiled_decode is not None:
                mark_dynamic(tokens, meta, lora)
            return decode(params, tokens, meta, cache, lora=lora)

        return DecodeGraphs(step, max_rows=bucket(self.max_running, self.max_running), width=self.max_width,
                            page_size=self.page_size, device=self.device, capture=capture,
                            lora=self.lora)  # fmt: skip

    @torch.inference_mode()
    def warm_prefill(self) -> None:
        """Compile the prefill step now (at engine start, like the decode graphs on CUDA), not on the first prompt:
        one step of padding requests only, which write nothing to the pool and attend to nothing."""
        rows = self.prefill_min_rows()
        tokens, meta = self._host_meta([], decode=False, rows=rows, width=2)
        for lora in (None, padding_rows(meta)) if self.lora else (None,):  # the base graph and the LoRA one
            self.run(StepInputs("prefill", tokens, meta, torch.zeros(rows, dtype=torch.long), lora))

    def prefill_min_rows(self) -> int:
        """The fewest tokens and sampled rows of a compiled prefill step: `PREFILL_MIN_ROWS`, past the few-row
        branches of `ops.linear`; on CPU past its AMX branch too (bf16 products of up to `AMX_MAX_ROWS` rows), so
        that a prefill step of any size matches the one graph compiled at start."""
        rows = kernel_rows(self.model.dtype)
        return rows + 1 if self.device.type == "cpu" and rows > MAX_REDUCE_ROWS else PREFILL_MIN_ROWS

    def decode_warm_sizes(self) -> list[int]:
        """Decode batch sizes that cover every graph the compiled CPU decode step can specialise: 1 (Dynamo's
        size-1 specialisation), 2, and one past each few-row bound of `ops.linear` (its row-reduce branch), plus
        `max_running`; the sizes between share a symbolic graph."""
        dtype = self.model.dtype
        sizes = {1, 2, reduce_rows(dtype) + 1, MAX_REDUCE_ROWS + 1, kernel_rows(dtype) + 1, self.max_running}
        return sorted(b for b in sizes if b <= self.max_running)

    @torch.inference_mode()
    def warm_up(self) -> dict[str, list]:
        """Compile now (before a server says `serving`) everything a request could otherwise compile on first use
        (DESIGN fact F9): the CPU decode step at `decode_warm_sizes` (padding rows only: they write to the null
        page and attend to nothing) and every sampler variant (`sampler_variants`); an eager prefill step runs one
        padding step too (first-call costs). A compiled prefill step is warmed in `__init__`, and CUDA decode
        graphs are captured there. Returns what was run, and `seconds`: [the steps', the sampler's]."""
        done: dict[str, list] = {"decode": [], "sampler": [], "seconds": []}
        start = time.perf_counter()
        if self.compiled_prefill is None:  # eager: nothing compiles, but the first call's one-time costs go here
            self.warm_prefill()
        if self.compiled_decode is not None and self.graphs is None:
            for rows in self.decode_warm_sizes():
                tokens, meta = self._host_meta([], decode=True, rows=rows, width=2)
                for lora in (None, padding_rows(meta)) if self.lora else (None,):
                    self.run(StepInputs("decode", tokens, meta, rows, lora))
                done["decode"].append(rows)
        middle = time.perf_counter()
        if self._sampler.compiled:
            done["sampler"] = self._sampler.warm(self.cfg.vocab_size, self.device)
        done["seconds"] = [round(middle - start, 2), round(time.perf_counter() - middle, 2)]  # [steps, sampler]
        return done

    # ---- metadata ---------------------------------------------------------------------------------------
    def _host_meta(
        self, plan: Sequence[ScheduledSeq], *, decode: bool, rows: int, width: int, previous: Launched | None = None
    ) -> tuple[Tensor, AttnMeta]:
        """Host tokens and metadata for `plan`, padded to `rows` requests and a `width`-page block table.

        A sequence whose last token is still in flight (sampled by `previous`, not yet collected) feeds the
        placeholder `-1 - row` of that token's row in `previous` (`resolve_placeholders`)."""
        tokens = []
        for item in plan:
            real = item.num_new - len(item.draft)  # a speculating entry feeds its last token, then the guesses
            ids = item.seq.tokens(item.start, item.start + real)
            if len(ids) < real:
                if previous is None or item.seq not in previous.rows:
                    raise RuntimeError(f"request {item.seq.id}: a step feeds a token no step in flight samples")
                ids.append(-1 - previous.rows[item.seq])
            tokens += ids
            tokens += item.draft
        if decode:  # a row per token: a speculating entry's k + 1 tokens are k + 1 rows over its pages
            spans = [(item.seq.pages, item.start + i) for item in plan for i in range(item.num_new)]
            pages, starts, new = [p for p, _ in spans], [s for _, s in spans], [1] * len(spans)
        else:
            pages, starts, new = [i.seq.pages for i in plan], [i.start for i in plan], [i.num_new for i in plan]
        tokens += [0] * (rows - len(new))  # padding rows (requests) feed token 0
        meta = make_attn_meta(pages, starts, new, page_size=self.page_size, device="cpu", decode=decode, rows=rows,
                              width=width)  # fmt: skip
        tokens = torch.tensor(tokens, dtype=torch.int64)
        if self.cuda:  # pinned, so the copies to the device (the graph buffers' included) never wait for the stream
            return tokens.pin_memory(), tree_map(Tensor.pin_memory, meta)
        return tokens, meta

    def _width(self, plan: Sequence[ScheduledSeq]) -> int:
        return table_width(max(len(item.seq.pages) for item in plan))

    # ---- one step -----------------------------------------------------------------------------------------
    def plan_step(self, plan: Sequence[ScheduledSeq], sampling: list[int], previous: Launched | None = None
                  ) -> StepInputs:  # fmt: skip
        """The host inputs of one forward: which path runs it, tokens, metadata and the rows to sample.

        A step of decoding sequences, some with guesses, runs the decode step too (*batch expansion*): a
        sequence's last token and its k guesses are k + 1 decode rows over its pages at consecutive positions.
        Every row's K/V is stored before any row attends (`paged_attention`), so row i sees the guesses before it:
        the causal extend, at the decode step's cost rather than the prefill path's (~12x a decode step for a
        one-million-parameter model on CPU)."""
        step = self._plan_step(plan, sampling, previous)
        return step._replace(lora=lora_rows(plan, step.meta)) if self.lora else step

    def _plan_step(self, plan: Sequence[ScheduledSeq], sampling: list[int], previous: Launched | None
                   ) -> StepInputs:  # fmt: skip
        decode = all(item.num_new == 1 + len(item.draft) for item in plan) and len(sampling) == len(plan)
        if decode:
            n, need = sum(item.num_new for item in plan), max(len(item.seq.pages) for item in plan)
            if self.graphs is not None and self.graphs.fits(bucket(n, self.max_running), need):
                tokens, meta = self._host_meta(plan, decode=True, rows=bucket(n, self.max_running), width=need,
                                               previous=previous)  # fmt: skip
                return StepInputs("graph", tokens, meta, n)
            tokens, meta = self._host_meta(plan, decode=True, rows=n, width=self._width(plan), previous=previous)
            return StepInputs("decode", tokens, meta, n)
        requests = len(plan)
        min_rows = self.prefill_min_rows() if self.compiled_prefill is not None else 0
        if self.compiled_prefill is not None:
            requests += prefill_padding(len(plan), sum(item.num_new for item in plan), min_rows)
        tokens, meta = self._host_meta(plan, decode=False, rows=requests, width=self._width(plan), previous=previous)
        last = logits_rows(meta).tolist()  # each sequence's last token; a speculating one samples k rows before it
        rows = torch.tensor([r for i in sampling for r in range(last[i] - len(plan[i].draft), last[i] + 1)],
                            dtype=torch.long)  # fmt: skip
        if len(rows) < min_rows:
            rows = torch.cat([rows, rows.new_zeros(min_rows - len(rows))])  # dropped after the forward
        return StepInputs("prefill", tokens, meta, rows)

    def run(self, step: StepInputs) -> Tensor:
        """Run the forward of `step` (every tensor-parallel rank runs this with the same inputs); float32 logits."""
        if step.kind == "graph":
            extra = () if step.lora is None else (step.lora,)
            return self.graphs.run(step.tokens, step.meta, *extra)[: step.rows]
        tokens = upload(step.tokens, self.device)
        meta = tree_map(lambda t: upload(t, self.device), step.meta)
        lora = None if step.lora is None else LoRARows(*(t if t is None else upload(t, self.device) for t in step.lora))
        if step.kind == "decode":
            if self.compiled_decode is not None:
                mark_dynamic(tokens, meta, lora)
                return self.compiled_decode(self.model.params, tokens, meta, self.cache, lora=lora)
            return self._eager_decode(self.model.params, tokens, meta, self.cache, lora=lora)
        rows = upload(step.rows, self.device)
        if self.compiled_prefill is not None:
            mark_dynamic(tokens, meta, lora)
            torch._dynamo.maybe_mark_dynamic(rows, 0)
            return self.compiled_prefill(self.model.params, tokens, meta, self.cache, rows, lora=lora)
        return self._eager_prefill(self.model.params, tokens, meta, self.cache, rows, lora=lora)

    def _eager_decode(self, *args: Any, **kwargs: Any) -> Tensor:
        with inference_kernels():  # eager: RMSNorm and SiLU * up in one CPU pass each (`ops.pointwise`)
            return self.eager_decode(*args, **kwargs)

    def _eager_prefill(self, *args: Any, **kwargs: Any) -> Tensor:
        with inference_kernels():
            return self.eager_prefill(*args, **kwargs)

    @torch.inference_mode()
    def execute(self, plan: Sequence[ScheduledSeq], *, vocab_size: int) -> dict[int, SampledToken]:
        """Run the step; returns the token drawn for each plan index that samples."""
        if not plan:
            return {}
        return self.collect(self.launch(plan, vocab_size=vocab_size))

    @torch.inference_mode()
    def launch(self, plan: Sequence[ScheduledSeq], *, vocab_size: int, previous: Launched | None = None) -> Launched:
        """Queue the step's forward and sampling on the device without waiting for them (on CUDA; the CPU runs
        them here). `previous`: the step still in flight whose sampled tokens this one feeds, if any."""
        sampling = [i for i, item in enumerate(plan) if item.sample]
        step = self.plan_step(plan, sampling, previous)
        if previous is not None and previous.tokens is not None and int(step.tokens.min()) < 0:  # a host tensor
            step = step._replace(tokens=resolve_placeholders(upload(step.tokens, self.device),
                                                             previous.tokens))  # fmt: skip
        # one sampled row per entry; k + 1 for an entry with k guesses, each drawn as if the guesses before it
        # had been accepted (its context, its output index)
        draws = [(plan[i].seq, plan[i].draft[:j]) for i in sampling for j in range(len(plan[i].draft) + 1)]
        logits = self.run(step)[: len(draws)]  # drops a compiled prefill's padding
        if not sampling:
            return Launched(sampling, {}, None, None, None)
        out = self._launch_sample(logits, draws, vocab_size)
        host, ready = out, None
        if self.cuda:  # start the copies back now; `collect` waits for them only
            host = tree_map(lambda t: t.to("cpu", non_blocking=True), out)
            ready = torch.cuda.Event()
            ready.record()
        spans = [len(plan[i].draft) + 1 for i in sampling]
        return Launched(sampling, {seq: j for j, (seq, _) in enumerate(draws)}, out.tokens, host, ready, spans)

    def collect(self, launched: Launched) -> dict[int, SampledToken]:
        """Wait for a launched step's sampled tokens (only for that step: a later one may still run) and return
        the token drawn for each plan index that samples."""
        if launched.host is None:
            return {}
        if launched.ready is not None:
            launched.ready.synchronize()
        out = launched.host
        tokens = out.tokens.tolist()
        lps = out.logprobs.tolist() if out.logprobs is not None else [None] * len(tokens)
        tops = None
        if out.top_ids is not None:
            tops = [list(zip(i, lp, strict=True)) for i, lp in zip(out.top_ids.tolist(), out.top_logprobs.tolist(),
                                                                   strict=True)]  # fmt: skip
        spans = launched.spans or [1] * len(launched.sampling)
        result, j = {}, 0
        # `rows` holds one key per sampled entry, in entry order (a speculating entry's key maps to its last row)
        for i, span, seq in zip(launched.sampling, spans, launched.rows, strict=True):
            params = seq.params
            drawn = []
            for row in range(j, j + span):
                logprob = lps[row] if (params.logprobs or params.top_logprobs) else None
                alternatives = tops[row][: params.top_logprobs] if (tops and params.top_logprobs) else None
                drawn.append(SampledToken(tokens[row], logprob, alternatives))
            result[i] = drawn[0] if span == 1 else drawn  # k + 1 draws for an entry with k guesses
            j += span
        return result

    def _grammar_bitmask(self, draws: list[tuple[Seq, tuple[int, ...]]], vocab_size: int) -> Tensor | None:
        """The sampled rows' grammar bitmask on the device (all ones on unconstrained rows); None if none is. A
        speculative row's mask is its grammar's after the guesses before it (`fill_bitmask_after`)."""
        seqs = [s for s, _ in draws]
        rows = [(s.matcher, j) for j, (s, before) in enumerate(draws) if s.matcher is not None and not before]
        if not rows:
            return None
        mask = allocate_bitmask(len(seqs), vocab_size, pin_memory=self.cuda)
        if len(rows) < len(seqs):
            mask[[j for j, s in enumerate(seqs) if s.matcher is None]] = -1
        fill_bitmask_batch(rows[0][0].grammar.view, rows, mask)
        for j, (s, before) in enumerate(draws):
            if s.matcher is not None and before:
                fill_bitmask_after(s.matcher, before, mask[j])
        for j, (s, before) in enumerate(draws):  # budget-aware closing: near the end of its budget a row follows
            if s.matcher is None or s.error is not None or before:  # its path (guessed rows are far from the end)
                continue
            token = guarded_steering(s)
            if token is not None:
                mask[j] = 0
                bit = 1 << (token & 31)
                mask[j, token >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit  # bit 31 is the int32 sign bit
        return mask.to(self.device, non_blocking=True)

    def _launch_sample(self, logits: Tensor, draws: list[tuple[Seq, tuple[int, ...]]], vocab_size: int
                       ) -> SampleOutput:  # fmt: skip
        """Queue the sampler on the step's sampled rows; the tokens stay on the device. A row is (its sequence,
        the guesses before it): a guessed row draws at the output index and with the penalty counts it would
        have once those guesses are accepted, so an accepted guess is exactly the token a plain run draws there."""
        seqs = [s for s, _ in draws]
        if any(s.in_flight > 1 and needs_outputs(s) for s in seqs):
            raise RuntimeError("a sequence with penalties or a grammar was planned before its last token came back")
        top = max(s.params.top_logprobs for s in seqs)
        want = any(s.params.logprobs or s.params.top_logprobs for s in seqs)
        bitmask = self._grammar_bitmask(draws, vocab_size)  # the forward is already launched: overlaps on CUDA
        outputs = [np.concatenate([s.output_array(), before]) if before else s.output_array() for s, before in draws]
        # copied without a host sync (`upload`); `steps` counts the tokens drawn before this one
        batch = make_sampling_batch(
            [s.params for s in seqs], seeds=[s.seed for s in seqs],
            steps=[len(s.outputs) + s.in_flight - 1 + len(before) for s, before in draws], vocab_size=vocab_size,
            device=self.device, prompts=[s.prompt_array() for s in seqs], outputs=outputs,
            stop_ids=[sorted(s.stop_ids) for s in seqs], grammar_bitmask=bitmask,
        )  # fmt: skip
        return self._sampler(logits[:, :vocab_size], batch, top_logprobs=top, want_logprobs=want)
