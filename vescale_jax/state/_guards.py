"""Catches per-leaf logic mapped over the flat bucket buffers of a :class:`~vescale_jax.ShardedParams`.

``jax.tree.map(lambda x: x.ndim >= 2, sp)`` sees one flat buffer per bucket, not the model's leaves, so a
shape-based mask or label (Optax's "no weight decay for biases", ``optax.contrib.muon``'s ``'muon'`` /
``'adam'`` labels) would silently give every bucket the same answer. Such a map builds a ``ShardedParams``
whose children are Python bools or strings; no JAX or Optax transformation legitimately does that with a
parameter tree, so :func:`check_children` (called from ``ShardedParams.tree_unflatten``) raises there, naming
the bucket and the optax code involved and pointing to the logical-tree replacement.

Optax's per-leaf *norm and shape* transformations (``optax.lamb`` / ``lars`` / ``fromage`` through
``scale_by_trust_ratio``, ``scale_by_param_block_norm`` / ``_rms``, ``clip_by_block_rms``, ``adafactor``,
``sm3``, ``novograd``) map arrays, not bools, so :func:`check_children` also looks at the few frames that
called it: when one of those transformations' ``init`` / ``update`` is rebuilding a ``ShardedParams`` whose
buckets would not give it one leaf each (:func:`check_per_leaf_transform`), it raises, naming the
transformation, a bucket with the leaves it would lump together, and the ``vj.optim`` replacement.

Orbax does the same when handed a ``ShardedParams`` (it maps a name function over the tree before saving or
restoring): then the error says so and points at ``vj.checkpoint`` instead, which stores the logical tree.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._compat import (
    OPTAX_MASKING_MODULE,
    OPTAX_MUON_MODULE,
    OPTAX_NORM_CODES,
    OPTAX_PARTITION_MODULE,
    OPTAX_PER_LEAF_CODES,
    is_tracer,
)

__all__ = ["PerLeafOnBucketsError", "check_children", "check_eager_norm", "check_per_leaf_transform"]


class PerLeafOnBucketsError(TypeError):
    """A per-leaf (shape-based) mask or label function was mapped over the bucket buffers of a
    ``ShardedParams``."""


# optax module -> (what it is, the vescale_jax replacement)
_REPLACEMENTS = (
    (OPTAX_MUON_MODULE, "optax.contrib.muon", "vj.optim.muon(learning_rate, ...)"),
    (
        OPTAX_MASKING_MODULE,
        "optax.masked (or the mask= of optax.adamw / add_decayed_weights / lamb)",
        "vj.optim.masked(inner, mask), vj.optim.adamw(..., mask=mask) or vj.optim.add_decayed_weights(wd, mask)",
    ),
    (
        OPTAX_PARTITION_MODULE,
        "optax.partition / optax.multi_transform",
        "vj.optim.partition(transforms, param_labels)",
    ),
)


# optax per-leaf transformation -> (exact on one leaf per bucket, what it computes per leaf, the replacement).
# A norm over a bucket holding one leaf is that leaf's norm (the padding is zero); an RMS divides by the
# bucket's size (padding included) and a shape-based transformation sees a flat buffer: never right.
_PER_LEAF_TRANSFORMS = {
    "scale_by_trust_ratio": (
        True,
        "one trust ratio (||param|| / ||update||) per leaf; it is what optax.lamb, optax.lars and optax.fromage chain",
        "vj.optim.lamb(...) for optax.lamb, vj.optim.lars(...) for optax.lars, vj.optim.scale_by_trust_ratio(...) "
        "for optax.scale_by_trust_ratio, which compute it per logical leaf (optax.fromage has no vj.optim version: "
        "build it from vj.optim.leaf_norms / vj.optim.scale_leaves)",
    ),
    "scale_by_param_block_norm": (
        True,
        "one parameter norm per leaf",
        "vj.optim.scale_by_param_block_norm(...), which computes it per logical leaf",
    ),
    "scale_by_param_block_rms": (
        False,
        "one parameter RMS per leaf",
        "vj.optim.scale_by_param_block_rms(...), which computes it per logical leaf",
    ),
    "clip_by_block_rms": (
        False,
        "one update RMS per leaf",
        "vj.optim.clip_by_block_rms(...), which computes it per logical leaf",
    ),
    "scale_by_factored_rms": (
        False,
        "second moments factored over each leaf's shape (optax.adafactor)",
        "an element-wise optimizer (optax.adamw, vj.optim.adamw_8bit) or vj.optim.muon / vj.optim.shampoo: "
        "vj.optim has no adafactor",
    ),
    "scale_by_sm3": (
        False,
        "accumulators over each leaf's dims (optax.sm3)",
        "an element-wise optimizer (optax.adagrad, optax.adamw): vj.optim has no sm3",
    ),
    "scale_by_novograd": (
        True,
        "one gradient norm per leaf (optax.novograd)",
        "vj.optim.lamb(...) or an element-wise optimizer: vj.optim has no novograd (build it from "
        "vj.optim.leaf_norms / vj.optim.scale_leaves)",
    ),
}


def _named_frames(codes: Any, depth: int) -> list[tuple[str, Any]]:
    """``(name, frame)`` of each frame, among the ``depth`` frames above the caller's caller, whose code object
    ``codes`` names; nearest first."""
    frame, found = sys._getframe(2), []
    while frame is not None and depth:
        name = codes.get(frame.f_code)
        if name is not None:
            found.append((name, frame))
        frame, depth = frame.f_back, depth - 1
    return found


def check_per_leaf_transform(plan: Any) -> None:
    """Raises :class:`PerLeafOnBucketsError` when one of optax's per-leaf norm / shape transformations is
    rebuilding a ``ShardedParams`` of ``plan`` (its ``init`` or ``update`` mapped over the bucket buffers), unless
    each bucket holds one leaf and the transformation is a norm (then per bucket is per leaf)."""
    found = _named_frames(OPTAX_PER_LEAF_CODES, 12)
    if not found:
        return
    name, frame = found[0]  # the nearest
    exact, what, fix = _PER_LEAF_TRANSFORMS[name]
    buckets = getattr(plan, "buckets", ())
    shared = [b for b in buckets if len(b.leaves) > 1]
    if exact and not shared:
        return
    leaves = getattr(plan, "leaves", ())
    if shared:
        b = shared[0]
        paths = [leaves[i].path for i in b.leaves[:4]] if leaves else []
        more = f" and {len(b.leaves) - 4} more" if len(b.leaves) > 4 else ""
        seen = f"bucket {b.name!r} {b.shape} holds {len(b.leaves)} leaves ({', '.join(paths)}{more})"
    else:
        b = buckets[0] if buckets else None
        seen = f"bucket {b.name!r} is a flat buffer of shape {b.shape}" if b else "each bucket is a flat buffer"
    raise PerLeafOnBucketsError(
        f"optax.{name} was applied to a vj.ShardedParams: it computes {what}, but it sees the plan's flat bucket "
        f"buffers, not the model's leaves ({seen}), so the result would be per bucket, not per leaf. Use {fix}. "
        f"[raised in {frame.f_globals.get('__name__', '?')}:"
        f"{frame.f_code.co_name} line {frame.f_lineno}]"
    )


def check_eager_norm(buffers: Sequence[Any], plan: Any) -> None:
    """Raises, naming the fix, when ``optax.global_norm`` / ``optax.tree.norm`` is taking the norm of a
    ``ShardedParams`` eagerly, outside ``jax.set_mesh``, on a JAX that cannot (its ``x.imag`` of an array on
    ``Explicit`` mesh axes needs a mesh context: JAX 0.10 and 0.11). Anywhere else it returns at once."""
    found = _named_frames(OPTAX_NORM_CODES, 8)
    if not found or not buffers or any(is_tracer(x) for x in buffers):
        return
    name = found[-1][0]  # the outermost: global_norm calls tree.norm, and the user called the first
    if not jax.sharding.get_abstract_mesh().empty or getattr(plan, "num_devices", 1) < 2:
        return
    x = buffers[0]
    try:
        jnp.imag(x)
    except ValueError as e:
        if "set_mesh" not in str(e):
            raise
        raise ValueError(
            f"optax.{name} was given a vj.ShardedParams outside jax.set_mesh: its buckets live on the plan's mesh "
            f"{dict(plan.mesh.shape)} with Explicit axes, and this JAX ({jax.__version__}) takes such a norm only "
            "inside a mesh context. Call vj.global_norm(params) (it enters the plan's mesh itself and leaves the "
            "padding out), or wrap the call: with jax.set_mesh(params.plan.mesh): optax.global_norm(params)."
        ) from None


_ORBAX = "orbax."  # any module of the orbax package (orbax.checkpoint names every leaf before saving)

_CHECKPOINT_FIX = (
    "Save with vj.checkpoint.Manager(directory).save(step, params=params, opt_state=opt_state) (restores into "
    "any plan or device count, optimizer state included) or vj.checkpoint.save_params(path, params) (one plain "
    "Orbax directory of the logical tree), and restore with Manager.restore(params=plan, opt_state=template) or "
    "vj.checkpoint.restore_params(path, plan). To give Orbax the logical tree yourself, pass "
    "vj.checkpoint.logical_tree(params) (each leaf evenly sharded, nothing gathered) or vj.unshard(params) "
    "(docs/checkpoint.md has the plain-Orbax recipe)."
)


def _caller() -> tuple[str, str, str] | None:
    """The nearest optax or orbax frame on the stack: (where, what it is, its replacement); ``what`` is
    ``"orbax"`` for Orbax."""
    frame = sys._getframe(2)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        where = f"{module}:{frame.f_code.co_name} line {frame.f_lineno}"
        if module.startswith(_ORBAX):
            return where, "orbax", _CHECKPOINT_FIX
        for prefix, what, fix in _REPLACEMENTS:
            if module.startswith(prefix):
                return where, what, fix
        frame = frame.f_back
    return None


def check_children(plan: Any, children: Sequence[Any], *, kind: str = "ShardedParams") -> None:
    """Raises :class:`PerLeafOnBucketsError` if a ``ShardedParams`` is being built from bools or strings.

    Args:
      plan: the ``ShardedParams``' plan (its aux data).
      children: the children handed to ``tree_unflatten``.
      kind: the container's class name, for the message.
    """
    bad = [i for i, child in enumerate(children) if isinstance(child, bool | np.bool_ | str)]
    if not bad:
        check_per_leaf_transform(plan)
        return
    buckets = getattr(plan, "buckets", ())

    def describe(i):
        b = buckets[i] if i < len(buckets) else None
        return f"{b.name!r} {b.shape} -> {children[i]!r}" if b else f"#{i} -> {children[i]!r}"

    name = buckets[bad[0]].name if bad[0] < len(buckets) else f"#{bad[0]}"
    shape = buckets[bad[0]].shape if bad[0] < len(buckets) else "?"
    got = "; ".join(describe(i) for i in bad[:4]) + ("; ..." if len(bad) > 4 else "")
    caller = _caller()
    if caller is not None and caller[1] == "orbax":
        raise PerLeafOnBucketsError(
            f"orbax.checkpoint was given a vj.{kind} (directly or inside a state tree): it would store the plan's "
            f"flat bucket buffers (e.g. {name!r}, shape {shape}), not the model's leaves, and could only restore "
            f"into the identical plan and device count. {caller[2]} [raised in {caller[0]}]"
        )
    if caller is not None and caller[1] == "optax.contrib.muon":
        raise PerLeafOnBucketsError(
            f"optax.contrib.muon was applied to a vj.ShardedParams: it labels leaves by ndim ('muon' for 2-D), but "
            f"each bucket (e.g. {name!r}, shape {shape}) is a flat buffer, so no matrix would be orthogonalised. "
            "Use vj.optim.muon(learning_rate, ...), which runs Newton-Schulz on each logical matrix "
            f"(same arguments where they overlap). [raised in {caller[0]}]"
        )
    where = f" (from {caller[1]}, {caller[0]})" if caller else ""
    fix = (
        caller[2]
        if caller
        else (
            "vj.optim.masked(inner, mask) / vj.optim.partition(transforms, labels), which take a mask or labels "
            "written over the plan's logical tree (a tree of bools/labels or a callable called on the logical "
            "abstract tree) and apply them per element"
        )
    )
    raise PerLeafOnBucketsError(
        f"a per-leaf function was mapped over a vj.ShardedParams{where}: it was called on the flat bucket buffers, "
        f"not on the model's leaves (bucket (shape) -> result: {got}), so a shape-based mask or label would give "
        f"every leaf of a bucket the same answer. Write the mask/labels over the logical tree "
        f"instead and use {fix}."
    )
