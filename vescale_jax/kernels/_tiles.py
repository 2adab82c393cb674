"""Pack and unpack with the tile relayout inside the kernel (Triton or Mosaic GPU): tile-major slots never exist
row-major-flattened in XLA.

A leaf planned with ``vj.tiles(th, tw)`` is stored in its bucket tile by tile
(:mod:`vescale_jax.layout._tiles`). The plain kernels (:mod:`vescale_jax.kernels._ragged`) copy the flat
storage and leave the relayout to XLA (``to_storage`` before a pack, ``from_storage`` after an unpack: one
more copy of the leaf each way). Here one kernel does both: a program per *band* (rows of one tile,
:mod:`vescale_jax.kernels._bands`) reads it contiguous from the buffer and writes it strided by the leaf's
width into the logical leaf (unpack), or the reverse (pack, with padding written as zero). Row-major slots go in
flat chunks in the same launch. Casts are fused.

References: :func:`unpack_tiled_reference` (``unpack_reference`` then ``from_storage``) and
:func:`pack_tiled_reference` (``to_storage`` then ``pack_reference``); the kernels are bit-exact copies of them.
Backends: the interpreter and ``"triton"`` (per-lane gathers over bands); ``"mosaic_gpu"`` moves each tile row as
register vectors (:mod:`vescale_jax.kernels._tiles_mosaic`), compiled or in Mosaic GPU's own interpreter.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.kernels import _bands, _fused, _tiles_mosaic
from vescale_jax.kernels._reference import _check_layout, _leaf_dtype, pack_reference, unpack_reference
from vescale_jax.layout import _tiles
from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = [
    "pack_tiled",
    "pack_tiled_mapped",
    "pack_tiled_reference",
    "unpack_tiled",
    "unpack_tiled_mapped",
    "unpack_tiled_reference",
]


def _storage(storage: Sequence[Any], n: int) -> tuple[Any, ...]:
    storage = tuple(storage) or (None,) * n
    if len(storage) != n:
        raise ValueError(f"storage has {len(storage)} entries but the layout has {n} slots.")
    return storage


def _check_shapes(shapes: Sequence[Sequence[int]], layout: BucketLayout, what: str) -> list[tuple[int, ...]]:
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if len(shapes) != len(layout.sizes):
        raise ValueError(f"{what}: {len(shapes)} leaves but the layout has {len(layout.sizes)} slots.")
    for i, (s, n) in enumerate(zip(shapes, layout.sizes, strict=True)):
        if math.prod(s) != n:
            raise ValueError(f"{what}: leaf {i} has shape {s} ({math.prod(s)} elements), the layout gives {n}.")
    _check_layout(layout, what)
    return shapes


def unpack_tiled_reference(
    buffer: jax.Array,
    layout: BucketLayout,
    shapes: Sequence[Sequence[int]],
    *,
    storage: Sequence[Any] = (),
    dtype: Any = None,
) -> list[jax.Array]:
    """Static slices (:func:`~vescale_jax.kernels.unpack_reference`), then ``from_storage`` for tile-major
    slots: the logical leaves in slot order."""
    storage = _storage(storage, len(layout.sizes))
    flat = unpack_reference(buffer, layout, [(n,) for n in layout.sizes], dtype=dtype)
    return [
        jnp.reshape(x, tuple(s)) if g is None else _tiles.from_storage(x, tuple(s), g, jnp)
        for x, s, g in zip(flat, shapes, storage, strict=True)
    ]


def pack_tiled_reference(
    leaves: Sequence[jax.Array], layout: BucketLayout, *, storage: Sequence[Any] = (), dtype: Any = None
) -> jax.Array:
    """``to_storage`` for tile-major slots, then one concatenate (:func:`~vescale_jax.kernels.pack_reference`)."""
    storage = _storage(storage, len(layout.sizes))
    flat = [x if g is None else _tiles.to_storage(x, x.shape, g, jnp) for x, g in zip(leaves, storage, strict=True)]
    return pack_reference(flat, layout, dtype=dtype)


def _mosaic_interpret(interpret: bool | None) -> bool:
    """Mosaic GPU's interpreter when asked, or by default on CPU."""
    return jax.default_backend() == "cpu" if interpret is None else bool(interpret)


def _copy_body(cls, row, in_refs, out_refs):
    src_ref, dst_ref = in_refs[cls.src_ref], out_refs[cls.dst_ref]
    ln = _fused.lanes(cls, row, src_ref, dst_ref)
    _fused.store(dst_ref, ln.dst, _fused.load(src_ref, ln.src, ln.valid), ln.valid)


