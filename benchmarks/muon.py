"""vj.optim.muon (owner-computed Newton–Schulz) against optax.contrib.muon on JAX's own FSDP sharding.

    python benchmarks/muon.py            # GPT-like tree, 8 simulated CPU devices

Static figures from the compiled optimizer update (per device): FLOPs (``cost_analysis``), collective bytes
(census, ring wire bytes) and temp memory. The baseline shards each leaf on its largest dim divisible by the
device count (else replicates) and runs optax.contrib.muon under ``jax.jit``: XLA gathers every matrix and runs
Newton–Schulz redundantly on every device. Exits non-zero if the busiest owner's NS cost exceeds 1.25x the mean.
"""

from __future__ import annotations

import os
import sys

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax import testing

D, F, V, L, M = 256, 1024, 1024, 8, 8


def model():
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return {
        "embed": {"table": f(V, D)},
        "layers": {"qkv": f(L, D, 3 * D), "proj": f(L, D, D), "fc1": f(L, D, F), "fc2": f(L, F, D), "ln": f(L, D)},
        "head": {"w": f(D, V)},
    }


_MDN = optax.contrib.MuonDimensionNumbers
DIMS = {"embed": {"table": None}, "head": {"w": _MDN()},
        "layers": {"qkv": _MDN(1, 2), "proj": _MDN(1, 2), "fc1": _MDN(1, 2), "fc2": _MDN(1, 2), "ln": None}}


def even_spec(shape, m):
    spec = [None] * len(shape)
    for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[d] % m == 0:
            spec[d] = "fsdp"
            break
    return P(*spec)


def figures(compiled):
    c, mem = testing.census(compiled), testing.memory(compiled)
    kinds = ("all-gather", "all-to-all", "all-reduce", "reduce-scatter", "collective-permute")
    wire = sum(c.wire_bytes(k) for k in kinds)
    return testing.cost(compiled)["flops"], wire, mem.temp


def main() -> int:
    mesh = jax.make_mesh((M,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    abstract = model()
    plan = vj.plan(abstract, mesh, stacked=["layers"])
    routing = vjo.muon_routing(plan, DIMS)
    loads = np.array(routing.loads, float)
    balance = loads.max() / (loads.sum() / M)

    tx = vjo.muon(1e-3, plan=plan, muon_weight_dimension_numbers=DIMS)
    sp = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      vj.ShardedParams(plan.shardings(), plan), vj.ShardedParams(
                          [jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in plan.buckets], plan))
    with jax.numpy_dtype_promotion("standard"), jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, sp)
        state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, P("fsdp") if x.ndim == 1 and x.shape[0] % M == 0 and
                                                     x.shape[0] > 1 else (P(None, "fsdp") if x.ndim == 2 else P()))),
            state)
        ours = jax.jit(tx.update, donate_argnums=(1,)).lower(sp, state, sp).compile()

        base_tx = optax.contrib.muon(1e-3, muon_weight_dimension_numbers=DIMS)
        ap = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                         sharding=NamedSharding(mesh, even_spec(x.shape, M))), abstract)
        bstate = jax.eval_shape(base_tx.init, ap)
        bstate = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, even_spec(x.shape, M))), bstate)
        base = jax.jit(base_tx.update, donate_argnums=(1,)).lower(ap, bstate, ap).compile()

    rows = [("", "flops/dev", "wire bytes/dev", "temp MiB")]
    for name, c in (("vj.optim.muon", ours), ("optax muon (JAX FSDP)", base)):
        fl, wire, temp = figures(c)
        rows.append((name, f"{fl / 1e9:.3f} G", f"{wire / 2**20:.2f} MiB", f"{temp / 2**20:.2f}"))
    print(f"GPT-like tree: {L} stacked layers, d={D}, ff={F}, vocab={V}; {M} devices")
    print(routing.summary())
    print(f"busiest owner NS cost / mean = {balance:.3f} (bound 1.25)")
    for r in rows:
        print("  ".join(x.ljust(24) for x in r))
    return 0 if balance <= 1.25 else 1


if __name__ == "__main__":
    sys.exit(main())
