"""FP8 block quantization fused into the wire's pack, dequantization fused into the unpack (Pallas, Triton).

The FP8 block-scaled gather (``vj.MixedPrecision(fp8_gather=(bh, bw))``, :mod:`vescale_jax.step._fp8`) sends
each device's ``(S,)`` shard as ``float8_e4m3fn`` codes and one fp32 scale per ``bh × bw`` block::

    scale = max|x| over the block * fp32(1/448)      code = fp8(x / scale)      x' = code * scale

(an exact leaf's elements are one-element blocks with ``scale = x``, ``code = 1``; a zero block has scale and
codes 0; padding gets codes 0 and the last scale slot, 0). :func:`quantize_reference` and
:func:`dequantize_reference` are that, in plain jnp over the block index's slot of every element.

:func:`quantize` is one kernel from the local shard to (codes, scales): a program per *band* unit (``bh`` rows
of a leaf, or of one of its storage tiles, and a group of whole column blocks: :mod:`vescale_jax.kernels._bands`)
loads the band as a ``(R, B, C)`` block (rows, column blocks, columns of a block), takes the per-block max over
rows and columns, writes the ``B`` scales at consecutive slots and the codes in place; exact leaves go in flat
units. :func:`dequantize_unpack` is one kernel from the gathered codes and scales to the leaves in the compute
dtype, writing each band at its *logical* (row-major) place, so a tile-major leaf is relaid out in the same
pass. Both are bit-exact against the references (same fp32 operations per element).

Backends: the interpreter and ``"triton"`` for every bucket the band units take (:func:`supported`);
``"mosaic_gpu"`` (no per-lane gathers) for the buckets whose blocks are contiguous runs
(:func:`vescale_jax.kernels._fp8_mosaic.takes`: tile-major leaves whose tiles are the blocks' row bands, blocks of
whole rows, exact leaves), by :mod:`vescale_jax.kernels._fp8_mosaic`, else ``NotImplementedError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.kernels import _bands, _fp8_mosaic, _fused
from vescale_jax.kernels._reference import unpack_reference
from vescale_jax.layout import _tiles
from vescale_jax.layout._blocks import BucketBlocks, local_slots
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = [
    "FP8",
    "dequantize_reference",
    "dequantize_unpack",
    "dequantize_unpack_reference",
    "num_blocks",
    "quantize",
    "quantize_reference",
    "supported",
]

QMAX = 448.0
FP8 = jnp.float8_e4m3fn
_INV_QMAX = np.float32(1.0 / QMAX)


def num_blocks(table: BucketBlocks) -> int:
    """``NB``: scale slots per device on the wire: the most blocks any device holds, plus one for padding."""
    return table.nb + 1


def _ids(table: BucketBlocks, k: Any, size: int) -> jax.Array:
    """``(S,)`` int32: the block (slot) of each local element of device ``k`` (``NB - 1`` at padding)."""
    return local_slots(table, k, size, xp=jnp)


# ----------------------------------------------------------------------------------------------------------
# References (plain jnp)


def quantize_reference(x: jax.Array, table: BucketBlocks, k: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Device ``k``'s local ``(S,)`` shard -> (``(S,)`` fp8 codes, ``(NB,)`` fp32 scales), by segment reductions
    over each element's slot.

    Sharding:
      ``x`` is device ``k``'s ``[k*S, (k+1)*S)`` of the bucket (``k`` its position on the plan's axis).
    """
    nb = num_blocks(table)
    xf = x.astype(jnp.float32)
    ids = _ids(table, k, x.shape[-1])
    exact = jnp.asarray(table.exact_slots)[k][ids]
    amax = jax.ops.segment_max(jnp.abs(xf), ids, num_segments=nb)
    amax = jnp.where(amax > 0, amax, jnp.float32(0))  # empty segments: -inf
    value = jax.ops.segment_sum(jnp.where(exact, xf, 0), ids, num_segments=nb)
    is_exact = jax.ops.segment_max(exact.astype(jnp.int32), ids, num_segments=nb) > 0
    scales = jnp.where(is_exact, value, amax * _INV_QMAX)
    s = scales[ids]
    y = jnp.where(exact, jnp.float32(1), xf / jnp.where(s != 0, s, jnp.float32(1)))
    y = jnp.where(exact | (s != 0), y, jnp.float32(0))
    return y.astype(FP8), scales


