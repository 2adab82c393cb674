"""How a training state is stored: ``ShardedParams`` as logical trees, ``PerDevice`` through its layout, checksums.

Turns ``params`` / an optimizer state into the trees Orbax writes (nested dicts keyed by key path; zero-size
leaves as ``None``, since Orbax refuses empty arrays) and back, given restore templates. Used by
:mod:`vescale_jax.checkpoint`.

An :class:`Offloaded` node (optimizer state in host memory) is stored as the node it holds: brought to the device
one node at a time, converted like a device node, and its stored arrays moved back to its host memory kind before
the next node, so the device holds about one node's state. A checkpoint saved from offloaded state is the one
saved from the same state on the device; either restores into an offloaded or a device-resident template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from vescale_jax.checkpoint import _integrity as _integrity
from vescale_jax.checkpoint import _orbax_slices as _orbax_slices
from vescale_jax.layout._plan import Plan
from vescale_jax.optim._logical_view import check_layout_groups
from vescale_jax.relayout import _logical_leaves as _logical
from vescale_jax.state._offloaded import (
    Offload,
    Offloaded,
    device_sharding,
    empty_node,
    full_shape,
    offload,
    onload,
)
from vescale_jax.state._sharded import PerDevice, ShardedParams

__all__ = [
    "abstract_logical",
    "check_layout_groups",
    "first_plan",
    "logical_and_sums",
    "logical_tree",
    "opt_state_items",
    "opt_state_target",
    "pack",
    "prepare",
    "rebuild_state",
    "storable",
]

OPT = "opt_state"

# ------------------------------------------------------------------------------------------------ key paths
_name, _raw_path = _integrity.key_name, _integrity.raw_path


def is_node(x: Any) -> bool:
    return isinstance(x, (ShardedParams, PerDevice, Offloaded))


# --------------------------------------------------------------------------------------------- offloaded nodes
def _in_memory(tree: Any, kind: str) -> Any:
    """``tree``'s arrays (or ``ShapeDtypeStruct`` targets) in memory ``kind`` with their shardings otherwise."""

    def move(x: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding.with_memory_kind(kind))
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding):
            return jax.device_put(x, x.sharding.with_memory_kind(kind))
        return x

    return jax.tree.map(move, tree)


def _shell(off: Offloaded, name: str) -> ShardedParams | PerDevice:
    """The device node an offloaded template holds, its children as ``ShapeDtypeStruct`` (no data moved)."""
    form, children = off.form, []
    for parts, split in zip(off.pieces, form.splits, strict=True):
        if split == -1:
            children.append(parts[0])
            continue
        first = parts[0]
        count = 1 if split is None else split.count
        if not (hasattr(first, "shape") and hasattr(first, "dtype")) or len(parts) != count:
            raise ValueError(
                f"vj.checkpoint: optimizer-state leaf {name!r} of the template is a vj.Offloaded whose pieces do "
                f"not match its form ({len(parts)} pieces of {type(first).__name__}, {count} expected); build "
                "the template with vj.init_opt_state(..., offload=vj.Offload()) or vj.offload(...)."
            )
        children.append(jax.ShapeDtypeStruct(full_shape(parts, split), np.dtype(first.dtype)))
    return empty_node(form, children)


def _policy(off: Offloaded) -> Offload:
    """The :class:`Offload` policy that re-creates ``off``'s form from its device node."""
    return off.form.policy


