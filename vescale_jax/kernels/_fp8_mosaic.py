"""FP8 block quantization and dequantization on Mosaic GPU, for buckets whose blocks are contiguous runs.

Mosaic GPU moves data between global memory and registers in vectors of consecutive elements; it has no
per-lane gather. The FP8 wire (:mod:`vescale_jax.kernels._fp8`) needs, per block, the maximum over its elements
and one scale for all of them, so a block it can take in vectors is a *contiguous* run of the flat buffer:

* an exact leaf's one-element blocks (vectors, small leaves);
* a tile-major leaf (``vj.tiles(th, tw)`` storage) whose blocks are its tiles' row bands: ``bw == tw`` and
  ``bh`` dividing ``th`` (the natural case: ``tiles(b, b)`` storage with ``fp8_gather=(b, b)``, one block per
  tile);
* a row-major leaf whose blocks span whole rows (``bw >= w``), or single rows (``bh == 1``).

:func:`takes` says whether a bucket is all of those. Its work is then a table of *pieces* per device (NumPy,
from the plan, cached): each quantized block (its offset in the shard, its slot; a class per block length, so
the vector shapes are static), each exact run, each padding gap and the unused scale slots. The kernel runs one
program (one warpgroup) per piece: a block is read twice in register tiles (``WG_STRIDED``, up to 16 bytes per
thread): once for ``max |x|``, once to divide and cast to ``float8_e4m3fn``; its scale is one store. The
dequantize-unpack kernel reads the gathered codes and scales of every device and writes each leaf in its storage
order (a tile-major leaf is then relaid out by XLA: the relayout is not fused here).

Both are bit-exact against :func:`vescale_jax.kernels._fp8.quantize_reference` and
:func:`~vescale_jax.kernels._fp8.dequantize_unpack_reference` (the same fp32 operations per element); tested in
Mosaic GPU's interpreter (JAX 0.12) and lowered for CUDA on every JAX with Mosaic GPU.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from vescale_jax._cache import plan_cache
from vescale_jax._compat import mosaic_gpu_interpret_params, mosaic_gpu_load
from vescale_jax.kernels._ragged import _vary_like
from vescale_jax.layout import _tiles
from vescale_jax.layout._blocks import EXACT, BucketBlocks, LeafBlocks, tile_regions

__all__ = ["dequantize_unpack", "quantize", "takes"]

FP8 = jnp.float8_e4m3fn
_INV_QMAX = np.float32(1.0 / 448.0)
WARPGROUP = 128
VECTOR_BYTES = 16
RUN_CHUNK = 4096
"""Most elements of one exact / zero piece (longer runs are cut, so that programs stay balanced)."""
_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------------------------
# Pieces (NumPy, from the plan)


def _extents(lb: LeafBlocks) -> tuple[np.ndarray, np.ndarray] | None:
    """``(starts, lengths)`` in the leaf's storage order of each of its (per-layer) blocks when every block is one
    contiguous run of the storage, else None."""
    bh, bw = lb.block
    *lead, h, w = lb.shape
    p = math.prod(lead)
    if lb.storage is None:
        if bw >= w or bh == 1 or h == 1:
            rows = min(bh, h) if bw >= w else 1
            cb = 1 if bw >= w else -(-w // bw)
            nr = -(-h // rows)
            ld, r, c = (a.reshape(-1) for a in np.indices((p, nr, cb)))
            row_len = np.minimum(rows, h - r * rows)
            col_len = np.full_like(c, w) if bw >= w else np.minimum(bw, w - c * bw)
            starts = ld * h * w + r * rows * w + (0 if bw >= w else c * bw)
            lengths = row_len * col_len if bw >= w else col_len * row_len
            return starts.astype(np.int64), lengths.astype(np.int64)
        return None
    if lb.storage.bw != bw or lb.storage.bh % bh:
        return None
    out_s, out_n, at = [], [], 0
    for _r0, _c0, ntr, ntc, th, tw in tile_regions(lb.shape, lb.storage):
        nt, sb = p * ntr * ntc, -(-th // bh)
        t, b = (a.reshape(-1) for a in np.indices((nt, sb)))
        out_s.append(at + t * th * tw + b * bh * tw)
        out_n.append(np.minimum(bh, th - b * bh) * tw)
        at += nt * th * tw
    return np.concatenate(out_s).astype(np.int64), np.concatenate(out_n).astype(np.int64)


@dataclasses.dataclass(frozen=True, eq=False)
class Pieces:
    """The work of the Mosaic GPU FP8 kernels for one bucket (every device's, in NumPy).

    Attributes:
      blocks: per block length ``b``: ``(m, n_b, 4)`` int64 rows ``(offset in the shard, slot, leaf index in
        the table, storage position in the leaf)``; unused rows ``(-1, ...)``.
      exact: ``(m, n_e, 4)`` rows ``(offset, slot, storage position, length)`` of exact runs, cut at
        :data:`RUN_CHUNK`; plus the leaf index per row in ``exact_leaf`` ``(m, n_e)``.
      zero: ``(m, n_z, 2)`` rows ``(offset, length)`` of the padding gaps of each shard.
      zscale: ``(m, n_s, 2)`` rows ``(first slot, count)`` of the scale slots no block uses (padding's included).
    """

    blocks: dict[int, np.ndarray]
    exact: np.ndarray
    exact_leaf: np.ndarray
    zero: np.ndarray
    zscale: np.ndarray


def _cut(off: int, n: int, *rest: int) -> list[tuple[int, ...]]:
    return [(off + i, *(r + i for r in rest), min(RUN_CHUNK, n - i)) for i in range(0, n, RUN_CHUNK)]


def _stack(rows: list[list[tuple[int, ...]]], width: int) -> np.ndarray:
    n = max([len(r) for r in rows] + [0])
    out = np.full((len(rows), n, width), -1, np.int64)
    for k, r in enumerate(rows):
        if r:
            out[k, : len(r)] = np.asarray(r, np.int64)
    return out


@plan_cache
def pieces(table: BucketBlocks, size: int) -> Pieces | None:
    """The bucket's pieces for a shard of ``size`` elements per device, or None when a quantized leaf's blocks
    are not contiguous runs (see the module docstring)."""
    extents = {}
    for j, lb in enumerate(table.leaves):
        if lb.numbering == EXACT:
            continue
        ext = _extents(lb)
        if ext is None:
            return None
        numbers = np.asarray(lb.number(ext[0]), np.int64)
        if len(np.unique(numbers)) != lb.num_blocks or len(numbers) != lb.num_blocks:
            return None
        extents[j] = (*ext, numbers)
    m = table.starts.shape[0]
    blocks: dict[int, list[list[tuple[int, ...]]]] = {}
    exact: list[list[tuple[int, ...]]] = [[] for _ in range(m)]
    exact_leaf: list[list[int]] = [[] for _ in range(m)]
    zero: list[list[tuple[int, ...]]] = [[] for _ in range(m)]
    zscale: list[list[tuple[int, ...]]] = [[] for _ in range(m)]
    for k in range(m):
        at, used = 0, 0
        for r in np.argsort(table.starts[k], kind="stable"):
            lo, hi = int(table.starts[k, r]), int(table.ends[k, r])
            if lo >= hi:
                continue
            if lo > at:
                zero[k] += [(o, n) for o, n in _cut(at, lo - at)]
            at = hi
            j, origin, base = int(table.kind[k, r]), int(table.origin[k, r]), int(table.base[k, r])
            first, count = int(table.first[k, r]), int(table.counts[k, r])
            used = max(used, base + count)
            if table.leaves[j].numbering == EXACT:
                cut = _cut(lo, hi - lo, base, origin)
                exact[k] += cut
                exact_leaf[k] += [j] * len(cut)
                continue
            s, n, num = extents[j]
            inside = (s >= origin) & (s < origin + hi - lo)
            if int(n[inside].sum()) != hi - lo or (inside.any() and int(s[inside].min()) != origin):
                return None
            for st, ln, nu in zip(s[inside], n[inside], num[inside], strict=True):
                blocks.setdefault(int(ln), [[] for _ in range(m)])[k].append(
                    (lo + int(st) - origin, base + int(nu) - first, j, int(st))
                )
        if at < size:
            zero[k] += [(o, n) for o, n in _cut(at, size - at)]
        nb = table.nb + 1
        zscale[k] += [(o, n) for o, n in _cut(used, nb - used)] if used < nb else []
    el = np.full((m, max([len(e) for e in exact_leaf] + [0])), -1, np.int64)
    for k, e in enumerate(exact_leaf):
        el[k, : len(e)] = e
    return Pieces(
        blocks={b: _stack(rows, 4) for b, rows in sorted(blocks.items())},
        exact=_stack(exact, 4),
        exact_leaf=el,
        zero=_stack(zero, 2),
        zscale=_stack(zscale, 2),
    )


def _pieces_or_refuse(table: BucketBlocks, size: int, what: str) -> Pieces:
    pc = pieces(table, size)
    if pc is None:
        raise NotImplementedError(
            f"{what}(backend='mosaic_gpu'): a quantized leaf's blocks are not contiguous runs of the bucket "
            "(see vescale_jax.kernels._fp8_mosaic.takes); use backend='triton' or the XLA path."
        )
    return pc


def takes(table: BucketBlocks, size: int) -> bool:
    """Whether the Mosaic GPU FP8 kernels take this bucket: every quantized block a contiguous run, every offset
    within int32 (see the module docstring)."""
    if size * table.starts.shape[0] > _MAX:
        return False
    try:
        return pieces(table, size) is not None
    except NotImplementedError:
        return False


# ----------------------------------------------------------------------------------------------------------
# One element's FP8 code in integer arithmetic (Mosaic GPU lowers no scalar of an 8-bit float)


def code_bits(y: jax.Array) -> jax.Array:
    """The ``float8_e4m3fn`` bits (int32, ``0..255``) of an fp32 ``y`` with ``|y| <= 464``, rounded to nearest even
    as XLA's conversion does (subnormals included; NaN gives ``0x7f``)."""
    b = jax.lax.bitcast_convert_type(y, jnp.int32)
    mag = b & 0x7FFFFFFF
    a = jax.lax.bitcast_convert_type(mag, jnp.float32)
    # under 2^-6: a multiple of 2^-9, the 24-bit significand shifted right by 141 - E with round-half-even
    exp = mag >> 23
    sig = jnp.where(exp > 0, (mag & 0x7FFFFF) | 0x800000, 0)
    k = jnp.clip(141 - exp, 1, 31)
    q, rem, half = sig >> k, sig & ((1 << k) - 1), 1 << (k - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).astype(jnp.int32)
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)  # rebias 127 -> 7, keep 3 mantissa bits
    code = jnp.where(a < np.float32(2.0**-6), sub, normal)
    code = jnp.where(a != a, 0x7F, code)
    return jnp.where(b < 0, code | 0x80, code)


def code_value(u: jax.Array) -> jax.Array:
    """The fp32 value of ``float8_e4m3fn`` bits ``u`` (int32, ``0..255``)."""
    e, m = (u >> 3) & 15, u & 7
    normal = (m + 8).astype(jnp.float32) * jax.lax.bitcast_convert_type((e + 117) << 23, jnp.float32)
    v = jnp.where(e == 0, m.astype(jnp.float32) * np.float32(2.0**-9), normal)
    v = jnp.where((u & 0x7F) == 0x7F, np.float32(np.nan), v)
    return jnp.where(u >= 128, -v, v)


ONE = 0x38
"""The bits of ``float8_e4m3fn(1)``: an exact element's code."""

# ----------------------------------------------------------------------------------------------------------
# Kernel plumbing


def _width(length: int, offsets: Sequence[np.ndarray], itemsize: int) -> int:
    """Elements per thread-vector for blocks of ``length``: the widest power of two within
    :data:`VECTOR_BYTES` dividing the length and every offset, with a warpgroup's vector no longer than it."""
    vec = max(1, VECTOR_BYTES // itemsize)
    offs = np.concatenate([np.asarray(o).reshape(-1) for o in offsets] + [np.zeros(1, np.int64)])
    offs = offs[offs >= 0]
    while vec > 1 and (length % vec or np.any(offs % vec) or WARPGROUP * vec > length):
        vec //= 2
    return vec


def _tiles_of(length: int, vec: int) -> tuple[int, int]:
    """``(tile, count)``: a register tile of up to two vectors per thread, and how many (the last one moved back
    to end at ``length``: overlapping tiles write the same values twice)."""
    tile = WARPGROUP * vec * (2 if length >= 2 * WARPGROUP * vec else 1)
    return tile, -(-length // tile)


def _over_tiles(length: int, tile: int, count: int, fn, init: Any) -> Any:
    """``fn(offset, carry)`` over the tiles of a run of static ``length``."""
    if count == 1:
        return fn(0, init)
    return jax.lax.fori_loop(0, count, lambda i, c: fn(jnp.minimum(i * tile, length - tile), c), init)


def _static_run(length: int, vec: int, vector, scalar) -> None:
    """A run of static ``length``: ``vector(offset, tile, layout)`` on its register tiles (:func:`_tiles_of`), or
    ``scalar(offset)`` per element when it is shorter than a warpgroup."""
    if length < WARPGROUP:
        jax.lax.fori_loop(0, length, lambda e, c: (scalar(e), c)[1], 0)
        return
    tile, count = _tiles_of(length, vec)
    lay = _strided(tile, vec)
    _over_tiles(length, tile, count, lambda at, c: (vector(at, tile, lay), c)[1], 0)


def _runs(n: Any, vector, scalar) -> None:
    """A run of dynamic length ``n``: ``vector(offset)`` on tiles of :data:`WARPGROUP` elements (the last moved
    back to end at ``n``), or ``scalar(offset)`` per element when ``n`` is shorter than a tile."""
    full = n // WARPGROUP

    @pl.when(n >= WARPGROUP)
    def _():
        jax.lax.fori_loop(0, full, lambda i, c: (vector(i * WARPGROUP), c)[1], 0)

        @pl.when(n % WARPGROUP != 0)
        def _():
            vector(n - WARPGROUP)

    @pl.when(n < WARPGROUP)
    def _():
        jax.lax.fori_loop(0, n, lambda e, c: (scalar(e), c)[1], 0)


def _classes(sizes: Sequence[int], emit) -> None:
    """Dispatches the program ``pid`` to ``emit(class, index)`` over consecutive ranges of ``sizes``."""
    starts = np.cumsum([0, *sizes])[:-1].tolist()
    live = [c for c, n in enumerate(sizes) if n]
    pid = jax.lax.axis_index("piece")

    def tree(lo: int, hi: int) -> None:
        if hi - lo == 1:
            emit(live[lo], pid - starts[live[lo]])
            return
        mid = (lo + hi) // 2

        @pl.when(pid < starts[live[mid]])
        def _():
            tree(lo, mid)

        @pl.when(pid >= starts[live[mid]])
        def _():
            tree(mid, hi)

    tree(0, len(live))


def _call(body, out_types: list[jax.ShapeDtypeStruct], programs: int, interpret: bool, *args: jax.Array):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.kernel(
        body,
        out_type=tuple(out_types),
        grid=(max(programs, 1),),
        grid_names=("piece",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
        **({"interpret": mosaic_gpu_interpret_params()} if interpret else {}),
    )(*args)


def _strided(width: int, vec: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.Layout.WG_STRIDED((width,), vec_size=vec)


def _table(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Rows of each class flattened into one int32 table per device: ``(m, total)`` and each class's start."""
    flat = [p.reshape(p.shape[0], -1) for p in parts]
    starts = np.cumsum([0] + [f.shape[1] for f in flat])[:-1].tolist()
    return np.concatenate(flat, axis=1).astype(np.int32), starts


def _vary(outs: Sequence[jax.Array], like: Sequence[jax.Array]) -> list[jax.Array]:
    return _vary_like(list(outs), list(like))


# ----------------------------------------------------------------------------------------------------------
# Quantize


def quantize(
    x: jax.Array, table: BucketBlocks, k: jax.Array | int, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """FP8 block quantization of device ``k``'s local shard in one Mosaic GPU kernel.

    Args:
      x: the ``(S,)`` local shard (bf16, fp32, ...); its padding is zero (the shards' invariant).
      table: the bucket's block index; :func:`takes` must hold.
      k: the device's position on the plan's axis (``jax.lax.axis_index`` inside ``shard_map``).
      interpret: run in Mosaic GPU's interpreter (JAX 0.12 and later) instead of compiling.

    Returns:
      ``(S,)`` ``float8_e4m3fn`` codes and ``(NB,)`` fp32 scales, bit-exact
      :func:`vescale_jax.kernels._fp8.quantize_reference`.

    Sharding:
      Inside ``shard_map``: ``x`` is device ``k``'s ``[k*S, (k+1)*S)``; the device's pieces are row ``k`` of a
      static table, so one program serves every device.
    """
    if x.ndim != 1:
        raise ValueError(f"quantize: expects one (S,) shard, got shape {x.shape}; vmap over stacked layers.")
    size = int(x.shape[0])
    pc = _pieces_or_refuse(table, size, "quantize")
    nb = table.nb + 1
    lengths = list(pc.blocks)
    parts = [pc.blocks[b][..., :2] for b in lengths] + [pc.exact[..., [0, 1, 3]], pc.zero, pc.zscale]
    tab, tstart = _table(parts)
    sizes = [p.shape[1] for p in parts]
    src_size = np.dtype(x.dtype).itemsize
    vecs = [_width(b, [pc.blocks[b][..., 0]], max(src_size, 1)) for b in lengths]
    n_block = len(lengths)

    def body(tab_ref, x_ref, codes_ref, scales_ref):
        def row(c, i, f, width):
            return tab_ref[tstart[c] + i * width + f]

        def block(c, i):
            b, vec = lengths[c], vecs[c]
            off, slot = row(c, i, 0, 2), row(c, i, 1, 2)

            @pl.when(off >= 0)
            def _():
                if b < WARPGROUP:  # a short block, element by element
                    amax = jax.lax.fori_loop(
                        0, b, lambda e, a: jnp.maximum(a, jnp.abs(x_ref[off + e].astype(jnp.float32))), jnp.float32(0)
                    )
                else:
                    tile, count = _tiles_of(b, vec)
                    lay = _strided(tile, vec)

                    def amax_tile(at, a):
                        v = mosaic_gpu_load(x_ref, off + at, tile, lay).astype(jnp.float32)
                        return jnp.maximum(a, jnp.max(jnp.abs(v)))

                    amax = _over_tiles(b, tile, count, amax_tile, jnp.float32(0))
                scale = jnp.where(amax > 0, amax, jnp.float32(0)) * _INV_QMAX
                scales_ref[slot] = scale
                div = jnp.where(scale != 0, scale, jnp.float32(1))

                def code(v):
                    return jnp.where(scale != 0, v.astype(jnp.float32) / div, jnp.float32(0))

                def codes_tile(at, tile, lay):
                    v = code(mosaic_gpu_load(x_ref, off + at, tile, lay)).astype(FP8)
                    codes_ref[pl.ds(off + at, tile)] = jax.lax.bitcast_convert_type(v, jnp.uint8)

                def one(e):
                    codes_ref[off + e] = code_bits(code(x_ref[off + e])).astype(jnp.uint8)

                _static_run(b, vec, codes_tile, one)

        def exact(i):
            c = n_block
            off, slot, n = row(c, i, 0, 3), row(c, i, 1, 3), row(c, i, 2, 3)
            lay = _strided(WARPGROUP, 1)

            def nonneg(v):  # -0.0 -> +0.0, as the reference's segment sum gives
                v = v.astype(jnp.float32)
                return jnp.where(v == 0, jnp.float32(0), v)

            def vector(at):
                v = mosaic_gpu_load(x_ref, off + at, WARPGROUP, lay)
                scales_ref[pl.ds(slot + at, WARPGROUP)] = nonneg(v)
                codes_ref[pl.ds(off + at, WARPGROUP)] = _strided_fill(ONE, jnp.uint8, lay)

            def scalar(e):
                scales_ref[slot + e] = nonneg(x_ref[off + e])
                codes_ref[off + e] = jnp.asarray(ONE, jnp.uint8)

            @pl.when(off >= 0)
            def _():
                _runs(n, vector, scalar)

        def fill(ref, c, i, dtype):
            off, n = row(c, i, 0, 2), row(c, i, 1, 2)
            lay = _strided(WARPGROUP, 1)

            def vector(at):
                ref[pl.ds(off + at, WARPGROUP)] = _strided_fill(0.0, dtype, lay)

            def scalar(e):
                ref[off + e] = jnp.asarray(0.0, dtype)

            @pl.when(off >= 0)
            def _():
                _runs(n, vector, scalar)

        def emit(c, i):
            if c < n_block:
                block(c, i)
            elif c == n_block:
                exact(i)
            elif c == n_block + 1:
                fill(codes_ref, c, i, jnp.uint8)
            else:
                fill(scales_ref, c, i, jnp.float32)

        _classes(sizes, emit)

    rows = jnp.asarray(tab)[k]
    codes, scales = _call(
        body,
        [jax.ShapeDtypeStruct((size,), jnp.uint8), jax.ShapeDtypeStruct((nb,), jnp.float32)],
        sum(sizes),
        interpret,
        rows,
        x,
    )
    codes, scales = _vary([codes, scales], [x])
    return jax.lax.bitcast_convert_type(codes, FP8), scales


def _strided_fill(value: float | int, dtype: Any, layout: Any) -> jax.Array:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu.layout_cast(jnp.full((WARPGROUP,), value, dtype), layout)


# ----------------------------------------------------------------------------------------------------------
# Dequantize + unpack


def dequantize_unpack(
    codes: jax.Array,
    scales: jax.Array,
    table: BucketBlocks,
    shapes: Sequence[Sequence[int]],
    used: Sequence[int],
    *,
    dtype: Any,
    storage: Sequence[Any] = (),
    interpret: bool = False,
) -> list[jax.Array]:
    """The gathered codes and scales -> the bucket's non-empty leaves in ``dtype``, in one Mosaic GPU kernel.

    Args:
      codes: ``(m, S)`` ``float8_e4m3fn``, every device's codes.
      scales: ``(m, NB)`` fp32, every device's scales.
      table: the bucket's block index; :func:`takes` must hold.
      shapes: each slot's logical (per-layer) shape.
      used: the non-empty slots, in the order of ``table.leaves``.
      dtype: the leaves' dtype.
      storage: the bucket's ``storage``: a tile-major slot is written in its storage order by the kernel and
        relaid out row-major by XLA.
      interpret: run in Mosaic GPU's interpreter.

    Returns:
      The non-empty leaves (in ``used`` order) in their logical shapes, bit-exact
      :func:`vescale_jax.kernels._fp8.dequantize_unpack_reference`.

    Sharding:
      Replicated in, replicated out (after the all-gather): every device unpacks every leaf.
    """
    m, size = (int(d) for d in codes.shape)
    nb = int(scales.shape[1])
    pc = _pieces_or_refuse(table, size, "dequantize_unpack")
    dev = np.arange(m)[:, None]
    classes: list[tuple[str, int, int]] = []  # (kind, leaf, block length)
    parts: list[np.ndarray] = []
    for b, rows in pc.blocks.items():
        for j in range(len(table.leaves)):
            sel = rows[..., 2] == j
            if not sel.any():
                continue
            g = np.where(sel[..., None], rows, -1)
            g = np.stack([np.where(sel, g[..., 0] + dev * size, -1), g[..., 1] + dev * nb, g[..., 3]], -1)
            flat = g.reshape(-1, 3)
            parts.append(flat[flat[:, 0] >= 0][None])
            classes.append(("block", j, b))
    for j in range(len(table.leaves)):
        sel = pc.exact_leaf == j
        if not sel.any():
            continue
        e = pc.exact
        g = np.stack([e[..., 0] + dev * size, e[..., 1] + dev * nb, e[..., 2], e[..., 3]], -1)[sel]
        parts.append(g[None])
        classes.append(("exact", j, 0))
    tab, tstart = _table(parts)
    sizes = [p.shape[1] for p in parts]
    out_size = np.dtype(dtype).itemsize
    vecs = [
        _width(b, [p[..., 0], p[..., 2]], max(out_size, 1)) if kind == "block" else 1
        for (kind, _, b), p in zip(classes, parts, strict=True)
    ]
    n_leaves = len(table.leaves)

    def body(tab_ref, codes_ref, scales_ref, *out_refs):
        def block(c, i):
            _, j, b = classes[c]
            vec, out = vecs[c], out_refs[j]
            src, slot, dst = (tab_ref[tstart[c] + i * 3 + f] for f in range(3))
            scale = scales_ref[slot]

            def piece(at, tile, lay):
                v = jax.lax.bitcast_convert_type(mosaic_gpu_load(codes_ref, src + at, tile, lay), FP8)
                out[pl.ds(dst + at, tile)] = (v.astype(jnp.float32) * scale).astype(dtype)

            def one(e):
                out[dst + e] = (code_value(codes_ref[src + e].astype(jnp.int32)) * scale).astype(dtype)

            _static_run(b, vec, piece, one)

        def exact(c, i):
            out = out_refs[classes[c][1]]
            src, slot, dst, n = (tab_ref[tstart[c] + i * 4 + f] for f in range(4))
            lay = _strided(WARPGROUP, 1)

            def vector(at):
                v = jax.lax.bitcast_convert_type(mosaic_gpu_load(codes_ref, src + at, WARPGROUP, lay), FP8)
                s = mosaic_gpu_load(scales_ref, slot + at, WARPGROUP, lay)
                out[pl.ds(dst + at, WARPGROUP)] = (v.astype(jnp.float32) * s).astype(dtype)

            def scalar(e):
                v = code_value(codes_ref[src + e].astype(jnp.int32))
                out[dst + e] = (v * scales_ref[slot + e]).astype(dtype)

            _runs(n, vector, scalar)

        def emit(c, i):
            (block if classes[c][0] == "block" else exact)(c, i)

        _classes(sizes, emit)

    lbs = table.leaves
    flat = _call(
        body,
        [jax.ShapeDtypeStruct((math.prod(lb.shape),), dtype) for lb in lbs],
        sum(sizes),
        interpret,
        jnp.asarray(tab[0]),
        jax.lax.bitcast_convert_type(jnp.reshape(codes, (-1,)), jnp.uint8),
        jnp.reshape(scales, (-1,)),
    )
    flat = _vary(flat, [codes, scales])
    out = []
    for n, (x, i) in enumerate(zip(flat, used, strict=True)):
        shape, g = tuple(shapes[i]), (storage[i] if storage else None)
        assert n < n_leaves
        out.append(jnp.reshape(x, shape) if g is None else _tiles.from_storage(x, shape, g, jnp))
    return out
