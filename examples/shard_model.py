"""Plan a GPT-style Flax NNX model into RaggedShard buckets and initialise it straight into shards.

Runs on 8 simulated CPU devices when no accelerator is present::

    python examples/shard_model.py [--devices 8] [--granularity rows1|rows16|element|whole]

It prints the plan (buckets, S, padding, per-device load), initialises the parameters directly into the
sharded flat buffers (no device ever holds the whole model), checks that un-sharding gives back exactly the
parameters a plain jitted ``nnx`` initialisation gives, and shows where one tensor lives across devices.

``--help`` answers before JAX is imported. The initialisations compile through JAX's persistent compilation
cache (``--compile-cache DIR``, default ``~/.cache/vescale_jax/jax``; ``--no-compile-cache`` to compile afresh).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import HelpFormatter, add_compile_cache_options, compile_cache, compile_cache_dir, simulate_cpu_devices

GRANULARITIES = ("element", "rows1", "rows16", "whole")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (no JAX needed: ``--help`` answers at once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument(
        "--devices", type=int, default=8, help="simulated CPU devices (ignored on GPU, or when XLA_FLAGS is set)"
    )
    parser.add_argument(
        "--granularity",
        choices=GRANULARITIES,
        default="rows1",
        help="block policy of every tensor: element, rows(1), rows(16), whole tensors",
    )
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (embedding and head rows)")
    parser.add_argument("--width", type=int, default=192, help="model width")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    add_compile_cache_options(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":  # the command line first: --help and usage errors answer before JAX is imported
    simulate_cpu_devices(parse_args().devices)

import jax  # noqa: E402  (after the command line, so that --help does not wait for JAX)
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import vescale_jax as vj  # noqa: E402


class Block(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.up = nnx.Linear(d, 4 * d, rngs=rngs)
        self.down = nnx.Linear(4 * d, d, rngs=rngs)


class GPT(nnx.Module):
    def __init__(self, vocab: int, d: int, layers: int, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, rngs=rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)


GRANULARITY = {"element": vj.element(), "rows1": vj.rows(1), "rows16": vj.rows(16), "whole": vj.whole()}
assert set(GRANULARITY) == set(GRANULARITIES)


def units(path, leaf) -> str:
    """One unit per transformer block, plus embed and head."""
    names = vj.plan_path(path).split("/")
    return "/".join(names[:2]) if names[0] == "blocks" else names[0]


def main(argv: list[str] | None = None) -> None:
    """Plans, initialises into shards, checks the round trip (with the compilation cache of the command line)."""
    args = parse_args(argv)
    with compile_cache(compile_cache_dir(args)):
        run(args)


def run(args: argparse.Namespace) -> None:
    """The plan, the sharded initialisation, the bitwise check against ``jax.jit(init)``, one tensor's layout."""
    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("fsdp",))
    print(f"{len(devices)} x {devices[0].platform} devices, mesh {dict(mesh.shape)}")

    def init(key):
        model = GPT(args.vocab, args.width, args.layers, rngs=nnx.Rngs(key))
        return nnx.state(model, nnx.Param)

    key = jax.random.key(0)
    shapes = jax.eval_shape(init, key)
    plan = vj.plan(shapes, mesh, granularity=GRANULARITY[args.granularity], units=units)
    print(plan.summary())

    sp = vj.init_sharded(init, plan, key)
    local = sp.buffers[0].addressable_shards[0].data
    print(f"\nbucket {plan.buckets[0].name}: global {sp.buffers[0].shape}, device 0 holds {local.shape}")

    reference = jax.jit(init)(key)  # eager init can differ from any compiled one in the last bit
    same = all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(jax.tree.leaves(vj.unshard(sp)), jax.tree.leaves(reference), strict=True)
    )
    print(f"unshard(init_sharded(...)) == jax.jit(init), bit for bit: {same}")

    rs = plan.shard_of("embed/embedding")
    print(
        f"\nembed/embedding {rs.shape} with block {rs.block}: rows per device "
        f"{[n // rs.shape[-1] for n in rs.local_sizes]}"
    )
    total = sum(x.size for x in jax.tree.leaves(reference))
    print(
        f"{total / 1e6:.1f} M parameters, padding {plan.padding_fraction:.3%}, "
        f"{sum(b.nbytes for b in plan.buckets) / len(devices) / 2**20:.1f} MiB per device"
    )
    if not same:
        raise SystemExit("round trip mismatch")


if __name__ == "__main__":
    main()
