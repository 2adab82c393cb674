"""One GPU-sized GPT train step under ``vj.fsdp`` beside the same model under plain ``jax.jit``.

The model is the example GPT (``examples/gpt.py``: pre-norm blocks stacked and scanned, untied head) written
the way one is for an H200 (``--config gpu``, about 0.94 B parameters): d_model 2048, 16 layers, 16 heads of
128, d_ff 8192, vocabulary 32768, sequence 2048; attention by ``jax.nn.dot_product_attention`` (cuDNN's fused
kernel on the GPU), each layer rematerialised in the backward pass (``nnx.remat``), bf16 compute over fp32 master
weights, AdamW, a batch of 16 × 2048 tokens. One variant per process (the device's ``peak_bytes_in_use`` only
grows, so each variant gets its own), one JSON line appended per run:

- ``jit``: plain ``jax.jit`` on one device, parameters cast to bf16 inside the loss (their gradients flow
  back to fp32), AdamW, donated state;
- ``fsdp``: ``vj.fsdp`` with ``vj.MixedPrecision(compute_dtype=bf16, reduce_dtype=fp32)``, plan ``rows(1)``;
- ``fsdp_fp8``: the same with ``fp8_gather=(128, 128)`` (plan ``tiles(128, 128)``);
- ``fsdp_adam8bit``: the same with ``vj.optim.adamw_8bit`` (plan ``tiles(32, 32)``).

Figures: median step time over ``--steps`` timed steps after two warm-up steps (``block_until_ready`` on
each, random tokens), tokens/s, model FLOPs utilisation against ``--peak-tflops`` (H200 bf16 dense: 989),
``peak_bytes_in_use`` of the device, and the first call's wall time (compile + one step; compile ≈ it minus
the median step). Model FLOPs per step, the formula written into every record (:data:`FLOPS_FORMULA`):
``6·N·tokens + 6·L·d·T·tokens``: N = the parameters of the matrix multiplies (blocks and head; the embedding and
position tables are lookups), L layers, d model width, T sequence length. The second term is the attention
scores and their product with V (forward ``4·T·d`` per token and layer, backward twice that) over the causal
half of the T × T square, as MaxText's ``calculate_tflops_training_per_device`` counts causal attention (PaLM's
appendix B counts the whole square: ``12·L·d·T``; each record also holds that MFU, ``mfu_full_attention``).

  python benchmarks/gpu_step.py --variant fsdp --jsonl OUT/steps.jsonl [--label lhs] [--dry-run]
  python benchmarks/gpu_step.py --report OUT/steps.jsonl --md benchmarks/results/gpu.md

``--dry-run``: a tiny model, 3 timed steps, on whatever devices JAX has (set
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` for simulated CPU devices); its figures mean nothing
and its report is titled as a dry run (and refused for ``benchmarks/results/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("jit", "fsdp", "fsdp_fp8", "fsdp_adam8bit")
H200_BF16_PEAK_TFLOPS = 989.0
FLOPS_FORMULA = "6·N·tokens + 6·L·d·T·tokens (N: matmul parameters, blocks + head; causal attention: half the T×T)"
GOALS = {"jit_mfu": 0.35, "fsdp_tokens_vs_jit": 0.97, "fsdp_peak_vs_jit": 1.05}
"""What the report checks: plain jit's MFU, and vj.fsdp's tokens/s and peak memory against jit's (same flags)."""