def dequantize_reference(codes: jax.Array, scales: jax.Array, table: BucketBlocks, dtype: Any) -> jax.Array:
    """``(m, S)`` gathered codes and ``(m, NB)`` scales -> the ``(m*S,)`` buffer in ``dtype``."""
    m, s = codes.shape
    ids = jax.vmap(lambda k: _ids(table, k, s))(jnp.arange(m))
    out = codes.astype(jnp.float32) * jnp.take_along_axis(scales, ids, axis=1)
    return jnp.reshape(out, (m * s,)).astype(dtype)


def dequantize_unpack_reference(
    codes: jax.Array,
    scales: jax.Array,
    table: BucketBlocks,
    layout: BucketLayout,
    shapes: Sequence[Sequence[int]],
    *,
    dtype: Any,
    storage: Sequence[Any] = (),
) -> list[jax.Array]:
    """:func:`dequantize_reference`, :func:`~vescale_jax.kernels.unpack_reference` and, for tile-major slots,
    :func:`vescale_jax.layout._tiles.from_storage`: the leaves in slot order, logical shapes, ``dtype``."""
    full = dequantize_reference(codes, scales, table, dtype)
    flat = unpack_reference(full, layout, [(n,) for n in layout.sizes])
    storage = storage or (None,) * len(flat)
    return [
        jnp.reshape(x, tuple(s)) if g is None else _tiles.from_storage(x, tuple(s), g, jnp)
        for x, s, g in zip(flat, shapes, storage, strict=True)
    ]


# ----------------------------------------------------------------------------------------------------------
# Kernels


def supported(table: BucketBlocks, size: int) -> bool:
    """Whether the fused kernels take this bucket: every device's blocks lie in whole bands. Not so for a
    tile-major leaf on one device whose storage tiles are not multiples of the block (a block spans tiles);
    the XLA path takes those."""
    try:
        _bands.quantize_units(table, size, chunk=_fused.DEFAULT_UNIT["triton"])
    except NotImplementedError:
        return False
    return True


def _quantize_body(cls, row, in_refs, out_refs):
    (x_ref,) = in_refs
    codes_ref, scales_ref = out_refs
    ln = _fused.lanes(cls, row, x_ref, codes_ref)
    xf = _fused.load(x_ref, ln.src, ln.valid).astype(jnp.float32)
    slots = jnp.where(ln.block_valid, row[2] + ln.blocks, scales_ref.shape[0])
    if cls.kind == _bands.FLAT:  # exact leaves: one-element blocks, scale = x (+0.0 for -0.0, as a sum does)
        scale = jnp.where(xf == 0, jnp.float32(0), xf)
        code = jnp.ones_like(xf)
    else:
        amax = jnp.max(jnp.max(jnp.abs(xf), axis=2), axis=0)
        scale = jnp.where(amax > 0, amax, jnp.float32(0)) * _INV_QMAX
        s = ln.per_block(scale)
        code = jnp.where(s != 0, xf / jnp.where(s != 0, s, jnp.float32(1)), jnp.float32(0))
    _fused.store(scales_ref, slots, scale, ln.block_valid)
    _fused.store(codes_ref, ln.dst, code.astype(FP8), ln.valid)


