"""Static work tables of the fused kernels: a bucket's leaves cut into *units* (pure NumPy, no device code).

The fused FP8 and tile kernels (:mod:`vescale_jax.kernels._fp8`, :mod:`vescale_jax.kernels._tiles`) run one
program per *unit*, a small rectangle of one leaf that Triton holds in registers as a power-of-two block:

* a **band unit**: ``rows`` rows of ``width`` elements, read at ``src + r * src_stride + col`` and written at
  ``dst + r * dst_stride + col``; its columns are grouped in ``block``-wide column blocks (an FP8 block's
  ``bw``; for a plain copy one block of ``width``). In registers it is ``(R, B, C)`` =
  ``(pow2(rows), pow2(ceil(width / block)), pow2(block))``, masked to the unit;
* a **flat unit**: ``n <= width`` consecutive elements (a row-major leaf's chunk, or an exact leaf's
  one-element blocks).

A unit's *class* (:class:`UnitClass`) is everything static about it (kind, shape, strides, which input and
output ref); the kernel emits one body per class behind a ``pl.when`` on the unit's class id. Its dynamic part
is one row of a ``(U, 5)`` int32 table: ``src``, ``dst``, ``slot`` (first FP8 scale slot), ``cls`` and ``n``
(a flat unit's length). Rows past the last unit have ``cls = -1`` and do nothing.

Bands follow the storage (:mod:`vescale_jax.layout._tiles`): a row-major leaf's bands are ``rows`` whole rows;
a tile-major leaf's are ``rows`` rows of one tile, tile by tile in storage order, so a band is contiguous in
storage and strided (by the leaf's width) in the logical leaf: the relayout is the band's two strides.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from vescale_jax.layout import _tiles
from vescale_jax.layout._blocks import BucketBlocks, LeafBlocks, tile_regions

__all__ = [
    "UnitClass",
    "Units",
    "copy_units",
    "dequantize_units",
    "leaf_bands",
    "pow2",
    "quantize_units",
]

FLAT, BAND = "flat", "band"
_COLS = 5  # src, dst, slot, cls, n


def pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, int(n) - 1).bit_length()


class UnitClass(NamedTuple):
    """What is static about a unit (one kernel body each).

    Attributes:
      kind: ``"band"`` or ``"flat"``.
      rows: rows of a band (1 for a flat unit).
      width: elements per row (a flat unit's largest length).
      block: columns per column block (FP8: ``bw``; a copy: ``width``; flat: 1).
      src_stride: elements between a band's rows in the source.
      dst_stride: elements between a band's rows in the destination.
      src_ref: which input ref the unit reads.
      dst_ref: which output ref the unit writes.
    """

    kind: str
    rows: int
    width: int
    block: int
    src_stride: int
    dst_stride: int
    src_ref: int
    dst_ref: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The power-of-two register block: ``(R, B, C)`` for a band, ``(width,)`` for a flat unit."""
        if self.kind == FLAT:
            return (pow2(self.width),)
        return (pow2(self.rows), pow2(-(-self.width // self.block)), pow2(self.block))

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class Units:
    """One launch's units.

    Attributes:
      classes: the static classes, indexed by the table's ``cls`` column.
      table: ``(..., U, 5)`` int32 rows ``(src, dst, slot, cls, n)``; a leading ``(m,)`` for a per-device table
        (the quantizer's, selected by the device's position at run time).
    """

    classes: tuple[UnitClass, ...]
    table: np.ndarray

    @property
    def num_units(self) -> int:
        return int(self.table.shape[-2])


class _Builder:
    """Collects units (per table) and interns their classes."""

    def __init__(self, tables: int):
        self.classes: dict[UnitClass, int] = {}
        self.rows: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(tables)]

    def add(self, t: int, cls: UnitClass, src: int, dst: int, slot: int = 0, n: int = 0) -> None:
        c = self.classes.setdefault(cls, len(self.classes))
        self.rows[t].append((src, dst, slot, c, n))

    def build(self, per_device: bool) -> Units:
        u = max(1, max(len(r) for r in self.rows))
        tab = np.zeros((len(self.rows), u, _COLS), np.int64)
        tab[:, :, 3] = -1
        for t, rows in enumerate(self.rows):
            if rows:
                tab[t, : len(rows)] = rows
        if tab.size and (tab.max() >= 2**31):
            raise ValueError("fused kernel tables: an offset past int32; split the bucket.")
        classes = tuple(sorted(self.classes, key=self.classes.get))
        return Units(classes, tab.astype(np.int32) if per_device else tab[0].astype(np.int32))


# ----------------------------------------------------------------------------------------------------------
# Bands of one leaf


def leaf_bands(shape: Sequence[int], storage: Any, band_rows: int) -> tuple[np.ndarray, ...]:
    """The bands of a leaf of two or more dims, in storage order.

    Args:
      shape: the leaf's (per-layer) shape, ``(*lead, H, W)``.
      storage: its ``vj.tiles`` granularity when stored tile-major, else ``None`` (row-major).
      band_rows: rows per band (a tile of ``th`` rows gives ``ceil(th / band_rows)`` bands).

    Returns:
      ``(pos, dst, rows, width)``, int64 arrays, one entry per band: its first element's storage position,
      that element's row-major logical index, its rows and its row width (= its storage row stride).
    """
    shape = tuple(int(d) for d in shape)
    *lead, h, w = shape
    p = math.prod(lead)
    if storage is None or not _tiles.is_tiled(shape, storage):
        i = np.arange(-(-h // band_rows), dtype=np.int64)
        ld, i = np.repeat(np.arange(p, dtype=np.int64), i.size), np.tile(i, p)
        pos = (ld * h + i * band_rows) * w
        rows = np.minimum(band_rows, h - i * band_rows)
        return pos, pos.copy(), rows, np.full(pos.shape, w, np.int64)
    out: list[list[np.ndarray]] = [[], [], [], []]
    seg0 = 0
    for r0, c0, ntr, ntc, th, tw in tile_regions(shape, storage):
        br = min(band_rows, th)
        nbands = -(-th // br)
        ld, tr, tc, i = (a.ravel().astype(np.int64) for a in np.indices((p, ntr, ntc, nbands)))
        tile = (ld * ntr + tr) * ntc + tc
        out[0].append(seg0 + tile * th * tw + i * br * tw)
        out[1].append(ld * h * w + (r0 + tr * th + i * br) * w + c0 + tc * tw)
        out[2].append(np.minimum(br, th - i * br))
        out[3].append(np.full(tile.shape, tw, np.int64))
        seg0 += p * ntr * ntc * th * tw
    return tuple(np.concatenate(a) if a else np.zeros(0, np.int64) for a in out)


def _column_groups(width: int, block: int, group: int) -> list[tuple[int, int]]:
    """``(col0, cols)`` of the column groups of a band: ``group`` blocks of ``block`` columns each, the last
    one shorter when the width is not a multiple."""
    step = block * group
    return [(c, min(step, width - c)) for c in range(0, width, step)]


def _group(rows: int, block: int, chunk: int) -> int:
    """Column blocks per band unit: as many as fit ``chunk`` register elements (a power of two, at least 1)."""
    per = pow2(rows) * pow2(block)
    return max(1, chunk // per) if per < chunk else 1


# ----------------------------------------------------------------------------------------------------------
# FP8: quantize (per device) and dequantize (all devices)


def _check_band(lb: LeafBlocks, dst: np.ndarray, rows: np.ndarray, width: np.ndarray) -> None:
    """Every band must hold whole blocks whose numbers are consecutive along its columns."""
    bh, bw = lb.block
    *_, h, w = lb.shape
    row0, col0 = dst % (h * w) // w, dst % w
    whole = (row0 % bh == 0) & (col0 % bw == 0) & (rows == np.minimum(bh, h - row0))
    whole &= (width % bw == 0) | (col0 + width == w)
    if not np.all(whole):
        raise NotImplementedError(
            f"fused FP8 kernels: leaf of shape {lb.shape} stored as {lb.storage!r} holds {bh}x{bw} blocks across "
            "its storage tiles (tiles that are not multiples of the block, on one device); the XLA path "
            "(vj.kernels.KernelPolicy(mode='xla')) takes it."
        )


def _fp8_units(table: BucketBlocks, size: int, chunk: int, per_device: bool) -> Units:
    m = table.starts.shape[0]
    b = _Builder(m if per_device else 1)
    bands: dict[int, tuple[np.ndarray, ...]] = {}
    flat = min(chunk, pow2(int(np.max(table.ends - table.starts, initial=1))))
    for k in range(m):
        t = k if per_device else 0
        src0, slot0 = (0, 0) if per_device else (k * size, k * (table.nb + 1))
        for r in range(table.starts.shape[1]):
            lo, hi = int(table.starts[k, r]), int(table.ends[k, r])
            if lo >= hi:
                continue
            j, origin = int(table.kind[k, r]), int(table.origin[k, r])
            base, first = int(table.base[k, r]), int(table.first[k, r])
            lb = table.leaves[j]
            out = 0 if per_device else j
            if lb.exact:
                if lb.storage is not None and _tiles.is_tiled(lb.shape, lb.storage):
                    raise NotImplementedError(f"fused FP8 kernels: an exact leaf of shape {lb.shape} stored tiled.")
                for c in range(0, hi - lo, flat):
                    cls = UnitClass(FLAT, 1, flat, 1, 1, 1, 0, out)
                    dst = src0 + lo + c if per_device else origin + c
                    b.add(t, cls, src0 + lo + c, dst, slot0 + base + origin + c - first, min(flat, hi - lo - c))
                continue
            if j not in bands:
                bands[j] = leaf_bands(lb.shape, lb.storage, lb.block[0])
                _check_band(lb, *bands[j][1:])
            pos, dst, rows, width = bands[j]
            sel = np.flatnonzero((pos >= origin) & (pos < origin + hi - lo))
            if int(np.sum(rows[sel] * width[sel])) != hi - lo or (sel.size and int(pos[sel[0]]) != origin):
                raise NotImplementedError(f"fused FP8 kernels: device {k} holds part of a band of leaf {lb.shape}.")
            numbers = lb.number(pos[sel]).astype(np.int64)
            bw, (_, w) = lb.block[1], lb.shape[-2:]
            for q, num in zip(sel, numbers, strict=True):
                nrows, wid = int(rows[q]), int(width[q])
                g = _group(nrows, bw, chunk)
                for col0, cols in _column_groups(wid, bw, g):
                    src = src0 + lo + int(pos[q]) - origin + col0
                    slot = slot0 + base + int(num) - first + col0 // bw
                    if per_device:
                        b.add(t, UnitClass(BAND, nrows, cols, bw, wid, wid, 0, 0), src, src, slot)
                    else:
                        cls = UnitClass(BAND, nrows, cols, bw, wid, w, 0, out)
                        b.add(t, cls, src, int(dst[q]) + col0, slot)
    return b.build(per_device)


@functools.lru_cache(maxsize=256)
def quantize_units(table: BucketBlocks, size: int, *, chunk: int) -> Units:
    """The FP8 quantizer's units of every device (a ``(m, U, 5)`` table; device ``k`` runs row ``k``).

    Args:
      table: the bucket's block index (:func:`vescale_jax.layout._blocks.block_index`).
      size: ``S``, the local shard's elements.
      chunk: most elements of a unit's register block (column blocks are grouped up to it).

    Returns:
      :class:`Units`: band units of whole ``bh``-row blocks (``src``: local element, ``slot``: the scale slot
      of its first column block) and flat units of exact leaves (``slot``: the first element's slot).

    Sharding:
      Device ``k`` on the plan's axis owns ``[k*S, (k+1)*S)``; its units cover each of its leaf elements once.
      Padding is in no unit.
    """
    return _fp8_units(table, size, chunk, per_device=True)


@functools.lru_cache(maxsize=256)
def dequantize_units(table: BucketBlocks, size: int, *, chunk: int) -> Units:
    """The FP8 dequantizer's units over the gathered ``(m * S,)`` codes and ``(m * NB,)`` scales.

    Returns:
      :class:`Units`: ``src`` indexes the gathered codes, ``slot`` the gathered scales, ``dst`` the leaf's
      row-major logical elements, and the class's ``dst_ref`` is the leaf (its index in ``table.leaves``).
      Every element of every leaf is in exactly one unit.
    """
    return _fp8_units(table, size, chunk, per_device=False)


# ----------------------------------------------------------------------------------------------------------
# Plain copies between a bucket buffer and its (tile-major) leaves


def copy_units(
    sizes: Sequence[int],
    offsets: Sequence[int],
    shapes: Sequence[Sequence[int]],
    storage: Sequence[Any],
    *,
    chunk: int,
    to_buffer: bool,
) -> Units:
    """Units that copy leaves out of a buffer (``to_buffer=False``: unpack) or into it (pack).

    A tile-major slot is copied in bands (rows of one tile): contiguous in the buffer, strided in the leaf;
    a row-major slot in flat chunks. Refs: the buffer is ref 0 on its side; leaf ``i`` (the ``i``-th non-empty
    slot) is ref ``i`` on the other.

    Returns:
      :class:`Units` with one ``(U, 5)`` table.
    """
    b = _Builder(1)
    used = [i for i, n in enumerate(sizes) if n]
    for r, i in enumerate(used):
        shape, n, off = tuple(int(d) for d in shapes[i]), int(sizes[i]), int(offsets[i])
        gran = storage[i] if storage else None
        if gran is not None and _tiles.is_tiled(shape, gran):
            w = shape[-1]
            col_block = min(pow2(gran.bw), max(1, chunk))
            band_rows = max(1, min(gran.bh, chunk // col_block))
            for pos, dst, rows, width in zip(*leaf_bands(shape, gran, band_rows), strict=True):
                for col0, cols in _column_groups(int(width), col_block, 1):
                    buf, leaf = off + int(pos) + col0, int(dst) + col0
                    if to_buffer:
                        b.add(0, UnitClass(BAND, int(rows), cols, cols, w, int(width), r, 0), leaf, buf)
                    else:
                        b.add(0, UnitClass(BAND, int(rows), cols, cols, int(width), w, 0, r), buf, leaf)
            continue
        flat = min(chunk, pow2(n))
        for c in range(0, n, flat):
            if to_buffer:
                b.add(0, UnitClass(FLAT, 1, flat, 1, 1, 1, r, 0), c, off + c, 0, min(flat, n - c))
            else:
                b.add(0, UnitClass(FLAT, 1, flat, 1, 1, 1, 0, r), off + c, c, 0, min(flat, n - c))
    return b.build(False)
