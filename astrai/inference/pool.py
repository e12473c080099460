"""Ref-counted allocator over the pages of the paged KV pool (host-side bookkeeping only).

The device tensors live in `cache.py`; this module only decides which page ids are free. Page 0 is the
null page that padding writes go to: it is never handed out, never freed and never counted.

Notable features:
- Lowest-id-first reuse: the free list is a min-heap, so `alloc` always returns the smallest free ids in
  ascending order. This keeps allocation deterministic (tests and replays see the same page ids) and packs
  live data towards the front of the pool. `alloc`, `incref` and `decref` cost O(log P) per page.
- All-or-nothing allocation: when too few pages are free, `alloc` first asks an evictor (the radix cache) to
  free the missing count; if that is still not enough it returns None without taking any page. Pages the
  evictor dropped stay dropped (they were only cache), so a failed `alloc` may still have freed pages.
- Reference counts: a page is shared by everything holding it (running requests, forks, the radix cache);
  it returns to the free list when its count reaches 0. Misuse (freeing or sharing a free page, touching the
  null page) raises ValueError before anything changes.

Not here: the K/V tensors, the prefix tree (`radix.py`), any locking (the engine's host thread is the only
user).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Iterable

NULL_PAGE = 0


class PagePool:
    """Ref-counted allocator over pages 1..num_pages-1 (page 0 is the null page).

    Attributes:
        num_pages: pages in the pool, including the null page 0.
        page_size: tokens per page (bookkeeping only; the pool itself counts pages).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (page 0 is reserved), got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = [0] * num_pages
        # already sorted, so it is a valid heap without heapify
        self._free = list(range(1, num_pages))
        self._evictor: Callable[[int], int] | None = None

    @property
    def num_free(self) -> int:
        """Pages that `alloc` can hand out without evicting."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with a refcount above 0 (held by requests or the cache)."""
        return self.num_pages - 1 - len(self._free)

    def set_evictor(self, fn: Callable[[int], int] | None) -> None:
        """Register `fn(n_needed) -> pages freed`, called by `alloc` when it is short (None unregisters)."""
        self._evictor = fn

    def alloc(self, n: int) -> list[int] | None:
        """Take `n` free pages, each with refcount 1, lowest ids first.

        Args:
            n: number of pages (0 gives []).

        Returns:
            The page ids in ascending order, or None when even after eviction fewer than `n` are free; then
            no page is taken.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free) and self._evictor is not None:
            self._evictor(n - len(self._free))
        if n > len(self._free):
            return None
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: Iterable[int]) -> None:
        """Add one reference to each page (a page listed twice gets two); every page must be in use."""
        pages = list(pages)
        for p in pages:
            self._check_live(p, "incref")
        for p in pages:
            self._refs[p] += 1

    def decref(self, pages: Iterable[int]) -> None:
        """Drop one reference from each page; pages reaching 0 return to the free list.

        Raises:
            ValueError: a page is free, out of range, the null page, or listed more times than its refcount
                (a double free). Nothing changes in that case.
        """
        counts = Counter(pages)
        for p, c in counts.items():
            self._check_live(p, "decref")
            if c > self._refs[p]:
                raise ValueError(f"decref: page {p} released {c} times but has refcount {self._refs[p]}")
        for p, c in counts.items():
            self._refs[p] -= c
            if self._refs[p] == 0:
                heapq.heappush(self._free, p)

    def refcount(self, page: int) -> int:
        """Current reference count of `page` (0 when free, and always 0 for the null page)."""
        if not 0 <= page < self.num_pages:
            raise ValueError(f"refcount: page {page} is out of range 0..{self.num_pages - 1}")
        return self._refs[page]

    def check(self) -> None:
        """Assert the pool's invariants; the AssertionError names the broken one. O(P log P), for tests."""
        free = set(self._free)
        assert len(free) == len(self._free), "free list holds duplicate pages"
        assert NULL_PAGE not in free, "null page 0 is on the free list"
        assert self._refs[NULL_PAGE] == 0, "null page 0 has a refcount"
        assert all(1 <= p < self.num_pages for p in free), "free list holds out-of-range pages"
        assert all(r >= 0 for r in self._refs), "negative refcount"
        assert all(self._refs[p] == 0 for p in free), "a free page has a refcount"
        used = sum(1 for r in self._refs if r > 0)
        assert used + len(free) == self.num_pages - 1, (
            f"counts do not add up: {used} used + {len(free)} free != {self.num_pages - 1} pages"
        )
        h = self._free
        assert all(h[(i - 1) // 2] <= h[i] for i in range(1, len(h))), "free list is not a min-heap"

    def _check_range(self, page: int, op: str) -> None:
        if not 1 <= page < self.num_pages:
            raise ValueError(f"{op}: page {page} is out of range 1..{self.num_pages - 1} (0 is the null page)")

    def _check_live(self, page: int, op: str) -> None:
        self._check_range(page, op)
        if self._refs[page] == 0:
            raise ValueError(f"{op}: page {page} is free")
