"""Which mesh axes a collective's replica groups span."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["group_axes"]


def group_axes(op: Any, mesh: Any) -> tuple[str, ...]:
    """The mesh axes a collective runs over: its replica groups are exactly the sets of devices that differ
    only in those axes' coordinates.

    Args:
        op: a :class:`~vescale_jax.testing.CollectiveOp` of a module compiled over ``mesh`` (or anything with a
            ``replica_groups`` attribute: tuples of device ids).
        mesh: the ``jax.sharding.Mesh`` the program was compiled for. Device ids in SPMD replica groups are
            partition ids, i.e. positions in ``mesh.devices.flat`` order (not ``jax.Device.id``).

    Returns:
        The spanned axes in mesh order (``()`` for groups of one device). Size-1 mesh axes are never listed.

    Raises:
        ValueError: when the op has no parsed groups, an id is outside the mesh, or the groups are not whole
            sub-meshes over one set of axes (e.g. a group of devices ``{0, 5}`` on a 2×4 mesh), naming the group.
    """
    groups = getattr(op, "replica_groups", None)
    name = getattr(op, "name", "the op")
    if groups is None:
        raise ValueError(f"group_axes: {name} has no parsed replica groups (a collective-permute, or an unparsed form)")
    shape = tuple(mesh.devices.shape)
    total = int(np.prod(shape))
    names = tuple(mesh.axis_names)
    spanned: set[str] | None = None
    seen: set[int] = set()
    for group in groups:
        if any(d < 0 or d >= total for d in group):
            raise ValueError(f"group_axes: {name}'s group {group} names a device outside the {total}-device mesh")
        coords = np.array(np.unravel_index(np.asarray(group, np.int64), shape)).T.reshape(len(group), len(shape))
        varying = {names[a] for a in range(len(shape)) if len(set(coords[:, a])) > 1}
        expected = int(np.prod([shape[names.index(a)] for a in varying])) if varying else 1
        distinct = {tuple(c) for c in coords}
        if len(distinct) != len(group) or len(group) != expected or (spanned is not None and varying != spanned):
            raise ValueError(
                f"group_axes: {name}'s replica group {group} is not a whole sub-mesh over one set of axes of the "
                f"mesh {dict(zip(names, shape, strict=True))} (it varies over {sorted(varying)})"
            )
        spanned = varying
        seen.update(group)
    if len(seen) != total:
        raise ValueError(f"group_axes: {name}'s replica groups cover {len(seen)} of the mesh's {total} devices")
    return tuple(a for a in names if a in (spanned or set()))