def nest(items: list[tuple[list[str], Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for parts, value in items:
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1] if parts else "value"] = value
    return out


# --------------------------------------------------------------------------------------- logical conversion
def _leaf_paths(plan: Plan, prefix: str = "") -> list[str]:
    flat, _ = jax.tree_util.tree_flatten_with_path(jax.tree_util.tree_unflatten(plan.treedef, range(len(plan.leaves))))
    return [prefix + _raw_path(p) for p, _ in flat]


def _named(plan: Plan, sums: np.ndarray, prefix: str = "") -> dict[str, list[int]]:
    return {p: [int(v) for v in row] for p, row in zip(_leaf_paths(plan, prefix), sums, strict=True)}


def logical_and_sums(
    params: ShardedParams, prefix: str = "", *, memory_kind: str | None = None, defer: bool = False
) -> tuple[Any, Any]:
    """``params``' logical tree (its leaves in ``memory_kind``, default device memory) and checksums by path
    (with ``defer``, a function of no arguments that fetches them: see :func:`_logical.to_logical`)."""
    plan = params.plan
    leaves, sums = _logical.to_logical(params.buffers, plan, memory_kind=memory_kind, defer_sums=defer)
    tree = jax.tree_util.tree_unflatten(plan.treedef, leaves)
    if defer:
        return tree, lambda: _named(plan, sums(), prefix)
    return tree, _named(plan, sums, prefix)


def logical_tree(params: ShardedParams) -> Any:
    """The logical parameter tree of ``params``, each leaf a global array evenly sharded for storage.

    Args:
      params: sharded parameters (or any parameter-shaped optimizer state).

    Returns:
      A tree of ``params.plan``'s structure (e.g. an NNX ``State``) whose leaves equal ``vj.unshard(params)``'s.

    Sharding:
      Each leaf is split over the plan's devices on its dim sharing the most factors with the device count (the
      earlier dim on a tie; replicated only if none does); the buckets are converted by one all-to-all per leaf,
      never gathered.
      A leaf split over tensor / expert axes keeps that split (major) and its TP shard is split so inside each
      group: its shape is still the full logical one.
    """
    return logical_and_sums(params)[0]


def abstract_logical(plan: Plan, buffers: Sequence[Any] | None = None) -> Any:
    """The restore target of :func:`logical_tree`: ``jax.ShapeDtypeStruct`` leaves with storage shardings.

    ``buffers`` (e.g. a parameter-shaped optimizer state's) give each bucket's dtype; default the plan's.
    """
    shardings = _logical.logical_shardings(plan)
    dtypes = [np.dtype(s.dtype if buffers is None else buffers[s.bucket].dtype) for s in plan.leaves]
    leaves = [
        jax.ShapeDtypeStruct(s.shape, d, sharding=sh) for s, d, sh in zip(plan.leaves, dtypes, shardings, strict=True)
    ]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def storable(tree: Any) -> Any:
    """Zero-size leaves as ``None`` (Orbax refuses to write an empty array; there is nothing to store)."""
    return jax.tree.map(lambda x: None if 0 in tuple(x.shape) else x, tree)


def pack(
    tree: Any,
    plan: Plan,
    expected: Mapping[str, list[int]] | None = None,
    *,
    prefix: str = "",
    item: str = "params",
    where: str = "",
    buffers: Sequence[Any] | None = None,
    donate: bool = False,
) -> ShardedParams:
    """Packs restored logical leaves into ``plan``'s buckets, checking their checksums against ``expected``.

    ``donate``: ``tree``'s arrays are not used afterwards (a restore's freshly read arrays); a bucket that holds
    one leaf split as its shards then takes that leaf's memory (no copy) and the leaf is deleted.
    """
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: x is None)
    if len(leaves) != len(plan.leaves):
        raise ValueError(f"vj.checkpoint: restored {len(leaves)} leaves for a plan of {len(plan.leaves)}.")
    dtypes = [s.dtype if buffers is None else buffers[s.bucket].dtype for s in plan.leaves]
    leaves = [
        jax.numpy.zeros(s.shape, d) if x is None else x for x, s, d in zip(leaves, plan.leaves, dtypes, strict=True)
    ]
    buffers, sums = _logical.from_logical(leaves, plan, donate=donate)
    if expected is not None:
        _integrity.compare(_named(plan, sums, prefix), expected, item=item, where=where)
    return ShardedParams(buffers, plan)


def _replicated(plan: Plan) -> NamedSharding:
    return NamedSharding(plan.mesh, P())


def _description(node: Any, name: str) -> dict[str, Any]:
    """The JSON description a save writes of one optimizer-state node (what a restore checks it against)."""
    if isinstance(node, ShardedParams):
        return {"path": name, "kind": "sharded", "plan": node.plan.fingerprint()}
    if isinstance(node, PerDevice):
        if getattr(node, "layout", None) is not None:
            return {"path": name, "kind": "per_device_logical", "layout": type(node.layout).__name__}
        return {"path": name, "kind": "per_device", "plan": node.plan.fingerprint(), "shape": list(node.value.shape)}
    return {"path": name, "kind": "array"}


