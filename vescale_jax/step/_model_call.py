"""The model's call inside ``vj.apply``: keyword arguments split with the batch or passed whole, and model state
carried in and out, the same on every device.

Keyword arguments are batch inputs like positional ones. The batch size ``B`` is the leading dim of the
positional arguments (of the first keyword argument holding an array when there is none). Per array leaf of a
keyword argument (``jax.Array`` or ``numpy`` array): with ``ndim >= 1`` and leading dim ``B`` it is split over
the data axes like the positional batch; any other array is passed whole (the same value on every device).
Python values (``bool``, ``int``, ``float``, ``str``, ``None``, ...) are static: the model sees them as they are.

State (``vj.apply(..., state=...)``) is passed whole to every device; the model returns ``(outputs,
new_state)``, and every leaf of ``new_state`` must be the same on every device: one that varies over the data
axes (a statistic of the device's own batch shard) is refused, naming the leaf.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from vescale_jax._compat import varying_axes
from vescale_jax.step._statistics import WHOLE_BATCH_VALUE

__all__ = ["ModelCall", "model_call"]

_SPLIT, _WHOLE, _STATIC = "split", "whole", "static"


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _batch_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int | None:
    """The leading dim of the first positional array leaf with one, else of the first keyword one (call order)."""
    for tree in (args, *kwargs.values()):
        for leaf in jax.tree.leaves(tree):
            if _is_array(leaf) and np.ndim(leaf) >= 1:
                return int(np.shape(leaf)[0])
    return None


@dataclasses.dataclass(frozen=True)
class ModelCall:
    """The model over flat inputs ``(params, *positional, *keyword_arrays[, state])``.

    Attributes:
      fn: the model over the flat inputs; returns ``fn``'s outputs (``(outputs, new_state)`` with state).
      extra: the inputs after the positional ones: the keyword arrays, then the state (if any).
      extra_specs: their ``PartitionSpec`` (split: dim 0 over the data axes; whole and state: ``P()``).
      split: the keyword arrays split with the batch, by name (for the batch checks).
      batch: the global batch size ``B`` (``None`` when no argument has a leading dim).
    """

    fn: Callable[..., Any]
    extra: tuple[Any, ...]
    extra_specs: tuple[Any, ...]
    split: dict[str, Any]
    batch: int | None = None


def model_call(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    state: Any,
    *,
    axes: tuple[str, ...],
) -> ModelCall:
    """``fn(params, *args, **kwargs)`` (with ``state=state`` when given) over flat inputs.

    Args:
      fn: the model.
      args: the positional batch inputs.
      kwargs: the keyword arguments (see the module docstring for which leaves are split, whole or static).
      state: model state passed whole, or ``None``.
      axes: the data axes.

    Returns:
      The :class:`ModelCall`.
    """
    batch = _batch_size(args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(dict(kwargs))
    kinds, arrays, specs, static, split = [], [], [], [], {}
    for path, leaf in leaves:
        if not _is_array(leaf):
            kinds.append(_STATIC)
            static.append(leaf)
            continue
        static.append(None)
        if np.ndim(leaf) >= 1 and np.shape(leaf)[0] == batch:
            kinds.append(_SPLIT)
            specs.append(P(axes))
            split[jax.tree_util.keystr(path)] = leaf
        else:
            kinds.append(_WHOLE)
            specs.append(P())
        arrays.append(leaf)
    n_args, n_kw = len(args), len(arrays)

    def call(params, *flat):
        positional, kw_arrays = flat[:n_args], iter(flat[n_args : n_args + n_kw])
        kw_leaves = [next(kw_arrays) if kind != _STATIC else value for kind, value in zip(kinds, static, strict=True)]
        kw = jax.tree_util.tree_unflatten(treedef, kw_leaves)
        if state is None:
            return fn(params, *positional, **kw)
        result = fn(params, *positional, state=flat[-1], **kw)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(
                f"vj.apply: with state= the model must return (outputs, new_state), got {type(result).__name__}; "
                "return the updated state (or the state unchanged) as the second element."
            )
        outputs, new_state = result
        _check_same_on_every_device(new_state, axes)
        return outputs, new_state

    extra = (*arrays, *(() if state is None else (state,)))
    extra_specs = (*specs, *(() if state is None else (P(),)))
    return ModelCall(call, extra, extra_specs, split, batch)


def _check_same_on_every_device(new_state: Any, axes: tuple[str, ...]) -> None:
    """Raises, naming the leaf, on a new-state leaf that varies over the data axes (seen at trace time where
    ``shard_map`` tracks varying axes)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(new_state)[0]:
        varying = varying_axes(leaf) if _is_array(leaf) else frozenset()
        over = [a for a in axes if a in varying]
        if over:
            raise ValueError(
                f"vj.apply: state leaf {jax.tree_util.keystr(path) or '<root>'} (shape {tuple(np.shape(leaf))}) is "
                f"updated from this device's batch shard: it varies over the data axes {tuple(over)}, but model "
                "state is the same on every device. Compute it from global-batch quantities: vj.batch_mean(x) / "
                "vj.batch_sum(x) give the unsharded value on every device (a pmean of a per-device statistic is "
                f"that only for a mean of equal shards, not for a variance or a product of means). {WHOLE_BATCH_VALUE} "
                "Or return it as a per-example output instead of state."
            )
