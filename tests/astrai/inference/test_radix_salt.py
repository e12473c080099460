"""`cache_salt` at the radix level (issue 42, item 4): pages inserted under one salt are found only under that
salt; the unsalted space stays shared; salted paths evict, reset and pass `check` like any other.

Reference: the naive rule itself (a dict from (salt, prefix) to pages), spelled out in each test.
"""

from __future__ import annotations

from astrai.inference.pool import PagePool
from astrai.inference.radix import RadixCache


def cached_request(pool: PagePool, radix: RadixCache, tokens: list[int], salt: str | None) -> list[int]:
    """One request the way the engine runs it (match, incref, alloc, insert, decref); its pages."""
    hit = radix.match(tokens, salt)
    pool.incref(hit)
    pages = hit + pool.alloc(-(-len(tokens) // pool.page_size) - len(hit))
    radix.insert(tokens, pages, salt)
    pool.decref(pages)
    return pages


def test_a_salt_finds_only_its_own_pages():
    pool = PagePool(32, 2)
    radix = RadixCache(pool)
    secret = [7, 8, 9, 10]
    pages = cached_request(pool, radix, secret, "tenant-a")
    assert radix.match(secret, "tenant-a") == pages  # the same salt shares (the cache still works)
    assert radix.match(secret, "tenant-b") == []  # another salt learns nothing
    assert radix.match(secret) == []  # nor does an unsalted request
    unsalted = cached_request(pool, radix, secret, None)
    assert radix.match(secret) == unsalted and set(unsalted).isdisjoint(pages)
    assert radix.match(secret, "tenant-a") == pages  # each space keeps its own copy
    radix.check()


def test_a_salt_that_looks_like_tokens_is_still_another_space():
    pool = PagePool(32, 2)
    radix = RadixCache(pool)
    cached_request(pool, radix, [1, 2, 3, 4], None)
    assert radix.match([1, 2, 3, 4], "1") == []  # the string "1" is not the token id 1


def test_salted_pages_evict_and_reset():
    pool = PagePool(4, 2)  # page 0 is the null page: 3 usable
    radix = RadixCache(pool)
    cached_request(pool, radix, [1, 2, 3, 4], "a")
    cached_request(pool, radix, [5, 6], "b")  # evicts a's least recent leaf to fit
    radix.check()
    assert radix.match([5, 6], "b") and radix.num_cached_pages <= 3
    radix.reset()
    assert radix.num_cached_pages == 0 and radix.match([5, 6], "b") == []