def opt_state_items(
    opt_state: Any, *, memory_kind: str | None = None, defer: bool = False
) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """``opt_state`` as a nested dict of storable values, the JSON description of each node, its checksums.

    An :class:`Offloaded` node is written as the device node it holds (the same keys, arrays and description):
    it is brought to the device alone, converted, checksummed there, and what is stored goes back to its host
    memory kind before the next node, so the device holds about one node's state at a time.

    ``memory_kind`` (e.g. ``"pinned_host"``): every stored array is put there as soon as it is made (each
    bucket's converted leaves by its conversion; a leaf stored as it is, copied), so the values no longer live
    in, or alias, the device state. ``defer``: the checksums come as a function of no arguments that fetches
    them (nothing here waits for the devices where the conversions run in launch order).
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_node)
    items, info, others, node_sums = [], [], [], []
    early: list[Any] = []  # checksums of values moved off the device before the end, computed there first
    early_names: set[str] = set()
    for path, node in flat:
        parts, name = [_name(k) for k in path], _raw_path(path)
        host = node.form.memory_kind if isinstance(node, Offloaded) else None
        if host is not None:
            node = onload(node)  # this node only: its buckets whole, on the device
        if isinstance(node, ShardedParams):
            tree, sums = logical_and_sums(node, prefix=name + "/", memory_kind=host or memory_kind, defer=True)
            items.append((parts, storable(tree) if host is None else _in_memory(storable(tree), host)))
            node_sums.append(sums)
            info.append(_description(node, name))
            continue
        moved_to = None
        if isinstance(node, PerDevice):
            layout = getattr(node, "layout", None)
            if layout is not None:
                check_layout_groups(node, name)
                value: Any = dict(layout.to_logical(node.value))
            else:
                value = node.value
            info.append(_description(node, name))
            moved_to = host or memory_kind
        else:
            # A process-local jax.Array (e.g. a scalar made outside jit) cannot be written as a global array in a
            # multi-process job: it is the same on every process, so store it as host data.
            is_global = isinstance(node, jax.Array) and (jax.process_count() == 1 or not node.is_fully_addressable)
            value = node if is_global else np.asarray(node)
            info.append(_description(node, name))
            moved_to = memory_kind if is_global else None
        if moved_to is not None:
            tree = nest([(parts, value)])
            early.append(_integrity.checksums(tree, defer=True))
            early_names.update(_raw_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
            value = _in_memory(value, moved_to)
        items.append((parts, value))
        others.append((parts, value))
    if early:
        on_device = _integrity.checksums(nest([(p, v) for p, v in others if not _under(p, early_names)]), defer=True)
        # In the order a device-resident state's checksums take (the same JSON either way).
        order = [_raw_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(nest(others))[0]]

        def rest() -> dict[str, list[int]]:
            found = on_device()
            for part in early:
                found.update(part())
            return {k: found[k] for k in order}
    else:
        rest = _integrity.checksums(nest(others), defer=True)

    def fetch() -> dict[str, list[int]]:
        sums: dict[str, list[int]] = {}
        for part in node_sums:
            sums.update(part())
        sums.update(rest())
        return sums

    return nest(items), info, fetch if defer else fetch()


def _under(parts: list[str], names: set[str]) -> bool:
    """Whether a leaf at ``parts`` (or a leaf below it) has a checksum in ``names``."""
    prefix = "/".join(parts) if parts else "value"
    return any(n == prefix or n.startswith(prefix + "/") for n in names)


def _abstract(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(x.shape), np.dtype(x.dtype), sharding=sharding)


def opt_state_target(template: Any, saved: Mapping[str, dict[str, Any]], default: Plan) -> tuple[dict, list]:
    """The Orbax restore target of an optimizer-state template, and how to rebuild each node.

    An :class:`Offloaded` node of the template is read as the device node it holds, into its host memory kind
    (so the read places nothing on the device); :func:`rebuild_state` converts it one node at a time.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_node)
    items, rebuild = [], []
    for path, node in flat:
        parts, name = [_name(k) for k in path], _raw_path(path)
        stored = saved.get(name)
        if stored is None:
            raise ValueError(
                f"vj.checkpoint: optimizer-state leaf {name!r} of the target template is not in the checkpoint "
                f"(it holds {sorted(saved)[:8]}); build the template with the optimizer the checkpoint was saved "
                "with, or restore params only (opt_state=None) and re-initialise the optimizer."
            )
        off = node if isinstance(node, Offloaded) else None
        if off is not None:
            node = _shell(off, name)
        if isinstance(node, ShardedParams):
            if stored["kind"] != "sharded":
                what = "parameter-shaped ShardedParams" if off is None else "an offloaded (vj.Offloaded) ShardedParams"
                raise ValueError(
                    f"vj.checkpoint: optimizer-state leaf {name!r} was saved as {stored['kind']}, the "
                    f"template has {what} there; use the same optimizer."
                )
            target: Any = storable(abstract_logical(node.plan, node.buffers))
            rebuild.append(("sharded", node, off))
        elif isinstance(node, PerDevice):
            layout = getattr(node, "layout", None)
            if layout is not None:
                check_layout_groups(node, name)
                if stored["kind"] != "per_device_logical":
                    raise ValueError(
                        f"vj.checkpoint: optimizer-state leaf {name!r} was saved by device index (its PerDevice "
                        "had no layout), so it can only be restored into the identical plan; restore with the "
                        "saved plan, or re-initialise this state."
                    )
                target = {
                    k: _abstract(
                        s,
                        s.sharding
                        if getattr(s, "sharding", None) is not None
                        else _logical.storage_sharding(s.shape, node.plan, stacked=False),
                    )
                    for k, s in layout.logical_shapes(node.value.dtype).items()
                }
                rebuild.append(("per_device_logical", node, off))
            else:
                if stored["kind"] != "per_device" or stored["plan"] != node.plan.fingerprint():
                    raise ValueError(
                        f"vj.checkpoint: optimizer-state leaf {name!r} is a PerDevice array without a layout: it is "
                        f"stored by device index and restores only into the plan it was saved with (saved shape "
                        f"{tuple(stored.get('shape', ()))}, target {tuple(node.value.shape)}, same plan: "
                        f"{stored.get('plan') == node.plan.fingerprint()}). Give its PerDevice a layout (to_logical "
                        "/ from_logical) to re-place it under another plan, restore into the saved plan, or restore "
                        "params only and re-initialise the optimizer."
                    )
                spec = P(node.plan.axis, *[None] * (len(node.value.shape) - 1))
                target = _abstract(node.value, NamedSharding(node.plan.mesh, spec))
                rebuild.append(("per_device", node, off))
        else:
            sharding = getattr(node, "sharding", None)
            # jax.eval_shape templates on Explicit axes carry shardings over an AbstractMesh: not placeable.
            if not isinstance(sharding, jax.sharding.Sharding) or isinstance(
                getattr(sharding, "mesh", None), jax.sharding.AbstractMesh
            ):
                sharding = _replicated(default)
            target = _abstract(np.asarray(node) if not hasattr(node, "shape") else node, sharding)
            rebuild.append(("array", node, None))
        items.append((parts, target if off is None else _in_memory(target, off.form.memory_kind)))
    return nest(items), rebuild