def unpack_tiled(
    buffer: jax.Array,
    layout: BucketLayout,
    shapes: Sequence[Sequence[int]],
    *,
    storage: Sequence[Any] = (),
    dtype: Any = None,
    interpret: bool | None = None,
    backend: str | None = None,
    chunk: int | None = None,
) -> list[jax.Array]:
    """A bucket's leaves from its ``(total_size,)`` buffer in one kernel, tile-major slots written row-major.

    Args:
      buffer: the bucket buffer.
      layout: the bucket layout.
      shapes: each slot's logical shape.
      storage: the bucket's ``storage`` (per slot: the ``vj.tiles`` granularity of a tile-major slot, or None).
      dtype: the leaves' dtype (default the buffer's); the cast is fused.
      interpret: run in the Pallas interpreter; None means on CPU.
      backend: ``"triton"`` (default) when compiled, or ``"mosaic_gpu"`` (compiled; in Mosaic GPU's own
        interpreter with ``interpret=True``, None meaning on CPU).
      chunk: most elements of one unit's register block (Triton and the Pallas interpreter).

    Returns:
      The leaves in slot order, bit-exact :func:`unpack_tiled_reference`.
    """
    shapes = _check_shapes(shapes, layout, "unpack_tiled")
    if tuple(buffer.shape) != (layout.total_size,):
        raise ValueError(f"unpack_tiled: buffer of shape {buffer.shape}, the layout needs ({layout.total_size},).")
    dtype = buffer.dtype if dtype is None else np.dtype(dtype)
    storage = _storage(storage, len(shapes))
    used = [i for i, n in enumerate(layout.sizes) if n]
    out: list[Any] = [jnp.zeros(s, dtype) for s in shapes]
    if not used:
        return out
    if backend == "mosaic_gpu":
        leaves = _tiles_mosaic.unpack_tiled(
            buffer, layout, shapes, storage=storage, dtype=dtype, interpret=_mosaic_interpret(interpret)
        )
        for i, x in zip(used, leaves, strict=True):
            out[i] = x
        return out
    interpret, backend = _fused.resolve(interpret, backend, "unpack_tiled")
    chunk = chunk or _fused.DEFAULT_UNIT[backend]
    units = _bands.copy_units(layout.sizes, layout.offsets, shapes, storage, chunk=chunk, to_buffer=False)
    flat = _fused.launch(
        units,
        jnp.asarray(units.table),
        _copy_body,
        [buffer],
        [jax.ShapeDtypeStruct((layout.sizes[i],), dtype) for i in used],
        interpret=interpret,
    )
    for i, x in zip(used, flat, strict=True):
        out[i] = jnp.reshape(x, shapes[i])
    return out


def pack_tiled(
    leaves: Sequence[jax.Array],
    layout: BucketLayout,
    *,
    storage: Sequence[Any] = (),
    dtype: Any = None,
    interpret: bool | None = None,
    backend: str | None = None,
    chunk: int | None = None,
) -> jax.Array:
    """A bucket's ``(total_size,)`` buffer from its logical leaves in one kernel, tile-major slots written
    tile by tile; padding is zero.

    Args:
      leaves: one array per slot, its logical shape.
      layout: the bucket layout.
      storage: the bucket's ``storage``.
      dtype: the buffer's dtype (default the leaves' common dtype); the cast is fused.
      interpret, backend, chunk: as :func:`unpack_tiled`.

    Returns:
      The buffer, bit-exact :func:`pack_tiled_reference`.
    """
    shapes = _check_shapes([np.shape(x) for x in leaves], layout, "pack_tiled")
    dtype = _leaf_dtype(leaves, dtype)
    storage = _storage(storage, len(shapes))
    used = [i for i, n in enumerate(layout.sizes) if n]
    if not used:
        return jnp.zeros((layout.total_size,), dtype)
    if backend == "mosaic_gpu":
        return _tiles_mosaic.pack_tiled(
            leaves, layout, storage=storage, dtype=dtype, interpret=_mosaic_interpret(interpret)
        )
    interpret, backend = _fused.resolve(interpret, backend, "pack_tiled")
    chunk = chunk or _fused.DEFAULT_UNIT[backend]
    units = _bands.copy_units(layout.sizes, layout.offsets, shapes, storage, chunk=chunk, to_buffer=True)
    (buf,) = _fused.launch(
        units,
        jnp.asarray(units.table),
        _copy_body,
        [jnp.reshape(leaves[i], (-1,)) for i in used],
        [jax.ShapeDtypeStruct((layout.total_size,), dtype)],
        interpret=interpret,
        zero_init=(0,) if sum(layout.sizes) < layout.total_size else (),
    )
    return buf


def unpack_tiled_mapped(
    full: jax.Array, layout: BucketLayout, shapes: Sequence[Sequence[int]], **kwargs: Any
) -> list[jax.Array]:
    """:func:`unpack_tiled` mapped over the leading dims of a ``(*lead, total_size)`` buffer (the layers of a
    stacked bucket); ``shapes`` include the leading dims."""
    lead = tuple(full.shape[:-1])
    per = [tuple(s)[len(lead) :] for s in shapes]
    fn = lambda f: unpack_tiled(f, layout, per, **kwargs)
    for _ in lead:
        fn = jax.vmap(fn)
    return list(fn(full))


def pack_tiled_mapped(
    leaves: Sequence[jax.Array], layout: BucketLayout, *, lead: tuple[int, ...] = (), **kwargs: Any
) -> jax.Array:
    """:func:`pack_tiled` mapped over ``lead`` leading dims of every leaf: a ``(*lead, total_size)`` buffer."""
    fn = lambda *xs: pack_tiled(xs, layout, **kwargs)
    for _ in lead:
        fn = jax.vmap(fn)
    return fn(*leaves)
