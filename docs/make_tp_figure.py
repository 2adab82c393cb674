"""Draws ``docs/figures/tp_bucket_layout.png``: one layer's buckets of a Megatron-style GPT on an fsdp × tensor mesh.

The GPT of ``examples/gpt_tp.py`` (``CONFIG`` below: column-parallel ``q``/``k``/``v``/``up``, row-parallel
``proj``/``down``) is planned with ``vj.plan(shapes, mesh, stacked=("blocks",), tp=partition_spec(cfg))`` on a
2 × 4 ``("fsdp", "tensor")`` mesh of 8 simulated CPU devices. The stacked ``blocks`` unit gets two buckets, drawn
per layer with one bar per device (device ``k`` on ``fsdp`` holds ``[k*S, (k+1)*S)`` of its group's buffer):

* the grouped bucket ``blocks@tensor:float32``: the leaves split over ``tensor``, one layout on their TP-local
  shapes shared by the 4 groups; each tensor rank's 2 bars hold that rank's column (``q``/``k``/``v``/``up``) or
  row (``proj``/``down``) block of every leaf, white ticks marking the local block's rows;
* the replicated bucket ``blocks:float32`` (the norms, the ``proj``/``down`` biases): 2 bars, the same on every
  tensor rank.

Run from the repository root (it simulates 8 CPU devices)::

    python docs/make_tp_figure.py

It prints ``plan.summary()``, every leaf's :class:`vescale_jax.RaggedShard` and each tensor rank's blocks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import gpt_tp
from make_figures import DPI, FIGURES, WIDTH_IN, draw_layout, save

import vescale_jax as vj

# Local widths 20/4 = 5 (q, k, v, proj) and 36/4 = 9 (up, down): odd, so no fsdp size but 1 divides them.
CONFIG = gpt_tp.Config(d_model=20, num_heads=4, d_ff=36, tensor="tensor")
MESH = ((2, 4), ("fsdp", "tensor"))
UNIT = "blocks"
PALETTE = plt.get_cmap("tab20").colors
PITCH = 1.5  # distance between two bars of one tensor rank (room for the labels of narrow spans)
GAP = 1.0  # extra space between two tensor ranks' bars


def make_plan() -> vj.Plan:
    """Plans the whole model of ``CONFIG`` (shapes only) on the fsdp × tensor mesh, ``blocks`` stacked."""
    _, shapes = gpt_tp.abstract_model(CONFIG)
    shape, names = MESH
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])
    return vj.plan(shapes, mesh, stacked=(UNIT,), tp=gpt_tp.partition_spec(CONFIG))


def unit_buckets(plan: vj.Plan) -> tuple[vj.Bucket, vj.Bucket]:
    """``(replicated, grouped)``: the unit's bucket without group axes and the one split over ``tensor``."""
    (rep,) = (b for b in plan.buckets if b.unit == UNIT and not b.groups)
    (grouped,) = (b for b in plan.buckets if b.unit == UNIT and b.groups)
    return rep, grouped


def specs(plan: vj.Plan, bucket: vj.Bucket) -> list[vj.LeafSpec]:
    """The bucket's leaves in layout slot order."""
    return [plan.leaves[i] for i in bucket.leaves]


def short(spec: vj.LeafSpec) -> str:
    """``"q/kernel"`` for ``"blocks/q/kernel"``."""
    return spec.path.split("/", 1)[1]


def group_coords(plan: vj.Plan, bucket: vj.Bucket, g: int) -> dict[str, int]:
    """Group ``g``'s coordinate on each of the bucket's group axes (row-major over ``bucket.groups``)."""
    sizes = [plan.mesh.shape[a] for a in bucket.groups]
    return {a: int(i) for a, i in zip(bucket.groups, np.unravel_index(g, sizes), strict=True)}