def rebuild_state(
    template: Any, restored: dict[str, Any], rebuild: list, expected: Mapping[str, list[int]], where: str
) -> Any:
    """The optimizer state of ``template``'s structure from the restored tree, checking every checksum.

    A node whose template is an :class:`Offloaded` is moved to the device, rebuilt there and offloaded again
    (in the template's memory kind and pieces) before the next node.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_node)
    out, others = [], []
    for (path, _), (kind, node, off) in zip(flat, rebuild, strict=True):
        value: Any = restored
        for k in path:
            value = value[_name(k)]
        if off is not None:
            value = _in_memory(value, "device")
        if kind == "sharded":
            built: Any = pack(
                value,
                node.plan,
                expected,
                prefix=_raw_path(path) + "/",
                item=OPT,
                where=where,
                buffers=node.buffers,
                donate=True,  # read for this node alone, used by nothing else
            )
        else:
            parts = [_name(k) for k in path]
            if off is None:
                others.append((parts, value))
            else:  # checked here, on the device, before the node goes back to host memory
                _integrity.compare(_integrity.checksums(nest([(parts, value)])), expected, item=OPT, where=where)
            if kind == "per_device_logical":
                children = [node.layout.from_logical(dict(value))]
                built = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(node), children)
            elif kind == "per_device":
                built = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(node), [value])
            else:
                built = value
        out.append(built if off is None else offload(built, _policy(off)))
    _integrity.compare(_integrity.checksums(nest(others)), expected, item=OPT, where=where)
    return jax.tree_util.tree_unflatten(treedef, out)


def _dtypes(node: ShardedParams) -> tuple[str, ...]:
    return tuple(np.dtype(b.dtype).name for b in node.buffers)


def _empty_leaves(plan: Plan, buffers: Sequence[Any]) -> None:
    """Runs the ``jnp.zeros`` :func:`pack` makes of each zero-size leaf (stored as ``None``) once."""
    for s in plan.leaves:
        if 0 in tuple(s.shape):
            jax.numpy.zeros(s.shape, buffers[s.bucket].dtype)


def _prepare_sharded(node: ShardedParams, donate: bool = False, memory_kind: str | None = None) -> Any:
    """Compiles a ``ShardedParams``' conversions both ways (restore's with ``donate``, as :func:`pack` runs it;
    the save's writing its leaves to ``memory_kind``); returns the storable tree a save writes of it, as
    ``jax.ShapeDtypeStruct`` s with their storage shardings (in ``memory_kind``)."""
    _logical.compile_conversions(node.plan, _dtypes(node), donate=donate, memory_kind=memory_kind)
    _empty_leaves(node.plan, node.buffers)
    tree = storable(abstract_logical(node.plan, node.buffers))
    return tree if memory_kind is None else _in_memory(tree, memory_kind)


def _on_mesh(x: Any, plan: Plan) -> Any:
    """An abstract leaf (``jax.eval_shape`` on Explicit axes shards it over an ``AbstractMesh``) as the
    ``ShapeDtypeStruct`` of the array it stands for, on ``plan``'s mesh; anything else as it is."""
    sharding = getattr(x, "sharding", None)
    if (
        isinstance(x, jax.ShapeDtypeStruct)
        and isinstance(sharding, NamedSharding)
        and isinstance(sharding.mesh, jax.sharding.AbstractMesh)
        and sharding.mesh == plan.mesh.abstract_mesh
    ):
        placed = NamedSharding(plan.mesh, sharding.spec, memory_kind=sharding.memory_kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=placed, weak_type=x.weak_type)
    return x


