"""Tree-level planning: a pytree of parameters -> a :class:`~vescale_jax.Plan` of flat buckets.

Leaves are grouped into *units* (by default one per repeated layer module and one per other module beside
them, see :func:`~vescale_jax.layout._paths.default_units`), each unit split by dtype into *buckets*, and every
bucket laid out by :func:`plan_bucket`. A unit
named in ``stacked`` is a scanned layer group: its leaves share a leading layer dim ``L``, the planner lays
out one layer, and the bucket's buffer has shape ``(L, m*S)``.

This module reads shapes and dtypes only; it never touches device memory.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax.layout._checks import check_granularity_factory, check_x64
from vescale_jax.layout._granularity import Granularity, element
from vescale_jax.layout._paths import KeyPath, path_str
from vescale_jax.layout._paths import unit_names as default_unit_names
from vescale_jax.layout._plan import Bucket, LeafSpec, Plan, mesh_size
from vescale_jax.layout._planner import plan_bucket
from vescale_jax.layout._tiles import is_tiled
from vescale_jax.layout._tp import DimAxes, group_axes, local_shape, normalize

__all__ = ["plan"]

GranularityArg = Granularity | Callable[[KeyPath, Any], Granularity]
UnitsArg = Callable[[KeyPath, Any], str] | None


def _leaf_shape_dtype(path: KeyPath, leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    if _is_layer_shard(leaf):
        raise TypeError(
            f"vj.plan: leaf {jax.tree_util.keystr(path)} is a vj.LayerShard (a stacked layer's stand-in inside "
            "vj.apply); plan the parameters outside the step."
        )
    shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"vj.plan: leaf {jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not an array; the params "
            "tree must hold arrays or jax.ShapeDtypeStruct only (wrap scalars with jnp.asarray, or move "
            "non-parameter state out of the tree, e.g. nnx.state(model, nnx.Param))."
        )
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"vj.plan: leaf {jax.tree_util.keystr(path)} holds PRNG keys ({dtype}); RNG state is not a trained "
            "parameter. Plan the parameters only and pass the rest as the model's state: NNX: graphdef, params, "
            "state = nnx.split(model, nnx.Param, ...); vj.plan(params, mesh); vj.flax.nnx_apply(graphdef, params, "
            "*batch, state=state). Linen: plan {'params': ...} and pass keys as vj.flax.linen_apply(..., "
            "rngs={'dropout': key})."
        )
    dtype = np.dtype(dtype)
    check_x64(jax.tree_util.keystr(path), dtype)
    return tuple(int(d) for d in shape), dtype


def _is_layer_shard(leaf: Any) -> bool:
    return type(leaf).__name__ == "LayerShard" and hasattr(leaf, "rows")


def _call_user(fn: Callable[..., Any], name: str, path: KeyPath, leaf: Any) -> Any:
    """Calls a user's ``(key_path, leaf)`` callback, naming the argument when its signature does not fit."""
    try:
        inspect.signature(fn).bind(path, leaf)
    except TypeError as e:
        raise TypeError(
            f"vj.plan: {name}= must be a callable of (key_path, leaf), but {fn!r} cannot take those two arguments "
            f"({e}); e.g. {name}=lambda path, leaf: ..."
        ) from None
    except ValueError:  # no signature (a builtin): just call it
        pass
    return fn(path, leaf)


def _resolve_granularity(granularity: GranularityArg, path: KeyPath, leaf: Any) -> Granularity:
    check_granularity_factory(granularity, "granularity")
    g = (
        _call_user(granularity, "granularity", path, leaf)
        if callable(granularity) and not isinstance(granularity, Granularity)
        else granularity
    )
    check_granularity_factory(g, f"the granularity callable's result for leaf {jax.tree_util.keystr(path)}")
    if not isinstance(g, Granularity):
        raise TypeError(
            f"vj.plan: granularity for leaf {jax.tree_util.keystr(path)} is {g!r}; it must be vj.element(), "
            "vj.rows(k), vj.tiles(bh, bw) or vj.whole() (or a callable of (path, leaf) returning one)."
        )
    return g


