"""Statistics over the global batch, written once for the unsharded model and for ``vj.apply``.

Inside ``vj.apply`` the model runs on each device's slice of the batch, so ``jnp.mean(h, axis=0)`` is a mean over
that slice: a different number on every device. :func:`batch_mean` and :func:`batch_sum` reduce over the whole
batch instead: the local reduction, summed over the data axes of the enclosing ``vj.apply`` (only those the
value varies over), divided by the global count. Outside ``vj.apply`` they are ``jnp.mean`` / ``jnp.sum``, so
the same model code runs unsharded. They differentiate as the unsharded reduction does (the all-reduce's
transpose hands every device the cotangent of the global statistic).

``vj.apply`` announces its data axes while it traces the model (:func:`over_batch`); nothing else reads them.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.step._wire import varying_axes

__all__ = ["batch_mean", "batch_sum", "over_batch"]


@dataclasses.dataclass(frozen=True)
class _Batch:
    """The data axes of the ``vj.apply`` being traced; ``typed``: ``shard_map`` checks varying axes (when not,
    every value is taken to vary over all of them)."""

    axes: tuple[str, ...]
    typed: bool


_ENCLOSING: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("vescale_jax_batch", default=None)


@contextlib.contextmanager
def over_batch(axes: tuple[str, ...], *, typed: bool) -> Iterator[None]:
    """Makes ``axes`` the data axes :func:`batch_mean` / :func:`batch_sum` reduce over while the model is traced
    (``typed``: the ``shard_map`` checks varying axes)."""
    token = _ENCLOSING.set(_Batch(tuple(axes), typed))
    try:
        yield
    finally:
        _ENCLOSING.reset(token)


WHOLE_BATCH_VALUE = (
    "A value that is one for the whole batch (a task or phase flag) is not batch data: pass it to the model call as "
    "a keyword argument that is not batch-shaped (a 0-d array, or any array whose first dim is not the batch's, "
    "reaches every device whole), e.g. vj.apply(model_fn, params, x, mode=phase) with the flag as the data "
    "pipeline's scalar, or mode=jnp.max(batch['mode']) reduced over the global batch outside the model call; or as "
    "a Python value (static)."
)
"""The way out every refusal of a batch-dependent value shows (control flow, outputs, model state)."""


def _dims(x: jax.Array, axis: int | Sequence[int] | None, fn: str) -> tuple[int, ...]:
    ndim = np.ndim(x)
    if axis is None:
        return tuple(range(ndim))
    dims = (axis,) if isinstance(axis, int | np.integer) else tuple(axis)
    out = []
    for d in dims:
        if not isinstance(d, int | np.integer) or not -ndim <= d < ndim:
            raise ValueError(
                f"{fn}: axis={axis!r} for an array of shape {tuple(np.shape(x))}; name dims of it (default 0, the "
                "batch dim), or axis=None for all."
            )
        out.append(int(d) % ndim)
    return tuple(sorted(set(out)))


def _over(*xs: Any) -> tuple[tuple[str, ...], _Batch | None]:
    """The data axes to sum the local reductions of ``xs`` over: those of the enclosing ``vj.apply`` that any of
    them varies over (all of them when varying axes are not checked)."""
    batch = _ENCLOSING.get()
    if batch is None:
        return (), None
    if not batch.typed:
        return batch.axes, batch
    vary = frozenset().union(*(varying_axes(x) for x in xs if x is not None))
    return tuple(a for a in batch.axes if a in vary), batch


def _accumulator(dtype: np.dtype) -> np.dtype:
    """The dtype partial sums are kept in: fp32 for narrower floats (as ``jnp.mean`` accumulates), else ``dtype``
    (floats) or the default float (integers, bools)."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.dtype(np.float32) if dtype.itemsize < 4 and jnp.issubdtype(dtype, jnp.floating) else dtype
    return np.dtype(jnp.zeros((), float).dtype)


