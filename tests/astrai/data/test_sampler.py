"""ResumableSampler: ranks split the single-process batch, resume continues exactly, epochs reshuffle."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.data.sampler import ResumableSampler


def _epochs(sampler, n):
    return [list(sampler) for _ in range(n)]


@settings(max_examples=60, deadline=None)
@given(
    num_items=st.integers(1, 60),
    batch_size=st.integers(1, 5),
    world=st.integers(1, 4),
    drop_last=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_ranks_together_equal_the_single_process_batch(num_items, batch_size, world, drop_last, seed):
    if drop_last and num_items < batch_size * world:
        with pytest.raises(ValueError, match="make no batch"):
            ResumableSampler(num_items, batch_size=batch_size, seed=seed, world_size=world, rank=0)
        return
    kw = {"seed": seed, "drop_last": drop_last}
    ranks = [ResumableSampler(num_items, batch_size=batch_size, rank=r, world_size=world, **kw) for r in range(world)]
    single = ResumableSampler(num_items, batch_size=batch_size * world, rank=0, world_size=1, **kw)
    for _ in range(2):  # two epochs
        per_rank = [list(s) for s in ranks]
        joined = [sum(step, []) for step in zip(*per_rank, strict=True)]
        assert joined == list(single)
        assert all(len(b) == batch_size for rank in per_rank for b in rank)
        flat = sum(joined, [])
        if drop_last:  # each item at most once; every full global batch is used
            assert len(set(flat)) == len(flat) == (num_items // (batch_size * world)) * batch_size * world
        else:  # every item at least once; the top-up repeats the epoch's first items
            assert set(flat) == set(range(num_items))


def test_resume_mid_epoch_gives_the_same_remaining_sequence():
    make = lambda: ResumableSampler(50, batch_size=4, seed=7, rank=1, world_size=2)  # noqa: E731
    reference = make()
    expected = _epochs(reference, 3)
    run = make()
    it = iter(run)
    got = [next(it) for _ in range(3)]
    state = run.state_dict()
    assert state["epoch"] == 0 and state["batch"] == 3 and state["seed"] == 7
    resumed = make()
    resumed.load_state_dict(state)
    got += list(resumed)
    got += list(itertools.chain.from_iterable(_epochs(resumed, 2)))
    assert got == [b for epoch in expected for b in epoch]
    assert resumed.state_dict()["epoch"] == 3


def test_epochs_differ_and_seeds_differ():
    s = ResumableSampler(40, batch_size=10, seed=1, rank=0, world_size=1)
    e0, e1 = _epochs(s, 2)
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(40))
    other = ResumableSampler(40, batch_size=10, seed=2, rank=0, world_size=1)
    assert list(other) != e0
    again = ResumableSampler(40, batch_size=10, seed=1, rank=0, world_size=1)
    assert list(again) == e0  # deterministic


def test_no_shuffle_is_in_order():
    s = ResumableSampler(7, batch_size=2, seed=0, shuffle=False, drop_last=False, rank=0, world_size=1)
    assert list(s) == [[0, 1], [2, 3], [4, 5], [6, 0]] and len(s) == 4


def test_bad_arguments_and_states():
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        ResumableSampler(10, batch_size=1, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size > 0"):
        ResumableSampler(10, batch_size=0, seed=0, rank=0, world_size=1)
    s = ResumableSampler(10, batch_size=2, seed=0, rank=0, world_size=1)
    other = ResumableSampler(12, batch_size=2, seed=0, rank=0, world_size=1)
    with pytest.raises(ValueError, match="num_items=12"):
        s.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="batch 9 is outside 0..5"):
        s.load_state_dict({**s.state_dict(), "batch": 9})


def test_defaults_to_a_single_process_without_torch_distributed():
    s = ResumableSampler(10, batch_size=2, seed=0)
    assert (s.rank, s.world_size) == (0, 1)
