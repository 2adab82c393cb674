"""Collective kinds, replica-group sizes as XLA prints them, and ring wire bytes per device."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np

from vescale_jax.testing._shapes import _split_top

__all__ = ["KINDS", "parse_replica_group_size", "parse_replica_groups", "wire_bytes"]

#: Collective kinds the census reports, in table order.
KINDS: tuple[str, ...] = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(.*?)\}(?=,\s*[a-z_]+=|\s*$)")
# XLA's mesh-axes form: mesh['a'=2,'b'=4] {'a'}, optionally with ", device_ids=(...)" after the mesh (an iota
# [2,4]T(1,0) or explicit ids) and sub-axes written 'a':(pre_size)size.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"^'?([^'=:]+?)'?(?::\((\d+)\)(\d+))?$")
# The iota device list of the mesh form: reshape dims, then an optional transpose (as in a tile assignment).
_IOTA_IDS = re.compile(r"(?:\[[\d,\s]*\]<=)?\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}(?=,\s*[a-z_]+=|\s*$)")


def _ints(text: str) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text)]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    """``arange(prod(dims))`` reshaped to ``dims``, transposed by ``perm``, flattened."""
    ids = np.arange(math.prod(dims), dtype=np.int64).reshape(dims)
    return (np.transpose(ids, perm) if perm else ids).reshape(-1)


def _mesh_device_ids(text: str | None, total: int, where: str) -> np.ndarray:
    """The device ids of the mesh form in mesh (row-major) order: an iota when ``device_ids`` is absent or written
    ``[dims]T(perm)`` (reshape dims, optional transpose), else the explicit ids listed."""
    if not text:
        return np.arange(total, dtype=np.int64)
    m = _IOTA_IDS.fullmatch(text.strip())
    if m and math.prod(_ints(m.group(1))) == total:
        # An explicit list is a permutation of 0..total-1, so it holds a 0 and never has that product.
        ids = _iota(_ints(m.group(1)), _ints(m.group(2)) if m.group(2) else None)
    else:
        ids = np.asarray(_ints(text), np.int64)
    if ids.size != total or sorted(ids.tolist()) != list(range(total)):
        raise ValueError(
            f"{where}: device_ids=({text}) lists {ids.size} ids, not a permutation of the mesh's {total} devices"
        )
    return ids


def _mesh_groups(mesh: str, device_ids: str | None, axes: str) -> tuple[tuple[int, ...], ...]:
    """The explicit groups of the mesh-axes form: the devices (``device_ids`` laid over the mesh) that differ only
    in the named axes or sub-axes, each group in row-major order over the axes as listed."""
    where = f"replica_groups=mesh[{mesh}]" + (f", device_ids=({device_ids})" if device_ids else "") + f" {{{axes}}}"
    names, sizes = [], []
    for entry in _split_top(mesh):
        name, _, size = entry.rpartition("=")
        names.append(name.strip().strip("'"))
        sizes.append(int(size))
    ids = _mesh_device_ids(device_ids, math.prod(sizes), where)
    # The named (sub-)axes as (mesh axis, pre-size, size); a whole axis is its own sub-axis (1)size.
    chosen: list[tuple[int, int, int]] = []
    for axis in _split_top(axes):
        m = _MESH_AXIS.match(axis)
        if m is None or m.group(1) not in names:
            raise ValueError(f"cannot parse mesh axis {axis!r} of {where}")
        i = names.index(m.group(1))
        pre, size = (int(m.group(2)), int(m.group(3))) if m.group(3) else (1, sizes[i])
        if sizes[i] % (pre * size):
            raise ValueError(f"sub-axis {axis!r} of {where} does not divide its axis of size {sizes[i]}")
        chosen.append((i, pre, size))
    # Split every mesh axis into factors (major to minor) at the boundaries of the sub-axes named on it.
    factors: list[tuple[int, int, int]] = []  # (mesh axis, pre-size, size)
    for i, n in enumerate(sizes):
        cuts = sorted({1, n} | {c for j, pre, size in chosen if j == i for c in (pre, pre * size)})
        for lo, hi in itertools.pairwise(cuts):
            if hi % lo:
                raise ValueError(f"the sub-axes of {names[i]!r} in {where} overlap")
            factors.append((i, lo, hi // lo))
    order = [
        f
        for i, pre, size in chosen
        for f, (j, lo, n) in enumerate(factors)
        if j == i and pre <= lo and lo * n <= pre * size
    ]
    if len(set(order)) != len(order):
        raise ValueError(f"the axes named in {where} overlap")
    keep = [f for f in range(len(factors)) if f not in order]
    grid = ids.reshape([n for _, _, n in factors])
    groups = np.transpose(grid, keep + order).reshape(-1, math.prod(factors[f][2] for f in order))
    return tuple(tuple(int(d) for d in g) for g in groups)


def parse_replica_groups(attrs: str, num_devices: int | None = None) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups named in an HLO instruction's attributes, as explicit device-id tuples.

    Args:
        attrs: the instruction text after the operands, with ``replica_groups=`` in one of the forms XLA prints:
            explicit ``{{0,1},{2,3}}``; empty ``{}`` (one group of all devices); iota ``[2,4]<=[8]`` or
            ``[4,2]<=[2,4]T(1,0)`` (an iota over the bracketed dims, transposed, reshaped to
            ``[groups, group_size]``); or mesh-axes ``mesh['a'=2,'b'=4] {'a'}``, optionally with
            ``device_ids=(...)`` after the mesh (an iota ``[2,4]T(1,0)`` or explicit ids, listing the devices in
            mesh order) and sub-axes ``'a':(pre_size)size`` (the factor of ``'a'`` after ``pre_size`` major ones).
        num_devices: the device count an empty ``replica_groups={}`` stands for (one group of all devices).

    Returns:
        One tuple of device ids per group, in the order XLA lists them (for the mesh form: row-major over the
        axes not named, each group row-major over the named ones), or ``None`` when the attributes hold no
        replica groups (or only an empty form and no ``num_devices``). In SPMD programs the ids are partition
        ids: positions in the ``mesh.devices.flat`` order of the mesh the program was compiled for.

    Raises:
        ValueError: for a ``replica_groups=`` value in none of these forms, a mesh axis that is not in the mesh,
            overlapping sub-axes, or a ``device_ids`` list that is not a permutation of the mesh's devices.
    """
    m = _MESH_GROUPS.search(attrs)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    m = _IOTA_GROUPS.search(attrs)
    if m:
        shape = _ints(m.group(1))
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) if m.group(3) else None)
        return tuple(tuple(int(d) for d in g) for g in ids.reshape(shape[0], -1))
    m = _EXPLICIT_GROUPS.search(attrs)
    if m:
        groups = re.findall(r"\{([^{}]*)\}", m.group(1))
        if groups:
            return tuple(tuple(_ints(g)) for g in groups)
        if m.group(1).strip():
            raise ValueError(f"cannot parse replica_groups in {attrs[:200]!r}")
        return None if num_devices is None else (tuple(range(num_devices)),)
    if "replica_groups=" in attrs:
        raise ValueError(f"unrecognised replica_groups form in {attrs[:200]!r}")
    return None if num_devices is None else (tuple(range(num_devices)),)


