"""Learning-rate schedules as pure functions of the optimizer step: cosine, SGDR, WSD and constant.

Host-side Python (no tensors): the loop computes `lr_at(cfg, base_lr, step)` and hands the value to the update.
The formulas are the reference system's (astrai-features.md §4.9), with s = step, W = warmup steps and
m = `min_lr_ratio` (default 0.01 for every kind):

- warmup (every kind), s < W:  max(m, s / max(W, 1))
- constant:                    1
- cosine:  p = min((s - W) / max(D, 1), 1) with D = total - W;  max(m, (1 + cos(pi p)) / 2)
- sgdr:    cycles of L, L t, L t^2, ... steps after warmup (L = cycle_length, default total - W; t = t_mult);
           with q the position inside the current cycle of length L_cur:  m + (1 - m)(1 + cos(pi q / L_cur)) / 2
- wsd:     1 for `stable` steps after warmup, then r = min((s - W - stable) / max(decay, 1), 1) and
           (1 - m)(1 - r)^2 + m  (quadratic decay; default stable = max(1, int(0.8 (total - W))),
           decay = max(1, total - W - stable))

Note the cosine floor is a clamp (max(m, .)), not the rescaled m + (1 - m)(.) that SGDR uses; both are kept as the
reference defines them. Every factor lies in [m, 1].
"""

from __future__ import annotations

import math
from typing import Literal

import attrs

ScheduleKind = Literal["cosine", "sgdr", "wsd", "constant"]
KINDS = ("cosine", "sgdr", "wsd", "constant")


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"ScheduleConfig.{name} must be a non-negative int, got {value!r}")


@attrs.frozen(kw_only=True)
class ScheduleConfig:
    """Which schedule and its step counts (all in optimizer steps)."""

    kind: ScheduleKind = "cosine"
    """cosine | sgdr | wsd | constant."""
    warmup_steps: int = 0
    """Linear warmup from 0 (floored at min_lr_ratio) to the peak."""
    total_steps: int = 0
    """Optimizer steps in the whole run; 0 = unset (the train loop fills in the run's step count)."""
    min_lr_ratio: float = 0.01
    """Floor of the factor, as a fraction of the peak lr."""
    cycle_length: int | None = None
    """sgdr: length of the first cycle; None = total_steps - warmup_steps."""
    t_mult: int = 2
    """sgdr: each cycle is t_mult times longer than the previous one."""
    stable_steps: int | None = None
    """wsd: steps at the peak after warmup; None = max(1, int(0.8 * (total_steps - warmup_steps)))."""
    decay_steps: int | None = None
    """wsd: steps of quadratic decay after the stable phase; None = what remains of total_steps (at least 1)."""

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ScheduleConfig.kind must be one of {KINDS}, got {self.kind!r}")
        _non_negative_int("total_steps", self.total_steps)
        _non_negative_int("warmup_steps", self.warmup_steps)
        if self.total_steps and self.warmup_steps > self.total_steps:
            raise ValueError(
                f"ScheduleConfig.warmup_steps ({self.warmup_steps}) exceeds total_steps ({self.total_steps})"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"ScheduleConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        for name in ("cycle_length", "stable_steps", "decay_steps"):
            if getattr(self, name) is not None:
                _non_negative_int(name, getattr(self, name))
        if self.cycle_length is not None and self.cycle_length < 1:
            raise ValueError(f"ScheduleConfig.cycle_length must be >= 1, got {self.cycle_length}")
        if isinstance(self.t_mult, bool) or not isinstance(self.t_mult, int) or self.t_mult < 1:
            raise ValueError(f"ScheduleConfig.t_mult must be an int >= 1, got {self.t_mult!r}")

    @property
    def after_warmup(self) -> int:
        """Steps left after warmup (total - W)."""
        return self.total_steps - self.warmup_steps

    @property
    def cosine_decay(self) -> int:
        """cosine: D, the steps from the end of warmup to the floor."""
        return self.after_warmup

    @property
    def sgdr_cycle(self) -> int:
        """sgdr: length of the first cycle (at least 1)."""
        return self.cycle_length if self.cycle_length is not None else max(1, self.after_warmup)

    @property
    def wsd_stable(self) -> int:
        """wsd: steps held at the peak after warmup."""
        return self.stable_steps if self.stable_steps is not None else max(1, int(0.8 * self.after_warmup))

    @property
    def wsd_decay(self) -> int:
        """wsd: steps of the quadratic decay (at least 1)."""
        given = self.decay_steps if self.decay_steps is not None else self.after_warmup - self.wsd_stable
        return max(1, given)


def _sgdr_position(s: int, length: int, t_mult: int) -> tuple[int, int]:
    """(position inside the current cycle, that cycle's length) for s steps after warmup; exact integer math."""
    if t_mult == 1:
        return s % length, length
    while s >= length:
        s -= length
        length *= t_mult
    return s, length


def lr_factor(cfg: ScheduleConfig, step: int) -> float:
    """The multiplier of the peak lr at optimizer step `step` (0-based); always in [min_lr_ratio, 1]."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if cfg.total_steps == 0:
        raise ValueError("ScheduleConfig.total_steps is 0 (unset); set it to the run's optimizer steps")
    m, w = cfg.min_lr_ratio, cfg.warmup_steps
    if step < w:
        return max(m, step / max(w, 1))
    s = step - w
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "cosine":
        p = min(s / max(cfg.cosine_decay, 1), 1.0)
        return max(m, 0.5 * (1.0 + math.cos(math.pi * p)))
    if cfg.kind == "sgdr":
        q, length = _sgdr_position(s, cfg.sgdr_cycle, cfg.t_mult)
        return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * q / length))
    if s < cfg.wsd_stable:  # wsd
        return 1.0
    r = min((s - cfg.wsd_stable) / max(cfg.wsd_decay, 1), 1.0)
    return (1.0 - m) * (1.0 - r) ** 2 + m


def lr_at(cfg: ScheduleConfig, base_lr: float, step: int) -> float:
    """The learning rate at optimizer step `step`: base_lr * lr_factor(cfg, step)."""
    return base_lr * lr_factor(cfg, step)