def plan(
    params: Any,
    mesh: jax.sharding.Mesh,
    *,
    axis: str | tuple[str, ...] = "fsdp",
    granularity: GranularityArg | None = None,
    units: UnitsArg = None,
    stacked: Collection[str] | Callable[[str], bool] = (),
    align_bytes: int = 16,
    split: str = "auto",
    tp: Any = None,
) -> Plan:
    """Plans the flat, sharded buckets for a parameter tree.

    Args:
      params: a pytree of arrays or ``jax.ShapeDtypeStruct`` (Flax NNX ``State``, Linen params, ...).
      mesh: the device mesh.
      axis: mesh axis (or tuple of axes) to shard the buckets over.
      granularity: ``vj.element()`` (default), ``vj.rows(k)``, ``vj.tiles(bh, bw)`` (tile-major storage),
        ``vj.whole()`` or a callable
        ``(key_path, leaf) -> Granularity`` choosing per leaf.
      units: callable ``(key_path, leaf) -> unit name`` grouping leaves into buckets; default
        :func:`default_units`: one unit per repeated layer module wherever it sits (``model/layers/3``), one per
        other module beside them, one per top-level module in a tree without repeated modules. Dtypes are never
        mixed in a bucket.
      stacked: unit names (or a predicate on the unit name) that are scanned layer groups; their leaves share
        a leading layer dim and get a per-layer layout and a buffer of shape ``(L, m*S)``.
      align_bytes: offsets and ``S`` are multiples of ``align_bytes // itemsize`` elements.
      split: how a unit is cut into buckets (each bucket is gathered and reduce-scattered as one):
        ``"none"``: one bucket per unit and dtype; ``"leaves"``: every matrix (a leaf of two or more dims per
        layer) its own bucket, the unit's vectors one bucket together; ``"auto"`` (default): a unit of at least
        4 MiB per layer gets one bucket per leaf of at least 1 MiB per layer and one for the rest, if that pads
        no more than 0.5 % of the unit more than one bucket would; smaller units stay whole. The rule trades
        launches for memory: a step holds about one gathered bucket and its gradient at a time (and copies a
        multi-leaf bucket's leaves out of it, where a one-leaf bucket is its leaf), so a large unit is worth a
        few more collectives, while a small one costs more in launches than it saves.
      tp: tensor / expert parallelism: how leaves are split over mesh axes other than ``axis`` before the FSDP
        layout. ``None`` (default): no leaf is. A pytree of ``PartitionSpec`` (or ``None``) with the params'
        structure (e.g. ``nnx.get_partition_spec(state)``, or :func:`vescale_jax.flax.partition_specs`), a
        callable ``(key_path, leaf) -> PartitionSpec | None``, or ``"sharding"``: each leaf's own
        ``NamedSharding`` spec (the ``ShapeDtypeStruct`` leaves of ``nnx.eval_shape`` under ``jax.set_mesh``, as
        ``nnx.with_partitioning`` annotates them). Entries naming ``axis`` are ignored: the FSDP layout is
        ragged over it.

    Returns:
      A hashable, deterministic :class:`Plan`.

    Sharding:
      Each bucket is sharded evenly over ``axis``; every leaf's placement is a :class:`RaggedShard`. With
      ``tp``, a leaf is split over its spec's other axes first, and each group of those axes lays out its
      shards over ``axis`` (one layout for all groups; a bucket never mixes leaves split over different axes):
      the FSDP gathers run within a group, and the model sees TP-local leaves.
    """
    if type(params).__name__ in ("ShardedParams", "GatheredParams"):
        raise TypeError(
            f"vj.plan: params is already a vj.{type(params).__name__} (planned as {params.plan.axis!r} over "
            f"{params.plan.num_devices} devices); plan the logical tree (vj.unshard(sp), or jax.eval_shape of the "
            "init function), or reuse sp.plan."
        )
    m = mesh_size(mesh, axis)
    axis = axis if isinstance(axis, str) else tuple(axis)
    granularity = element() if granularity is None else granularity
    if isinstance(stacked, str):  # a single unit name, not its letters
        stacked = (stacked,)
    is_stacked = stacked if callable(stacked) else (lambda name, names=frozenset(stacked): name in names)
    if isinstance(align_bytes, bool) or not isinstance(align_bytes, int) or align_bytes < 1:
        raise ValueError(f"vj.plan: align_bytes must be a positive integer, got {align_bytes!r}")

    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    defaults = default_unit_names([p for p, _ in flat]) if units is None else None
    tp_specs = _tp_specs(tp, flat)
    sizes = dict(mesh.shape)
    fsdp_axes = (axis,) if isinstance(axis, str) else axis
    groups: dict[tuple[str, str, tuple[str, ...]], list[int]] = {}
    infos = []
    logical: list[tuple[tuple[int, ...], DimAxes]] = []
    for index, (path, leaf) in enumerate(flat):
        shape, dtype = _leaf_shape_dtype(path, leaf)
        unit = str(_call_user(units, "units", path, leaf)) if defaults is None else defaults[index]
        g = _resolve_granularity(granularity, path, leaf)
        dims = normalize(
            tp_specs[index], shape, sizes, drop=fsdp_axes, path=path_str(path), stacked=bool(is_stacked(unit))
        )
        logical.append((shape, dims))
        infos.append((path, local_shape(shape, dims, sizes), dtype, unit, g))
        groups.setdefault((unit, dtype.name, group_axes(dims, mesh.axis_names)), []).append(index)
    if not flat:
        raise ValueError(
            f"vj.plan: params has no array leaves (got {type(params).__name__} {params!r:.80}); pass the parameter "
            "tree (e.g. nnx.state(model, nnx.Param) or variables['params'])."
        )
    if not callable(stacked):
        unit_names = list(dict.fromkeys(unit for unit, _, _ in groups))
        unknown = [name for name in stacked if name not in unit_names]
        if unknown:
            raise ValueError(
                f"vj.plan: stacked={tuple(stacked)!r} names {unknown[0]!r}, which is not a unit of this tree; "
                f"the units are {unit_names[:12]}{' ...' if len(unit_names) > 12 else ''} (one per top-level "
                "module, or per repeated layer, by default; or as units= groups them)."
            )

    if split not in _SPLITS:
        raise ValueError(f"vj.plan: split={split!r}; use one of {_SPLITS}.")
    specs: list[LeafSpec | None] = [None] * len(flat)
    buckets = []
    for (unit, dtype_name, on), indices in groups.items():
        layers = None
        if is_stacked(unit):
            leads = {infos[i][1][:1] for i in indices}
            if len(leads) != 1 or () in leads:
                detail = ", ".join(f"{jax.tree_util.keystr(infos[i][0])}: {infos[i][1]}" for i in indices[:4])
                raise ValueError(
                    f"vj.plan: stacked unit {unit!r} needs every leaf to share a leading layer dim, got {detail}; "
                    "stack the layers (nnx.vmap / nn.scan) or leave the unit out of stacked=."
                )
            layers = infos[indices[0]][1][0]
            if layers == 0:
                raise ValueError(
                    f"vj.plan: stacked unit {unit!r} has 0 layers (leaf {jax.tree_util.keystr(infos[indices[0]][0])} "
                    f"has shape {infos[indices[0]][1]}); build it with at least one layer, or drop the unit from the "
                    "tree and from stacked=."
                )
        align = max(1, align_bytes // np.dtype(dtype_name).itemsize)
        itemsize = np.dtype(dtype_name).itemsize

        def lay(idx, layers=layers, align=align):
            per_layer = [infos[i][1][1:] if layers is not None else infos[i][1] for i in idx]
            return _layout(per_layer, [infos[i][4] for i in idx], m, align)

        parts = [("", indices, lay(indices))]
        cut = _split_leaves(indices, infos, layers, itemsize, split)
        if cut is not None:
            split_parts = [(name, idx, lay(idx)) for name, idx in cut]
            padded = lambda ps: sum(layout.total_size - sum(layout.sizes) for _, _, (layout, _) in ps)
            unit_size = sum(parts[0][2][0].sizes)
            if split == "leaves" or padded(split_parts) - padded(parts) <= 0.005 * unit_size:
                parts = split_parts
        for name, idx, (layout, grans) in parts:
            b = len(buckets)
            label = f"{unit}/{name}" if name else unit
            label = f"{label}@{'+'.join(on)}:{dtype_name}" if on else f"{label}:{dtype_name}"
            per_layer = [infos[i][1][1:] if layers is not None else infos[i][1] for i in idx]
            storage = tuple(g if is_tiled(s, g) else None for g, s in zip(grans, per_layer, strict=True))
            storage = storage if any(storage) else ()
            num_groups = math.prod(sizes[a] for a in on)
            buckets.append(Bucket(label, unit, dtype_name, layout, tuple(idx), layers, storage, on, num_groups))
            for slot, i in enumerate(idx):
                path, local = infos[i][:2]
                shape, dims = logical[i]
                specs[i] = LeafSpec(
                    path_str(path), shape, dtype_name, b, slot, grans[slot], dims, local if dims else None
                )
    return Plan(treedef, tuple(specs), tuple(buckets), mesh, axis)


_SPLITS = ("auto", "leaves", "none")


_LEAF_BYTES = 1 << 20  # a leaf of at least this many bytes per layer gets its own bucket when a unit is split


_UNIT_BYTES = 4 << 20  # "auto" splits units of at least this many bytes per layer


def _tp_specs(tp: Any, flat: Sequence[tuple[KeyPath, Any]]) -> list[Any]:
    """Each leaf's ``PartitionSpec`` (or None) from ``plan``'s ``tp=`` argument (checked: its type, and a tree's
    structure against the params'; each spec is checked by :func:`vescale_jax.layout._tp.normalize`)."""
    if tp is None:
        return [None] * len(flat)
    if isinstance(tp, str):
        if tp != "sharding":
            raise ValueError(f"vj.plan: tp={tp!r}; pass 'sharding', a pytree of PartitionSpecs or a callable.")
        out = []
        for _, leaf in flat:
            sh = getattr(leaf, "sharding", None)
            out.append(sh.spec if isinstance(sh, jax.sharding.NamedSharding) else None)
        return out
    if isinstance(tp, jax.sharding.PartitionSpec) and not (len(flat) == 1 and not flat[0][0]):  # a one-array tree
        raise TypeError(
            f"vj.plan: tp={tp} is one PartitionSpec; tp= takes one spec per leaf: a tree of PartitionSpecs (or None) "
            f"with the params' structure, or a callable, e.g. tp=lambda path, leaf: {tp} if leaf.ndim == "
            f"{len(tuple(tp))} else None."
        )
    if callable(tp):
        return [_call_user(tp, "tp", path, leaf) for path, leaf in flat]
    is_spec = lambda x: x is None or isinstance(x, jax.sharding.PartitionSpec)
    if not is_spec(tp) and jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(tp, is_leaf=is_spec)):
        raise TypeError(
            f"vj.plan: tp= is {type(tp).__name__} {tp!r:.60}, not a tree of specs; pass None, 'sharding', a tree of "
            "PartitionSpecs (or None) with the params' structure, or a callable (key_path, leaf) returning specs."
        )
    got = jax.tree_util.tree_flatten_with_path(tp, is_leaf=is_spec)[0]
    want = [path_str(p) for p, _ in flat]
    have = [path_str(p) for p, _ in got]
    if have != want:
        missing = [p for p in want if p not in have][:3]
        extra = [p for p in have if p not in want][:3]
        # a tuple or list written where a leaf's spec goes: its entries flatten to paths below the leaf's
        nested = [p for p in missing if any(q.startswith(p + "/") for q in have)][:1]
        raise ValueError(
            f"vj.plan: tp= must be a tree of PartitionSpecs (or None) with the params' structure; it has "
            f"{len(have)} leaves, the params {len(want)}"
            + (f"; params leaves without a spec: {missing}" if missing else "")
            + (f"; specs with no params leaf: {extra}" if extra else "")
            + (
                f"; the spec of leaf {nested[0]!r} is a tuple or list, not a PartitionSpec: write P(...)"
                if nested
                else ""
            )
            + ". Build it from the same tree (nnx.get_partition_spec(state)), or pass a callable (path, leaf)."
        )
    return [x for _, x in got]