def block_index(plan: vj.Plan, spec: vj.LeafSpec, coords: dict[str, int] | None) -> str:
    """The slice of the (per-layer) leaf a group holds: ``"[:, 5t:5t+5]"`` symbolically (``coords=None``, each
    axis by its initial), or ``"[:, 5:10]"`` for the group at ``coords``."""
    dims = spec.tp[1:] if plan.buckets[spec.bucket].layers else spec.tp
    parts = []
    for axes, n in zip(dims, plan.layer_shape(spec), strict=True):
        if not axes:
            parts.append(":")
            continue
        if coords is None:
            sym = axes[0][0]
            for a in axes[1:]:
                sym = f"({sym}·{plan.mesh.shape[a]}+{a[0]})"
            parts.append(f"{n}{sym}:{n}{sym}+{n}")
        else:
            index = 0
            for a in axes:
                index = index * plan.mesh.shape[a] + coords[a]
            parts.append(f"{index * n}:{(index + 1) * n}")
    return f"[{', '.join(parts)}]"


def row_ticks(plan: vj.Plan, bucket: vj.Bucket) -> list[int]:
    """Per slot, the length of one row of the leaf's local block (a 1-D leaf: its size, i.e. no tick)."""
    return [
        plan.layer_shape(s)[-1] if len(plan.layer_shape(s)) > 1 else bucket.layout.sizes[s.slot]
        for s in specs(plan, bucket)
    ]


def describe(plan: vj.Plan) -> str:
    """``plan.summary()``, every leaf's offset and RaggedShard, and each group's blocks of the grouped bucket."""
    lines = [f"# vj.plan(shapes, mesh {dict(plan.mesh.shape)}, stacked={(UNIT,)}, tp=partition_spec({CONFIG}))"]
    lines += [plan.summary(), ""]
    lines.append(f"{'leaf':<20} {'shape':<13} {'tp':<28} {'local':<12} {'bucket':<22} {'offset':>6}  RaggedShard")
    for spec in plan.leaves:
        bucket = plan.buckets[spec.bucket]
        tp = str(spec.tp) if spec.tp else "-"
        lines.append(
            f"{spec.path:<20} {spec.shape!s:<13} {tp:<28} {spec.local_shape!s:<12} {bucket.name:<22} "
            f"{bucket.layout.offsets[spec.slot]:>6}  {plan.shard_of(spec.path)!r}"
        )
    rep, grouped = unit_buckets(plan)
    lines.append("")
    lines.append(
        f"{grouped.name}: groups {grouped.groups}, G = {grouped.num_groups}, S = {grouped.layout.shard_size}, "
        f"buffer {grouped.shape} with {plan.partition_spec(grouped)}, loads per fsdp device "
        f"{list(grouped.layout.device_loads())}, padding {grouped.layout.padding} elements "
        f"({grouped.layout.padding_fraction:.2%}) per group and layer"
    )
    for spec in specs(plan, grouped):
        ranks = ", ".join(
            f"{g}: {block_index(plan, spec, group_coords(plan, grouped, g))}" for g in range(grouped.num_groups)
        )
        lines.append(f"  {short(spec):<12} {block_index(plan, spec, None):<18} group {ranks}")
    lines.append(
        f"{rep.name}: S = {rep.layout.shard_size}, buffer {rep.shape} with {plan.partition_spec(rep)}: "
        f"the same on every {'/'.join(grouped.groups)} rank"
    )
    return "\n".join(lines)


