"""The plan: which leaf lives in which bucket at which offset, as hashable, JSON-describable data.

:class:`LeafSpec` (one leaf: path, shape, dtype, granularity, bucket and slot), :class:`Bucket` (one flat buffer:
its leaves and :class:`~vescale_jax.BucketLayout`) and :class:`Plan` (the whole tree on a mesh axis). Built by
:func:`vescale_jax.plan`; pure data, no device memory.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax.layout._bucket_layout import BucketLayout
from vescale_jax.layout._granularity import Granularity
from vescale_jax.layout._ragged import RaggedShard
from vescale_jax.layout._tp import DimAxes

__all__ = ["Bucket", "LeafSpec", "Plan", "mesh_size"]


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Where one leaf of the logical tree lives.

    Attributes:
      path: the leaf's key path as ``"a/b/c"``.
      shape: logical shape (stacked leaves include the leading layer dim).
      dtype: dtype name.
      bucket: index of its bucket in ``Plan.buckets``.
      slot: its index inside that bucket's layout.
      granularity: the block policy it was planned with (``element()`` for a ``whole(max_padding=...)`` leaf
        the planner released).
      tp: per dim, the tensor / expert mesh axes it is split over (``()`` when it is not split; see
        :mod:`vescale_jax.layout._tp`).
      local: the shape of one TP/EP shard (``None``: the logical shape).

    Sharding:
      A leaf with ``tp`` is split over those axes first; its bucket lays out one shard per group.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    bucket: int
    slot: int
    granularity: Granularity
    tp: DimAxes = ()
    local: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape the model sees inside ``shard_map``: the leaf's TP/EP shard (its shape without TP)."""
        return self.shape if self.local is None else self.local


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat buffer: the leaves of one unit and one dtype.

    Attributes:
      name: ``"<unit>:<dtype>"``.
      unit: the unit the leaves belong to.
      dtype: dtype name of every leaf in it.
      layout: the per-layer :class:`BucketLayout`.
      leaves: indices of its leaves in the flattened logical tree, in layout slot order.
      layers: ``L`` for a stacked layer group, else ``None``.
      storage: per slot, the ``vj.tiles`` granularity of a leaf stored tile-major, ``None`` for row-major;
        empty when every leaf is row-major (see :mod:`vescale_jax.layout._tiles`).
      groups: the tensor / expert mesh axes its leaves are split over (in mesh order; ``()`` for none).
      num_groups: the number of TP/EP groups (the product of the ``groups`` axes' sizes).

    Sharding:
      The buffer has shape ``(m*S,)`` (or ``(L, m*S)``) and ``PartitionSpec(axis)`` (or ``(None, axis)``):
      device ``k`` holds ``[k*S, (k+1)*S)`` of every layer. With ``groups`` it is ``(G*m*S,)`` and
      ``PartitionSpec((*groups, axis))``: group ``g``'s buffer is ``[g*m*S, (g+1)*m*S)``, laid out alike in
      every group, and the device at position ``k`` on ``axis`` in group ``g`` holds ``S`` elements of it.
    """

    name: str
    unit: str
    dtype: str
    layout: BucketLayout
    leaves: tuple[int, ...]
    layers: int | None = None
    storage: tuple[Granularity | None, ...] = ()
    groups: tuple[str, ...] = ()
    num_groups: int = 1

    @property
    def shape(self) -> tuple[int, ...]:
        flat = (self.num_groups * self.layout.total_size,)
        return flat if self.layers is None else (self.layers, *flat)

    @property
    def local_shape(self) -> tuple[int, ...]:
        flat = (self.layout.shard_size,)
        return flat if self.layers is None else (self.layers, *flat)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a parameter tree is packed into sharded flat buckets. Hashable and deterministic.

    Attributes:
      treedef: the logical tree's structure.
      leaves: one :class:`LeafSpec` per leaf, in flattening order.
      buckets: the buckets, in order of first appearance in the tree.
      mesh: the device mesh.
      axis: the mesh axis (or axes) the buckets are sharded over.
    """

    treedef: Any
    leaves: tuple[LeafSpec, ...]
    buckets: tuple[Bucket, ...]
    mesh: jax.sharding.Mesh
    axis: str | tuple[str, ...]

    @property
    def num_devices(self) -> int:
        return mesh_size(self.mesh, self.axis)

    @property
    def padding_fraction(self) -> float:
        """Padding elements over all buffer elements, across every bucket (layers counted)."""
        total = sum(math.prod(b.shape) for b in self.buckets)
        used = sum(s.size for s in self.leaves)
        return (total - used) / total if total else 0.0

    @property
    def tp_axes(self) -> tuple[str, ...]:
        """The tensor / expert mesh axes any bucket is split over (in mesh order)."""
        used = {a for b in self.buckets for a in b.groups}
        return tuple(a for a in self.mesh.axis_names if a in used)

    def bucket_axes(self, bucket: Bucket) -> tuple[str, ...]:
        """Every mesh axis a bucket's buffer is sharded over: its group axes, then the plan's axis (or axes)."""
        return (*bucket.groups, *((self.axis,) if isinstance(self.axis, str) else self.axis))

    def partition_spec(self, bucket: Bucket) -> jax.sharding.PartitionSpec:
        P = jax.sharding.PartitionSpec
        axes = self.bucket_axes(bucket) if bucket.groups else self.axis
        return P(axes) if bucket.layers is None else P(None, axes)

    def shardings(self) -> tuple[jax.sharding.NamedSharding, ...]:
        """The ``NamedSharding`` of each bucket's buffer."""
        return tuple(jax.sharding.NamedSharding(self.mesh, self.partition_spec(b)) for b in self.buckets)

    def leaf(self, path: str) -> LeafSpec:
        for spec in self.leaves:
            if spec.path == path:
                return spec
        raise KeyError(f"no leaf {path!r} in the plan; leaves are: {[s.path for s in self.leaves][:8]}...")

    def layer_shape(self, spec: LeafSpec) -> tuple[int, ...]:
        """A leaf's shape as laid out in its bucket: its TP/EP shard's shape, without the layer dim for a stacked
        bucket."""
        shape = spec.local_shape
        return shape if self.buckets[spec.bucket].layers is None else shape[1:]

    def shard_of(self, path: str) -> RaggedShard:
        """The :class:`RaggedShard` of one leaf (per layer for a stacked leaf).

        For a leaf stored tile-major (``vj.tiles``; its bucket's ``storage`` names it) the element ranges count
        positions in its storage order (:func:`vescale_jax.layout._tiles.to_storage`), not in its row-major flattening.
        """
        spec = self.leaf(path)
        return self.buckets[spec.bucket].layout.ragged_shard(spec.slot, self.layer_shape(spec))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable description of the layout (mesh and tree structure by name only)."""
        return {
            "axis": self.axis,
            "num_devices": self.num_devices,
            "leaves": [
                {
                    "path": s.path,
                    "shape": list(s.shape),
                    "dtype": s.dtype,
                    "bucket": s.bucket,
                    "slot": s.slot,
                    "granularity": repr(s.granularity),
                    **({"tp": [list(a) for a in s.tp], "local_shape": list(s.local_shape)} if s.tp else {}),
                }
                for s in self.leaves
            ],
            "buckets": [
                {
                    "name": b.name,
                    "dtype": b.dtype,
                    "layers": b.layers,
                    "shard_size": b.layout.shard_size,
                    "align": b.layout.align,
                    "offsets": list(b.layout.offsets),
                    "sizes": list(b.layout.sizes),
                    "blocks": list(b.layout.blocks),
                    "leaves": list(b.leaves),
                    **({"groups": list(b.groups), "num_groups": b.num_groups} if b.groups else {}),
                    # Tile-major slots (vj.tiles): their storage granularity and segments; None for row-major.
                    "storage": [None if g is None else repr(g) for g in (b.storage or (None,) * len(b.leaves))],
                    "segments": [
                        None if b.layout.segments_of(j) is None else [list(x) for x in b.layout.segments_of(j)]
                        for j in range(len(b.leaves))
                    ],
                }
                for b in self.buckets
            ],
        }

    def fingerprint(self) -> str:
        """SHA-256 of :meth:`to_dict` and the mesh (axis names, shape, device ids): equal on every process that
        planned the same tree the same way on the same mesh; plans on other devices differ."""
        mesh = {
            "axis_names": list(self.mesh.axis_names),
            "shape": [int(n) for n in self.mesh.devices.shape],
            "devices": [int(d.id) for d in self.mesh.devices.reshape(-1)],
        }
        text = json.dumps({**self.to_dict(), "mesh": mesh}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def summary(self) -> str:
        """A human-readable table of buckets, S, padding and per-device load."""
        m = self.num_devices
        rows = [("bucket", "dtype", "leaves", "layers", "S", "m*S", "padding", "load min/max", "MiB/dev")]
        for b in self.buckets:
            loads = b.layout.device_loads()
            per_dev = b.nbytes / m / b.num_groups / 2**20
            rows.append(
                (
                    b.name,
                    b.dtype,
                    str(len(b.leaves)),
                    str(b.layers or "-"),
                    f"{b.layout.shard_size:,}",
                    f"{b.layout.total_size:,}",
                    f"{b.layout.padding_fraction:.2%}",
                    f"{min(loads):,}/{max(loads):,}",
                    f"{per_dev:.2f}",
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        total = sum(b.nbytes / b.num_groups for b in self.buckets)
        tp = f" (split over {self.tp_axes})" if self.tp_axes else ""
        lines.append(
            f"{len(self.buckets)} buckets, {len(self.leaves)} leaves over {m} devices on axis {self.axis!r}{tp}: "
            f"{total / m / 2**20:.2f} MiB per device, padding {self.padding_fraction:.3%}"
        )
        lines.extend(_units_lines([b.unit for b in self.buckets]))
        return "\n".join(lines)


def _units_lines(units: Sequence[str]) -> list[str]:
    """The summary's account of the units: each list of repeated layers (one unit per layer) and the rest."""
    units = list(dict.fromkeys(units))
    layers: dict[str, list[int]] = {}
    rest = []
    for u in units:
        head, _, last = u.rpartition("/")
        if head and last.isdigit():
            layers.setdefault(head, []).append(int(last))
        else:
            rest.append(u)
    if not layers:
        return []
    out = [f"units: one per repeated layer of {head}/0..{max(ks)} ({len(ks)} layers)" for head, ks in layers.items()]
    if rest:
        shown = ", ".join(rest[:8]) + (f", ... ({len(rest)} in all)" if len(rest) > 8 else "")
        out.append(f"other units: {shown}")
    return out


def mesh_size(mesh: jax.sharding.Mesh, axis: str | Sequence[str]) -> int:
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"vj.plan: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one with "
            "jax.make_mesh((n,), ('fsdp',)) (arguments: vj.plan(params, mesh, ...))."
        )
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    if not axes:
        raise ValueError("vj.plan: axis=() names no mesh axis; pass axis='fsdp' (or a tuple of mesh axes).")
    dup = next((a for i, a in enumerate(axes) if a in axes[:i]), None)
    if dup is not None:
        raise ValueError(
            f"vj.plan: axis={axes!r} names mesh axis {dup!r} twice; name each axis once "
            f"(e.g. axis={tuple(dict.fromkeys(axes))!r})."
        )
    missing = [a for a in axes if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"vj.plan: mesh has axes {tuple(mesh.shape)} but no axis {missing[0]!r}; build the mesh with "
            f"that axis (e.g. jax.make_mesh(({mesh.size},), ({missing[0]!r},))) or pass axis=... naming one "
            "of its axes."
        )
    return math.prod(mesh.shape[a] for a in axes)
