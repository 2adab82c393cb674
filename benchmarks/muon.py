"""vj.optim.muon (owner-computed Newton–Schulz) against optax.contrib.muon on JAX's own FSDP sharding.

    python benchmarks/muon.py            # GPT-like tree, 8 simulated CPU devices

Static figures from the compiled optimizer update (per device): FLOPs (``cost_analysis``), collective bytes
(census, ring wire bytes) and temp memory. The baseline shards each leaf on its largest dim divisible by the
device count (else replicates) and runs optax.contrib.muon under ``jax.jit``: XLA gathers every matrix and runs
Newton–Schulz on sharded matrices (partial Gram products and all-reduces). The total is optax.contrib.muon's
update compiled for one device. Exits non-zero if the per-device NS FLOPs (compiled, and by the cost model of
vescale_jax.optim.owners, padding slots included) exceed 1.25x the total / m, or if the update's temp memory
at m = 8 exceeds the baseline's, or does not fall as 1/m (temp(m=2) / temp(m=8) below 3, or temp above 5x the
owned Newton–Schulz work at m = 2, 4 or 8).
"""

from __future__ import annotations

import math
import os
import sys

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax import testing

D, F, V, L, M = 256, 1024, 1024, 8, 8
TEMP_PER_OWNED = 5.0  # bound on update temp / owned Newton-Schulz work, per device


def model():
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return {
        "embed": {"table": f(V, D)},
        "layers": {"qkv": f(L, D, 3 * D), "proj": f(L, D, D), "fc1": f(L, D, F), "fc2": f(L, F, D), "ln": f(L, D)},
        "head": {"w": f(D, V)},
    }


_MDN = optax.contrib.MuonDimensionNumbers
DIMS = {
    "embed": {"table": None},
    "head": {"w": _MDN()},
    "layers": {"qkv": _MDN(1, 2), "proj": _MDN(1, 2), "fc1": _MDN(1, 2), "fc2": _MDN(1, 2), "ln": None},
}


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


def per_device_bytes(tree):
    """Bytes of one device's shard of every leaf (ShapeDtypeStructs with shardings)."""
    return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def compile_pair(m, *, ns_unroll=False, states=False, abstract=None, dims=DIMS):
    """(routing, compiled vj update, compiled optax baseline) with the plan on the first m devices (``abstract``:
    the tree, default :func:`model`; ``dims``: its Muon dimension numbers)."""
    mesh = jax.make_mesh((m,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:m])
    abstract = model() if abstract is None else abstract
    plan = vj.plan(abstract, mesh, stacked=["layers"])
    routing = vjo.muon_routing(plan, dims)
    tx = vjo.muon(1e-3, plan=plan, muon_weight_dimension_numbers=dims, ns_unroll=ns_unroll)
    sp = jax.tree.map(
        lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        vj.ShardedParams(plan.shardings(), plan),
        vj.ShardedParams([jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in plan.buckets], plan),
    )
    with jax.numpy_dtype_promotion("standard"), jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, sp)
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape,
                x.dtype,
                sharding=NamedSharding(
                    mesh,
                    P("fsdp")
                    if x.ndim == 1 and x.shape[0] % m == 0 and x.shape[0] > 1
                    else (P(None, "fsdp") if x.ndim == 2 else P()),
                ),
            ),
            state,
        )
        ours = jax.jit(tx.update, donate_argnums=(1,)).lower(sp, state, sp).compile()

        base_tx = optax.contrib.muon(1e-3, muon_weight_dimension_numbers=dims)
        ap = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, even_spec(x.shape, m))),
            abstract,
        )
        bstate = jax.eval_shape(base_tx.init, ap)
        bstate = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, even_spec(x.shape, m))),
            bstate,
        )
        base = jax.jit(base_tx.update, donate_argnums=(1,)).lower(ap, bstate, ap).compile()
    return (routing, ours, base, state, bstate) if states else (routing, ours, base)