def _device_value(node: PerDevice) -> jax.Array:
    """``node.value`` if it is an array; else (an abstract state) zeros of its shape placed as a device state is."""
    x = _on_mesh(node.value, node.plan)
    if isinstance(x, jax.Array):
        return x
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding) or isinstance(
        getattr(sharding, "mesh", None), jax.sharding.AbstractMesh
    ):
        sharding = device_sharding(node, 0, tuple(x.shape))
    return _orbax_slices.zeros(tuple(x.shape), x.dtype, sharding)


def _prepare_pieces(off: Offloaded) -> None:
    """Runs, on zeros, the joins of an offloaded node's pieces on the device (a save's ``vj.onload``) and the
    cuts of its device buffers into pieces (a restore's ``vj.offload``), one child at a time."""
    shell = empty_node(off.form, [None] * len(off.form.splits))
    for i, (parts, split) in enumerate(zip(off.pieces, off.form.splits, strict=True)):
        if split is None or split == -1:
            continue
        sharding = device_sharding(shell, i, split.full)
        pieces = [_orbax_slices.zeros(split.piece_shape(r), parts[0].dtype, sharding) for r in range(split.count)]
        whole = split.join(pieces)
        jax.block_until_ready([split.take(whole, r) for r in range(split.count)])


def _prepare_opt_state(opt_state: Any, default: Plan, memory_kind: str | None = None) -> list[Any]:
    """Compiles what a save of ``opt_state`` (with its ``memory_kind``) and a restore into it run (see
    :func:`prepare`); returns the leaves a save hands Orbax (arrays, or ``jax.ShapeDtypeStruct`` s with their
    shardings)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_node)
    stored: list[Any] = []
    info, others, early = [], [], []
    logical: dict[str, dict[str, jax.Array]] = {}  # each PerDevice layout's to_logical, for its from_logical
    # -- the save (as opt_state_items)
    for path, node in flat:
        parts, name = [_name(k) for k in path], _raw_path(path)
        host = node.form.memory_kind if isinstance(node, Offloaded) else None
        if host is not None:
            _prepare_pieces(node)
            node = _shell(node, name)
        info.append(_description(node, name))
        if isinstance(node, ShardedParams):
            # rebuild_state packs with donate=True
            tree = _prepare_sharded(node, donate=True, memory_kind=host or memory_kind)
            stored += jax.tree.leaves(tree)
            continue
        if isinstance(node, PerDevice):
            if getattr(node, "layout", None) is not None:
                check_layout_groups(node, name)
                value: Any = dict(node.layout.to_logical(_device_value(node)))
                logical[name] = value
            else:
                value = _on_mesh(node.value, node.plan)
            moved_to = host or memory_kind
        else:
            is_global = isinstance(node, jax.Array) and (jax.process_count() == 1 or not node.is_fully_addressable)
            abstract = isinstance(node, jax.ShapeDtypeStruct)
            value = node if is_global else _on_mesh(node, default) if abstract else np.asarray(node)
            moved_to = memory_kind if is_global or abstract else None
        if moved_to is not None:  # checksummed alone on the device, then moved (as opt_state_items does)
            early.append((parts, value))
            value = _in_memory(value, moved_to)
        stored += jax.tree.leaves(value)
        others.append((parts, value))
    early_parts = [parts for parts, _ in early]
    for parts, value in early:  # an offloaded PerDevice's checksums, on the device, one node at a time
        _integrity.compile_checksums(nest([(parts, value)]))
    _integrity.compile_checksums(nest([(parts, v) for parts, v in others if parts not in early_parts]))
    # -- a restore (as opt_state_target and rebuild_state), into this state and into its jax.eval_shape
    saved = {d["path"]: d for d in info}
    templates = [opt_state]
    if any(isinstance(x, jax.Array) for x in jax.tree.leaves(opt_state)):
        templates.append(jax.eval_shape(lambda: opt_state))
    for t, template in enumerate(templates):
        target, rebuild = opt_state_target(template, saved, default)
        flat_t, _ = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_node)
        restored = []
        for (path, _), (kind, node, off) in zip(flat_t, rebuild, strict=True):
            parts = [_name(k) for k in path]
            got: Any = target
            for k in parts:
                got = got[k]
            if off is not None:
                got = _in_memory(got, "device")
            if kind == "sharded":
                continue
            if off is None:
                restored.append((parts, got))
            else:
                _integrity.compile_checksums(nest([(parts, got)]))
            if kind == "per_device_logical" and t == 0:
                arrays = logical[_raw_path(path)]
                node.layout.from_logical({k: jax.device_put(x, got[k].sharding) for k, x in arrays.items()})
        _integrity.compile_checksums(nest(restored))
    return stored


def prepare(params: ShardedParams, opt_state: Any = None, *, memory_kind: str | None = None) -> None:
    """Compiles, ahead of time, every executable a save of this state and a restore into its plans run.

    * every ``ShardedParams`` (``params`` and the parameter-shaped nodes of ``opt_state``, offloaded ones
      included): its bucket -> logical and logical -> bucket executables, compiled without running and cached by
      plan and dtype;
    * every ``PerDevice`` with a layout (Shampoo's blocks, compact moments, 8-bit AdamW's scales): its
      ``to_logical`` run once on the state's value (on zeros of its shape for an abstract state), and its
      ``from_logical`` on what that gave, placed as a restore reads it;
    * the checksums a save computes and those a restore computes (into this state, and into its
      ``jax.eval_shape``), compiled without running;
    * an offloaded node's joins of its pieces on the device and cuts back into pieces, run once on zeros;
    * Orbax's slicing of replicated storage blocks (each replica writes a slice of its block): run once per
      stored shape and sharding, on the stored arrays or on zeros of their shape (:mod:`._orbax_slices`).

    Nothing is written, no bucket is converted, and the state is not changed; the device holds at most one
    node's conversion (or one offloaded buffer) more while it runs.

    Args:
      params: the sharded parameters (real or abstract, ``jax.eval_shape``: only their plan and dtypes are read).
      opt_state: the optimizer state over them (real or abstract), or ``None``.
      memory_kind: the memory a save writes the converted leaves to (as :func:`logical_and_sums` and
        :func:`opt_state_items` with it); ``None``: device memory.
    """
    # a restore packs the params with donate=True
    stored = jax.tree.leaves(_prepare_sharded(params, donate=True, memory_kind=memory_kind))
    if opt_state is not None:
        stored += _prepare_opt_state(opt_state, params.plan, memory_kind)
    _orbax_slices.precompile(stored)


def first_plan(tree: Any) -> Plan:
    for node in jax.tree_util.tree_leaves(tree, is_leaf=is_node):
        if is_node(node):
            return node.plan
    raise ValueError(
        "vj.checkpoint: pass params= (the target plan) to place an optimizer state without ShardedParams in it."
    )
