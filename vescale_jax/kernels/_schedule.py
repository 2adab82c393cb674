"""Static copy schedules for the ragged pack / unpack kernels (pure Python, no JAX).

A bucket copy is a list of *segments*: contiguous runs ``src[src_start : src_start+length]`` ->
``dst[dst_start : dst_start+length]`` (a zero segment reads nothing and writes zeros). Each segment is covered
by *windows* of one static power-of-two width ``w <= chunk`` (Triton needs power-of-two block shapes):

* ``length // w`` full windows at ``k * w`` (``k`` is dynamic: the program id minus the segment's first id);
* if ``length % w``, one static tail window at ``length - w``, which overlaps the last full window.

Every window lies inside its segment, so no load or store is masked or out of bounds, and the overlap only
writes the same values twice. ``w = min(chunk, largest power of two <= length)``, so a segment of ``n``
elements takes ``ceil(n / w)`` windows. One kernel program copies one window; ``starts[j]`` is the first
program id of segment ``j`` and ``num_programs`` the grid size. With ``min_width`` (Mosaic GPU: a warpgroup's 128
threads), a run shorter than it is one window of its own length (not a power of two), copied element by element.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Schedule", "Segment", "pack_schedule", "unpack_schedule"]

ZERO = -1  # `Segment.src` of a zero-fill segment


@dataclasses.dataclass(frozen=True)
class Segment:
    """One contiguous run copied by ``num_windows`` programs.

    Attributes:
      src: index of the source array (``ZERO``: write zeros).
      src_start: first element read from the (flattened) source.
      dst: index of the destination array.
      dst_start: first element written in the (flattened) destination.
      length: elements in the run (>= 1).
      width: window width, a power of two ``<= length`` (or ``length`` itself, for a run under the schedule's
        ``min_width``).
    """

    src: int
    src_start: int
    dst: int
    dst_start: int
    length: int
    width: int

    @property
    def num_full(self) -> int:
        """Windows at dynamic offsets ``k * width``."""
        return self.length // self.width

    @property
    def has_tail(self) -> bool:
        """Whether a static window at ``length - width`` covers the remainder."""
        return self.length % self.width != 0

    @property
    def num_windows(self) -> int:
        return self.num_full + int(self.has_tail)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The segments of one kernel launch and the first program id of each.

    Attributes:
      segments: in program order.
      starts: ``starts[j]`` is the first program id of segment ``j``; ``starts[-1]`` is the grid size.
    """

    segments: tuple[Segment, ...]
    starts: tuple[int, ...]

    @property
    def num_programs(self) -> int:
        return self.starts[-1]

    def windows(self) -> list[tuple[int, int, int, int, int]]:
        """Every window as ``(src, src_start, dst, dst_start, width)``, in program order (for tests)."""
        out = []
        for s in self.segments:
            for k in range(s.num_windows):
                off = k * s.width if k < s.num_full else s.length - s.width
                src_off = 0 if s.src == ZERO else s.src_start + off
                out.append((s.src, src_off, s.dst, s.dst_start + off, s.width))
        return out


def _width(length: int, chunk: int, min_width: int) -> int:
    if length < min_width:
        return length
    return min(chunk, 1 << (length.bit_length() - 1))


def _check_chunk(chunk: int) -> None:
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= 1, got {chunk}.")


def _schedule(segments: Sequence[tuple[int, int, int, int, int]], chunk: int, min_width: int = 1) -> Schedule:
    _check_chunk(chunk)
    if min_width > chunk:
        raise ValueError(f"min_width={min_width} exceeds chunk={chunk}.")
    segs, starts = [], [0]
    for src, src_start, dst, dst_start, length in segments:
        if length <= 0:
            continue
        seg = Segment(src, src_start, dst, dst_start, length, _width(length, chunk, min_width))
        segs.append(seg)
        starts.append(starts[-1] + seg.num_windows)
    return Schedule(tuple(segs), tuple(starts))


def pack_schedule(
    sizes: Sequence[int],
    offsets: Sequence[int],
    total_size: int,
    *,
    chunk: int,
    zero_fill: bool = True,
    min_width: int = 1,
) -> Schedule:
    """Leaves -> one flat buffer: a segment per non-empty leaf and (with ``zero_fill``) one per padding gap.

    Args:
      sizes: elements of each leaf.
      offsets: where each leaf starts in the buffer (leaves must not overlap).
      total_size: elements in the buffer.
      chunk: the largest window width (a power of two).
      zero_fill: emit zero segments for every element no leaf covers.
      min_width: a run shorter than this is one window of its own length.

    Returns:
      The :class:`Schedule`, segments in buffer order (source ``i`` is leaf ``i``, destination 0 the buffer).
    """
    order = sorted((o, i) for i, (n, o) in enumerate(zip(sizes, offsets, strict=True)) if n)
    runs, cursor = [], 0
    for o, i in order:
        if o < cursor:
            raise ValueError(f"leaf {i} at offset {o} overlaps the previous leaf (ending at {cursor}).")
        if zero_fill and o > cursor:
            runs.append((ZERO, 0, 0, cursor, o - cursor))
        runs.append((i, 0, 0, o, sizes[i]))
        cursor = o + sizes[i]
    if cursor > total_size:
        raise ValueError(f"leaves end at element {cursor}, past the buffer's {total_size} elements.")
    if zero_fill and total_size > cursor:
        runs.append((ZERO, 0, 0, cursor, total_size - cursor))
    return _schedule(runs, chunk, min_width)


def unpack_schedule(sizes: Sequence[int], offsets: Sequence[int], *, chunk: int, min_width: int = 1) -> Schedule:
    """One flat buffer -> leaves: a segment per non-empty leaf (source 0 is the buffer, destination ``i`` leaf i);
    ``min_width`` as in :func:`pack_schedule`."""
    runs = [(0, o, i, 0, n) for i, (n, o) in enumerate(zip(sizes, offsets, strict=True))]
    return _schedule(runs, chunk, min_width)
