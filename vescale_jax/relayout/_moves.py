"""Planning a relayout: the moves of ragged ranges between two placements (pure NumPy).

A :class:`Placement` says, per device, which element ranges of which tensor it holds and where: a list of
*pieces* ``(device, key, start, length, offset)``, piece ``i`` holding flat elements ``[start, start + length)``
of tensor ``key`` (a tensor, or one layer of a stacked one: the caller numbers them) at local offsets
``[offset, offset + length)`` of that device's flat buffer. :func:`plan_moves` intersects a source and a
destination placement into one :class:`Moves`: per ``(source device, destination device)`` pair, runs
``(source offset, destination offset, length)``, a run being contiguous on both sides (so the tables are
``O(pieces)``, never ``O(elements)``). The executors (:mod:`vescale_jax.relayout._execute`) run a ``Moves``
inside ``shard_map``.

Everything is vectorised: planning is a sort and two ``searchsorted`` over the pieces, whatever the tensors'
sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from vescale_jax.layout._ragged import RaggedShard

__all__ = ["Moves", "Placement", "plan_moves"]

_I64 = np.int64


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Which element ranges of which tensors each device holds, and at which local offsets.

    Attributes:
      num_devices: ``m``.
      device, key, start, length, offset: ``(P,)`` int64 per piece (zero-length pieces are dropped).

    Sharding:
      Device ``device[i]``'s flat local buffer holds elements ``[start[i], start[i] + length[i])`` of tensor
      ``key[i]`` at ``[offset[i], offset[i] + length[i])``. Pieces of one key may overlap across devices
      (replicas); :func:`plan_moves` then reads each element from one of them.
    """

    num_devices: int
    device: np.ndarray
    key: np.ndarray
    start: np.ndarray
    length: np.ndarray
    offset: np.ndarray

    @classmethod
    def of(cls, num_devices: int, device, key, start, length, offset) -> Placement:
        """A placement from per-piece columns (scalars broadcast); zero-length pieces are dropped.

        Args:
          num_devices: ``m``.
          device, key, start, length, offset: per piece (see the class docstring).

        Returns:
          The :class:`Placement`.
        """
        given = [np.asarray(x, _I64) for x in (device, key, start, length, offset)]
        n = max([x.size for x in given if x.ndim] or [1])  # scalars broadcast
        cols = [np.full(n, int(x)) if not x.ndim else x.reshape(-1) for x in given]
        if len({c.size for c in cols}) != 1:
            raise ValueError(f"Placement.of: columns of different lengths {[c.size for c in cols]}.")
        if (cols[3] < 0).any():
            raise ValueError("Placement.of: a negative length.")
        keep = cols[3] > 0  # zero-length pieces are dropped first: their offsets mean nothing
        device, key, start, length, offset = (c[keep] for c in cols)
        if (start < 0).any() or (offset < 0).any():
            raise ValueError("Placement.of: a negative start or offset.")
        if ((device < 0) | (device >= num_devices)).any():
            raise ValueError(f"Placement.of: a device outside [0, {num_devices}).")
        return cls(int(num_devices), device, key, start, length, offset)

    @classmethod
    def ragged(cls, rs: RaggedShard, offsets: np.ndarray | Sequence[int] | None = None, *, key: int = 0) -> Placement:
        """A :class:`RaggedShard` (of ``L`` layers) at per-device local offsets.

        Args:
          rs: the placement of one layer.
          offsets: ``(m,)`` or ``(m, L)``: where device ``k``'s piece of layer ``l`` starts in its buffer
            (default: ``0``, one layer).
          key: the key of layer 0; layer ``l`` is key ``key + l``.

        Returns:
          The :class:`Placement`.
        """
        m = rs.num_devices
        at = np.zeros((m, 1), _I64) if offsets is None else np.asarray(offsets, _I64).reshape(m, -1)
        layers = at.shape[1]
        dev = np.repeat(np.arange(m, dtype=_I64), layers)
        starts = np.repeat(np.asarray(rs.starts, _I64), layers)
        sizes = np.repeat(np.asarray(rs.local_sizes, _I64), layers)
        keys = key + np.tile(np.arange(layers, dtype=_I64), m)
        return cls.of(m, dev, keys, starts, sizes, at.reshape(-1))

    @classmethod
    def concat(cls, parts: Sequence[Placement], num_devices: int | None = None) -> Placement:
        """The pieces of all ``parts`` (same device count) in one placement."""
        m = parts[0].num_devices if parts else num_devices
        if m is None:
            raise ValueError("Placement.concat: no parts and no num_devices.")
        if any(p.num_devices != m for p in parts):
            raise ValueError(f"Placement.concat: parts on {[p.num_devices for p in parts]} devices.")
        names = ("device", "key", "start", "length", "offset")
        cols = [np.concatenate([getattr(p, n) for p in parts]) if parts else np.zeros(0, _I64) for n in names]
        return cls(int(m), *cols)

    def __len__(self) -> int:
        return int(self.device.size)