def _layout(per_layer: Sequence[tuple[int, ...]], grans: Sequence[Granularity], m: int, align: int):
    """``(BucketLayout, granularities)`` of one bucket's leaves; ``vj.whole(max_padding=x)`` leaves are
    released to ``element()``, the largest first, until the bucket's padding fits the smallest such budget."""
    sizes = [math.prod(s) for s in per_layer]
    grans = list(grans)
    blocks = [g.block(s) for g, s in zip(grans, per_layer, strict=True)]
    segments = [g.segments(s) for g, s in zip(grans, per_layer, strict=True)]
    layout = plan_bucket(sizes, blocks, m, align=align, segments=segments)
    soft = sorted((j for j, g in enumerate(grans) if g.max_padding is not None), key=lambda j: -sizes[j])
    budget = min((grans[j].max_padding for j in soft), default=1.0)
    for j in soft:
        if layout.padding_fraction <= budget:
            break
        grans[j], blocks[j] = element(), 1
        layout = plan_bucket(sizes, blocks, m, align=align, segments=segments)
    return layout, grans


def _split_leaves(indices, infos, layers, itemsize, split) -> list[tuple[str, list[int]]] | None:
    """The sub-buckets ``split`` cuts a unit's leaves into (``[(name, leaf indices)]``), or None for one."""
    if split == "none" or len(indices) < 2:
        return None
    nbytes = {i: math.prod(infos[i][1][1:] if layers is not None else infos[i][1]) * itemsize for i in indices}
    if split == "auto" and sum(nbytes.values()) < _UNIT_BYTES:
        return None
    if split == "leaves":  # every matrix its own bucket
        own = lambda i: len(infos[i][1]) - (layers is not None) >= 2
    else:
        own = lambda i: nbytes[i] >= _LEAF_BYTES
    big = [i for i in indices if own(i)]
    rest = [i for i in indices if not own(i)]
    if not big or (len(big) == 1 and not rest):
        return None
    names = [path_str(infos[i][0]).split("/", 1)[-1] for i in big]
    return [*zip(names, ([i] for i in big), strict=True), *([("rest", rest)] if rest else [])]