def finish_axis(ax: Axes, bucket: vj.Bucket, rows: list[float], labels: list[str], title: str) -> None:
    s = bucket.layout.shard_size
    ax.set_xlim(0, s)
    ax.set_ylim(max(rows) + 0.5, min(rows) - 1.0)
    ax.set_yticks(rows, labels, fontsize=8)
    ax.set_xlabel(f"local offset in each device's shard (elements, 0 .. S = {s:,})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=10.5, loc="left")


def draw_replicated(ax: Axes, plan: vj.Plan, bucket: vj.Bucket, colors: dict[str, str], bar_px: float) -> None:
    layout, m = bucket.layout, bucket.layout.num_devices
    names = [short(s) for s in specs(plan, bucket)]
    rows = list(range(m))
    draw_layout(ax, layout, names, [colors[n] for n in names], bar_px=bar_px, ticks=row_ticks(plan, bucket))
    s = layout.shard_size
    labels = [f"fsdp {k}, every tensor rank\n[{k * s:,}, {(k + 1) * s:,})" for k in range(m)]
    finish_axis(
        ax,
        bucket,
        rows,
        labels,
        f"{bucket.name}: replicated over tensor, the same {m} bars on every tensor rank; S = {s:,}, "
        f"m·S = {layout.total_size:,}, data = {sum(layout.sizes):,}, padding {layout.padding_fraction:.2%}",
    )
    ax.legend(
        handles=[
            Patch(facecolor=colors[short(sp)], edgecolor="black", label=f"{short(sp)} {sp.shape[1:]}")
            for sp in specs(plan, bucket)
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.42),
        ncol=len(names),
        fontsize=8.5,
        frameon=False,
    )


def draw_grouped(ax: Axes, plan: vj.Plan, bucket: vj.Bucket, colors: dict[str, str], bar_px: float) -> None:
    layout, m, big = bucket.layout, bucket.layout.num_devices, bucket.num_groups
    s = layout.shard_size
    leaves = specs(plan, bucket)
    rows, labels = [], []
    for g in range(big):
        coords = group_coords(plan, bucket, g)
        ys = [g * (m * PITCH + GAP) + k * PITCH for k in range(m)]
        if g % 2:
            ax.axhspan(ys[0] - PITCH / 2 - GAP / 2, ys[-1] + PITCH / 2 + GAP / 2, color="#f2f2f2", zorder=0)
        names = [f"{short(sp)}{block_index(plan, sp, coords)}" for sp in leaves]
        draw_layout(
            ax,
            layout,
            names,
            [colors[short(sp)] for sp in leaves],
            bar_px=bar_px,
            ticks=row_ticks(plan, bucket),
            rows=ys,
        )
        where = ", ".join(f"{a} {i}" for a, i in coords.items())
        base = g * layout.total_size
        rows += ys
        labels += [f"{where}, fsdp {k}\n[{base + k * s:,}, {base + (k + 1) * s:,})" for k in range(m)]
    groups = " × ".join(bucket.groups)
    finish_axis(
        ax,
        bucket,
        rows,
        labels,
        f"{bucket.name}: G = {big} groups ({groups}) × m = {m}, one layout on the local shapes; S = {s:,}, "
        f"G·m·S = {big * layout.total_size:,}, data = {sum(layout.sizes):,} per group, "
        f"padding {layout.padding_fraction:.2%}",
    )
    ranks = ", ".join(f"{a} rank {a[0]}" for a in bucket.groups)
    handles = [
        Patch(
            facecolor=colors[short(sp)],
            edgecolor="black",
            label=f"{short(sp)} {sp.shape[1:]}: {ranks} holds {block_index(plan, sp, None)}, "
            f"local {plan.layer_shape(sp)}",
        )
        for sp in leaves
    ]
    handles.append(Patch(facecolor="#d9d9d9", edgecolor="#7f7f7f", hatch="////", label="padding"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=3, fontsize=8.5, frameon=False)


def figure(plan: vj.Plan, path: Path) -> None:
    rep, grouped = unit_buckets(plan)
    names = [short(s) for b in (grouped, rep) for s in specs(plan, b)]
    colors = {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}
    m, big = grouped.layout.num_devices, grouped.num_groups
    heights = [m + 2.6, big * (m * PITCH + GAP) + 3.4]
    fig, (top, bottom) = plt.subplots(
        2, 1, figsize=(WIDTH_IN, 0.36 * sum(heights) + 1.2), gridspec_kw={"height_ratios": heights}
    )
    bar_px = 0.8 * WIDTH_IN * DPI
    draw_replicated(top, plan, rep, colors, bar_px)
    draw_grouped(bottom, plan, grouped, colors, bar_px)
    shape = " × ".join(f"{n} {a}" for a, n in plan.mesh.shape.items())
    fig.suptitle(
        f"One layer of the stacked '{UNIT}' unit of gpt_tp.Config(d_model={CONFIG.d_model}, "
        f"num_heads={CONFIG.num_heads}, d_ff={CONFIG.d_ff}), float32, planned by vj.plan on a {shape} mesh\n"
        "one bar per device, holding its S elements; white ticks: the rows of each leaf's local block",
        fontsize=12,
        x=0.01,
        ha="left",
    )
    save(fig, path, rect=(0, 0, 0.97, 0.955), left=0.12)


def main() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    plan = make_plan()
    print(describe(plan), end="\n\n")
    figure(plan, FIGURES / "tp_bucket_layout.png")


if __name__ == "__main__":
    main()
