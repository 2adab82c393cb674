"""Draws the bucket-layout figures of ``docs/planner.md`` from real plans made by ``vescale_jax``.

One small GPT-like block (a layernorm ``(96,)``, ``qkv (96, 288)``, ``proj (96, 96)``, ``mlp_up (96, 384)``,
``mlp_down (384, 96)``, float32, so ``align_bytes=16`` means 4 elements) is planned with :func:`vescale_jax.plan`
on ``jax.ShapeDtypeStruct`` leaves; the figures draw the resulting flat bucket with one horizontal bar per
device (device ``k`` owns ``[k*S, (k+1)*S)``): each tensor a coloured span, its block boundaries as thin
ticks, padding hatched grey.

* ``figures/bucket_layout.png``: ``rows(1)`` granularity on 3 and on 8 devices.
* ``figures/bucket_granularity.png``: the same block on 8 devices with ``element()``, ``rows(1)`` and
  ``whole()`` granularity.

Run from the repository root (it simulates 8 CPU devices)::

    python docs/make_figures.py

It also prints ``plan.summary()`` and every leaf's :class:`vescale_jax.RaggedShard` for each plan it draws.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Patch, Rectangle

import vescale_jax as vj

FIGURES = Path(__file__).resolve().parent / "figures"
D = 96  # model width of the toy block

# Leaf path inside the block -> shape (in forward order; vj.plan sees dict keys sorted, as jax flattens them).
BLOCK = {
    "ln/scale": (D,),
    "attn/qkv": (D, 3 * D),
    "attn/proj": (D, D),
    "mlp/up": (D, 4 * D),
    "mlp/down": (4 * D, D),
}
COLORS = {
    "ln/scale": "#e15759",
    "attn/qkv": "#4e79a7",
    "attn/proj": "#f28e2b",
    "mlp/up": "#59a14f",
    "mlp/down": "#b07aa1",
}
MIN_TICK_PX = 2.5  # block ticks closer than this (in pixels) are left out: the span would turn solid
DPI = 150
WIDTH_IN = 14.0


def block_tree() -> dict[str, dict[str, dict[str, jax.ShapeDtypeStruct]]]:
    """The toy block as a nested, Flax-like tree of ``jax.ShapeDtypeStruct`` under one top-level module."""
    tree: dict[str, dict[str, jax.ShapeDtypeStruct]] = {}
    for path, shape in BLOCK.items():
        module, leaf = path.split("/")
        tree.setdefault(module, {})[leaf] = jax.ShapeDtypeStruct(shape, np.float32)
    return {"block": tree}


@dataclasses.dataclass(frozen=True)
class Drawn:
    """One plan to draw: its bucket and a caption."""

    plan: vj.Plan
    granularity: vj.Granularity

    @property
    def bucket(self) -> vj.Bucket:
        (bucket,) = self.plan.buckets
        return bucket


def make_plan(m: int, granularity: vj.Granularity) -> vj.Plan:
    """Plans the toy block (one bucket, float32) on the first ``m`` devices."""
    params = block_tree()
    mesh = jax.make_mesh((m,), ("fsdp",), devices=jax.devices()[:m])
    return vj.plan(params, mesh, axis="fsdp", granularity=granularity, align_bytes=16)


def describe(drawn: Drawn) -> str:
    """``plan.summary()`` plus each leaf's offset and RaggedShard, as printed text."""
    plan, layout = drawn.plan, drawn.bucket.layout
    lines = [f"# vj.plan(..., granularity=vj.{drawn.granularity!r}) on {plan.num_devices} devices", plan.summary()]
    lines.append(f"{'leaf':<18} {'shape':<10} {'block':>6} {'offset':>7}  local elements per device")
    for spec in plan.leaves:
        rs = plan.shard_of(spec.path)
        lines.append(
            f"{spec.path:<18} {spec.shape!s:<10} {rs.block:>6} {layout.offsets[spec.slot]:>7}  {list(rs.local_sizes)}"
        )
    return "\n".join(lines)


