"""Input validation shared by the public functions: each check names the key path or index, the value and the fix.

Pure functions over shapes, dtypes, plans and pytree structure; none touches device memory or traces anything.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "check_axes",
    "check_granularity_factory",
    "check_microbatches",
    "check_precision_type",
    "check_sharded_params",
    "check_state_not_logical",
    "check_step_outputs",
    "check_x64",
    "int_grad_message",
    "plan_difference",
    "plan_states",
    "tree_difference",
]

_SHOW = 6  # paths listed per group in a message


def _listing(paths: Sequence[str]) -> str:
    shown = ", ".join(repr(p) for p in paths[:_SHOW])
    return shown + (f" and {len(paths) - _SHOW} more" if len(paths) > _SHOW else "")


def tree_difference(got_paths: Sequence[str], planned_paths: Sequence[str]) -> str:
    """Which key paths are missing, extra or renamed in ``got_paths`` relative to ``planned_paths``."""
    got, planned = list(got_paths), list(planned_paths)
    got_set, planned_set = set(got), set(planned)
    missing = [p for p in planned if p not in got_set]
    extra = [p for p in got if p not in planned_set]
    parts = []
    if missing and extra and len(missing) == len(extra):
        pairs = ", ".join(f"{a!r} -> {b!r}" for a, b in list(zip(missing, extra, strict=True))[:_SHOW])
        parts.append(f"renamed (planned -> got): {pairs}")
    else:
        if missing:
            parts.append(f"missing (in the plan, not in the tree): {_listing(missing)}")
        if extra:
            parts.append(f"extra (in the tree, not in the plan): {_listing(extra)}")
    if not parts:
        parts.append(
            "the same key paths, but other container types (e.g. a dict where the plan had an "
            "nnx.State, a list where it had a tuple, or a None node)"
        )
    return "; ".join(parts)


def _mesh_text(mesh: Any) -> str:
    ids = [int(d.id) for d in np.asarray(mesh.devices).flat]
    shown = ids if len(ids) <= 16 else [*ids[:16], "..."]
    return f"mesh {dict(mesh.shape)} on devices {shown}"


def plan_difference(got: Any, want: Any) -> str:
    """How two plans differ, in words (mesh devices, axis, leaves, layouts), for error messages."""
    if got.mesh != want.mesh:
        return f"the mesh differs: {_mesh_text(got.mesh)} vs {_mesh_text(want.mesh)}"
    if got.axis != want.axis:
        return f"the axis differs: {got.axis!r} vs {want.axis!r}"
    got_paths, want_paths = [s.path for s in got.leaves], [s.path for s in want.leaves]
    if got_paths != want_paths or got.treedef != want.treedef:
        return f"the trees differ: {tree_difference(got_paths, want_paths)}"
    for a, b in zip(got.leaves, want.leaves, strict=True):
        if a != b:
            return (
                f"leaf {a.path!r} differs: shape {a.shape} {a.dtype} {a.granularity!r} bucket {a.bucket} vs "
                f"shape {b.shape} {b.dtype} {b.granularity!r} bucket {b.bucket}"
            )
    for a, b in zip(got.buckets, want.buckets, strict=True):
        if a != b:
            return f"bucket {a.name!r} has another layout (S={a.layout.shard_size} vs {b.layout.shard_size})"
    return "the plans are not equal"


def check_sharded_params(x: Any, fn: str, *, what: str = "params") -> None:
    """TypeError unless ``x`` is a ``vj.ShardedParams`` (the fix depends on what was passed instead)."""
    from vescale_jax._buffer import GatheredParams, PerDevice, ShardedParams

    if isinstance(x, ShardedParams):
        return
    if isinstance(x, GatheredParams | PerDevice):
        hint = f"a {type(x).__name__} is internal state, not parameters; pass the vj.ShardedParams instead."
    elif x is None:
        hint = "build them with vj.shard(params, plan) or vj.init_sharded(init_fn, plan, key)."
    else:
        inner = [
            type(v).__name__
            for v in jax.tree.leaves(x, is_leaf=lambda v: isinstance(v, ShardedParams))
            if isinstance(v, ShardedParams)
        ]
        hint = (
            "it holds a vj.ShardedParams inside; pass that one, not the container."
            if inner
            else "a logical tree is not sharded yet: pass vj.shard(params, plan) (or vj.init_sharded(init_fn, "
            "plan, key))."
        )
    raise TypeError(f"{fn}: {what} must be a vj.ShardedParams, got {type(x).__name__}; {hint}")


def plan_states(tree: Any) -> list[tuple[str, Any]]:
    """``(key path, node)`` of every ``ShardedParams`` / ``PerDevice`` inside an optimizer-state tree."""
    from vescale_jax._buffer import PerDevice, ShardedParams

    kinds = ShardedParams | PerDevice
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda v: isinstance(v, kinds))[0]
    return [(jax.tree_util.keystr(p) or "<root>", v) for p, v in flat if isinstance(v, kinds)]


def check_state_not_logical(opt_state: Any, plan: Any) -> None:
    """ValueError if the optimizer state holds the plan's *logical* tree (``tx.init`` ran on unsharded params)."""
    if plan.treedef.num_leaves < 2 or plan_states(opt_state):  # state built on the shards: nothing to say
        return
    shapes = [s.shape for s in plan.leaves]

    def logical(x: Any) -> bool:
        try:
            flat, treedef = jax.tree.flatten(x)
        except Exception:
            return False
        return treedef == plan.treedef and [tuple(np.shape(v)) for v in flat] == shapes

    for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=logical)[0]:
        if logical(node):
            raise ValueError(
                f"vj.fsdp: opt_state{jax.tree_util.keystr(path)} has the structure of the logical parameter tree: the "
                "optimizer state was initialised on the unsharded params (tx.init(params)); initialise it on the "
                "ShardedParams: opt_state = vj.init_opt_state(tx, params)."
            )


