"""NNX models under ``vj.fsdp``: :func:`nnx_apply` (the model's call, its state carried in and out) and
:func:`nnx_scan_layers` (a stacked layer group looped with a per-layer gather)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from vescale_jax.flax._batch_norm import batch_axes, global_batch_norm_nnx
from vescale_jax.state._sharded import ShardedParams
from vescale_jax.step._forwarding import forwarded_inputs
from vescale_jax.step._fsdp import apply
from vescale_jax.step._scan_layers import scan_layers

__all__ = ["nnx_apply", "nnx_scan_layers"]

_SPLIT_HINT = (
    "graphdef, params, state = nnx.split(model, nnx.Param, ...); plan and shard params; call "
    "vj.flax.nnx_apply(graphdef, params, *batch, state=state)"
)


def _flat(tree: Any) -> dict[str, Any]:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _name(key: str) -> str:
    """``"['bn']['mean'].value"`` as ``bn/mean``."""
    return "/".join(k.strip("'\"") for k in key.removesuffix(".value").strip("[]").split("]["))


def _copy(tree: Any) -> Any:
    """The same leaves in new containers (new ``nnx.Variable`` objects for a state)."""
    return jax.tree.map(lambda x: x, tree)


def _merge(graphdef: Any, params: Any, state: Any) -> Any:
    from flax import nnx

    try:
        return nnx.merge(graphdef, params) if state is None else nnx.merge(graphdef, params, state)
    except ValueError as e:
        if "number of leaves" not in str(e):
            raise
        have = len(jax.tree.leaves(params)) + len(jax.tree.leaves(state))
        raise ValueError(
            f"vj.flax.nnx_apply: the graphdef's model has other variables than the {have} leaves given ({e}). "
            "Variables that are not trained parameters (BatchNorm statistics, counters, RNG state) are the "
            f"model's state: {_SPLIT_HINT}."
        ) from None


def _check_params_unchanged(model: Any, tree: Any, call: Callable[[Any], Any]) -> None:
    """Raises, naming the variable, when the model assigned a planned leaf (its update would be dropped).

    ``tree``: the planned leaves the model was built from; ``call(tree) -> model``: builds and calls the model
    again. A leaf that is the very value that went in passes at once. A lifted transform (``nnx.remat``,
    ``nnx.scan``, ``nnx.jit``, ``nnx.cond`` ...) hands every variable out and back as a new traced value: then the
    call is traced once more on its own, and a leaf passes when the jaxpr shows it is the input it came from.
    """
    from flax import nnx

    before = _flat(tree)
    now = _flat(nnx.state(model))
    if all(now.get(key, leaf) is leaf for key, leaf in before.items()):
        return
    keys = list(before)
    leaves, treedef = jax.tree.flatten(tree)

    def planned_after(*flat: Any) -> list[Any]:
        state = _flat(nnx.state(call(jax.tree.unflatten(treedef, flat))))
        return [state.get(k, x) for k, x in zip(keys, flat, strict=True)]

    origin = forwarded_inputs(jax.make_jaxpr(planned_after)(*leaves).jaxpr)
    for i, key in enumerate(keys):
        if origin[i] != i:
            raise ValueError(
                f"vj.flax.nnx_apply: the model updated {_name(key)}, a leaf of the planned params; planned leaves "
                "are trained by the optimizer and an update made by the model itself would be dropped. Plan only "
                f"the parameters and pass the other variables as the model's state: {_SPLIT_HINT}."
            )


def nnx_apply(
    graphdef: Any,
    params: ShardedParams,
    *args: Any,
    state: Any = None,
    method: str | Callable[..., Any] | None = None,
    data_axes: str | Sequence[str] | None = None,
    reshard_after_forward: bool | None = None,
    out_specs: Any = None,
    **kwargs: Any,
) -> Any:
    """Calls an NNX model rebuilt from ``graphdef``, the gathered ``params`` and ``state`` on each device's batch
    shard, as the model would run unsharded on the global batch.

    Split the model into its trained parameters and the rest: ``graphdef, params, state = nnx.split(model,
    nnx.Param, ...)``; plan and shard ``params``; pass ``state`` (BatchNorm statistics, counters, RNG state,
    any other ``nnx.Variable``) here. A model with parameters only needs no ``state``.

    While the model runs, every ``nnx.BatchNorm`` averages its training statistics over the data axes (its
    ``axis_name`` set to them for the call, the user's own axes kept after them), so its means, variances and
    running statistics are those of the global batch.

    Args:
      graphdef: from the ``nnx.split`` that gave ``params`` (and ``state``).
      params: the sharded parameters.
      *args: batch inputs (dim 0 split over the data axes).
      state: the model's other variables (an ``nnx.State``), passed whole to every device. The state the model
        leaves behind is returned with the same structure; every update must be the same on every device (a
        counter, BatchNorm's global statistics): one computed from the device's own batch shard raises, naming
        the variable. Variables the model creates during the call (``nnx.sow``) are not returned.
      method: a method name or ``lambda model, *args, **kwargs: ...`` to call instead of ``__call__``.
      data_axes, reshard_after_forward, out_specs: as in :func:`vj.apply`.
      **kwargs: keyword arguments of the model: batch inputs as in :func:`vj.apply` (an array with the
        batch's leading dim is split, another array passed whole, a Python value static).

    Returns:
      The model's outputs as global arrays (dim 0 over the data axes); with ``state``: ``(outputs,
      new_state)``, ``new_state`` replicated.

    Raises:
      ValueError: the model has variables that are neither in ``params`` nor in ``state``; the model updates a
        planned leaf; a state update differs per device.

    Sharding:
      As :func:`vj.apply`; ``state`` and ``new_state`` are replicated over the mesh.
    """
    from flax import nnx

    if isinstance(graphdef, nnx.Module):
        raise TypeError(
            f"vj.flax.nnx_apply: the first argument is a {type(graphdef).__name__} module; pass its graphdef: "
            "graphdef, params = nnx.split(model) for a model of parameters only; for a model with other "
            f"variables (BatchNorm statistics, counters, RNG state): {_SPLIT_HINT}."
        )
    plan = getattr(params, "plan", None)  # ShardedParams, or GatheredParams inside vj.accumulate
    axes = batch_axes(plan, data_axes) if plan is not None else None

    def call(tree, given, a, kw):
        # merge shares the Variables it is given with the model, which may assign them: it gets copies, so the
        # tree and state passed in keep the values that went in
        model = _merge(graphdef, _copy(tree), None if given is None else _copy(given))
        if axes is not None:
            global_batch_norm_nnx(model, axes)
        if method is None:
            out = model(*a, **kw)
        else:
            out = getattr(model, method)(*a, **kw) if isinstance(method, str) else method(model, *a, **kw)
        return model, out

    def fn(tree, *a, **kw):
        given = kw.pop("state") if state is not None else None
        model, out = call(tree, given, a, kw)
        _check_params_unchanged(model, tree, lambda t: call(t, given, a, kw)[0])
        if state is None:
            return out
        now = _flat(nnx.state(model))
        keys, treedef = list(_flat(given)), jax.tree.structure(given)
        return out, jax.tree.unflatten(treedef, [now[k] for k in keys])

    return apply(
        fn,
        params,
        *args,
        data_axes=data_axes,
        reshard_after_forward=reshard_after_forward,
        out_specs=out_specs,
        **({} if state is None else {"state": state}),
        **kwargs,
    )


def nnx_scan_layers(
    layers: Any, carry: Any, fn: Callable[..., Any] | None = None, xs: Any = None, *, unroll: int | bool = 1
) -> Any:
    """Runs ``carry = fn(layer, carry[, x])`` over a stacked NNX layer group (e.g. built with ``nnx.vmap``).

    Inside :func:`nnx_apply` each layer is gathered in the loop body with the next one prefetched; outside it is
    an ordinary ``lax.scan`` over the stacked parameters.

    Args:
      layers: the stacked module (every parameter with a leading layer dim).
      carry: the loop carry.
      fn: ``(layer_module, carry[, x]) -> carry``; default calls the layer on the carry.
      xs: optional per-layer inputs with leading layer dim.
      unroll: passed to :func:`vj.scan_layers`.

    Returns:
      The final carry.
    """
    from flax import nnx

    graphdef, state = nnx.split(layers)
    call = fn if fn is not None else (lambda layer, c, *x: layer(c, *x))

    def body(layer_state, c, *x):
        return call(nnx.merge(graphdef, layer_state), c, *x)

    return scan_layers(body, state, carry, xs, unroll=unroll)
