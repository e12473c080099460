"""Packing: BFD against a brute-force best-fit simulation, and the invariants of every strategy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from astrai.data.packing import Piece, pack, pieces, plan_bfd


def _bfd_brute_force(lengths, capacity):
    """Best-fit decreasing by scanning every bin for each item (the definition, O(n * bins))."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, used = [], []
    for i in order:
        fits = [b for b in range(len(bins)) if used[b] + lengths[i] <= capacity]
        if fits:
            b = min(fits, key=lambda b: (capacity - used[b], b))  # least room left; oldest bin on ties
        else:
            b = len(bins)
            bins.append([])
            used.append(0)
        bins[b].append(i)
        used[b] += lengths[i]
    return bins


_capacity = st.integers(1, 40)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), capacity=_capacity)
def test_bfd_equals_brute_force_best_fit(data, capacity):
    lengths = data.draw(st.lists(st.integers(1, capacity), max_size=60))
    bins = plan_bfd(lengths, capacity)
    assert bins == _bfd_brute_force(lengths, capacity)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # each item exactly once
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    # no two bins could be merged: BFD never leaves two bins each at most half full
    assert sum(1 for b in bins if 2 * sum(lengths[i] for i in b) <= capacity) <= 1


def _tokens(rows):
    return sorted((p.doc, t) for row in rows for p in row for t in range(p.start, p.end))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), capacity=_capacity)
def test_strategies_keep_rows_within_capacity(data, capacity):
    lengths = data.draw(st.lists(st.integers(1, 3 * capacity), max_size=30))
    for strategy in ("bfd", "bfd_split", "none"):
        rows = pack(lengths, capacity, strategy)
        assert all(0 < sum(len(p) for p in row) <= capacity for row in rows)
    # bfd_split loses nothing and cuts documents into consecutive capacity-long chunks
    split = pack(lengths, capacity, "bfd_split")
    assert _tokens(split) == sorted((d, t) for d, n in enumerate(lengths) for t in range(n))
    for d, n in enumerate(lengths):
        chunks = sorted((p.start, p.end) for row in split for p in row if p.doc == d)
        assert chunks == [(s, min(s + capacity, n)) for s in range(0, n, capacity)]
    # bfd and none keep one (truncated) piece per document
    for strategy in ("bfd", "none"):
        placed = sorted((p.doc, len(p)) for row in pack(lengths, capacity, strategy) for p in row)
        assert placed == [(d, min(n, capacity)) for d, n in enumerate(lengths)]


def test_truncation_mode_picks_the_kept_end():
    assert pieces([10, 3], 4, split=False, truncation_mode="keep_end") == [Piece(0, 6, 10), Piece(1, 0, 3)]
    assert pieces([10], 4, split=False, truncation_mode="keep_start") == [Piece(0, 0, 4)]


def test_packs_short_documents_together():
    rows = pack([5, 3, 4, 2, 6], 8, "bfd")
    assert [[(p.doc, len(p)) for p in row] for row in rows] == [[(4, 6), (3, 2)], [(0, 5), (1, 3)], [(2, 4)]]


@pytest.mark.parametrize(
    ("lengths", "capacity", "match"),
    [([3, 0], 4, "document 1 has length 0"), ([1], 0, "capacity must be > 0"), ([5], 4, "item 0 has length 5")],
)
def test_bad_input_is_a_clear_error(lengths, capacity, match):
    with pytest.raises(ValueError, match=match):
        plan_bfd(lengths, capacity)


def test_unknown_strategy():
    with pytest.raises(ValueError, match="unknown packing strategy 'simple'"):
        pack([1], 4, "simple")
