"""Moving many ragged tensors between two flat per-device buffers at once (inside ``shard_map``).

Each tensor (of ``L`` layers) is placed by a :class:`~vescale_jax.RaggedShard` on each side. The device pairs
that exchange data are edge-coloured into rounds in which every device sends to at most one device and receives
from at most one; each round is one collective-permute whose message packs all of a pair's pieces and is sized by
the round's heaviest pair. A single padded all-to-all (as :func:`._redistribute.reshard` does for one
tensor) sizes every message by the largest overlap instead: ``m`` times a device's piece when pieces barely move.
XLA:CPU has no ragged all-to-all, and this schedule needs none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.layout._ragged import RaggedShard

__all__ = ["exchange", "schedule"]


def schedule(
    moves: Sequence[tuple[RaggedShard, RaggedShard]], src_at: Sequence[np.ndarray], out_at: Sequence[np.ndarray], m: int
) -> list[tuple[Any, ...]]:
    """Static schedule of :func:`exchange`: per round, its ``(sender, receiver)`` pairs and per-device segment
    tables ``(src offset, dst offset, message offset, length)``, one column per segment index, and widths."""
    segments: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for e, (a, b) in enumerate(moves):
        ov = a.overlap(b)
        for s in range(m):
            for d in range(m):
                lo, hi = ov[s][d]
                if hi <= lo:
                    continue
                for layer in range(src_at[e].shape[1]):
                    segments.setdefault((s, d), []).append(
                        (
                            int(src_at[e][s, layer]) + lo - a.starts[s],
                            int(out_at[e][d, layer]) + lo - b.starts[d],
                            hi - lo,
                        )
                    )
    for pair, segs in segments.items():  # a run contiguous on both sides is one segment (fewer ops)
        merged: list[tuple[int, int, int]] = []
        for so, do, n in sorted(segs):
            if merged and merged[-1][0] + merged[-1][2] == so and merged[-1][1] + merged[-1][2] == do:
                merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)
            else:
                merged.append((so, do, n))
        segments[pair] = merged
    # Edge-colour the (sender, receiver) traffic graph, heaviest first: each colour is a partial permutation, one
    # collective-permute whose message is sized by its heaviest pair (the local pairs form round 0).
    weight = {pair: sum(n for *_, n in segs) for pair, segs in segments.items()}
    rounds: list[list[tuple[int, int]]] = [[(k, k) for k in range(m) if (k, k) in segments]]
    busy: list[tuple[set[int], set[int]]] = []
    for pair in sorted((p for p in segments if p[0] != p[1]), key=lambda p: (-weight[p], p)):
        j = next((j for j, (snd, rcv) in enumerate(busy) if pair[0] not in snd and pair[1] not in rcv), len(busy))
        if j == len(busy):
            busy.append((set(), set()))
            rounds.append([])
        busy[j][0].add(pair[0])
        busy[j][1].add(pair[1])
        rounds[j + 1].append(pair)
    out = []
    for pairs in rounds:
        if not pairs:
            continue
        count = max(len(segments[p]) for p in pairs)
        send = np.zeros((4, m, count), np.int64)  # src offset, -, message offset, length (as sender)
        recv = np.zeros((4, m, count), np.int64)  # -, dst offset, message offset, length (as receiver)
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


def exchange(
    src: jax.Array,
    src_at: Sequence[np.ndarray],
    out: jax.Array,
    out_at: Sequence[np.ndarray],
    moves: Sequence[tuple[RaggedShard, RaggedShard]],
    axis: Any,
    m: int,
) -> jax.Array:
    """Moves many ragged tensors at once between two flat local buffers (inside ``shard_map``).

    Tensor ``e`` has ``L_e`` layers, each placed by ``moves[e][0]`` in ``src`` (device ``k``'s piece of layer
    ``l`` at ``src[src_at[e][k, l]:]``) and wanted as placed by ``moves[e][1]`` in ``out`` (at ``out_at[e][k, l]``).
    The device pairs that exchange data are edge-coloured into rounds in which every device sends to at most one
    device and receives from at most one: each round is one collective-permute of a message that packs all of a
    pair's pieces, sized by the round's heaviest pair (pieces that stay on their device are copied locally).
    Pieces are read from ``src`` and written into ``out`` in place; the other buffers are the messages.

    Returns:
      ``out`` with every tensor's elements at their places.
    """
    k = jax.lax.axis_index(axis)
    rounds = schedule(moves, src_at, out_at, m)
    most = max([max(w) for *_, w, _ in rounds if w] + [0])
    src = jnp.pad(src, (0, most))
    size = out.shape[0]
    out = jnp.pad(out, (0, most))  # writes of a full width never clamp

    def put(buf, x, at, n, w):
        keep = jax.lax.dynamic_slice(buf, (at,), (w,))
        return jax.lax.dynamic_update_slice(buf, jnp.where(jnp.arange(w) < n, x.astype(buf.dtype), keep), (at,))

    for pairs, send, recv, widths, width in rounds:
        send, recv = jnp.asarray(send.astype(np.int32))[:, k], jnp.asarray(recv.astype(np.int32))[:, k]
        if all(s == d for s, d in pairs):  # pieces that stay: copied straight from src to out
            for i, w in enumerate(widths):
                if w:
                    out = put(out, jax.lax.dynamic_slice(src, (send[0, i],), (w,)), recv[1, i], recv[3, i], w)
            continue
        msg = jnp.zeros((max(width, sum(widths)),), src.dtype)  # segment i ends before sum(widths[:i + 1])
        for i, w in enumerate(widths):
            if w:
                msg = put(msg, jax.lax.dynamic_slice(src, (send[0, i],), (w,)), send[2, i], send[3, i], w)
        msg = jax.lax.ppermute(msg, axis, list(pairs))
        for i, w in enumerate(widths):
            if w:
                out = put(out, jax.lax.dynamic_slice(msg, (recv[2, i],), (w,)), recv[1, i], recv[3, i], w)
    return out[:size]
