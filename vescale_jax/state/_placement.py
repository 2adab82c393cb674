"""Where a step's state lives: optimizer state and step outputs placed by type, never by shape.

Children of a ``ShardedParams`` carry their bucket's ``NamedSharding``, ``PerDevice`` values are split over
the plan's axis on dim 0, everything else is replicated (state) or left as computed (outputs).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vescale_jax.layout._checks import plan_difference
from vescale_jax.layout._plan import Plan, mesh_size
from vescale_jax.state._checks import check_sharded_params
from vescale_jax.state._offloaded import Offload
from vescale_jax.state._offloaded import offload as offload_tree
from vescale_jax.state._sharded import PerDevice, ShardedParams

__all__ = ["constrain_outputs", "init_opt_state"]


def _is_node(x: Any) -> bool:
    return isinstance(x, ShardedParams | PerDevice)


def _bucket_shardings(node: ShardedParams, plan: Plan) -> list[NamedSharding | None]:
    """Per child of a ``ShardedParams`` of ``plan``: its bucket's sharding where the bucket's spec fits the
    child's shape (dim and divisibility), else ``None``. Nodes of other plans get ``None`` everywhere."""
    if node.plan != plan:
        return [None] * len(node.buffers)
    m = plan.num_devices
    out = []
    for bucket, x in zip(plan.buckets, node.buffers, strict=True):
        shape = getattr(x, "shape", None)
        # a grouped bucket (leaves split over tensor / expert axes) spans G groups of m devices
        fits = shape is not None and len(shape) == len(bucket.shape) and shape[-1] % (m * bucket.num_groups) == 0
        out.append(NamedSharding(plan.mesh, plan.partition_spec(bucket)) if fits else None)
    return out


def _per_device_sharding(node: PerDevice, plan: Plan) -> NamedSharding | None:
    """``P(node.axes, None, ...)`` on the value of a ``PerDevice`` of ``plan`` (the full spec, as shard_map outputs
    carry it: no recompilation), else ``None``."""
    shape = tuple(getattr(node.value, "shape", None) or ())
    axes = node.axes
    if node.plan != plan or not shape or shape[0] % mesh_size(plan.mesh, axes):
        return None
    return NamedSharding(plan.mesh, P(axes, *[None] * (len(shape) - 1)))


def _state_shardings(tree: Any, plan: Plan) -> Any:
    """The ``out_shardings`` of an optimizer state, by type: children of a ``ShardedParams`` of ``plan`` like
    their bucket, ``PerDevice`` values split on dim 0, everything else (counts, scalars, any other array,
    whatever its shape) replicated."""
    replicated = NamedSharding(plan.mesh, P())

    def one(x):
        if isinstance(x, ShardedParams):
            shardings = _bucket_shardings(x, plan)
            return ShardedParams(
                [
                    b if not hasattr(b, "shape") else s or replicated  # an empty node stays empty
                    for b, s in zip(x.buffers, shardings, strict=True)
                ],
                x.plan,
            )
        if isinstance(x, PerDevice):
            return x.replace(_per_device_sharding(x, plan) or replicated)
        return replicated

    return jax.tree.map(one, tree, is_leaf=_is_node)


def init_opt_state(tx: Any, params: ShardedParams, *, plan: Plan | None = None, offload: Offload | None = None) -> Any:
    """``tx.init(params)`` jitted so every parameter-like state (a ``ShardedParams``) is sharded like the buckets.

    Args:
      tx: an ``optax.GradientTransformation``.
      params: the sharded parameters; the state is placed by the plan they carry.
      plan: optional; given, it must be the params' plan (another one raises, saying how they differ).
      offload: a :class:`vj.Offload`: the state for a ``vj.fsdp(offload=...)`` step, its ``ShardedParams`` and
        ``PerDevice`` nodes moved to host memory (:func:`vj.offload`).

    Returns:
      The optimizer state. Placement goes by type, not shape: the children of each :class:`ShardedParams` carry
      their bucket's ``NamedSharding``, :class:`vescale_jax.PerDevice` values are split over the plan's
      axis on dim 0, and every other leaf (counts, scalars, any other array, even one shaped like a bucket) is
      replicated.
    """
    if isinstance(tx, ShardedParams) and not isinstance(params, ShardedParams):
        raise TypeError("vj.init_opt_state: the arguments are (tx, params); got the params first.")
    check_sharded_params(params, "vj.init_opt_state")
    if not callable(getattr(tx, "init", None)):
        hint = (
            f"{getattr(tx, '__name__', tx)!r} looks like an optimizer factory: call it (e.g. optax.adamw(1e-3))"
            if callable(tx)
            else "pass e.g. optax.adamw(1e-3) or vj.optim.muon(1e-3)"
        )
        raise TypeError(
            f"vj.init_opt_state: tx must be an optax.GradientTransformation, got {type(tx).__name__}; {hint}."
        )
    if plan is not None and params.plan != plan:
        raise ValueError(
            f"vj.init_opt_state: params were sharded with another plan than plan= "
            f"({plan_difference(params.plan, plan)}); leave plan= out to use the plan the params carry, or "
            "re-shard them with this plan (vj.shard(vj.unshard(params), plan))."
        )
    plan = params.plan
    shapes = jax.eval_shape(tx.init, params)
    if offload is not None and not isinstance(offload, Offload):
        raise TypeError(f"vj.init_opt_state: offload= must be a vj.Offload, got {type(offload).__name__}.")
    with jax.set_mesh(plan.mesh):
        state = jax.jit(tx.init, out_shardings=_state_shardings(shapes, plan))(params)
    return state if offload is None else offload_tree(state, offload)


def constrain_outputs(out: Any, plan: Plan) -> Any:
    """Sharding hints on a step's outputs, by type: children of a ``ShardedParams`` of ``plan`` like their
    bucket, ``PerDevice`` values split on dim 0; any other output keeps the sharding its computation gives it
    (even one shaped like a bucket)."""

    def constrain(x, sharding):
        return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

    def one(x):
        if isinstance(x, ShardedParams):
            return ShardedParams(
                [constrain(b, s) for b, s in zip(x.buffers, _bucket_shardings(x, plan), strict=True)], x.plan
            )
        if isinstance(x, PerDevice):
            return x.replace(constrain(x.value, _per_device_sharding(x, plan)))
        return x

    return jax.tree.map(one, out, is_leaf=_is_node)
