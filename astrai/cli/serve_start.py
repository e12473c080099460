"""What `astrai serve` does to an engine before it prints `serving`: the grammar view, and every compile.

DESIGN fact F9: no request waits on a compile after `serving`. The warm-up compiles the decode step's batch sizes
and the sampler's variants (`ModelRunner.warm_up`), and a draft model's too. One compile serves every thread count
`EngineConfig.share_cpu_cores` may pick (`astrai.inference.thread_count`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from astrai.cli._common import console

if TYPE_CHECKING:
    from astrai.inference.engine import Engine


def prepare_grammar(engine: Engine) -> None:
    """Build the grammar view while the server starts (structured output, tool calls): the first constrained
    request would otherwise wait seconds for it at a large vocabulary."""
    start = time.perf_counter()
    if engine.prepare_grammar():
        console.print(f"grammar engine ready ({time.perf_counter() - start:.1f} s)", highlight=False)


def warm_up(engine: Engine) -> None:
    """Compile every decode batch-size graph and sampler variant now (`ModelRunner.warm_up`), a draft model's too.
    Nothing to do without `--compile`."""
    runner_warm_up = getattr(engine.runner, "warm_up", None)
    if runner_warm_up is None or not engine.config.compile:
        return
    start = time.perf_counter()
    with console.status("compiling the decode step's batch sizes and the sampler's variants"):
        done = runner_warm_up()
        if engine.draft is not None:  # speculative decoding's draft model: its steps too
            engine.draft.warm_up()
    steps, sampler = done["seconds"]
    console.print(f"compiled before serving ({time.perf_counter() - start:.1f} s): decode batch sizes "
                  f"{done['decode'] or 'none (CUDA graphs or eager)'} ({steps:.1f} s), sampler variants "
                  f"{done['sampler']} ({sampler:.1f} s)", highlight=False)  # fmt: skip
