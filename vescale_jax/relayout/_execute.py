"""Running a relayout inside ``shard_map``: pack per destination, move, unpack.

A :class:`~vescale_jax.relayout._moves.Moves` is executed by one of two strategies, both reading from one flat
local buffer (with any leading batch dims) and writing into another:

* :func:`all_to_all`: every device packs one message per destination (its runs back to back), one all-to-all
  padded to the largest message (``Moves.width``; XLA:CPU has no ragged all-to-all) moves them all, and every
  device unpacks what arrived. Pack and unpack are gathers through per-device periodic run tables
  (:mod:`vescale_jax.relayout._runs`: ``O(runs)`` constants, never ``O(elements)``, a pair's strided rows
  being one run); unpacking gathers over the window of destination positions the device writes. Pieces that
  stay on their device travel too.
* :func:`permute_rounds`: the device pairs that exchange data are edge-coloured into rounds in which every
  device sends to at most one device and receives from at most one; each round is one collective-permute whose
  message packs all of a pair's runs and is sized by the round's heaviest pair; runs that stay on their device
  are copied locally. Cheaper than a padded all-to-all when pieces barely move (that sizes every message by the
  largest pair: ``m`` times a device's piece).

All functions must be called inside ``shard_map`` (or any context where ``axis`` is bound); device ``k`` selects
its row of the static tables with ``lax.axis_index``. They are differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.relayout import _runs as runs
from vescale_jax.relayout._moves import Moves

__all__ = ["all_to_all", "exchange_messages", "permute_rounds", "rounds", "tables"]


class Tables:
    """Static tables of :func:`all_to_all` for one ``Moves`` and destination size (NumPy, built once).

    Attributes:
      width: ``W``, elements per message.
      pack: :mod:`~vescale_jax.relayout._runs` table over the ``m * W`` message positions ``(destination, w)``:
        source offsets.
      window: ``(m,)`` where each device's written window of the destination starts; ``span`` its length.
      unpack: a run table over the window's positions: indices into what arrived, ``(source, w)``.

    The runs of one device pair are compressed in message order, so a pair whose runs are a fixed stride apart
    on either side (a block column of every row) is one periodic run.
    """

    def __init__(self, moves: Moves, size: int):
        m, w = moves.num_devices, moves.width
        mo = moves.message_offset()
        pair = moves.src * m + moves.dst
        self.width = w
        self.pack = runs.compress(moves.src, pair, moves.dst * w + mo, moves.src_offset, moves.length, m)
        lo = np.full(m, size, np.int64)
        hi = np.zeros(m, np.int64)
        np.minimum.at(lo, moves.dst, moves.dst_offset)
        np.maximum.at(hi, moves.dst, moves.dst_offset + moves.length)
        self.span = int(max((hi - lo).max(initial=0), 0))
        # Static window starts that never make a dynamic slice of ``span`` clamp.
        self.window = np.clip(np.minimum(lo, size - self.span), 0, None)
        at = moves.dst_offset - self.window[moves.dst]
        self.unpack = runs.compress(moves.dst, pair, at, moves.src * w + mo, moves.length, m)


def tables(moves: Moves, size: int) -> Tables:
    """The static tables :func:`all_to_all` bakes in (for inspection and tests)."""
    return Tables(moves, size)


def all_to_all(x: jax.Array, moves: Moves, *, axis: Any, size: int, out: jax.Array | None = None) -> jax.Array:
    """Runs ``moves`` by one padded all-to-all.

    Args:
      x: ``(..., N)`` this device's source buffer (the moves' source offsets index its last axis).
      moves: the runs.
      axis: the mesh axis (or axes) of the devices, ``moves.num_devices`` of them.
      size: the destination buffer's length.
      out: ``(..., size)`` values of the destination positions no run writes (default zero); only the window
        of positions this device's runs write is read and rewritten.

    Returns:
      ``(..., size)`` this device's destination buffer.

    Sharding:
      One all-to-all of ``(..., m, moves.width)`` elements per device.
    """
    m, t = moves.num_devices, Tables(moves, size)
    w = t.width
    k = jax.lax.axis_index(axis)
    lead = x.shape[:-1]
    idx, ok = runs.lookup(t.pack, k, m * w)
    if x.shape[-1]:
        rows = jnp.where(ok, jnp.take(x, idx, axis=-1, mode="clip"), jnp.zeros((), x.dtype))
    else:
        rows = jnp.zeros((*lead, m * w), x.dtype)
    received = jax.lax.all_to_all(jnp.reshape(rows, (*lead, m, w)), axis, len(lead), len(lead))  # [.., s, :]: from s
    received = jnp.reshape(received, (*lead, m * w))
    whole = out is None and t.span in (0, size)  # every device writes from 0 into zeros: no window to keep
    if out is None and not whole:
        out = jnp.zeros((*lead, size), x.dtype)
    dtype = x.dtype if out is None else out.dtype
    if not t.span:
        return jnp.zeros((*lead, size), dtype) if out is None else out
    idx, ok = runs.lookup(t.unpack, k, t.span)
    got = jnp.take(received, idx, axis=-1, mode="clip").astype(dtype)
    if whole:
        return jnp.where(ok, got, jnp.zeros((), dtype))
    start = jnp.asarray(t.window.astype(np.int32))[k]
    window = jax.lax.dynamic_slice_in_dim(out, start, t.span, axis=-1)
    return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(ok, got, window), start, axis=-1)


def exchange_messages(messages: Sequence[jax.Array], *, axis: Any) -> list[jax.Array]:
    """The move step of :func:`all_to_all` for a caller that packs its own messages (e.g. from its own run
    tables, chunk by chunk): message ``d`` goes to device ``d``, all by one padded all-to-all.

    Args:
      messages: ``m`` arrays ``(W,)``, one per destination.
      axis: the mesh axis (or axes) of the ``m`` devices.

    Returns:
      ``m`` arrays ``(W,)``: what each source device sent this one.
    """
    got = jax.lax.all_to_all(jnp.stack(list(messages)), axis, 0, 0, tiled=False)
    return [got[d] for d in range(len(messages))]


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
    m = moves.num_devices
    # A local column every device copies at its full width needs no mask and never clamps (its runs lie inside
    # both buffers); the others are masked, and the buffers padded so that a full-width slice never clamps.
    exact = [_exact_columns(pairs, send, recv, widths, m) for pairs, send, recv, widths, _ in schedule]
    loose = [
        w for (*_, widths, _), ex in zip(schedule, exact, strict=True) for w, e in zip(widths, ex, strict=True) if not e
    ]
    most = max([*loose, 0])
    size = out.shape[0]
    if most:
        x = jnp.pad(x, (0, most))
        out = jnp.pad(out, (0, most))  # writes of a full width never clamp

    def put(buf, v, at, n, w, exact=False):
        if exact:
            return jax.lax.dynamic_update_slice(buf, v.astype(buf.dtype), (at,))
        keep = jax.lax.dynamic_slice(buf, (at,), (w,))
        return jax.lax.dynamic_update_slice(buf, jnp.where(jnp.arange(w) < n, v.astype(buf.dtype), keep), (at,))

    for (pairs, send, recv, widths, width), ex in zip(schedule, exact, strict=True):
        send, recv = jnp.asarray(send.astype(np.int32))[:, k], jnp.asarray(recv.astype(np.int32))[:, k]
        if all(s == d for s, d in pairs):  # pieces that stay: copied straight from x to out
            for i, w in enumerate(widths):
                if w:
                    piece = jax.lax.dynamic_slice(x, (send[0, i],), (w,))
                    out = put(out, piece, recv[1, i], recv[3, i], w, ex[i])
            continue
        msg = jnp.zeros((max(width, sum(widths)),), x.dtype)  # segment i ends before sum(widths[:i + 1])
        for i, w in enumerate(widths):
            if w:
                msg = put(msg, jax.lax.dynamic_slice(x, (send[0, i],), (w,)), send[2, i], send[3, i], w)
        msg = jax.lax.ppermute(msg, axis, list(pairs))
        for i, w in enumerate(widths):
            if w:
                out = put(out, jax.lax.dynamic_slice(msg, (recv[2, i],), (w,)), recv[1, i], recv[3, i], w)
    return out[:size] if most else out


def _exact_columns(pairs, send: np.ndarray, recv: np.ndarray, widths, m: int) -> list[bool]:
    """Per segment column of a local round: whether all ``m`` devices copy a run of the column's full width."""
    if len(pairs) != m or not all(s == d for s, d in pairs):
        return [False] * len(widths)
    return [bool(w) and bool((send[3, :, i] == w).all() and (recv[3, :, i] == w).all()) for i, w in enumerate(widths)]
