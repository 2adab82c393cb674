"""Tensor and expert parallelism under the FSDP layout: a leaf's ``PartitionSpec`` over the non-FSDP mesh axes.

A leaf whose dims are split over ``tensor`` or ``expert`` mesh axes is first cut into its TP/EP shards (each
device of a *group* of those axes holds one); every group then lays its shards out ragged over the FSDP axis,
with one layout shared by all groups. A bucket holds the leaves of one set of group axes only, so its global
buffer is ``G`` copies of one layout side by side::

    global buffer (G*m*S,)   [ group 0: m*S | group 1: m*S | ... ]      PartitionSpec((*groups, *fsdp))

and inside ``shard_map`` each device sees its ``(S,)`` shard of its own group's bucket: the FSDP all-gather and
reduce-scatter run over the FSDP axis only, the model sees TP-local leaves, and a bucket of leaves replicated
over ``tensor`` stays invariant over it (its gradient sums over ``tensor`` are autodiff's, where the model mixes
it with tensor-varying values, as in any ``shard_map`` model).

Pure index math on shapes and mesh axis sizes; :func:`local_block` / :func:`assemble` are the jnp slices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["DimAxes", "assemble", "group_coords", "local_block", "local_shape", "normalize"]

DimAxes = tuple[tuple[str, ...], ...]
"""Per dim of a leaf, the mesh axes it is split over (major first); ``()`` for a dim that is not split. A leaf
with no split dim has ``tp == ()``."""


def normalize(
    spec: Any,
    shape: tuple[int, ...],
    sizes: Mapping[str, int],
    *,
    drop: Sequence[str],
    path: str,
    stacked: bool,
) -> DimAxes:
    """A leaf's ``PartitionSpec`` as :data:`DimAxes` over the mesh axes not in ``drop`` (the FSDP and replica
    axes, which the FSDP layout owns); checked.

    Raises:
      ValueError: naming the leaf, its shape and the spec, for an axis not in the mesh, an axis used twice, a
        spec longer than the leaf, a dim not divisible by its axes' size, or a split layer dim.
    """
    if spec is None:
        return ()
    if isinstance(spec, str):
        spec = jax.sharding.PartitionSpec(spec)
    if not isinstance(spec, jax.sharding.PartitionSpec):
        raise TypeError(
            f"vj.plan: tp= gives leaf {path!r} {spec!r}; give a jax.sharding.PartitionSpec (or None for a leaf "
            "that is not split over tensor or expert axes)."
        )
    entries = tuple(spec)
    if len(entries) > len(shape):
        raise ValueError(
            f"vj.plan: leaf {path!r} has shape {shape} but its spec {spec} names {len(entries)} dims; give one "
            "entry per dim at most."
        )
    seen: set[str] = set()
    out: list[tuple[str, ...]] = []
    for d, entry in enumerate(entries + (None,) * (len(shape) - len(entries))):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        for a in axes:
            if a not in sizes:
                raise ValueError(
                    f"vj.plan: leaf {path!r} (shape {shape}) has spec {spec}, which names mesh axis {a!r}; the mesh "
                    f"has axes {tuple(sizes)}. Name one of them, or build the mesh with a {a!r} axis."
                )
            if a in seen:
                raise ValueError(
                    f"vj.plan: leaf {path!r} (shape {shape}) has spec {spec}, which names mesh axis {a!r} twice; a "
                    "mesh axis splits one dim of a leaf at most: name it once."
                )
            seen.add(a)
        axes = tuple(a for a in axes if a not in drop)
        n = math.prod(sizes[a] for a in axes)
        if axes and stacked and d == 0:
            raise ValueError(
                f"vj.plan: leaf {path!r} (shape {shape}) is in a stacked layer group, and its spec {spec} splits "
                f"the layer dim over {axes}; split another dim (the layer dim is scanned over)."
            )
        if axes and shape[d] % n:
            raise ValueError(
                f"vj.plan: leaf {path!r} has shape {shape}; its dim {d} ({shape[d]}) is split over {axes} "
                f"({n} shards) by spec {spec}, but {shape[d]} is not a multiple of {n}. Choose a mesh whose "
                f"{'/'.join(axes)} size divides {shape[d]}, or leave that dim unsplit."
            )
        out.append(axes)
    return tuple(out) if any(out) else ()


def misaligned_split(
    dims: DimAxes, shape: tuple[int, ...], block: tuple[int, int], *, stacked: bool
) -> tuple[int, int, tuple[str, ...]] | None:
    """The first of a shard's last two dims that is split over tensor / expert axes but not a multiple of the
    2-D ``block``'s extent there, as ``(dim, extent, axes)`` (``None`` if there is none): a shard whose edge
    blocks are not blocks of the logical leaf. ``shape`` is the shard's per-layer shape; ``dims`` the leaf's
    split."""
    dims = dims[1:] if stacked and dims else dims
    for d in range(max(0, len(dims) - 2), len(dims)):
        extent = block[d - (len(dims) - 2)]
        if dims[d] and shape[d] % extent:
            return d, extent, dims[d]
    return None


def group_axes(dims: DimAxes, order: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes a leaf is split over, in the mesh's axis order (its bucket's group axes)."""
    used = {a for axes in dims for a in axes}
    return tuple(a for a in order if a in used)


