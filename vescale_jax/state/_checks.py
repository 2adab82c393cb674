"""Checks on sharded state passed to the public functions: each names what was passed and the fix."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from vescale_jax._compat import is_tracer
from vescale_jax.state._containers import GatheredParams, PerDevice, ShardedParams

__all__ = ["check_not_donated", "check_sharded_params", "check_state_not_logical", "plan_states"]


def check_not_donated(x: ShardedParams, fn: str, *, what: str = "params") -> None:
    """ValueError naming the bucket when a buffer of ``x`` was deleted (donated to a ``vj.fsdp`` step, or
    deleted by hand): JAX would raise "Array has been deleted" from deep inside, naming neither."""
    for bucket, buf in zip(x.plan.buckets, x.buffers, strict=True):
        if isinstance(buf, jax.Array) and not is_tracer(buf) and buf.is_deleted():
            raise ValueError(
                f"{fn}: {what} were donated to a vj.fsdp step (or deleted): the buffer of bucket {bucket.name!r} "
                f"{bucket.shape} is deleted. Use the params the step returned (write `params, opt_state, ... = "
                "step(params, opt_state, batch)` and read `params` after it), or compile the step with "
                "vj.fsdp(..., donate=False) to keep its inputs."
            )


def check_sharded_params(x: Any, fn: str, *, what: str = "params") -> None:
    """TypeError unless ``x`` is a ``vj.ShardedParams`` (the fix depends on what was passed instead)."""

    if isinstance(x, ShardedParams):
        return
    if isinstance(x, GatheredParams | PerDevice):
        hint = f"a {type(x).__name__} is internal state, not parameters; pass the vj.ShardedParams instead."
    elif x is None:
        hint = "build them with vj.shard(params, plan) or vj.init_sharded(init_fn, plan, key)."
    else:
        inner = [
            type(v).__name__
            for v in jax.tree.leaves(x, is_leaf=lambda v: isinstance(v, ShardedParams))
            if isinstance(v, ShardedParams)
        ]
        hint = (
            "it holds a vj.ShardedParams inside; pass that one, not the container."
            if inner
            else "a logical tree is not sharded yet: pass vj.shard(params, plan) (or vj.init_sharded(init_fn, "
            "plan, key))."
        )
    raise TypeError(f"{fn}: {what} must be a vj.ShardedParams, got {type(x).__name__}; {hint}")


def check_buffers_fit_plan(sp: ShardedParams, fn: str) -> None:
    """ValueError naming the bucket when a buffer of ``sp`` is not an array of its bucket's shape (buffers from
    another plan, or made by hand).

    Only the geometry is checked: a buffer may hold any dtype (optimizer moments in fp32 over bf16 params, 8-bit
    codes), as every parameter-shaped optimizer state does.

    Args:
      sp: the sharded tree (parameters or a parameter-shaped optimizer state).
      fn: the public function's name, for the message.
    """
    for i, (bucket, x) in enumerate(zip(sp.plan.buckets, sp.buffers, strict=True)):
        shape, dtype = tuple(getattr(x, "shape", ())), getattr(x, "dtype", None)
        if shape != tuple(bucket.shape) or dtype is None:
            got = f"shape {shape} and dtype {dtype}" if dtype is None else f"shape {shape}"
            raise ValueError(
                f"{fn}: buffer {i} (bucket {bucket.name!r}, unit {bucket.unit!r}) has {got}; its plan stores that "
                f"bucket as an array of shape {tuple(bucket.shape)} (of any dtype: the params' are "
                f"{np.dtype(bucket.dtype).name}). The buffers do not belong to this plan: pair them with the plan "
                "they were made under (the ShardedParams vj.shard / vj.init_sharded / a checkpoint restore / the "
                "optimizer's init returned); parameters move to another plan by vj.shard(vj.unshard(sp), plan), "
                "or by restoring a checkpoint into that plan."
            )


def plan_states(tree: Any) -> list[tuple[str, Any]]:
    """``(key path, node)`` of every ``ShardedParams`` / ``PerDevice`` inside an optimizer-state tree."""

    kinds = ShardedParams | PerDevice
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: isinstance(v, kinds))[0]
    return [(jax.tree_util.keystr(p) or "<root>", v) for p, v in flat if isinstance(v, kinds)]


def check_state_not_logical(opt_state: Any, plan: Any) -> None:
    """ValueError if the optimizer state holds the plan's *logical* tree (``tx.init`` ran on unsharded params)."""
    if plan.treedef.num_leaves < 2 or plan_states(opt_state):  # state built on the shards: nothing to say
        return
    shapes = [s.shape for s in plan.leaves]

    def logical(x: Any) -> bool:
        try:
            flat, treedef = jax.tree.flatten(x)
        except Exception:
            return False
        return treedef == plan.treedef and [tuple(np.shape(v)) for v in flat] == shapes

    for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=logical)[0]:
        if logical(node):
            raise ValueError(
                f"vj.fsdp: opt_state{jax.tree_util.keystr(path)} has the structure of the logical parameter tree: the "
                "optimizer state was initialised on the unsharded params (tx.init(params)); initialise it on the "
                "ShardedParams: opt_state = vj.init_opt_state(tx, params)."
            )
