"""The tile relayout of pack and unpack on Mosaic GPU: tile rows moved as vectors.

A leaf planned with ``vj.tiles(th, tw)`` is stored tile by tile (:mod:`vescale_jax.layout._tiles`); each row of a
tile is ``tw`` consecutive elements both in the bucket (storage order) and in the logical leaf (row-major, at
the leaf's width), so the relayout is a set of contiguous runs: Mosaic GPU moves each as register vectors with
no per-lane gather. The runs are a static table (NumPy, from the layout): for each tile row its offset in the
buffer and in the leaf, one class per (slot, row length) so the vector shapes are static; a row-major slot is one
run; padding gaps of the buffer are written as zero (pack). One program moves :data:`ROWS_PER_PROGRAM` runs of
one class; casts are fused. Bit-exact against :func:`vescale_jax.kernels._tiles.unpack_tiled_reference` and
:func:`~vescale_jax.kernels._tiles.pack_tiled_reference`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from vescale_jax._compat import mosaic_gpu_load
from vescale_jax.kernels._fp8_mosaic import (
    WARPGROUP,
    _call,
    _classes,
    _runs,
    _static_run,
    _strided,
    _strided_fill,
    _vary,
    _width,
)
from vescale_jax.layout._blocks import tile_regions
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = ["pack_tiled", "unpack_tiled"]

ROWS_PER_PROGRAM = 16
"""Runs one program moves (tile rows are short: a program per row would be mostly launch)."""


def _runs_of(shape: tuple[int, ...], gran: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(storage offsets, logical offsets, lengths)`` of the tile rows of one leaf (a row-major leaf: one run)."""
    n = math.prod(shape)
    if gran is None:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.full(1, n, np.int64)
    *lead, h, w = shape
    p = math.prod(lead)
    src, dst, lens, at = [], [], [], 0
    for r0, c0, ntr, ntc, th, tw in tile_regions(shape, gran):
        ld, tr, tc, r = (a.reshape(-1) for a in np.indices((p, ntr, ntc, th)))
        tile = (ld * ntr + tr) * ntc + tc
        src.append(at + tile * th * tw + r * tw)
        dst.append(ld * h * w + (r0 + tr * th + r) * w + c0 + tc * tw)
        lens.append(np.full(len(r), tw, np.int64))
        at += p * ntr * ntc * th * tw
    return np.concatenate(src), np.concatenate(dst), np.concatenate(lens)


def _plan(layout: BucketLayout, shapes: Sequence[tuple[int, ...]], storage: Sequence[Any]):
    """Classes ``(slot, run length)`` with their ``(n, 2)`` rows ``(buffer offset, leaf offset)``, and the
    buffer's padding gaps ``(n, 2)`` rows ``(offset, length)``."""
    classes: list[tuple[int, int]] = []
    rows: list[np.ndarray] = []
    for i, (n, off) in enumerate(zip(layout.sizes, layout.offsets, strict=True)):
        if not n:
            continue
        src, dst, lens = _runs_of(tuple(shapes[i]), storage[i] if storage else None)
        for length in np.unique(lens):
            sel = lens == length
            classes.append((i, int(length)))
            rows.append(np.stack([src[sel] + off, dst[sel]], -1))
    gaps, at = [], 0
    for n, off in sorted(zip(layout.sizes, layout.offsets, strict=True), key=lambda t: t[1]):
        if n and off > at:
            gaps += [(o, min(4096, off - o)) for o in range(at, off, 4096)]
        at = max(at, off + n) if n else at
    if at < layout.total_size:
        gaps += [(o, min(4096, layout.total_size - o)) for o in range(at, layout.total_size, 4096)]
    return classes, rows, np.asarray(gaps, np.int64).reshape(-1, 2)


