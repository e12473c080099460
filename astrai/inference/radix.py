"""Radix prefix cache: exact, page-aligned, parent-linked reuse of K/V pages (host-side bookkeeping only).

A tree whose edges are the exact token tuples of one page (`page_size` tokens). The node at depth i+1 on the
path spelled by `tokens` holds the physical page with the K/V of `tokens[i*N:(i+1)*N]` computed *in the
context of* `tokens[:i*N]`. Lookups walk from the root, so a page is only ever reused under the same parent
prefix (reference §5.4 and pitfall §11a.1: a hash of one page's tokens alone would reuse K/V computed in the
wrong context). Only full pages enter the tree; callers insert the fully materialised tokens of a finished
request, i.e. prompt + outputs[:-1] (pitfall §11a.2: the last sampled token has no K/V yet), and never insert
aborted requests.

Notable features:
- Reference counting through the pool: the cache holds one reference per cached page. A page with
  refcount 1 is held only by the cache and may be evicted; a running request holding it (refcount > 1)
  pins it. `match` does not incref: the caller increfs what it keeps, before allocating more pages, so an
  eviction triggered by that allocation cannot take the pages it just matched.
- LRU eviction of leaves (as SGLang's RadixCache): `match` and `insert` stamp the whole touched path with
  one tick, so a parent is never older than its children and evicting leaves in tick order is LRU over
  prefixes. Leaves sit in a lazy min-heap keyed by (tick, creation id); stale entries are dropped when
  popped and the heap is rebuilt when it outgrows the tree, so each eviction costs O(log n) amortised, plus
  one pop/push per leaf pinned by a running request (at most one per running request).
- No recursion anywhere: page_size 1 makes the tree as deep as the longest prompt.

Salts (vLLM's `cache_salt`): a salted request's first page is keyed by (salt, *its tokens), so its whole path
lives under its own root child; requests share pages only with requests of the same salt (or, unsalted, with
each other). A cache hit then tells a client nothing about what clients of another salt sent.

Not here: partial-page sharing, token-granular matching inside a page, locking (single host thread),
copy-on-write (a request writes only into pages it allocated itself). Ref: SGLang
`python/sglang/srt/mem_cache/radix_cache.py`.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence

from astrai.inference.pool import NULL_PAGE, PagePool


class _Node:
    """One cached page: `key` is its page's token tuple, `page` the physical page (None only at the root)."""

    __slots__ = ("parent", "key", "children", "page", "last_access", "uid")

    def __init__(self, parent: _Node | None, key: tuple[int, ...], page: int | None, uid: int) -> None:
        self.parent = parent  # None at the root and once the node is removed from the tree
        self.key = key
        self.children: dict[tuple[int, ...], _Node] = {}
        self.page = page
        self.last_access = 0
        self.uid = uid


