"""Block-wise quantized training on the layout: padding of tile-major blocks, FP8 gather wire bytes, 8-bit
AdamW state bytes and the census of its update.

    python benchmarks/quant.py                       # 8 simulated CPU devices; writes nothing
    python benchmarks/quant.py --out benchmarks/results/quant.md

Four tables, all static (shapes, the plans' layouts and the compiled / lowered HLO), so the same on every run:

1. **Padding**: every bucket of Llama-3-70B, DeepSeek-V3 and GPT-OSS-120B (``benchmarks/model_configs.py``)
   planned with ``vj.rows(128)`` (128 full rows per block) and ``vj.tiles(128, 128)`` (one tile per block,
   stored tile-major) at m in {8, 64, 256, 1024}, bf16 alignment (16 bytes). Gate: tiles pads no more than
   rows everywhere and at most 3 % at m <= 256.
2. **FP8 gather**: a GPT (``examples/gpt.py``; d_model 512, 4 layers, vocab 256) planned with
   ``vj.tiles(128, 128)``; all-gather bytes per step of the ``vj.fsdp`` train step lowered with
   ``MixedPrecision(compute_dtype=bf16, fp8_gather=(128, 128))`` against the bf16 gather. The lowered HLO is
   read for both (XLA:CPU compiles bf16 collectives in f32; the FP8 wire is uint8 either way). Gate: <= 0.52x.
3. **8-bit AdamW state**: bytes per device of ``vj.optim.adamw_8bit``'s state against ``vj.optim.adamw``'s
   (fp32 moments) on the same plan. Gate: <= 0.27x.
4. **Census of the 8-bit update**: collectives in the compiled ``tx.update`` (gate: none).

Exits non-zero when a gate fails.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import optax

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
from gpt import GPTConfig, abstract_model, init_params, loss_fn  # noqa: E402
from model_configs import buckets  # noqa: E402

import vescale_jax as vj  # noqa: E402
from vescale_jax import testing  # noqa: E402

MODELS = ("llama3-70b", "deepseek-v3", "gpt-oss-120b")
DEVICE_COUNTS = (8, 64, 256, 1024)
ALIGN = 8  # 16 bytes of bf16
PAD_LIMIT = 0.03
WIRE_LIMIT = 0.52
STATE_LIMIT = 0.27


def padding(model: str, m: int, gran: vj.Granularity) -> tuple[float, float]:
    """Whole-model padding fraction and planning seconds of ``model`` at ``m`` with ``gran`` for every leaf."""
    total = used = 0
    t = time.perf_counter()
    for _, params in buckets(model):
        sizes = [math.prod(s) for _, s in params]
        layout = vj.plan_bucket(
            sizes,
            [gran.block(s) for _, s in params],
            m,
            align=ALIGN,
            segments=[gran.segments(s) for _, s in params],
        )
        total += layout.total_size
        used += sum(sizes)
    return (total - used) / total, time.perf_counter() - t


def padding_table() -> tuple[list[str], list[str]]:
    lines = [
        "| model | m | rows(128) | tiles(128, 128) | plan time rows / tiles (s) |",
        "|---|---|---|---|---|",
    ]
    failures = []
    for model in MODELS:
        for m in DEVICE_COUNTS:
            rows, t_rows = padding(model, m, vj.rows(128))
            tiles, t_tiles = padding(model, m, vj.tiles(128, 128))
            lines.append(f"| {model} | {m} | {rows:.3%} | {tiles:.3%} | {t_rows:.2f} / {t_tiles:.2f} |")
            if tiles > rows + 1e-12:
                failures.append(f"{model} m={m}: tiles pads {tiles:.3%} > rows {rows:.3%}")
            if m <= 256 and tiles > PAD_LIMIT:
                failures.append(f"{model} m={m}: tiles pads {tiles:.3%} > {PAD_LIMIT:.0%}")
    return lines, failures


CFG = GPTConfig(vocab=256, max_len=128, d_model=512, num_heads=8, num_layers=4, d_ff=2048)
TILE = (128, 128)


def gpt_plan(mesh):
    graphdef, shapes = abstract_model(CFG)
    gran = lambda path, leaf: vj.tiles(*TILE) if leaf.ndim >= 2 else vj.element()
    return graphdef, shapes, vj.plan(shapes, mesh, stacked=("blocks",), granularity=gran)


def lowered_step(plan, graphdef, tx, precision):
    @vj.fsdp(plan=plan, precision=precision)
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"]))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch = {"x": np.zeros((16, CFG.max_len), np.int32), "y": np.zeros((16, CFG.max_len), np.int32)}
    sp = vj.init_sharded(lambda k: init_params(CFG, k), plan, jax.random.key(0))
    return step.lower(sp, vj.init_opt_state(tx, sp), batch)


def wire_table(mesh) -> tuple[list[str], list[str]]:
    graphdef, _, plan = gpt_plan(mesh)
    tx = optax.adamw(1e-3)
    rows = []
    for name, precision in (
        ("bf16 gather", vj.MixedPrecision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)),
        ("FP8 gather", vj.MixedPrecision(compute_dtype=jnp.bfloat16, reduce_dtype=jnp.float32, fp8_gather=TILE)),
    ):
        cen = testing.census(lowered_step(plan, graphdef, tx, precision).as_text(dialect="hlo"))
        dtypes = sorted({op.shape.split("[")[0] for op in cen.of("all-gather")})
        rows.append((name, cen.count("all-gather"), cen.bytes("all-gather"), cen.bytes("reduce-scatter"), dtypes))
    ratio = rows[1][2] / rows[0][2]
    lines = [
        f"GPT d_model {CFG.d_model}, {CFG.num_layers} layers, vocab {CFG.vocab}, "
        f"{sum(s.size for s in plan.leaves) / 1e6:.2f} M parameters, planned with vj.tiles{TILE} on "
        f"{plan.num_devices} devices (padding {plan.padding_fraction:.2%}).",
        "",
        "| gather | all-gathers per step | all-gather result bytes per step | reduce-scatter bytes | wire dtype |",
        "|---|---|---|---|---|",
    ]
    for name, count, ag, rs, dtypes in rows:
        lines.append(f"| {name} | {count} | {ag:,} | {rs:,} | {', '.join(dtypes)} |")
    lines += ["", f"FP8 / bf16 all-gather bytes: **{ratio:.4f}** (gate <= {WIRE_LIMIT})."]
    return lines, ([] if ratio <= WIRE_LIMIT else [f"FP8 gather sends {ratio:.4f}x the bf16 bytes"])


def state_bytes(state) -> int:
    """Bytes per device of an optimizer state: each array's bytes over its sharding's device count."""
    total = 0
    for x in jax.tree.leaves(state):
        if not isinstance(x, jax.Array):
            continue
        shard = x.sharding.shard_shape(x.shape)
        total += math.prod(shard) * x.dtype.itemsize
    return total


def state_table(mesh) -> tuple[list[str], list[str]]:
    if not hasattr(vj.optim, "adamw_8bit"):
        return ["vj.optim.adamw_8bit is not available."], ["no adamw_8bit"]
    _, shapes = abstract_model(CFG)
    plan8 = vj.plan(
        shapes,
        mesh,
        stacked=("blocks",),
        granularity=lambda path, leaf: vj.tiles(32, 32) if leaf.ndim >= 2 else vj.element(),
    )
    sp = vj.init_sharded(lambda k: init_params(CFG, k), plan8, jax.random.key(0))
    fp32 = vj.optim.adamw(1e-3, plan=plan8)
    q8 = vj.optim.adamw_8bit(1e-3, plan=plan8, block=(32, 32))
    s32, s8 = vj.init_opt_state(fp32, sp), vj.init_opt_state(q8, sp)
    b32, b8 = state_bytes(s32), state_bytes(s8)
    ratio = b8 / b32
    update = jax.jit(q8.update).lower(sp, s8, sp).compile()
    cen = testing.census(update)
    kinds = {k: cen.count(k) for k in testing.KINDS if cen.count(k)}
    lines = [
        f"Same GPT, planned with vj.tiles(32, 32) for matrices ({plan8.num_devices} devices, padding "
        f"{plan8.padding_fraction:.2%}).",
        "",
        "| optimizer | state bytes per device |",
        "|---|---|",
        f"| vj.optim.adamw (fp32 moments) | {b32:,} |",
        f"| vj.optim.adamw_8bit (block 32x32) | {b8:,} |",
        "",
        f"8-bit / fp32 state: **{ratio:.4f}** (gate <= {STATE_LIMIT}).",
        "",
        f"Collectives in the compiled adamw_8bit update: {kinds or 'none'} (gate: none).",
    ]
    failures = [] if ratio <= STATE_LIMIT else [f"8-bit state is {ratio:.4f}x fp32"]
    if kinds:
        failures.append(f"the 8-bit update has collectives {kinds}")
    return lines, failures


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="write the tables (markdown) to this path")
    args = p.parse_args(argv)
    mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",))
    header = [
        "# Block-wise quantization: padding, FP8 gather bytes, 8-bit AdamW state",
        "",
        f"`python benchmarks/quant.py` — JAX {jax.__version__}, Python {platform.python_version()}, "
        f"{platform.machine()} {jax.devices()[0].platform} x {len(jax.devices())} "
        "(static figures: shapes, layouts, HLO).",
        "",
    ]
    out, failures = list(header), []
    for title, table in (
        ("## Padding: vj.tiles(128, 128) vs vj.rows(128)", padding_table),
        ("## FP8 block-scaled weight gather", lambda: wire_table(mesh)),
        ("## 8-bit AdamW state", lambda: state_table(mesh)),
    ):
        lines, fails = table()
        out += [title, "", *lines, ""]
        failures += fails
        print("\n".join([title, "", *lines, ""]), flush=True)
    out += ["## Gates", "", *(f"- FAILED: {f}" for f in failures)] if failures else ["## Gates", "", "All gates pass."]
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(out) + "\n")
    for f in failures:
        print(f"FAILED: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