@dataclasses.dataclass(frozen=True, eq=False)
class Moves:
    """Runs of elements from source devices to destination devices, contiguous on both sides.

    Attributes:
      num_devices: ``m``.
      src, dst: ``(R,)`` the run's sender and receiver.
      src_offset, dst_offset: ``(R,)`` where it starts in the sender's and the receiver's flat buffer.
      length: ``(R,)`` elements (``> 0``).

    Runs are sorted by ``(src, dst, src_offset)``, and runs of one pair that continue each other on both sides
    are merged. A pair's *message* is its runs in that order, back to back (:meth:`message_offset`).
    """

    num_devices: int
    src: np.ndarray
    dst: np.ndarray
    src_offset: np.ndarray
    dst_offset: np.ndarray
    length: np.ndarray

    @classmethod
    def of(cls, num_devices: int, src, dst, src_offset, dst_offset, length) -> Moves:
        """Runs from columns, sorted and merged (zero-length runs dropped)."""
        cols = [np.asarray(x, _I64).reshape(-1) for x in (src, dst, src_offset, dst_offset, length)]
        keep = cols[4] > 0
        src, dst, so, do, n = (c[keep] for c in cols)
        order = np.lexsort((do, so, dst, src))
        src, dst, so, do, n = src[order], dst[order], so[order], do[order], n[order]
        if src.size > 1:  # merge a run into the one before when it continues it on both sides
            cont = np.zeros(src.size, bool)
            cont[1:] = (
                (src[1:] == src[:-1])
                & (dst[1:] == dst[:-1])
                & (so[1:] == so[:-1] + n[:-1])
                & (do[1:] == do[:-1] + n[:-1])
            )
            head = np.flatnonzero(~cont)
            n = np.add.reduceat(n, head)
            src, dst, so, do = src[head], dst[head], so[head], do[head]
        return cls(int(num_devices), src, dst, so, do, n)

    def __len__(self) -> int:
        return int(self.src.size)

    def inverse(self) -> Moves:
        """The moves back: every run from its receiver to its sender."""
        return Moves.of(self.num_devices, self.dst, self.src, self.dst_offset, self.src_offset, self.length)

    def pair_sizes(self) -> np.ndarray:
        """``(m, m)`` elements each source sends each destination."""
        m = self.num_devices
        out = np.zeros(m * m, _I64)
        np.add.at(out, self.src * m + self.dst, self.length)
        return out.reshape(m, m)

    @property
    def width(self) -> int:
        """Elements of the largest message (at least 1): a padded all-to-all's per-pair width."""
        return max(1, int(self.pair_sizes().max(initial=0)))

    def message_offset(self) -> np.ndarray:
        """``(R,)`` where each run starts inside its pair's message."""
        if not len(self):
            return np.zeros(0, _I64)
        pair = self.src * self.num_devices + self.dst
        first = np.r_[True, pair[1:] != pair[:-1]]
        ends = np.cumsum(self.length)
        base = np.maximum.accumulate(np.where(first, ends - self.length, 0))
        return ends - self.length - base

    def segments(self) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
        """Per ``(src, dst)`` pair its runs ``(src offset, dst offset, length)``, in message order."""
        out: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
        for s, d, so, do, n in zip(
            *(c.tolist() for c in (self.src, self.dst, self.src_offset, self.dst_offset, self.length)), strict=True
        ):
            out.setdefault((s, d), []).append((so, do, n))
        return out


def _rank(src: np.ndarray, dst: np.ndarray, m: int) -> np.ndarray:
    """Default preference among replicas: the receiver itself, then the next devices after it."""
    return (src - dst) % m


