"""Optimizer state in host memory: ``vj.Offload``, the :class:`Offloaded` node, ``vj.offload`` / ``vj.onload``.

An offloaded :class:`ShardedParams` or :class:`PerDevice` keeps its children in host memory (``pinned_host`` by
default) between steps, split into the pieces a ``vj.fsdp(offload=...)`` step streams one after the other: a
stacked layer group's buffer ``(L, m·S)`` as ``L`` rows of ``(1, m·S)``, any other buffer whole. The rows of a
layer group are separate arrays so that a step moves one row to the device and one back without slicing or
concatenating in host memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vescale_jax.layout._plan import Plan
from vescale_jax.state._containers import PerDevice, ShardedParams

__all__ = ["Offload", "Offloaded", "offload", "onload"]

_KINDS = ("pinned_host", "unpinned_host")


@dataclasses.dataclass(frozen=True)
class Offload:
    """Which state a ``vj.fsdp`` step keeps in host memory between steps.

    Attributes:
      opt_state: keep every :class:`ShardedParams` and :class:`PerDevice` of the optimizer state (Adam's moments,
        8-bit state and its scales, Muon's momentum, Shampoo's statistics) in host memory; the step brings each
        bucket's state to the device, updates it and sends it back, one piece at a time (a layer of a stacked
        group, or a whole bucket). Counts and other small leaves stay on the device.
      params: keep the fp32 master shards in host memory too. Not supported: the forward gathers every bucket
        from device memory, so the master shards would come to the device for the whole step and save nothing;
        ``True`` raises.
      memory_kind: the host memory kind, ``"pinned_host"`` (default: the device copies it with DMA) or
        ``"unpinned_host"``.
      pieces: ``"layer"`` (default): a stacked layer group's state is streamed one layer at a time when its
        update is element-wise, so the device holds about two layers of state; ``"bucket"``: every bucket's state
        is streamed whole (more device memory, and the update runs exactly as the step without offload compiles
        it). The results are the same operations on the same values either way; XLA:CPU's fusion emitters may
        round a fused ``x / (sqrt(y) + eps)`` on a layer's row differently from the same expression on the whole
        buffer (one ulp on a few percent of elements; none with ``--xla_cpu_use_fusion_emitters=false``).
    """

    opt_state: bool = True
    params: bool = False
    memory_kind: str = "pinned_host"
    pieces: str = "layer"

    def __post_init__(self):
        for name in ("opt_state", "params"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"vj.Offload: {name} must be a bool, got {type(getattr(self, name)).__name__}.")
        if self.params:
            raise ValueError(
                "vj.Offload(params=True) is not supported: the step's forward gathers every bucket from device "
                "memory, so the master shards would live on the device during the whole step and offloading them "
                "would save nothing. Offload the optimizer state (vj.Offload(opt_state=True)), the larger part "
                "with Adam (two moments per parameter)."
            )
        if self.pieces not in ("layer", "bucket"):
            raise ValueError(f"vj.Offload: pieces must be 'layer' or 'bucket', got {self.pieces!r}.")
        if self.memory_kind not in _KINDS:
            raise ValueError(f"vj.Offload: memory_kind must be one of {_KINDS}, got {self.memory_kind!r}.")

    @property
    def active(self) -> bool:
        """Whether anything is offloaded."""
        return self.opt_state


@dataclasses.dataclass(frozen=True)
class _Form:
    """Static description of an offloaded node: its type, plan, layout and how each child is split."""

    kind: str  # "sharded" or "per_device"
    plan: Plan
    layout: Any
    rows: tuple[int | None, ...]  # per child: number of row pieces, None for a whole piece, -1 for a non-array
    memory_kind: str
    by_layer: bool = True  # stream a stacked child's rows one at a time where the update allows it


@jax.tree_util.register_pytree_node_class
class Offloaded:
    """A :class:`ShardedParams` or :class:`PerDevice` of the optimizer state held in host memory, in pieces.

    Attributes:
      pieces: per child of the node (per bucket buffer of a ``ShardedParams``; the value of a ``PerDevice``), a
        tuple of arrays in host memory: the ``L`` rows ``(1, m·S)`` of a stacked layer group's buffer, else the
        whole buffer (a child that is not an array, such as a masked-out ``None``, is kept as it is).
      form: static: the node's type, plan and layout, and how each child is split.

    Sharding:
      Each piece has its node's ``NamedSharding`` with the host memory kind: rows of a stacked buffer
      ``P(None, axis)``, flat buffers ``P(axis)``, ``PerDevice`` values split on dim 0.
    """

    __slots__ = ("form", "pieces")

    def __init__(self, pieces: Sequence[Sequence[Any]], form: _Form):
        self.pieces = tuple(tuple(p) for p in pieces)
        self.form = form

    def tree_flatten(self):
        return self.pieces, self.form

    @classmethod
    def tree_unflatten(cls, form, pieces):
        return cls(pieces, form)

    @property
    def plan(self) -> Plan:
        """The plan of the node."""
        return self.form.plan

    def __repr__(self) -> str:
        kind = "ShardedParams" if self.form.kind == "sharded" else "PerDevice"
        return f"Offloaded({kind}, {sum(len(p) for p in self.pieces)} pieces in {self.form.memory_kind})"


def _is_node(x: Any) -> bool:
    return isinstance(x, ShardedParams | PerDevice)


def _children(node: ShardedParams | PerDevice) -> tuple[Any, ...]:
    return node.buffers if isinstance(node, ShardedParams) else (node.value,)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def device_sharding(node: ShardedParams | PerDevice, i: int, shape: Sequence[int]) -> NamedSharding:
    """The device ``NamedSharding`` of child ``i`` (of global shape ``shape``) of a plan's state node: its bucket's
    spec for a bucket-shaped child of a ``ShardedParams``, dim 0 split for a ``PerDevice``, else replicated."""
    plan = node.plan
    mesh = plan.mesh
    if isinstance(node, ShardedParams):
        bucket = plan.buckets[i]
        m = plan.num_devices * bucket.num_groups
        if len(shape) == len(bucket.shape) and shape[-1] % m == 0:
            return NamedSharding(mesh, plan.partition_spec(bucket))
        return NamedSharding(mesh, P())
    axes = node.axes
    size = int(np.prod([mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,))]))
    if shape and shape[0] % size == 0:
        return NamedSharding(mesh, P(axes, *[None] * (len(shape) - 1)))
    return NamedSharding(mesh, P())


def split_rows(node: ShardedParams | PerDevice, i: int, shape: Sequence[int]) -> int | None:
    """How child ``i`` of ``node`` is split in host memory: ``L`` rows for a stacked layer group's bucket-shaped
    buffer ``(L, m·S)``, else ``None`` (one whole piece)."""
    if isinstance(node, ShardedParams):
        bucket = node.plan.buckets[i]
        if bucket.layers is not None and tuple(shape) == tuple(bucket.shape) and bucket.layers > 1:
            return int(bucket.layers)
    return None


def host_form(node: ShardedParams | PerDevice, memory_kind: str, *, by_layer: bool = True) -> _Form:
    """The :class:`_Form` an offloaded ``node`` takes (from its children's shapes)."""
    rows = []
    for i, x in enumerate(_children(node)):
        rows.append((split_rows(node, i, x.shape) if by_layer else None) if _is_array(x) else -1)
    kind = "sharded" if isinstance(node, ShardedParams) else "per_device"
    layout = node.layout if isinstance(node, PerDevice) else None
    return _Form(kind, node.plan, layout, tuple(rows), memory_kind, by_layer)


def empty_node(form: _Form, children: Sequence[Any]) -> ShardedParams | PerDevice:
    """The device node of ``form`` around ``children``."""
    if form.kind == "sharded":
        return ShardedParams(children, form.plan)
    return PerDevice(children[0], form.plan, form.layout)


def _to_host(node: ShardedParams | PerDevice, policy: Offload) -> Offloaded:
    memory_kind = policy.memory_kind
    form = host_form(node, memory_kind, by_layer=policy.pieces == "layer")
    pieces = []
    for i, (x, rows) in enumerate(zip(_children(node), form.rows, strict=True)):
        if rows == -1:
            pieces.append((x,))
            continue
        host = device_sharding(node, i, x.shape).with_memory_kind(memory_kind)
        parts = [x] if rows is None else [jax.lax.slice_in_dim(x, r, r + 1) for r in range(rows)]
        pieces.append(tuple(jax.device_put(p, host) for p in parts))
    return Offloaded(pieces, form)


def to_device(off: Offloaded) -> ShardedParams | PerDevice:
    """The device node an :class:`Offloaded` holds (rows concatenated on the device)."""
    form = off.form
    shell = empty_node(form, [None] * len(form.rows))
    children = []
    for i, (parts, rows) in enumerate(zip(off.pieces, form.rows, strict=True)):
        if rows == -1:
            children.append(parts[0])
            continue
        shape = parts[0].shape if rows is None else (rows, *parts[0].shape[1:])
        dev = device_sharding(shell, i, shape)
        moved = [jax.device_put(p, dev) for p in parts]
        children.append(moved[0] if rows is None else jnp.concatenate(moved, axis=0))
    return empty_node(form, children)


def offload(tree: Any, offload: Offload | None = None) -> Any:
    """``tree`` with every :class:`ShardedParams` and :class:`PerDevice` in it moved to host memory.

    Args:
      tree: an optimizer state (or any pytree) holding plan state nodes; nodes already offloaded stay as they are.
      offload: the :class:`Offload` policy (default ``Offload()``: opt_state in ``pinned_host``).

    Returns:
      The same structure with each node replaced by an :class:`Offloaded` (the same values, split into the pieces
      a ``vj.fsdp(offload=...)`` step streams); other leaves (counts) unchanged.

    Sharding:
      Each piece keeps its node's ``NamedSharding`` with the host memory kind.
    """
    policy = Offload() if offload is None else offload
    if not isinstance(policy, Offload):
        raise TypeError(f"vj.offload: offload must be a vj.Offload, got {type(policy).__name__}.")
    if not policy.opt_state:
        return onload(tree)
    return jax.tree.map(lambda x: _to_host(x, policy) if _is_node(x) else x, tree, is_leaf=_is_node)


def onload(tree: Any) -> Any:
    """``tree`` with every :class:`Offloaded` node brought back to device memory as the node it holds.

    Args:
      tree: a pytree that may hold offloaded nodes (e.g. an optimizer state from ``vj.init_opt_state(...,
        offload=...)`` or from an offloaded step).

    Returns:
      The same values as :class:`ShardedParams` / :class:`PerDevice` in device memory (bit for bit).
    """
    return jax.tree.map(lambda x: to_device(x) if isinstance(x, Offloaded) else x, tree, is_leaf=is_offloaded)


def is_offloaded(x: Any) -> bool:
    """Whether ``x`` is an :class:`Offloaded` node."""
    return isinstance(x, Offloaded)


def has_offloaded(tree: Any) -> bool:
    """Whether any node of ``tree`` is offloaded."""
    return any(is_offloaded(x) for x in jax.tree.leaves(tree, is_leaf=is_offloaded))
