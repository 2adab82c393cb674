"""Transformations built from the plan of the params they see: the plan travels with the data.

An optimizer whose static tables come from the plan (Muon's owner routing, Shampoo's blocks, 8-bit Adam's
quantization blocks, the per-leaf tables of masks and decay) is written as ``build(plan) -> transformation``;
:func:`per_plan` turns it into one transformation that builds (and caches, per plan) the inner one when
``init`` or ``update`` first sees a :class:`~vescale_jax.ShardedParams`, whose ``plan`` is static pytree aux
data (so this works under ``jax.jit``). ``vj.optim.muon(learning_rate=0.02)`` then reads like optax's; a
``plan=`` given to the constructor builds at once and must match the data's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from vescale_jax._cache import plan_cache
from vescale_jax.layout._plan import Plan
from vescale_jax.optim._leaf_tables import is_placeholder, plan_of

__all__ = ["per_plan"]


def per_plan(
    build: Callable[[Plan], optax.GradientTransformation], plan: Plan | None, what: str
) -> optax.GradientTransformationExtraArgs:
    """The transformation ``build(params.plan)``, built when ``init`` / ``update`` first sees params of a plan.

    Args:
      build: ``plan -> transformation`` (pure: the same plan gives the same transformation).
      plan: the constructor's ``plan=``: built at once (construction-time errors stay there), and every
        params / updates must carry it (a mismatch raises, saying how the plans differ); ``None``: read from
        the data.
      what: the optimizer's name, for error messages.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is the inner transformation's.
    """
    built = plan_cache(lambda p: optax.with_extra_args_support(build(p)))
    seen: list[Plan] = []
    if plan is not None:
        built(plan)

    def for_data(tree: Any) -> optax.GradientTransformationExtraArgs:
        p = plan_of(tree, plan, what)
        if p not in seen and len(seen) < 2:  # enough to tell one plan from several
            seen.append(p)
        return built(p)

    def for_placeholder() -> optax.GradientTransformationExtraArgs:
        # optax.tree.map_params calls init on a structure-only stand-in, which carries no plan.
        if plan is not None:
            return built(plan)
        if len(seen) != 1:
            raise ValueError(
                f"vj.optim.{what}: optax.tree.map_params calls init without params, and this optimizer reads its "
                f"plan from the params ({len(seen)} plans seen so far); call tx.init(params) first, or build it "
                "with plan=params.plan."
            )
        return built(seen[0])

    def init_fn(params):
        return (for_placeholder() if is_placeholder(params) else for_data(params)).init(params)

    def update_fn(updates, state, params=None, **extra_args):
        return for_data(updates).update(updates, state, params, **extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
