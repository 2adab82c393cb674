"""Names of leaves: a key path as ``"blocks/attn/kernel"``, and the default units leaves belong to.

:func:`default_units` is the rule ``vj.plan`` applies: every repeated layer module (the children ``0 … N`` of a
list or dict of modules, wherever it sits: ``transformer/h/3``, ``model/layers/3``, ``layers/3``) is a unit of its
own, and every other module beside the path to those layers is one (``transformer/wte``, ``lm_head``). A tree
without repeated modules gets one unit per top-level module (:func:`default_unit`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["KeyPath", "default_unit", "default_units", "key_name", "path_str", "unit_names"]

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


def _names(path: KeyPath) -> list[str]:
    """The path's names, a Linen ``"params"`` collection key dropped."""
    names = path_str(path).split("/")
    return names[1:] if names[0] == "params" and len(names) > 2 else names


def unit_names(paths: Sequence[KeyPath]) -> list[str]:
    """The default unit of each leaf path (see :func:`default_units`), in the given order."""
    all_names = [_names(p) for p in paths]
    children: dict[tuple[str, ...], set[str]] = {}
    for names in all_names:
        for k in range(len(names) - 1):  # inner nodes only: a list of arrays is not a list of layers
            children.setdefault(tuple(names[:k]), set()).add(names[k])
    layers = {p for p, ch in children.items() if p and all(c.isdigit() for c in ch)}
    spine = {p[:k] for p in layers for k in range(len(p))} or {()}
    out = []
    for names in all_names:
        cut = next((k for k in range(1, len(names)) if tuple(names[:k]) in layers), None)
        if cut is None:  # beside the layers: the module under the deepest ancestor of a layer list
            cut = max(k for k in range(len(names)) if tuple(names[:k]) in spine)
        out.append("/".join(names[: cut + 1]))
    return out


def default_units(params: Any) -> Callable[[KeyPath, Any], str]:
    """The units ``vj.plan`` groups ``params``' leaves into when ``units=None``, as a ``units=`` callable.

    Every repeated layer module is a unit of its own: a node whose children are all named ``0 … N`` (a list of
    modules, or Hugging Face's ``h`` / ``layers`` dicts) gives units ``<path>/0`` … ``<path>/N``, wherever it sits
    in the tree (the outermost such node when they nest, e.g. a layer's experts stay in the layer). Every other
    leaf goes to the module just below the deepest node on the way to a layer list: ``transformer/wte``,
    ``transformer/ln_f``, ``lm_head``. A tree with no repeated modules gets one unit per top-level module (as
    :func:`default_unit`). A Linen ``"params"`` collection key is never part of a unit name.

    Args:
      params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``).

    Returns:
      ``(key_path, leaf) -> unit name``, to start a ``units=`` function from, e.g.
      ``base = vj.default_units(params); units = lambda p, x: "norms" if x.ndim == 1 else base(p, x)``.
    """
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    table = dict(zip((path_str(p) for p, _ in flat), unit_names([p for p, _ in flat]), strict=True))

    def unit(path: KeyPath, leaf: Any) -> str:
        name = path_str(path)
        if name not in table:
            raise KeyError(f"vj.default_units: {name!r} is not a leaf path of the tree the units were built for.")
        return table[name]

    return unit
