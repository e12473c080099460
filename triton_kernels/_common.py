"""Small helpers shared by the Triton launchers: interpreter detection, SM counts, layout checks.

Everything here runs on the host, is cheap, and never synchronises with the device, so launchers that use it
stay capturable by CUDA graphs and traceable by `torch.compile` (the ops are opaque `custom_op`s there).
Nothing here imports a kernel module; kernel modules import this one.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "autotune_configs",
    "cdiv",
    "check_last_dim_contiguous",
    "interpreting",
    "next_power_of_2",
    "num_sms",
    "prune_by",
    "upcast",
]


def cdiv(x: int, y: int) -> int:
    """ceil(x / y) for ints, as `triton.cdiv`. Launchers size grids and blocks with these two on every call; Triton's
    own are constexpr functions whose wrapper costs ~1.4 us a call on the host (against ~0.03 us here), ~6 us a
    decode attention launch."""
    return (x + y - 1) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as `triton.next_power_of_2`, at plain-Python cost."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def interpreting() -> bool:
    """Whether Triton kernels run under the interpreter (`TRITON_INTERPRET` set to a true value).

    Triton reads the variable when a `@triton.jit` function is *created*, so this reflects how the kernels of an
    already imported module behave only if the variable was not changed after that import.
    """
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def upcast() -> bool:
    """The value launchers pass as the `UPCAST` constexpr: cast loaded tiles to fp32 before any math.

    True under the interpreter, which has no bf16 arithmetic and computes bf16 `tl.dot` wrongly (triton #11584,
    DESIGN.md fact F6). On a GPU the kernels keep 16-bit tiles and accumulate in fp32.
    """
    return interpreting()


def autotune_configs(kept: list) -> list:
    """The configs an autotuner should time: all of `kept`, or only the first when `ASTRAI_TRITON_AUTOTUNE=0`.

    Tuning compiles and times every config at the first call per key, which dominates GPU test time; tests set
    the variable to compile one config per shape, benchmarks leave tuning on.
    """
    if os.environ.get("ASTRAI_TRITON_AUTOTUNE", "1") == "0":
        return kept[:1]
    return kept


def prune_by(keep: Callable[[Any, int], bool], arg: str) -> Callable[..., list]:
    """An autotune `early_config_prune` shared by the split-KV kernels.

    It keeps the configs with `keep(config, value of the launch argument arg)`, or the one with the smallest
    BLOCK_N when none passes, and hands them to `autotune_configs`.
    """

    def prune(configs: list, named_args: dict, **kwargs) -> list:
        value = {**named_args, **kwargs}[arg]
        kept = [c for c in configs if keep(c, value)]
        return autotune_configs(kept or [min(configs, key=lambda c: c.kwargs["BLOCK_N"])])

    return prune


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming-multiprocessor count of `device`, used to size split-KV grids (a host query, cached, no sync).

    Returns a small stand-in (4) for CPU tensors and under the interpreter, where programs run one after another
    and extra parallelism only costs time.
    """
    if device.type != "cuda" or interpreting():
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def check_last_dim_contiguous(**tensors: Tensor) -> None:
    """Assert that each named tensor has a unit stride in its last dimension (other strides may be arbitrary).

    Kernels hard-code the innermost stride to 1 so that head-dim loads vectorise; a view of a fused qkv
    projection passes, a transposed tensor does not.

    Raises:
        AssertionError: naming the first offending tensor and its strides.
    """
    for name, t in tensors.items():
        assert t.stride(-1) == 1 or t.shape[-1] == 1, f"{name} needs a contiguous last dim, strides {t.stride()}"
