"""BatchNorm over the global batch: Flax's BatchNorm given the data axes while the model runs under ``vj.apply``.

Inside ``vj.apply`` each device holds a slice of the batch; BatchNorm's training statistics must be those of the
whole batch. Flax's BatchNorm (``nnx.BatchNorm``, ``flax.linen.BatchNorm``) averages its per-device mean and mean
of squares with one ``lax.pmean`` over its ``axis_name``: the adapters set ``axis_name`` to the data axes for the
call (the user's own axes kept after them), without editing the model. Every device holds as many examples, so
the mean of the per-device means is the global mean. Norms over the features of one example (LayerNorm,
GroupNorm, RMSNorm) need nothing. Outside ``vj.apply`` the model is untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from vescale_jax.layout._plan import Plan
from vescale_jax.step._batch import data_sharding
from vescale_jax.step._policy import enclosing_policy

__all__ = ["batch_axes", "global_batch_norm_linen", "global_batch_norm_nnx"]


def batch_axes(plan: Plan, data_axes: str | Sequence[str] | None) -> tuple[str, ...]:
    """The data axes ``vj.apply`` splits the batch over: ``data_axes``, else the enclosing step's, else the plan's
    axis."""
    if data_axes is None:
        outer = enclosing_policy()
        if outer is not None:
            return outer.data_axes
        data_axes = plan.axis
    axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
    data_sharding(plan, axes)  # checks them against the mesh
    return axes


def _axis_name(own: Any, groups: Any, axes: tuple[str, ...], where: str) -> str | tuple[str, ...]:
    """BatchNorm's ``axis_name`` for the call: the data axes, then the user's own axes that are not among them."""
    if groups is not None:
        raise ValueError(
            f"vj.flax: BatchNorm {where} has axis_index_groups={groups!r}; under vj.apply its statistics are "
            f"averaged over the data axes {axes} (the global batch), which index groups would split. Leave "
            "axis_index_groups unset."
        )
    user = () if own is None else ((own,) if isinstance(own, str) else tuple(own))
    merged = (*axes, *(a for a in user if a not in axes))
    return merged[0] if len(merged) == 1 else merged


def global_batch_norm_nnx(model: Any, axes: tuple[str, ...]) -> None:
    """Sets ``axis_name`` on every ``nnx.BatchNorm`` of ``model`` (a model merged for this call) to the data
    axes (the user's own axes kept after them)."""
    from flax import nnx

    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            where = "/".join(str(p) for p in path) or "<root>"
            module.axis_name = _axis_name(module.axis_name, module.axis_index_groups, axes, where)


@contextlib.contextmanager
def global_batch_norm_linen(axes: tuple[str, ...]) -> Iterator[None]:
    """While active, every ``flax.linen.BatchNorm`` call averages its statistics over the data axes (the user's
    own ``axis_name`` kept after them); the module is restored after each call."""
    import flax.linen as nn

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if not isinstance(module, nn.BatchNorm) or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        where = "/".join(module.scope.path) if module.scope is not None else type(module).__name__
        old = module.axis_name
        name = _axis_name(old, module.axis_index_groups, axes, where)
        object.__setattr__(module, "axis_name", name)  # Linen modules are frozen; restored right after the call
        try:
            return next_fun(*args, **kwargs)
        finally:
            object.__setattr__(module, "axis_name", old)

    with nn.intercept_methods(interceptor):
        yield
