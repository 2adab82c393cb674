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

from vescale_jax._compat import is_tracer
from vescale_jax.layout._checks import plan_difference
from vescale_jax.layout._plan import Plan
from vescale_jax.state._containers import PerDevice, ShardedParams

__all__ = [
    "abstract_params",
    "check_same_plan",
    "check_sharded",
    "is_placeholder",
    "leaf_mask",
    "local_vector",
    "masked_decay",
    "per_element",
    "place_state",
    "plan_of",
    "prefix_per_leaf",
    "split_local",
    "state_sharding",
    "static_int",
]


def abstract_params(plan: Plan) -> Any:
    """The plan's logical tree as ``jax.ShapeDtypeStruct`` leaves."""
    leaves = [jax.ShapeDtypeStruct(s.shape, jnp.dtype(s.dtype)) for s in plan.leaves]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def prefix_per_leaf(
    prefix: Any, full: Any, is_leaf: Callable[[Any], bool], *, what: str = "the prefix tree", fix: str = ""
) -> list[Any]:
    """Per-leaf values (in the plan's flattening order) of a prefix tree of ``full``.

    Raises:
      ValueError: ``prefix`` is not a prefix tree of ``full``; the message names ``what``, the key paths of
        ``prefix`` that are not in ``full`` and the leaves of ``full`` it leaves uncovered, and ends with ``fix``.
    """
    out: list[Any] = []
    try:
        jax.tree.map(lambda v, sub: out.extend([v] * len(jax.tree.leaves(sub))), prefix, full, is_leaf=is_leaf)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"{what} is not a prefix tree of the params: {_prefix_difference(prefix, full, is_leaf)}. {fix}".rstrip()
        ) from e
    return out


def _prefix_difference(prefix: Any, full: Any, is_leaf: Callable[[Any], bool]) -> str:
    """Which key paths of ``prefix`` name no subtree of ``full``, and which leaves of ``full`` no entry covers."""
    keys = lambda tree, leaf: [
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf)[0]
    ]
    given = keys(prefix, lambda x: x is None or is_leaf(x))
    leaves = keys(full, None)
    extra = [g for g in given if not any(f.startswith(g) for f in leaves)]
    uncovered = [f for f in leaves if not any(f.startswith(g) for g in given)]
    parts = []
    if extra:
        parts.append(f"not in the params: {', '.join(extra[:6])}{' ...' if len(extra) > 6 else ''}")
    if uncovered:
        parts.append(f"params it does not cover: {', '.join(uncovered[:6])}{' ...' if len(uncovered) > 6 else ''}")
    return (
        "; ".join(parts) or "the same key paths in other container types (a dict for an nnx.State, a list for a tuple)"
    )


def _local_runs(plan: Plan) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per bucket: ``(m, R)`` int32 tables ``lo, hi, leaf`` of the leaf runs on each device, as offsets
    *relative to the device's shard start* (``0 <= lo < hi <= S``, sorted by ``lo``; unused entries have
    ``lo = hi = S``). Local offsets fit int32 whenever the shard does, however large the bucket (a global
    element index ``k * S + i`` of a bucket past 2**31 elements would wrap in int32)."""
    out = []
    for b in plan.buckets:
        m, size = plan.num_devices, b.layout.shard_size
        if size >= 2**31:
            raise ValueError(
                f"vj.optim: bucket {b.name!r} has {size} elements per device, past int32 indices; split the unit "
                "(units=...) or use more devices."
            )
        runs: list[list[tuple[int, int, int]]] = [[] for _ in range(m)]
        for slot, leaf in enumerate(b.leaves):
            o, n = b.layout.offsets[slot], b.layout.sizes[slot]
            for k in range(o // size, (o + n - 1) // size + 1) if n else ():
                runs[k].append((max(o - k * size, 0), min(o + n - k * size, size), leaf))
        width = max(1, max(len(r) for r in runs))
        lo = np.full((m, width), size, np.int64)
        hi, leaf = lo.copy(), np.zeros((m, width), np.int64)
        for k, rs in enumerate(runs):
            for j, run in enumerate(sorted(rs)):
                lo[k, j], hi[k, j], leaf[k, j] = run
        out.append((lo.astype(np.int32), hi.astype(np.int32), leaf.astype(np.int32)))
    return out


def local_leaf(lo: jax.Array, hi: jax.Array, leaf: jax.Array, i: jax.Array, pad: int) -> jax.Array:
    """The leaf of each local position ``i`` of one device (``pad`` for padding), from that device's row of
    :func:`_local_runs`."""
    slot = jnp.clip(jnp.searchsorted(lo, i, side="right") - 1, 0, lo.shape[0] - 1)
    inside = (i >= lo[slot]) & (i < hi[slot])
    return jnp.where(inside, leaf[slot], pad)


def per_element(plan: Plan, like: Sequence[jax.Array], table: Any) -> list[jax.Array]:
    """Global buffers (sharded like ``like``) holding ``table[leaf]`` at each leaf's elements, ``table[-1]``
    (``table`` has ``num_leaves + 1`` entries) at padding. Computed locally from ``axis_index``, with indices
    relative to each device's shard (int32 for any bucket size whose shard fits int32)."""
    runs = _local_runs(plan)
    axis = plan.axis
    pad = len(plan.leaves)

    def local(*shards):
        k = jax.lax.axis_index(axis)
        out = []
        for b, s, (lo, hi, leaf_of) in zip(plan.buckets, shards, runs, strict=True):
            size = b.layout.shard_size
            i = jnp.arange(size, dtype=jnp.int32)
            leaf = local_leaf(*(jnp.asarray(t)[k] for t in (lo, hi, leaf_of)), i, pad)
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
    check_same_plan(updates.plan, plan, what)