def main() -> int:
    routing, ours, base, ours_state, base_state = compile_pair(M, states=True)
    # XLA's cost analysis counts a rolled loop's body once: FLOPs come from the same update with the
    # Newton–Schulz loop unrolled (identical arithmetic), memory from the default rolled one.
    _, ours_unrolled, _ = compile_pair(M, ns_unroll=True)
    _, _, single = compile_pair(1)  # optax on one device: the total work
    total_flops = testing.cost(single)["flops"]

    state_bytes = {"vj.optim.muon": per_device_bytes(ours_state), "optax muon (JAX FSDP)": per_device_bytes(base_state)}
    rows = [("", "flops/dev", "flops/dev / (total/m)", "wire bytes/dev", "temp MiB", "state MiB/dev")]
    for name, c, fc in (("vj.optim.muon", ours, ours_unrolled), ("optax muon (JAX FSDP)", base, base)):
        _, wire, temp = figures(c)
        fl = figures(fc)[0]
        state = state_bytes[name]
        rows.append(
            (
                name,
                f"{fl / 1e9:.3f} G",
                f"{fl / (total_flops / M):.3f}",
                f"{wire / 2**20:.2f} MiB",
                f"{temp / 2**20:.2f}",
                f"{state / 2**20:.2f}",
            )
        )
    ratio = testing.cost(ours_unrolled)["flops"] / (total_flops / M)
    print(f"GPT-like tree: {L} stacked layers, d={D}, ff={F}, vocab={V}; {M} devices")
    print(routing.summary())
    print(f"optax.contrib.muon on one device (the total): {total_flops / 1e9:.3f} GFLOP")
    print(
        f"index constants baked into the update (run tables): {routing.index_bytes / 2**20:.2f} MiB per device "
        f"for {sum(r.shape[0] * r.shape[1] for r in routing.matrices) / 2**20:.2f} M Muon elements"
    )
    for r in rows:
        print("  ".join(x.ljust(21) for x in r))
    print("temp memory as the device count grows; 'owned' = one device's Newton-Schulz work arrays (the matrices")
    print("it owns plus its column pieces of split ones):")
    temps, owned = {}, {}
    for m, (rt, o, b) in ((2, compile_pair(2)), (4, compile_pair(4)), (M, (routing, ours, base))):
        owned[m], temps[m], base_temp = rt.work_size * 4 / 2**20, figures(o)[2] / 2**20, figures(b)[2] / 2**20
        temps[("base", m)] = base_temp
        print(
            f"  m={m}: owned {owned[m]:.2f} MiB; vj.optim.muon temp {temps[m]:.2f} MiB "
            f"({temps[m] / owned[m]:.1f}x owned); optax muon (JAX FSDP) temp {base_temp:.2f} MiB"
        )
    ok = ratio <= 1.25 and routing.balance <= 1.25
    print(
        f"per-device NS FLOPs / (total / m) = {ratio:.3f} compiled, {routing.balance:.3f} by the model "
        f"(bound 1.25): {'ok' if ok else 'BROKEN'}"
    )
    # Temp memory: at most the baseline's at m = M, and falling as 1/m (temp(2) / temp(M) at least 3/4 of M / 2,
    # and at most TEMP_PER_OWNED x the owned work at every m: per-device temp follows what a device owns).
    falls = temps[2] / temps[M]
    temp_ok = (
        temps[M] <= temps[("base", M)]
        and falls >= 0.75 * M / 2
        and all(temps[m] <= TEMP_PER_OWNED * owned[m] for m in owned)
    )
    print(
        f"update temp at m={M}: {temps[M]:.2f} MiB vs optax muon (JAX FSDP) {temps[('base', M)]:.2f} MiB (bound: <=); "
        f"temp(m=2) / temp(m={M}) = {falls:.2f} (bound >= {0.75 * M / 2:.2f}); temp / owned "
        + ", ".join(f"{temps[m] / owned[m]:.1f}" for m in owned)
        + f" (bound <= {TEMP_PER_OWNED}): {'ok' if temp_ok else 'BROKEN'}"
    )
    ok = ok and temp_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
