"""Train a GPT with FSDP × tensor parallelism (Megatron column/row-parallel attention and MLP) on stdlib source.

    python examples/train_gpt_tp.py                       # fsdp 2 × tensor 4 on 8 simulated CPU devices
    python examples/train_gpt_tp.py --tensor 2            # fsdp 4 × tensor 2
    python examples/train_gpt_tp.py --tensor 1 --expert 4 --experts 8   # 8 experts over expert = 4
    python examples/train_gpt_tp.py --tensor 1 --expert 4 --experts 8 --expert-data   # batch over expert too

The mesh is ``fsdp × tensor × expert`` over every device JAX sees. ``vj.plan(..., tp=...)`` splits the
column-parallel kernels on their output features and the row-parallel ones on their input features over
``tensor`` (the experts' stacked dim over ``expert``), then lays each group's shards out ragged over ``fsdp``.
Inside the step each device gathers its own group's shards over ``fsdp`` only; the model's two ``psum`` per
block are the only tensor-parallel collectives.

Prints the plan; "compiling the train step…" and then how long tracing, lowering and compiling took; the loss
every ``--log-every`` steps with tokens/s and s/step counted from the end of the first step (so the compile is
not in them; on a terminal a live progress bar shows every step); the first step's time (compile + run); the
validation loss; and writes a loss-curve PNG (``--plot``, needs matplotlib) and, with ``--log-json``, the curve.
Compiled executables are kept in JAX's persistent compilation cache (``--compile-cache DIR``, default
``~/.cache/vescale_jax/jax``; ``--no-compile-cache`` to compile afresh), so a second run with the same options
reads them back instead of compiling: compare the first-step times the two runs print.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import (
    CacheStats,
    HelpFormatter,
    Progress,
    add_compile_cache_options,
    add_output_options,
    compile_cache,
    compile_cache_dir,
    plot_losses,
    simulate_cpu_devices,
)
from train_gpt import batches, stdlib_text  # no JAX imported: train_gpt imports it where it is used


def loss_fn(logits: Any, targets: Any) -> Any:
    """Mean next-byte cross-entropy (logits in float32)."""
    import numpy as np
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), targets).mean()


def build_parser() -> argparse.ArgumentParser:
    """The command line (no JAX needed: ``--help`` answers at once)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--tensor", type=int, default=4, help="tensor-parallel size (the mesh's tensor axis)")
    p.add_argument("--expert", type=int, default=1, help="expert-parallel size (needs --experts)")
    p.add_argument("--experts", type=int, default=0, help="experts per MoE layer (0: dense MLP)")
    p.add_argument(
        "--expert-data", action="store_true", help="split the batch over expert too (tokens travel to the experts)"
    )
    p.add_argument("--steps", type=int, default=150, help="training steps")
    p.add_argument("--batch", type=int, default=32, help="global batch (a multiple of the data-parallel size)")
    p.add_argument("--seq", type=int, default=64, help="bytes per training sequence (the model's context)")
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (stacked, scanned one at a time)")
    p.add_argument("--d-model", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=8, help="attention heads (a multiple of --tensor)")
    p.add_argument("--d-ff", type=int, default=512, help="MLP hidden width (a multiple of --tensor)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (constant)")
    p.add_argument("--data-mb", type=float, default=4.0, help="megabytes of stdlib source to train on")
    p.add_argument("--seed", type=int, default=0, help="initial parameters and data order")
    p.add_argument("--plot", default="train_gpt_tp_loss.png", help="loss-curve PNG ('' to skip; needs matplotlib)")
    p.add_argument(
        "--log-json",
        metavar="PATH",
        help="write {'train': {step: loss}, 'val_loss', 'plan', 's_per_step', 'first_step_s', ...} here "
        "(default: none)",
    )
    add_output_options(p)
    add_compile_cache_options(p)
    return p


def main(argv: list[str] | None = None) -> dict:
    """Parses the command line (before JAX is imported), sets up the devices and the compilation cache, trains."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.expert > 1 and not args.experts:
        p.error("--expert needs --experts (the number of experts to split over it)")
    simulate_cpu_devices(8)
    with compile_cache(compile_cache_dir(args)) as cache:
        return train(args, p, cache)


def train(args: argparse.Namespace, p: argparse.ArgumentParser, cache: CacheStats) -> dict:
    """The run: mesh, plan, initialise, compile, train, validate, plot."""
    import jax
    import numpy as np
    import optax
    from gpt_tp import Config, abstract_model, partition_spec, split_model

    import vescale_jax as vj

    n = len(jax.devices())
    if n % (args.tensor * args.expert):
        p.error(f"{n} devices do not split into tensor={args.tensor} x expert={args.expert} groups")
    fsdp = n // (args.tensor * args.expert)
    mesh = jax.make_mesh((fsdp, args.tensor, args.expert), ("fsdp", "tensor", "expert"))
    cfg = Config(
        vocab=256,
        max_len=args.seq,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        d_ff=args.d_ff,
        num_experts=args.experts,
        tensor="tensor" if args.tensor > 1 else None,
        expert="expert" if args.expert > 1 else None,
        expert_data=args.expert_data,
    )
    data_axes = ("fsdp", "expert") if args.expert_data else ("fsdp",)
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, mesh, stacked=("blocks",), tp=partition_spec(cfg))
    print(f"mesh {dict(mesh.shape)}")
    print(plan.summary())

    tx = optax.adamw(args.lr, weight_decay=0.1)
    params = vj.init_sharded(lambda key: split_model(cfg, key)[1], plan, jax.random.key(args.seed))
    opt_state = vj.init_opt_state(tx, params)

    @vj.fsdp(plan=plan, data_axes=data_axes)
    def train_step(params, opt_state, batch):
        def loss_of(p):
            return loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @vj.fsdp(plan=plan, data_axes=data_axes, donate=False)
    def eval_step(params, _, batch):
        return loss_fn(vj.flax.nnx_apply(graphdef, params, batch["x"]), batch["y"])

    data = stdlib_text(int(args.data_mb * 2**20))
    split = int(0.9 * len(data))
    train = batches(data[:split], args.batch, args.seq, np.random.default_rng(args.seed))
    val = batches(data[split:], args.batch, args.seq, np.random.default_rng(args.seed + 1))
    progress = Progress(args.steps, items_per_step=args.batch * args.seq, every=args.log_every, cache=cache)
    batch = next(train)
    progress.compile(train_step, params, opt_state, batch)  # timed apart from the steps; JAX keeps the executable
    for step in range(1, args.steps + 1):
        if step > 1:
            batch = next(train)
        params, opt_state, loss = train_step(params, opt_state, batch)
        progress.step(step, float(loss))  # float(): waits for the step
    timing = progress.close()
    curve = progress.losses
    val_loss = float(np.mean([float(eval_step(params, None, next(val))) for _ in range(8)]))
    print(f"final train loss {curve[args.steps]:.4f}, validation loss {val_loss:.4f}")
    out = {"train": curve, "val_loss": val_loss, "mesh": dict(mesh.shape), "plan": plan.summary(), **timing}
    if args.log_json:
        with open(args.log_json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        title = f"vj.fsdp x TP char-level GPT, mesh {dict(mesh.shape)}"
        plot_losses(args.plot, list(curve), list(curve.values()), val_loss=val_loss, title=title)
    return out


if __name__ == "__main__":
    main()
