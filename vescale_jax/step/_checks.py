"""Checks on a step's options and outputs: each names the option or output, the value and the fix."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np

from vescale_jax.kernels import KernelPolicy
from vescale_jax.layout._checks import plan_difference
from vescale_jax.state._sharded import ShardedParams
from vescale_jax.step._precision import MixedPrecision

__all__ = ["check_kernel_policy", "check_microbatches", "check_precision_type", "check_step_outputs"]


def check_kernel_policy(kernels: Any, fn: str) -> Any:
    """``kernels`` if it is a ``vj.kernels.KernelPolicy``, else a TypeError saying how to write one."""

    if isinstance(kernels, KernelPolicy):
        return kernels
    hint = f"vj.kernels.KernelPolicy(mode={kernels!r})" if isinstance(kernels, str) else "vj.kernels.KernelPolicy()"
    raise TypeError(
        f"{fn}: kernels= must be a vj.kernels.KernelPolicy, got {type(kernels).__name__}; write kernels={hint}."
    )


def check_precision_type(precision: Any, fn: str) -> None:
    """TypeError unless ``precision`` is ``None`` or a ``vj.MixedPrecision``."""

    if precision is None or isinstance(precision, MixedPrecision):
        return
    try:
        name = np.dtype(precision).name
    except TypeError:
        name = None
    fix = (
        f"precision=vj.MixedPrecision(compute_dtype=jnp.{name})"
        if name
        else "precision=vj.MixedPrecision(compute_dtype=jnp.bfloat16)"
    )
    raise TypeError(
        f"{fn}: precision must be a vj.MixedPrecision policy, got "
        f"{f'the dtype {name}' if name else f'{precision!r} ({type(precision).__name__})'}; "
        f"use {fix} (fp32 masters, {name or 'low-precision'} gather and compute)."
    )


def check_microbatches(k: Any, fn: str) -> int | None:
    """``k`` as an int (or ``None``); ValueError for 0, negatives, bools and non-integers."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or int(k) < 1:
        raise ValueError(
            f"{fn}: microbatches={k!r}; it must be an integer >= 1 that divides the batch size (or None for no "
            "accumulation)."
        )
    return int(k)


def check_step_outputs(out: Any, plan: Any, opt_state: Any) -> None:
    """Checks a donating ``vj.fsdp`` step returned ``(params, opt_state, *rest)`` (at trace time, so once)."""

    contract = (
        "a vj.fsdp step returns (params, opt_state, *rest) — the new ShardedParams first, the new optimizer "
        "state second, then metrics"
    )
    if not isinstance(out, tuple | list) or len(out) < 2:
        got = f"{len(out)} output(s)" if isinstance(out, tuple | list) else f"one value, {_describe(out)}"
        raise ValueError(
            f"vj.fsdp: the step returned {got}; {contract}. Its params and opt_state are donated, so return them "
            "(or compile an evaluation step with vj.fsdp(..., donate=False), which may return anything)."
        )
    first, second = out[0], out[1]
    if not isinstance(first, ShardedParams):
        swapped = isinstance(second, ShardedParams)
        raise ValueError(
            f"vj.fsdp: output 0 of the step is a {type(first).__name__}, not the new vj.ShardedParams"
            + (" (output 1 is: the order looks like (opt_state, params, ...))" if swapped else "")
            + f"; {contract}."
        )
    if first.plan != plan:
        raise ValueError(
            f"vj.fsdp: output 0 of the step (params) has another plan than the step's "
            f"({plan_difference(first.plan, plan)}); return params in the layout they came in "
            "(optax.apply_updates keeps it)."
        )
    if jax.tree.structure(opt_state) != jax.tree.structure(second):
        raise ValueError(
            f"vj.fsdp: output 1 of the step should be the new opt_state, structured like the opt_state passed in "
            f"({_describe(opt_state)}), got {_describe(second)}; {contract}."
        )


def _describe(x: Any) -> str:
    """``tuple(ScaleByAdamState, EmptyState)``-style one-line description of a pytree's top levels."""
    if isinstance(x, tuple | list) and not hasattr(x, "_fields"):
        inner = ", ".join(type(v).__name__ for v in x[:4]) + (", ..." if len(x) > 4 else "")
        return f"{type(x).__name__}({inner})"
    shape = getattr(x, "shape", None)
    return type(x).__name__ if shape is None else f"an array of shape {tuple(shape)}"