def config(name: str):
    """The model of ``--config``: ``gpu`` (about 350 M parameters) or ``tiny`` (the dry run)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPTConfig

    h200 = dict(remat=True, attention="dot_product")
    if name == "gpu":
        return GPTConfig(vocab=32768, max_len=2048, d_model=2048, num_heads=16, num_layers=16, d_ff=8192, **h200)
    if name == "tiny":
        return GPTConfig(vocab=256, max_len=64, d_model=64, num_heads=2, num_layers=2, d_ff=256, **h200)
    raise ValueError(f"--config {name!r}; use 'gpu' or 'tiny'.")


def model_flops(cfg, *, n_matmul: int, tokens: int, seq: int, causal: bool = True) -> float:
    """Model FLOPs of one train step (forward + backward): ``6·N·tokens + 6·L·d·T·tokens`` for causal attention
    (``12·L·d·T·tokens`` with ``causal=False``: the whole T × T square).

    Args:
      cfg: the GPT config (layers and width).
      n_matmul: parameters of the matrix multiplies.
      tokens: tokens per step (batch × sequence).
      seq: sequence length T.
      causal: count the causal half of the attention scores.

    Returns:
      FLOPs per step.
    """
    attention = (6.0 if causal else 12.0) * cfg.num_layers * cfg.d_model * seq * tokens
    return 6.0 * n_matmul * tokens + attention


def matmul_params(shapes) -> int:
    """Parameters of the blocks' and head's kernels (2-D or stacked 3-D leaves named ``.../kernel``)."""
    import jax

    import vescale_jax as vj

    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
        if vj.plan_path(path).endswith("kernel"):
            total += math.prod(leaf.shape)
    return total


def run_variant(args) -> dict:
    """Build, compile and time one variant; the record of the run."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import abstract_model, init_params, loss_fn

    import vescale_jax as vj

    cfg = config(args.config)
    seq = cfg.max_len
    devices = jax.devices()
    dev = devices[0]
    graphdef, shapes = abstract_model(cfg)
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    n_matmul = matmul_params(shapes)
    batch = args.batch
    tokens = batch * seq
    rng = np.random.default_rng(0)
    x = rng.integers(0, cfg.vocab, (batch, seq + 1), dtype=np.int32)
    batch_arrays = {"x": jnp.asarray(x[:, :-1]), "y": jnp.asarray(x[:, 1:])}
    lr = 1e-4
    bf16 = jnp.bfloat16
    variant = args.variant

    if variant == "jit":
        from flax import nnx

        params = jax.jit(lambda k: init_params(cfg, k))(jax.random.key(0))
        tx = optax.adamw(lr, b2=0.99, weight_decay=0.1)
        opt_state = jax.jit(tx.init)(params)

        def loss_of(p, b):
            p16 = jax.tree.map(lambda a: a.astype(bf16) if jnp.issubdtype(a.dtype, jnp.floating) else a, p)
            model = nnx.merge(graphdef, p16)
            return loss_fn(model(b["x"]), b["y"])

        def train_step(params, opt_state, b):
            loss, grads = jax.value_and_grad(loss_of)(params, b)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        step = jax.jit(train_step, donate_argnums=(0, 1))
    else:
        mesh = jax.make_mesh((len(devices),), ("fsdp",))
        if variant == "fsdp_fp8":
            gran = lambda path, leaf: vj.tiles(128, 128) if leaf.ndim >= 2 else vj.rows(1)
        elif variant == "fsdp_adam8bit":
            gran = lambda path, leaf: vj.tiles(32, 32) if leaf.ndim >= 2 else vj.rows(1)
        else:
            gran = vj.rows(1)
        plan = vj.plan(shapes, mesh, stacked=("blocks",), granularity=gran)
        if variant == "fsdp_adam8bit":
            tx = vj.optim.adamw_8bit(lr, plan=plan, b2=0.99, weight_decay=0.1)
        else:
            tx = optax.adamw(lr, b2=0.99, weight_decay=0.1)
        fp8 = (128, 128) if variant == "fsdp_fp8" else None
        precision = vj.MixedPrecision(compute_dtype="bfloat16", reduce_dtype="float32", fp8_gather=fp8)
        params = vj.init_sharded(lambda key: init_params(cfg, key), plan, jax.random.key(0))
        opt_state = vj.init_opt_state(tx, params)

        @vj.fsdp(plan=plan, precision=precision)
        def step(params, opt_state, b):
            def loss_of(p, bb):
                return loss_fn(vj.flax.nnx_apply(graphdef, p, bb["x"]), bb["y"])

            loss, grads = jax.value_and_grad(loss_of)(params, b)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

    _progress(f"{variant}: {n_params / 1e6:.1f} M parameters built; first call (trace, compile, one step)")
    t = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, batch_arrays)
    jax.block_until_ready((params, opt_state, loss))
    first_s = time.perf_counter() - t
    _progress(f"{variant}: first call took {first_s:.1f} s; timing {args.steps} steps")
    first_loss = float(loss)
    for _ in range(2):  # warm-up
        params, opt_state, loss = step(params, opt_state, batch_arrays)
        jax.block_until_ready((params, opt_state, loss))
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch_arrays)
        jax.block_until_ready((params, opt_state, loss))
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    flops = model_flops(cfg, n_matmul=n_matmul, tokens=tokens, seq=seq)
    full = model_flops(cfg, n_matmul=n_matmul, tokens=tokens, seq=seq, causal=False)
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    peak = (stats or {}).get("peak_bytes_in_use")
    return {
        "variant": variant,
        "label": args.label,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "devices": len(devices),
        "jax": jax.__version__,
        "config": args.config,
        "params": n_params,
        "matmul_params": n_matmul,
        "batch": batch,
        "seq": seq,
        "tokens_per_step": tokens,
        "step_ms": 1e3 * step_s,
        "step_ms_min": 1e3 * min(times),
        "timed_steps": len(times),
        "tokens_per_s": tokens / step_s,
        "model_flops_per_step": flops,
        "flops_formula": FLOPS_FORMULA,
        "mfu": flops / step_s / (args.peak_tflops * 1e12),
        "mfu_full_attention": full / step_s / (args.peak_tflops * 1e12),
        "attention": f"{cfg.attention} ({cfg.attention_implementation or 'JAX picks'}), remat {cfg.remat}",
        "peak_tflops": args.peak_tflops,
        "peak_bytes_in_use": peak,
        "first_call_s": first_s,
        "compile_s": first_s - step_s,
        "first_loss": first_loss,
        "last_loss": float(loss),
    }


