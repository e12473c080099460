"""LR schedules vs torch.optim.lr_scheduler where the formulas coincide, and hand-computed points elsewhere."""

from __future__ import annotations

import math

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.train.schedule import ScheduleConfig, lr_at, lr_factor


def _torch_factors(make_scheduler, steps: int) -> list[float]:
    """Factors (lr / base lr) a torch scheduler produces for steps 0 .. steps-1."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_cosine_matches_torch_cosine_annealing_after_warmup():
    warmup, total, m = 10, 110, 0.05
    cfg = ScheduleConfig(kind="cosine", warmup_steps=warmup, total_steps=total, min_lr_ratio=m)
    # torch's CosineAnnealingLR with eta_min=0 gives (1 + cos(pi s / D)) / 2; ours clamps it at m and holds after D
    cos = _torch_factors(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total - warmup), total - warmup)
    for s, c in enumerate(cos):
        assert lr_factor(cfg, warmup + s) == pytest.approx(max(m, c), abs=1e-12)
    assert lr_factor(cfg, total) == m and lr_factor(cfg, 10 * total) == m
    assert lr_factor(cfg, warmup) == 1.0
    assert lr_factor(cfg, warmup + 50) == pytest.approx(0.5)  # half way: cos(pi / 2) = 0


def test_cosine_with_zero_floor_matches_sequential_linear_then_cosine():
    # with m = 0 our warmup s / W is torch's LinearLR from 1/W (shifted by one step) and the decay is pure cosine
    warmup, total = 8, 40
    cfg = ScheduleConfig(kind="cosine", warmup_steps=warmup, total_steps=total, min_lr_ratio=0.0)
    ref = _torch_factors(
        lambda o: torch.optim.lr_scheduler.SequentialLR(
            o,
            [
                torch.optim.lr_scheduler.LinearLR(o, start_factor=1 / warmup, end_factor=1.0, total_iters=warmup - 1),
                torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=total - warmup),
            ],
            milestones=[warmup],
        ),
        total + 1,
    )
    for s in range(total + 1):
        want = 0.0 if s == 0 else ref[s - 1] if s <= warmup else ref[s]
        assert lr_factor(cfg, s) == pytest.approx(want, abs=1e-9), s


@pytest.mark.parametrize("kind", ["cosine", "sgdr", "wsd", "constant"])
def test_warmup_is_linear_with_a_floor(kind):
    cfg = ScheduleConfig(kind=kind, warmup_steps=200, total_steps=1000)
    assert lr_factor(cfg, 0) == 0.01  # max(m, 0)
    assert lr_factor(cfg, 1) == 0.01  # 1/200 = 0.005 is below the floor
    assert lr_factor(cfg, 2) == 0.01
    assert lr_factor(cfg, 3) == pytest.approx(3 / 200)
    assert lr_factor(cfg, 100) == pytest.approx(0.5)
    assert lr_factor(cfg, 199) == pytest.approx(199 / 200)
    assert lr_factor(cfg, 200) == 1.0


def test_sgdr_matches_torch_warm_restarts():
    warmup, cycle, m = 5, 7, 0.1
    cfg = ScheduleConfig(kind="sgdr", warmup_steps=warmup, total_steps=500, cycle_length=cycle, min_lr_ratio=m)
    ref = _torch_factors(
        lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=cycle, T_mult=2, eta_min=m), 120
    )
    for s, want in enumerate(ref):
        assert lr_factor(cfg, warmup + s) == pytest.approx(want, abs=1e-12), s


def test_sgdr_cycle_boundaries_by_hand():
    cfg = ScheduleConfig(kind="sgdr", warmup_steps=10, total_steps=1000, cycle_length=100, t_mult=2)
    m = 0.01
    # cycles after warmup: [0, 100), [100, 300), [300, 700)
    for start in (10, 110, 310, 710):
        assert lr_factor(cfg, start) == 1.0, start
    assert lr_factor(cfg, 10 + 50) == pytest.approx(m + (1 - m) * 0.5)  # middle of the first cycle
    assert lr_factor(cfg, 110 + 100) == pytest.approx(m + (1 - m) * 0.5)  # middle of the second (length 200)
    assert lr_factor(cfg, 109) == pytest.approx(m + (1 - m) * 0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert lr_factor(cfg, 309) < 0.02
    same = ScheduleConfig(kind="sgdr", warmup_steps=0, total_steps=100, cycle_length=10, t_mult=1)
    assert [lr_factor(same, s) for s in (0, 10, 20, 990)] == [1.0] * 4
    default = ScheduleConfig(kind="sgdr", warmup_steps=20, total_steps=120)
    assert default.sgdr_cycle == 100 and lr_factor(default, 120) == 1.0  # cycle defaults to total - W


def test_wsd_phases_and_quadratic_decay():
    cfg = ScheduleConfig(kind="wsd", warmup_steps=10, total_steps=110, min_lr_ratio=0.01)
    # CLI derivation: stable = max(1, int(0.8 * 100)) = 80, decay = 100 - 80 = 20
    assert (cfg.wsd_stable, cfg.wsd_decay) == (80, 20)
    assert lr_factor(cfg, 10) == 1.0 and lr_factor(cfg, 89) == 1.0
    assert lr_factor(cfg, 90) == 1.0  # r = 0
    assert lr_factor(cfg, 100) == pytest.approx(0.99 * 0.25 + 0.01)  # r = 1/2: quadratic, not sqrt (0.71)
    assert lr_factor(cfg, 95) == pytest.approx(0.99 * 0.75**2 + 0.01)
    assert lr_factor(cfg, 110) == pytest.approx(0.01) and lr_factor(cfg, 500) == pytest.approx(0.01)
    explicit = ScheduleConfig(kind="wsd", warmup_steps=0, total_steps=100, stable_steps=10, decay_steps=40)
    assert lr_factor(explicit, 30) == pytest.approx(0.99 * 0.5**2 + 0.01)
    tiny = ScheduleConfig(kind="wsd", warmup_steps=3, total_steps=3)
    assert (tiny.wsd_stable, tiny.wsd_decay) == (1, 1)  # the max(1, .) guards


def test_constant_and_lr_at():
    cfg = ScheduleConfig(kind="constant", warmup_steps=4, total_steps=10)
    assert [lr_factor(cfg, s) for s in (4, 9, 100)] == [1.0, 1.0, 1.0]
    assert lr_at(cfg, 3e-4, 2) == pytest.approx(1.5e-4)
    assert lr_at(ScheduleConfig(kind="cosine", total_steps=10), 3e-4, 10) == pytest.approx(3e-6)


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(["cosine", "sgdr", "wsd", "constant"]),
    total=st.integers(1, 5000),
    warmup_frac=st.floats(0, 1),
    m=st.floats(0, 1),
    step=st.integers(0, 20000),
    t_mult=st.integers(1, 4),
)
def test_factor_stays_in_range(kind, total, warmup_frac, m, step, t_mult):
    cfg = ScheduleConfig(
        kind=kind, warmup_steps=int(warmup_frac * total), total_steps=total, min_lr_ratio=m, t_mult=t_mult
    )
    assert m - 1e-12 <= lr_factor(cfg, step) <= 1.0 + 1e-12


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(kind="linear"), "kind"),
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(total_steps=-5), "total_steps"),
        (dict(warmup_steps=101), "warmup_steps"),
        (dict(min_lr_ratio=1.5), "min_lr_ratio"),
        (dict(kind="sgdr", cycle_length=0), "cycle_length"),
        (dict(kind="sgdr", t_mult=0), "t_mult"),
        (dict(kind="wsd", stable_steps=-1), "stable_steps"),
        (dict(kind="wsd", decay_steps=-2), "decay_steps"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ScheduleConfig(**{"total_steps": 100, **kwargs})


def test_bad_step_raises():
    cfg = ScheduleConfig(total_steps=10)
    with pytest.raises(ValueError, match="step"):
        lr_factor(cfg, -1)


def test_unset_total_steps_is_filled_in_later():
    cfg = ScheduleConfig(kind="cosine", warmup_steps=20)  # a recipe: the loop sets total_steps to the run's steps
    assert cfg.total_steps == 0
    with pytest.raises(ValueError, match="total_steps"):
        lr_factor(cfg, 0)
    assert lr_factor(attrs.evolve(cfg, total_steps=100), 10) == 0.5
    with pytest.raises(ValueError, match="warmup_steps"):
        attrs.evolve(cfg, total_steps=10)
