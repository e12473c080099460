"""PagePool: lowest-id-first allocation, all-or-nothing with an evictor, ref counting, misuse errors, check().

The stateful model test over pool + radix together lives in test_radix.py.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from astrai.inference.pool import PagePool


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="at least 2 pages"):
        PagePool(1, 4)
    with pytest.raises(ValueError, match="page_size"):
        PagePool(8, 0)


def test_fresh_pool_excludes_null_page() -> None:
    pool = PagePool(5, 2)
    assert (pool.num_free, pool.num_used) == (4, 0)
    assert pool.alloc(4) == [1, 2, 3, 4]  # page 0 is never handed out
    assert pool.alloc(1) is None
    assert (pool.num_free, pool.num_used) == (0, 4)
    pool.check()


def test_alloc_gives_lowest_ids_with_refcount_one() -> None:
    pool = PagePool(10, 4)
    a = pool.alloc(3)
    b = pool.alloc(2)
    assert a == [1, 2, 3] and b == [4, 5]
    assert all(pool.refcount(p) == 1 for p in a + b)
    assert pool.refcount(6) == 0
    assert pool.alloc(0) == []
    with pytest.raises(ValueError, match="negative"):
        pool.alloc(-1)
    pool.check()


def test_freed_pages_are_reused_lowest_first() -> None:
    pool = PagePool(10, 1)
    pool.alloc(6)  # 1..6
    pool.decref([5, 2, 4])
    assert pool.num_free == 3 + 3
    assert pool.alloc(4) == [2, 4, 5, 7]
    pool.check()


def test_alloc_is_all_or_nothing() -> None:
    pool = PagePool(6, 2)
    held = pool.alloc(3)
    before = (pool.num_free, [pool.refcount(p) for p in range(6)])
    assert pool.alloc(3) is None  # only 2 free
    assert (pool.num_free, [pool.refcount(p) for p in range(6)]) == before
    assert pool.alloc(2) == [4, 5]  # the failed call took nothing
    pool.decref(held)
    pool.check()


def test_refcounting_shares_and_releases() -> None:
    pool = PagePool(4, 2)
    [p] = pool.alloc(1)
    pool.incref([p, p])  # listed twice: two references
    assert pool.refcount(p) == 3
    pool.decref([p])
    pool.decref([p])
    assert pool.refcount(p) == 1 and pool.num_free == 2
    pool.decref([p])
    assert pool.refcount(p) == 0 and pool.num_free == 3
    pool.check()


def test_misuse_raises_and_changes_nothing() -> None:
    pool = PagePool(6, 2)
    a, b = pool.alloc(2)
    pool.decref([b])
    with pytest.raises(ValueError, match="free"):
        pool.decref([b])  # double free
    with pytest.raises(ValueError, match="free"):
        pool.incref([a, b])  # b is free: a must not be incremented either
    assert pool.refcount(a) == 1
    with pytest.raises(ValueError, match="refcount 1"):
        pool.decref([a, a])  # more releases than references: nothing released
    assert pool.refcount(a) == 1
    assert pool.refcount(0) == 0  # the null page is never in use
    with pytest.raises(ValueError, match="out of range"):
        pool.refcount(6)
    for bad in (0, 6, -1):
        with pytest.raises(ValueError, match="out of range"):
            pool.incref([bad])
        with pytest.raises(ValueError, match="out of range"):
            pool.decref([bad])
    pool.check()


def test_evictor_called_with_missing_count_only_when_short() -> None:
    pool = PagePool(8, 2)
    cached = pool.alloc(5)  # pages 1..5, pretend a cache holds them
    calls: list[int] = []

    def evictor(n: int) -> int:
        calls.append(n)
        victims, cached[:] = cached[:n], cached[n:]
        pool.decref(victims)
        return len(victims)

    pool.set_evictor(evictor)
    assert pool.alloc(1) == [6] and calls == []  # enough free: no eviction
    assert pool.alloc(2) == [1, 7] and calls == [1]  # one free, one missing
    assert pool.alloc(2) == [2, 3] and calls == [1, 2]
    assert pool.alloc(3) is None and calls == [1, 2, 3]  # the evictor could free only 2
    assert pool.num_free == 2  # what the evictor freed stays free; no page was taken
    pool.set_evictor(None)
    assert pool.alloc(3) is None and calls == [1, 2, 3]
    pool.check()


def test_check_detects_corruption() -> None:
    pool = PagePool(6, 2)
    pool.alloc(2)
    pool.check()
    pool._free.append(pool._free[0])
    with pytest.raises(AssertionError, match="duplicate"):
        pool.check()
    pool = PagePool(6, 2)
    [p] = pool.alloc(1)
    pool._refs[p] = 0  # lost page: neither free nor used
    with pytest.raises(AssertionError, match="add up"):
        pool.check()
    pool = PagePool(6, 2)
    pool._refs[pool._free[-1]] = 2
    with pytest.raises(AssertionError, match="free page has a refcount"):
        pool.check()
    pool = PagePool(6, 2)
    pool._free.append(0)
    with pytest.raises(AssertionError, match="null page"):
        pool.check()


class PoolModel(RuleBasedStateMachine):
    """Random alloc / share / release (with misuse attempts) against a Counter of references per page."""

    @initialize(num_pages=st.integers(2, 10))
    def setup(self, num_pages: int) -> None:
        self.pool = PagePool(num_pages, 1)
        self.refs: Counter[int] = Counter()

    @rule(n=st.integers(0, 4))
    def alloc(self, n: int) -> None:
        free = [p for p in range(1, self.pool.num_pages) if not self.refs[p]]
        got = self.pool.alloc(n)
        assert got == (free[:n] if n <= len(free) else None)
        self.refs.update(got or [])

    @rule(data=st.data())
    def share_or_release(self, data: st.DataObject) -> None:
        pages = data.draw(st.lists(st.integers(0, self.pool.num_pages), max_size=4))
        release = data.draw(st.booleans())
        want = Counter(pages)
        valid = all(1 <= p < self.pool.num_pages and self.refs[p] >= (want[p] if release else 1) for p in want)
        if not valid:  # misuse: must raise and change nothing
            before = [self.pool.refcount(p) for p in range(self.pool.num_pages)]
            with pytest.raises(ValueError):
                (self.pool.decref if release else self.pool.incref)(pages)
            assert [self.pool.refcount(p) for p in range(self.pool.num_pages)] == before
        elif release:
            self.pool.decref(pages)
            self.refs.subtract(want)
        else:
            self.pool.incref(pages)
            self.refs.update(want)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        assert [self.pool.refcount(p) for p in range(self.pool.num_pages)] == [
            self.refs[p] for p in range(self.pool.num_pages)
        ]
        assert self.pool.num_used == sum(1 for c in self.refs.values() if c > 0)


PoolModel.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)
TestPoolModel = PoolModel.TestCase
