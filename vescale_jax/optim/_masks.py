"""Masks and labels written over the logical tree, applied per element of the flat buckets.

On a :class:`~vescale_jax.ShardedParams` every bucket is one flat buffer, so Optax's per-leaf masks and labels
(``optax.masked``, ``optax.partition``, ``optax.adamw(mask=...)``) cannot see the model's leaves. The versions
here take the mask or the labels over the plan's *logical* tree — a (prefix) tree of bools / labels, or a
callable called on the logical abstract tree (``jax.ShapeDtypeStruct`` leaves, so ``x.ndim`` and ``x.shape``
are the real ones) — turn them into a per-leaf table and apply it per element: each device looks up the leaf
of each of its elements with a local iota and a static range table (:func:`vescale_jax.state._padding.local_leaf_ids`),
no communication.

The inner transformation sees a ``ShardedParams`` whose masked-out elements (and padding) are zero, so its
reductions (a global norm, a per-leaf trust ratio) cover its own leaves only, as in Optax; its outputs are
kept at its own leaves and the incoming updates pass through elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vescale_jax._compat import is_params_placeholder
from vescale_jax.layout._plan import Plan
from vescale_jax.optim._leaf_tables import abstract_params, plan_of
from vescale_jax.optim._on_leaves import on_leaves
from vescale_jax.state._padding import local_leaf_ids
from vescale_jax.state._sharded import ShardedParams

__all__ = [
    "adamw",
    "add_decayed_weights",
    "leaf_labels",
    "leaf_table",
    "masked",
    "multi_transform",
    "partition",
    "select_leaves",
]

MaskOrFn = Any | Callable[[Any], Any]


def _resolve(plan: Plan, spec: Any, is_value: Callable[[Any], bool], what: str, kind: str) -> list[Any]:
    """Per-leaf values (flattening order) of a (prefix) tree over the logical tree, or a callable of it."""
    abstract = abstract_params(plan)
    if callable(spec):
        try:
            tree = spec(abstract)
        except Exception as e:
            raise TypeError(
                f"vj.optim.{what}: the {kind} function failed on the plan's logical abstract tree: {type(e).__name__}: "
                f"{e}. It is called once, on jax.ShapeDtypeStruct leaves (shape, dtype, ndim, key paths), not on "
                f"values; compute the {kind} from those, or pass a tree of {kind} values."
            ) from e
    else:
        tree = spec
    if is_value(tree):
        return [tree] * len(plan.leaves)
    values: list[Any] = []

    def spread(path, value, sub):
        if not is_value(value):
            raise TypeError(
                f"vj.optim.{what}: the {kind} at {jax.tree_util.keystr(path) or '<root>'} is {value!r} "
                f"({type(value).__name__}), not a {kind} value ({'a Python bool' if kind == 'mask' else 'a label'})."
            )
        values.extend([value] * len(jax.tree.leaves(sub)))

    try:
        jax.tree_util.tree_map_with_path(spread, tree, abstract, is_leaf=is_value)
    except ValueError as e:
        paths = [s.path for s in plan.leaves]
        raise ValueError(
            f"vj.optim.{what}: the {kind} tree does not match the plan's logical tree (it must have the same "
            f"structure, or be a prefix of it); the plan's leaves are {paths[:6]}{'...' if len(paths) > 6 else ''}. "
            f"Build it from the logical params (or pass a callable, called on the logical abstract tree). "
            f"JAX said: {e}"
        ) from None
    if len(values) != len(plan.leaves):
        raise ValueError(f"vj.optim.{what}: the {kind} tree gives {len(values)} values for {len(plan.leaves)} leaves.")
    return values


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool | np.bool_) or (isinstance(x, np.ndarray) and x.shape == () and x.dtype == np.bool_)


def leaf_table(plan: Plan, mask: MaskOrFn, *, what: str = "masked") -> np.ndarray:
    """A mask over the logical tree as a per-leaf table.

    Args:
      plan: the plan.
      mask: a bool, a (prefix) tree of bools over the plan's logical tree, or a callable of the logical
        abstract tree returning one.
      what: the caller's name, for error messages.

    Returns:
      ``(num_leaves + 1,)`` bool: one entry per leaf of the plan (flattening order), ``False`` for padding.
    """
    values = _resolve(plan, mask, _is_bool, what, "mask")
    return np.array([*(bool(v) for v in values), False])


def leaf_labels(plan: Plan, param_labels: Any, *, what: str = "partition") -> list[Hashable]:
    """Labels over the logical tree (a (prefix) tree of labels, or a callable of the logical abstract tree)
    as one label per leaf of the plan (flattening order)."""

    def is_label(x):  # a pytree leaf that can key ``transforms``
        return x is not None and jax.tree_util.all_leaves([x]) and isinstance(x, Hashable) and not _is_struct(x)

    return _resolve(plan, param_labels, is_label, what, "label")


def _is_struct(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct | jax.Array | np.ndarray)


def select_leaves(plan: Plan, table: np.ndarray, on: Sequence[Any], off: Sequence[Any] | None = None) -> list[Any]:
    """Per element: ``on`` where the element's leaf has ``table[leaf]``, else ``off`` (zero when ``None``).

    Args:
      plan: the plan.
      table: ``(num_leaves + 1,)`` bool, the last entry for padding.
      on, off: global bucket buffers (sharded like the plan's).

    Returns:
      One global buffer per bucket. Buffers that are not arrays (``None``, ``optax.MaskedNode``) in ``on`` are
      returned as they are.

    Sharding:
      A ``shard_map``: each device looks up its elements' leaves locally.
    """
    live = [
        b
        for b, x in enumerate(on)
        if isinstance(x, jax.Array | np.ndarray) and (off is None or isinstance(off[b], jax.Array | np.ndarray))
    ]
    if not live:
        return list(on)
    specs = tuple(plan.partition_spec(plan.buckets[b]) for b in live)
    table = np.asarray(table)

    def local(*shards):
        t = jnp.asarray(table)  # a constant of the manual region (closing over a traced array is not allowed)
        ons, offs = shards[: len(live)], shards[len(live) :]
        out = []
        for j, b in enumerate(live):
            keep = jnp.take(t, local_leaf_ids(plan, b))
            x = ons[j]
            y = offs[j].astype(x.dtype) if offs else jnp.zeros((), x.dtype)
            out.append(jnp.where(keep, x, y))
        return tuple(out)

    args = [on[b] for b in live] + ([] if off is None else [off[b] for b in live])
    mapped = jax.shard_map(
        local, mesh=plan.mesh, in_specs=specs * (2 if off is not None else 1), out_specs=specs, check_vma=False
    )
    result = list(on)
    for b, x in zip(live, mapped(*args), strict=True):
        result[b] = x
    return result


def _mask_tree(plan: Plan, table: np.ndarray, tree: Any) -> Any:
    return ShardedParams(select_leaves(plan, table, tree.buffers), plan)


def masked(
    inner: optax.GradientTransformation,
    mask: MaskOrFn,
    *,
    mask_compatible_extra_args: bool = False,
    plan: Plan | None = None,
    compact: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """``optax.masked`` over :class:`~vescale_jax.ShardedParams`, with the mask written over the logical tree.

    Args:
      inner: the transformation to apply to the masked-in leaves.
      mask: a bool, a (prefix) tree of bools over the plan's logical tree, or a callable called on the logical
        abstract tree (``jax.ShapeDtypeStruct`` leaves), e.g. ``lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)``.
      mask_compatible_extra_args: also mask extra arguments that are ``ShardedParams`` of the same plan.
      plan: the plan (default: the ``plan`` of the params / updates the transformation sees).
      compact: run ``inner`` only on the masked-in leaves' elements, gathered into a compact per-device vector
        (:func:`vescale_jax.optim._on_leaves.on_leaves`): its state then covers those elements only, as in
        Optax. Only for element-wise ``inner`` (or ones whose reductions are global sums); the default
        runs ``inner`` on the whole buffers with the masked-out elements zeroed, which works with any
        transformation (``vj.optim.scale_by_trust_ratio`` included) but keeps its state for every element.

    Returns:
      A transformation whose updates are ``inner``'s at the masked-in leaves' elements and the incoming updates
      elsewhere (padding included).

    Sharding:
      Per element, on each device's own shard: no communication beyond ``inner``'s own.
    """
    inner = optax.with_extra_args_support(inner)

    def resolve(tree):
        p = plan_of(tree, plan, "masked")
        return p, leaf_table(p, mask, what="masked")

    def init_fn(params):
        if is_params_placeholder(params):  # optax.tree.map_params
            return optax.MaskedState(inner_state=inner.init(params))
        p, table = resolve(params)
        if compact:
            return optax.MaskedState(inner_state=on_leaves(inner, p, table[:-1]).init(params))
        return optax.MaskedState(inner_state=inner.init(_mask_tree(p, table, params)))

    def update_fn(updates, state, params=None, **extra_args):
        p, table = resolve(updates)
        if compact:
            new, inner_state = on_leaves(inner, p, table[:-1]).update(updates, state.inner_state, params)
        else:
            if mask_compatible_extra_args:
                extra_args = {
                    k: _mask_tree(p, table, v) if isinstance(v, ShardedParams) and v.plan == p else v
                    for k, v in extra_args.items()
                }
            new, inner_state = inner.update(
                _mask_tree(p, table, updates),
                state.inner_state,
                None if params is None else _mask_tree(p, table, params),
                **extra_args,
            )
        out = select_leaves(p, table, new.buffers, updates.buffers)
        return ShardedParams(out, p), optax.MaskedState(inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def partition(
    transforms: Mapping[Hashable, optax.GradientTransformation],
    param_labels: Any,
    *,
    mask_compatible_extra_args: bool = False,
    plan: Plan | None = None,
    compact: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """``optax.partition`` over :class:`~vescale_jax.ShardedParams`, with labels written over the logical tree.

    Args:
      transforms: label -> transformation.
      param_labels: a (prefix) tree of labels over the plan's logical tree, or a callable called on the logical
        abstract tree returning one (e.g. ``lambda p: jax.tree.map(lambda x: "muon" if x.ndim == 2 else
        "adam", p)``).
      mask_compatible_extra_args: as in :func:`masked`.
      plan: the plan (default: the ``plan`` of the params / updates the transformation sees).
      compact: as in :func:`masked`: each transformation runs on (and keeps state for) its own leaves'
        elements only; for element-wise transformations.

    Returns:
      A transformation applying ``transforms[label]`` to the elements of the leaves with that label. The state
      is an ``optax.PartitionState`` of ``optax.MaskedState``s, one per label, as in Optax.

    Sharding:
      Per element, on each device's own shard.
    """
    parts = {
        k: masked(
            v,
            _LabelMask(param_labels, k),
            mask_compatible_extra_args=mask_compatible_extra_args,
            plan=plan,
            compact=compact,
        )
        for k, v in transforms.items()
    }

    def check(tree):
        p = plan_of(tree, plan, "partition")
        labels = leaf_labels(p, param_labels)
        missing = [(s.path, lab) for s, lab in zip(p.leaves, labels, strict=True) if lab not in transforms]
        if missing:
            raise ValueError(
                f"vj.optim.partition: leaf {missing[0][0]!r} has label {missing[0][1]!r}, which has no "
                f"transformation ({len(missing)} such leaves); transforms has {sorted(map(str, transforms))}. "
                "Add it to transforms or relabel the leaf."
            )

    def init_fn(params):
        if not is_params_placeholder(params):
            check(params)
        return optax.PartitionState({k: tx.init(params) for k, tx in parts.items()})

    def update_fn(updates, state, params=None, **extra_args):
        check(updates)
        inner = {}
        for k, tx in parts.items():
            updates, inner[k] = tx.update(updates, state.inner_states[k], params, **extra_args)
        return updates, optax.PartitionState(inner)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


multi_transform = partition


class _LabelMask:
    """The mask "label == k" over the logical tree, as a callable of it."""

    def __init__(self, param_labels: Any, label: Hashable):
        self.param_labels, self.label = param_labels, label

    def __call__(self, abstract: Any) -> Any:
        labels = self.param_labels(abstract) if callable(self.param_labels) else self.param_labels
        treedef = jax.tree.structure(labels)
        return jax.tree.unflatten(treedef, [lab == self.label for lab in jax.tree.leaves(labels)])


def add_decayed_weights(
    weight_decay: optax.ScalarOrSchedule = 0.0,
    mask: MaskOrFn | None = None,
    *,
    plan: Plan | None = None,
) -> optax.GradientTransformation:
    """``optax.add_decayed_weights`` over :class:`~vescale_jax.ShardedParams`, ``mask`` over the logical tree.

    Args:
      weight_decay: the decay rate (a scalar or a schedule).
      mask: as in :func:`masked` (``None``: every leaf).
      plan: the plan (default: the params' plan).

    Returns:
      ``updates + weight_decay * params`` at the masked-in leaves' elements, ``updates`` elsewhere.
    """
    tx = optax.add_decayed_weights(weight_decay)
    return tx if mask is None else masked(tx, mask, plan=plan)


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: jax.typing.ArrayLike = 0.9,
    b2: jax.typing.ArrayLike = 0.999,
    eps: jax.typing.ArrayLike = 1e-8,
    eps_root: jax.typing.ArrayLike = 0.0,
    mu_dtype: Any | None = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: MaskOrFn | None = None,
    *,
    nesterov: bool = False,
    plan: Plan | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optax.adamw`` over :class:`~vescale_jax.ShardedParams`, the weight-decay ``mask`` over the logical tree.

    Same arguments as ``optax.adamw``, plus ``plan`` (default: the params' plan). Adam's moments are kept
    for every element, sharded like the params.

    Returns:
      The optimizer: ``chain(scale_by_adam, add_decayed_weights(weight_decay, mask), scale_by_learning_rate)``.
    """
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov),
        add_decayed_weights(weight_decay, mask, plan=plan),
        optax.scale_by_learning_rate(learning_rate),
    )
