"""Launch autotuned Triton kernels without the autotuner's Python on every call.

`triton.autotune` wraps a kernel in an `Autotuner` whose `run` works out the tuning key on every launch: it builds
a dict of all arguments, merges it with the keyword arguments, collects the key's values and every tensor's dtype
as strings, then looks the config up and expands its kwargs: ~10 us a launch on the development CPU, against
~3.5 us for `TunedKernel.launch` (both with the kernel's `JITFunction.run` stubbed out). Over a whole op call it
is ~7 us of ~27 (`benchmarks/bench_launch.py`; docs/kernels.md, "Launching tuned kernels"). Outside CUDA graphs
(eager and compiled prefill, where attention is an opaque op) a step launches two autotuned kernels per layer,
split-KV decode and extend attention, so a 30-layer model paid ~0.4 ms a step for the lookup alone.

`TunedKernel` keeps the autotuner for what it is for, choosing a config: the first launch for a key goes through
it (timing every config that survives its pruning, as before), and it remembers the choice. Later launches with
the same key go straight to the underlying kernel with the remembered config's kwargs, which is the call the
autotuner itself makes after its lookup. The key is the autotuner's own: the values of its `key` arguments and
the dtypes of the tensor arguments, computed from positions worked out once.

`ASTRAI_TRITON_TUNED_LAUNCH=0` (or false / no / off; read at import, and benchmarks flip `CACHE_CONFIGS`) sends
every launch through the autotuner, for A/B timing. Configs with a `pre_hook` always go through it, since the hook
must run per launch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor

__all__ = ["CACHE_CONFIGS", "TunedKernel", "switched_off"]


def switched_off(value: str) -> bool:
    """Whether an environment value turns a default-on switch off ("0", "false", "no", "off"; any case), as
    `ASTRAI_CPU_KERNELS` reads."""
    return value.strip().lower() in ("0", "false", "no", "off")


CACHE_CONFIGS = not switched_off(os.environ.get("ASTRAI_TRITON_TUNED_LAUNCH", "1"))

Grid = tuple[int, ...] | Callable[[dict], tuple[int, ...]]


class TunedKernel:
    """An autotuned kernel (`triton.autotune(...)(kernel)`) launched through the tuner once per key.

    `launch(grid, args, meta)` is `autotuner[grid](*args, **meta)`: same config, same launch.
    """

    def __init__(self, autotuner: Any) -> None:
        self.autotuner = autotuner
        names = list(autotuner.arg_names)
        # the tuning key's arguments: by position when passed positionally, else by name from `meta`
        self._key_names = tuple(autotuner.keys)
        self._key_positions = {name: names.index(name) for name in self._key_names}
        self._configs: dict[tuple, dict[str, Any]] = {}

    def key(self, args: Sequence[Any], meta: dict[str, Any]) -> tuple:
        """The autotuner's key for these arguments: its key arguments' values, then every tensor's dtype."""
        values = tuple(meta[n] if n in meta else args[self._key_positions[n]] for n in self._key_names)
        # the autotuner takes the dtype of anything with one; the launchers here pass tensors only, and isinstance
        # is ~2 us a launch cheaper than hasattr's failed lookups on the int arguments
        return values + tuple(a.dtype for a in (*args, *meta.values()) if isinstance(a, Tensor))

    def launch(self, grid: Grid, args: Sequence[Any], meta: dict[str, Any]) -> Any:
        """Launch with the config the autotuner chose for this key (choosing it on the key's first launch)."""
        if not CACHE_CONFIGS:
            return self.autotuner[grid](*args, **meta)
        key = self.key(args, meta)
        kwargs = self._configs.get(key)
        if kwargs is None:
            result = self.autotuner[grid](*args, **meta)
            config = self.autotuner.best_config
            if config.pre_hook is None:
                self._configs[key] = config.all_kwargs()
            return result
        return self.autotuner.fn.run(*args, grid=grid, warmup=False, **meta, **kwargs)

    def chosen(self) -> dict[tuple, dict[str, Any]]:
        """The remembered configs' kwargs by key (a copy, for tests and benchmarks)."""
        return dict(self._configs)
