"""Periodic run tables: a relayout's position -> index mappings in ``O(runs)`` integers, whatever the sizes.

A *run* maps ``count`` pieces of ``piece`` consecutive positions, ``pos_step`` apart from ``start``, to ``count``
pieces of consecutive indices ``val_step`` apart from ``value``: position ``start + c * pos_step + j``
(``c < count``, ``j < piece``) maps to ``value + c * val_step + j``. The block column of every row of a matrix
that one device sends another is then one run instead of one per row; runs of different pairs may interleave.
A table is ``(m, 6, R)`` int32 ``(start, value, piece, count, pos_step, val_step)`` per device, padded to the
most runs ``R`` of any device with empty runs starting at ``2**31 - 1``.

:func:`compress` builds a table from runs listed per group (e.g. per device pair, in message order), vectorised
and greedy: a run continues the one before in its group while it has the same length and both steps stay the
same. :func:`lookup` expands device ``k``'s positions inside ``shard_map``: one select per run for a few runs,
the block index of :mod:`._run_lookup` for many (:func:`strided`: the table as strided runs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.relayout._run_lookup import RunLookup, expand_runs

__all__ = ["NO_RUN", "compress", "expand", "lookup", "strided"]

NO_RUN = np.iinfo(np.int32).max  # start of the padding runs (after every position)
_I64 = np.int64
_UNROLLED = 48  # most runs per device looked up by one select each (fused, no position-sized temporaries)
_BLOCK_SEGMENTS = 1 << 16  # most strided runs (and blocks) per device of a block-index lookup (else a loop)


def compress(
    key: np.ndarray, group: np.ndarray, pos: np.ndarray, value: np.ndarray, length: np.ndarray, m: int
) -> np.ndarray:
    """The ``(m, 6, R)`` table of runs (positions ``pos .. pos + length - 1`` of device ``key`` map to
    ``value ..``), runs of one device not overlapping in positions.

    Args:
      key: ``(n,)`` the device of each run.
      group: ``(n,)`` runs of one group (in the listed order) may merge into a periodic run.
      pos, value, length: ``(n,)`` the runs.
      m: devices.

    Returns:
      The table (see the module docstring).
    """
    key, group, pos, value, length = (np.asarray(x, _I64).reshape(-1) for x in (key, group, pos, value, length))
    keep = length > 0
    key, group, pos, value, length = key[keep], group[keep], pos[keep], value[keep], length[keep]
    order = np.lexsort((np.arange(key.size), group, key))  # stable: the listed order inside a group
    key, group, pos, value, length = key[order], group[order], pos[order], value[order], length[order]
    n = key.size
    if n == 0:
        out = np.zeros((m, 6, 1), _I64)
        out[:, 0], out[:, 2], out[:, 4], out[:, 5] = NO_RUN, 1, 1, 1
        return out.astype(np.int32)
    brk = np.ones(n, bool)  # i cannot continue i - 1's run
    brk[1:] = (key[1:] != key[:-1]) | (group[1:] != group[:-1]) | (length[1:] != length[:-1])
    dpos, dval = pos[1:] - pos[:-1], value[1:] - value[:-1]
    brk[1:] |= dpos < length[:-1]  # pieces of a run never overlap
    c = brk.copy()  # ... or its steps differ from those into i - 1
    c[2:] |= (dpos[1:] != dpos[:-1]) | (dval[1:] != dval[:-1])
    # start[i] = brk[i] or (c[i] and not start[i - 1]) (a one-piece run takes any steps): in a stretch of
    # consecutive c entries the starts alternate from the stretch's first entry (or a brk).
    first = c.copy()
    first[1:] &= brk[1:] | ~c[:-1]
    i = np.arange(n, dtype=_I64)
    origin = np.where(first, i, 0)
    np.maximum.accumulate(origin, out=origin)
    s = np.flatnonzero(c & ((i - origin) & 1 == 0))
    count = np.diff(np.append(s, n))
    nxt = np.minimum(s, n - 2)
    pstep = np.where(count > 1, dpos[nxt], 0) if n > 1 else np.zeros(1, _I64)
    vstep = np.where(count > 1, dval[nxt], 0) if n > 1 else np.zeros(1, _I64)
    piece = length[s]
    plain = (count > 1) & (pstep == piece) & (vstep == piece)  # back to back on both sides: one plain run
    piece, count = np.where(plain, piece * count, piece), np.where(plain, 1, count)
    # A one-piece run steps by its piece (so the lookup needs no special case; no second piece is read).
    pstep, vstep = np.where(count > 1, pstep, piece), np.where(count > 1, vstep, piece)
    k = key[s]
    cols = np.stack([pos[s], value[s], piece, count, pstep, vstep])
    counts = np.bincount(k, minlength=m)
    r = max(int(counts.max()), 1)
    by = np.lexsort((cols[0], k))
    k, cols = k[by], cols[:, by]
    slot = np.arange(k.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.zeros((m, 6, r), _I64)
    out[:, 0], out[:, 2], out[:, 4], out[:, 5] = NO_RUN, 1, 1, 1  # empty runs: count 0
    out[k, :, slot] = cols.T
    real = out[:, 0] < NO_RUN
    span = lambda start, step: start + step * np.maximum(out[:, 3] - 1, 0) + out[:, 2]
    if (out[:, 1][real] < 0).any() or max(
        span(out[:, 0], out[:, 4])[real].max(initial=0), span(out[:, 1], out[:, 5])[real].max(initial=0)
    ) >= NO_RUN:
        raise ValueError("relayout: offsets exceed int32")
    return out.astype(np.int32)


def expand(table: np.ndarray, n: int, sentinel: int) -> np.ndarray:
    """The ``(m, n)`` indices of positions ``0 .. n - 1`` (NumPy; what :func:`lookup` computes), ``sentinel``
    where no run covers a position."""
    out = np.full((table.shape[0], n), sentinel, _I64)
    for k, row in enumerate(table.astype(_I64)):
        for start, value, piece, count, pstep, vstep in row.T:
            if start >= NO_RUN:
                continue
            for c in range(count):
                lo = start + c * pstep
                hi = min(lo + piece, n)
                if hi > lo:
                    out[k, lo:hi] = value + c * vstep + np.arange(hi - lo)
    return out


def strided(table: np.ndarray, *, most: int | None = None) -> np.ndarray | None:
    """The same mapping as a strided run table ``(m, 4, S)`` ``(start, value, stride, length)`` (see
    :mod:`._run_lookup`): a one-piece run, or one of single positions back to back, is one strided run; any
    other periodic run is one per piece.

    Args:
      table: ``(m, 6, R)`` (see the module docstring).
      most: if given, ``None`` instead of a table with more than ``most`` strided runs on some device (decided
        before building it).

    Returns:
      ``(m, 4, S)`` int32, sorted by ``start`` and padded with runs starting at ``NO_RUN``.
    """
    m = table.shape[0]
    k, r = np.nonzero(table[:, 0] < NO_RUN)
    start, value, piece, count, pstep, vstep = (table[k, c, r].astype(_I64) for c in range(6))
    one = (count == 1) | ((piece == 1) & (pstep == 1))  # a single strided run
    reps = np.where(one, 1, count)
    if most is not None and np.bincount(k, weights=reps, minlength=m).max(initial=0) > most:
        return None
    c = np.arange(int(reps.sum()), dtype=_I64) - np.repeat(np.cumsum(reps) - reps, reps)
    k, start, value, piece, count, pstep, vstep, one = (
        np.repeat(x, reps) for x in (k, start, value, piece, count, pstep, vstep, one)
    )
    cols = np.stack(
        [
            start + c * pstep,
            value + c * vstep,
            np.where(one & (count > 1), vstep, 1),
            np.where(one & (count > 1), count, piece),
        ]
    )
    by = np.lexsort((cols[0], k))
    k, cols = k[by], cols[:, by]
    counts = np.bincount(k, minlength=m)
    slot = np.arange(k.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.zeros((m, 4, max(int(counts.max(initial=0)), 1)), _I64)
    out[:, 0] = NO_RUN
    out[k, :, slot] = cols.T
    return out.astype(np.int32)


def lookup(table: np.ndarray, k: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """Device ``k``'s ``(n,)`` int32 indices of positions ``0 .. n - 1``, and whether a run covers each.

    Up to ``_UNROLLED`` runs, every run is one select over the positions with scalar operands; past that, the
    block index of :class:`~vescale_jax.relayout._run_lookup.RunLookup` over :func:`strided` runs (``probes + 3``
    small-table lookups per position, whatever the runs), or a loop of selects when that would hold more than
    ``_BLOCK_SEGMENTS`` strided runs or blocks per device (its constants stay bounded, whatever the sizes).
    Either way XLA fuses the lookup into its consumer: no position-sized index temporaries beyond the result.
    """
    runs = table.shape[2]
    real = table[:, 0] < NO_RUN
    p = jnp.arange(n, dtype=jnp.int32)

    def one(j, carry, row, kind):
        idx, ok = carry
        start, value, piece, count, pstep, vstep = (row[c] for c in range(6))
        i = p - start
        if kind == "plain":
            hit, val = (i >= 0) & (i < piece), value + i
        else:  # one truncating division (fusible when its result has one use) for the piece
            i0 = jnp.maximum(i, 0)
            c = jax.lax.div(i0, pstep)
            if kind == "contiguous":  # pieces back to back in positions: the mask needs no division
                hit, val = (i >= 0) & (i < piece * count), value + i0 + c * (vstep - pstep)
            else:
                j0 = i0 - c * pstep
                hit, val = (i >= 0) & (c < count) & (j0 < piece), value + c * vstep + j0
        return jnp.where(hit, val, idx), ok | hit

    def kind(cols: np.ndarray) -> str:
        live = cols[0] < NO_RUN
        if (cols[3][live] <= 1).all():
            return "plain"
        return "contiguous" if (cols[4] == cols[2])[live].all() else "strided"

    rows = jnp.asarray(table)[k]  # (6, R)
    carry = (jnp.zeros((n,), jnp.int32), jnp.zeros((n,), bool))
    if runs <= _UNROLLED:
        for j in range(runs):
            if real[:, j].any():
                carry = one(j, carry, rows[:, j], kind(table[:, :, j].T))
        return carry
    segments = strided(table, most=_BLOCK_SEGMENTS)
    block = None if segments is None else RunLookup.build(segments, n, -1)
    if block is not None and block.blocks.shape[1] <= _BLOCK_SEGMENTS:
        idx = expand_runs(block, k, p)  # -1: no run (every real index is >= 0)
        ok = idx >= 0
        return jnp.where(ok, idx, 0), ok
    every = kind(np.moveaxis(table, 1, 0).reshape(6, -1))
    return jax.lax.fori_loop(0, runs, lambda j, c: one(j, c, rows[:, j], every), carry)
