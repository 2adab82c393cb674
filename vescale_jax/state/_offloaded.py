"""Optimizer state in host memory: ``vj.Offload``, the :class:`Offloaded` node, ``vj.offload`` / ``vj.onload``.

An offloaded :class:`ShardedParams` or :class:`PerDevice` keeps its children in host memory (``pinned_host`` by
default) between steps, split into the pieces a ``vj.fsdp(offload=...)`` step streams one after the other: a
stacked layer group's buffer ``(L, m·S)`` as ``L`` rows of ``(1, m·S)``, a large flat buffer as column pieces
(:class:`Split`), any other buffer whole. The pieces are separate arrays so that a step moves one piece to the
device and one back without slicing or concatenating in host memory.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
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
        buffer (one ulp on a few percent of elements).
      piece_bytes: with ``pieces="layer"``, a flat (not stacked) buffer whose share on a device exceeds this many
        bytes is streamed in column pieces of at most about this size (each device's contiguous shard cut at the
        same local offsets), so a large embedding's state does not come to the device whole. Default 4 MiB.
    """

    opt_state: bool = True
    params: bool = False
    memory_kind: str = "pinned_host"
    pieces: str = "layer"
    piece_bytes: int = 4 * 2**20

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
        if isinstance(self.piece_bytes, bool) or not isinstance(self.piece_bytes, int) or self.piece_bytes < 1:
            raise ValueError(f"vj.Offload: piece_bytes must be a positive int, got {self.piece_bytes!r}.")
        if self.pieces not in ("layer", "bucket"):
            raise ValueError(f"vj.Offload: pieces must be 'layer' or 'bucket', got {self.pieces!r}.")
        if self.memory_kind not in _KINDS:
            raise ValueError(f"vj.Offload: memory_kind must be one of {_KINDS}, got {self.memory_kind!r}.")

    @property
    def active(self) -> bool:
        """Whether anything is offloaded."""
        return self.opt_state


@dataclasses.dataclass(frozen=True)
class Split:
    """How one buffer of global shape ``full`` is cut into the pieces a step streams.

    ``"rows"``: a stacked layer group's ``(L, m·S)`` buffer as its ``L`` rows ``(1, m·S)``. ``"cols"``: a flat
    ``(m·S,)`` buffer split over ``shards`` devices on dim 0, each device's contiguous ``(S,)`` shard cut at the
    same local offsets ``bounds``: piece ``i`` is the ``(shards·(b_{i+1} − b_i),)`` array whose device ``k`` holds
    local elements ``[b_i, b_{i+1})``. Either way an element-wise operation on piece ``i`` of every operand gives
    piece ``i`` of its result, and no piece crosses a device: cutting and joining move nothing between devices.
    """

    kind: str
    count: int
    full: tuple[int, ...]
    shards: int = 1
    bounds: tuple[int, ...] = ()

    def piece_shape(self, i: int) -> tuple[int, ...]:
        if self.kind == "rows":
            return (1, *self.full[1:])
        return (self.shards * (self.bounds[i + 1] - self.bounds[i]),)

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether a value of ``shape`` is cut the same way (for ``"rows"``: any shape with ``count`` rows)."""
        if self.kind == "rows":
            return len(shape) >= 1 and shape[0] == self.count
        return tuple(shape) == self.full

    def take(self, x: Any, i: int) -> Any:
        """Piece ``i`` of ``x`` (a value that :meth:`fits`)."""
        if self.kind == "rows":
            return jax.lax.slice_in_dim(x, i, i + 1)
        per = x.reshape(self.shards, -1)
        return per[:, self.bounds[i] : self.bounds[i + 1]].reshape(-1)

    def join(self, parts: Sequence[Any]) -> Any:
        """The whole value from its pieces."""
        if self.kind == "rows":
            return jnp.concatenate(parts, axis=0)
        return jnp.concatenate([p.reshape(self.shards, -1) for p in parts], axis=1).reshape(self.full)


@dataclasses.dataclass(frozen=True)
class _Form:
    """Static description of an offloaded node: its type, plan, layout and how each child is split."""

    kind: str  # "sharded" or "per_device"
    plan: Plan
    layout: Any
    splits: tuple[Any, ...]  # per child: a Split, None for one whole piece, -1 for a non-array child
    memory_kind: str
    by_layer: bool = True  # stream a child piece by piece where the update allows it
    piece_bytes: int = 4 * 2**20

    @property
    def policy(self) -> Offload:
        """The :class:`Offload` policy that gives this form."""
        return Offload(
            memory_kind=self.memory_kind, pieces="layer" if self.by_layer else "bucket", piece_bytes=self.piece_bytes
        )


def full_shape(parts: Sequence[Any], split: Split | None) -> tuple[int, ...]:
    """The global shape of the buffer cut into ``parts`` by ``split``."""
    return tuple(parts[0].shape) if split is None else split.full


@jax.tree_util.register_pytree_node_class
class Offloaded:
    """A :class:`ShardedParams` or :class:`PerDevice` of the optimizer state held in host memory, in pieces.

    Attributes:
      pieces: per child of the node (per bucket buffer of a ``ShardedParams``; the value of a ``PerDevice``), a
        tuple of arrays in host memory: the pieces of the child's :class:`Split` (the ``L`` rows ``(1, m·S)`` of a
        stacked layer group's buffer, or column pieces of a large flat one), else the whole buffer (a child that is
        not an array, such as a masked-out ``None``, is kept as it is).
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


