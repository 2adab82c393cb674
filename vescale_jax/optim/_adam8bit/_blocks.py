"""Quantization blocks of 8-bit optimizer state on the flat buckets: which block each local element is in.

A *quantized* leaf (floating, at least two dims per layer, at least ``min_size`` elements per layer) is cut
into logical ``bh × bw`` tiles of its last two dims (per leading index, edge tiles partial); every other leaf
is cut into one-element blocks. Each device numbers the blocks of its own elements ``0 .. n_k - 1`` (its
leaves in slot order, each leaf's blocks in the order described below) and keeps ``NB = max_k n_k`` scale
slots per layer; padding elements get the dummy slot ``NB``.

The slot of an element comes from a per-device table of its leaf runs (a handful of integers per leaf, as in
:func:`vescale_jax.state._padding.leaf_runs`) and integer arithmetic on its storage position ``o`` inside the leaf:

* one-element blocks: the storage position itself;
* a row-major leaf (``vj.element()``, ``vj.rows(k)``, ``vj.whole()``), or a tile-major leaf on one device:
  the logical block index ``lead * nbh * nbw + (row // bh) * nbw + col // bw`` of ``_tiles.coords(o)``; a
  device's blocks are then one contiguous range of it (when no block is cut);
* a tile-major leaf (``vj.tiles(th, tw)`` with ``bh | th`` and ``bw | tw``) spread over devices: the *storage*
  block order, tile by tile in storage order and row-major inside each tile, so that the whole tiles a device
  owns are one contiguous range of blocks.

:func:`build` refuses (ValueError naming the leaf, its shape, the block, its granularity and the fix) a layout
that puts a device boundary inside a quantization block. A leaf split over tensor / expert axes is blocked on its
TP/EP shard (each group holds its own blocks); a split dim of the shard (one of the last two) must be a multiple
of the block's, so that the shards' blocks are the logical leaf's (else ValueError, naming the leaf).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._cache import plan_cache
from vescale_jax.layout import _tiles as _tiles
from vescale_jax.layout import _tp as _tp
from vescale_jax.layout._granularity import element
from vescale_jax.layout._plan import Plan

__all__ = ["BucketBlocks", "LeafBlocks", "build", "local_slots"]

_EXACT, _LOGICAL, _STORAGE = "exact", "logical", "storage"


@dataclasses.dataclass(frozen=True, eq=False)
class LeafBlocks:
    """How one leaf is blocked (per layer).

    Attributes:
      leaf: index into ``plan.leaves``.
      shape: per-layer shape.
      storage: the tile-major ``vj.tiles`` granularity it is stored with, or ``None`` (row-major).
      numbering: ``"exact"`` (one-element blocks), ``"logical"`` or ``"storage"`` (see the module docstring).
      block: ``(bh, bw)`` (quantized) or ``None``.
      num_blocks: blocks per layer.
    """

    leaf: int
    shape: tuple[int, ...]
    storage: Any
    numbering: str
    block: tuple[int, int] | None
    num_blocks: int

    @property
    def grid(self) -> tuple[int, ...]:
        """Shape of its (per-layer) scales in logical block order."""
        if self.block is None:
            return self.shape
        *lead, h, w = self.shape
        return (*lead, -(-h // self.block[0]), -(-w // self.block[1]))

    def number(self, o: Any, xp: Any = np) -> Any:
        """Block number (in this leaf's numbering) of the elements at storage positions ``o``."""
        if self.numbering == _EXACT:
            return o
        bh, bw = self.block
        h, w = self.shape[-2:]
        nbw = -(-w // bw)
        if self.numbering == _LOGICAL:
            lead_i, row, col = _tiles.coords(o, self.shape, self.storage or element(), xp)
            return lead_i * (-(-h // bh) * nbw) + row // bh * nbw + col // bw
        num, start, before = o * 0, 0, 0
        for count, th, tw in _segments(self.shape, self.storage):
            q = o - start
            sr, sc = -(-th // bh), -(-tw // bw)
            e = q % (th * tw)
            value = before + q // (th * tw) * (sr * sc) + e // tw // bh * sc + e % tw // bw
            num = xp.where(o >= start, value, num)
            start, before = start + count * th * tw, before + count * sr * sc
        return num

    def logical_of_numbers(self) -> np.ndarray:
        """``(num_blocks,)`` int64: the logical (row-major) block index of each block number."""
        if self.numbering == _EXACT:
            n = math.prod(self.shape)
            return _tiles.storage_index(self.shape, self.storage or element()) if n else np.zeros(0, np.int64)
        if self.numbering == _LOGICAL:
            return np.arange(self.num_blocks, dtype=np.int64)
        bh, bw = self.block
        *lead, h, w = self.shape
        p, nbw = math.prod(lead), -(-w // bw)
        out = []
        for r_lo, c_lo, ntr, ntc, th, tw in _regions(self.shape, self.storage):
            sr, sc = -(-th // bh), -(-tw // bw)
            ld, tr, tc, br, bc = np.indices((p, ntr, ntc, sr, sc)).reshape(5, -1)
            row, col = r_lo + tr * th + br * bh, c_lo + tc * tw + bc * bw
            out.append(ld * (-(-h // bh) * nbw) + row // bh * nbw + col // bw)
        return np.concatenate(out).astype(np.int64) if out else np.zeros(0, np.int64)


def _regions(shape: tuple[int, ...], gran: Any) -> list[tuple[int, int, int, int, int, int]]:
    """Non-empty storage segments of a tile-major leaf: ``(row0, col0, tile rows, tile cols, th, tw)``."""
    *_, h, w = shape
    gh, gw = gran.bh, gran.bw
    hf, wf = h - h % gh, w - w % gw
    parts = (
        (0, 0, hf // gh, wf // gw, gh, gw),
        (0, wf, hf // gh, 1, gh, w - wf),
        (hf, 0, 1, wf // gw, h - hf, gw),
        (hf, wf, 1, 1, h - hf, w - wf),
    )
    return [r for r in parts if r[2] * r[3] * r[4] * r[5]]


def _segments(shape: tuple[int, ...], gran: Any) -> list[tuple[int, int, int]]:
    """``(tiles, th, tw)`` of each non-empty segment, in storage order (tiles over all leading indices)."""
    p = math.prod(shape[:-2])
    return [(p * ntr * ntc, th, tw) for _, _, ntr, ntc, th, tw in _regions(shape, gran)]


@dataclasses.dataclass(frozen=True, eq=False)
class BucketBlocks:
    """Per-device block tables of one bucket.

    Attributes:
      nb: scale slots per device and layer (``NB``, at least 1); slot ``nb`` is padding's dummy.
      layers: ``L`` (1 for a flat bucket).
      leaves: the :class:`LeafBlocks` of the bucket's non-empty leaves (slot order).
      starts, ends, kind, origin, base: ``(m, R)`` int32: on device ``k``, local elements
        ``[starts, ends)`` belong to ``leaves[kind]``, starting at its storage position ``origin``; its first
        block there is in slot ``base``. Unused entries ``(S, S, 0, 0, nb)``.
      first: ``(m, R)`` int32: the block number of the run's first block.
      counts: ``(m, R)`` int32: how many blocks the run holds.
    """

    nb: int
    layers: int
    leaves: tuple[LeafBlocks, ...]
    starts: np.ndarray
    ends: np.ndarray
    kind: np.ndarray
    origin: np.ndarray
    base: np.ndarray
    first: np.ndarray
    counts: np.ndarray


def _refuse(spec: Any, shape, block, gran, detail: str) -> ValueError:
    bh, bw = block
    return ValueError(
        f"vj.optim.adamw_8bit: leaf {spec.path!r} of shape {spec.shape} (per layer {shape}) is quantized in "
        f"{bh}x{bw} blocks, but its layout (granularity {gran!r}) {detail}, so a block's scale would need "
        f"another device's elements. Plan it with granularity vj.tiles({bh}, {bw}) or vj.rows({bh}) (e.g. "
        f"granularity=lambda path, leaf: vj.tiles({bh}, {bw}) if leaf.ndim >= 2 else vj.element()), or keep it "
        f"in fp32 with a larger min_size."
    )


def _row_major_cut(o: int, shape: tuple[int, ...], block: tuple[int, int]) -> bool:
    """Whether a device boundary before row-major storage position ``o`` splits a ``block`` tile."""
    h = shape[-2]
    bh, bw = block
    _, row, col = (int(v) for v in _tiles.coords(np.int64(o), shape, element()))
    rr, tile_h = row % bh, min(bh, h - row // bh * bh)
    return not ((rr == 0 and col == 0) or (tile_h == 1 and col % bw == 0))


def _check_split(spec: Any, shape: tuple[int, ...], block: tuple[int, int], *, stacked: bool) -> None:
    """Refuses a leaf split over tensor / expert axes whose shard's split dim (one of the last two) is not a
    multiple of the block's: its shards' edge blocks would not be blocks of the logical leaf, and the state would
    depend on the TP/EP size."""
    bad = _tp.misaligned_split(spec.tp, shape, block, stacked=stacked)
    if bad is None:
        return
    d, blk, axes = bad
    raise ValueError(
        f"vj.optim.adamw_8bit: leaf {spec.path!r} of shape {spec.shape} is split over "
        f"{'/'.join(axes)} into shards of {shape} (per layer), whose dim {d} ({shape[d]}) is not a "
        f"multiple of the {block[0]}x{block[1]} block's {blk}: the blocks of the shards would not be blocks "
        f"of the leaf. Choose a block that divides {shape[d]}, or keep the leaf in fp32 with min_size above "
        f"{math.prod(shape)}."
    )


def _leaf_blocks(plan: Plan, bucket: int, slot: int, block: tuple[int, int], min_size: int) -> LeafBlocks:
    b = plan.buckets[bucket]
    i = b.leaves[slot]
    spec = plan.leaves[i]
    shape = plan.layer_shape(spec)
    size = math.prod(shape)
    storage = b.storage[slot] if b.storage else None
    if len(shape) < 2 or size < min_size or not jnp.issubdtype(jnp.dtype(spec.dtype), jnp.floating):
        return LeafBlocks(i, shape, storage, _EXACT, None, size)
    *lead, h, w = shape
    _check_split(spec, shape, block, stacked=b.layers is not None)
    nb = math.prod(lead) * -(-h // block[0]) * -(-w // block[1])
    s, o = b.layout.shard_size, b.layout.offsets[slot]
    boundaries = [k * s - o for k in range(o // s + 1, (o + size - 1) // s + 1)]
    if storage is None:
        for at in boundaries:
            if _row_major_cut(at, shape, block):
                k = (o + at) // s
                raise _refuse(spec, shape, block, spec.granularity, f"starts device {k} at its element {at}")
        return LeafBlocks(i, shape, None, _LOGICAL, block, nb)
    if not boundaries:
        return LeafBlocks(i, shape, storage, _LOGICAL, block, nb)
    if storage.bh % block[0] or storage.bw % block[1]:
        raise _refuse(
            spec,
            shape,
            block,
            spec.granularity,
            f"spreads it over devices in {storage.bh}x{storage.bw} tiles, which the {block[0]}x{block[1]} "
            "blocks do not divide",
        )
    return LeafBlocks(i, shape, storage, _STORAGE, block, nb)


@plan_cache
def build(plan: Plan, block: tuple[int, int], min_size: int) -> tuple[BucketBlocks, ...]:
    """The block tables of every bucket (NumPy, from the plan only).

    Raises:
      ValueError: a device boundary inside a quantization block (naming the leaf, shape, block, granularity
        and the fix).
    """
    m = plan.num_devices
    out = []
    for bi, b in enumerate(plan.buckets):
        s = b.layout.shard_size
        leaves: list[LeafBlocks] = []
        runs: list[list[tuple[int, ...]]] = [[] for _ in range(m)]
        used = [0] * m
        for slot in range(len(b.leaves)):
            o, n = b.layout.offsets[slot], b.layout.sizes[slot]
            if not n:
                continue
            lb = _leaf_blocks(plan, bi, slot, block, min_size)
            kind = len(leaves)
            leaves.append(lb)
            for k in range(o // s, (o + n - 1) // s + 1):
                lo, hi = max(o, k * s), min(o + n, (k + 1) * s)
                first = int(lb.number(np.int64(lo - o)))
                count = int(lb.number(np.int64(hi - 1 - o))) - first + 1
                runs[k].append((lo - k * s, hi - k * s, kind, lo - o, used[k], first, count))
                used[k] += count
        width = max(1, max(len(r) for r in runs))
        nb = max(1, max(used))
        tab = np.zeros((7, m, width), np.int64)
        tab[0], tab[1], tab[4] = s, s, nb
        for k, rs in enumerate(runs):
            for r, run in enumerate(sorted(rs)):  # by local start, for the lookup
                tab[:, k, r] = run
        if s >= 2**31 or nb >= 2**31:
            raise ValueError(f"vj.optim.adamw_8bit: bucket {b.name!r} has {s} elements per device, past int32.")
        t = tab.astype(np.int32)
        out.append(BucketBlocks(nb, b.layers or 1, tuple(leaves), t[0], t[1], t[2], t[3], t[4], t[5], t[6]))
    return tuple(out)


def local_slots(tables: BucketBlocks, axis: Any, size: int) -> jax.Array:
    """Inside ``shard_map``: ``(S,)`` int32, the scale slot of each local element (``nb`` at padding)."""
    k = jax.lax.axis_index(axis)
    st, en = jnp.asarray(tables.starts)[k], jnp.asarray(tables.ends)[k]
    i = jnp.arange(size, dtype=jnp.int32)
    r = jnp.searchsorted(st, i, side="right", method="compare_all" if st.shape[0] <= 16 else "scan") - 1
    rc = jnp.clip(r, 0, st.shape[0] - 1)
    inside = (r >= 0) & (i < en[rc])
    row = lambda t: jnp.asarray(t)[k][rc]
    kind, o = row(tables.kind), i - st[rc] + row(tables.origin)
    num = o
    done: dict[tuple[Any, ...], jax.Array] = {}
    for j, lb in enumerate(tables.leaves):
        if lb.numbering == _EXACT:
            continue
        key = (lb.shape, lb.storage, lb.numbering, lb.block)
        if key not in done:  # leaves of one shape and storage share the arithmetic
            done[key] = lb.number(o, jnp)
        num = jnp.where(kind == j, done[key], num)
    slot = row(tables.base) + num - row(tables.first)
    return jnp.where(inside, slot, tables.nb).astype(jnp.int32)
