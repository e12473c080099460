"""RadixCache rules (reference §5.4 tests, §11a.1-2) and a stateful model test of pool + radix together.

The stateful test drives the engine's usage pattern (admit = match + incref + alloc, decode, finish = insert +
decref, abort = decref, evict, reset) against a naive reference: a dict from cached token prefixes to pages,
an O(n^2) LRU-leaf eviction, refcounts recounted from scratch, and the context each page's K/V was written in.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from astrai.inference.pool import PagePool
from astrai.inference.radix import RadixCache


def make(page_size: int = 2, num_pages: int = 32) -> tuple[PagePool, RadixCache]:
    pool = PagePool(num_pages, page_size)
    return pool, RadixCache(pool)


def cache_request(pool: PagePool, radix: RadixCache, tokens: list[int]) -> list[int]:
    """Run one request over `tokens` the way the engine does (match, incref, alloc, insert, decref)."""
    hit = radix.match(tokens)
    pool.incref(hit)
    pages = hit + pool.alloc(-(-len(tokens) // pool.page_size) - len(hit))
    radix.insert(tokens, pages)
    pool.decref(pages)
    return pages


def test_hits_are_returned() -> None:
    pool, radix = make()
    pages = cache_request(pool, radix, [1, 2, 3, 4])
    assert radix.match([1, 2, 3, 4, 5, 6]) == pages
    assert radix.match([1, 2]) == pages[:1]
    assert radix.num_cached_pages == 2
    assert all(pool.refcount(p) == 1 for p in pages)  # only the cache holds them now
    radix.check()


def test_walk_stops_at_first_miss() -> None:
    pool, radix = make()
    a, b, c = cache_request(pool, radix, [1, 2, 3, 4, 5, 6])
    assert radix.match([1, 2, 9, 9, 5, 6]) == [a]  # page 3 matches [5, 6] but its parent prefix differs
    assert radix.match([9, 9, 3, 4]) == []
    assert radix.match([1, 2, 3, 4, 5, 7]) == [a, b]


def test_partial_last_page_is_ignored() -> None:
    pool, radix = make(page_size=4)
    pages = pool.alloc(2)
    assert radix.insert([1, 2, 3, 4, 5, 6], pages) == 1  # the second page is partial: not cached
    assert pool.refcount(pages[1]) == 1  # not incref'd by the cache
    assert radix.match([1, 2, 3, 4, 5, 6, 7]) == pages[:1]  # its partial last page can't match either
    assert radix.match([1, 2, 3]) == []
    assert radix.insert([1, 2, 3], pages) == 0


def test_no_reuse_without_the_same_parent_prefix() -> None:
    pool, radix = make()
    cache_request(pool, radix, [1, 2, 3, 4])
    assert radix.match([3, 4]) == []  # same page content, different (empty) parent prefix
    assert radix.match([5, 6, 3, 4]) == []
    radix.match([])
    assert radix.hit_tokens == 0 and radix.query_tokens == 4 + 2 + 4  # the first 4 from cache_request


def test_branches_share_their_prefix() -> None:
    pool, radix = make()
    a, b = cache_request(pool, radix, [1, 2, 3, 4])
    own = pool.alloc(2)
    assert radix.insert([1, 2, 7, 8], own) == 1  # [1, 2] is cached already: keep page a, cache only own[1]
    assert pool.refcount(own[0]) == 1 and pool.refcount(own[1]) == 2
    assert radix.match([1, 2, 7, 8]) == [a, own[1]]
    assert radix.match([1, 2, 3, 4]) == [a, b]
    assert radix.snapshot() == {(1, 2): a, (1, 2, 3, 4): b, (1, 2, 7, 8): own[1]}
    radix.check()


def test_duplicate_insert_keeps_existing_pages() -> None:
    pool, radix = make()
    cached = cache_request(pool, radix, [1, 2, 3, 4])
    dup = pool.alloc(2)
    assert radix.insert([1, 2, 3, 4], dup) == 0
    assert [pool.refcount(p) for p in dup] == [1, 1]
    assert radix.match([1, 2, 3, 4]) == cached
    pool.decref(dup)
    assert pool.num_used == radix.num_cached_pages == 2


def test_insert_rejects_bad_pages_without_changes() -> None:
    pool, radix = make()
    cached = cache_request(pool, radix, [1, 2])
    fresh = pool.alloc(2)
    with pytest.raises(ValueError, match="only 1"):
        radix.insert([5, 6, 7, 8], fresh[:1])
    with pytest.raises(ValueError, match="another prefix"):
        radix.insert([5, 6, 7, 8], [fresh[0], cached[0]])
    with pytest.raises(ValueError, match="twice"):
        radix.insert([5, 6, 7, 8], [fresh[0], fresh[0]])
    with pytest.raises(ValueError, match="null page"):
        radix.insert([5, 6], [0])
    pool.decref([fresh[1]])
    with pytest.raises(ValueError, match="free"):
        radix.insert([5, 6, 7, 8], fresh)
    assert radix.snapshot() == {(1, 2): cached[0]} and pool.refcount(fresh[0]) == 1
    radix.check()
    pool.check()


def test_eviction_is_lru_among_unreferenced_leaves() -> None:
    pool, radix = make(page_size=2)
    old = cache_request(pool, radix, [1, 1])
    mid = cache_request(pool, radix, [2, 2])
    new = cache_request(pool, radix, [3, 3])
    radix.match([1, 1])  # now [2, 2] is the least recently used
    assert radix.evict(1) == 1
    assert radix.snapshot() == {(1, 1): old[0], (3, 3): new[0]} and pool.refcount(mid[0]) == 0
    pool.incref(new)  # a running request holds [3, 3]: [1, 1] goes next although it is newer
    assert radix.evict(5) == 1
    assert radix.snapshot() == {(3, 3): new[0]}
    assert radix.evict(5) == 0  # the referenced page is never evicted
    pool.decref(new)
    assert radix.evict(5) == 1 and pool.num_free == pool.num_pages - 1
    radix.check()


def test_evicting_a_leaf_keeps_siblings_and_parent() -> None:
    pool, radix = make()
    a, b = cache_request(pool, radix, [1, 2, 3, 4])
    _, c = cache_request(pool, radix, [1, 2, 7, 8])  # the newest leaf
    assert radix.evict(1) == 1  # the [3, 4] leaf, not its parent [1, 2] (not a leaf) nor the sibling
    assert radix.match([1, 2, 7, 8]) == [a, c]
    assert radix.match([1, 2, 3, 4]) == [a]
    assert pool.refcount(b) == 0
    radix.check()


def test_parent_becomes_evictable_but_referenced_inner_nodes_stay() -> None:
    pool, radix = make()
    a, b, c = cache_request(pool, radix, [1, 2, 3, 4, 5, 6])
    pool.incref([a, b])  # a request matched the first two pages
    assert radix.evict(3) == 1  # only the leaf c; b is now a leaf but referenced
    assert radix.snapshot() == {(1, 2): a, (1, 2, 3, 4): b}
    pool.decref([a, b])
    assert radix.evict(3) == 2  # b, then its parent a, once they are unreferenced leaves
    assert radix.num_cached_pages == 0 and pool.num_used == 0
    radix.check()


def test_pool_alloc_evicts_lru_cached_pages() -> None:
    pool, radix = make(page_size=2, num_pages=5)
    first = cache_request(pool, radix, [1, 2, 3, 4])
    second = cache_request(pool, radix, [5, 6, 7, 8])
    assert pool.num_free == 0
    radix.match([1, 2])  # the [1, 2] chain is newer now, but its leaf [3, 4] is older than [7, 8]...
    radix.match([5, 6, 7, 8])  # ...until the second chain is touched again
    assert pool.alloc(2) == sorted(first)  # the whole older chain: leaf first, then its parent
    assert radix.snapshot() == {(5, 6): second[0], (5, 6, 7, 8): second[1]}
    assert pool.alloc(3) is None  # only 2 more evictable
    assert radix.num_cached_pages == 0 and pool.num_free == 2


def test_matched_pages_survive_the_allocation_that_follows() -> None:
    pool, radix = make(page_size=2, num_pages=4)
    cached = cache_request(pool, radix, [1, 2, 3, 4, 5, 6])
    hit = radix.match([1, 2, 3, 4])
    pool.incref(hit)  # the engine increfs before it allocates the rest
    assert pool.alloc(1) == [cached[2]]  # only the unreferenced leaf could go
    assert pool.alloc(1) is None
    assert radix.match([1, 2, 3, 4]) == hit


@pytest.mark.parametrize("page_size", [1, 16])
def test_deep_and_wide_trees(page_size: int) -> None:
    """page_size 1 gives a 3000-deep tree: every walk must be iterative (the recursion limit is 1000)."""
    n_tokens = 3000 if page_size == 1 else 16 * 40
    pool, radix = make(page_size=page_size, num_pages=2 * n_tokens // page_size + 2)
    long = [t % 7 for t in range(n_tokens)]
    pages = cache_request(pool, radix, long)
    assert radix.match(long + [1]) == pages and radix.num_cached_pages == n_tokens // page_size
    branch = long[: n_tokens // 2] + [9] * (n_tokens // 2)
    other = cache_request(pool, radix, branch)
    assert other[: n_tokens // 2 // page_size] == pages[: n_tokens // 2 // page_size]
    radix.check()
    assert radix.evict(n_tokens // page_size // 2) == n_tokens // page_size // 2
    radix.check()
    radix.reset()
    assert pool.num_free == pool.num_pages - 1
    pool.check()


def test_reset_releases_everything_and_keeps_stats() -> None:
    pool, radix = make()
    cache_request(pool, radix, [1, 2, 3, 4])
    cache_request(pool, radix, [1, 2, 3, 4, 5])
    assert (radix.hit_tokens, radix.query_tokens) == (4, 9) and radix.hit_rate == pytest.approx(4 / 9)
    held = radix.match([1, 2])
    pool.incref(held)  # a running request keeps its page through the reset
    radix.reset()
    assert radix.num_cached_pages == 0 and radix.snapshot() == {}
    assert pool.refcount(held[0]) == 1 and pool.num_used == 1
    assert radix.match([1, 2, 3, 4]) == []
    pool.decref(held)
    assert pool.num_free == pool.num_pages - 1
    assert RadixCache(PagePool(4, 2)).hit_rate == 0.0


def test_repeated_touches_keep_the_eviction_heap_bounded() -> None:
    pool, radix = make()
    cache_request(pool, radix, [1, 2, 3, 4])
    for _ in range(1000):
        radix.match([1, 2, 3, 4])  # each touch pushes a heap entry; old ones go stale
    assert len(radix._heap) <= 2 * radix.num_cached_pages + 65
    assert radix.evict(5) == 2
    radix.check()


def test_check_detects_corruption() -> None:
    pool, radix = make()
    a, b = cache_request(pool, radix, [1, 2, 3, 4])
    radix.check()
    node_b = radix._page_node[b]
    node_b.page = a
    with pytest.raises(AssertionError, match="cached twice"):
        radix.check()
    node_b.page = b
    pool.decref([b])  # the pool freed a page the cache still holds
    with pytest.raises(AssertionError, match="free in the pool"):
        radix.check()
    pool._refs[b] = 1  # undo behind the pool's back (incref refuses a free page)
    pool._free.remove(b)
    radix._heap.clear()
    with pytest.raises(AssertionError, match="eviction heap"):
        radix.check()


# ---- stateful model test --------------------------------------------------------------------------------------


class _Req:
    def __init__(self, mat: list[int], pages: list[int]) -> None:
        self.mat = mat  # materialised tokens: their K/V are written
        self.pages = pages
        self.last = 0  # the last sampled token: no K/V yet


class PoolRadixModel(RuleBasedStateMachine):
    """Random admit / decode / finish / abort / evict / reset against a naive reference model."""

    @initialize(page_size=st.sampled_from([1, 2, 3]), num_pages=st.integers(3, 20))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.pool = PagePool(num_pages, page_size)
        self.radix = RadixCache(self.pool)
        self.reqs: dict[int, _Req] = {}
        self.next_id = 0
        self.cache: dict[tuple[int, ...], int] = {}  # cached prefix -> page (prefix-closed)
        self.access: dict[tuple[int, ...], int] = {}
        self.tick = 0
        self.written: dict[int, tuple[int, ...]] = {}  # page -> the token context its last written slot ends
        self.hits = self.queries = 0

    # -- reference model --------------------------------------------------------------------------------------
    def refs(self, page: int) -> int:
        held = sum(r.pages.count(page) for r in self.reqs.values())
        return held + (page in self.cache.values())

    def model_free(self) -> list[int]:
        return [p for p in range(1, self.pool.num_pages) if self.refs(p) == 0]

    def model_touch(self, keys: list[tuple[int, ...]]) -> None:
        self.tick += 1
        for k in keys:
            self.access[k] = self.tick

    def model_match(self, tokens: list[int]) -> list[int]:
        keys = []
        for i in range(1, len(tokens) // self.ps + 1):
            if tuple(tokens[: i * self.ps]) not in self.cache:
                break
            keys.append(tuple(tokens[: i * self.ps]))
        self.model_touch(keys)
        return [self.cache[k] for k in keys]

    def model_evict(self, n: int) -> int:
        freed = 0
        while freed < n:
            leaves = [k for k in self.cache if not any(len(o) > len(k) and o[: len(k)] == k for o in self.cache)]
            ok = [k for k in leaves if self.refs(self.cache[k]) == 1]
            if not ok:
                break
            victim = min(ok, key=self.access.__getitem__)
            assert [self.access[k] for k in ok].count(self.access[victim]) == 1, "LRU tie in the model"
            del self.cache[victim]
            freed += 1
        return freed

    def model_alloc(self, n: int) -> list[int] | None:
        if len(self.model_free()) < n:
            self.model_evict(n - len(self.model_free()))
        free = self.model_free()
        return free[:n] if len(free) >= n else None

    def model_insert(self, tokens: list[int], pages: list[int]) -> int:
        keys = [tuple(tokens[: (i + 1) * self.ps]) for i in range(len(tokens) // self.ps)]
        new = [(k, p) for k, p in zip(keys, pages, strict=False) if k not in self.cache]
        self.cache.update(new)
        self.model_touch(keys)
        return len(new)

    # -- engine operations ------------------------------------------------------------------------------------
    def write(self, req: _Req, token: int) -> None:
        """Materialise one token's K/V into the request's page for that position."""
        page = req.pages[len(req.mat) // self.ps]
        assert self.pool.refcount(page) == 1, f"writing into page {page} that someone else holds"
        req.mat.append(token)
        self.written[page] = tuple(req.mat)

    def alloc(self, n: int) -> list[int] | None:
        got = self.pool.alloc(n)
        assert got == self.model_alloc(n)
        return got

    def drop(self, rid: int, *, insert: bool) -> None:
        req = self.reqs[rid]
        if insert:  # prompt + outputs[:-1]: the last sampled token has no K/V
            assert self.radix.insert(req.mat, req.pages) == self.model_insert(req.mat, req.pages)
        self.pool.decref(req.pages)
        del self.reqs[rid]

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(shared=st.sampled_from([(), (0, 1, 0, 1), (0, 1, 2)]), own=st.lists(st.integers(0, 2), max_size=5))
    def admit(self, shared: tuple[int, ...], own: list[int]) -> None:
        """A request whose prompt often starts with a shared "system prompt", so prefixes collide."""
        prompt = [*shared, *own] or [0]
        hit = self.radix.match(prompt)
        assert hit == self.model_match(prompt)
        self.queries += len(prompt)
        self.hits += len(hit) * self.ps
        self.pool.incref(hit)
        rid, self.next_id = self.next_id, self.next_id + 1
        req = self.reqs[rid] = _Req(list(prompt[: len(hit) * self.ps]), list(hit))
        fresh = self.alloc(-(-len(prompt) // self.ps) - len(hit))
        if fresh is None:
            self.drop(rid, insert=False)
            return
        req.pages += fresh
        for token in prompt[len(req.mat) :]:
            self.write(req, token)
        req.last = prompt[0]  # any token: what matters is that it has no K/V until the next decode

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        if len(req.mat) == len(req.pages) * self.ps:
            fresh = self.alloc(1)
            if fresh is None:  # out of KV: the engine preempts (aborts here)
                self.drop(rid, insert=False)
                return
            req.pages += fresh
        self.write(req, req.last)
        req.last = token

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), insert=st.booleans())
    def finish_or_abort(self, data: st.DataObject, insert: bool) -> None:
        self.drop(data.draw(st.sampled_from(sorted(self.reqs))), insert=insert)

    @rule(n=st.integers(0, 4))
    def evict(self, n: int) -> None:
        assert self.radix.evict(n) == self.model_evict(n)

    @rule(roll=st.integers(0, 7))
    def reset(self, roll: int) -> None:
        if roll == 0:  # rare: it would otherwise keep the trees shallow
            self.radix.reset()
            self.cache.clear()

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        self.radix.check()
        assert self.radix.snapshot() == self.cache
        assert [self.pool.refcount(p) for p in range(self.pool.num_pages)] == [0] + [
            self.refs(p) for p in range(1, self.pool.num_pages)
        ], "refcounts differ from the holders (a page both free and held, or a leak)"
        held = set(self.cache.values()).union(*(r.pages for r in self.reqs.values()))
        assert self.pool.num_used == len(held) and self.pool.num_free == self.pool.num_pages - 1 - len(held)
        for prefix, page in self.cache.items():
            assert self.written[page] == prefix, f"cached page {page} holds K/V of another context"
        for req in self.reqs.values():
            assert len(set(req.pages)) == len(req.pages)
            for i, page in enumerate(req.pages):
                assert self.written[page] == tuple(req.mat[: (i + 1) * self.ps]), f"page {page} was overwritten"
        assert (self.radix.hit_tokens, self.radix.query_tokens) == (self.hits, self.queries)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for i, rid in enumerate(sorted(self.reqs)):
            self.drop(rid, insert=i % 2 == 0)
        self.pool.check()
        self.radix.check()
        assert self.pool.num_used == self.radix.num_cached_pages
        self.radix.reset()
        assert self.pool.num_free == self.pool.num_pages - 1
        self.pool.check()


PoolRadixModel.TestCase.settings = settings(max_examples=400, stateful_step_count=50, deadline=None)
TestPoolRadixModel = PoolRadixModel.TestCase
