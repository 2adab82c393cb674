"""The planner's result: one flat bucket buffer of ``m·S`` elements, where each tensor lies and who owns it.

:class:`BucketLayout` holds the tensors' sizes, blocks (or segments), offsets and the shard size ``S``, and
derives from them each tensor's :class:`~vescale_jax.RaggedShard`, its offsets inside each device's shard, the
padding and the load per device; :meth:`BucketLayout.check` asserts the invariants of DESIGN.md §3.
:func:`allowed_cut` is the rule for a segmented tensor: a cut must lie on the grid of the segment holding it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from vescale_jax.layout._ragged import RaggedShard

__all__ = ["BucketLayout", "allowed_cut"]


def allowed_cut(segs: tuple[tuple[int, int], ...], d: int) -> bool:
    """Whether a cut ``d`` elements into a segmented tensor lies on the grid of the segment holding it."""
    start = 0
    for size, block in segs:
        if d <= start + size:
            return (d - start) % block == 0
        start += size
    return d == start


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
        return d % self.blocks[i] == 0 if segs is None else allowed_cut(segs, d)

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
