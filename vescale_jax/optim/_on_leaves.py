"""Run an element-wise Optax transformation on a subset of leaves only, with state for those elements only.

Muon and Shampoo hand their non-matrix leaves (norm scales, biases, embeddings by choice) to AdamW. Those
leaves are usually a sliver of the parameters but sit inside the same buckets as the matrices, so running
AdamW on whole buckets would keep two moments for every parameter. :func:`on_leaves` instead gathers, on
each device, the elements of the chosen leaves from its local shards into one compact vector (static range
tables from the plan; no communication), runs the transformation there, and scatters the updates back.
The state is ``PerDevice``: each device keeps the moments of the elements it holds. Chosen leaves of different
dtypes get one compact vector per dtype, so the transformation computes and keeps its state in each leaf's own
dtype, as Optax does on the logical tree (a bf16 bias keeps bf16 AdamW moments unless ``mu_dtype`` says
otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from vescale_jax.layout._plan import Plan
from vescale_jax.optim._compact_tables import CompactTables, build_compact, chosen_dtype
from vescale_jax.optim._leaf_tables import check_sharded, is_placeholder, local_vector, place_state, split_local
from vescale_jax.optim._rows_to_logical import per_device_axes
from vescale_jax.optim._state_layouts import CompactLayout
from vescale_jax.state._sharded import PerDevice, ShardedParams
from vescale_jax.step._wire import tie

__all__ = ["CompactTables", "build_compact", "dtype_groups", "on_leaves", "split_leaves"]


def _source_index(tables: CompactTables, k: jax.Array) -> jax.Array:
    """For each compact position on device ``k``: its index in ``X`` (``local_size`` past the end)."""
    pos = jnp.arange(tables.size, dtype=jnp.int32)
    position, start, length = (jnp.asarray(t)[k] for t in (tables.position, tables.start, tables.length))
    r = jnp.clip(jnp.searchsorted(position, pos, side="right") - 1, 0, position.shape[0] - 1)
    i = pos - position[r]
    return jnp.where(i < length[r], start[r] + i, tables.local_size)


def _mapped(plan: Plan, tables: CompactTables, fn, in_compact: int, in_buckets: int, out_compact: bool):
    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    per_device = jax.sharding.PartitionSpec(per_device_axes(plan))  # with tp: each TP/EP group's own elements
    in_specs = (per_device,) * in_compact + specs * in_buckets
    out_specs = per_device if out_compact else specs
    return jax.shard_map(fn, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def compact(buffers: Sequence[jax.Array], plan: Plan, tables: CompactTables, dtype: Any = None) -> jax.Array:
    """``(m * n,)`` global array (``G * m * n`` with ``G`` TP/EP groups): each device's chosen elements of ``buffers``,
    zero-padded, in ``dtype`` (default: the widest bucket dtype)."""

    if dtype is None:  # strict promotion has no bf16/f32 path: one dtype for the whole vector
        dtype = max((jnp.dtype(b.dtype) for b in buffers), key=lambda d: d.itemsize, default=jnp.dtype(jnp.float32))

    def local(*shards):
        k = jax.lax.axis_index(plan.axis)
        x = local_vector(shards, range(len(shards)), dtype)
        return jnp.take(x, _source_index(tables, k), mode="fill", fill_value=0)

    return _mapped(plan, tables, local, 0, 1, True)(*buffers)


def expand(values: jax.Array, like: Sequence[jax.Array], plan: Plan, tables: CompactTables) -> list[jax.Array]:
    """Inverse of :func:`compact`: buffers shaped like ``like`` with ``values`` at the chosen elements, zero
    elsewhere."""

    def local(v, *shards):
        k = jax.lax.axis_index(plan.axis)
        # tie: the full-size buffer is allocated only once ``v`` exists (a constant would be placed at the start).
        x = tie([jnp.zeros((tables.local_size,), v.dtype)], v)[0].at[_source_index(tables, k)].set(v, mode="drop")
        return tuple(split_local(x, shards, range(len(shards))))

    return list(_mapped(plan, tables, local, 1, 1, False)(values, *like))


def dtype_groups(plan: Plan, chosen: Sequence[bool]) -> list[tuple[str, tuple[bool, ...]]]:
    """The chosen leaves split by their bucket's dtype: ``[(dtype name, chosen of that dtype)]``, widest first
    (then by name)."""
    names = {plan.buckets[s.bucket].dtype for s, c in zip(plan.leaves, chosen, strict=True) if c}
    order = sorted(names, key=lambda n: (-jnp.dtype(n).itemsize, n))
    return [
        (n, tuple(bool(c) and plan.buckets[s.bucket].dtype == n for s, c in zip(plan.leaves, chosen, strict=True)))
        for n in order
    ]


def on_leaves(tx: optax.GradientTransformation, plan: Plan, chosen: Sequence[bool]) -> optax.GradientTransformation:
    """``tx`` (element-wise) applied to the chosen leaves only, over :class:`~vescale_jax.ShardedParams`.

    Args:
      tx: an element-wise Optax transformation (e.g. ``optax.adamw``).
      plan: the plan.
      chosen: per leaf (flattening order), whether ``tx`` handles it.

    Returns:
      A transformation whose updates are ``tx``'s at the chosen leaves' elements and zero elsewhere. When the
      chosen leaves have one dtype its state is ``tx``'s over one compact vector in that dtype; with several,
      a dict ``{dtype name: tx's state}`` with one compact vector per dtype, so each leaf is transformed (and
      keeps its state) in its own dtype, as ``tx`` on the logical tree does.

    ``tx.init`` sees zeros of the compact vector's shape (true of element-wise transformations, whose state
    starts from the shapes).

    Sharding:
      ``tx``'s state is built over a ``PerDevice`` compact vector: each device keeps state for the chosen
      elements it holds (``max`` over devices of their count), nothing for the others. Its ``PerDevice``
      leaves carry a :class:`~vescale_jax.optim._state_layouts.CompactLayout` (re-placing them under another plan).
    """
    groups = dtype_groups(plan, chosen)
    if len(groups) > 1:
        return _by_dtype({name: _on_leaves(tx, plan, mask) for name, mask in groups})
    return _on_leaves(tx, plan, chosen)


def _by_dtype(parts: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """One :func:`_on_leaves` per dtype; updates summed (disjoint supports), state ``{dtype name: state}``."""

    def init_fn(params):
        return {name: part.init(params) for name, part in parts.items()}

    def update_fn(updates, state, params=None, **extra_args):
        out, new = None, {}
        for name, part in parts.items():
            u, new[name] = part.update(updates, state[name], params, **extra_args)
            out = u.buffers if out is None else [a + b for a, b in zip(out, u.buffers, strict=True)]
        return ShardedParams(out, updates.plan), new

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _on_leaves(tx: optax.GradientTransformation, plan: Plan, chosen: Sequence[bool]) -> optax.GradientTransformation:
    """:func:`on_leaves` over one compact vector, in the chosen leaves' dtype (:func:`chosen_dtype`)."""
    tables = build_compact(plan, chosen)
    layout = CompactLayout(plan, tuple(bool(c) for c in chosen))
    dtype = chosen_dtype(plan, chosen)

    def wrap(buffers):
        return PerDevice(compact(buffers, plan, tables, dtype), plan, layout)

    def init_zeros():
        rows = plan.num_devices * math.prod(plan.mesh.shape[a] for a in plan.tp_axes) * tables.size
        return tx.init(PerDevice(jnp.zeros((rows,), dtype), plan, layout))

    def init_fn(params):
        # The state's shape and dtype, from zeros: element-wise transformations initialise from shapes (and
        # ``jax.eval_shape(tx.init, abstract_params)`` then works without shardings). For the structure-only
        # stand-in of ``optax.tree.map_params`` the compact state is abstract (it holds no parameter tree).
        if is_placeholder(params):
            return jax.eval_shape(init_zeros)
        return place_state(init_zeros(), plan)

    def update_fn(updates, state, params=None, **extra_args):
        u, state = optax.with_extra_args_support(tx).update(
            wrap(updates.buffers), state, None if params is None else wrap(params.buffers), **extra_args
        )
        return ShardedParams(expand(u.value, updates.buffers, plan, tables), plan), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _after(buffers: Sequence[jax.Array], anchors: Sequence[jax.Array], plan: Plan) -> list[jax.Array]:
    """``buffers`` (bucket buffers) unchanged bit for bit, computed after the largest of ``anchors`` (bucket
    buffers too): each device ties its shards to its own shard of that one (no communication)."""
    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    i = max(range(len(anchors)), key=lambda j: anchors[j].size)
    local = lambda a, *shards: tuple(tie(shards, a))
    mapped = jax.shard_map(local, mesh=plan.mesh, in_specs=(specs[i], *specs), out_specs=specs, check_vma=False)
    return list(mapped(anchors[i], *buffers))