def batch_sum(
    x: jax.Array, axis: int | Sequence[int] | None = 0, *, keepdims: bool = False, where: jax.Array | None = None
) -> jax.Array:
    """``jnp.sum(x, axis)`` over the global batch: the same value on every device inside ``vj.apply``, and the
    plain sum outside it.

    Args:
      x: an array whose ``axis`` includes the dim that indexes examples (dim 0 of the batch ``vj.apply`` split,
        or a dim derived from it, e.g. tokens of ``(B·T, D)``).
      axis: the dims to sum over (default 0; ``None``: all).
      keepdims: keep the summed dims with size 1.
      where: optional mask broadcastable to ``x``: only its true elements are summed (as ``jnp.sum``).

    Returns:
      The sum, in ``jnp.sum``'s dtype (low-precision floats are summed in fp32 and rounded once).

    Sharding:
      Inside ``vj.apply``: the local sum, all-reduced (``psum``) over the data axes ``x`` varies over; the result
      does not vary over them. Outside: ``jnp.sum``.
    """
    dims = _dims(x, axis, "vj.batch_sum")
    axes, _ = _over(x, where)
    if not axes:
        return jnp.sum(x, axis=dims, keepdims=keepdims, where=where)
    out_dtype = jax.eval_shape(lambda: jnp.sum(x, axis=dims, keepdims=keepdims, where=where)).dtype
    local = jnp.sum(x, axis=dims, keepdims=keepdims, where=where, dtype=_accumulator(np.dtype(x.dtype)))
    return jax.lax.psum(local, axes).astype(out_dtype)


def batch_mean(
    x: jax.Array, axis: int | Sequence[int] | None = 0, *, keepdims: bool = False, where: jax.Array | None = None
) -> jax.Array:
    """``jnp.mean(x, axis)`` over the global batch: the same value on every device inside ``vj.apply`` (and the
    value the unsharded model computes), the plain mean outside it.

    Use it for any statistic of the batch the model computes: a mixture-of-experts load-balancing loss (the
    fraction of tokens per expert and the mean router probability), a statistic a ``lax.cond`` branches on,
    normalisation over the batch. Products of such means differentiate as unsharded, which a per-device mean
    averaged afterwards does not.

    Args:
      x: an array whose ``axis`` includes the dim that indexes examples (dim 0 of the batch ``vj.apply`` split,
        or a dim derived from it, e.g. tokens of ``(B·T, D)``).
      axis: the dims to average over (default 0; ``None``: all).
      keepdims: keep the averaged dims with size 1.
      where: optional mask broadcastable to ``x``: the mean of its true elements (counted over the global batch).

    Returns:
      The mean, in ``jnp.mean``'s dtype (low-precision floats are summed in fp32 and rounded once).

    Sharding:
      Inside ``vj.apply``: the local sum (and, with ``where``, the local count) all-reduced (``psum``) over the data
      axes ``x`` varies over, divided by the global count; every device's slice has the same number of examples.
      Under a context axis (``vj.fsdp(context_axis=...)``) it is among the axes summed over: a mean over tokens
      counts every token of every sequence once. The result does not vary over the data axes. Outside:
      ``jnp.mean``.
    """
    dims = _dims(x, axis, "vj.batch_mean")
    axes, _ = _over(x, where)
    if not axes:
        return jnp.mean(x, axis=dims, keepdims=keepdims, where=where)
    out_dtype = jax.eval_shape(lambda: jnp.mean(x, axis=dims, keepdims=keepdims, where=where)).dtype
    acc = _accumulator(np.dtype(out_dtype))
    total = jax.lax.psum(jnp.sum(x, axis=dims, keepdims=keepdims, where=where, dtype=acc), axes)
    if where is None:
        count = math.prod(np.shape(x)[d] for d in dims) * math.prod(jax.lax.axis_size(a) for a in axes)
        return (total / np.asarray(count, acc)).astype(out_dtype)
    mask = jnp.broadcast_to(where, np.shape(x))
    count = jax.lax.psum(jnp.sum(mask, axis=dims, keepdims=keepdims, dtype=acc), axes)
    return (total / count).astype(out_dtype)
