"""Plan a GPT-style Flax NNX model into RaggedShard buckets and initialise it straight into shards.

Runs on 8 simulated CPU devices when no accelerator is present::

    python examples/shard_model.py [--devices 8] [--granularity rows1|rows16|element|whole]

It prints the plan (buckets, S, padding, per-device load), initialises the parameters directly into the
sharded flat buffers (no device ever holds the whole model), checks that un-sharding gives back exactly the
parameters a plain jitted ``nnx`` initialisation gives, and shows where one tensor lives across devices.
"""

from __future__ import annotations

import argparse
import os
import sys

if __name__ == "__main__":
    _n = next((a.split("=")[1] for a in sys.argv if a.startswith("--devices=")), None)
    if _n is None and "--devices" in sys.argv:
        _n = sys.argv[sys.argv.index("--devices") + 1]
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_n or 8}")

import jax
import numpy as np
from flax import nnx

import vescale_jax as vj


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


def units(path, leaf) -> str:
    """One unit per transformer block, plus embed and head."""
    names = vj.plan_path(path).split("/")
    return "/".join(names[:2]) if names[0] == "blocks" else names[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (ignored on GPU)")
    parser.add_argument("--granularity", choices=sorted(GRANULARITY), default="rows1")
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

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
