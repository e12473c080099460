"""`EngineConfig`, the engine's settings, and `EngineStats`, a snapshot of its counters (`astrai.inference.engine`)."""

from __future__ import annotations

from typing import Any

import attrs

from astrai.inference.speculative import SpeculativeConfig
from astrai.openmp import share_cpu_cores_default


def _speculative(value: Any) -> SpeculativeConfig | None:
    return value if value is None or isinstance(value, SpeculativeConfig) else SpeculativeConfig.parse(value)


@attrs.frozen(kw_only=True)
class EngineConfig:
    """Engine settings."""

    page_size: int = 16
    """Tokens per KV page (1 is supported)."""
    kv_budget_tokens: int | None = None
    """KV pool size in tokens; None sizes it from kv_memory_fraction (CUDA) or kv_budget_bytes (CPU)."""
    kv_memory_fraction: float = 0.85
    """CUDA: share of the free device memory (after loading the weights) given to the KV pool; unused when
    gpu_memory_utilization is set."""
    gpu_memory_utilization: float | None = None
    """CUDA, vLLM's meaning: the fraction (0, 1] of the device's *total* memory this process may use for weights,
    KV pool and activations together. The KV pool gets `utilization * total - torch's reserved memory (the
    weights) - activation_headroom`, never more than the free memory less that headroom
    (`kv_budget_for_utilization`). None: size the pool with kv_memory_fraction. Ignored on CPU."""
    kv_budget_bytes: int = 1 << 30
    """CPU: bytes of KV pool when kv_budget_tokens is None."""
    max_running: int = 64
    """Most sequences decoding at once."""
    max_step_tokens: int = 2048
    """Token budget of one step (decodes + prefill chunks); smaller means finer chunked prefill."""
    max_waiting: int = 1024
    """Most queued sequences (a request with n > 1 counts n); more raise EngineBusyError, and a request with
    n > max_waiting is refused (EngineInputError naming n)."""
    max_model_len: int | None = None
    """Longest prompt + completion; default the model's max_position_embeddings."""
    prefix_cache: bool = True
    """Share K/V of common prefixes through the radix cache."""
    compile: bool = True
    """torch.compile the decode step and the sampler, and the prefill step per `compile_prefill`."""
    compile_prefill: bool | None = None
    """With `compile`, compile the prefill step too; None: on CUDA, and on CPU with `speculative` (there the
    extend path is the verify step of every round: compiled, a 5-token round measured 2.0x plain decode against
    1.4x eager, docs/inference.md). For prompts alone on CPU it measured no faster than eager, and its first
    compile takes ~40 s for a 135M model."""
    cuda_graphs: bool = True
    """CUDA: replay decode steps from CUDA graphs, one per batch bucket, captured at start (every model type: MoE
    layers run the sync-free fused experts there, `astrai.ops.moe`)."""
    pack_weights: bool = True
    """CPU: keep a oneDNN-packed copy of each projection weight for many-row products (batched decode, prefill;
    `astrai.ops.packed_linear`): faster, at the cost of the weights' memory once more (skipped when free memory
    is short). Ignored on CUDA."""
    fuse_projections: bool | None = None
    """Serve a copy of the weights with each block's q/k/v and gate/up as one projection (`astrai.models.fuse`):
    two GEMMs instead of five per block and step. It costs those weights' memory once more. None: on CUDA when the
    copy fits in a quarter of the free device memory, off on CPU (fused compiled decode steps measured no
    consistent gain there, docs/inference.md); ignored under tensor parallel."""
    seed: int | None = None
    """Seed for the seeds of requests that give none (None: random)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (`astrai.inference.tp`): heads, MLP columns, experts and vocab; rank r runs
    on cuda:r when the machine has that many GPUs, else every rank on the CPU (gloo)."""
    overlap_schedule: bool = False
    """Plan step N+1 (scheduling, metadata, sampling batch, their copies to the device) while the device runs step
    N, and read N's tokens (scheduler update, detokenization, delivery) only after N+1 is queued: SGLang's
    overlap scheduler (vLLM's `--async-scheduling`). A decoding sequence feeds its in-flight token from the
    device; one that ends on a stop token costs one wasted row in the next step. Sequences with penalties or a
    grammar read their tokens on the host, so a step holding one is collected before the next is planned. On CPU
    the forward runs synchronously and nothing overlaps (same tokens, same speed); off by default until it is
    measured on a GPU (`benchmarks/bench_engine.py --overlap`). Single-rank engines only."""
    scheduling_policy: str = attrs.field(default="fcfs", validator=attrs.validators.in_(("fcfs", "priority")))
    """vLLM's `--scheduling-policy`: "fcfs" admits and preempts by arrival; "priority" by (SamplingParams.priority,
    arrival): a lower value is admitted first, runs first within a step's budget and is preempted last."""
    speculative: SpeculativeConfig | None = attrs.field(default=None, converter=_speculative)
    """Speculative decoding (`astrai.inference.speculative`; a `SpeculativeConfig`, or vLLM's
    `--speculative-config` JSON as a string or dict): "ngram" (prompt lookup) guesses up to
    `num_speculative_tokens` tokens per decoding sequence and step, verified in one forward; the output is the
    very tokens a run without it gives (greedy and seeded sampling). "draft" runs a smaller model sharing the
    tokenizer (`astrai.inference.draft`, loaded and checked at start) for the guesses. Sequences with a grammar
    decode plainly. Needs `overlap_schedule` off and one rank."""
    enable_lora: bool = False
    """Multi-LoRA serving (vLLM's `--enable-lora`): the served tree gets `max_loras` adapter slots on every attention
    and MLP projection (`astrai.nn.lora_slots`); `Engine.load_lora` registers PEFT folders and `submit(lora=name)`
    picks one per request, so one step mixes adapters and the base model. Under tensor parallel every rank's shard
    holds the slots, each adapter split like its base projection. Not with fused projections (the slots are on the
    checkpoint's projections)."""
    max_loras: int = 4
    """Adapters resident in slots at once (vLLM's `--max-loras`, whose default is 1); a request whose adapter finds
    every slot held by others waits for one."""
    max_lora_rank: int = 16
    """Largest adapter rank the slots hold (vLLM's `--max-lora-rank`); smaller ranks are zero-padded."""
    max_cpu_loras: int | None = None
    """Adapters whose weights stay in host memory (vLLM's `--max-cpu-loras`; None: max_loras); others are read
    again from their folders when a request names them."""
    share_cpu_cores: bool = attrs.field(factory=share_cpu_cores_default)
    """CPU: while other programs keep cores busy, run the steps on the cores they leave (measured from /proc;
    Linux, two threads or more, no tensor parallel): a descheduled step thread stalls every OpenMP barrier
    (docs/inference.md, "CPU: cores shared with other programs"). On by default (`ASTRAI_SHARE_CPU_CORES=0` turns
    the default off); one compile serves every thread count (`astrai.inference.thread_count`). A lower count can
    change the last bits of some products (oneDNN's), so a greedy near-tie may resolve differently under load: off
    for bit-reproducible runs on a shared machine."""
    background: bool = True
    """Run the scheduler loop on a background thread (streams to other threads, asyncio, the server). False:
    the thread that waits (generate, run_batch, result, stream) runs the steps itself, like vLLM's offline
    `LLM`; on CPU that is faster, because OpenMP spins less in a second thread's worker pool."""

    @property
    def speculative_method(self) -> str | None:
        """`speculative.method`, or None without speculation."""
        return self.speculative.method if self.speculative is not None else None

    def resolved_compile_prefill(self, device_type: str) -> bool | None:
        """`compile_prefill` with speculation's CPU default (True) filled in; None leaves the choice to the runner
        (on CUDA: compiled once its start check passes)."""
        if self.compile_prefill is None and self.speculative is not None and device_type == "cpu":
            return True
        return self.compile_prefill

    def __attrs_post_init__(self) -> None:
        util = self.gpu_memory_utilization
        if util is not None and not 0.0 < util <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.speculative is not None:
            if self.overlap_schedule or self.tensor_parallel_size > 1:
                raise ValueError("speculative decoding needs overlap_schedule off and tensor_parallel_size=1")
        if self.enable_lora:
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and "
                                 f"{self.max_lora_rank}")  # fmt: skip
            if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
            if self.fuse_projections:
                raise ValueError("enable_lora needs fuse_projections off: the adapter slots sit on the checkpoint's "
                                 "own projections")  # fmt: skip
        if self.overlap_schedule and self.tensor_parallel_size > 1:
            raise ValueError(
                "overlap_schedule (astrai serve --async-scheduling) needs tensor_parallel_size=1: the ranks "
                "run each step in lockstep"
            )


@attrs.frozen(kw_only=True)
class EngineStats:
    """A snapshot of the engine."""

    running: int
    waiting: int  # sequences (a request with n > 1 counts n), inbox included
    kv_pages_total: int
    kv_pages_used: int
    kv_pages_cached: int
    kv_pages_free: int
    prefix_hit_rate: float
    prompt_tokens: int
    generated_tokens: int
    generation_tokens_per_s: float
    preemptions: int
    steps: int
    spec_drafts: int = 0  # speculative decoding: verified rounds that had guesses
    spec_draft_tokens: int = 0  # guesses proposed
    spec_accepted_tokens: int = 0  # guesses accepted
    spec_accepted_hist: tuple[int, ...] = ()  # [a]: rounds that accepted exactly a guesses
    lora_loaded: int = 0  # multi-LoRA serving: adapters loaded
    lora_running: dict[str, int] = attrs.Factory(dict)  # running sequences per adapter name
    lora_waiting: dict[str, int] = attrs.Factory(dict)  # waiting sequences per adapter name
    page_size: int = 0  # tokens per KV page (0: not known)
    prefix_cache: bool = False  # the radix prefix cache is on