def _progress(msg: str) -> None:
    """One line to stderr at once (a run killed by its time limit shows how far it got)."""
    print(f"[gpu_step] {msg}", file=sys.stderr, flush=True)


def report(records: list[dict]) -> str:
    """The markdown table of the step records (one row per run)."""
    dry = any(r["platform"] != "gpu" for r in records)
    r0 = records[0]
    lines = [
        "# GPU step: vj.fsdp beside plain jax.jit" + (" — DRY RUN on CPU, figures meaningless" if dry else ""),
        "",
        f"{r0['device_kind']} ({r0['platform']}, {r0['devices']} device(s)), JAX {r0['jax']}. Model: example GPT "
        f"`{r0['config']}`, {r0['params'] / 1e6:.1f} M parameters ({r0['matmul_params'] / 1e6:.1f} M in matmuls), "
        f"batch {r0['batch']} × sequence {r0['seq']}, bf16 compute over fp32 master weights, attention "
        f"{r0.get('attention', 'einsum')}. Median of "
        f"{r0['timed_steps']} steps after 2 warm-up steps. MFU = model FLOPs per step ÷ step time ÷ "
        f"{r0['peak_tflops']:.0f} TFLOP/s (H200 bf16 dense peak); model FLOPs per step = {r0['flops_formula']} "
        "(MaxText's count for causal attention; PaLM's whole T×T square in the `MFU full` column) "
        f"= {r0['model_flops_per_step'] / 1e12:.2f} TFLOP. Peak = `device.memory_stats()['peak_bytes_in_use']` "
        "(one process per row). First call = compile + one step (tracing included); compile ≈ first call − the "
        "median step.",
        "",
        "| variant | XLA flags | step ms | tokens/s | MFU | MFU full | peak GiB | tokens/s ÷ jit | peak ÷ jit "
        "| compile s | first call s | loss first → last |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in records:
        peak = "-" if r["peak_bytes_in_use"] is None else f"{r['peak_bytes_in_use'] / 2**30:.2f}"
        flags = r["label"] or "default"
        speed, memory = _against_jit(r, records)
        lines.append(
            f"| {r['variant']} | {flags} | {r['step_ms']:.1f} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f} % "
            f"| {100 * r.get('mfu_full_attention', r['mfu']):.1f} % | {peak} | {_ratio(speed)} | {_ratio(memory)} "
            f"| {r.get('compile_s', r['first_call_s']):.1f} | {r['first_call_s']:.1f} "
            f"| {r['first_loss']:.3f} → {r['last_loss']:.3f} |"
        )
    lines += ["", *(f"- {line}" for line in goal_lines(records))]
    return "\n".join(lines) + "\n"


def _jit_of(record: dict, records: list[dict]) -> dict | None:
    """The plain-jit record run with the same XLA flags (the last one)."""
    same = [r for r in records if r["variant"] == "jit" and r["label"] == record["label"]]
    return same[-1] if same else None


def _against_jit(record: dict, records: list[dict]) -> tuple[float | None, float | None]:
    """``(tokens/s ÷ jit's, peak ÷ jit's)`` against the jit record of the same flags (None where unknown)."""
    jit = _jit_of(record, records)
    if jit is None:
        return None, None
    speed = record["tokens_per_s"] / jit["tokens_per_s"]
    peaks = record["peak_bytes_in_use"], jit["peak_bytes_in_use"]
    return speed, (peaks[0] / peaks[1] if all(peaks) else None)


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def goal_lines(records: list[dict]) -> list[str]:
    """One line per goal of :data:`GOALS` and record it applies to: the figure, the bound, met or not."""
    out = []
    for r in records:
        flags = r["label"] or "default"
        if r["variant"] == "jit":
            ok = r["mfu"] >= GOALS["jit_mfu"]
            out.append(
                f"jit ({flags}): MFU {100 * r['mfu']:.1f} % (goal ≥ {100 * GOALS['jit_mfu']:.0f} %): "
                f"{'met' if ok else 'NOT met'}"
            )
        elif r["variant"] == "fsdp":
            speed, memory = _against_jit(r, records)
            if speed is None:
                continue
            ok = speed >= GOALS["fsdp_tokens_vs_jit"] and (memory is None or memory <= GOALS["fsdp_peak_vs_jit"])
            out.append(
                f"fsdp ({flags}): {_ratio(speed)} × jit's tokens/s (goal ≥ {GOALS['fsdp_tokens_vs_jit']}), "
                f"{_ratio(memory)} × its peak (goal ≤ {GOALS['fsdp_peak_vs_jit']}): {'met' if ok else 'NOT met'}"
            )
    return out


def write_report(jsonl: str, md: str) -> None:
    """Rewrite ``md`` from every record of ``jsonl``; CPU (dry-run) records never go to benchmarks/results/."""
    with open(jsonl) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        print(f"no records in {jsonl}")
        return
    if any(r["platform"] != "gpu" for r in records) and Path(md).resolve().parent == ROOT / "benchmarks" / "results":
        raise SystemExit(f"refusing to write CPU figures to {md}: benchmarks/results/ holds GPU measurements only")
    Path(md).write_text(report(records))
    print(f"wrote {md} ({len(records)} rows)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--config", default=None, help="gpu (default) or tiny (default with --dry-run)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 16; dry run: 2 per device)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 10; dry run: 3)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS)
    p.add_argument("--label", default="", help="a name for this run's XLA flags (e.g. lhs)")
    p.add_argument("--jsonl", help="append the run's record here")
    p.add_argument("--report", help="a JSONL file of records: write the markdown table instead of running")
    p.add_argument("--md", help="markdown file the report is written to")
    p.add_argument("--dry-run", action="store_true", help="tiny model, 3 steps, any device (figures meaningless)")
    args = p.parse_args(argv)
    if args.report:
        if not args.md:
            p.error("--report needs --md")
        write_report(args.report, args.md)
        return 0
    if not args.variant:
        p.error("--variant is required (or --report)")
    import jax

    args.config = args.config or ("tiny" if args.dry_run else "gpu")
    args.steps = args.steps or (3 if args.dry_run else 10)
    args.batch = args.batch or (2 * len(jax.devices()) if args.dry_run else 16)
    record = run_variant(args)
    print(json.dumps(record))
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