def parse_replica_group_size(attrs: str, num_devices: int | None = None) -> int | None:
    """The size of the (first) replica group named in an HLO instruction's attributes.

    Args:
        attrs: the instruction text after the operands, containing ``replica_groups=...`` in any form
            :func:`parse_replica_groups` reads.
        num_devices: the group size to use for an empty ``replica_groups={}`` (all devices).

    Returns:
        The group size, or ``num_devices`` when the groups are empty or absent.

    Raises:
        ValueError: for a ``replica_groups=`` value :func:`parse_replica_groups` cannot read.
    """
    groups = parse_replica_groups(attrs, num_devices)
    return len(groups[0]) if groups else num_devices


def wire_bytes(kind: str, result_bytes: float, group_size: int) -> float:
    """Ring wire bytes sent per device by one launch of a collective.

    Args:
        kind: one of :data:`KINDS`.
        result_bytes: bytes of the collective's result on one device (``b``).
        group_size: replica-group size (``g``); ignored for collective-permute.

    Returns:
        all-gather ``b(g−1)/g``, reduce-scatter ``b(g−1)``, all-reduce ``2b(g−1)/g``, all-to-all ``b(g−1)/g``,
        collective-permute ``b``.
    """
    b, g = result_bytes, group_size
    if kind == "collective-permute":
        return float(b)
    if g <= 0:
        raise ValueError(f"group size must be positive, got {g}")
    if kind in ("all-gather", "all-to-all"):
        return b * (g - 1) / g
    if kind == "reduce-scatter":
        return float(b * (g - 1))
    if kind == "all-reduce":
        return 2 * b * (g - 1) / g
    raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")


def _group_size(kind: str, attrs: str, devices: int | None) -> int:
    if kind == "collective-permute":
        m = _PAIRS.search(attrs)
        ids = set(re.findall(r"\d+", m.group(1))) if m else set()
        return len(ids) or 2
    g = parse_replica_group_size(attrs, devices)
    if g is None:
        raise ValueError(f"cannot tell the replica-group size of a {kind} (empty replica_groups, no module header)")
    return g
