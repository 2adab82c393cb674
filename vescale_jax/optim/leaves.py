"""Per-leaf tables over the flat buffers, shared by the optimizers in :mod:`vescale_jax.optim`.

A *table* holds one value per leaf of the plan's logical tree plus one for padding (``num_leaves + 1``
entries); :func:`per_element` spreads it over the sharded buffers, computing each device's part locally.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vescale_jax.buffer import ShardedParams
from vescale_jax.plan import Plan

__all__ = [
    "abstract_params", "check_sharded", "leaf_mask", "local_vector", "masked_decay", "per_element", "prefix_per_leaf",
    "split_local",
]


def abstract_params(plan: Plan) -> Any:
    """The plan's logical tree as ``jax.ShapeDtypeStruct`` leaves."""
    leaves = [jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in plan.leaves]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def prefix_per_leaf(prefix: Any, full: Any, is_leaf: Callable[[Any], bool]) -> list[Any]:
    """Per-leaf values (in the plan's flattening order) of a prefix tree of ``full``."""
    out = []
    jax.tree.map(lambda v, sub: out.extend([v] * len(jax.tree.leaves(sub))), prefix, full, is_leaf=is_leaf)
    return out


def _leaf_ids(plan: Plan) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per bucket: sorted slot starts, ends and leaf indices, for element -> leaf lookups."""
    out = []
    for b in plan.buckets:
        order = sorted(range(len(b.leaves)), key=lambda s: b.layout.offsets[s])
        starts = np.array([b.layout.offsets[s] for s in order], np.int64)
        ends = np.array([b.layout.offsets[s] + b.layout.sizes[s] for s in order], np.int64)
        leaves = np.array([b.leaves[s] for s in order], np.int32)
        out.append((starts, ends, leaves))
    return out


def per_element(plan: Plan, like: Sequence[jax.Array], table: np.ndarray) -> list[jax.Array]:
    """Global buffers (sharded like ``like``) holding ``table[leaf]`` at each leaf's elements, ``table[-1]``
    (``table`` has ``num_leaves + 1`` entries) at padding. Computed locally from ``axis_index``."""
    ids = _leaf_ids(plan)
    axis = plan.axis

    def local(*shards):
        k = jax.lax.axis_index(axis)
        out = []
        for b, s, (starts, ends, leaves) in zip(plan.buckets, shards, ids, strict=True):
            size = b.layout.shard_size
            g = k * size + jnp.arange(size)
            if len(starts):
                slot = jnp.clip(jnp.searchsorted(jnp.asarray(starts), g, side="right") - 1, 0, len(starts) - 1)
                inside = (g >= jnp.asarray(starts)[slot]) & (g < jnp.asarray(ends)[slot])
                leaf = jnp.where(inside, jnp.asarray(leaves)[slot], len(plan.leaves))
            else:
                leaf = jnp.full((size,), len(plan.leaves), jnp.int32)
            vals = jnp.take(jnp.asarray(table), leaf)
            out.append(jnp.broadcast_to(vals, s.shape))
        return tuple(out)

    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=specs, out_specs=specs, check_vma=False)
    return list(mapped(*like))


def check_sharded(updates: Any, plan: Plan, what: str) -> None:
    """Raises unless ``updates`` is a :class:`~vescale_jax.ShardedParams` of ``plan`` (``what``: the caller)."""
    if not isinstance(updates, ShardedParams):
        raise TypeError(
            f"vj.optim.{what}: expected vj.ShardedParams, got {type(updates).__name__}; vj.optim transforms run on "
            "the flat shards: pass vj.shard(params, plan) (and the gradients jax.grad gives for it), or use the "
            "optax optimizer on an unsharded tree."
        )
    if updates.plan != plan:
        from vescale_jax._checks import plan_difference

        raise ValueError(
            f"vj.optim.{what}: the updates were sharded with another plan than the one given "
            f"({plan_difference(updates.plan, plan)}); build the optimizer with plan=params.plan."
        )


def leaf_mask(plan: Plan, mask: Any, default: bool = True) -> np.ndarray:
    """A logical (prefix) tree of bools, or a callable of the logical tree, as a per-leaf table."""
    if mask is None:
        values = [default] * len(plan.leaves)
    else:
        abstract = abstract_params(plan)
        tree = mask(abstract) if callable(mask) else mask
        values = [True] * len(plan.leaves) if isinstance(tree, bool) else prefix_per_leaf(
            tree, abstract, lambda x: isinstance(x, bool | np.bool_))
    return np.array([*map(bool, values), False])


def masked_decay(plan: Plan, weight_decay: float, table: np.ndarray) -> optax.GradientTransformation:
    """Adds ``weight_decay * param`` to the updates of the leaves with ``table[leaf]`` (a per-leaf bool table
    with a final ``False`` for padding); other elements are unchanged."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("weight decay needs the params: call tx.update(grads, state, params).")
        on = per_element(plan, updates.buffers, table)
        out = [jnp.where(o, u + weight_decay * p, u) for u, p, o in zip(updates.buffers, params.buffers, on,
                                                                        strict=True)]
        return ShardedParams(out, plan), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def local_vector(shards: Sequence[jax.Array], buckets: Sequence[int], dtype: Any) -> jax.Array:
    """``X``: the local shards of ``buckets`` (indices into ``shards``) flattened and concatenated in that order,
    cast to ``dtype`` (inside ``shard_map``)."""
    parts = [jnp.reshape(shards[b], (-1,)).astype(dtype) for b in buckets]
    return jnp.concatenate(parts) if parts else jnp.zeros((0,), dtype)


def split_local(x: jax.Array, shards: Sequence[jax.Array], buckets: Sequence[int]) -> list[jax.Array]:
    """Inverse of :func:`local_vector`: one array per shard, shaped and typed like it, cut from ``x`` for
    ``buckets`` and zero for the others (inside ``shard_map``)."""
    out, base = [], 0
    for i, s in enumerate(shards):
        if i in buckets:
            n = math.prod(s.shape)
            out.append(jnp.reshape(x[base: base + n], s.shape).astype(s.dtype))
            base += n
        else:
            out.append(jnp.zeros_like(s))
    return out