def check_same_plan(data: Plan, given: Plan | None, what: str) -> None:
    """Raises, saying how they differ, when ``plan=`` was given and the data's plan is another one."""
    if given is not None and data != given:
        raise ValueError(
            f"vj.optim.{what}: the updates were sharded with another plan than the one given "
            f"({plan_difference(data, given)}); build the optimizer with plan=params.plan, or leave plan= out "
            "(the optimizer then reads the plan from the params it sees)."
        )


def plan_of(tree: Any, given: Plan | None, what: str) -> Plan:
    """The plan of ``tree`` (a :class:`~vescale_jax.ShardedParams`), checked against ``plan=`` when given.

    Args:
      tree: the params or updates a transformation sees.
      given: the ``plan=`` its constructor was given, or ``None``.
      what: the transformation's name, for error messages.

    Returns:
      ``tree.plan``.
    """
    check_sharded(tree, given if given is not None else getattr(tree, "plan", None), what)
    return tree.plan


def leaf_mask(plan: Plan, mask: Any, default: bool = True) -> np.ndarray:
    """A logical (prefix) tree of bools, or a callable of the logical tree, as a per-leaf table."""
    if mask is None:
        values = [default] * len(plan.leaves)
    else:
        abstract = abstract_params(plan)
        tree = mask(abstract) if callable(mask) else mask
        values = (
            [True] * len(plan.leaves)
            if isinstance(tree, bool)
            else prefix_per_leaf(tree, abstract, lambda x: isinstance(x, bool | np.bool_))
        )
    return np.array([*map(bool, values), False])


def static_int(value: Any, name: str, what: str) -> int:
    """``value`` as a Python int, or a ValueError saying it must be static (e.g. under
    ``optax.inject_hyperparams``, which traces every numeric argument unless listed in ``static_args``)."""
    if not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.integer):
        return value  # a Python value: validated where it is used
    try:
        return int(value)
    except (jax.errors.ConcretizationTypeError, TypeError) as e:
        raise ValueError(
            f"vj.optim.{what}: {name} fixes array shapes and must be a static Python int, got {value!r}; with "
            f"optax.inject_hyperparams pass static_args=({name!r},)."
        ) from e


def masked_decay(plan: Plan, weight_decay: Any, table: np.ndarray) -> optax.GradientTransformation:
    """Adds ``weight_decay * param`` to the updates of the leaves with ``table[leaf]`` (a per-leaf bool table
    with a final ``False`` for padding); other elements are unchanged. ``weight_decay`` may be traced."""

    def update_fn(updates, state, params=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("weight decay needs the params: call tx.update(grads, state, params).")
        on = per_element(plan, updates.buffers, table)
        decay = jnp.asarray(weight_decay)
        out = [
            jnp.where(o, u + decay.astype(p.dtype) * p, u)
            for u, p, o in zip(updates.buffers, params.buffers, on, strict=True)
        ]
        return ShardedParams(out, plan), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


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
            out.append(jnp.reshape(x[base : base + n], s.shape).astype(s.dtype))
            base += n
        else:
            out.append(jnp.zeros_like(s))
    return out


def is_placeholder(params: Any) -> bool:
    """Whether ``params`` is the structure-only stand-in ``optax.tree.map_params`` passes to ``tx.init`` (a
    pytree node with no leaves), rather than parameters."""
    return not isinstance(params, ShardedParams) and not jax.tree.leaves(params)


def state_sharding(x: Any, plan: Plan) -> jax.sharding.NamedSharding:
    """The sharding of one optimizer-state array: a bucket-shaped one like its bucket, a ``PerDevice`` value
    (``m * B`` rows) over the plan's axis on dim 0, anything else (counts, scalars) replicated."""
    P = jax.sharding.PartitionSpec
    shape = tuple(x.shape)
    for b in plan.buckets:
        if b.shape == shape:
            return jax.sharding.NamedSharding(plan.mesh, plan.partition_spec(b))
    return jax.sharding.NamedSharding(plan.mesh, P())


def place_state(state: Any, plan: Plan) -> Any:
    """``state`` with every array placed by :func:`state_sharding` (``PerDevice`` values split on dim 0).

    Works eagerly (``device_put``) and under ``jit`` (a sharding constraint on Auto mesh axes, ``reshard`` on
    Explicit ones), so ``tx.init(params)`` and ``jax.jit(tx.init)(params)`` give the same shardings as the
    state ``tx.update`` returns: a jitted step then compiles once, and ``lax.cond``/``select`` over states
    (``optax.MultiSteps``) sees matching shardings.
    """
    P = jax.sharding.PartitionSpec
    auto = all(t == jax.sharding.AxisType.Auto for t in plan.mesh.axis_types)

    def put(x, sharding):
        if not isinstance(x, jax.Array):
            return x
        if is_tracer(x):
            return jax.lax.with_sharding_constraint(x, sharding) if auto else jax.sharding.reshard(x, sharding)
        return jax.device_put(x, sharding)

    def one(x):
        if isinstance(x, PerDevice):
            if not hasattr(x.value, "shape"):
                return x
            spec = P(x.axes, *[None] * (len(x.value.shape) - 1))
            return x.replace(put(x.value, jax.sharding.NamedSharding(plan.mesh, spec)))
        return put(x, state_sharding(x, plan)) if hasattr(x, "shape") else x

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, PerDevice))
