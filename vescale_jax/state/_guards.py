"""Catches per-leaf logic mapped over the flat bucket buffers of a :class:`~vescale_jax.ShardedParams`.

``jax.tree.map(lambda x: x.ndim >= 2, sp)`` sees one flat buffer per bucket, not the model's leaves, so a
shape-based mask or label (Optax's "no weight decay for biases", ``optax.contrib.muon``'s ``'muon'`` /
``'adam'`` labels) would silently give every bucket the same answer. Such a map builds a ``ShardedParams``
whose children are Python bools or strings; no JAX or Optax transformation legitimately does that with a
parameter tree, so :func:`check_children` (called from ``ShardedParams.tree_unflatten``) raises there, naming
the bucket and the optax code involved and pointing to the logical-tree replacement.

Orbax does the same when handed a ``ShardedParams`` (it maps a name function over the tree before saving or
restoring): then the error says so and points at ``vj.checkpoint`` instead, which stores the logical tree.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from vescale_jax._compat import OPTAX_MASKING_MODULE, OPTAX_MUON_MODULE, OPTAX_PARTITION_MODULE

__all__ = ["PerLeafOnBucketsError", "check_children"]


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
