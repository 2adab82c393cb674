"""RaggedShard: contiguous, block-aligned, possibly uneven placement of one tensor.

A tensor of ``shape`` is flattened row-major and cut into blocks of ``block`` elements (the last block may be
partial). Device ``k`` owns ``units[k]`` consecutive blocks, device ``0`` first, so every device owns one
contiguous element range and no device boundary cuts a block. ``units[k] == 0`` is allowed.

Special cases: element-wise (``block == 1``), row-wise (``block == shape[-1]``), whole tensor on one device
(``block >= size``: exactly one device owns the single block).

This module is pure index math: no JAX arrays, no Flax. The collectives that move data between placements
live in :mod:`vescale_jax.relayout._redistribute`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["RaggedShard"]


def _prod(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


@dataclasses.dataclass(frozen=True)
class RaggedShard:
    """Placement of one tensor as one contiguous, block-aligned range per device.

    Attributes:
      shape: logical shape of the tensor.
      block: elements per block (the atomic unit); the last block may be partial.
      units: number of blocks each device owns, one entry per device, in device order.

    Sharding:
      Device ``k`` owns flat elements ``[starts[k], ends[k])`` of the row-major flattened tensor. Inside
      ``shard_map`` its local piece is a 1-D array of ``max_local_size`` elements whose first
      ``local_sizes[k]`` are valid and the rest are zero (see :mod:`vescale_jax.relayout._redistribute`).
    """

    shape: tuple[int, ...]
    block: int
    units: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "units", tuple(int(u) for u in self.units))
        if any(d < 0 for d in self.shape):
            raise ValueError(f"RaggedShard: negative dimension in shape {self.shape}.")
        if int(self.block) < 1:
            raise ValueError(f"RaggedShard: block must be >= 1, got {self.block} for shape {self.shape}.")
        object.__setattr__(self, "block", int(self.block))
        if not self.units:
            raise ValueError("RaggedShard: units must name at least one device.")
        for k, u in enumerate(self.units):
            if u < 0:
                raise ValueError(f"RaggedShard: units[{k}] = {u} is negative (shape {self.shape}).")
        if sum(self.units) != self.num_blocks:
            raise ValueError(
                f"RaggedShard: units {self.units} sum to {sum(self.units)} blocks, but shape {self.shape} "
                f"with block {self.block} has {self.num_blocks} blocks."
            )

    # ----------------------------------------------------------------- constructors
    @classmethod
    def from_ranges(cls, shape: Sequence[int], block: int, ranges: Sequence[tuple[int, int]]) -> RaggedShard:
        """Builds a placement from per-device ``[start, end)`` element ranges.

        The ranges must tile ``[0, size)`` in device order and start on block boundaries.
        """
        size = _prod(shape)
        units, cursor = [], 0
        for k, (start, end) in enumerate(ranges):
            if start != cursor or end < start:
                raise ValueError(
                    f"RaggedShard.from_ranges: range {k} = [{start}, {end}) does not continue at {cursor}."
                )
            if start % block and start != end:
                raise ValueError(f"RaggedShard.from_ranges: range {k} starts at {start}, inside a block of {block}.")
            if end % block and end != size:
                raise ValueError(f"RaggedShard.from_ranges: range {k} ends at {end}, cutting a block of {block}.")
            units.append(-(-(end - start) // block) if end > start else 0)
            cursor = end
        if cursor != size:
            raise ValueError(f"RaggedShard.from_ranges: ranges cover [0, {cursor}), tensor has {size}.")
        return cls(tuple(shape), block, tuple(units))

    @classmethod
    def even(cls, shape: Sequence[int], num_devices: int, *, block: int = 1) -> RaggedShard:
        """Balanced placement: blocks spread as evenly as possible, earlier devices take the remainder."""
        nb = -(-_prod(shape) // block) if _prod(shape) else 0
        q, r = divmod(nb, num_devices)
        return cls(tuple(shape), block, tuple(q + (k < r) for k in range(num_devices)))

    @classmethod
    def on_device(cls, shape: Sequence[int], num_devices: int, owner: int) -> RaggedShard:
        """Whole tensor on ``owner`` (a one-hot placement)."""
        if not 0 <= owner < num_devices:
            raise ValueError(f"RaggedShard.on_device: owner {owner} not in [0, {num_devices}).")
        size = _prod(shape)
        block = max(size, 1)
        units = [0] * num_devices
        units[owner] = 1 if size else 0
        return cls(tuple(shape), block, tuple(units))

    @classmethod
    def dim0(cls, shape: Sequence[int], num_devices: int) -> RaggedShard:
        """JAX's even dim-0 sharding (``PartitionSpec(axis)``) as a RaggedShard; needs ``shape[0] % m == 0``."""
        if not shape or shape[0] % num_devices:
            raise ValueError(
                f"RaggedShard.dim0: shape {tuple(shape)} has no leading dim divisible by {num_devices} devices; "
                "use RaggedShard.even(...) for an uneven split."
            )
        row = _prod(shape[1:])
        per = shape[0] // num_devices
        return cls(tuple(shape), max(row, 1), tuple([per if row else 0] * num_devices))

    # ------------------------------------------------------------------ derived
    @property
    def size(self) -> int:
        return _prod(self.shape)

    @property
    def num_devices(self) -> int:
        return len(self.units)

    @property
    def num_blocks(self) -> int:
        return -(-self.size // self.block) if self.size else 0

    @property
    def starts(self) -> tuple[int, ...]:
        out, acc = [], 0
        for u in self.units:
            out.append(min(acc * self.block, self.size))
            acc += u
        return tuple(out)

    @property
    def ends(self) -> tuple[int, ...]:
        out, acc = [], 0
        for u in self.units:
            acc += u
            out.append(min(acc * self.block, self.size))
        return tuple(out)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """Per-device ``[start, end)`` element ranges of the flattened tensor."""
        return tuple(zip(self.starts, self.ends, strict=True))

    @property
    def local_sizes(self) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.ranges)

    @property
    def max_local_size(self) -> int:
        """Length of the padded local piece every device holds inside ``shard_map``."""
        return max(self.local_sizes)

    @property
    def owner(self) -> int | None:
        """The single device that owns the whole tensor, or ``None`` if it is split (or empty)."""
        holders = [k for k, n in enumerate(self.local_sizes) if n]
        return holders[0] if len(holders) == 1 else None

    def device_of(self, index: int) -> int:
        """Device that owns flat element ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"flat index {index} outside tensor of {self.size} elements")
        for k, (s, e) in enumerate(self.ranges):
            if s <= index < e:
                return k
        raise AssertionError("unreachable")

    def overlap(self, other: RaggedShard) -> tuple[tuple[tuple[int, int], ...], ...]:
        """``[src][dst]`` element ranges that device ``src`` of ``self`` sends to ``dst`` of ``other``."""
        if self.size != other.size or self.num_devices != other.num_devices:
            raise ValueError(
                f"RaggedShard.overlap: {self.size} elements on {self.num_devices} devices vs "
                f"{other.size} on {other.num_devices}."
            )
        out = []
        for s0, e0 in self.ranges:
            row = []
            for s1, e1 in other.ranges:
                lo, hi = max(s0, s1), min(e0, e1)
                row.append((lo, hi) if hi > lo else (lo, lo))
            out.append(tuple(row))
        return tuple(out)

    def __repr__(self) -> str:
        return f"RaggedShard(shape={self.shape}, block={self.block}, units={self.units})"
