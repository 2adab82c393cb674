"""The bucket planner: pack tensors into one flat buffer that every device owns an equal ``S`` of.

Problem (DESIGN.md §1): given tensor sizes ``n_i``, blocks ``b_i``, ``m`` devices and an alignment ``a``,
choose offsets and the smallest ``S`` (a multiple of ``a``) such that the tensors are disjoint inside
``[0, m*S)``, every offset is a multiple of ``a``, and every device boundary ``k*S`` strictly inside tensor
``i`` lies on one of its block boundaries: ``(k*S - offset_i) % b_i == 0``.

Algorithm:

* **Fixed S, fixed order.** Placing each tensor at the earliest feasible offset after the previous one is
  optimal for that order (the earliest end position dominates: any later start is still available).
  ``_earliest`` computes that offset in O(1): a tensor either fits before the next boundary, or crosses it at
  a distance ``d`` that is a multiple of ``lcm(b, a)``; a tensor that crosses two or more boundaries needs
  ``S % b == 0``.
* **Fixed S, several orders.** The input order (natural, parameter-major), first-fit into the padding gaps in
  input order, size-descending and constraint-descending first-fit. For buckets of up to
  ``EXACT_MAX_TENSORS`` tensors, an exact dynamic program over subsets (the earliest end for each set of
  tensors already placed) decides feasibility over *all* orders.
* **Search over S.** Candidates start at a lower bound (``ceil(total/m)``, the largest block) and skip values
  that break a necessary condition: a tensor of more than ``2S`` elements spans two boundaries, so ``S`` must
  be a multiple of its block. Candidates are scanned in increasing order; after ``LINEAR_PROBES`` failures the
  search probes geometrically and bisects (feasibility is not monotone in S, so this phase is a heuristic),
  then tries a few "hint" candidates below the result: multiples of the blocks of every tensor longer than
  ``S``, where such tensors may cross boundaries anywhere on their block grid.
  ``S = sum(aligned sizes)`` (everything on device 0) is always feasible, so the search ends.
* **Segmented tensors** (``segments=``, a tile-major ``vj.tiles`` leaf with partial edge tiles): a tensor that
  is a run of contiguous segments, each with its own block grid. ``_earliest_segmented`` moves the offset
  forward to the nearest allowed cut below the first boundary that falls off-grid, until every boundary
  lands on a grid (or one device period has been tried).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

from vescale_jax.layout._ragged import RaggedShard

__all__ = ["BucketLayout", "plan_bucket"]

EXACT_MAX_TENSORS = 8
LINEAR_PROBES = 256
HINT_PROBES = 8


def _ceil_to(x: int, a: int) -> int:
    return -(-x // a) * a


@dataclasses.dataclass(frozen=True)
class BucketLayout:
    """Layout of one flat bucket buffer of ``num_devices * shard_size`` elements.

    Attributes:
      sizes: element count of each tensor, in input order.
      blocks: block (atomic unit, in elements) of each tensor, in input order.
      offsets: element offset of each tensor in the global buffer, in input order.
      shard_size: ``S``, the elements every device owns (a multiple of ``align``).
      num_devices: ``m``.
      align: offsets and ``S`` are multiples of it.
      segments: per tensor, ``None`` (one block grid, ``blocks[i]``) or ``((elements, block), ...)``: the
        tensor is that run of segments, each cut only on its own block grid (segment ends are cuts too);
        empty when no tensor is segmented.

    Sharding:
      Device ``k`` owns ``[k*S, (k+1)*S)`` of the global buffer; tensor ``i`` lies at
      ``[offsets[i], offsets[i] + sizes[i])`` and is never cut inside a block.
    """

    sizes: tuple[int, ...]
    blocks: tuple[int, ...]
    offsets: tuple[int, ...]
    shard_size: int
    num_devices: int
    align: int = 1
    segments: tuple[tuple[tuple[int, int], ...] | None, ...] = ()

    def segments_of(self, i: int) -> tuple[tuple[int, int], ...] | None:
        """Tensor ``i``'s segments, or None when it has one block grid."""
        return self.segments[i] if self.segments else None

    def cuts_ok(self, i: int, d: int) -> bool:
        """Whether a device boundary ``d`` elements into tensor ``i`` (``0 < d < size``) cuts no block."""
        segs = self.segments_of(i)
        return d % self.blocks[i] == 0 if segs is None else _allowed(segs, d)

    @property
    def total_size(self) -> int:
        """``m * S``: elements in the global buffer."""
        return self.num_devices * self.shard_size

    @property
    def padding(self) -> int:
        return self.total_size - sum(self.sizes)

    @property
    def padding_fraction(self) -> float:
        """``(m*S - sum(sizes)) / (m*S)``; 0.0 for an empty buffer."""
        return self.padding / self.total_size if self.total_size else 0.0

    def ragged_shard(self, i: int, shape: Sequence[int] | None = None) -> RaggedShard:
        """The RaggedShard of tensor ``i`` implied by this layout (``shape`` defaults to 1-D)."""
        n, b, o, s = self.sizes[i], self.blocks[i], self.offsets[i], self.shard_size
        segs = self.segments_of(i)
        if segs is not None:  # the finest grid every segment's cuts lie on
            b, start = 0, 0
            for size, block in segs:
                b, start = math.gcd(b, start, block), start + size
        shape = (n,) if shape is None else tuple(shape)
        ranges = []
        for k in range(self.num_devices):
            lo, hi = max(o, k * s), min(o + n, (k + 1) * s)
            ranges.append((lo - o, hi - o) if hi > lo else (None, None))
        # Empty devices sit where the tensor is not: before its first or after its last range.
        fixed, cursor = [], 0
        for lo, hi in ranges:
            if lo is None:
                fixed.append((cursor, cursor))
            else:
                fixed.append((lo, hi))
                cursor = hi
        return RaggedShard.from_ranges(shape, min(b, max(n, 1)), fixed)

    def local_offsets(self, i: int) -> tuple[int, ...]:
        """Offset of tensor ``i``'s piece inside each device's local shard (0 where it has none)."""
        n, o, s = self.sizes[i], self.offsets[i], self.shard_size
        return tuple(
            max(o, k * s) - k * s if min(o + n, (k + 1) * s) > max(o, k * s) else 0 for k in range(self.num_devices)
        )

    def device_loads(self) -> tuple[int, ...]:
        """Elements of real tensor data (not padding) on each device."""
        s = self.shard_size
        loads = [0] * self.num_devices
        for n, o in zip(self.sizes, self.offsets, strict=True):
            if not n:
                continue
            for k in range(o // s, (o + n - 1) // s + 1):
                loads[k] += min(o + n, (k + 1) * s) - max(o, k * s)
        return tuple(loads)

    def check(self) -> None:
        """Raises ``AssertionError`` if any invariant of DESIGN.md §3 is broken."""
        s, m, a = self.shard_size, self.num_devices, self.align
        assert s % a == 0, f"S={s} not a multiple of align={a}"
        spans = []
        for i, (n, b, o) in enumerate(zip(self.sizes, self.blocks, self.offsets, strict=True)):
            assert o % a == 0, f"tensor {i}: offset {o} not aligned to {a}"
            assert 0 <= o and o + n <= m * s, f"tensor {i}: [{o}, {o + n}) outside [0, {m * s})"
            for k in range(o // s + 1 if s else 1, -(-(o + n) // s) if s else 0):
                assert self.cuts_ok(i, k * s - o), f"tensor {i}: boundary {k * s} cuts a block of {b}"
            if n:
                spans.append((o, o + n, i))
        spans.sort()
        for (_, e0, i0), (s1, _, i1) in itertools.pairwise(spans):
            assert e0 <= s1, f"tensors {i0} and {i1} overlap"


# --------------------------------------------------------------------------- placement primitives


def _allowed(segs: tuple[tuple[int, int], ...], d: int) -> bool:
    """Whether a cut ``d`` elements into a segmented tensor lies on the grid of the segment holding it."""
    start = 0
    for size, block in segs:
        if d <= start + size:
            return (d - start) % block == 0
        start += size
    return d == start


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
    o = first = _ceil_to(c, a)
    while o - first < s:  # offsets one device period apart see the same boundaries
        r = o % s
        if r + n <= s:
            return o
        bad = next((d for d in range(s - r, n, s) if not _allowed(segs, d)), None)
        if bad is None:
            return o
        o += bad - _prev_allowed(segs, bad, a)
    return None


def _earliest(c: int, n: int, b: int | tuple[tuple[int, int], ...], s: int, a: int) -> int | None:
    """Earliest offset ``o >= c`` (a multiple of ``a``) where tensor ``(n, b)`` is valid; None if none.
    ``b`` is a block, or a segmented tensor's segments."""
    if isinstance(b, tuple):
        return _earliest_segmented(c, n, b, s, a)
    o = _ceil_to(c, a)
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


def _attempt(sizes, blocks, s: int, a: int, m: int, orders, exact: bool) -> tuple[list[int] | None, int]:
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


class _Candidates:
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
            y = _ceil_to(x, step)
            if j == len(self._thresholds) or y <= self._thresholds[j]:
                return y
            x = self._thresholds[j] + 1  # the first constraining tensor drops out here


def _validate(sizes, blocks, num_devices, align) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if isinstance(num_devices, bool) or int(num_devices) != num_devices or num_devices < 1:
        raise ValueError(f"plan_bucket: num_devices must be an integer >= 1, got {num_devices!r}.")
    if isinstance(align, bool) or int(align) != align or align < 1:
        raise ValueError(f"plan_bucket: align must be an integer >= 1, got {align!r}.")
    sizes, blocks = list(sizes), list(blocks)
    if len(sizes) != len(blocks):
        raise ValueError(
            f"plan_bucket: {len(sizes)} sizes but {len(blocks)} blocks; give one block per tensor "
            f"(index {min(len(sizes), len(blocks))} has no partner)."
        )
    for i, (n, b) in enumerate(zip(sizes, blocks, strict=True)):
        if isinstance(n, bool) or int(n) != n or n < 0:
            raise ValueError(f"plan_bucket: sizes[{i}] = {n!r} must be a non-negative integer.")
        if isinstance(b, bool) or int(b) != b or b < 1:
            raise ValueError(f"plan_bucket: blocks[{i}] = {b!r} must be an integer >= 1.")
    return tuple(int(n) for n in sizes), tuple(int(b) for b in blocks)


def _validate_segments(segments, sizes, blocks) -> tuple:
    if segments is None:
        return ()
    segments = list(segments)
    if len(segments) != len(sizes):
        raise ValueError(f"plan_bucket: {len(segments)} segment entries for {len(sizes)} tensors; give one per tensor.")
    out = []
    for i, segs in enumerate(segments):
        out.append(None if segs is None else _one_segments(i, segs, sizes[i], blocks[i]))
    return tuple(out) if any(x is not None for x in out) else ()


def _one_segments(i: int, segs: Any, size: int, block: int) -> tuple[tuple[int, int], ...] | None:
    """One tensor's segments, validated and normalised (empty ones dropped; one segment is no segments)."""
    try:
        segs = tuple((int(n), int(b)) for n, b in segs) if not isinstance(segs, tuple) else segs
        result = _normalise_segments(segs, size, block)
    except (TypeError, ValueError):
        result = None, f"must be None or ((elements, block), ...), got {segs!r}"
    if result[1]:
        raise ValueError(f"plan_bucket: segments[{i}] {result[1]}.")
    return result[0]


@functools.lru_cache(maxsize=4096)
def _normalise_segments(segs: tuple, size: int, block: int) -> tuple[tuple[tuple[int, int], ...] | None, str]:
    segs = tuple((int(n), int(b)) for n, b in segs)
    if any(n < 0 or b < 1 for n, b in segs) or sum(n for n, _ in segs) != size:
        return None, f"= {segs!r} must have elements >= 0 and blocks >= 1 summing to the tensor's size {size}"
    segs = tuple((n, min(b, n)) for n, b in segs if n)
    if len(segs) == 1 and segs[0][1] != min(block, max(size, 1)):
        return None, f"has one segment of block {segs[0][1]}, but the tensor's block is {block}"
    return (segs if len(segs) > 1 else None), ""


def plan_bucket(
    sizes: Sequence[int],
    blocks: Sequence[int],
    num_devices: int,
    *,
    align: int = 1,
    segments: Sequence[Sequence[tuple[int, int]] | None] | None = None,
) -> BucketLayout:
    """Packs tensors into one flat buffer of ``num_devices * S`` elements with the smallest S found.

    Args:
      sizes: element count of each tensor (0 allowed).
      blocks: atomic unit of each tensor in elements; ``blocks[i] >= sizes[i]`` keeps tensor ``i`` whole on
        one device. A size that is not a multiple of its block has a partial last block, also never cut.
      num_devices: ``m``, the devices sharing the buffer.
      align: offsets and ``S`` are multiples of this many elements.
      segments: optional, per tensor ``None`` or ``((elements, block), ...)`` summing to its size: the tensor
        is that run of contiguous segments, each cut only on its own block grid (a tile-major leaf whose
        edge tiles are smaller than its full tiles). ``blocks[i]`` is then the first segment's block.

    Returns:
      A :class:`BucketLayout` with ``offsets`` in input order and ``shard_size`` S.

    Raises:
      ValueError: naming the offending index for negative sizes, blocks < 1, mismatched lengths, or
        ``num_devices < 1``.

    Sharding:
      Device ``k`` owns ``[k*S, (k+1)*S)``; each tensor is contiguous and each of its blocks is on one device.

    Layouts are cached by their arguments (identical layers are planned once); ``plan_bucket.cache_clear()``
    empties that cache, e.g. to time planning cold.
    """
    sizes, blocks = _validate(sizes, blocks, num_devices, align)
    segs = _validate_segments(segments, sizes, blocks)
    return _plan_bucket_cached(sizes, blocks, int(num_devices), int(align), segs)


@functools.lru_cache(maxsize=4096)
def _plan_bucket_cached(
    sizes: tuple[int, ...], blocks: tuple[int, ...], m: int, a: int, segs: tuple = ()
) -> BucketLayout:
    blocks = tuple(min(b, max(n, 1)) for n, b in zip(sizes, blocks, strict=True))  # b >= n means "whole"
    if segs:
        blocks = tuple(b if g is None else g[0][1] for b, g in zip(blocks, segs, strict=True))
    total = sum(sizes)
    if total == 0:
        return BucketLayout(sizes, blocks, (0,) * len(sizes), 0, m, a, segs)
    # what the placement primitives see: a block, or a segmented tensor's segments
    grids = blocks if not segs else tuple(b if g is None else g for b, g in zip(blocks, segs, strict=True))
    k = len(sizes)
    natural = list(range(k))
    by_size = sorted(natural, key=lambda i: (-sizes[i], i))
    by_block = sorted(natural, key=lambda i: (-(blocks[i] * a // math.gcd(blocks[i], a)), -sizes[i], i))
    orders = [natural, by_size, by_block]

    lower = max(-(-total // m), max(blocks))
    upper = sum(_ceil_to(n, a) for n in sizes)  # all on device 0: always feasible
    cands = _Candidates(sizes, grids, a)
    cands_upper = cands.next(upper)
    exact = sum(1 for n in sizes if n) <= EXACT_MAX_TENSORS

    def attempt(s: int) -> tuple[list[int] | None, int]:
        return _attempt(sizes, grids, s, a, m, orders, exact)

    # Scan candidates upwards. Outside exact mode a failure that overflowed by `over` elements jumps ahead
    # by the secant estimate of where the overflow reaches zero (first guess over/2m); the bisection below
    # takes back an overshoot.
    s, prev, prev_over = cands.next(lower), None, None
    offsets = None
    for _ in range(LINEAR_PROBES):
        s = min(s, cands_upper)
        offsets, over = attempt(s)
        if offsets is not None:
            break
        jump = 1
        if not exact and over:
            slope = (prev_over - over) / (s - prev) if prev is not None and prev_over > over else 2 * m
            jump = max(1, int(over / slope))
        prev, prev_over = s, over
        s = cands.next(s + jump)
    if offsets is None:
        # Geometric probe from the last failure (feasibility is not monotone in S: a heuristic phase).
        prev, step = s, max(a, s // 256)
        while True:
            s = min(cands.next(prev + step), cands_upper)
            offsets, _ = attempt(s)
            if offsets is not None:
                break
            prev, step = s, step * 2
    # Bisect between the last failure and the success for a smaller feasible S.
    while prev is not None:
        mid = cands.next((prev + s) // 2 + 1)
        if mid >= s:
            break
        found, _ = attempt(mid)
        if found is None:
            prev = mid
        else:
            s, offsets = mid, found
    # Second chance: the "hint" candidates (multiples of the blocks of every tensor longer than S) are where
    # sparse feasible values tend to sit when the jumps above skipped them.
    hint = _Candidates(sizes, grids, a, span=1)
    x = lower
    for _ in range(HINT_PROBES):
        x = cands.next(hint.next(x))
        if x >= s:
            break
        found, _ = attempt(x)
        if found is not None:
            s, offsets = x, found
            break
        x += 1
    return BucketLayout(sizes, blocks, tuple(offsets), s, m, a, segs)


#: ``plan_bucket.cache_clear()``: empty the layout cache, as for a ``functools.lru_cache`` function.
plan_bucket.cache_clear = _plan_bucket_cached.cache_clear  # type: ignore[attr-defined]
