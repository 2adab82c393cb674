"""Per-leaf reductions over :class:`~vescale_jax.ShardedParams` as segment reductions over each leaf's range.

Optax's per-leaf transformations (LAMB's trust ratio, ``scale_by_param_block_norm`` / ``_rms``,
``clip_by_block_rms``) reduce over each leaf; on the flat buckets they would reduce over a whole bucket. Here
each device sums its own elements into one slot per logical leaf (a local ``segment_sum`` keyed by
:func:`vescale_jax.state._padding.local_leaf_ids`), one ``psum`` of ``num_leaves`` scalars adds the devices up, and the
per-leaf result is spread back over the leaf's elements locally. A stacked leaf ``(L, ...)`` is one logical
leaf: one norm over all its layers, as Optax computes on the unsharded tree. Padding is excluded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vescale_jax.layout._plan import Plan
from vescale_jax.optim._leaf_tables import plan_of
from vescale_jax.optim._masks import add_decayed_weights, masked
from vescale_jax.state._padding import global_norm, local_leaf_ids, zero_padding
from vescale_jax.state._sharded import ShardedParams

__all__ = [
    "clip_by_block_rms",
    "clip_by_global_norm",
    "lamb",
    "lars",
    "leaf_norms",
    "leaf_sums",
    "scale_by_param_block_norm",
    "scale_by_param_block_rms",
    "scale_by_trust_ratio",
    "scale_leaves",
]


def _no_params(name: str) -> str:
    return (
        f"vj.optim.{name} needs the current parameters: pass them as the third argument of update, "
        "tx.update(updates, state, params)."
    )


def _acc_dtype(dtype: Any) -> Any:
    return jnp.float64 if jnp.dtype(dtype).itemsize >= 8 and jnp.issubdtype(dtype, jnp.inexact) else jnp.float32


def _abs_sq(x: jax.Array) -> jax.Array:
    if jnp.iscomplexobj(x):
        return jnp.real(x * jnp.conj(x)).astype(_acc_dtype(x.dtype))
    x = x.astype(_acc_dtype(x.dtype))
    return x * x


def leaf_sums(tree: ShardedParams, fn: Callable[[jax.Array], jax.Array] = _abs_sq) -> jax.Array:
    """``sum(fn(leaf))`` for every leaf of the logical tree, from the flat buckets.

    Args:
      tree: a ``ShardedParams`` (global buffers).
      fn: element-wise map applied before summing (default ``|x|^2``, accumulated in float32, float64 for
        64-bit buckets); padding never enters.

    Returns:
      ``(num_leaves,)`` replicated array, in the plan's leaf order (a stacked leaf's sum covers all layers).

    Sharding:
      A local ``segment_sum`` per device and one ``psum`` of ``num_leaves`` values over the plan's axis per set
      of bucket axes (``plan.bucket_axes``): a leaf split over tensor / expert groups sums over its groups too.
    """
    plan = tree.plan
    n = len(plan.leaves)
    live = [b for b, x in enumerate(tree.buffers) if isinstance(x, jax.Array | np.ndarray)]
    dtype = jnp.result_type(*[_acc_dtype(tree.buffers[b].dtype) for b in live]) if live else jnp.float32

    # A leaf of a grouped bucket is split over its TP/EP groups too: its sum adds every group's part, so each
    # set of group axes gets its own accumulator, summed over those axes and the plan's (an ungrouped bucket's
    # shards are equal copies across the group axes: summing them there would count them G times).
    by_axes: dict[tuple[str, ...], list[int]] = {}
    for j, b in enumerate(live):
        by_axes.setdefault(plan.bucket_axes(plan.buckets[b]), []).append(j)

    def local(*shards):
        total = jnp.zeros((n + 1,), dtype)
        for axes, members in by_axes.items():
            acc = jnp.zeros((n + 1,), dtype)
            for j in members:
                v = fn(shards[j]).astype(dtype)
                if v.ndim == 2:  # stacked: every layer of a slot belongs to the same logical leaf
                    v = jnp.sum(v, axis=0)
                acc = acc + jax.ops.segment_sum(v, local_leaf_ids(plan, live[j]), num_segments=n + 1)
            total = total + jax.lax.psum(acc, axes)
        return total[:n]

    specs = tuple(plan.partition_spec(plan.buckets[b]) for b in live)
    mapped = jax.shard_map(
        local, mesh=plan.mesh, in_specs=specs, out_specs=jax.sharding.PartitionSpec(), check_vma=False
    )
    return mapped(*[tree.buffers[b] for b in live])


def leaf_norms(tree: ShardedParams) -> Any:
    """The L2 norm of every leaf of the logical tree: ``jax.tree.map(jnp.linalg.norm, vj.unshard(tree))``
    without gathering anything.

    Args:
      tree: a ``ShardedParams``.

    Returns:
      The plan's logical tree with one scalar per leaf.
    """
    norms = jnp.sqrt(leaf_sums(tree))
    return jax.tree_util.tree_unflatten(tree.plan.treedef, [norms[i] for i in range(len(tree.plan.leaves))])


def scale_leaves(tree: ShardedParams, scale: jax.Array) -> ShardedParams:
    """Each leaf's elements times its entry of ``scale`` (``(num_leaves,)``, plan order); padding becomes zero.

    Sharding:
      ``scale`` is replicated; each device scales its own elements.
    """
    plan = tree.plan
    table = jnp.concatenate([jnp.ravel(scale), jnp.zeros((1,), jnp.asarray(scale).dtype)])
    live = [b for b, x in enumerate(tree.buffers) if isinstance(x, jax.Array | np.ndarray)]

    def local(t, *shards):
        out = []
        for b, x in zip(live, shards, strict=True):
            out.append(x * jnp.take(t, local_leaf_ids(plan, b)).astype(x.dtype))
        return tuple(out)

    specs = tuple(plan.partition_spec(plan.buckets[b]) for b in live)
    mapped = jax.shard_map(
        local, mesh=plan.mesh, in_specs=(jax.sharding.PartitionSpec(), *specs), out_specs=specs, check_vma=False
    )
    buffers = list(tree.buffers)
    for b, x in zip(live, mapped(table, *[tree.buffers[b] for b in live]), strict=True):
        buffers[b] = x
    return ShardedParams(buffers, plan)


def _safe(value: jax.Array, minimum: Any) -> jax.Array:
    """``numerics.safe_norm``'s forward value: ``minimum`` where ``value <= minimum``."""
    return jnp.where(value <= minimum, jnp.asarray(minimum, value.dtype), value)