def leaf_name(plan: vj.Plan, slot: int, bucket: vj.Bucket) -> str:
    """``"attn/qkv"`` for the leaf ``"block/attn/qkv"`` in layout slot ``slot``."""
    return plan.leaves[bucket.leaves[slot]].path.split("/", 1)[1]


def segments(start: int, stop: int, s: int) -> list[tuple[int, int, int]]:
    """Splits global range ``[start, stop)`` at device boundaries into ``(device, local_lo, local_hi)``."""
    out = []
    while start < stop:
        k = start // s
        hi = min(stop, (k + 1) * s)
        out.append((k, start - k * s, hi - k * s))
        start = hi
    return out


def draw_layout(
    ax: Axes,
    layout: vj.BucketLayout,
    labels: Sequence[str],
    colors: Sequence[str],
    *,
    bar_px: float,
    ticks: Sequence[int] | None = None,
    rows: Sequence[float] | None = None,
) -> None:
    """Draws one bar per device of a layout: slot ``j`` as a span coloured ``colors[j]`` and named ``labels[j]``,
    thin ticks every ``ticks[j]`` elements inside it (default: its block size), padding hatched grey and each
    device's load at the right. Device ``k``'s bar is centred at height ``rows[k]`` (default ``k``)."""
    s, m = layout.shard_size, layout.num_devices
    ys = np.arange(m, dtype=float) if rows is None else np.asarray(rows, dtype=float)
    ticks = layout.blocks if ticks is None else ticks
    px_per_elem = bar_px / s
    height = 0.7

    used = []
    for slot, (n, b, o) in enumerate(zip(layout.sizes, ticks, layout.offsets, strict=True)):
        name, color = labels[slot], colors[slot]
        used.append((o, o + n))
        parts = segments(o, o + n, s)
        for k, lo, hi in parts:
            y = ys[k] - height / 2
            ax.add_patch(Rectangle((lo, y), hi - lo, height, facecolor=color, edgecolor="black", lw=0.8))
            if (hi - lo) * px_per_elem > 70:
                ax.text(
                    (lo + hi) / 2, ys[k], name, ha="center", va="center", fontsize=9, color="white", fontweight="bold"
                )
        if parts and all((hi - lo) * px_per_elem <= 70 for _, lo, hi in parts):
            # Too narrow to hold its name: label it just above its first piece.
            k, lo, _ = parts[0]
            right = lo > s / 2
            ax.annotate(
                name,
                xy=(lo, ys[k] - height / 2),
                xytext=(-4 if right else 4, 7),
                textcoords="offset points",
                ha="right" if right else "left",
                va="bottom",
                fontsize=8,
                color=color,
                fontweight="bold",
                arrowprops={"arrowstyle": "-", "color": color, "lw": 0.8},
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": color, "lw": 0.6},
                zorder=5,
            )
        # Tick boundaries strictly inside the tensor (the device cuts are among them).
        if b < n and b * px_per_elem >= MIN_TICK_PX:
            at = np.arange(o + b, o + n, b)
            ks, xs = at // s, at % s
            ax.vlines(xs, ys[ks] - height / 2, ys[ks] - height / 2 + height * 0.35, colors="white", lw=0.5, alpha=0.9)

    # Padding: the complement of the tensors inside [0, m*S).
    cursor = 0
    for lo, hi in [*sorted(used), (m * s, m * s)]:
        if lo > cursor:
            for k, a, z in segments(cursor, lo, s):
                ax.add_patch(
                    Rectangle(
                        (a, ys[k] - height / 2),
                        z - a,
                        height,
                        facecolor="#d9d9d9",
                        edgecolor="#7f7f7f",
                        hatch="////",
                        lw=0.6,
                    )
                )
        cursor = max(cursor, hi)

    loads = layout.device_loads()
    for k in range(m):
        ax.text(s * 1.005, ys[k], f"{loads[k]:,}", ha="left", va="center", fontsize=8, color="#404040")
    ax.text(s * 1.005, ys[0] - 0.75, "data", ha="left", va="center", fontsize=8, color="#404040", style="italic")


