"""Running a relayout inside ``shard_map``: pack per destination, move, unpack.

A :class:`~vescale_jax.relayout._moves.Moves` is executed by one of two strategies, both reading from one flat
local buffer (with any leading batch dims) and writing into another:

* :func:`all_to_all`: every device packs one message per destination (its runs back to back), one all-to-all
  padded to the largest message (``Moves.width``; XLA:CPU has no ragged all-to-all) moves them all, and every
  device unpacks what arrived. Pack and unpack are gathers through per-device run tables (a ``searchsorted``
  over the runs, ``O(runs)`` constants, never ``O(elements)``). Pieces that stay on their device travel too.
* :func:`permute_rounds`: the device pairs that exchange data are edge-coloured into rounds in which every
  device sends to at most one device and receives from at most one; each round is one collective-permute whose
  message packs all of a pair's runs and is sized by the round's heaviest pair; runs that stay on their device
  are copied locally. Cheaper than a padded all-to-all when pieces barely move (that sizes every message by the
  largest pair: ``m`` times a device's piece).

All functions must be called inside ``shard_map`` (or any context where ``axis`` is bound); device ``k`` selects
its row of the static tables with ``lax.axis_index``. They are differentiable.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.relayout._moves import Moves

__all__ = ["all_to_all", "gather_runs", "permute_rounds", "rounds", "run_table"]

_NO_RUN = np.iinfo(np.int32).max


def run_table(key: np.ndarray, pos: np.ndarray, value: np.ndarray, length: np.ndarray, m: int) -> np.ndarray:
    """``(m, 3, R)`` int32 runs ``(start, value, length)`` per device ``key``, sorted by ``start``, padded with
    runs starting at ``2**31 - 1``: positions ``start + i`` map to indices ``value + i``, ``0 <= i < length``."""
    counts = np.bincount(key, minlength=m) if key.size else np.zeros(m, np.int64)
    r = max(int(counts.max(initial=0)), 1)
    order = np.lexsort((pos, key))
    key, cols = key[order], np.stack([pos, value, length])[:, order]
    slot = np.arange(key.size) - np.repeat(np.cumsum(counts) - counts, counts)
    out = np.zeros((m, 3, r), np.int64)
    out[:, 0] = _NO_RUN
    out[key, :, slot] = cols.T
    if max(np.abs(out[:, 1:]).max(initial=0), (out[:, 0] + out[:, 2])[out[:, 0] < _NO_RUN].max(initial=0)) >= _NO_RUN:
        raise ValueError("relayout: offsets exceed int32")
    return out.astype(np.int32)


def gather_runs(x: jax.Array, table: np.ndarray, k: jax.Array, n: int, fill: Any = None) -> jax.Array:
    """Device ``k``'s positions ``0 .. n - 1`` of a :func:`run_table` gathered from ``x`` (last axis).

    Args:
      x: ``(..., N)`` the indexed buffer.
      table: ``(m, 3, R)`` from :func:`run_table`.
      k: this device.
      n: positions.
      fill: ``(..., n)`` values of the positions no run covers (default zero).

    Returns:
      ``(..., n)``.
    """
    starts, values, lengths = (jnp.asarray(table[:, i])[k] for i in range(3))
    pos = jnp.arange(n, dtype=jnp.int32)
    r = jnp.clip(jnp.searchsorted(starts, pos, side="right") - 1, 0, table.shape[2] - 1)
    off = pos - starts[r]
    ok = (off >= 0) & (off < lengths[r])
    idx = jnp.where(ok, values[r] + off, 0)
    if x.shape[-1] == 0:
        val = jnp.zeros((*x.shape[:-1], n), x.dtype)
    else:
        val = jnp.take(x, jnp.clip(idx, 0, x.shape[-1] - 1), axis=-1)
    return jnp.where(ok, val, jnp.zeros((), x.dtype) if fill is None else fill)


def all_to_all(x: jax.Array, moves: Moves, *, axis: Any, size: int, out: jax.Array | None = None) -> jax.Array:
    """Runs ``moves`` by one padded all-to-all.

    Args:
      x: ``(..., N)`` this device's source buffer (the moves' source offsets index its last axis).
      moves: the runs.
      axis: the mesh axis (or axes) of the devices, ``moves.num_devices`` of them.
      size: the destination buffer's length.
      out: ``(..., size)`` values of the destination positions no run writes (default zero).

    Returns:
      ``(..., size)`` this device's destination buffer.

    Sharding:
      One all-to-all of ``(..., m, moves.width)`` elements per device.
    """
    m, w = moves.num_devices, moves.width
    k = jax.lax.axis_index(axis)
    mo = moves.message_offset()
    pack = run_table(moves.src, moves.dst * w + mo, moves.src_offset, moves.length, m)
    unpack = run_table(moves.dst, moves.dst_offset, moves.src * w + mo, moves.length, m)
    lead = x.shape[:-1]
    rows = jnp.reshape(gather_runs(x, pack, k, m * w), (*lead, m, w))
    received = jax.lax.all_to_all(rows, axis, len(lead), len(lead))  # [..., s, :] came from device s
    return gather_runs(jnp.reshape(received, (*lead, m * w)), unpack, k, size, out)


def rounds(moves: Moves) -> list[tuple[Any, ...]]:
    """Static schedule of :func:`permute_rounds`: per round, its ``(sender, receiver)`` pairs, per-device segment
    tables ``(4, m, count)`` as sender (source offset, -, message offset, length) and as receiver (-, destination
    offset, message offset, length), the widths of the segment columns and the message size. Round 0 holds the
    local pairs; the others are the edge colours of the traffic graph, heaviest pair first."""
    m = moves.num_devices
    segments = moves.segments()
    weight = {pair: sum(n for *_, n in segs) for pair, segs in segments.items()}
    pairs_of: list[list[tuple[int, int]]] = [[(k, k) for k in range(m) if (k, k) in segments]]
    busy: list[tuple[set[int], set[int]]] = []
    for pair in sorted((p for p in segments if p[0] != p[1]), key=lambda p: (-weight[p], p)):
        j = next((j for j, (snd, rcv) in enumerate(busy) if pair[0] not in snd and pair[1] not in rcv), len(busy))
        if j == len(busy):
            busy.append((set(), set()))
            pairs_of.append([])
        busy[j][0].add(pair[0])
        busy[j][1].add(pair[1])
        pairs_of[j + 1].append(pair)
    out = []
    for pairs in pairs_of:
        if not pairs:
            continue
        count = max(len(segments[p]) for p in pairs)
        send = np.zeros((4, m, count), np.int64)
        recv = np.zeros((4, m, count), np.int64)
        for s, d in pairs:
            cursor = 0
            for i, (so, do, n) in enumerate(sorted(segments[s, d], key=lambda x: -x[2])):
                send[:, s, i] = (so, 0, cursor, n)
                recv[:, d, i] = (0, do, cursor, n)
                cursor += n
        widths = np.maximum(send[3].max(axis=0), recv[3].max(axis=0))
        size = int(max(weight[p] for p in pairs))
        out.append((tuple(pairs), send, recv, tuple(int(w) for w in widths), size))
    return out


def permute_rounds(x: jax.Array, out: jax.Array, moves: Moves, *, axis: Any) -> jax.Array:
    """Runs ``moves`` by collective-permute rounds (:func:`rounds`), reading ``x`` and writing ``out`` in place.

    Args:
      x: ``(N,)`` this device's source buffer.
      out: ``(size,)`` its destination buffer; positions no run writes keep their values.
      moves: the runs.
      axis: the mesh axis (or axes) of the devices.

    Returns:
      ``out`` with every run written.

    Sharding:
      One collective-permute per round but the local one, of the round's heaviest pair's elements.
    """
    k = jax.lax.axis_index(axis)
    schedule = rounds(moves)
    most = max([max(w) for *_, w, _ in schedule if w] + [0])
    x = jnp.pad(x, (0, most))
    size = out.shape[0]
    out = jnp.pad(out, (0, most))  # writes of a full width never clamp

    def put(buf, v, at, n, w):
        keep = jax.lax.dynamic_slice(buf, (at,), (w,))
        return jax.lax.dynamic_update_slice(buf, jnp.where(jnp.arange(w) < n, v.astype(buf.dtype), keep), (at,))

    for pairs, send, recv, widths, width in schedule:
        send, recv = jnp.asarray(send.astype(np.int32))[:, k], jnp.asarray(recv.astype(np.int32))[:, k]
        if all(s == d for s, d in pairs):  # pieces that stay: copied straight from x to out
            for i, w in enumerate(widths):
                if w:
                    out = put(out, jax.lax.dynamic_slice(x, (send[0, i],), (w,)), recv[1, i], recv[3, i], w)
            continue
        msg = jnp.zeros((max(width, sum(widths)),), x.dtype)  # segment i ends before sum(widths[:i + 1])
        for i, w in enumerate(widths):
            if w:
                msg = put(msg, jax.lax.dynamic_slice(x, (send[0, i],), (w,)), send[2, i], send[3, i], w)
        msg = jax.lax.ppermute(msg, axis, list(pairs))
        for i, w in enumerate(widths):
            if w:
                out = put(out, jax.lax.dynamic_slice(msg, (recv[2, i],), (w,)), recv[1, i], recv[3, i], w)
    return out[:size]