def local_shape(shape: tuple[int, ...], dims: DimAxes, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The shape of one TP/EP shard of a leaf."""
    if not dims:
        return shape
    return tuple(n // math.prod(sizes[a] for a in axes) for n, axes in zip(shape, dims, strict=True))


def group_coords(g: int, groups: Sequence[str], sizes: Mapping[str, int]) -> dict[str, int]:
    """The coordinate on each group axis of group ``g`` (row-major over ``groups``, as ``PartitionSpec`` orders
    the axes of one dim)."""
    out: dict[str, int] = {}
    for a in reversed(groups):
        g, out[a] = divmod(g, sizes[a])
    return out


def _starts(shape, dims, coords, sizes):
    starts = []
    for n, axes in zip(shape, dims, strict=True):
        index = 0
        for a in axes:
            index = index * sizes[a] + coords[a]
        starts.append(index * (n // math.prod(sizes[a] for a in axes)))
    return starts


def local_block(x: jax.Array, dims: DimAxes, coords: Mapping[str, int], sizes: Mapping[str, int]) -> jax.Array:
    """The TP/EP shard of the full leaf ``x`` that the group at ``coords`` holds (a static slice)."""
    if not dims:
        return x
    lead = x.ndim - len(dims)
    local = local_shape(tuple(x.shape[lead:]), dims, sizes)
    starts = _starts(tuple(x.shape[lead:]), dims, coords, sizes)
    return jax.lax.slice(
        x, (0,) * lead + tuple(starts), tuple(x.shape[:lead]) + tuple(s + n for s, n in zip(starts, local, strict=True))
    )


def assemble(
    blocks: Sequence[jax.Array],
    shape: tuple[int, ...],
    dims: DimAxes,
    groups: Sequence[str],
    sizes: Mapping[str, int],
) -> jax.Array:
    """The full leaf from its groups' shards (``blocks[g]`` of group ``g``); the inverse of
    :func:`local_block`. A group axis the leaf is not split over holds equal copies: the first is taken."""
    if not dims:
        return blocks[0]
    lead = blocks[0].ndim - len(dims)
    counts = [math.prod(sizes[a] for a in axes) for axes in dims]
    by_index: dict[tuple[int, ...], jax.Array] = {}
    for g, block in enumerate(blocks):
        coords = group_coords(g, groups, sizes)
        starts = _starts(shape, dims, coords, sizes)
        index = tuple(s // (n // c) for s, n, c in zip(starts, shape, counts, strict=True))
        by_index.setdefault(index, block)

    def join(prefix: tuple[int, ...]) -> jax.Array:
        d = len(prefix)
        if d == len(dims):
            return by_index[prefix]
        parts = [join((*prefix, i)) for i in range(counts[d])]
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=lead + d)

    return join(())
