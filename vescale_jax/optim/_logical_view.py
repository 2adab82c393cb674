"""The logical view of a whole optimizer state: every ``PerDevice`` leaf with a layout as plan-independent arrays.

:func:`logical_view` replaces each such leaf by its layout's ``to_logical`` dict; :func:`restore_logical` puts a
view back under a target state's plan. :func:`check_layout_groups` refuses a layout that would view only one
tensor / expert group's shards of leaves split over those axes.
"""

from __future__ import annotations

from typing import Any

import jax

from vescale_jax.layout._plan import Plan
from vescale_jax.state._sharded import PerDevice

__all__ = ["check_layout_groups", "logical_view", "restore_logical"]


def _is_per_device(x: Any) -> bool:
    return isinstance(x, PerDevice)


def logical_view(state: Any) -> Any:
    """``state`` with every ``PerDevice`` leaf that has a layout replaced by its ``to_logical`` dict.

    Args:
      state: any pytree (an optimizer state).

    Returns:
      The same tree, each such ``PerDevice`` a ``{key: array}`` dict; everything else unchanged.
    """

    def one(path, x):
        if _is_per_device(x) and x.layout is not None:
            check_layout_groups(x, jax.tree_util.keystr(path), what="vj.optim.logical_view")
            return x.layout.to_logical(x.value)
        return x

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_per_device)


def restore_logical(target: Any, view: Any) -> Any:
    """Inverse of :func:`logical_view` into ``target``'s plan: ``target`` (a state or its ``jax.eval_shape``) gives
    the structure and each ``PerDevice``'s layout; ``view`` (same structure, from :func:`logical_view` under any
    plan) the values.

    Args:
      target: a state (arrays or ``ShapeDtypeStruct`` leaves) whose ``PerDevice`` leaves carry their layouts.
      view: the logical view of a state of the same optimizer over the same logical tree.

    Returns:
      A state like ``target``: its ``PerDevice`` values from ``from_logical``, other leaves from ``view``.
    """

    def one(path, t, v):
        if _is_per_device(t) and t.layout is not None:
            check_layout_groups(t, jax.tree_util.keystr(path), what="vj.optim.restore_logical")
            return t.replace(t.layout.from_logical(v))
        return v

    return jax.tree_util.tree_map_with_path(one, target, view, is_leaf=_is_per_device)


def _grouped_keys(layout: Any, plan: Plan) -> list[str]:
    """The keys of ``layout``'s logical view that belong to leaves of grouped buckets (its keys are
    ``"<leaf path>"`` or ``"<leaf path>/<part>"``); every grouped leaf when the keys cannot be listed."""
    grouped = {s.path for s in plan.leaves if plan.buckets[s.bucket].groups}
    if not grouped:
        return []
    try:
        keys = [str(k) for k in layout.logical_shapes()]
    except Exception:  # a layout that cannot list its keys: assume it covers every leaf
        return sorted(grouped)
    prefixes = lambda k: ("/".join(k.split("/")[:n]) for n in range(1, k.count("/") + 2))
    return [k for k in keys if any(p in grouped for p in prefixes(k))]


def check_layout_groups(node: PerDevice, name: str, *, what: str = "vj.checkpoint") -> None:
    """Raises when a ``PerDevice`` state's layout covers leaves of grouped buckets (split over tensor / expert
    axes) and does not say it handles them (``layout.supports_groups``): a ``PerDevice`` value is replicated
    over those axes, so its logical view would hold one group's shards of those leaves."""
    plan, layout = node.plan, getattr(node, "layout", None)
    if layout is None or getattr(layout, "supports_groups", False):
        return
    keys = _grouped_keys(layout, plan)
    if not keys:
        return
    raise NotImplementedError(
        f"{what}: optimizer-state leaf {name!r} is a PerDevice state with a {type(layout).__name__} whose entries "
        f"{keys[:3]} are leaves split over tensor / expert axes (vj.plan(..., tp=...)); that layout has no logical "
        "view of grouped buckets (it would hold one TP/EP group's shards), so it is neither viewed, stored nor "
        "restored. Use an optimizer whose state is ShardedParams for those leaves (optax.adamw, vj.optim.adamw, "
        "vj.optim.masked(..., compact=False)), or save params only (opt_state=None) and re-initialise the "
        "optimizer after restoring."
    )
