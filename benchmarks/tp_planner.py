"""Padding of the ragged FSDP layout composed with expert / tensor parallelism, beside FSDP-only and FSDP2.

What it measures (all static: shapes, the planner's layouts; bf16 parameters, offsets and ``S`` aligned to
16 bytes = 8 elements, as ``benchmarks/planner.py``):

* **GPT-OSS-120B** (``benchmarks/model_configs.py``; 36 layers, 128 experts stacked in one tensor per layer in
  HF's layout): the experts (``mlp.experts.*``, dim 0) split over an ``expert`` mesh axis of 8, so each EP group
  holds 16 experts, every other leaf replicated over ``expert``; ``fsdp`` in {8, 32} inside each group
  (64 and 256 devices). Beside it the FSDP-only plan: no EP, all 64 / 256 devices on ``fsdp``, logical shapes.
* **Llama-3-70B**: Megatron tensor parallelism over a ``tensor`` axis of 8 (column-parallel q/k/v/gate/up
  split on the output dim, dim 0 of HF's ``(out, in)``; row-parallel o/down split on the input dim, dim 1;
  vocab-parallel embedding and output head split on the vocab dim, dim 0; norms replicated) with ``fsdp`` in
  {8, 32}, beside FSDP-only on 64 / 256 devices.

For every configuration, granularity (``element()``, ``vj.plan``'s default, and ``rows(1)``) and ``split``
mode (``"auto"``, ``vj.plan``'s default, and ``"none"``: one bucket per layer and group axes):

* **ragged**: the layout ``vj.plan`` builds: leaves grouped into buckets by ``(unit, dtype, group axes)`` (a
  bucket never mixes expert-split and replicated leaves; one unit per layer, embed / final_norm / lm_head
  their own), cut by ``split``, each bucket laid out by :func:`vescale_jax.plan_bucket` on its leaves'
  TP/EP-local shapes (:func:`local_shape`) over the ``fsdp`` size. Padding over the whole model
  (a grouped bucket counts its ``G`` group copies, a replicated leaf once, as ``Plan.padding_fraction``) and
  over the TP/EP-split leaves alone (the experts; Llama's split matrices): those leaves planned by themselves,
  which for the TP/EP configurations are exactly their buckets in the whole plan (checked). **S/device** is
  ``sum(S)`` over the buckets: every device owns exactly ``S`` of each bucket, so it is also the maximum, and
  **GiB/device** is that in bf16, beside the ideal (the local elements / ``fsdp``) and FSDP2's.
* **FSDP2**: even dim-0 sharding of each leaf's local shape over the ``fsdp`` size (dim 0 padded up to a
  multiple of it, as torch FSDP2 and a ``NamedSharding`` over ``fsdp`` do): 16 local experts over 32 devices,
  or 128 experts over 256, pad to twice their size.
* **time**: ``plan_bucket`` over every bucket with a cold planner cache, best of 3; and, when the process has
  the devices (the script simulates 256 CPU devices), ``vj.plan`` itself on ``jax.ShapeDtypeStruct`` leaves
  over a real ``jax.sharding.Mesh`` of ``("fsdp", "expert" | "tensor")``, whose buckets (names, leaves, group
  axes, ``S``, offsets) must equal the integer ones.

Run from the repository root::

    python benchmarks/tp_planner.py                                   # print the tables
    python benchmarks/tp_planner.py --out benchmarks/results/tp_planner.md

Exits non-zero if, in any row: the EP experts pad ``>= 0.1 %`` (FSDP2 pads them 50 %, a 2x buffer, at
fsdp = 32); the TP/EP-split leaves or the whole model pad ``>= 1 %`` with ``split="auto"`` or ``>= 3 %`` with
``split="none"`` (``benchmarks/planner.py``'s limit: one bucket per layer with ``rows(1)`` blocks pads Llama
1.2 % at 256 devices, by its forced bound); ``vj.plan`` builds other buckets than the integer grouping; a
layout breaks an invariant; or a whole-model ``plan_bucket`` pass takes ``>= 0.3 s`` (``--no-time-gate``
reports the time only).
"""