class RadixCache:
    """Exact, page-aligned, parent-linked prefix cache over a PagePool (SGLang-style radix tree).

    Registers its `evict` as the pool's evictor, so `pool.alloc` reclaims cached pages on demand.

    Attributes:
        pool: the page pool whose pages are cached.
        page_size: tokens per page (the pool's).
    """

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._root = _Node(None, (), None, 0)
        self._page_node: dict[int, _Node] = {}
        self._heap: list[tuple[int, int, _Node]] = []  # (last_access, uid, leaf), lazily invalidated
        self._tick = 0
        self._next_uid = 1
        self._hit_tokens = 0
        self._query_tokens = 0
        pool.set_evictor(self.evict)

    @property
    def num_cached_pages(self) -> int:
        """Pages the cache holds a reference to."""
        return len(self._page_node)

    @property
    def hit_tokens(self) -> int:
        """Tokens served from the cache by `match`, summed over all calls."""
        return self._hit_tokens

    @property
    def query_tokens(self) -> int:
        """Tokens passed to `match` (all of them, partial last page included), summed over all calls."""
        return self._query_tokens

    @property
    def hit_rate(self) -> float:
        """hit_tokens / query_tokens, 0.0 before any query. Cumulative: `reset` keeps the statistics."""
        return self._hit_tokens / self._query_tokens if self._query_tokens else 0.0

    def match(self, tokens: Sequence[int], salt: Hashable | None = None) -> list[int]:
        """Pages of the longest cached prefix of `tokens` made of full pages, root first.

        Marks the matched path as most recently used and counts hit statistics. Does not incref.

        Args:
            tokens: token ids; only the first len(tokens) // page_size pages can match.
            salt: the request's cache salt; only pages inserted with the same salt match (None: unsalted ones).

        Returns:
            Physical page ids, one per matched page (possibly empty).
        """
        path = self._walk(tokens, len(tokens) // self.page_size, salt)
        self._touch(path)
        self._query_tokens += len(tokens)
        self._hit_tokens += len(path) * self.page_size
        return [node.page for node in path]

    def cached_pages(self, tokens: Sequence[int], salt: Hashable | None = None) -> list[int]:
        """Pages of the longest cached full-page prefix of `tokens` (under `salt`), without touching LRU stamps or
        statistics."""
        return [node.page for node in self._walk(tokens, len(tokens) // self.page_size, salt)]

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: Hashable | None = None) -> int:
        """Cache the full pages of `tokens`, whose K/V are in `pages`; increfs every newly cached page.

        Where a prefix is already cached the existing page is kept and the caller's page is not cached.

        Args:
            tokens: fully materialised token ids (prompt + outputs[:-1]); a partial last page is ignored.
            pages: the request's pages in order; at least len(tokens) // page_size of them.
            salt: the request's cache salt (`match` with the same salt finds these pages).

        Returns:
            Number of newly cached pages.

        Raises:
            ValueError: too few pages, a page to cache is free / the null page / listed twice, or already
                cached under another prefix. Nothing changes in that case.
        """
        n_full = len(tokens) // self.page_size
        if len(pages) < n_full:
            raise ValueError(f"insert: {len(tokens)} tokens fill {n_full} pages but only {len(pages)} were given")
        path = self._walk(tokens, n_full, salt)
        new = list(pages[len(path) : n_full])
        self._check_insertable(new)
        self.pool.incref(new)
        node = path[-1] if path else self._root
        for i in range(len(path), n_full):
            child = _Node(node, self._key(tokens, i, salt), pages[i], self._next_uid)
            self._next_uid += 1
            node.children[child.key] = child
            self._page_node[child.page] = child
            path.append(child)
            node = child
        self._touch(path)
        return len(new)

    def evict(self, n: int) -> int:
        """Free up to `n` pages held only by the cache, least recently used leaf first.

        A removed leaf's page is decref'd back to the pool; its parent may then become an evictable leaf.
        Pages a running request holds (refcount > 1) are never evicted.

        Returns:
            Number of pages freed (less than `n` when nothing else is evictable).
        """
        freed = 0
        pinned: list[tuple[int, int, _Node]] = []
        while freed < n and self._heap:
            entry = heapq.heappop(self._heap)
            tick, _, node = entry
            if node.parent is None or node.children or tick != node.last_access:
                continue  # stale: removed, no longer a leaf, or touched since this entry was pushed
            if self.pool.refcount(node.page) > 1:
                pinned.append(entry)  # a running request holds it; it becomes evictable when that finishes
                continue
            self._remove_leaf(node)
            freed += 1
        for entry in pinned:
            heapq.heappush(self._heap, entry)
        return freed

    def reset(self) -> None:
        """Drop every node and decref every cached page. Hit statistics are kept."""
        pages = list(self._page_node)
        self._root = _Node(None, (), None, 0)
        self._page_node = {}
        self._heap = []
        self.pool.decref(pages)

    def snapshot(self) -> dict[tuple[int, ...], int]:
        """Every cached prefix (the full token tuple up to the end of its page) -> its page. For tests/debugging.

        Costs O(pages * depth) memory: fine for small trees, not for routine use.
        """
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for key, child in node.children.items():
                out[prefix + key] = child.page
                stack.append((child, prefix + key))
        return out

    def check(self) -> None:
        """Assert the tree's invariants; the AssertionError names the broken one. O(n log n), for tests."""
        root = self._root
        assert root.parent is None and root.page is None, "root has a parent or a page"
        seen: set[int] = set()
        leaves: list[_Node] = []
        stack = [root]
        while stack:
            node = stack.pop()
            if node is not root and not node.children:
                leaves.append(node)
            for key, child in node.children.items():
                assert child.parent is node, f"page {child.page}: parent link does not match its parent's children"
                assert child.key == key, f"page {child.page}: stored key differs from its key in the parent"
                salted = node is root and len(key) == self.page_size + 1 and not isinstance(key[0], int)
                assert len(key) == self.page_size or salted, f"page {child.page}: key has {len(key)} tokens"
                assert child.page is not None, "a non-root node has no page"
                assert child.page not in seen, f"page {child.page} is cached twice"
                seen.add(child.page)
                assert self._page_node.get(child.page) is child, f"page {child.page}: page map points elsewhere"
                assert self.pool.refcount(child.page) >= 1, f"cached page {child.page} is free in the pool"
                assert node is root or child.last_access <= node.last_access, f"page {child.page} newer than parent"
                stack.append(child)
        assert len(seen) == len(self._page_node), "page map holds pages that are not in the tree"
        live = {uid for tick, uid, node in self._heap if node.parent is not None and tick == node.last_access}
        missing = [leaf.page for leaf in leaves if leaf.uid not in live]
        assert not missing, f"leaves {missing} have no eviction heap entry (they could never be evicted)"

    def _key(self, tokens: Sequence[int], i: int, salt: Hashable | None = None) -> tuple:
        page = tuple(tokens[i * self.page_size : (i + 1) * self.page_size])
        return (salt, *page) if salt is not None and i == 0 else page  # a str or tuple never equals a token id

    def _walk(self, tokens: Sequence[int], n_pages: int, salt: Hashable | None = None) -> list[_Node]:
        """Nodes of the longest cached prefix of the first `n_pages` pages of `tokens` under `salt`, root excluded."""
        path: list[_Node] = []
        node = self._root
        for i in range(n_pages):
            child = node.children.get(self._key(tokens, i, salt))
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def _touch(self, path: list[_Node]) -> None:
        """Stamp `path` (root to some node) as most recently used; a parent is never older than its child."""
        if not path:
            return
        self._tick += 1
        for node in path:
            node.last_access = self._tick
        if not path[-1].children:
            self._push(path[-1])

    def _push(self, leaf: _Node) -> None:
        heapq.heappush(self._heap, (leaf.last_access, leaf.uid, leaf))
        # every touch pushes an entry; rebuilding past twice the tree size keeps the heap O(n), amortised O(1)
        if len(self._heap) > 2 * len(self._page_node) + 64:
            self._heap = [(n.last_access, n.uid, n) for n in self._page_node.values() if not n.children]
            heapq.heapify(self._heap)

    def _remove_leaf(self, node: _Node) -> None:
        parent = node.parent
        del parent.children[node.key]
        del self._page_node[node.page]
        node.parent = None
        self.pool.decref([node.page])
        if parent is not self._root and not parent.children:
            self._push(parent)

    def _check_insertable(self, pages: list[int]) -> None:
        if len(set(pages)) != len(pages):
            raise ValueError(f"insert: a page is listed twice in {pages}")
        for p in pages:
            if p in self._page_node:
                raise ValueError(f"insert: page {p} is already cached under another prefix")
            if p == NULL_PAGE:
                raise ValueError("insert: the null page 0 cannot be cached")
            if self.pool.refcount(p) < 1:  # refcount itself rejects out-of-range ids
                raise ValueError(f"insert: page {p} is free")
