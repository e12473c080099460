"""Packing documents into rows of at most `capacity` tokens: best-fit decreasing, with or without splitting.

A packing is a list of rows; a row is a list of `Piece(doc, start, end)` slices of the input documents, in the
order they were placed. Strategies:

- `bfd`: documents longer than `capacity` are truncated (keeping their start or end), then sorted by length,
  longest first (ties by index), and each goes to the open row with the LEAST room that still fits it (ties:
  the oldest row); when none fits a new row opens. Rows stay within capacity by construction.
- `bfd_split`: documents longer than `capacity` are first cut into consecutive `capacity`-long chunks (the last
  one shorter), which are then packed as documents of their own. No token is lost, but a later chunk does not
  see the earlier ones: each chunk is a separate document (its positions restart at 0).
- `none`: one (truncated) document per row.

BFD is within 11/9 OPT + 1 rows of optimal (Johnson 1973); in practice rows come out nearly full. Runs in
O(n log n + n * rows) worst case with a sorted list of (room, row) pairs.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import attrs


@attrs.frozen
class Piece:
    """Tokens [start, end) of document `doc`."""

    doc: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


def _check(lengths: Sequence[int], capacity: int) -> None:
    if capacity <= 0:
        raise ValueError(f"capacity must be > 0, got {capacity}")
    bad = next((i for i, n in enumerate(lengths) if n <= 0), None)
    if bad is not None:
        raise ValueError(f"document {bad} has length {lengths[bad]}; documents must be non-empty")


def plan_bfd(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing bins of item indices; every item must fit (`lengths[i] <= capacity`).

    Returns:
        Bins in the order they were opened, each listing item indices in placement order.
    """
    _check(lengths, capacity)
    too_long = next((i for i, n in enumerate(lengths) if n > capacity), None)
    if too_long is not None:
        raise ValueError(f"item {too_long} has length {lengths[too_long]} > capacity {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    open_bins: list[tuple[int, int]] = []  # sorted (room left, bin index); full bins are dropped
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(open_bins, (n, -1))  # first bin with room >= n: the least room that fits
        if k < len(open_bins):
            room, b = open_bins.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if room - n > 0:
            bisect.insort(open_bins, (room - n, b))
    return bins


def _clip(doc: int, n: int, capacity: int, truncation_mode: str) -> Piece:
    if n <= capacity:
        return Piece(doc, 0, n)
    return Piece(doc, 0, capacity) if truncation_mode == "keep_start" else Piece(doc, n - capacity, n)


def pieces(lengths: Sequence[int], capacity: int, *, split: bool, truncation_mode: str = "keep_start") -> list[Piece]:
    """Each document as one piece (truncated to capacity) or, with `split`, as consecutive capacity-long chunks."""
    _check(lengths, capacity)
    if not split:
        return [_clip(d, n, capacity, truncation_mode) for d, n in enumerate(lengths)]
    return [Piece(d, s, min(s + capacity, n)) for d, n in enumerate(lengths) for s in range(0, n, capacity)]


def pack(
    lengths: Sequence[int], capacity: int, strategy: str, *, truncation_mode: str = "keep_start"
) -> list[list[Piece]]:
    """Pack documents of `lengths` into rows of at most `capacity` tokens with `strategy` (bfd, bfd_split, none)."""
    if strategy not in ("bfd", "bfd_split", "none"):
        raise ValueError(f"unknown packing strategy {strategy!r} (bfd, bfd_split, none)")
    items = pieces(lengths, capacity, split=strategy == "bfd_split", truncation_mode=truncation_mode)
    if strategy == "none":
        return [[p] for p in items]
    return [[items[i] for i in row] for row in plan_bfd([len(p) for p in items], capacity)]
