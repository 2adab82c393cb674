"""The relayout engine's lookup for many runs: strided run tables and their block index.

A *strided run* maps ``length`` consecutive positions from ``start`` to indices ``value + i * stride``: a
stored row piece of a matrix (stride 1 as stored, the row length of a transposed one). A strided table is
``(m, 4, R)`` int32 runs ``(start, value, stride, length)`` sorted by ``start`` and padded to the most runs ``R``
of any device (:func:`strided_runs` builds one from per-element entries, vectorised). Where a device holds many
runs (Muon's owner routing: about one per stored row), one select per run (the unrolled form of
:func:`vescale_jax.relayout._runs.lookup`) is too slow, so what is baked into a program is the
:class:`RunLookup` form (segments covering every position plus a block table): :func:`expand_runs` maps
positions with ``probes + 3`` small-table lookups each; :func:`run_indices` expands a device's row into the
index array of one gather (a short loop over chunks), and :func:`run_gather` gathers chunk by chunk without any
index array.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RunLookup", "expand_runs", "expand_strided", "run_gather", "run_indices", "strided_runs"]


_NO_RUN = np.iinfo(np.int32).max  # start of the padding runs (after every position)
_PROBES = 4  # most run starts inside one block of a RunLookup (more probes stop XLA fusing the lookups)


def strided_runs(key: np.ndarray, pos: np.ndarray, val: np.ndarray, m: int) -> np.ndarray:
    """Strided run table ``(m, 4, R)`` of the entries ``(key, pos) -> val`` (device, position, index), listed in an
    order in which the positions of a run follow each other. Greedy, vectorised: an entry continues the
    previous one's run when it has the same device, the next position and (from a run's third entry on)
    the same step of values; anything else, a non-arithmetic row included, just starts more runs."""
    n = len(pos)
    if n == 0:
        return np.array([[[_NO_RUN], [0], [0], [0]]] * m, np.int32)
    brk = np.empty(n, bool)  # i cannot continue i - 1's run
    brk[0] = True
    np.not_equal(key[1:], key[:-1], out=brk[1:])
    brk[1:] |= pos[1:] - pos[:-1] != 1
    step = val[1:] - val[:-1]
    c = brk.copy()  # ... or its step differs from the one into i - 1
    c[2:] |= step[1:] != step[:-1]
    # start[i] = brk[i] or (c[i] and not start[i-1]) (a one-entry run takes any step): in a stretch of
    # consecutive c entries the starts alternate from the stretch's first entry (or a brk).
    first = c.copy()
    first[1:] &= brk[1:] | ~c[:-1]
    i = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    origin = np.where(first, i, 0)
    np.maximum.accumulate(origin, out=origin)
    s = np.flatnonzero(c & ((i - origin) & 1 == 0))
    length = np.diff(np.append(s, n))
    stride = np.where(length > 1, step[np.minimum(s, n - 2)], 0) if n > 1 else np.zeros(1, val.dtype)
    k, start, value = key[s], pos[s], val[s]
    order = np.lexsort((start, k))
    k, cols = k[order], np.stack([start, value, stride, length])[:, order]
    counts = np.bincount(k, minlength=m)
    r = max(int(counts.max()), 1)
    slot = np.arange(len(k)) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.zeros((m, 4, r), np.int64)
    out[:, 0] = _NO_RUN
    out[k, :, slot] = cols.T
    last = out[:, 1] + out[:, 2] * np.maximum(out[:, 3] - 1, 0)
    if min(out[:, 1].min(), last.min()) < 0 or max(np.abs(out[:, 1:]).max(), last.max()) >= _NO_RUN:
        raise ValueError("relayout: run table indices exceed int32")
    return out.astype(np.int32)


def expand_strided(runs: np.ndarray, n: int, sentinel: int) -> np.ndarray:
    """A strided run table ``(m, 4, R)`` as the ``(m, n)`` indices of positions ``0 .. n-1`` (NumPy; what the devices
    compute): ``value + (i - start) * stride`` for ``i`` in a run, ``sentinel`` elsewhere."""
    pos = np.arange(n, dtype=np.int64)
    out = np.full((runs.shape[0], n), sentinel, np.int64)
    for k, (start, value, stride, length) in enumerate(runs.astype(np.int64)):
        r = np.maximum(np.searchsorted(start, pos, side="right") - 1, 0)
        off = pos - start[r]
        ok = (off >= 0) & (off < length[r])
        out[k, ok] = (value[r] + off * stride[r])[ok]
    return out


def _wrap32(x: np.ndarray) -> np.ndarray:
    """int64 -> int32 modulo 2**32 (what int32 arithmetic on the device does)."""
    return ((x + 2**31) % 2**32 - 2**31).astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class RunLookup:
    """A strided run table in the form the devices expand (:func:`expand_runs`).

    The positions ``0 .. n-1`` of device ``k`` are covered by segments: its runs, and stride-0 segments of
    the sentinel in between. Position ``i`` lies in segment ``r0 + #{u = 1..probes: starts[r0 + u] <= i}``,
    ``r0 = blocks[k, i >> shift]`` the segment holding the start of ``i``'s block of ``2**shift`` positions
    (``shift`` is chosen so that no block has more than ``probes`` segment starts inside it), and maps to
    ``base + i * stride`` of that segment (``base = value - start * stride``, modulo ``2**32`` like the
    device's int32 arithmetic, which makes the sum exact).

    Attributes:
      blocks: ``(m, ceil(n / 2**shift))`` int32.
      segments: ``(m, 3, S + probes)`` int32 rows ``starts`` (padding: ``2**31 - 1``), ``base``, ``stride``.
      shift, probes: see above.
    """

    blocks: np.ndarray
    segments: np.ndarray
    shift: int
    probes: int

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes + self.segments.nbytes

    @classmethod
    def build(cls, runs: np.ndarray, n: int, sentinel: int) -> RunLookup:
        m = runs.shape[0]
        segs = []
        for start, value, stride, length in runs.astype(np.int64):
            real = (length > 0) & (start < _NO_RUN)
            start, value, stride, length = start[real], value[real], stride[real], length[real]
            gap = np.append(0, start + length)
            gap_len = np.append(start, n) - gap
            s = np.concatenate([start, gap[gap_len > 0]])
            v = np.concatenate([value, np.full(int((gap_len > 0).sum()), sentinel)])
            st = np.concatenate([stride, np.zeros(int((gap_len > 0).sum()), np.int64)])
            order = np.argsort(s, kind="stable")
            segs.append((s[order], v[order], st[order]))
        most = max(len(s) for s, _, _ in segs)
        # The smallest blocks table no longer than the segments, then smaller blocks while a block holds more
        # than _PROBES segment starts.
        shift = max(0, math.ceil(math.log2(max(n, 1) / max(most, 1))))

        def probes(shift: int) -> int:
            inner = [s[s & ((1 << shift) - 1) != 0] >> shift for s, _, _ in segs]
            return max([int(np.bincount(x).max()) for x in inner if len(x)] + [0])

        while shift > 0 and probes(shift) > _PROBES:
            shift -= 1
        c = probes(shift)
        nb = max(-(-n // (1 << shift)), 1)
        blocks = np.zeros((m, nb), np.int32)
        segments = np.zeros((m, 3, most + c), np.int32)
        segments[:, 0] = _NO_RUN
        for k, (s, v, st) in enumerate(segs):
            blocks[k] = np.maximum(np.searchsorted(s, np.arange(nb) << shift, side="right") - 1, 0)
            segments[k, :, : len(s)] = s, _wrap32(v - s * st), _wrap32(st)
        return cls(blocks, segments, shift, c)


def expand_runs(lookup: RunLookup, k: jax.Array, pos: jax.Array) -> jax.Array:
    """Device ``k``'s int32 indices at the int32 positions ``pos`` of a :class:`RunLookup`: elementwise
    arithmetic and ``probes + 3`` lookups in small tables."""
    nb, ns = lookup.blocks.shape[1], lookup.segments.shape[2]
    blocks, segments = jnp.asarray(lookup.blocks.reshape(-1)), jnp.asarray(lookup.segments.reshape(-1))
    take = functools.partial(jnp.take, mode="clip")  # every index is in bounds
    r0 = take(blocks, k * nb + (pos >> lookup.shift)) + k * (3 * ns)
    r = r0
    for u in range(1, lookup.probes + 1):
        r = r + (pos >= take(segments, r0 + u)).astype(jnp.int32)
    return take(segments, r + ns) + pos * take(segments, r + 2 * ns)


_CHUNK = 1 << 16  # least positions per step of run_indices


def run_indices(lookup: RunLookup, k: jax.Array, n: int, after: jax.Array) -> jax.Array:
    """Device ``k``'s ``(n,)`` int32 indices of the positions ``0 .. n - 1`` of a run table.

    A loop over chunks of at least ``_CHUNK`` positions (at most 32 steps) writing into one index array:
    whatever XLA fuses, the temporaries are one chunk. The array starts from ``after`` (any value, every
    entry is overwritten) so that it cannot be computed, and held, before the data it indexes exists.
    """
    tie = jnp.real(jnp.ravel(after)[0]) if after.size else 0  # real: a complex tie would warn on the int cast
    init = jnp.broadcast_to(jax.lax.convert_element_type(tie, jnp.int32), (n,))
    if n == 0:
        return init
    chunk = min(n, max(_CHUNK, -(-n // 32)))

    def step(i, out):
        at = jnp.minimum(i * chunk, n - chunk)  # the last chunk overlaps the one before
        idx = expand_runs(lookup, k, at + jax.lax.iota(jnp.int32, chunk))
        return jax.lax.dynamic_update_slice(out, idx, (at,))

    return jax.lax.fori_loop(0, -(-n // chunk), step, init)


def run_gather(
    lookup: RunLookup,
    k: jax.Array,
    start: int,
    n: int,
    sources: Sequence[jax.Array],
    dtype: Any,
    *,
    after: jax.Array | bool | None = None,
) -> jax.Array:
    """``concatenate(sources + [0])[indices]`` for device ``k``'s positions ``start .. start + n - 1`` of a run
    table, without building the concatenation or the index array.

    A loop over chunks (as :func:`run_indices`) that expands one chunk of indices and picks each element from
    the source its index falls in: the temporaries are one chunk, and the sources are read where they lie (a
    concatenation of them would be one more copy of everything). Indices past the last source (the sentinel)
    give zero.

    Args:
      lookup: the run table.
      k: the device.
      start, n: the positions.
      sources: 1-D arrays, the index space in order.
      dtype: the result's dtype (the sources are cast to it).
      after: the result's buffer is seeded from this array's first element (default: the last source's), so
        that it is allocated only once that exists; ``False``: from zeros (no dependency). Seed from an
        array that is not an element-wise expression XLA can fuse through, or the seed's read keeps that
        expression's own inputs alive.

    Returns:
      ``(n,)`` of ``dtype``.
    """
    sources = [jnp.ravel(x) for x in sources if x.size]
    offsets = np.cumsum([0] + [x.size for x in sources]).tolist()
    if n == 0 or not sources:
        return jnp.zeros((n,), dtype)
    # The loop's buffer starts from a seed's first element (every entry is overwritten) so that it cannot be
    # allocated before that exists; and the loop takes at least two steps, so that XLA keeps it a loop (a
    # one-step loop is inlined and fused with the sources' producers, which then keep their own inputs alive
    # instead of the sources).
    seed = sources[-1] if after is None else after
    if seed is False or not seed.size:
        out = jnp.zeros((n,), dtype)
    else:
        out = jnp.broadcast_to(jnp.real(jnp.ravel(seed)[0]).astype(dtype), (n,))
    chunk = min(max(_CHUNK, -(-n // 32)), max(-(-n // 2), 1))

    def step(i, out):
        at = jnp.minimum(i * chunk, n - chunk)  # the last chunk overlaps the one before
        idx = expand_runs(lookup, k, start + at + jax.lax.iota(jnp.int32, chunk))
        val = jnp.zeros((chunk,), dtype)
        for x, lo, hi in zip(sources, offsets[:-1], offsets[1:], strict=True):
            hit = (idx >= lo) & (idx < hi)
            val = jnp.where(hit, jnp.take(x, idx - lo, mode="clip").astype(dtype), val)
        return jax.lax.dynamic_update_slice(out, val, (at,))

    return jax.lax.fori_loop(0, -(-n // chunk), step, out)
