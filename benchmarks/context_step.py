"""Context parallelism: the compiled ``vj.fsdp`` step of the example GPT at sequence 4096, cp = 1 against cp = 4.

    python benchmarks/context_step.py                                      # 8 simulated CPU devices
    python benchmarks/context_step.py --out benchmarks/results/context_step.md

The GPT of ``examples/gpt.py`` with ``attention="context"`` (``vj.attention`` over the context axis with the
all-gather, ``vj.positions``; the loss a ``vj.batch_mean`` over every token inside the model) trains with AdamW on
the same global batch (``--batch`` sequences of ``--seq-len`` tokens) on two meshes: ``fsdp × context`` =
``F × 1`` (cp = 1: each device holds whole sequences) and ``F × 4`` (cp = 4: each holds a quarter of each). The
parameters are sharded over ``fsdp`` alone in both, so the state per device is the same and the memory the
context axis saves is the activations'. Every figure is static (``memory_analysis()`` and the HLO of the
compiled step):

- **activations**: compiled peak minus the step's arguments (parameters, AdamW state and batch) per device;
- **K/V traffic**: the collectives over the context axis alone per step (result bytes per device), against the
  ideal of the all-gather: per layer, K and V gathered in forward (``(cp - 1) / cp`` of the gathered bytes
  arrive from the other devices) and their gradients reduce-scattered in backward (the same bytes leave);
- the CUDA lowering (no compile) with ``implementation="cudnn"``: the cuDNN fused-attention custom calls.

cp = 4 is compiled twice: with ``context_kv="keep"`` (the default: each layer's gathered K and V kept for its
backward, the gated row) and with ``"regather"`` (gathered again when the backward recomputes the layer), for
the memory / traffic trade-off.

Gates (exit 1 when one fails): activations at cp = 4 at most 0.3x those at cp = 1; the K/V wire bytes within
2 % of the ideal; at least one cuDNN attention custom call in the CUDA lowering.
"""

from __future__ import annotations

import argparse
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
sys.path[:0] = [os.path.join(HERE, "..", "examples"), os.path.join(HERE, "..")]
from gpt import GPTConfig, abstract_model, init_params  # noqa: E402

import vescale_jax as vj  # noqa: E402
from vescale_jax import testing  # noqa: E402

MIB = 2**20


def token_loss(model, x, y):
    """Mean next-token cross-entropy over every token of the batch (each counted once under a context axis)."""
    logp = jax.nn.log_softmax(model(x).astype(jnp.float32), axis=-1)
    return -vj.batch_mean(jnp.take_along_axis(logp, y[..., None], axis=-1)[..., 0], axis=None)


def build(args, cp: int, implementation: str, precision=None, dtype=None, context_kv="keep"):
    """``(step, params, opt_state, batch, mesh, cfg)`` on an ``fsdp × context`` mesh of ``args.fsdp × cp``."""
    mesh = jax.make_mesh((args.fsdp, cp), ("fsdp", "context"), devices=jax.devices()[: args.fsdp * cp])
    cfg = GPTConfig(
        vocab=256,
        max_len=args.seq_len,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        d_ff=4 * args.d_model,
        attention="context",
        attention_implementation=implementation,
        attention_dtype=dtype,
    )
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, mesh, stacked=("blocks",), granularity=vj.rows(1))
    params = vj.init_sharded(lambda key: init_params(cfg, key), plan, jax.random.key(0))
    tx = optax.adamw(1e-3)
    opt_state = vj.init_opt_state(tx, params)

    @vj.fsdp(context_axis="context", precision=precision, context_kv=context_kv)
    def step(p, o, b):
        loss, g = jax.value_and_grad(lambda q: vj.flax.nnx_apply(graphdef, q, b["x"], b["y"], method=token_loss))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    rng = np.random.default_rng(0)
    tok = rng.integers(0, 256, size=(args.batch, args.seq_len + 1)).astype(np.int32)
    return step, params, opt_state, {"x": tok[:, :-1], "y": tok[:, 1:]}, mesh, cfg


def measure(args, cp: int, context_kv: str = "keep") -> dict:
    step, params, opt_state, batch, mesh, _ = build(args, cp, "all_gather", context_kv=context_kv)
    t = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    seconds = time.perf_counter() - t
    mem = testing.memory(compiled)
    activations = mem.peak - mem.argument
    ops = testing.census(compiled).ops
    over_context = [op for op in ops if testing.group_axes(op, mesh) == ("context",)]
    by_kind: dict[str, float] = {}
    for op in over_context:
        by_kind[op.kind] = by_kind.get(op.kind, 0.0) + op.total_wire_bytes
    # ideal: per layer, K and V (B_local x L x D each, in the compute dtype) all-gathered in forward, their
    # gradients reduce-scattered in backward: (cp - 1) / cp of the gathered bytes each way
    b_local = args.batch // args.fsdp
    kv = 2 * b_local * args.seq_len * args.d_model * 4
    ideal = 2 * args.layers * kv * (cp - 1) / cp
    kv_wire = by_kind.get("all-gather", 0.0) + by_kind.get("reduce-scatter", 0.0)
    return {
        "kv_wire": kv_wire,
        "cp": cp,
        "context_kv": context_kv,
        "compile_s": seconds,
        "peak": mem.peak,
        "argument": mem.argument,
        "activations": activations,
        "context_wire": sum(by_kind.values()),
        "by_kind": by_kind,
        "ideal": ideal,
    }


