"""Range tables of a compact vector: where the chosen leaves' elements sit in each device's local shards.

Pure NumPy over the plan, no communication; :func:`vescale_jax.optim._on_leaves.on_leaves` gathers and scatters
with them and :class:`~vescale_jax.optim.CompactLayout` views the compact state logically through them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from vescale_jax.layout._plan import Plan

__all__ = ["CompactTables", "build_compact", "chosen_dtype"]


@dataclasses.dataclass(frozen=True, eq=False)
class CompactTables:
    """Where the chosen leaves' elements sit in each device's local vector ``X`` (its bucket shards,
    flattened and concatenated in bucket order).

    Attributes:
      size: ``n``, compact elements per device (the most any device holds; the others pad with zeros).
      counts: chosen elements per device.
      start, length, position: ``(m, R)`` int32 runs: ``X[start + i]`` is compact element ``position + i``
        for ``i < length`` (runs sorted by ``position``; unused runs have length 0).
      local_size: length of ``X``.
    """

    size: int
    counts: tuple[int, ...]
    start: np.ndarray
    length: np.ndarray
    position: np.ndarray
    local_size: int


def build_compact(plan: Plan, chosen: Sequence[bool]) -> CompactTables:
    """Range tables for the leaves with ``chosen[i]`` (flattening order)."""
    m = plan.num_devices
    bases, cursor = [], 0
    for b in plan.buckets:
        bases.append(cursor)
        cursor += math.prod(b.local_shape)
    runs: list[list[tuple[int, int]]] = [[] for _ in range(m)]
    for index, spec in enumerate(plan.leaves):
        if not chosen[index] or not spec.size:
            continue
        bucket = plan.buckets[spec.bucket]
        s, offset, n = bucket.layout.shard_size, bucket.layout.offsets[spec.slot], bucket.layout.sizes[spec.slot]
        for layer in range(bucket.layers or 1):
            for k in range(offset // s, (offset + n - 1) // s + 1):
                lo, hi = max(offset, k * s), min(offset + n, (k + 1) * s)
                runs[k].append((bases[spec.bucket] + layer * s + lo - k * s, hi - lo))
    width = max((len(r) for r in runs), default=0)
    start = np.zeros((m, max(width, 1)), np.int32)
    length = np.zeros_like(start)
    position = np.zeros_like(start)
    counts = []
    for k, rs in enumerate(runs):
        rs.sort()
        pos = 0
        for j, (st, ln) in enumerate(rs):
            start[k, j], length[k, j], position[k, j] = st, ln, pos
            pos += ln
        position[k, len(rs) :] = pos
        counts.append(pos)
    return CompactTables(max(counts, default=0), tuple(counts), start, length, position, cursor)


def chosen_dtype(plan: Plan, chosen: Sequence[bool]) -> jnp.dtype:
    """The dtype of a compact vector over the ``chosen`` leaves: the widest of their buckets' dtypes (the widest
    of the plan's when none is chosen); one dtype in practice, since :func:`on_leaves` splits by dtype."""
    dtypes = [jnp.dtype(plan.buckets[s.bucket].dtype) for s, c in zip(plan.leaves, chosen, strict=True) if c]
    dtypes = dtypes or [jnp.dtype(b.dtype) for b in plan.buckets]
    return max(dtypes, key=lambda d: d.itemsize, default=jnp.dtype(jnp.float32))
