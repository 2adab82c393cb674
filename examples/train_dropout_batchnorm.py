"""Dropout, BatchNorm and a batch-statistic auxiliary loss under ``vj.fsdp``, against the same model unsharded.

A Flax NNX classifier with ``nnx.Dropout`` (its key in an ``nnx.Rngs`` carried as model state), ``nnx.BatchNorm``
(running statistics carried as model state) and an auxiliary loss on the batch mean of its hidden activations
(``vj.batch_mean``). It trains on generated data under ``vj.fsdp`` on 8 simulated CPU devices (or the GPUs there
are), and the same model trains unsharded on one device from the same initial state. The two runs draw the same
dropout masks and compute the same statistics, so their parameters and running statistics agree to float
rounding at the end::

    python examples/train_dropout_batchnorm.py --steps 20

Prints "compiling…" and the compile times of both steps, then the two losses every ``--log-every`` steps with
samples/s and s/step (both steps of an iteration, counted from the end of the first; on a terminal a live progress
bar shows every step), and the first step's time (compile + run). Compiled executables are kept in JAX's
persistent compilation cache (``--compile-cache DIR``, default ``~/.cache/vescale_jax/jax``;
``--no-compile-cache`` to compile afresh). What each construct does on each device: docs/devices.md.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import (
    CacheStats,
    HelpFormatter,
    Progress,
    add_compile_cache_options,
    add_output_options,
    compile_cache,
    compile_cache_dir,
    simulate_cpu_devices,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (no JAX needed: ``--help`` answers at once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps (each: the sharded and the unsharded)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (a multiple of the device count)")
    parser.add_argument("--width", type=int, default=64, help="hidden width (BatchNorm features)")
    add_output_options(parser, every=5)
    add_compile_cache_options(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":  # the command line first: --help and usage errors answer before JAX is imported
    parse_args()
    simulate_cpu_devices(8)  # 8 simulated CPU devices, unless XLA_FLAGS says otherwise (no effect on GPUs)

import jax  # noqa: E402  (after the command line, so that --help does not wait for JAX)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import vescale_jax as vj  # noqa: E402


class Classifier(nnx.Module):
    def __init__(self, d_in: int, width: int, classes: int, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(d_in, width, use_bias=False, rngs=rngs)  # BatchNorm follows: a bias would cancel
        self.norm = nnx.BatchNorm(width, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(width, classes, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.norm(self.inp(x)))
        # an auxiliary term on a statistic of the whole batch: keep the mean activation near 0.5
        aux = jnp.mean((vj.batch_mean(h, axis=0) - 0.5) ** 2)
        return self.out(self.drop(h)), aux


def data(steps: int, batch: int, d_in: int, classes: int, seed: int = 0):
    """Gaussian clusters, one per class: ``(steps, batch, d_in)`` inputs and their labels."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(0.0, 2.0, (classes, d_in)).astype(np.float32)
    labels = rng.integers(0, classes, (steps, batch))
    x = centres[labels] + rng.normal(0.0, 1.0, (steps, batch, d_in)).astype(np.float32)
    return x, labels.astype(np.int32)


def loss_of(out, labels):
    logits, aux = out
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() + 0.1 * aux


def main(argv: list[str] | None = None) -> tuple[float, float]:
    """Trains both runs; returns the largest relative differences of the parameters and of the running
    statistics."""
    args = parse_args(argv)
    with compile_cache(compile_cache_dir(args)) as cache:
        return train(args, cache)


def train(args: argparse.Namespace, cache: CacheStats) -> tuple[float, float]:
    """Both runs from the same initial state, step by step; then the comparison."""
    d_in, classes = 16, 4
    xs, ys = data(args.steps, args.batch, d_in, classes)

    model = Classifier(d_in, args.width, classes, rngs=nnx.Rngs(params=0, dropout=1))
    graphdef, params, state = nnx.split(model, nnx.Param, ...)  # trained | BatchNorm statistics and the Rngs
    tx = optax.adamw(3e-3)
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    plan = vj.plan(params, mesh)

    @vj.fsdp(plan=plan)
    def step(params, opt_state, batch, state):
        def loss(p):
            out, new_state = vj.flax.nnx_apply(graphdef, p, batch["x"], state=state)
            return loss_of(out, batch["y"]), new_state

        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value

    @jax.jit
    def reference_step(params, opt_state, batch, state):  # the same model on one device over the global batch
        def loss(p):
            model = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, state))  # Variables of this trace
            out = model(batch["x"])
            return loss_of(out, batch["y"]), nnx.split(model, nnx.Param, ...)[2]

        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, state, value

    sharded = vj.shard(params, plan)
    opt_state = vj.init_opt_state(tx, sharded)
    # The model state replicated on the mesh, as the step returns it: the second step then runs the first's program
    sharded_state = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.P()))
    ref, ref_opt, ref_state = params, tx.init(params), state
    progress = Progress(args.steps, items_per_step=args.batch, unit="samples", every=args.log_every, cache=cache)
    with jax.numpy_dtype_promotion("standard"):
        first = {"x": xs[0], "y": ys[0]}
        progress.compile(step, sharded, opt_state, first, sharded_state, what="the vj.fsdp step")
        progress.compile(reference_step, ref, ref_opt, first, ref_state, what="the unsharded reference step")
        for i in range(args.steps):
            batch = {"x": xs[i], "y": ys[i]}
            sharded, opt_state, sharded_state, value = step(sharded, opt_state, batch, sharded_state)
            ref, ref_opt, ref_state, ref_value = reference_step(ref, ref_opt, batch, ref_state)
            value, ref_value = float(value), float(ref_value)
            progress.step(i + 1, value, note=f"vj.fsdp {value:.5f}, unsharded {ref_value:.5f}")
    progress.close()

    def worst(got, want):
        leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
        return max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30)) for a, b in leaves)

    floats = lambda s: nnx.State.filter(s, nnx.BatchStat)  # the running statistics (the Rngs hold integer keys)
    params_diff, stats_diff = worst(vj.unshard(sharded), ref), worst(floats(sharded_state), floats(ref_state))
    print(f"devices {jax.device_count()}: params max |diff|/max|ref| {params_diff:.1e}")
    print(f"running statistics max |diff|/max|ref| {stats_diff:.1e}")
    return params_diff, stats_diff


if __name__ == "__main__":
    main()