def cuda_lowering(args) -> int:
    """The number of cuDNN fused-attention custom calls in the step lowered for CUDA (cp = 4, cudnn)."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # no cuDNN on this machine: lower as for an H100

    cudnn.check_cudnn_version = lambda: 91000
    cudnn.check_compute_capability = lambda capability: True
    cudnn.is_cuda_compute_capability_equal = lambda capability: False
    precision = vj.MixedPrecision(compute_dtype="bfloat16", reduce_dtype="float32")  # cuDNN attends in bf16
    step, params, opt_state, batch, _, _ = build(args, 4, "cudnn", precision, "bfloat16")
    text = step.lower(params, opt_state, batch, lowering_platforms=("cuda",)).as_text()
    return text.count("__cudnn$fmha")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2, help="global sequences per step (a multiple of --fsdp)")
    p.add_argument("--fsdp", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--out", help="write the results here (markdown)")
    args = p.parse_args(argv)

    rows = []
    for cp, kv in ((1, "keep"), (4, "keep"), (4, "regather")):
        rows.append(measure(args, cp, kv))
        print({k: v for k, v in rows[-1].items()}, flush=True)
    one, four, again = rows
    ratio = four["activations"] / one["activations"]
    traffic = four["kv_wire"] / four["ideal"]
    try:
        calls, why = cuda_lowering(args), ""
    except Exception as e:  # recorded as a failed gate, with JAX's message
        calls, why = 0, f"{type(e).__name__}: {str(e).splitlines()[0][:400]}"
    gates = {
        "activations at cp=4 <= 0.3x cp=1": ratio <= 0.3,
        "K/V wire bytes within 2% of the ideal": abs(traffic - 1) <= 0.02,
        "cuDNN attention custom calls in the CUDA lowering": calls > 0,
    }
    lines = [
        f"# Context parallelism: the example GPT's step at sequence {args.seq_len}",
        "",
        f"Command: `python benchmarks/context_step.py {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip()
        + "`" * 0,
        f"Machine: shared VM, 2 cores AMD EPYC, no accelerator ({len(jax.devices())} simulated CPU devices); "
        f"Python {platform.python_version()}, JAX {jax.__version__}, jaxlib {jax.lib.__version__}.",
        "",
        f"Model: GPT d_model {args.d_model}, {args.layers} layers, {args.heads} heads, vocab 256; global batch "
        f"{args.batch} x {args.seq_len} tokens; AdamW; meshes fsdp x context = {args.fsdp} x 1 and {args.fsdp} x 4.",
        "",
        "| cp | context_kv | devices | peak MiB/device | arguments MiB | activations MiB | K/V wire MiB "
        "| K/V ideal MiB |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cp']} | {r['context_kv'] if r['cp'] > 1 else '-'} | {args.fsdp * r['cp']} | "
            f"{r['peak'] / MIB:.1f} | {r['argument'] / MIB:.1f} | "
            f"{r['activations'] / MIB:.1f} | {r['kv_wire'] / MIB:.2f} | {r['ideal'] / MIB:.2f} |"
        )
    kinds = ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in sorted(four["by_kind"].items()))
    lines += [
        "",
        f"Activations at cp = 4 / cp = 1: **{ratio:.3f}** (goal <= 0.3) with `context_kv='keep'` (the default: "
        f"each layer's gathered K and V kept for its backward); {again['activations'] / one['activations']:.3f} "
        f"with `'regather'`, whose K/V traffic is {again['kv_wire'] / again['ideal']:.4f}x the ideal (K and V "
        "gathered again when the backward recomputes the layer).",
        f"Collectives over the context axis alone at cp = 4, 'keep' (wire bytes per device per step): {kinds}. The K/V "
        f"traffic is the all-gathers (K and V) and reduce-scatters (dK and dV): {four['kv_wire'] / MIB:.2f} MiB, "
        f"/ ideal (K and V gathered once in forward, dK and dV reduce-scattered once in backward) = "
        f"**{traffic:.4f}** (goal 1 +- 0.02). The all-reduce is the parameters' gradient summed over the context "
        "axis (on the shards, after the reduce-scatter over fsdp), not K/V.",
        f"CUDA lowering (implementation='cudnn', cp = 4): **{calls}** `__cudnn$fmha` custom calls"
        + (f"; the lowering failed: `{why}`." if why else "."),
        "",
        *[f"- {'PASS' if ok else 'FAIL'}: {name}" for name, ok in gates.items()],
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if all(gates.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
