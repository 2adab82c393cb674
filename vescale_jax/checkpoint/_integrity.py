"""Checks on a checkpoint before and after reading it: tree/shape/dtype agreement and per-leaf checksums.

Orbax (TensorStore) raises on a missing or truncated chunk file, but a chunk whose bytes were flipped in place
decodes to other numbers silently. Every leaf therefore gets a checksum at save time, computed where the
leaf lives (a sharded reduction, no gather) and stored in the checkpoint's JSON: two 32-bit sums of the leaf's
words, plain and weighted by ``2 i + 1`` (an odd weight, so any single changed word changes the sum).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.layout._paths import key_name
from vescale_jax.relayout._logical_leaves import words

__all__ = [
    "check_against",
    "checksums",
    "compare",
    "compile_checksums",
    "flat_shapes",
    "raw_path",
    "stored_shapes",
    "words",
]

Shapes = Mapping[str, tuple[tuple[int, ...], str]]
Sums = dict[str, list[int]]


def raw_path(path: Any) -> str:
    """Every key of a path joined by ``/`` (NNX's ``value`` kept: it is a key of the stored tree too)."""
    return "/".join(key_name(k) for k in path)


def flat_shapes(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {raw_path(p): (tuple(int(d) for d in x.shape), np.dtype(x.dtype).name) for p, x in flat}


def stored_shapes(item_metadata: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{key path: (shape, dtype)}`` of an Orbax item's metadata tree."""
    tree = getattr(item_metadata, "tree", item_metadata)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
    return {
        raw_path(p): (tuple(int(d) for d in x.shape), np.dtype(x.dtype).name) for p, x in flat if hasattr(x, "shape")
    }


def check_against(stored: Shapes, target: Any, *, item: str) -> None:
    """Raises naming the first key path whose presence, shape or dtype differs between checkpoint and target."""
    want = flat_shapes(target)
    missing = [k for k in want if k not in stored]
    extra = [k for k in stored if k not in want]
    if missing:
        k = missing[0]
        hint = f"; the checkpoint has {extra[:4]} that the target lacks (renamed?)" if extra else ""
        raise ValueError(
            f"vj.checkpoint: {item} leaf {k!r} (shape {want[k][0]}, {want[k][1]}) of the target is not in the "
            f"checkpoint{hint}. Restore into a tree with the checkpoint's key paths (rename the module, or map "
            "the names before planning), or start that leaf from scratch."
        )
    if extra:
        raise ValueError(
            f"vj.checkpoint: the checkpoint's {item} leaf {extra[0]!r} (shape {stored[extra[0]][0]}, "
            f"{stored[extra[0]][1]}) has no place in the target; plan the target from the checkpointed tree "
            "(it has every leaf the checkpoint has), or drop that leaf from the checkpoint."
        )
    for k, (shape, dtype) in want.items():
        s_shape, s_dtype = stored[k]
        if (s_shape, s_dtype) != (shape, dtype):
            raise ValueError(
                f"vj.checkpoint: {item} leaf {k!r} is stored with shape {s_shape} and dtype {s_dtype}, but the "
                f"target expects shape {shape} and dtype {dtype}. Plan the target from the model config the "
                "checkpoint was trained with (shapes and dtypes must match; only the plan, device count and mesh "
                "may change), or cast/reshape that leaf before planning."
            )


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % 2**32)
        stride *= shape[d]
    return index


def _leaf_sums(x: jax.Array) -> jax.Array:
    w = words(x)
    weight = _flat_index(w.shape) * jnp.uint32(2) + jnp.uint32(1)
    return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * weight, dtype=jnp.uint32)])


@jax.jit
def _sums(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_leaf_sums(x) for x in leaves]


def checksums(tree: Any, *, defer: bool = False) -> Sums | Callable[[], Sums]:
    """``{key path: [sum, weighted sum]}`` of every leaf (uint32 arithmetic), computed where each leaf lives.

    ``defer``: launch the computation and return a function of no arguments that fetches the result (it waits
    for the devices then; call it from a thread that may wait, e.g. a background save's worker)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not flat:
        return (lambda: {}) if defer else {}
    on_device = _sums([x for _, x in flat])

    def fetch() -> Sums:
        sums = jax.device_get(on_device)
        return {raw_path(p): [int(v) for v in np.asarray(s)] for (p, _), s in zip(flat, sums, strict=True)}

    return fetch if defer else fetch()


def compile_checksums(tree: Any) -> None:
    """Compiles, without running, what :func:`checksums` of ``tree`` runs (arrays, or ``jax.ShapeDtypeStruct`` s
    with the shardings the arrays will have)."""
    leaves = jax.tree_util.tree_leaves(tree)
    if leaves:
        _sums.lower(leaves).compile()


def compare(got: Mapping[str, list[int]], expected: Mapping[str, list[int]], *, item: str, where: str) -> None:
    """Raises if a restored leaf's checksum differs from the one saved (a corrupt file)."""
    for k, v in got.items():
        if k in expected and list(expected[k]) != list(v):
            raise ValueError(
                f"vj.checkpoint: {item} leaf {k!r} read from {where} is corrupt: its checksum {list(v)} differs "
                f"from the saved {list(expected[k])}. The file was changed after the save; restore another step "
                "(Manager.all_steps()) or re-copy the checkpoint."
            )
