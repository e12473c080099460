"""CUDA-graph decode: the decode step replayed from one captured CUDA graph per batch bucket.

A graph replays fixed device addresses, so every input lives in a buffer preallocated for the largest bucket;
bucket b reads the first b rows. Each step copies its (padded) metadata into those rows and replays the
bucket's graph, which writes the K/V of the new tokens into the pool and leaves the logits in the graph's own
output tensor. `capture_all` records every bucket when the engine starts, largest first, as vLLM and SGLang
do (capturing on first use stalled a step by ~0.9 s for a 135M model on an H200): per bucket two warm-up
calls on a side stream (compilation, Triton autotuning) and then the capture, all while the rows hold padding
(slot -1, length 0), so neither touches the pool. All graphs share one memory pool (they never run
concurrently), so the smaller ones reuse the largest one's activations. The capture is explicit
(`torch.cuda.CUDAGraph`, as nano-vllm and SGLang do) rather than `mode="reduce-overhead"`, whose per-thread
graph trees did not survive the engine's background thread.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from astrai.inference.cache import NULL_PAGE
from astrai.inference.step import LoRARows
from astrai.ops.attention import AttnMeta


class GraphCaptureError(RuntimeError):
    """Capturing a decode CUDA graph failed; the message names the batch, the cause and the way out."""


class DecodeGraphs:
    """Decode steps over preallocated input rows; with `capture`, replayed from per-bucket CUDA graphs.

    Without `capture` (CPU tests) the step is simply called on the buffers, which exercises the same row
    bookkeeping: stale rows of a larger earlier batch must never leak into a smaller one.
    """

    def __init__(
        self,
        step: Callable[[Tensor, AttnMeta], Tensor],
        *,
        max_rows: int,
        width: int,
        page_size: int,
        device: torch.device,
        capture: bool,
        lora: bool = False,
    ) -> None:
        """`step(tokens, meta[, lora])` is the decode step with the weights and the pool bound; with `lora` (the
        served tree holds adapter slots) every graph reads each row's slot from a buffer of its own (-1: none),
        so a new mix of adapters replays the same graphs."""
        self.step, self.page_size, self.capture = step, page_size, capture
        self.max_rows, self.width, self.device = max_rows, width, device
        self.tokens = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_rows,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(max_rows + 1, dtype=torch.int32, device=device)  # one token per row
        self.block_table = torch.full((max_rows, width), NULL_PAGE, dtype=torch.int32, device=device)
        self.slot_ids = torch.full((max_rows,), -1, dtype=torch.int64, device=device) if lora else None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = None

    def _meta(self, rows: int) -> AttnMeta:
        return AttnMeta(
            positions=self.positions[:rows],
            slot_mapping=self.slot_mapping[:rows],
            cu_seqlens_q=self.cu_seqlens_q[: rows + 1],
            seq_lens=self.seq_lens[:rows],
            block_table=self.block_table[:rows],
            page_size=self.page_size,
            decode=True,
        )

    def _call(self, rows: int) -> Tensor:
        if self.slot_ids is None:
            return self.step(self.tokens[:rows], self._meta(rows))
        return self.step(self.tokens[:rows], self._meta(rows), LoRARows(self.slot_ids[:rows]))

    def _fill(self, tokens: Tensor, meta: AttnMeta, lora: LoRARows | None = None) -> None:
        """Copy a step's host metadata (already padded to its bucket) into the first rows of the buffers."""
        rows, width = meta.block_table.shape
        if self.slot_ids is not None:
            if lora is None:
                self.slot_ids[:rows].fill_(-1)
            else:
                self.slot_ids[:rows].copy_(lora.slot_ids, non_blocking=True)
        self.tokens[:rows].copy_(tokens, non_blocking=True)
        self.positions[:rows].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:rows].copy_(meta.seq_lens, non_blocking=True)
        self.block_table[:rows, :width].copy_(meta.block_table, non_blocking=True)

    def _pad(self, rows: int) -> None:
        self.tokens[:rows].zero_()
        self.positions[:rows].zero_()
        self.slot_mapping[:rows].fill_(-1)
        self.seq_lens[:rows].zero_()
        self.block_table[:rows].fill_(NULL_PAGE)
        if self.slot_ids is not None:
            self.slot_ids[:rows].fill_(-1)

    def _capture(self, rows: int) -> None:
        self._pad(rows)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compile and autotune outside the capture
                self._call(rows)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads may use CUDA while this one captures (a bucket captured late, while serving)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._call(rows)
        self._pool = graph.pool()
        self.graphs[rows] = (graph, out)

    def capture_all(self, buckets: list[int]) -> None:
        """Capture the graphs of `buckets` (each at most `max_rows`), largest first."""
        with torch.inference_mode():
            for rows in sorted(buckets, reverse=True):
                if rows not in self.graphs:
                    self._capture_or_explain(rows)

    def _capture_or_explain(self, rows: int) -> None:
        try:
            self._capture(rows)
        except Exception as e:
            hint = ("lower kv_memory_fraction (the KV pool takes that share of the free memory first) or "
                    if isinstance(e, torch.cuda.OutOfMemoryError) else "")  # fmt: skip
            raise GraphCaptureError(
                f"capturing the CUDA graph of the decode step for batch {rows} failed ({type(e).__name__}: {e}); "
                f"{hint}run without graphs: EngineConfig(cuda_graphs=False), `astrai serve --no-cuda-graphs`"
            ) from e

    def fits(self, rows: int, width: int) -> bool:
        """Whether a step of `rows` rows and a `width`-page block table fits the buffers."""
        return rows <= self.max_rows and width <= self.width

    def run(self, tokens: Tensor, meta: AttnMeta, lora: LoRARows | None = None) -> Tensor:
        """Logits [rows, V] of one decode step; `tokens` [rows] and `meta` are host tensors padded to a bucket
        (padding rows: slot -1, length 0) with a block table no wider than the buffers'; `lora` each row's
        adapter slot (None: no row has one).

        With graphs the result is the graph's output tensor, valid until the next replay of any bucket. A bucket
        `capture_all` skipped is captured here.
        """
        rows, width = tokens.shape[0], meta.block_table.shape[1]
        if not self.fits(rows, width):
            raise ValueError(f"decode step of {rows} rows x {width} pages exceeds the buffers "
                             f"({self.max_rows} x {self.width})")  # fmt: skip
        if self.capture and rows not in self.graphs:
            self._capture_or_explain(rows)
        if width < self.width:
            self.block_table[:rows, width:].fill_(NULL_PAGE)
        self._fill(tokens, meta, lora)
        if not self.capture:
            return self._call(rows)
        graph, out = self.graphs[rows]
        graph.replay()
        return out
