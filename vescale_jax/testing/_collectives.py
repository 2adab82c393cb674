"""Collective kinds, replica-group sizes as XLA prints them, and ring wire bytes per device."""

from __future__ import annotations

import math
import re

import numpy as np

from vescale_jax.testing._shapes import _split_top

__all__ = ["KINDS", "parse_replica_group_size", "parse_replica_groups", "wire_bytes"]

#: Collective kinds the census reports, in table order.
KINDS: tuple[str, ...] = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{(.*?)\}(?=,\s*[a-z_]+=|\s*$)")
# XLA's mesh-axes form (JAX 0.11): mesh['a'=2,'b'=4] {'a'}, optionally with ", device_ids=(...)" after the mesh
# and sub-axes written 'a':(pre_size)size.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.*?)\))?\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"^'?([^'=:]+?)'?(?::\((\d+)\)(\d+))?$")
_PAIRS = re.compile(r"source_target_pairs=\{(.*?)\}(?=,\s*[a-z_]+=|\s*$)")


def _mesh_group_size(mesh: str, axes: str) -> int:
    sizes = {}
    for entry in _split_top(mesh):
        name, _, size = entry.rpartition("=")
        sizes[name.strip().strip("'")] = int(size)
    g = 1
    for axis in _split_top(axes):
        m = _MESH_AXIS.match(axis)
        if m is None or (m.group(3) is None and m.group(1) not in sizes):
            raise ValueError(f"cannot parse mesh axis {axis!r} of replica_groups=mesh[{mesh}] {{{axes}}}")
        g *= int(m.group(3)) if m.group(3) is not None else sizes[m.group(1)]
    return g


def parse_replica_group_size(attrs: str, num_devices: int | None = None) -> int | None:
    """The size of the (first) replica group named in an HLO instruction's attributes.

    Args:
        attrs: the instruction text after the operands, containing ``replica_groups=...`` in the explicit form
            ``{{0,1,2},{3,4,5}}``, the iota form ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)`` (shape
            ``[groups, group_size]``) or the mesh-axes form of newer XLA, ``mesh['a'=2,'b'=4] {'a'}`` (product of
            the named axes' sizes; a sub-axis ``'a':(1)2`` counts its own size).
        num_devices: the group size to use for an empty ``replica_groups={}`` (all devices).

    Returns:
        The group size, or ``num_devices`` when the groups are empty or absent.

    Raises:
        ValueError: for a ``replica_groups=`` value in none of these forms.
    """
    m = _MESH_GROUPS.search(attrs)
    if m:
        return _mesh_group_size(m.group(1), m.group(3))
    m = _IOTA_GROUPS.search(attrs)
    if m:
        dims = [int(d) for d in m.group(1).split(",") if d.strip()]
        return dims[-1]
    m = _EXPLICIT_GROUPS.search(attrs)
    if m:
        groups = re.findall(r"\{([^{}]*)\}", m.group(1))
        if groups:
            return len([d for d in groups[0].split(",") if d.strip()])
        if m.group(1).strip():
            raise ValueError(f"cannot parse replica_groups in {attrs[:200]!r}")
        return num_devices
    if "replica_groups=" in attrs:
        raise ValueError(f"unrecognised replica_groups form in {attrs[:200]!r}")
    return num_devices


def _ints(text: str) -> list[int]:
    return [int(d) for d in re.findall(r"\d+", text)]


def _mesh_groups(mesh: str, device_ids: str | None, axes: str) -> tuple[tuple[int, ...], ...] | None:
    """The explicit groups of the mesh-axes form: the devices (``device_ids`` laid over the mesh, else an iota)
    that differ only in the named axes (or sub-axes), each group in row-major order over them."""
    names, sizes = [], []
    for entry in _split_top(mesh):
        name, _, size = entry.rpartition("=")
        names.append(name.strip().strip("'"))
        sizes.append(int(size))
    total = math.prod(sizes)
    ids = np.asarray(_ints(device_ids), np.int64) if device_ids else np.arange(total, dtype=np.int64)
    if ids.size != total:
        raise ValueError(f"replica_groups=mesh[{mesh}]: device_ids has {ids.size} entries, the mesh {total}")
    # Each mesh axis as its factors; a sub-axis 'a':(pre)size splits its axis into (pre, size, rest).
    factors: list[list[tuple[str, int]]] = [[(n, s)] for n, s in zip(names, sizes, strict=True)]
    chosen: list[str] = []
    for axis in _split_top(axes):
        m = _MESH_AXIS.match(axis)
        if m is None or m.group(1) not in names:
            raise ValueError(f"cannot parse mesh axis {axis!r} of replica_groups=mesh[{mesh}] {{{axes}}}")
        i = names.index(m.group(1))
        if m.group(3) is None:
            chosen.append(m.group(1))
            continue
        pre, size = int(m.group(2)), int(m.group(3))
        if len(factors[i]) != 1 or sizes[i] % (pre * size):
            return None  # several sub-axes of one axis: the size is known, the groups are not parsed
        label = f"{m.group(1)}:({pre}){size}"
        factors[i] = [(f"{m.group(1)}:pre", pre), (label, size), (f"{m.group(1)}:post", sizes[i] // (pre * size))]
        chosen.append(label)
    flat = [f for fs in factors for f in fs]
    grid = ids.reshape([s for _, s in flat])
    keep = [j for j, (n, _) in enumerate(flat) if n not in chosen]
    order = [next(j for j, (n, _) in enumerate(flat) if n == c) for c in chosen]
    groups = np.transpose(grid, keep + order).reshape(-1, math.prod(flat[j][1] for j in order))
    return tuple(tuple(int(d) for d in g) for g in groups)


def parse_replica_groups(attrs: str, num_devices: int | None = None) -> tuple[tuple[int, ...], ...] | None:
    """The replica groups named in an HLO instruction's attributes, as explicit device-id tuples.

    Args:
        attrs: the instruction text after the operands, with ``replica_groups=`` in the explicit form
            ``{{0,1},{2,3}}``, the iota form ``[4,2]<=[2,4]T(1,0)`` (an iota over the bracketed dims, transposed,
            reshaped to ``[groups, group_size]``) or the mesh-axes form ``mesh['a'=2,'b'=4] {'a'}`` (optionally
            with ``device_ids=(...)`` and sub-axes ``'a':(pre)size``).
        num_devices: the device count an empty ``replica_groups={}`` stands for (one group of all devices).

    Returns:
        One tuple of device ids per group, in the order XLA lists them, or ``None`` when the attributes hold no
        replica groups (or only an empty form and no ``num_devices``), or name several sub-axes of one mesh axis.
        In SPMD programs the ids are partition ids: positions in the ``mesh.devices.flat`` order of the mesh
        the program was compiled for.

    Raises:
        ValueError: for a ``replica_groups=`` value in none of these forms.
    """
    m = _MESH_GROUPS.search(attrs)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    m = _IOTA_GROUPS.search(attrs)
    if m:
        shape, dims = _ints(m.group(1)), _ints(m.group(2))
        ids = np.arange(math.prod(dims), dtype=np.int64).reshape(dims)
        if m.group(3):
            ids = np.transpose(ids, _ints(m.group(3)))
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
