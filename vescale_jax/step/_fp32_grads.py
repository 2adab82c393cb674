"""Low-precision leaves whose gradient is summed in fp32 before it is rounded, as the unsharded step does.

Unsharded, the gradient of a bf16 parameter ``b`` used as ``b.astype(f32)`` is the fp32 sum over the whole
batch, rounded to bf16 once (the transpose of the cast). Under FSDP each device sums its own batch shard; if
it rounds its partial sum to bf16 before the cross-device reduction, the result is off by several ulp. JAX's
NamedSharding FSDP avoids this because the partitioner reduces the fp32 partial sums where the batch is
contracted, before the cast's transpose.

:func:`widened` does the same for ``vj.apply``: the gathered leaf reaches the model in its own dtype, but the
model is run on an fp32 copy of it (exactly representable: it is an upcast) through which every
``astype(float32)`` of the leaf is the identity. Its cotangent is therefore the model's fp32 partial sum,
which the gather's transpose reduce-scatters in fp32 and rounds once. Uses of the leaf in its own dtype
(``x_bf16 * b``) see the bf16 value unchanged; their gradient is bf16 already in the model (as unsharded).

The casts are found wherever the leaf's value flows (:mod:`vescale_jax.step._interpret`): through slices and
reshapes of it (``b[i].astype(f32)``), into nested ``jit``, ``scan`` (the model's own ``jax.lax.scan`` /
``nnx.scan`` over a stacked leaf planned without ``stacked=``), ``jax.checkpoint`` / ``nnx.remat`` and ``cond``.
``custom_jvp`` / ``custom_vjp`` functions and ``while`` loops receive the leaf in its own dtype: their
gradient is what their rules (or no rule) make it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.step._interpret import Wide, evaluate

__all__ = ["wide_dtype", "widened"]


def wide_dtype(dtype: Any) -> np.dtype | None:
    """fp32 for a floating dtype narrower than 32 bits (bf16, fp16, fp8), else None."""
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return None


def widened(fn: Callable[..., Any], narrow: Sequence[Any], *, is_leaf: Any = None) -> Callable[..., Any]:
    """``fn(tree, *args)`` run on ``tree`` whose wide leaves (``narrow[i]`` not None) hold an fp32 copy of a
    leaf of dtype ``narrow[i]``: ``fn`` sees that leaf in ``narrow[i]``, and ``astype(float32)`` of it is the
    fp32 copy itself (no round trip), so gradients reach the copy unrounded.

    Args:
      fn: the model ``(tree, *args) -> outputs``.
      narrow: per leaf of ``tree`` (flattening order, with ``is_leaf``): the dtype the model expects, or None
        for leaves passed as they are.
      is_leaf: passed to ``jax.tree.flatten`` (e.g. to keep layer stand-ins whole).

    Returns:
      The wrapped function (same signature, wide leaves in fp32).
    """
    if not any(d is not None for d in narrow):
        return fn

    def run(tree, *args):
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
        if len(leaves) != len(narrow):
            raise ValueError(f"widened: {len(leaves)} leaves, {len(narrow)} dtypes")
        # The model traces on the leaves in their own dtype (the casts are dead code once it is evaluated).
        model_leaves = [x if d is None else x.astype(d) for x, d in zip(leaves, narrow, strict=True)]
        in_flat, in_def = jax.tree.flatten((model_leaves, args))
        wide, pos = {}, 0
        for x, d in zip(leaves, narrow, strict=True):
            if d is not None:
                wide[pos] = (x, np.dtype(d))
            pos += len(jax.tree.leaves(x))

        def flat_fn(*xs):
            leaves_, args_ = jax.tree.unflatten(in_def, xs)
            return fn(jax.tree.unflatten(treedef, leaves_), *args_)

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*in_flat)
        args = [Wide(*wide[i]) if i in wide else x for i, x in enumerate(in_flat)]
        outs = [x.narrow() if isinstance(x, Wide) else x for x in evaluate(closed, args)]
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run