def check_axes(axes: Sequence[str], mesh: Any, what: str) -> None:
    """ValueError for a duplicated axis or one the mesh lacks."""
    seen: set[str] = set()
    for a in axes:
        if a in seen:
            raise ValueError(
                f"{what}={tuple(axes)!r} names mesh axis {a!r} twice; name each axis once "
                f"(e.g. {tuple(dict.fromkeys(axes))!r})."
            )
        seen.add(a)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"{what}={tuple(axes)!r}: data axes {missing} are not axes of the mesh {dict(mesh.shape)}; name axes of "
            "the mesh."
        )


def check_kernel_policy(kernels: Any, fn: str) -> Any:
    """``kernels`` if it is a ``vj.kernels.KernelPolicy``, else a TypeError saying how to write one."""
    from vescale_jax.kernels import KernelPolicy

    if isinstance(kernels, KernelPolicy):
        return kernels
    hint = f"vj.kernels.KernelPolicy(mode={kernels!r})" if isinstance(kernels, str) else "vj.kernels.KernelPolicy()"
    raise TypeError(
        f"{fn}: kernels= must be a vj.kernels.KernelPolicy, got {type(kernels).__name__}; write kernels={hint}."
    )


def check_precision_type(precision: Any, fn: str) -> None:
    """TypeError unless ``precision`` is ``None`` or a ``vj.MixedPrecision``."""
    from vescale_jax._precision import MixedPrecision

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


def check_granularity_factory(g: Any, where: str) -> None:
    """TypeError for ``vj.rows`` / ``vj.element`` / ``vj.whole`` passed uncalled (or returned uncalled)."""
    from vescale_jax import _granularity as gran

    names = {gran.element: "vj.element()", gran.rows: "vj.rows(1)", gran.whole: "vj.whole()"}
    for factory, fix in names.items():
        if g is factory:
            raise TypeError(
                f"vj.plan: {where} is the function vj.{factory.__name__}, not a granularity; call it: "
                f"granularity={fix}."
            )


_X64 = {"float64": "float32", "int64": "int32", "uint64": "uint32", "complex128": "complex64"}


def check_x64(path: str, dtype: np.dtype) -> None:
    """ValueError for a 64-bit leaf while ``jax_enable_x64`` is off (JAX would silently store it in 32 bits)."""
    if dtype.name in _X64 and not jax.config.jax_enable_x64:
        narrow = _X64[dtype.name]
        raise ValueError(
            f"vj.plan: leaf {path} is {dtype.name} but jax_enable_x64 is off, so JAX would store it as {narrow} "
            f"and the shards would not match the plan; cast the tree first "
            f"(jax.tree.map(lambda x: x.astype(jnp.{narrow}), params)) or enable "
            "jax.config.update('jax_enable_x64', True)."
        )


def check_step_outputs(out: Any, plan: Any, opt_state: Any) -> None:
    """Checks a donating ``vj.fsdp`` step returned ``(params, opt_state, *rest)`` (at trace time, so once)."""
    from vescale_jax._buffer import ShardedParams

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


def int_grad_message(plan: Any) -> str | None:
    """The fix for ``jax.grad`` over params with integer leaves (which JAX reports without naming them)."""
    bad = [
        f"{s.path!r} ({s.dtype}{list(s.shape)})"
        for s in plan.leaves
        if not np.issubdtype(np.dtype(s.dtype), np.inexact)
    ]
    if not bad:
        return None
    return (
        f"jax.grad over vj.ShardedParams whose plan holds integer leaves: {', '.join(bad[:_SHOW])}. Keep non-trainable "
        "state out of the params tree (e.g. nnx.state(model, nnx.Param)), or plan only the float leaves; "
        "jax.grad(..., allow_int=True) gives float0 gradients that optimizers cannot use."
    )
