"""Placing a bucket's tensors at a fixed shard size ``S``, and the candidate values of ``S`` the planner tries.

The primitives of :mod:`vescale_jax.layout._planner`'s algorithm: ``_earliest`` (and ``_earliest_segmented``
for a segmented tensor) gives a tensor's earliest valid offset after a cursor; ``_sequential``, ``_first_fit``
(into the padding gaps) and, for small buckets, ``_exact`` (a dynamic program over subsets) place every tensor
for an order; :func:`try_shard_size` tries them all at one ``S``. :class:`Candidates` skips the values of ``S``
that break a necessary condition (or, as a hint, lists the values where long tensors cross boundaries freely).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from vescale_jax.layout._bucket_layout import allowed_cut

__all__ = ["Candidates", "ceil_to", "try_shard_size"]


def ceil_to(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a``."""
    return -(-x // a) * a


def _prev_allowed(segs: tuple[tuple[int, int], ...], d: int, a: int) -> int:
    """The largest allowed cut ``0 <= d' < d`` that is a multiple of ``a`` (0: start at the boundary)."""
    starts = [0]
    for size, _ in segs:
        starts.append(starts[-1] + size)
    j = bisect.bisect_left(starts, d) - 1  # segment j holds (starts[j], starts[j+1]]
    while j >= 0:
        lo, block = starts[j], segs[j][1]
        t = (d - 1 - lo) // block
        for _ in range(a // math.gcd(a, block) + 1):
            if t < 0:
                break
            if (lo + t * block) % a == 0:
                return lo + t * block
            t -= 1
        d, j = lo + 1, j - 1  # the segment's start (an allowed cut) and below
    return 0


def _earliest_segmented(c: int, n: int, segs: tuple[tuple[int, int], ...], s: int, a: int) -> int | None:
    """``_earliest`` for a segmented tensor: every boundary inside it must land on its segment's grid."""
    o = first = ceil_to(c, a)
    while o - first < s:  # offsets one device period apart see the same boundaries
        r = o % s
        if r + n <= s:
            return o
        bad = next((d for d in range(s - r, n, s) if not allowed_cut(segs, d)), None)
        if bad is None:
            return o
        o += bad - _prev_allowed(segs, bad, a)
    return None


def _earliest(c: int, n: int, b: int | tuple[tuple[int, int], ...], s: int, a: int) -> int | None:
    """Earliest offset ``o >= c`` (a multiple of ``a``) where tensor ``(n, b)`` is valid; None if none.
    ``b`` is a block, or a segmented tensor's segments."""
    if isinstance(b, tuple):
        return _earliest_segmented(c, n, b, s, a)
    o = ceil_to(c, a)
    if n == 0:
        return o
    r = o % s
    if r + n <= s:
        return o
    step = b * a // math.gcd(b, a)
    multi_ok = s % b == 0
    # Cross the boundary at distance d from the start: d a multiple of lcm(b, a), as large as possible.
    d = (s - r) // step * step
    if d > 0 and (n - d <= s or multi_ok):
        return o - r + s - d
    start = o - r + s  # the next device's first element
    if n <= s:
        return start
    d = s // step * step
    if d > 0 and (n - d <= s or multi_ok):
        return start + s - d
    return None  # every device start looks the same: no later offset works either


def _sequential(order: Sequence[int], sizes, blocks, s: int, a: int) -> tuple[list[int], int] | None:
    """Places tensors one after another; returns (offsets, end) or None if some tensor fits nowhere."""
    offsets = [0] * len(sizes)
    c = 0
    for i in order:
        if not sizes[i]:
            continue
        o = _earliest(c, sizes[i], blocks[i], s, a)
        if o is None:
            return None
        offsets[i] = o
        c = o + sizes[i]
    return offsets, c


def _first_fit(order: Sequence[int], sizes, blocks, s: int, a: int) -> tuple[list[int], int] | None:
    """Each tensor goes to the earliest valid place in any padding gap left by earlier ones, else the end."""
    offsets = [0] * len(sizes)
    gaps: list[tuple[int, int]] = []  # sorted, disjoint free intervals before the end cursor
    c = 0
    for i in order:
        n = sizes[i]
        if not n:
            continue
        for g, (lo, hi) in enumerate(gaps):
            if hi - lo < n:
                continue
            o = _earliest(lo, n, blocks[i], s, a)
            if o is not None and o + n <= hi:
                gaps[g : g + 1] = [(x, y) for x, y in ((lo, o), (o + n, hi)) if y > x]
                break
        else:
            o = _earliest(c, n, blocks[i], s, a)
            if o is None:
                return None
            if o > c:
                gaps.append((c, o))
            c = o + n
        offsets[i] = o
    return offsets, c


def _exact(sizes, blocks, s: int, a: int, limit: int) -> list[int] | None:
    """Exact feasibility over all orders: DP over subsets of the earliest end cursor."""
    idx = [i for i, n in enumerate(sizes) if n]
    k = len(idx)
    full = (1 << k) - 1
    end = {0: 0}
    parent: dict[int, tuple[int, int, int]] = {}
    for mask in range(1 << k):
        c = end.get(mask)
        if c is None:
            continue
        for j in range(k):
            if mask >> j & 1:
                continue
            i = idx[j]
            o = _earliest(c, sizes[i], blocks[i], s, a)
            if o is None or o + sizes[i] > limit:
                continue
            nxt, e = mask | 1 << j, o + sizes[i]
            if e < end.get(nxt, limit + 1):
                end[nxt] = e
                parent[nxt] = (mask, i, o)
    if full not in end:
        return None
    offsets = [0] * len(sizes)
    mask = full
    while mask:
        mask, i, o = parent[mask]
        offsets[i] = o
    return offsets


def try_shard_size(sizes, blocks, s: int, a: int, m: int, orders, exact: bool) -> tuple[list[int] | None, int]:
    """Tries every strategy at ``S = s``: (offsets, 0) on success, else (None, smallest overflow)."""
    limit = m * s
    overflow = None
    for order in orders:
        for strategy in (_sequential, _first_fit):
            placed = strategy(order, sizes, blocks, s, a)
            if placed is None:
                continue
            offsets, end = placed
            if end <= limit:
                return offsets, 0
            overflow = end - limit if overflow is None else min(overflow, end - limit)
    if exact:
        return _exact(sizes, blocks, s, a, limit), 0
    return None, overflow or 0


class Candidates:
    """Smallest S >= x that is a multiple of ``a`` and of every block of a tensor longer than ``span * S``.

    With ``span=2`` this is a necessary condition (such a tensor crosses two boundaries). With ``span=1`` it
    is a hint: S values that let every tensor longer than S cross boundaries anywhere on its block grid.
    """

    def __init__(self, sizes, blocks, a: int, span: int = 2):
        pairs = []  # a segmented tensor constrains S through each of its segments
        for n, b in zip(sizes, blocks, strict=True):
            pairs.extend(b if isinstance(b, tuple) else [(n, b)])
        big = sorted(((n - 1) // span, b) for n, b in pairs if b < n)
        self._thresholds = [t for t, _ in big]  # tensor j constrains S while S <= thresholds[j]
        # suffix_lcm[j] = lcm(a, blocks of tensors j..end) (those with threshold >= thresholds[j])
        lcms = [a] * (len(big) + 1)
        for j in range(len(big) - 1, -1, -1):
            lcms[j] = lcms[j + 1] * big[j][1] // math.gcd(lcms[j + 1], big[j][1])
        self._lcms = lcms

    def next(self, x: int) -> int:
        while True:
            j = bisect.bisect_left(self._thresholds, x)  # tensors j.. have threshold >= x
            step = self._lcms[j]
            y = ceil_to(x, step)
            if j == len(self._thresholds) or y <= self._thresholds[j]:
                return y
            x = self._thresholds[j] + 1  # the first constraining tensor drops out here