def split_of(
    node: ShardedParams | PerDevice, i: int, shape: Sequence[int], dtype: Any, piece_bytes: int
) -> Split | None:
    """How child ``i`` of ``node`` is cut in host memory: a stacked layer group's bucket-shaped ``(L, m·S)`` buffer
    into its rows; a flat bucket-shaped buffer whose per-device share exceeds ``piece_bytes`` into column pieces;
    anything else (``PerDevice`` values, other shapes) whole (``None``)."""
    if not isinstance(node, ShardedParams):
        return None
    bucket = node.plan.buckets[i]
    if tuple(shape) != tuple(bucket.shape):
        return None
    if bucket.layers is not None:
        return Split("rows", int(bucket.layers), tuple(shape)) if bucket.layers > 1 else None
    spec = node.plan.partition_spec(bucket)
    if len(shape) != 1 or len(spec) != 1 or spec[0] is None:
        return None
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    shards = int(np.prod([node.plan.mesh.shape[a] for a in axes]))
    local = shape[0] // shards
    count = -(-local * np.dtype(dtype).itemsize // piece_bytes)
    if count <= 1 or shape[0] % shards:
        return None
    count = min(count, local)
    bounds = tuple(int(b) for b in np.linspace(0, local, count + 1).round().astype(int))
    return Split("cols", count, tuple(shape), shards, bounds)


def host_form(node: ShardedParams | PerDevice, policy: Offload) -> _Form:
    """The :class:`_Form` ``node`` takes when offloaded by ``policy`` (from its children's shapes)."""
    by_layer = policy.pieces == "layer"
    splits = []
    for i, x in enumerate(_children(node)):
        if not _is_array(x):
            splits.append(-1)
        else:
            splits.append(split_of(node, i, x.shape, x.dtype, policy.piece_bytes) if by_layer else None)
    kind = "sharded" if isinstance(node, ShardedParams) else "per_device"
    layout = node.layout if isinstance(node, PerDevice) else None
    return _Form(kind, node.plan, layout, tuple(splits), policy.memory_kind, by_layer, policy.piece_bytes)


def empty_node(form: _Form, children: Sequence[Any]) -> ShardedParams | PerDevice:
    """The device node of ``form`` around ``children``."""
    if form.kind == "sharded":
        return ShardedParams(children, form.plan)
    return PerDevice(children[0], form.plan, form.layout)


def _to_host(node: ShardedParams | PerDevice, policy: Offload) -> Offloaded:
    form = host_form(node, policy)
    pieces = []
    for i, (x, split) in enumerate(zip(_children(node), form.splits, strict=True)):
        if split == -1:
            pieces.append((x,))
            continue
        host = device_sharding(node, i, x.shape).with_memory_kind(form.memory_kind)
        parts = [x] if split is None else [split.take(x, r) for r in range(split.count)]
        pieces.append(tuple(jax.device_put(p, host) for p in parts))
    return Offloaded(pieces, form)


def device_node(off: Offloaded, child: Callable[[int, tuple[Any, ...], Split | None, NamedSharding], Any]) -> Any:
    """The device node of ``off``'s form whose array children are ``child(i, pieces, split, sharding)`` (the
    device ``NamedSharding`` of child ``i``'s whole buffer); children that are not arrays are kept."""
    form = off.form
    shell = empty_node(form, [None] * len(form.splits))
    children = []
    for i, (parts, split) in enumerate(zip(off.pieces, form.splits, strict=True)):
        if split == -1:
            children.append(parts[0])
        else:
            children.append(child(i, parts, split, device_sharding(shell, i, full_shape(parts, split))))
    return empty_node(form, children)


def to_device(off: Offloaded) -> ShardedParams | PerDevice:
    """The device node an :class:`Offloaded` holds (pieces joined on the device)."""

    def child(i, parts, split, sharding):
        moved = [_to_device_memory(p, sharding) for p in parts]
        return moved[0] if split is None else split.join(moved)

    return device_node(off, child)


def _to_device_memory(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """``x`` (a piece in host memory) copied to ``sharding``'s device memory by a compiled copy: JAX 0.12.1's
    ``jax.device_put`` refuses, on CPU devices, a buffer a compiled step wrote to pinned host memory ("Unsupported
    layout used for PjRt CPU buffers: {1,0:S(5)}"); the copy program reads it as any program's input."""
    return _copy_to(sharding)(x)


@functools.cache
def _copy_to(sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: x, out_shardings=sharding)


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
