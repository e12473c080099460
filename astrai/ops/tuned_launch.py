"""The tuned-launch switch of the autotuned Triton kernels, for the layers above the kernels.

`triton_kernels/_launch.py` launches an autotuned kernel from the config its autotuner chose for the key the first
time (`CACHE_CONFIGS`, from `ASTRAI_TRITON_TUNED_LAUNCH`, read at import); off, every launch goes through the
autotuner's per-call lookup, the path the H200 runs of 2026-11-29/30 confirmed. Only ops may import the kernels
(tests/astrai/test_architecture.py), so the engine's start check (`astrai.inference.fast_paths`) reads and turns
the switch through here.
"""

from __future__ import annotations

import os

TUNED_LAUNCH_ENV = "ASTRAI_TRITON_TUNED_LAUNCH"


def tuned_launch() -> bool:
    """Whether tuned kernels launch from the remembered config."""
    from astrai.triton_kernels import _launch

    return _launch.CACHE_CONFIGS


def set_tuned_launch(enabled: bool) -> None:
    """Launch from the remembered config (True) or through the autotuner every time (False), process-wide."""
    from astrai.triton_kernels import _launch

    _launch.CACHE_CONFIGS = enabled


def tuned_launch_forced() -> bool:
    """Whether the user chose the launch path (`ASTRAI_TRITON_TUNED_LAUNCH` set): then no start check overrides it."""
    return TUNED_LAUNCH_ENV in os.environ
