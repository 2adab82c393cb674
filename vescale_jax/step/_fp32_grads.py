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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._compat import bind_equation, convert_dtype, is_convert, is_literal

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
        outs = _eval(closed, in_flat, wide)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def _eval(closed: Any, in_flat: Sequence[Any], wide: dict[int, tuple[Any, np.dtype]]) -> list[Any]:
    """Evaluates ``closed`` on ``in_flat``; input ``i`` in ``wide`` is ``(fp32 copy, dtype)``: its uses read
    the copy cast to ``dtype``, except ``convert_element_type`` to the copy's dtype, which is the copy."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = {}
    copies: dict[Any, tuple[Any, np.dtype]] = {}

    def read(v):
        if is_literal(v):
            return v.val
        if v not in env:  # a wide input used in its own dtype
            copy, dtype = copies[v]
            env[v] = copy.astype(dtype)
        return env[v]

    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = c
    for i, v in enumerate(jaxpr.invars):
        if i in wide:
            copies[v] = wide[i]
        else:
            env[v] = in_flat[i]
    for eqn in jaxpr.eqns:
        src = eqn.invars[0] if eqn.invars else None
        if (
            is_convert(eqn)
            and not is_literal(src)
            and src in copies
            and convert_dtype(eqn) == np.dtype(copies[src][0].dtype)
        ):
            env[eqn.outvars[0]] = copies[src][0]  # astype(f32) of the leaf: its exact fp32 copy
            continue
        env.update(zip(eqn.outvars, bind_equation(eqn, [read(v) for v in eqn.invars]), strict=True))
    return [read(v) for v in jaxpr.outvars]
