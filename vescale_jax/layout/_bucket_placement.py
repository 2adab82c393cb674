"""Placing a bucket's tensors at a fixed shard size ``S``, and the candidate values of ``S`` the planner tries.

The primitives of :mod:`vescale_jax.layout._planner`'s algorithm: ``_earliest`` (and ``_earliest_segmented``
for a segmented tensor) gives a tensor's earliest valid offset after a cursor; ``_sequential``, ``_first_fit``
(into the padding gaps) and, for small buckets, ``_exact`` (a dynamic program over subsets) place every tensor
for an order; :class:`Placer` tries them all at one ``S``. :class:`Candidates` skips the values of ``S`` that
break a necessary condition (or, as a hint, lists the values where long tensors cross boundaries freely).

Speed without changing a layout: an :class:`Order` is prepared once per bucket (aligned prefix sums), so the
tensors that fit before the next device boundary are placed as one run found by bisection, and only a tensor
that meets a boundary is placed on its own; first-fit keeps only the gaps a tensor still to come could use;
a strategy stops as soon as a lower bound on its end shows it cannot fit (or cannot beat the smallest overflow
so far, when the overflow is needed); the sequential layout of an order reuses first-fit's work up to the first
tensor first-fit put into a gap. ``tests/test_planner.py`` checks all of it against the tensor-by-tensor rule.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

import numpy as np

from vescale_jax.layout._bucket_layout import allowed_cut

__all__ = ["Candidates", "Placer", "ceil_to"]


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
    return _earliest_aligned(o, n, b, b * a // math.gcd(b, a), s)


def _earliest_aligned(o: int, n: int, b: int, step: int, s: int) -> int | None:
    """:func:`_earliest` from an aligned offset ``o`` for a non-empty tensor of block ``b``, where ``step`` is
    ``lcm(b, a)``: the distance from the start at which a boundary may cross the tensor is a multiple of it."""
    r = o % s
    if r + n <= s:
        return o
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


class Order:
    """One order of a bucket's non-empty tensors, with what placing them at any ``S`` needs precomputed.

    Positions ``0..k-1`` follow the order. ``aligned[x]`` is the sum of the aligned sizes before position ``x``,
    so tensors placed back to back from an aligned offset ``o`` start at ``o + aligned[x] - aligned[j]``;
    ``remaining[x]`` the sum of the sizes from ``x`` on (a lower bound on what still has to be placed);
    ``floor[x]`` the smallest size from ``x`` on (a padding gap shorter than it is of no further use);
    ``steps[x]`` is ``lcm(block, a)`` (0 for a segmented tensor).
    """

    def __init__(self, order: Sequence[int], sizes: Sequence[int], grids: Sequence, a: int):
        self.index = [i for i in order if sizes[i]]
        self.sizes = [sizes[i] for i in self.index]
        self.grids = [grids[i] for i in self.index]
        self.steps = [0 if isinstance(b, tuple) else b * a // math.gcd(b, a) for b in self.grids]
        # int64 unless sums of sizes could overflow it (Python ints then)
        self.size_array = np.asarray(self.sizes, dtype=np.int64 if sum(self.sizes) < 2**62 else object)
        self.aligned = [0, *itertools.accumulate(ceil_to(n, a) for n in self.sizes)]
        self.remaining = [*itertools.accumulate(reversed(self.sizes), initial=0)][::-1]
        self.floor = [*itertools.accumulate(reversed(self.sizes), min, initial=math.inf)][::-1]

    def __len__(self) -> int:
        return len(self.sizes)

    def fitting_run(self, j: int, o: int, s: int) -> int:
        """The first position ``t >= j`` that, placed back to back from the aligned offset ``o`` with positions
        ``j..t-1``, does not end by the device boundary after ``o`` (``len(self)`` if every one does).

        With ``S``, ``o`` and the boundary multiples of the alignment, ``o_t + n_t <= boundary`` exactly when
        ``o_t + ceil_to(n_t, a) <= boundary``: a bisection on the aligned prefix sums."""
        room = (o // s + 1) * s - o
        return bisect.bisect_right(self.aligned, self.aligned[j] + room, j, len(self.sizes) + 1) - 1

    def first_at_most(self, j: int, t: int, n: int) -> int:
        """The first position in ``[j, t)`` whose size is at most ``n`` (``t`` if none)."""
        sizes = self.sizes
        if min(sizes[j:t]) > n:  # the common case, at C speed
            return t
        return next(x for x in range(j, t) if sizes[x] <= n)

    def at_most_from(self, j: int, n: int) -> int:
        """The sum of the sizes at positions ``>= j`` that are at most ``n``."""
        rest = self.size_array[j:]
        return int(rest[rest <= n].sum())

    def earliest(self, t: int, o: int, s: int, a: int) -> int | None:
        """:func:`_earliest` for position ``t`` from the aligned offset ``o``."""
        if self.steps[t]:
            return _earliest_aligned(o, self.sizes[t], self.grids[t], self.steps[t], s)
        return _earliest_segmented(o, self.sizes[t], self.grids[t], s, a)

    def offsets(self, runs: list[tuple[int, int, int]], count: int) -> list[int]:
        """The offsets of all ``count`` tensors, in input order (0 for the empty ones), from the runs of a
        placement: ``(j, t, shift)`` puts positions ``j..t-1`` at ``shift + aligned[x]``."""
        by_position = [0] * len(self.sizes)
        for j, t, shift in runs:
            by_position[j:t] = map(shift.__add__, self.aligned[j:t])
        out = [0] * count
        for i, o in zip(self.index, by_position, strict=True):
            out[i] = o
        return out


Runs = list[tuple[int, int, int]]  # (j, t, shift): positions j..t-1 of an Order start at shift + aligned[x]


Runs = list[tuple[int, int, int]]  # (j, t, shift): positions j..t-1 of an Order start at shift + aligned[x]
State = tuple[Runs, int, int]  # a placement in progress: its runs, the end cursor, the next position


def _sequential(order: Order, s: int, a: int, stop: float, state: State = ([], 0, 0)) -> tuple[Runs | None, int]:
    """Places the order's tensors one after another, each at its earliest valid offset.

    Returns ``(runs, end)`` (:meth:`Order.offsets` turns the runs into offsets); ``(None, -1)`` if some tensor
    fits nowhere; ``(None, bound)`` with ``bound >= stop`` as soon as the end is known to reach ``stop``. Runs
    of tensors that fit before the next device boundary are placed in one step (:meth:`Order.fitting_run`);
    only a tensor that meets a boundary goes through :func:`_earliest`. ``state`` continues a placement that
    has placed the positions before its ``j`` as this function would.
    """
    aligned, remaining, sizes, k = order.aligned, order.remaining, order.sizes, len(order)
    runs, c, j = list(state[0]), state[1], state[2]
    while j < k:
        o = -(-c // a) * a
        t = order.fitting_run(j, o, s)
        if t > j:
            runs.append((j, t, o - aligned[j]))
            if t == k:
                return runs, o - aligned[j] + aligned[k - 1] + sizes[k - 1]
            o += aligned[t] - aligned[j]
        o = order.earliest(t, o, s, a)
        if o is None:
            return None, -1
        runs.append((t, t + 1, o - aligned[t]))
        c, j = o + sizes[t], t + 1
        if c + remaining[j] >= stop:
            return None, c + remaining[j]
    return runs, c


class _Gaps:
    """The padding gaps left before the end cursor by a first-fit placement, in address order.

    Only gaps that can still hold the smallest tensor left to place at an aligned offset are kept (dropping
    the others changes no placement); ``longest`` is an upper bound on their lengths, exact after a scan that
    found nothing; ``room`` is the sum of their lengths (what the tensors left can put before the cursor).
    """

    def __init__(self, a: int):
        self.a = a
        self.items: list[tuple[int, int]] = []
        self.longest = self.room = self.floor = 0

    def _keep(self, pieces: Sequence[tuple[int, int]], floor: float) -> list[tuple[int, int]]:
        """The pieces that can hold ``floor`` elements at an aligned offset."""
        return [(lo, hi) for lo, hi in pieces if ceil_to(lo, self.a) + floor <= hi]

    def raise_floor(self, floor: int) -> None:
        """Drops the gaps that cannot hold ``floor`` elements at an aligned offset."""
        if floor > self.floor:
            self.floor = floor
            self.items = self._keep(self.items, floor)
            self.longest = max((hi - lo for lo, hi in self.items), default=0)
            self.room = sum(hi - lo for lo, hi in self.items)

    def add(self, lo: int, hi: int, floor: float) -> None:
        """Appends the gap ``[lo, hi)`` (after every other one) if it can hold ``floor`` elements."""
        if ceil_to(lo, self.a) + floor <= hi:
            self.items.append((lo, hi))
            self.longest = max(self.longest, hi - lo)
            self.room += hi - lo

    def take(self, n: int, grid: int | tuple, s: int, floor: float) -> int | None:
        """Places a tensor in the first gap where it is valid and returns its offset; None if no gap fits.
        What is left of that gap is kept if it can hold ``floor`` elements."""
        longest = 0
        for g, (lo, hi) in enumerate(self.items):
            if hi - lo >= n:
                o = _earliest(lo, n, grid, s, self.a)
                if o is not None and o + n <= hi:
                    kept = self._keep(((lo, o), (o + n, hi)), floor)
                    self.items[g : g + 1] = kept
                    self.room += sum(y - x for x, y in kept) - (hi - lo)
                    return o
            longest = max(longest, hi - lo)
        self.longest = longest
        return None


def _first_fit_bound(order: Order, j: int, c: int, gaps: _Gaps, stop: float) -> int:
    """A lower bound on the end of a first-fit placement with the positions ``>= j`` left to place, the cursor
    at ``c``: what the kept gaps cannot take of those goes after ``c``. The gaps take at most their room, and
    only tensors no longer than the longest gap (computed only when it decides whether to stop)."""
    rest = order.remaining[j]
    if c + rest < stop or c + rest - gaps.room >= stop:
        return c + max(0, rest - gaps.room)
    return c + rest - min(gaps.room, order.at_most_from(j, gaps.longest))


def _first_fit(order: Order, s: int, a: int, stop: float) -> tuple[Runs | None, int, State | None]:
    """Each tensor goes to the earliest valid place in any padding gap left by earlier ones, else at the end.

    Returns as :func:`_sequential` (the bound checked against ``stop`` is :func:`_first_fit_bound`), and the
    state just before the first tensor went into a gap: up to there the placement is :func:`_sequential`'s
    (None: it is :func:`_sequential`'s throughout). While no kept gap is long enough for the next tensors
    they are placed in runs, as there.
    """
    aligned, sizes, k = order.aligned, order.sizes, len(order)
    runs: Runs = []
    gaps = _Gaps(a)
    fork = None
    c = j = 0
    while j < k:
        if gaps.items:
            gaps.raise_floor(order.floor[j])
        o = -(-c // a) * a
        t = order.fitting_run(j, o, s)
        if t > j and gaps.items:
            t = order.first_at_most(j, t, gaps.longest)
        if t > j:
            runs.append((j, t, o - aligned[j]))
            c = o - aligned[j] + aligned[t - 1] + sizes[t - 1]
            if t == k:
                break
            o += aligned[t] - aligned[j]
        n, floor = sizes[t], order.floor[t + 1]
        found = gaps.take(n, order.grids[t], s, floor) if gaps.items and n <= gaps.longest else None
        if found is None:
            found = order.earliest(t, o, s, a)
            if found is None:
                return None, -1, fork
            gaps.add(o, found, floor)  # [c, o) holds no aligned offset: the gap from o is the same gap
            c = found + n
        elif fork is None:
            fork = (runs[:], c, t)
        runs.append((t, t + 1, found - aligned[t]))
        j = t + 1
        bound = _first_fit_bound(order, j, c, gaps, stop)
        if bound >= stop:
            return None, bound, fork
    return runs, c, fork


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


class Placer:
    """Tries a bucket's tensors at one ``S`` after another: every order, sequentially and by first-fit, and for
    small buckets the exact dynamic program. The orders are prepared once (:class:`Order`); an order equal to
    an earlier one is tried once."""

    def __init__(self, sizes: Sequence[int], grids: Sequence, a: int, orders: Sequence[Sequence[int]], exact: bool):
        self.sizes, self.grids, self.a, self.exact = sizes, grids, a, exact
        self.orders: list[Order] = []
        for order in orders:
            prepared = Order(order, sizes, grids, a)
            if all(prepared.index != seen.index for seen in self.orders):
                self.orders.append(prepared)

    def try_shard_size(self, s: int, m: int, overflow_needed: bool = True) -> tuple[list[int] | None, int]:
        """``(offsets, 0)`` on success, else ``(None, smallest overflow)`` past ``m*s`` over the strategies.

        For each order the sequential layout is preferred to the first-fit one. First-fit runs first: when it
        put no tensor into a gap it *is* the sequential layout, else the sequential one continues from where
        first-fit first used a gap. A strategy stops as soon as its end is known to
        overflow by at least the smallest overflow so far, which changes neither result. Without
        ``overflow_needed`` (and in exact mode) a strategy stops as soon as it is known to overflow, and the
        overflow returned is only positive."""
        limit = m * s
        overflow: int | None = None

        def stop() -> float:
            if self.exact or not overflow_needed:
                return limit + 1
            return math.inf if overflow is None else limit + max(overflow, 1)

        for order in self.orders:
            *fitted, fork = _first_fit(order, s, self.a, stop())
            placements = [_sequential(order, s, self.a, stop(), fork), fitted] if fork else [fitted]
            for runs, end in placements:
                if runs is not None and end <= limit:
                    return order.offsets(runs, len(self.sizes)), 0
                if end >= 0 and (overflow is None or end - limit < overflow):
                    overflow = end - limit
        if self.exact:
            return _exact(self.sizes, self.grids, s, self.a, limit), 0
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