import argparse
import dataclasses
import datetime
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

if "XLA_FLAGS" not in os.environ:  # enough simulated CPU devices for vj.plan on the largest mesh
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=256"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from model_configs import buckets  # noqa: E402

import vescale_jax as vj  # noqa: E402

P = jax.sharding.PartitionSpec
DTYPE = np.dtype(jax.numpy.bfloat16)
ALIGN = 16 // DTYPE.itemsize  # 16-byte alignment of bf16 elements, as benchmarks/planner.py
REPEATS = 3
EXPERT_LIMIT = 0.001  # EP experts, every row (FSDP2 pads them to 2x where fsdp exceeds the local expert count)
PAD_LIMIT = {"auto": 0.01, "none": 0.03}  # TP/EP leaves and whole model; "none": benchmarks/planner.py's limit
TIME_LIMIT_S = 0.3
GRANULARITIES = (("element()", vj.element()), ("rows(1)", vj.rows(1)))
SPLITS = ("auto", "none")
# vj.plan's split="auto" rule (vescale_jax/layout/_plan.py): a unit of >= 4 MiB per layer gets one bucket per leaf of
# >= 1 MiB and one for the rest, if that pads at most 0.5 % of the unit more than one bucket.
UNIT_BYTES = 4 << 20
LEAF_BYTES = 1 << 20
SPLIT_SLACK = 0.005


# ----------------------------------------------------------------------------------------------- configurations


def gpt_oss_spec(name: str, shape: tuple[int, ...]) -> jax.sharding.PartitionSpec | None:
    """Expert parallelism: the stacked experts' dim 0 over ``expert``; every other leaf replicated."""
    return P("expert") if ".mlp.experts." in name else None


_COLUMN = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
_ROW = ("o_proj.weight", "down_proj.weight")
_VOCAB = ("embed_tokens.weight", "lm_head.weight")


def megatron_spec(name: str, shape: tuple[int, ...]) -> jax.sharding.PartitionSpec | None:
    """Megatron TP of HF ``(out, in)`` Linear weights: column-parallel on dim 0, row-parallel on dim 1,
    vocab-parallel embedding / head on dim 0; norms replicated."""
    if name.endswith(_COLUMN) or name.endswith(_VOCAB):
        return P("tensor", None)
    if name.endswith(_ROW):
        return P(None, "tensor")
    return None


@dataclasses.dataclass(frozen=True)
class Config:
    """One mesh and TP/EP assignment of one model."""

    model: str
    kind: str  # "EP", "TP" or "FSDP-only"
    fsdp: int
    group_axis: str  # "expert" or "tensor"
    group_size: int  # 1 for FSDP-only
    spec: Callable[[str, tuple[int, ...]], jax.sharding.PartitionSpec | None]

    @property
    def devices(self) -> int:
        return self.fsdp * self.group_size

    @property
    def mesh_axes(self) -> tuple[tuple[str, int], ...]:
        return (("fsdp", self.fsdp), (self.group_axis, self.group_size))

    @property
    def label(self) -> str:
        if self.group_size == 1:
            return f"FSDP-only fsdp={self.fsdp}"
        return f"{self.kind} {self.group_axis}={self.group_size} x fsdp={self.fsdp}"


def configs() -> list[Config]:
    out = []
    for model, kind, axis, spec in (
        ("gpt-oss-120b", "EP", "expert", gpt_oss_spec),
        ("llama3-70b", "TP", "tensor", megatron_spec),
    ):
        for fsdp in (8, 32):
            out.append(Config(model, kind, fsdp, axis, 8, spec))
            out.append(Config(model, "FSDP-only", 8 * fsdp, axis, 1, spec))
    return out


