"""Linen models under ``vj.fsdp``: :func:`linen_apply`, ``model.apply`` with the gathered variables, model state
(mutable collections) carried in and out, BatchNorm over the global batch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from vescale_jax.flax._batch_norm import batch_axes, global_batch_norm_linen
from vescale_jax.layout._plan import Plan
from vescale_jax.state._sharded import ShardedParams
from vescale_jax.step._fsdp import apply

__all__ = ["linen_apply"]


def _check_plan(plan: Plan) -> list[str]:
    """The plan's top-level collections; raises on a plan of ``variables['params']``."""
    tops = list(dict.fromkeys(s.path.split("/")[0] for s in plan.leaves))
    if "params" not in tops:
        raise ValueError(
            f"vj.flax.linen_apply: the plan's top-level keys are {tops[:6]}, not Linen collections: plan the "
            "whole variables dict (vj.plan({'params': variables['params']}, mesh) or model.init(...)), not "
            "variables['params']."
        )
    return tops


def linen_apply(
    model: Any,
    params: ShardedParams,
    *args: Any,
    state: Any = None,
    mutable: Any = False,
    rngs: Any = None,
    method: str | Callable[..., Any] | None = None,
    data_axes: str | Sequence[str] | None = None,
    reshard_after_forward: bool | None = None,
    out_specs: Any = None,
    **kwargs: Any,
) -> Any:
    """``model.apply({**params, **state}, *args, mutable=mutable, **kwargs)`` with the gathered parameters, on each
    device's batch shard, as the model would run unsharded on the global batch.

    Plan the trained collection(s) (``{"params": variables["params"]}``) and pass the others (``batch_stats``,
    any mutable collection) as ``state``. While the model runs, every ``flax.linen.BatchNorm`` averages its
    training statistics over the data axes (its ``axis_name`` set to them for the call, the user's own axes
    kept after them), so its means, variances and running statistics are those of the global batch. A group of
    layers planned with ``stacked=`` and looped with ``nn.scan(variable_axes={"params": 0})`` (``nn.remat``
    blocks, ``split_rngs``) runs as :func:`vj.scan_layers`, one layer gathered per iteration
    (:mod:`vescale_jax.step._layer_loops`).

    Args:
      model: a Linen module.
      params: the sharded variables: the planned ``{"params": ...}`` dict (plan the dict, not its value).
      *args: batch inputs (dim 0 split over the data axes).
      state: the other collections, e.g. ``{"batch_stats": ...}``, passed whole to every device.
      mutable: as in ``model.apply``: the collections the model may update (``True``: every collection that is
        not planned). The updates must be the same on every device (BatchNorm's global statistics, a
        counter); one computed from the device's own batch shard (e.g. ``sow``'d intermediates) raises,
        naming it.
      rngs: as in ``model.apply`` (e.g. ``{"dropout": key}``), passed whole to every device.
      method: as in ``model.apply``.
      data_axes, reshard_after_forward, out_specs: as in :func:`vj.apply`.
      **kwargs: keyword arguments of the model: batch inputs as in :func:`vj.apply` (an array with the batch's
        leading dim is split, e.g. ``attention_mask``; another array passed whole; a Python value such as
        ``deterministic=True`` static).

    Returns:
      The outputs as global arrays; with ``mutable``: ``(outputs, updated_collections)`` as ``model.apply``
      returns them, the collections replicated.

    Raises:
      ValueError: the plan is not a dict of collections, or a collection is both planned and in ``state`` /
        ``mutable``; an update differs per device; a loop over a stacked group that cannot run as
        :func:`vj.scan_layers` (in reverse, with per-layer floating-point outputs).

    Sharding:
      As :func:`vj.apply`; ``state``, ``rngs`` and the updated collections are replicated over the mesh.
    """
    import flax.linen as nn

    plan = getattr(params, "plan", None)
    planned = _check_plan(plan) if plan is not None else []
    state = dict(state or {})
    both = [c for c in state if c in planned]
    if both:
        raise ValueError(
            f"vj.flax.linen_apply: collection(s) {both} are both planned and in state=; plan only the trained "
            "parameters ({'params': ...}) and pass the other collections as state."
        )
    if mutable is True:
        mutable = nn.DenyList(tuple(planned))
    elif isinstance(mutable, str | list | tuple):
        names = [mutable] if isinstance(mutable, str) else list(mutable)
        if any(c in planned for c in names):
            raise ValueError(
                f"vj.flax.linen_apply: mutable={mutable!r} names planned collection(s) "
                f"{[c for c in names if c in planned]}; planned leaves are trained by the optimizer. Plan only "
                "{'params': ...} and pass the mutable collections as state= (e.g. state={'batch_stats': ...})."
            )
    axes = batch_axes(plan, data_axes) if plan is not None else None
    whole = {"variables": state, "rngs": rngs}

    def fn(variables, *a, state, **kw):
        with global_batch_norm_linen(axes) if axes is not None else contextlib.nullcontext():
            result = model.apply(
                {**variables, **state["variables"]}, *a, method=method, mutable=mutable, rngs=state["rngs"], **kw
            )
        return (result, {}) if mutable is False else result

    out, updated = apply(
        fn,
        params,
        *args,
        state=whole,
        data_axes=data_axes,
        reshard_after_forward=reshard_after_forward,
        out_specs=out_specs,
        **kwargs,
    )
    return out if mutable is False else (out, updated)
