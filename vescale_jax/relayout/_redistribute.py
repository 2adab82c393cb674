"""Moving one tensor between placements inside ``shard_map``; every function is differentiable.

A RaggedShard's local piece on device ``k`` is a 1-D array of ``rs.max_local_size`` elements: the first
``rs.local_sizes[k]`` hold flat elements ``[rs.starts[k], rs.ends[k])`` and the rest are zero. All functions
must be called inside ``shard_map`` (or any context where ``axis`` is bound) and use static index tables
built from the placements, selected per device with ``lax.axis_index``.

* :func:`to_ragged`: replicated -> ragged, a local slice (no communication).
* :func:`from_ragged`: ragged -> replicated, one all-gather.
* :func:`reshard`: ragged -> ragged with other units, one all-to-all padded to the largest piece (XLA:CPU has
  no ragged all-to-all): the relayout engine's :func:`~vescale_jax.relayout._execute.all_to_all` of the moves
  :func:`~vescale_jax.relayout._moves.plan_moves` finds between the two placements.
* :func:`to_dim0` / :func:`from_dim0`: ragged <-> JAX's even dim-0 sharding.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.layout._ragged import RaggedShard
from vescale_jax.relayout._execute import all_to_all
from vescale_jax.relayout._moves import Placement, plan_moves

__all__ = ["from_dim0", "from_ragged", "reshard", "to_dim0", "to_ragged"]

Axis = str | tuple[str, ...]


def _check_devices(rs: RaggedShard, axis: Axis, what: str) -> None:
    try:
        m = jax.lax.axis_size(axis)
    except NameError as e:  # "unbound axis name": called outside shard_map
        raise ValueError(
            f"vj.redistribute.{what}: mesh axis {axis!r} is not bound here; call it inside jax.shard_map over a "
            f"mesh with that axis, e.g. jax.shard_map(lambda x: vj.redistribute.{what}(x, rs, axis={axis!r}), "
            f"mesh=mesh, in_specs=..., out_specs=...) ({rs} has {rs.num_devices} devices)."
        ) from e
    if m != rs.num_devices:
        raise ValueError(f"{what}: {rs} is laid out for {rs.num_devices} devices but axis {axis!r} has {m}.")


def _table(values: Any, dtype=np.int32) -> jax.Array:
    return jnp.asarray(np.asarray(values, dtype=dtype))


def to_ragged(x: jax.Array, rs: RaggedShard, *, axis: Axis) -> jax.Array:
    """Replicated tensor -> this device's padded local piece.

    Args:
      x: the full tensor (same value on every device), of shape ``rs.shape``.
      rs: the target placement.
      axis: the mesh axis (or axes) the placement is over.

    Returns:
      ``(rs.max_local_size,)`` array: this device's elements, zero-padded.

    Sharding:
      Input replicated over ``axis``; output varies over ``axis`` (ragged).
    """
    if tuple(x.shape) != rs.shape:
        raise ValueError(f"to_ragged: input shape {tuple(x.shape)} does not match placement shape {rs.shape}.")
    _check_devices(rs, axis, "to_ragged")
    k = jax.lax.axis_index(axis)
    width = max(rs.max_local_size, 1)
    flat = jnp.pad(jnp.reshape(x, (-1,)), (0, width))
    piece = jax.lax.dynamic_slice(flat, (_table(rs.starts)[k],), (width,))
    piece = jnp.where(jnp.arange(width) < _table(rs.local_sizes)[k], piece, jnp.zeros((), x.dtype))
    return piece[: rs.max_local_size]


def from_ragged(local: jax.Array, rs: RaggedShard, *, axis: Axis) -> jax.Array:
    """Padded local pieces -> the full tensor on every device (one all-gather, then static slices).

    Args:
      local: ``(rs.max_local_size,)`` piece of this device.
      rs: its placement.
      axis: the mesh axis (or axes).

    Returns:
      The tensor of shape ``rs.shape``. Its transpose is a reduce-scatter of the cotangent.
    """
    if tuple(local.shape) != (rs.max_local_size,):
        raise ValueError(f"from_ragged: local piece has shape {tuple(local.shape)}, expected ({rs.max_local_size},).")
    _check_devices(rs, axis, "from_ragged")
    gathered = jax.lax.all_gather(local, axis)  # (m, max_local)
    parts = [gathered[k, :n] for k, n in enumerate(rs.local_sizes) if n]
    flat = jnp.concatenate(parts) if parts else jnp.zeros((0,), local.dtype)
    return jnp.reshape(flat, rs.shape)


def reshard(local: jax.Array, src: RaggedShard, dst: RaggedShard, *, axis: Axis) -> jax.Array:
    """Ragged -> ragged with other units, by one all-to-all.

    Device ``s`` sends device ``d`` the overlap of their ranges; every message is padded to the largest
    overlap, so the collective is a plain (even) all-to-all.

    Args:
      local: ``(src.max_local_size,)`` piece of this device.
      src: the current placement.
      dst: the target placement (same number of elements and devices; any block).
      axis: the mesh axis (or axes).

    Returns:
      ``(dst.max_local_size,)`` piece of this device under ``dst``.
    """
    if src.size != dst.size or src.num_devices != dst.num_devices:
        raise ValueError(f"reshard: {src} and {dst} do not describe the same tensor on the same devices.")
    if tuple(local.shape) != (src.max_local_size,):
        raise ValueError(f"reshard: local piece has shape {tuple(local.shape)}, expected ({src.max_local_size},).")
    _check_devices(src, axis, "reshard")
    moves = plan_moves(Placement.ragged(src), Placement.ragged(dst))
    return all_to_all(local, moves, axis=axis, size=dst.max_local_size)


def to_dim0(local: jax.Array, rs: RaggedShard, *, axis: Axis) -> jax.Array:
    """Ragged -> JAX's even dim-0 sharding: returns this device's ``(shape[0] // m, *shape[1:])`` rows."""
    dst = RaggedShard.dim0(rs.shape, rs.num_devices)
    rows = reshard(local, rs, dst, axis=axis)
    return jnp.reshape(rows, (rs.shape[0] // rs.num_devices, *rs.shape[1:]))


def from_dim0(local_rows: jax.Array, rs: RaggedShard, *, axis: Axis) -> jax.Array:
    """JAX's even dim-0 sharding -> ragged: this device's rows to its padded piece under ``rs``."""
    src = RaggedShard.dim0(rs.shape, rs.num_devices)
    return reshard(jnp.reshape(local_rows, (-1,)), src, rs, axis=axis)
