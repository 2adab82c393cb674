"""Input checks on plans and trees: each names the key path or index, the value and the fix.

Pure functions over shapes, dtypes, plans and pytree structure; none touches device memory or traces anything.
"""

from __future__ import annotations

import numbers  # noqa: F401
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax.layout import _granularity as gran

__all__ = [
    "check_axes",
    "check_granularity_factory",
    "check_x64",
    "int_grad_message",
    "plan_difference",
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


def check_granularity_factory(g: Any, where: str) -> None:
    """TypeError for ``vj.rows`` / ``vj.element`` / ``vj.whole`` passed uncalled (or returned uncalled)."""

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
