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

This module validates the arguments and runs the search over S; the result type is
:class:`vescale_jax.layout._bucket_layout.BucketLayout` and the placement at a fixed S (``_earliest`` and the
strategies above) is in :mod:`vescale_jax.layout._bucket_placement`.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from typing import Any

import numpy as np

from vescale_jax.layout._bucket_layout import BucketLayout
from vescale_jax.layout._bucket_placement import Candidates, Placer, ceil_to

__all__ = ["plan_bucket"]

EXACT_MAX_TENSORS = 8
LINEAR_PROBES = 256
HINT_PROBES = 8


def _as_int(x: Any) -> int | None:
    """``x`` as an int when it is an integral number (``3``, ``np.int64(3)``, ``3.0``), else None (bools,
    strings, None, NaN, infinities and fractions included)."""
    if isinstance(x, bool | np.bool_) or not isinstance(x, int | float | np.integer | np.floating):
        return None
    if isinstance(x, float | np.floating) and not (np.isfinite(x) and float(x).is_integer()):
        return None
    return int(x)


def _int_list(name: str, values: Any) -> tuple[list[Any], bool]:
    """``values`` as a list, and whether every entry is a plain Python ``int`` (not a bool); a ValueError naming
    the argument when it is not a flat sequence of numbers.

    The type check runs at C speed (``operator.countOf`` over ``map(type, ...)``); an integer NumPy array
    becomes a list of Python ints in one step (``tolist``); a list of plain ints is one-dimensional without
    asking NumPy (which would copy it into an array to find out)."""
    if values is None or isinstance(values, str | bytes | dict) or not hasattr(values, "__iter__"):
        raise ValueError(
            f"plan_bucket: {name} must be a sequence of integers (one per tensor), got "
            f"{type(values).__name__} {values!r}; pass e.g. {name}=[{'1024, 4096' if name == 'sizes' else '1, 64'}]."
        )
    if isinstance(values, np.ndarray) and values.ndim == 1 and values.dtype.kind in "iu":
        return values.tolist(), True
    out = list(values)
    plain = operator.countOf(map(type, out), int) == len(out)
    if not plain and np.ndim(values) > 1:
        raise ValueError(
            f"plan_bucket: {name} must be one-dimensional (one integer per tensor), got shape {np.shape(values)}."
        )
    return out, plain


def _validate(sizes, blocks, num_devices, align) -> tuple[tuple[int, ...], tuple[int, ...]]:
    m = _as_int(num_devices)
    if m is None or m < 1:
        raise ValueError(
            f"plan_bucket: num_devices must be an integer >= 1, got {type(num_devices).__name__} {num_devices!r}; "
            "pass the size of the mesh axis, e.g. num_devices=8."
        )
    a = _as_int(align)
    if a is None or a < 1:
        raise ValueError(
            f"plan_bucket: align must be an integer >= 1 (elements), got {type(align).__name__} {align!r}; "
            "pass e.g. align=1 (default) or align=4."
        )
    (sizes, plain_sizes), (blocks, plain_blocks) = _int_list("sizes", sizes), _int_list("blocks", blocks)
    if len(sizes) != len(blocks):
        raise ValueError(
            f"plan_bucket: {len(sizes)} sizes but {len(blocks)} blocks; give one block per tensor "
            f"(index {min(len(sizes), len(blocks))} has no partner)."
        )
    if plain_sizes and plain_blocks and min(sizes, default=0) >= 0 and min(blocks, default=1) >= 1:
        return tuple(sizes), tuple(blocks)  # the common case, checked at C speed
    for i, (n, b) in enumerate(zip(sizes, blocks, strict=True)):
        if _as_int(n) is None or _as_int(n) < 0:
            raise ValueError(
                f"plan_bucket: sizes[{i}] = {n!r} must be a non-negative integer (the tensor's element count)."
            )
        if _as_int(b) is None or _as_int(b) < 1:
            raise ValueError(
                f"plan_bucket: blocks[{i}] = {b!r} must be an integer >= 1 (1: element-wise; >= sizes[{i}]: whole)."
            )
    return tuple(_as_int(n) for n in sizes), tuple(_as_int(b) for b in blocks)


def _validate_segments(segments, sizes, blocks) -> tuple:
    if segments is None:
        return ()
    if isinstance(segments, str | bytes) or not hasattr(segments, "__iter__"):
        raise ValueError(
            f"plan_bucket: segments must be None or one entry per tensor (None or ((elements, block), ...)), got "
            f"{type(segments).__name__} {segments!r}."
        )
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
    return _plan_bucket_cached(sizes, blocks, _as_int(num_devices), _as_int(align), segs)


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
    upper = sum(ceil_to(n, a) for n in sizes)  # all on device 0: always feasible
    cands = Candidates(sizes, grids, a)
    cands_upper = cands.next(upper)
    exact = sum(1 for n in sizes if n) <= EXACT_MAX_TENSORS

    placer = Placer(sizes, grids, a, orders, exact)
    tried: dict[int, tuple[list[int] | None, int]] = {}

    def attempt(s: int, overflow_needed: bool = False) -> tuple[list[int] | None, int]:
        """Offsets at S = s or None, and (if needed: only the scan's secant uses it) the smallest overflow."""
        if s not in tried:  # the hint probes may come back to a value the scan tried
            tried[s] = placer.try_shard_size(s, m, overflow_needed)
        return tried[s]

    # Scan candidates upwards. Outside exact mode a failure that overflowed by `over` elements jumps ahead
    # by the secant estimate of where the overflow reaches zero (first guess over/2m); the bisection below
    # takes back an overshoot.
    s, prev, prev_over = cands.next(lower), None, None
    offsets = None
    for _ in range(LINEAR_PROBES):
        s = min(s, cands_upper)
        offsets, over = attempt(s, overflow_needed=True)
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
    hint = Candidates(sizes, grids, a, span=1)
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