def plan_moves(
    source: Placement,
    target: Placement,
    *,
    prefer: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
    complete: bool = True,
) -> Moves:
    """The runs that take every element ``target`` wants from where ``source`` holds it.

    Args:
      source: where the elements are.
      target: where they are wanted (pieces of one key may overlap: each gets its own copy).
      prefer: ``(src devices, dst devices) -> rank`` (lower first): which replica serves an element held by
        several source pieces (default: the receiver itself, then the devices after it, cyclically). Resolving
        replicas loops over the target pieces they overlap (in Python); a caller with many replicated pieces
        plans one replica set at a time instead (as the checkpoint's logical conversion does).
      complete: raise if an element ``target`` wants is held by no source piece.

    Returns:
      The :class:`Moves`.
    """
    m = source.num_devices
    if target.num_devices != m:
        raise ValueError(f"plan_moves: source on {m} devices, target on {target.num_devices}.")
    s_end = source.start + source.length
    t_end = target.start + target.length
    span = int(max(s_end.max(initial=0), t_end.max(initial=0))) + 1
    # One sort key per piece (key, position): pieces of a key that start before a target's end and end after
    # its start. Sources sorted by start; with overlapping (replicated) sources ends are not sorted, so the
    # candidates of a target are those starting before its end, from the first that may end after its start.
    order = np.lexsort((source.start, source.key))
    s_key, s_lo, s_hi = source.key[order], source.start[order], s_end[order]
    code = lambda key, pos: key * span + pos
    lo_code = code(s_key, s_lo)
    hi_code = code(s_key, s_hi)
    # Largest end so far (per key): the first candidate is the first source whose running max end > target start.
    run_max = hi_code.copy()
    np.maximum.accumulate(run_max, out=run_max)
    first = np.searchsorted(run_max, code(target.key, target.start), side="right")
    last = np.searchsorted(lo_code, code(target.key, t_end), side="left")
    count = np.maximum(last - first, 0)
    t_idx = np.repeat(np.arange(len(target)), count)
    s_idx = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count) + np.repeat(first, count)
    s_ord = order[s_idx]
    lo = np.maximum(source.start[s_ord], target.start[t_idx])
    hi = np.minimum(s_end[s_ord], t_end[t_idx])
    ok = (hi > lo) & (source.key[s_ord] == target.key[t_idx])
    t_idx, s_ord, lo, hi = t_idx[ok], s_ord[ok], lo[ok], hi[ok]
    # Candidates of one target piece that overlap each other (replicas): keep one source per element.
    by = np.lexsort((lo, t_idx))
    t_idx, s_ord, lo, hi = t_idx[by], s_ord[by], lo[by], hi[by]
    clash = np.zeros(len(target), bool)
    if t_idx.size:
        # running max of hi within a target piece (codes keep pieces apart), compared with the next lo
        span_t = int(hi.max()) + 1
        run = np.maximum.accumulate(t_idx * span_t + hi)
        reach = np.r_[-1, run[:-1]] - t_idx * span_t
        clash[t_idx[lo < reach]] = True
    if clash.any():
        rank = prefer or (lambda a, b: _rank(a, b, m))
        t_idx, s_ord, lo, hi = _deduplicate(source, target, t_idx, s_ord, lo, hi, clash, rank)
    covered = np.bincount(t_idx, weights=hi - lo, minlength=len(target)).astype(_I64)
    if complete and (covered < target.length).any():
        i = int(np.flatnonzero(covered < target.length)[0])
        raise ValueError(
            f"plan_moves: target piece on device {int(target.device[i])} wants elements "
            f"[{int(target.start[i])}, {int(t_end[i])}) of key {int(target.key[i])}, but the source holds only "
            f"{int(covered[i])} of them; give the source placement every element the target wants."
        )
    return Moves.of(
        m,
        source.device[s_ord],
        target.device[t_idx],
        source.offset[s_ord] + lo - source.start[s_ord],
        target.offset[t_idx] + lo - target.start[t_idx],
        hi - lo,
    )


def _deduplicate(source, target, t_idx, s_ord, lo, hi, clash, prefer):
    """Among overlapping candidates of one target piece, each element from the most preferred source."""
    multi = clash[t_idx]
    keep_t, keep_s, keep_lo, keep_hi = [t_idx[~multi]], [s_ord[~multi]], [lo[~multi]], [hi[~multi]]
    t_m, s_m, lo_m, hi_m = t_idx[multi], s_ord[multi], lo[multi], hi[multi]
    rank = np.asarray(prefer(source.device[s_m], target.device[t_m]), _I64)
    for t in np.unique(t_m):
        sel = np.flatnonzero(t_m == t)
        taken: list[tuple[int, int]] = []  # disjoint, sorted
        for j in sel[np.lexsort((s_m[sel], rank[sel]))]:
            pieces = [(int(lo_m[j]), int(hi_m[j]))]
            for a, b in taken:
                pieces = [q for x, y in pieces for q in ((x, min(y, a)), (max(x, b), y)) if q[1] > q[0]]
            for x, y in pieces:
                keep_t.append(np.array([t]))
                keep_s.append(np.array([s_m[j]]))
                keep_lo.append(np.array([x]))
                keep_hi.append(np.array([y]))
            taken = sorted(taken + pieces)
    return tuple(np.concatenate(c).astype(_I64) for c in (keep_t, keep_s, keep_lo, keep_hi))