def quantize(
    x: jax.Array,
    table: BucketBlocks,
    k: jax.Array | int,
    *,
    interpret: bool | None = None,
    backend: str | None = None,
    chunk: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """FP8 block quantization of device ``k``'s local shard in one kernel (the wire's content).

    Args:
      x: the ``(S,)`` local shard (bf16, fp32, ...); its padding is zero (the shards' invariant).
      table: the bucket's block index (:func:`vescale_jax.step._fp8.block_table`).
      k: the device's position on the plan's axis (``jax.lax.axis_index`` inside ``shard_map``).
      interpret: run in the Pallas interpreter; None means on CPU.
      backend: ``"triton"`` (default) when compiled; ``"mosaic_gpu"`` for a bucket
        :func:`vescale_jax.kernels._fp8_mosaic.takes` (else NotImplementedError), compiled, or in Mosaic GPU's
        own interpreter with ``interpret=True`` (None: on CPU).
      chunk: most elements of one unit's register block (default ``_fused.DEFAULT_UNIT``).

    Returns:
      ``(S,)`` ``float8_e4m3fn`` codes and ``(NB,)`` fp32 scales, bit-exact :func:`quantize_reference`.

    Sharding:
      Inside ``shard_map``: ``x`` is device ``k``'s ``[k*S, (k+1)*S)``; the device's units are row ``k`` of a
      static ``(m, U, 5)`` table, so one program serves every device.
    """
    if backend == "mosaic_gpu":
        return _fp8_mosaic.quantize(x, table, k, interpret=_mosaic_interpret(interpret))
    interpret, backend = _fused.resolve(interpret, backend, "quantize")
    if x.ndim != 1:
        raise ValueError(f"quantize: expects one (S,) shard, got shape {x.shape}; vmap over stacked layers.")
    size = int(x.shape[0])
    units = _bands.quantize_units(table, size, chunk=chunk or _fused.DEFAULT_UNIT[backend])
    rows = jnp.asarray(units.table)[k]
    codes, scales = _fused.launch(
        units,
        rows,
        _quantize_body,
        [x],
        [jax.ShapeDtypeStruct((size,), FP8), jax.ShapeDtypeStruct((num_blocks(table),), jnp.float32)],
        interpret=interpret,
        zero_init=(0, 1),
    )
    return codes, scales


def _mosaic_interpret(interpret: bool | None) -> bool:
    """Mosaic GPU's interpreter when asked, or by default on CPU."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _dequantize_body(cls, row, in_refs, out_refs):
    codes_ref, scales_ref = in_refs
    out_ref = out_refs[cls.dst_ref]
    ln = _fused.lanes(cls, row, codes_ref, out_ref)
    code = _fused.load(codes_ref, ln.src, ln.valid).astype(jnp.float32)
    slots = jnp.where(ln.block_valid, row[2] + ln.blocks, scales_ref.shape[0])
    scale = _fused.load(scales_ref, slots, ln.block_valid)
    _fused.store(out_ref, ln.dst, code * ln.per_block(scale), ln.valid)


def dequantize_unpack(
    codes: jax.Array,
    scales: jax.Array,
    table: BucketBlocks,
    layout: BucketLayout,
    shapes: Sequence[Sequence[int]],
    *,
    dtype: Any,
    storage: Sequence[Any] = (),
    interpret: bool | None = None,
    backend: str | None = None,
    chunk: int | None = None,
) -> list[jax.Array]:
    """The gathered codes and scales -> the bucket's leaves in ``dtype``, in one kernel.

    Args:
      codes: ``(m, S)`` ``float8_e4m3fn``, every device's codes.
      scales: ``(m, NB)`` fp32, every device's scales.
      table: the bucket's block index.
      layout: the bucket layout.
      shapes: each slot's logical (per-layer) shape.
      dtype: the leaves' dtype (the compute dtype).
      storage: the bucket's ``storage``: tile-major slots are written row-major (the relayout is fused).
      interpret, backend, chunk: as :func:`quantize`.

    Returns:
      The leaves in slot order, bit-exact :func:`dequantize_unpack_reference`.

    Sharding:
      Replicated in, replicated out (after the all-gather): every device unpacks every leaf.
    """
    if backend != "mosaic_gpu":
        interpret, backend = _fused.resolve(interpret, backend, "dequantize_unpack")
    m, size = (int(d) for d in codes.shape)
    if tuple(scales.shape) != (m, num_blocks(table)):
        raise ValueError(f"dequantize_unpack: scales {scales.shape}, expected {(m, num_blocks(table))}.")
    shapes = [tuple(int(d) for d in s) for s in shapes]
    used = [i for i, n in enumerate(layout.sizes) if n]
    if len(used) != len(table.leaves):
        raise ValueError("dequantize_unpack: the block index and the layout disagree on the non-empty slots.")
    for i, lb in zip(used, table.leaves, strict=True):
        if math.prod(shapes[i]) != math.prod(lb.shape) or (storage and storage[i] != lb.storage):
            raise ValueError(f"dequantize_unpack: slot {i} has shape {shapes[i]}, the block index {lb.shape}.")
    if backend == "mosaic_gpu":
        leaves = _fp8_mosaic.dequantize_unpack(
            codes, scales, table, shapes, used, dtype=dtype, storage=storage, interpret=_mosaic_interpret(interpret)
        )
        out_m: list[Any] = [jnp.zeros(s, dtype) for s in shapes]
        for i, x in zip(used, leaves, strict=True):
            out_m[i] = x
        return out_m
    units = _bands.dequantize_units(table, size, chunk=chunk or _fused.DEFAULT_UNIT[backend])
    flat = _fused.launch(
        units,
        jnp.asarray(units.table),
        _dequantize_body,
        [jnp.reshape(codes, (-1,)), jnp.reshape(scales, (-1,))],
        [jax.ShapeDtypeStruct((layout.sizes[i],), dtype) for i in used],
        interpret=interpret,
    )
    out: list[Any] = [jnp.zeros(s, dtype) for s in shapes]
    for i, x in zip(used, flat, strict=True):
        out[i] = jnp.reshape(x, shapes[i])
    return out
