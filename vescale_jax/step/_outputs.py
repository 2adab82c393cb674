"""``vj.apply``'s outputs under the default ``out_specs``: per-example values split, batch statistics whole.

``shard_map`` needs its ``out_specs`` before the model is traced, but whether an output is per-example (rows of
the batch, one slice per device) or a value of the whole batch (the same on every device) is known only once the
model is traced: whether the output depends on the device's slice of the batch
(:func:`vescale_jax.step._control_flow.batch_dependence`) and what shape the unsharded model gives it. Every
output therefore leaves the ``shard_map`` split on dim 0 over the data axes, and the decision is made while
tracing. With ``b`` the device's batch rows:

* an output that depends on the batch slice is per-example when its dim 0 is ``b``, or when the model traced at
  the global arguments' shapes gives it ``size`` times the rows (``(b * T, D)`` token rows); a scalar, or an
  array the unsharded model returns with the same shape (``jnp.mean(h, axis=0)``: a statistic of the device's
  slice), is refused, naming the output and the fix;
* an output that does not depend on it (computed with ``vj.batch_mean``, or from the parameters alone) gets a
  leading length-1 dim inside, and the copy of device 0 is taken outside: the model's value, as the unsharded
  model returns it. Its cotangent reaches the one copy taken (zero on the other devices), and the backward sums
  it over the devices (the ``shard_map``'s transpose for a value typed as not varying, the gradient's
  reduce-scatter for the parameters), so it differentiates as the unsharded output. The exception: a
  batch-free output with dim 0 equal to ``b`` that the global trace shows per-example (a parameter broadcast
  over the batch) is split, as the unsharded model's rows are the same.

The trace at the global shapes runs only for those ambiguous outputs, and when it cannot run (a model that
traces only at its local shapes) the leading-dim rule decides: dim 0 equal to ``b`` is per-example.

Under a context axis (:mod:`vescale_jax.step._context_batch`) every output leaves the ``shard_map`` split on dim 0
over the data axes and on dim 1 over the context axis: an output that varies over the context axis is per-token
(``(b, l, ...)`` with ``l`` the device's tokens) and comes back with dim 1 in the global order; a per-example
output that does not vary over it gets a length-1 dim 1 inside, dropped outside; a whole output two leading
length-1 dims. An output that varies over the context axis but is not per-token (a sum over the device's tokens)
is refused, naming it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vescale_jax.step._context_batch import ContextBatch
from vescale_jax.step._statistics import WHOLE_BATCH_VALUE
from vescale_jax.step._wire import varying_axes

__all__ = ["split_or_whole"]


_SPLIT, _WHOLE, _TOKENS = "split", "whole", "tokens"


def split_or_whole(
    fn: Callable[..., Any],
    axes: tuple[str, ...],
    mesh: jax.sharding.Mesh,
    dependence: list[bool],
    *,
    state: bool = False,
    batch: int | None = None,
    global_outputs: Callable[..., Sequence[Any] | None] | None = None,
    sequence: ContextBatch | None = None,
) -> tuple[Callable[..., Any], Callable[[Any], Any]]:
    """``(wrapped fn, finish)`` for outputs with ``out_specs=P(axes)``: ``finish`` turns the ``shard_map``'s
    results into the model's outputs (see the module docstring).

    Args:
      fn: the model, called inside the ``shard_map``.
      axes: the data axes.
      mesh: the ``shard_map``'s mesh.
      dependence: per output leaf, whether it depends on the batch slice; filled while ``fn`` is traced
        (:func:`vescale_jax.step._control_flow.checked_model`).
      state: ``fn`` returns ``(outputs, new_state)``: only ``outputs`` are split or whole, ``new_state`` passes
        as it is (its own ``out_specs``).
      batch: the device's batch rows ``b`` (``None``: no argument has a batch dim).
      global_outputs: ``(*fn's arguments) -> the output leaves' shapes`` of the model at the global arguments'
        shapes, or ``None`` when that trace cannot run; called only for an ambiguous output.
      sequence: the context axis's split of the batch (then ``out_specs`` is ``P(axes, context axis)``).

    Returns:
      The wrapped model and the function to apply to the ``shard_map``'s outputs (after the wrapped model was
      traced).

    Sharding:
      Per-example outputs: dim 0 split over ``axes``. Whole outputs: replicated.
    """
    size = math.prod(mesh.shape[a] for a in axes)
    whole: list[str] = []  # per output leaf: its kind

    @functools.wraps(fn)
    def wrapped(*a: Any) -> Any:
        result = fn(*a)
        out = result[0] if state else result
        flat, tree = jax.tree_util.tree_flatten_with_path(out)
        cache: list[Sequence[Any] | None] = []

        def global_shape(i: int) -> tuple[int, ...] | None:
            if not cache:
                shapes = None
                if global_outputs is not None:
                    try:
                        shapes = global_outputs(*a)
                    except Exception:  # a model that traces only at its local shapes: the leading-dim rule
                        shapes = None
                cache.append(shapes if shapes is not None and len(shapes) == len(flat) else None)
            return None if cache[0] is None else tuple(np.shape(cache[0][i]))

        kinds = [
            _kind(
                jax.tree_util.keystr(path) or "<root>", tuple(np.shape(leaf)), dep, i, batch, size, global_shape, axes
            )
            for i, ((path, leaf), dep) in enumerate(zip(flat, dependence[: len(flat)], strict=True))
        ]  # the outputs' leaves come first in ``dependence`` (before the state's)
        if sequence is not None:
            kinds = [
                _per_token(jax.tree_util.keystr(path) or "<root>", x, k, sequence)
                for (path, x), k in zip(flat, kinds, strict=True)
            ]
        whole[:] = kinds
        out = jax.tree_util.tree_unflatten(
            tree, [_inside(x, k, sequence) for (_, x), k in zip(flat, kinds, strict=True)]
        )
        return (out, result[1]) if state else out

    replicated = NamedSharding(mesh, P())

    def finish_outputs(out: Any) -> Any:
        leaves, tree = jax.tree.flatten(out)
        if len(whole) != len(leaves):  # not traced by this call (cannot happen: each call wraps afresh)
            raise RuntimeError("vj.apply: the model's outputs were not traced")
        return jax.tree.unflatten(
            tree, [_outside(x, k, sequence, replicated) for x, k in zip(leaves, whole, strict=True)]
        )

    def finish(result: Any) -> Any:
        return (finish_outputs(result[0]), result[1]) if state else finish_outputs(result)

    return wrapped, finish


def _inside(x: jax.Array, kind: str, sequence: ContextBatch | None) -> jax.Array:
    """An output as it leaves the ``shard_map`` (``out_specs`` ``P(axes)``, or ``P(axes, context)``)."""
    if sequence is None:
        return x[None] if kind == _WHOLE else x
    return {_TOKENS: x, _SPLIT: x[:, None] if np.ndim(x) else x, _WHOLE: x[None, None]}[kind]


def _outside(x: jax.Array, kind: str, sequence: ContextBatch | None, replicated: NamedSharding) -> jax.Array:
    """The model's output from the ``shard_map``'s (see :func:`_inside`)."""
    if kind == _WHOLE:
        x = jax.sharding.reshard(x, replicated)
        return x[0] if sequence is None else x[0, 0]
    if sequence is None:
        return x
    return sequence.to_global(x, replicated.mesh) if kind == _TOKENS else x[:, 0]


def _per_token(name: str, x: jax.Array, kind: str, sequence: ContextBatch) -> str:
    """Under a context axis: an output that varies over it is per-token (``_TOKENS``) or refused."""
    axis = sequence.ctx.axis
    vary = varying_axes(x)
    over = axis in vary if vary else kind == _SPLIT  # untyped (check_vma off): split outputs are taken as varying
    if not over:
        return kind
    shape = tuple(np.shape(x))
    if len(shape) >= 2 and shape[1] == sequence.local:
        return _TOKENS
    raise ValueError(
        f"vj.apply: output {name} of the model (shape {shape} on each device) is computed from this device's "
        f"tokens (the sequence is split over the context axis {axis!r}, {sequence.local} of {sequence.length} "
        "tokens per device) but is not per-token: it is not the unsharded model's value. Reduce over tokens with "
        "vj.batch_mean / vj.batch_sum (every token counted once, the same on every device), or return per-token "
        "values with dim 1 the sequence, (B, L, ...), and reduce outside the model."
    )


def _kind(
    name: str,
    shape: tuple[int, ...],
    dependent: bool,
    i: int,
    batch: int | None,
    size: int,
    global_shape: Callable[[int], tuple[int, ...] | None],
    axes: tuple[str, ...],
) -> str:
    """Whether output ``i`` (local ``shape``) leaves split or whole; raises for a per-device statistic."""

    def per_example(glob: tuple[int, ...] | None) -> bool:
        return glob is not None and len(glob) == len(shape) and glob[0] == shape[0] * size and glob[1:] == shape[1:]

    if dependent:
        if not shape:
            raise _scalar(name, axes)
        if size == 1 or shape[0] == batch:
            return _SPLIT
        glob = global_shape(i)
        if glob is None or per_example(glob):
            return _SPLIT
        raise _statistic(name, shape, glob, axes)
    if size > 1 and shape and shape[0] == batch and per_example(global_shape(i)):
        return _SPLIT  # the same rows on every device (a parameter broadcast over the batch): per-example
    return _WHOLE


def _statistic(name: str, shape: tuple[int, ...], glob: tuple[int, ...], axes: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"vj.apply: output {name} of the model (shape {shape} on each device, {glob} unsharded) is computed from "
        f"each device's slice of the batch (the data axes are {axes}) but is not per-example: it differs between "
        "devices and is not the unsharded model's value (a statistic such as jnp.mean(h, axis=0)). Compute it "
        "over the global batch with vj.batch_mean / vj.batch_sum (it is then returned whole, as unsharded), or "
        f"return per-example values (dim 0 the batch) and reduce outside. {WHOLE_BATCH_VALUE}"
    )


def _scalar(name: str, axes: tuple[str, ...]) -> ValueError:
    return ValueError(
        f"vj.apply: output {name} of the model is a scalar computed from each device's slice of the batch (the data "
        f"axes are {axes}): it differs between devices and is not the unsharded model's value, and averaging it "
        "over the devices afterwards is not either for anything but a plain mean (a product of means, a ratio). "
        "Compute it over the global batch with vj.batch_mean / vj.batch_sum (it is then returned whole, as "
        "unsharded), or return per-example values (dim 0 the batch) and reduce outside: jnp.mean(vj.apply(...)). "
        f"{WHOLE_BATCH_VALUE}"
    )