def split_leaves(
    main: optax.GradientTransformation,
    other: optax.GradientTransformation,
    *,
    plan: Plan,
    main_leaves: Sequence[bool],
    state: Callable[[Any, Any], Any],
    what: str,
) -> optax.GradientTransformation:
    """``main`` for the leaves with ``main_leaves`` (its updates must be zero elsewhere) and ``other`` for the
    rest through :func:`on_leaves` (state for those elements only), over :class:`~vescale_jax.ShardedParams`.

    Args:
      main: the transformation of the main leaves (e.g. Muon's or Shampoo's chain).
      other: an element-wise transformation for the other leaves (e.g. ``optax.adamw``).
      plan: the plan.
      main_leaves: per leaf (flattening order), whether ``main`` handles it.
      state: builds the state from ``(main's state, other's state)`` (a NamedTuple class).
      what: the optimizer's name for error messages.

    Returns:
      The combined transformation; updates are cast to the gradients' dtypes.
    """
    rest = [not x for x in main_leaves]
    other = on_leaves(other, plan, rest) if any(rest) else None

    main = optax.with_extra_args_support(main)

    def init_fn(params):
        if is_placeholder(params):  # optax.tree.map_params: the state's structure with params stand-ins
            return state(main.init(params), other.init(params) if other else optax.EmptyState())
        check_sharded(params, plan, what)
        return place_state(state(main.init(params), other.init(params) if other else optax.EmptyState()), plan)

    def update_fn(updates, opt_state, params=None, **extra_args):
        check_sharded(updates, plan, what)
        u, s_main = main.update(updates, opt_state[0], params, **extra_args)
        out, s_other = list(u.buffers), opt_state[1]
        if other:
            # After the main branch (tied to its largest output, bit for bit): the other branch's full-size
            # updates then never sit beside the main branch's temporaries.
            later = ShardedParams(_after(updates.buffers, u.buffers, plan), plan)
            v, s_other = other.update(later, s_other, params, **extra_args)
            out = [a + b for a, b in zip(out, v.buffers, strict=True)]  # disjoint supports
        out = [x.astype(g.dtype) for x, g in zip(out, updates.buffers, strict=True)]
        return ShardedParams(out, plan), state(s_main, s_other)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
