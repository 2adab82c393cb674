"""The compiled ``vj.fsdp`` train step under tensor and expert parallelism: memory and collectives per device.

    python benchmarks/tp_step.py                      # 8 simulated CPU devices; writes nothing
    python benchmarks/tp_step.py --out benchmarks/results/tp_step.md

The GPT of ``examples/gpt_tp.py`` (Megatron column/row-parallel attention and MLP; with ``--experts``, a top-k
mixture of experts in every block) is planned on ``fsdp × tensor`` (or ``fsdp × expert``) meshes of all 8
devices and on ``fsdp`` alone, and its AdamW train step is compiled. Every figure is static (read from the
compiled HLO and ``memory_analysis()``):

- **state**: parameters + AdamW moments each device owns (the plan's buffers / their groups / fsdp size);
- **peak**: ``argument + output − alias + temp`` of the compiled step;
- per collective kind, launches per step and result bytes per device, split by the mesh axes its replica
  groups span (read from the groups' device ids);
- the ideal FSDP traffic of the plan: all-gathers ``2·m·S`` per bucket and layer (gathered again in
  backward), reduce-scatters ``S`` per bucket and layer (result bytes).

Gates (exit non-zero when one fails): every all-gather and reduce-scatter spans the fsdp axis alone; nothing but
all-reduces runs over tensor/expert; all-gather bytes at most the plan's ideal (+2 %; small buckets read in
backward are kept, not gathered again) and at least half of it, reduce-scatter bytes within 2 % of it.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from gpt_tp import Config, abstract_model, partition_spec  # noqa: E402

import vescale_jax as vj  # noqa: E402
from vescale_jax import testing  # noqa: E402

MIB = 2**20
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def loss_fn(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), targets).mean()


def _groups(text: str) -> dict[str, list[list[int]]]:
    """Replica groups of every collective instruction of an HLO module, by instruction name."""
    out = {}
    for line in text.splitlines():
        m = re.search(r"%?([\w.\-]+) = [^=]*? (all-gather|reduce-scatter|all-reduce|all-to-all)(?:-start)?\(", line)
        if not m:
            continue
        g = re.search(r"replica_groups=\{(\{[\d,{} ]*\})\}", line)
        if g:
            out[m.group(1)] = [
                [int(x) for x in grp.split(",") if x.strip()] for grp in re.findall(r"\{([^{}]*)\}", g.group(1))
            ]
            continue
        g = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
        if g:
            shape = [int(x) for x in g.group(1).split(",")]
            dims = [int(x) for x in g.group(2).split(",")]
            ids = np.arange(int(np.prod(dims))).reshape(dims)
            if g.group(3):
                ids = ids.transpose([int(x) for x in g.group(3).split(",")])
            out[m.group(1)] = ids.reshape(shape).tolist()
    return out


def span(group: list[int], mesh: jax.sharding.Mesh) -> tuple[str, ...]:
    """The mesh axes along which the devices of one replica group differ (ids are positions in the mesh)."""
    coords = np.array([np.unravel_index(i, mesh.devices.shape) for i in group])
    return tuple(a for d, a in enumerate(mesh.axis_names) if len(set(coords[:, d])) > 1)


def measure(cfg: Config, mesh: jax.sharding.Mesh, batch: int, seq: int) -> dict:
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, mesh, stacked=("blocks",), tp=partition_spec(cfg))
    tx = optax.adamw(1e-3)
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), shapes)
    sp = vj.shard(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), params), plan)
    opt_state = vj.init_opt_state(tx, sp)

    @vj.fsdp(plan=plan)
    def step(p, opt_state, b):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, b["x"]), b["y"]))(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    tokens = np.zeros((batch, seq), np.int32)
    compiled = step.lower(sp, opt_state, {"x": tokens, "y": tokens}).compile()
    text = compiled.as_text()
    census, groups = testing.census(compiled), _groups(text)
    by: dict[tuple[str, tuple[str, ...]], list[int]] = {}
    for op in census.ops:
        axes = span(groups[op.name][0], mesh) if op.name in groups else tuple(mesh.axis_names)
        entry = by.setdefault((op.kind, axes), [0, 0])
        entry[0] += op.multiplier
        entry[1] += op.total_bytes
    m = plan.num_devices
    state = sum(b.nbytes / b.num_groups / m for b in plan.buckets) * 3  # params, mu, nu
    per_layer = lambda b: (b.layers or 1) * np.dtype(b.dtype).itemsize * b.layout.shard_size
    ideal_ag = sum(2 * m * per_layer(b) for b in plan.buckets if b.layout.total_size)
    ideal_rs = sum(per_layer(b) for b in plan.buckets if b.layout.total_size)
    return {
        "mesh": dict(mesh.shape),
        "state": state,
        "peak": testing.memory(compiled).peak,
        "ops": by,
        "ideal_ag": ideal_ag,
        "ideal_rs": ideal_rs,
        "split_share": sum(b.nbytes for b in plan.buckets if b.groups) / sum(b.nbytes for b in plan.buckets),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", help="write the results as markdown here")
    args = p.parse_args(argv)
    n = len(jax.devices())
    base = dict(vocab=256, max_len=args.seq, d_model=args.d_model, num_heads=args.heads, num_layers=args.layers)
    runs = [
        ("dense, FSDP only", Config(**base, d_ff=args.d_ff), (n, 1), "tensor"),
        ("dense, fsdp × tensor", Config(**base, d_ff=args.d_ff, tensor="tensor"), (n // 2, 2), "tensor"),
        ("dense, fsdp × tensor", Config(**base, d_ff=args.d_ff, tensor="tensor"), (n // 4, 4), "tensor"),
        ("MoE, FSDP only", Config(**base, d_ff=args.d_ff // 4, num_experts=args.experts), (n, 1), "expert"),
        (
            "MoE, fsdp × expert",
            Config(**base, d_ff=args.d_ff // 4, num_experts=args.experts, expert="expert"),
            (n // 4, 4),
            "expert",
        ),
    ]
    rows, failures = [], []
    for name, cfg, shape, axis in runs:
        mesh = jax.make_mesh(shape, ("fsdp", axis))
        r = measure(cfg, mesh, args.batch, args.seq)
        rows.append((name, r))
        for (kind, axes), (count, _) in r["ops"].items():
            if kind in ("all-gather", "reduce-scatter") and axes != ("fsdp",):
                failures.append(f"{name} {shape}: {count} {kind} over {axes}")
            if axis in axes and kind != "all-reduce":
                failures.append(f"{name} {shape}: {count} {kind} over {axes}")
        ag = sum(b for (k, _), (_, b) in r["ops"].items() if k == "all-gather")
        rs = sum(b for (k, _), (_, b) in r["ops"].items() if k == "reduce-scatter")
        # Small buckets a layer reads in backward are kept rather than gathered again: at most the ideal, at
        # least the one-gather-per-bucket floor.
        for what, got, want, floor in (
            ("all-gather", ag, r["ideal_ag"], r["ideal_ag"] / 2),
            ("reduce-scatter", rs, r["ideal_rs"], r["ideal_rs"] * 0.98),
        ):
            if not floor <= got <= 1.02 * want:
                failures.append(f"{name} {shape}: {what} bytes {got} outside [{floor:.0f}, 1.02 x {want}]")

    fsdp_only = {name.split(",")[0]: r for name, r in rows if "only" in name}
    lines = [
        f"# `vj.fsdp` under tensor / expert parallelism ({n} simulated CPU devices)",
        "",
        f"jax {jax.__version__}, {platform.processor() or platform.machine()}, {platform.python_version()}. "
        f"`python benchmarks/tp_step.py` (d_model {args.d_model}, {args.heads} heads, {args.layers} layers, "
        f"d_ff {args.d_ff} (MoE: {args.experts} experts of d_ff {args.d_ff // 4}), batch {args.batch} × {args.seq}, "
        "AdamW fp32). Bytes are per device; collectives are launches per step and result MiB, by the mesh axes "
        "their replica groups span.",
        "",
        "| model, mesh | state MiB (vs FSDP only) | peak MiB | all-gather over fsdp | reduce-scatter over fsdp | "
        "all-reduce (axes: launches / MiB) | AG, RS ÷ plan ideal |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        base_r = fsdp_only[name.split(",")[0]]
        ops = r["ops"]
        ag = ops.get(("all-gather", ("fsdp",)), [0, 0])
        rs = ops.get(("reduce-scatter", ("fsdp",)), [0, 0])
        ar = "; ".join(
            f"{'+'.join(axes) or '-'}: {c} / {b / MIB:.3f}"
            for (k, axes), (c, b) in sorted(ops.items())
            if k == "all-reduce"
        )
        mesh = " × ".join(f"{a} {s}" for a, s in r["mesh"].items() if s > 1 or a == "fsdp")
        lines.append(
            f"| {name.split(',')[0]}, {mesh} | {r['state'] / MIB:.2f} ({r['state'] / base_r['state']:.3f}×) | "
            f"{r['peak'] / MIB:.1f} | {ag[0]} / {ag[1] / MIB:.2f} | {rs[0]} / {rs[1] / MIB:.2f} | {ar} | "
            f"{ag[1] / r['ideal_ag']:.4f}, {rs[1] / r['ideal_rs']:.4f} |"
        )
    lines += ["", "Gates: " + ("all pass." if not failures else "FAILED: " + "; ".join(failures))]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
