"""Names of leaves: a key path as ``"blocks/attn/kernel"``, and the default unit a leaf belongs to."""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["KeyPath", "default_unit", "key_name", "path_str"]

KeyPath = tuple[Any, ...]


def key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_str(path: KeyPath) -> str:
    """``"layers/attn/kernel"`` style name of a key path (NNX's trailing ``value`` dropped)."""
    names = [key_name(k) for k in path]
    if len(names) > 1 and names[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        names = names[:-1]
    return "/".join(names)


def default_unit(path: KeyPath, leaf: Any) -> str:
    """The unit ``vj.plan`` puts a leaf in by default: one unit per top-level module.

    A ``units=`` callable can start from it, e.g. to move a unit's vectors into a unit of their own.

    Args:
      path: the leaf's key path (as ``jax.tree_util.tree_flatten_with_path`` gives it).
      leaf: the leaf (unused; there for the ``units=`` signature).

    Returns:
      The first name of the path, or the second when the first is a Linen ``"params"`` collection key.
    """
    names = path_str(path).split("/")
    if names[0] == "params" and len(names) > 2:
        return names[1]
    return names[0]