# ------------------------------------------------------------------------------------- the tree and its grouping

DimAxes = tuple[tuple[str, ...], ...]  # per dim of a leaf the TP/EP axes it is split over; () when none is split


def split_dims(spec: P | None, shape: tuple[int, ...], sizes: dict[str, int], path: str) -> DimAxes:
    """Per dim the mesh axes ``spec`` splits it over, ``fsdp`` left out (the ragged layout owns it), as
    ``LeafSpec.tp`` holds them; ``()`` for a leaf with no split dim. Checks that each split dim divides."""
    if spec is None:
        return ()
    dims = []
    for d, entry in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
        axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
        axes = tuple(a for a in axes if a != "fsdp")
        if shape[d] % math.prod(sizes[a] for a in axes):
            raise ValueError(f"{path}: dim {d} of shape {shape} does not split over {axes} ({spec})")
        dims.append(axes)
    return tuple(dims) if any(dims) else ()


def local_shape(shape: tuple[int, ...], dims: DimAxes, sizes: dict[str, int]) -> tuple[int, ...]:
    """The shape of one TP/EP shard of a leaf (``LeafSpec.local``)."""
    if not dims:
        return shape
    return tuple(n // math.prod(sizes[a] for a in axes) for n, axes in zip(shape, dims, strict=True))


def split_axes(dims: DimAxes, order: Sequence[str]) -> tuple[str, ...]:
    """The mesh axes a leaf is split over, in mesh order: its bucket's group axes (``Bucket.groups``)."""
    used = {a for axes in dims for a in axes}
    return tuple(a for a in order if a in used)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter as ``vj.plan`` sees it (in the tree's flattening order)."""

    path: str  # "unit/param" as vj.plan_path writes it
    unit: str
    shape: tuple[int, ...]
    dims: DimAxes  # per dim the TP/EP axes (``()``: not split)
    local: tuple[int, ...]
    split: bool  # named by the TP/EP spec (also in FSDP-only configurations, where the axis has size 1)


def abstract_tree(model: str) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
    """``{unit: {param name: ShapeDtypeStruct}}`` of ``model`` in bf16: one unit per layer, embed / final_norm /
    lm_head their own (``vj.plan``'s default units are the top-level keys)."""
    return {
        unit: {name: jax.ShapeDtypeStruct(shape, DTYPE) for name, shape in params} for unit, params in buckets(model)
    }


def leaves_of(tree: dict, cfg: Config) -> list[Leaf]:
    """The tree's leaves in ``jax.tree_util`` flattening order (``vj.plan``'s), with their TP/EP dims."""
    sizes = dict(cfg.mesh_axes)
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        unit, name = path[0].key, path[1].key
        spec = cfg.spec(name, tuple(leaf.shape)) if cfg.group_size > 1 else None
        dims = split_dims(spec, tuple(leaf.shape), sizes, f"{unit}/{name}")
        split = cfg.spec(name, tuple(leaf.shape)) is not None
        out.append(Leaf(f"{unit}/{name}", unit, tuple(leaf.shape), dims, local_shape(leaf.shape, dims, sizes), split))
    return out


@dataclasses.dataclass(frozen=True)
class PlannedBucket:
    """One bucket of the integer grouping, as ``vj.plan`` would build it."""

    name: str
    groups: tuple[str, ...]
    num_groups: int
    leaves: tuple[int, ...]  # indices into the leaf list, in slot order
    layout: vj.BucketLayout


def _lay(leaves: Sequence[Leaf], idx: Sequence[int], gran: vj.Granularity, m: int) -> vj.BucketLayout:
    shapes = [leaves[i].local for i in idx]
    return vj.plan_bucket(
        [math.prod(s) for s in shapes],
        [gran.block(s) for s in shapes],
        m,
        align=ALIGN,
        segments=[gran.segments(s) for s in shapes],
    )


def _padded(layout: vj.BucketLayout) -> int:
    return layout.total_size - sum(layout.sizes)


def group_buckets(leaves: Sequence[Leaf], cfg: Config, gran: vj.Granularity, split: str) -> list[PlannedBucket]:
    """The buckets ``vj.plan(tree, mesh, tp=..., granularity=gran, split=split)`` builds, from integers only.

    Leaves are grouped by ``(unit, dtype, group axes)`` in order of first appearance (one dtype here), so a
    bucket never mixes leaves split over ``expert`` / ``tensor`` with replicated ones; ``split="auto"`` then
    cuts a group of at least ``UNIT_BYTES`` into one bucket per leaf of at least ``LEAF_BYTES`` (a ``"<unit>/<leaf
    name>"`` bucket) and a ``"<unit>/rest"`` bucket, when that pads at most ``SPLIT_SLACK`` of the group more.
    Every bucket is laid out by :func:`vescale_jax.plan_bucket` on the local shapes over ``cfg.fsdp``.
    """
    order = [a for a, _ in cfg.mesh_axes]
    sizes = dict(cfg.mesh_axes)
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault((leaf.unit, split_axes(leaf.dims, order)), []).append(i)
    out = []
    for (unit, on), idx in groups.items():
        parts = [("", idx, _lay(leaves, idx, gran, cfg.fsdp))]
        nbytes = {i: math.prod(leaves[i].local) * DTYPE.itemsize for i in idx}
        if split == "auto" and len(idx) >= 2 and sum(nbytes.values()) >= UNIT_BYTES:
            big = [i for i in idx if nbytes[i] >= LEAF_BYTES]
            rest = [i for i in idx if nbytes[i] < LEAF_BYTES]
            if big and not (len(big) == 1 and not rest):
                cut = [(leaves[i].path.split("/", 1)[1], [i]) for i in big] + ([("rest", rest)] if rest else [])
                cut_parts = [(name, part, _lay(leaves, part, gran, cfg.fsdp)) for name, part in cut]
                extra = sum(_padded(lay) for *_, lay in cut_parts) - _padded(parts[0][2])
                if extra <= SPLIT_SLACK * sum(parts[0][2].sizes):
                    parts = cut_parts
        for name, part, layout in parts:
            label = f"{unit}/{name}" if name else unit
            label = f"{label}@{'+'.join(on)}:{DTYPE.name}" if on else f"{label}:{DTYPE.name}"
            out.append(PlannedBucket(label, on, math.prod(sizes[a] for a in on), tuple(part), layout))
    return out


# ---------------------------------------------------------------------------------------------------- figures


def fsdp2_padded(shape: tuple[int, ...], m: int) -> int:
    """Elements of a leaf after even dim-0 sharding over ``m`` devices (dim 0 padded up to a multiple of m)."""
    if not shape:
        return m
    return -(-shape[0] // m) * m * math.prod(shape[1:])


def _copies(leaf: Leaf, cfg: Config) -> int:
    """How many distinct local shards a leaf has (its group count); a replicated leaf counts once."""
    sizes = dict(cfg.mesh_axes)
    return math.prod(sizes[a] for axes in leaf.dims for a in axes)


@dataclasses.dataclass(frozen=True)
class Result:
    """Figures of one (configuration, granularity, split)."""

    cfg: Config
    gran: str
    split: str
    num_buckets: int
    numel: int
    split_padding: float  # ragged, TP/EP-split leaves alone
    padding: float  # ragged, whole model
    fsdp2_split_padding: float
    fsdp2_padding: float
    shard_elements: int  # sum of S over buckets: elements every device owns
    ideal_elements: float  # local elements / fsdp
    fsdp2_elements: int  # per device under FSDP2
    seconds: float  # plan_bucket over every bucket, cold cache, best of REPEATS
    layer0: tuple[PlannedBucket, ...]  # buckets of layers.0 (for the detail table)
    plan_seconds: float | None = None  # vj.plan on ShapeDtypeStructs over a real mesh
    plan_matches: bool | None = None  # None: not enough devices to build the mesh

    def failures(self, *, time_gate: bool = True) -> list[str]:
        out = []
        what = f"{self.cfg.model} {self.cfg.label} {self.gran} split={self.split}"
        limit = PAD_LIMIT[self.split]
        if self.cfg.kind == "EP" and self.split_padding >= EXPERT_LIMIT:
            out.append(f"{what}: the experts pad {pct(self.split_padding)} >= {pct(EXPERT_LIMIT)}")
        if self.split_padding >= limit:
            out.append(f"{what}: TP/EP-split leaves pad {pct(self.split_padding)} >= {pct(limit)}")
        if self.padding >= limit:
            out.append(f"{what}: whole model pads {pct(self.padding)} >= {pct(limit)}")
        if self.plan_matches is False:
            out.append(f"{what}: vj.plan's buckets differ from the integer grouping")
        if time_gate and self.seconds >= TIME_LIMIT_S:
            out.append(f"{what}: plan_bucket time {1e3 * self.seconds:.1f} ms >= {1e3 * TIME_LIMIT_S:.0f} ms")
        return out


def _fraction(padded: int, used: int) -> float:
    return (padded - used) / padded if padded else 0.0


def ragged_padding(leaves: Sequence[Leaf], bs: Sequence[PlannedBucket]) -> float:
    """Padding over every bucket's global buffer (``G * m * S`` each) against the logical leaves."""
    return _fraction(sum(b.num_groups * b.layout.total_size for b in bs), sum(math.prod(x.shape) for x in leaves))


def fsdp2_padding(leaves: Sequence[Leaf], cfg: Config) -> float:
    padded = sum(_copies(x, cfg) * fsdp2_padded(x.local, cfg.fsdp) for x in leaves)
    return _fraction(padded, sum(math.prod(x.shape) for x in leaves))


def time_plan_bucket(bs: Sequence[PlannedBucket]) -> float:
    """Best of ``REPEATS`` cold-cache runs of ``plan_bucket`` over the buckets' inputs."""
    inputs = [(b.layout.sizes, b.layout.blocks, b.layout.num_devices) for b in bs]
    best = math.inf
    for _ in range(REPEATS):
        vj.plan_bucket.cache_clear()
        t0 = time.perf_counter()
        for sizes, blocks, m in inputs:
            vj.plan_bucket(sizes, blocks, m, align=ALIGN)
        best = min(best, time.perf_counter() - t0)
    vj.plan_bucket.cache_clear()
    return best


def make_mesh(cfg: Config) -> jax.sharding.Mesh | None:
    """A real ``("fsdp", group axis)`` mesh of the configuration, or None without enough devices."""
    if cfg.devices > jax.device_count():
        return None
    names = tuple(a for a, _ in cfg.mesh_axes)
    return jax.make_mesh((cfg.fsdp, cfg.group_size), names, devices=jax.devices()[: cfg.devices])


def tp_tree(tree: dict, cfg: Config) -> dict:
    """The ``tp=`` argument of ``vj.plan`` for the configuration (a tree of specs with the params' structure)."""
    return {
        unit: {name: (cfg.spec(name, tuple(x.shape)) if cfg.group_size > 1 else None) for name, x in params.items()}
        for unit, params in tree.items()
    }


def same_buckets(plan: vj.Plan, leaves: Sequence[Leaf], bs: Sequence[PlannedBucket]) -> bool:
    """Whether ``vj.plan``'s buckets equal the integer grouping: names, leaves, group axes, sizes, S, offsets."""
    mine = [
        (b.name, tuple(leaves[i].path for i in b.leaves), b.groups, b.num_groups, b.layout.sizes, b.layout.offsets)
        for b in bs
    ]
    theirs = [
        (b.name, tuple(plan.leaves[i].path for i in b.leaves), b.groups, b.num_groups, b.layout.sizes, b.layout.offsets)
        for b in plan.buckets
    ]
    same_s = [b.layout.shard_size for b in bs] == [b.layout.shard_size for b in plan.buckets]
    return mine == theirs and same_s


def measure(cfg: Config, gran_name: str, split: str, *, check_plan: bool = True) -> Result:
    """All figures of one configuration (``check_plan``: also run ``vj.plan`` when the devices exist)."""
    gran = dict(GRANULARITIES)[gran_name]
    tree = abstract_tree(cfg.model)
    leaves = leaves_of(tree, cfg)
    bs = group_buckets(leaves, cfg, gran, split)
    for b in bs:
        b.layout.check()
    split_leaves = [x for x in leaves if x.split]
    split_bs = group_buckets(split_leaves, cfg, gran, split)
    if cfg.group_size > 1:  # the split leaves' buckets are the same whether planned alone or in the model
        grouped = [(b.name, b.layout) for b in bs if b.groups]
        assert grouped == [(b.name, b.layout) for b in split_bs], f"{cfg.label}: split-leaf buckets differ"
    plan_seconds = plan_matches = None
    mesh = make_mesh(cfg) if check_plan else None
    if mesh is not None:
        vj.plan_bucket.cache_clear()
        t0 = time.perf_counter()
        plan = vj.plan(tree, mesh, tp=tp_tree(tree, cfg), granularity=gran, split=split)
        plan_seconds = time.perf_counter() - t0
        plan_matches = same_buckets(plan, leaves, bs) and math.isclose(
            plan.padding_fraction, ragged_padding(leaves, bs)
        )
    return Result(
        cfg=cfg,
        gran=gran_name,
        split=split,
        num_buckets=len(bs),
        numel=sum(math.prod(x.shape) for x in leaves),
        split_padding=ragged_padding(split_leaves, split_bs),
        padding=ragged_padding(leaves, bs),
        fsdp2_split_padding=fsdp2_padding(split_leaves, cfg),
        fsdp2_padding=fsdp2_padding(leaves, cfg),
        shard_elements=sum(b.layout.shard_size for b in bs),
        ideal_elements=sum(math.prod(x.local) for x in leaves) / cfg.fsdp,
        fsdp2_elements=sum(fsdp2_padded(x.local, cfg.fsdp) for x in leaves) // cfg.fsdp,
        seconds=time_plan_bucket(bs),
        layer0=tuple(b for b in bs if b.name.startswith("layers.0@") or b.name.startswith(("layers.0:", "layers.0/"))),
        plan_seconds=plan_seconds,
        plan_matches=plan_matches,
    )


def run(cfgs: Sequence[Config], *, check_plan: bool = True) -> list[Result]:
    return [measure(c, g, s, check_plan=check_plan) for c in cfgs for g, _ in GRANULARITIES for s in SPLITS]


# ----------------------------------------------------------------------------------------------------- output


def pct(x: float) -> str:
    """A fraction in percent; exactly zero as ``0``, a nonzero one under 0.0005 % as ``<0.001%``."""
    if x == 0:
        return "0"
    return "<0.001%" if x < 5e-6 else f"{100 * x:.3f}%"


def gib(elements: float) -> str:
    return f"{elements * DTYPE.itemsize / 2**30:.3f}"


def times(padding: float) -> str:
    """A padding fraction as buffer / parameters (``2.00x``: the buffer is twice the parameters)."""
    return f"{1 / (1 - padding):.2f}x"


def summary_table(results: Sequence[Result]) -> str:
    """One row per configuration under ``split="auto"`` (``vj.plan``'s default), both granularities."""
    head = (
        "| model | mesh | devices | ragged: TP/EP leaves, element() / rows(1) | ragged: model, element() / rows(1) "
        "| FSDP2: TP/EP leaves | FSDP2: model | GiB/device ragged / FSDP2 / ideal |"
    )
    lines = [head, "|---|---|--:|--:|--:|--:|--:|--:|"]
    by = {(r.cfg, r.gran, r.split): r for r in results}
    for cfg in dict.fromkeys(r.cfg for r in results):
        el, r1 = by.get((cfg, "element()", "auto")), by.get((cfg, "rows(1)", "auto"))
        if el is None or r1 is None:
            continue
        lines.append(
            f"| {cfg.model} | {cfg.label} | {cfg.devices} | {pct(el.split_padding)} / {pct(r1.split_padding)} "
            f"| {pct(el.padding)} / {pct(r1.padding)} | {pct(el.fsdp2_split_padding)} "
            f"({times(el.fsdp2_split_padding)}) | {pct(el.fsdp2_padding)} ({times(el.fsdp2_padding)}) "
            f"| {gib(el.shard_elements)} / {gib(el.fsdp2_elements)} / {gib(el.ideal_elements)} |"
        )
    return "\n".join(lines)


def table(results: Sequence[Result], *, time_gate: bool = True) -> str:
    head = (
        "| model | mesh | devices | granularity | split | buckets | ragged: TP/EP leaves | ragged: model "
        "| FSDP2: TP/EP leaves | FSDP2: model | S/device (elements) | GiB/device ragged / FSDP2 / ideal "
        "| plan_bucket ms | vj.plan ms | vj.plan = integer | check |"
    )
    lines = [head, "|---|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|---|---|"]
    for r in results:
        fails = r.failures(time_gate=time_gate)
        match = "-" if r.plan_matches is None else ("yes" if r.plan_matches else "NO")
        plan_ms = "-" if r.plan_seconds is None else f"{1e3 * r.plan_seconds:.0f}"
        lines.append(
            f"| {r.cfg.model} | {r.cfg.label} | {r.cfg.devices} | {r.gran} | {r.split} | {r.num_buckets} "
            f"| {pct(r.split_padding)} | {pct(r.padding)} "
            f"| {pct(r.fsdp2_split_padding)} ({times(r.fsdp2_split_padding)}) | {pct(r.fsdp2_padding)} "
            f"| {r.shard_elements:,} | {gib(r.shard_elements)} / {gib(r.fsdp2_elements)} / {gib(r.ideal_elements)} "
            f"| {1e3 * r.seconds:.1f} | {plan_ms} | {match} | {'FAIL' if fails else 'ok'} |"
        )
    return "\n".join(lines)


def layer_table(results: Sequence[Result]) -> str:
    """The buckets of ``layers.0`` under the defaults (``element()``, ``split="auto"``)."""
    lines = ["| model | mesh | bucket | G | leaves | S | G*m*S | padding |", "|---|---|---|--:|--:|--:|--:|--:|"]
    for r in results:
        if (r.gran, r.split) != (GRANULARITIES[0][0], SPLITS[0]):
            continue
        for b in r.layer0:
            lines.append(
                f"| {r.cfg.model} | {r.cfg.label} | {b.name} | {b.num_groups} | {len(b.leaves)} "
                f"| {b.layout.shard_size:,} | {b.num_groups * b.layout.total_size:,} "
                f"| {pct(b.layout.padding_fraction)} |"
            )
    return "\n".join(lines)


def reading(results: Sequence[Result]) -> str:
    """A paragraph about the results, computed from them."""
    out = []
    grouped = [r for r in results if r.cfg.group_size > 1]
    worst = max(grouped, key=lambda r: r.split_padding)
    out.append(
        f"Over the {len(grouped)} TP/EP rows the TP/EP-split leaves pad at most {pct(worst.split_padding)} "
        f"({worst.cfg.model} {worst.cfg.label} {worst.gran} split={worst.split}); the whole model at most "
        f"{pct(max(r.padding for r in results))} over all {len(results)} rows."
    )
    twice = [r for r in results if r.fsdp2_split_padding >= 0.45]
    if twice:
        out.append(
            "FSDP2's even dim-0 split pads the TP/EP-split leaves to about twice their size where the dim-0 count "
            "is smaller than the fsdp size: "
            + ", ".join(sorted({f"{r.cfg.model} {r.cfg.label} ({pct(r.fsdp2_split_padding)})" for r in twice}))
            + f"; the ragged layout pads the same leaves at most {pct(max(r.split_padding for r in twice))} there."
        )
    if all(r.plan_matches for r in results):
        out.append("vj.plan on a real mesh built exactly the integer grouping's buckets in every row.")
    elif any(r.plan_matches is None for r in results):
        out.append("Some rows were not checked against vj.plan (not enough devices in this process).")
    slow = max(results, key=lambda r: r.seconds)
    out.append(
        f"The slowest whole-model plan_bucket pass takes {1e3 * slow.seconds:.1f} ms ({slow.cfg.model} "
        f"{slow.cfg.label} {slow.gran} split={slow.split}), against a limit of {1e3 * TIME_LIMIT_S:.0f} ms."
    )
    return " ".join(out)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report(results: Sequence[Result], command: str, *, time_gate: bool = True) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            "# TP / EP planner benchmark: padding of FSDP x expert / tensor parallelism",
            "",
            f"- date: {now}",
            f"- python {platform.python_version()}, jax {jax.__version__}, numpy {np.__version__}",
            f"- CPU: {cpu_name()} ({os.cpu_count()} cores); vj.plan over {jax.device_count()} simulated "
            f"{jax.devices()[0].platform.upper()} devices",
            f"- command: `{command}`",
            f"- bf16 parameters, align = {ALIGN} elements; plan_bucket time = best of {REPEATS} cold-cache runs; "
            "vj.plan time = one cold run",
            "",
            "Padding: (buffer elements - parameter elements) / buffer elements. *TP/EP leaves*: the leaves split "
            "over `expert` (GPT-OSS experts) or `tensor` (Llama's Megatron-split matrices, embedding and head), "
            "planned by themselves (in FSDP-only rows: the same leaves at their logical shapes); `2.00x`: the "
            "buffer is twice the parameters. *S/device*: elements every device owns (sum of S over buckets; "
            "every device owns exactly S of each bucket, so this is also the maximum). *ideal*: local elements / "
            "fsdp size. Gates: the EP experts pad < "
            f"{pct(EXPERT_LIMIT)} in every row; the TP/EP leaves and the whole model pad < "
            f"{pct(PAD_LIMIT['auto'])} with split=auto and < {pct(PAD_LIMIT['none'])} with split=none; vj.plan "
            f"builds the integer grouping's buckets; plan_bucket < {1e3 * TIME_LIMIT_S:.0f} ms.",
            "",
            "## Summary (split=auto, vj.plan's default)",
            "",
            summary_table(results),
            "",
            "## Every configuration",
            "",
            table(results, time_gate=time_gate),
            "",
            "## Buckets of one layer (element(), split=auto)",
            "",
            layer_table(results),
            "",
            "## Reading the tables",
            "",
            reading(results),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write a markdown report to this path")
    parser.add_argument("--no-time-gate", action="store_true", help="report planning time but do not fail on it")
    parser.add_argument("--no-plan-check", action="store_true", help="skip the vj.plan cross-check")
    args = parser.parse_args(argv)
    time_gate = not args.no_time_gate

    results = run(configs(), check_plan=not args.no_plan_check)
    print(summary_table(results))
    print()
    print(table(results, time_gate=time_gate))
    print()
    print(layer_table(results))
    print()
    print(reading(results))
    if args.out is not None:
        command = shlex.join(["python", *sys.argv])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report(results, command, time_gate=time_gate))
        print(f"\nwrote {args.out}")
    failures = [f for r in results for f in r.failures(time_gate=time_gate)]
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