def draw_bucket(ax: Axes, drawn: Drawn, *, bar_px: float) -> None:
    """Draws one bucket: a bar per device, coloured tensor spans, block ticks and hatched padding."""
    plan, bucket = drawn.plan, drawn.bucket
    layout = bucket.layout
    s, m = layout.shard_size, layout.num_devices
    names = [leaf_name(plan, slot, bucket) for slot in range(len(layout.sizes))]
    draw_layout(ax, layout, names, [COLORS[n] for n in names], bar_px=bar_px)
    ax.set_xlim(0, s)
    ax.set_ylim(m - 0.5, -1.0)
    ax.set_yticks(range(m), [f"device {k}\n[{k * s:,}, {(k + 1) * s:,})" for k in range(m)], fontsize=8)
    ax.set_xlabel(f"local offset in each device's shard (elements, 0 .. S = {s:,})", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(
        f"{drawn.granularity!r} granularity, m = {m}: S = {s:,} elements, m·S = {m * s:,}, "
        f"data = {sum(layout.sizes):,}, padding {layout.padding_fraction:.2%}",
        fontsize=11,
        loc="left",
    )


def legend_handles(granularity: vj.Granularity | None) -> list[Patch]:
    handles = []
    for name, shape in BLOCK.items():
        text = f"{name} {shape}"
        if granularity is not None:
            text += f", block {granularity.block(shape)}"
        handles.append(Patch(facecolor=COLORS[name], edgecolor="black", label=text))
    handles.append(Patch(facecolor="#d9d9d9", edgecolor="#7f7f7f", hatch="////", label="padding"))
    return handles


def save(fig: plt.Figure, path: Path, *, rect: tuple[float, float, float, float], left: float) -> None:
    """Lays the figure out inside ``rect`` (figure fractions) with its panels from ``left``, writes and closes it."""
    fig.tight_layout(rect=rect)
    fig.subplots_adjust(left=left, right=0.95)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    print(f"wrote {path}")


def figure(drawns: list[Drawn], path: Path, suptitle: str, granularity: vj.Granularity | None) -> None:
    """Stacks one panel per plan and writes a PNG."""
    heights = [d.bucket.layout.num_devices + 2.2 for d in drawns]
    fig, axes = plt.subplots(
        len(drawns),
        1,
        figsize=(WIDTH_IN, 0.36 * sum(heights) + 1.6),
        gridspec_kw={"height_ratios": heights},
        squeeze=False,
    )
    bar_px = 0.8 * WIDTH_IN * DPI
    for ax, drawn in zip(axes[:, 0], drawns, strict=True):
        draw_bucket(ax, drawn, bar_px=bar_px)
    fig.suptitle(suptitle, fontsize=12, x=0.01, ha="left")
    fig.legend(handles=legend_handles(granularity), loc="lower center", ncol=6, fontsize=9, frameon=False)
    save(fig, path, rect=(0, 0.05, 0.97, 0.97), left=0.095)


def main() -> None:
    FIGURES.mkdir(parents=True, exist_ok=True)
    title = "One bucket of a toy GPT block (float32, align 4) planned by vj.plan: one bar per device"

    rows = [Drawn(make_plan(m, vj.rows(1)), vj.rows(1)) for m in (3, 8)]
    for drawn in rows:
        print(describe(drawn), end="\n\n")
    figure(rows, FIGURES / "bucket_layout.png", title, vj.rows(1))

    grans = [vj.element(), vj.rows(1), vj.whole()]
    contrast = [Drawn(make_plan(8, g), g) for g in grans]
    for drawn in contrast:
        if drawn.granularity != vj.rows(1):
            print(describe(drawn), end="\n\n")
    figure(contrast, FIGURES / "bucket_granularity.png", title + " (block sizes depend on the granularity)", None)


if __name__ == "__main__":
    main()