def _table(rows: list[np.ndarray]) -> tuple[np.ndarray, list[int], list[int]]:
    """One int32 table: each class's rows padded to whole programs (``-1``), its first entry and its programs."""
    parts, starts, programs, at = [], [], [], 0
    for r in rows:
        n = -(-len(r) // ROWS_PER_PROGRAM)
        padded = np.full((n * ROWS_PER_PROGRAM, r.shape[1]), -1, np.int64)
        padded[: len(r)] = r
        parts.append(padded.reshape(-1))
        starts.append(at)
        programs.append(n)
        at += padded.size
    flat = np.concatenate(parts) if parts else np.zeros(1, np.int64)
    return flat.astype(np.int32), starts, programs


def _move(src_ref, dst_ref, src, dst, length: int, vec: int, dtype: Any) -> None:
    """``dst_ref[dst : dst + length] = src_ref[src : src + length]`` cast to ``dtype``, in register tiles (or
    element by element under a warpgroup)."""

    def piece(at, tile, lay):
        dst_ref[pl.ds(dst + at, tile)] = mosaic_gpu_load(src_ref, src + at, tile, lay).astype(dtype)

    def one(e):
        dst_ref[dst + e] = src_ref[src + e].astype(dtype)

    _static_run(length, vec, piece, one)


def _row_loop(tab_ref, base: int, i, width: int, fn) -> None:
    """Calls ``fn(*row)`` for the :data:`ROWS_PER_PROGRAM` rows of program ``i`` of a class (skipping padding)."""

    def one(r, carry):
        at = base + (i * ROWS_PER_PROGRAM + r) * width
        row = [tab_ref[at + f] for f in range(width)]

        @pl.when(row[0] >= 0)
        def _():
            fn(*row)

        return carry

    jax.lax.fori_loop(0, ROWS_PER_PROGRAM, one, 0)


def unpack_tiled(
    buffer: jax.Array,
    layout: BucketLayout,
    shapes: Sequence[tuple[int, ...]],
    *,
    storage: Sequence[Any],
    dtype: Any,
    interpret: bool = False,
) -> list[jax.Array]:
    """The non-empty leaves (slot order, logical shapes, ``dtype``) from the ``(total_size,)`` buffer, in one
    Mosaic GPU kernel; tile-major slots written row-major.

    Args:
      buffer: the bucket buffer.
      layout: the bucket layout.
      shapes: each slot's logical shape.
      storage: per slot, the ``vj.tiles`` granularity of a tile-major slot or None.
      dtype: the leaves' dtype (the cast is fused).
      interpret: run in Mosaic GPU's interpreter.

    Returns:
      The non-empty slots' leaves, bit-exact :func:`vescale_jax.kernels._tiles.unpack_tiled_reference`.
    """
    classes, rows, _ = _plan(layout, shapes, storage)
    tab, starts, programs = _table(rows)
    used = sorted({c[0] for c in classes})
    out_of = {slot: k for k, slot in enumerate(used)}
    size = max(np.dtype(buffer.dtype).itemsize, np.dtype(dtype).itemsize)
    vecs = [_width(length, [r], size) for (_, length), r in zip(classes, rows, strict=True)]

    def body(tab_ref, buf_ref, *out_refs):
        def emit(c, i):
            slot, length = classes[c]
            out = out_refs[out_of[slot]]
            _row_loop(tab_ref, starts[c], i, 2, lambda s, d: _move(buf_ref, out, s, d, length, vecs[c], dtype))

        _classes(programs, emit)

    flat = _call(
        body,
        [jax.ShapeDtypeStruct((layout.sizes[i],), dtype) for i in used],
        sum(programs),
        interpret,
        jnp.asarray(tab),
        buffer,
    )
    flat = _vary(flat, [buffer])
    return [jnp.reshape(x, tuple(shapes[i])) for i, x in zip(used, flat, strict=True)]


def pack_tiled(
    leaves: Sequence[jax.Array],
    layout: BucketLayout,
    *,
    storage: Sequence[Any],
    dtype: Any,
    interpret: bool = False,
) -> jax.Array:
    """The ``(total_size,)`` buffer from the logical leaves, in one Mosaic GPU kernel: tile-major slots written
    tile by tile, padding zero.

    Args:
      leaves: one array per slot, its logical shape.
      layout: the bucket layout.
      storage: per slot, the ``vj.tiles`` granularity of a tile-major slot or None.
      dtype: the buffer's dtype (the cast is fused).
      interpret: run in Mosaic GPU's interpreter.

    Returns:
      The buffer, bit-exact :func:`vescale_jax.kernels._tiles.pack_tiled_reference`.
    """
    shapes = [tuple(np.shape(x)) for x in leaves]
    classes, rows, gaps = _plan(layout, shapes, storage)
    used = sorted({c[0] for c in classes})
    in_of = {slot: k for k, slot in enumerate(used)}
    tab, starts, programs = _table([*rows, gaps])
    size = max([np.dtype(dtype).itemsize] + [np.dtype(leaves[i].dtype).itemsize for i in used])
    vecs = [_width(length, [r], size) for (_, length), r in zip(classes, rows, strict=True)]
    n_runs = len(classes)

    def body(tab_ref, *refs):
        in_refs, buf_ref = refs[:-1], refs[-1]

        def emit(c, i):
            if c < n_runs:
                slot, length = classes[c]
                src = in_refs[in_of[slot]]
                _row_loop(tab_ref, starts[c], i, 2, lambda b, lf: _move(src, buf_ref, lf, b, length, vecs[c], dtype))
                return
            lay = _strided(WARPGROUP, 1)

            def zero(off, n):
                def vector(at):
                    buf_ref[pl.ds(off + at, WARPGROUP)] = _strided_fill(0, dtype, lay)

                def scalar(e):
                    buf_ref[off + e] = jnp.asarray(0, dtype)

                _runs(n, vector, scalar)

            _row_loop(tab_ref, starts[c], i, 2, zero)

        _classes(programs, emit)

    (buf,) = _call(
        body,
        [jax.ShapeDtypeStruct((layout.total_size,), dtype)],
        sum(programs),
        interpret,
        jnp.asarray(tab),
        *[jnp.reshape(leaves[i], (-1,)) for i in used],
    )
    (buf,) = _vary([buf], [leaves[i] for i in used])
    return buf
