"""Plain-jnp pack / unpack: what XLA does on its own (a concatenate, static slices), and the kernels' reference.

Both stand alone on a :class:`vescale_jax.BucketLayout`; the scale and cast semantics here are the
ones the kernels in :mod:`vescale_jax.kernels.ragged` fuse.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.layout._bucket_layout import BucketLayout

__all__ = ["pack_reference", "unpack_reference"]

Scale = float | jax.Array | None


def _convert(x: jax.Array, dtype: Any, scale: Any) -> jax.Array:
    """``x * scale`` (in float32 or wider) cast to ``dtype``; a plain cast without a scale."""
    if scale is None:
        return x if x.dtype == dtype else x.astype(dtype)
    compute = x.dtype if np.dtype(x.dtype).itemsize > 4 else np.dtype(np.float32)
    return (x.astype(compute) * jnp.asarray(scale).astype(compute)).astype(dtype)


def _leaf_dtype(leaves: Sequence[Any], dtype: Any) -> np.dtype:
    if dtype is not None:
        return np.dtype(dtype)
    kinds = {np.dtype(x.dtype) for x in leaves}
    if len(kinds) != 1:
        raise ValueError(f"pack: leaves have dtypes {sorted(d.name for d in kinds)}; pass dtype= explicitly.")
    return kinds.pop()


def _check_layout(layout: BucketLayout, what: str) -> None:
    """Every slot inside ``[0, total_size)`` and no two overlapping (``pack``'s schedule checks the same)."""
    end = 0
    for i in sorted(range(len(layout.sizes)), key=lambda i: (layout.offsets[i], layout.sizes[i])):
        o, n = layout.offsets[i], layout.sizes[i]
        if o < 0 or n < 0:
            raise ValueError(f"{what}: layout slot {i} has offset {o} and size {n}; both must be >= 0.")
        if n and o < end:
            raise ValueError(
                f"{what}: layout slot {i} at offset {o} overlaps the previous leaf (ending at {end}); build the "
                "layout with vj.plan_bucket."
            )
        if o + n > layout.total_size:
            raise ValueError(
                f"{what}: layout slot {i} ends at element {o + n} (offset {o} + size {n}), past the buffer's "
                f"{layout.total_size} elements (num_devices {layout.num_devices} x shard_size {layout.shard_size}); "
                "build the layout with vj.plan_bucket."
            )
        end = max(end, o + n)


def _check_leaves(leaves: Sequence[Any], layout: BucketLayout, what: str) -> None:
    if len(leaves) != len(layout.sizes):
        raise ValueError(f"{what}: {len(leaves)} leaves but the layout has {len(layout.sizes)} slots.")
    _check_layout(layout, what)
    for i, (x, n) in enumerate(zip(leaves, layout.sizes, strict=True)):
        if math.prod(np.shape(x)) != n:
            raise ValueError(
                f"{what}: leaf {i} has shape {tuple(np.shape(x))} ({math.prod(np.shape(x))} elements), "
                f"but the layout gives slot {i} {n} elements."
            )


def pack_reference(
    leaves: Sequence[jax.Array], layout: BucketLayout, *, dtype: Any = None, scale: Scale = None
) -> jax.Array:
    """Pure-jnp pack: one concatenate of the flattened (scaled, cast) leaves and zero padding.

    Args:
      leaves: one array per layout slot, any shape with ``layout.sizes[i]`` elements.
      layout: the bucket layout.
      dtype: buffer dtype (default: the leaves' common dtype).
      scale: multiply each leaf by this (in float32 or wider) before the cast.

    Returns:
      The ``(layout.total_size,)`` buffer.
    """
    _check_leaves(leaves, layout, "pack_reference")
    dtype = _leaf_dtype(leaves, dtype)
    pieces, cursor = [], 0
    for i in sorted(range(len(leaves)), key=lambda i: layout.offsets[i]):
        n, o = layout.sizes[i], layout.offsets[i]
        if not n:
            continue
        if o > cursor:
            pieces.append(jnp.zeros((o - cursor,), dtype))
        pieces.append(_convert(jnp.reshape(leaves[i], (n,)), dtype, scale))
        cursor = o + n
    if layout.total_size > cursor:
        pieces.append(jnp.zeros((layout.total_size - cursor,), dtype))
    if not pieces:
        return jnp.zeros((0,), dtype)
    return jnp.concatenate(pieces) if len(pieces) > 1 else pieces[0]


def unpack_reference(
    buffer: jax.Array, layout: BucketLayout, shapes: Sequence[Sequence[int]], *, dtype: Any = None
) -> list[jax.Array]:
    """Pure-jnp unpack: a static slice, reshape and cast per leaf.

    Args:
      buffer: the ``(layout.total_size,)`` buffer.
      layout: the bucket layout.
      shapes: each leaf's shape (``layout.sizes[i]`` elements).
      dtype: leaf dtype (default: the buffer's).

    Returns:
      The leaves, in slot order.
    """
    _check_unpack(buffer, layout, shapes, "unpack_reference")
    dtype = buffer.dtype if dtype is None else np.dtype(dtype)
    return [
        _convert(jnp.reshape(jax.lax.slice_in_dim(buffer, o, o + n), tuple(shape)), dtype, None)
        for o, n, shape in zip(layout.offsets, layout.sizes, shapes, strict=True)
    ]


def _check_unpack(buffer: Any, layout: BucketLayout, shapes: Sequence[Sequence[int]], what: str) -> None:
    if tuple(np.shape(buffer)) != (layout.total_size,):
        raise ValueError(
            f"{what}: buffer has shape {tuple(np.shape(buffer))}, the layout needs "
            f"({layout.total_size},); unpack one layer of a stacked bucket at a time (or vmap)."
        )
    _check_leaves([np.empty(tuple(s), np.int8) for s in shapes], layout, what)