def _sizes(plan: Plan) -> jax.Array:
    return jnp.asarray(np.maximum([s.size for s in plan.leaves], 1), jnp.float32)


def scale_by_trust_ratio(
    min_norm: float = 0.0,
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
    *,
    plan: Plan | None = None,
) -> optax.GradientTransformation:
    """``optax.scale_by_trust_ratio`` over :class:`~vescale_jax.ShardedParams`: one trust ratio per logical leaf.

    Args:
      min_norm: lower bound of the parameter and update norms.
      trust_coefficient: multiplies the ratio.
      eps: added to the update norm.
      plan: the plan (default: the params' plan).

    Returns:
      Updates scaled by ``trust_coefficient * |param| / (|update| + eps)`` per leaf (1 where either norm is 0).

    Sharding:
      Two :func:`leaf_sums` (one ``psum`` of ``num_leaves`` scalars each) and a local scale.
    """

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(_no_params("scale_by_trust_ratio"))
        plan_of(updates, plan, "scale_by_trust_ratio")
        param_norm = _safe(jnp.sqrt(leaf_sums(params)), min_norm)
        update_norm = _safe(jnp.sqrt(leaf_sums(updates)), min_norm)
        ratio = trust_coefficient * param_norm / (update_norm + eps)
        ratio = jnp.where((param_norm == 0.0) | (update_norm == 0.0), jnp.ones((), ratio.dtype), ratio)
        return scale_leaves(updates, ratio), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def lamb(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-6,
    eps_root: jax.typing.ArrayLike = 0.0,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: Any = None,
    *,
    plan: Plan | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optax.lamb`` over :class:`~vescale_jax.ShardedParams`: trust ratios per logical leaf, ``mask`` over the
    logical tree. Same arguments as ``optax.lamb``, plus ``plan`` (default: the params' plan).

    Returns:
      ``chain(scale_by_adam, add_decayed_weights(weight_decay, mask), scale_by_trust_ratio,
      scale_by_learning_rate)``.
    """
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root),
        add_decayed_weights(weight_decay, mask, plan=plan),
        scale_by_trust_ratio(plan=plan),
        optax.scale_by_learning_rate(learning_rate),
    )


def lars(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: optax.ScalarOrSchedule = 0.0,
    weight_decay_mask: Any = True,
    trust_coefficient: jax.typing.ArrayLike = 0.001,
    eps: jax.typing.ArrayLike = 0.0,
    trust_ratio_mask: Any = True,
    momentum: jax.typing.ArrayLike = 0.9,
    nesterov: bool = False,
    *,
    plan: Plan | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optax.lars`` over :class:`~vescale_jax.ShardedParams`: trust ratios per logical leaf, both masks over
    the logical tree. Same arguments as ``optax.lars``, plus ``plan`` (default: the params' plan).

    Returns:
      ``chain(add_decayed_weights(weight_decay, weight_decay_mask), masked(scale_by_trust_ratio,
      trust_ratio_mask), scale_by_learning_rate, trace(momentum, nesterov))``.
    """
    return optax.chain(
        add_decayed_weights(weight_decay, weight_decay_mask, plan=plan),
        masked(
            scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps, plan=plan), trust_ratio_mask, plan=plan
        ),
        optax.scale_by_learning_rate(learning_rate),
        optax.trace(decay=momentum, nesterov=nesterov),
    )


def scale_by_param_block_norm(min_scale: float = 1e-3, *, plan: Plan | None = None) -> optax.GradientTransformation:
    """``optax.scale_by_param_block_norm`` over ``ShardedParams``: updates times each logical leaf's param norm
    (at least ``min_scale``)."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(_no_params("scale_by_param_block_norm"))
        plan_of(updates, plan, "scale_by_param_block_norm")
        return scale_leaves(updates, _safe(jnp.sqrt(leaf_sums(params)), min_scale)), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_param_block_rms(min_scale: float = 1e-3, *, plan: Plan | None = None) -> optax.GradientTransformation:
    """``optax.scale_by_param_block_rms`` over ``ShardedParams``: updates times each logical leaf's param RMS
    (at least ``min_scale``)."""

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(_no_params("scale_by_param_block_rms"))
        p = plan_of(updates, plan, "scale_by_param_block_rms")
        rms = jnp.sqrt(leaf_sums(params) / _sizes(p).astype(leaf_sums(params).dtype))
        return scale_leaves(updates, _safe(rms, min_scale)), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def clip_by_block_rms(threshold: float, *, plan: Plan | None = None) -> optax.GradientTransformation:
    """``optax.clip_by_block_rms`` over ``ShardedParams``: each logical leaf's update divided by
    ``max(1, rms(leaf) / threshold)``."""

    def update_fn(updates, state, params=None):
        del params
        p = plan_of(updates, plan, "clip_by_block_rms")
        sums = leaf_sums(updates)
        rms = jnp.sqrt(sums / _sizes(p).astype(sums.dtype))
        return scale_leaves(updates, 1.0 / jnp.maximum(1.0, rms / threshold)), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` whose norm excludes the padding of every ``ShardedParams`` (and whose
    output keeps it zero): the logical tree's global norm, even after a non-finite value reached the padding.

    Args:
      max_norm: the maximum global norm.

    Returns:
      Updates scaled by ``max_norm / norm`` when ``norm >= max_norm``. Works on any tree (plain arrays too).
    """

    def update_fn(updates, state, params=None):
        del params
        updates = zero_padding(updates)
        g_norm = global_norm(updates)
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip_fn(t):
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip_fn, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
