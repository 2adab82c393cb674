"""vj.optim.shampoo (blocked Shampoo, every block preconditioned on the device that holds it): static figures.

    python benchmarks/shampoo.py         # GPT-like trees, 8 simulated CPU devices

Compiles (does not run) ``tx.update(grads, state, params)`` on ``ShapeDtypeStruct`` arguments carrying the
plan's shardings and reports, per device:

(a) the block placement: blocks per device and max/mean (``vj.optim.shampoo_blocks(plan, b).summary()``);
(b) a collective census of the compiled update: the step must add no parameter-sized collective (a collective
    whose result exceeds ``SCALAR_BYTES`` fails the gate; scalars are fine);
(c) root FLOPs: each device computes ``B`` block slots x 2 inverse roots of ``b x b``. XLA:CPU lowers ``eigh`` to
    a LAPACK custom call that ``cost_analysis`` counts as 0 FLOPs, so we report both the compiled FLOPs and an
    analytic root-FLOP model (below), and the ratio busiest-device root FLOPs / (total over real blocks / m),
    gated at <= 1.25. As an independent check the same update is compiled on 1 device: compiled FLOPs
    (8 devices, per device) / (1 device / 8);
(d) memory: optimizer-state bytes per device against parameter bytes per device, and the compiled update's temp
    memory, next to ``optax.adamw``'s on the same plan and sharded buffers (reported, no bound).

The model: stacked layers {qkv (L,D,3D), proj (L,D,D), fc1 (L,D,F), fc2 (L,F,D), ln (L,D)}, embed (V,D),
head (D,V), planned with ``granularity=vj.rows(b)`` and the per-layer-rank-<2 leaves in their own unit (else
the 1-D ``ln`` leaves in the ``layers`` bucket force rows(b) padding). Two configurations: the main one
(D=1024, F=4096, V=8192, L=4; gated) and a less favourable one (D=512, F=2048, V=4096, L=8; reported only) in
which a 128-row band is large next to a device's share of a bucket, so the plan pads and the blocks are unevenly
spread. Exits 1 if the main configuration breaks the balance bound or has a parameter-sized collective.
"""

from __future__ import annotations

import os
import sys
import time

if "XLA_FLAGS" not in os.environ:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
from vescale_jax import testing

M, BLOCK, BOUND = 8, 128, 1.25
MAIN = {"D": 1024, "F": 4096, "V": 8192, "L": 4}
SECOND = {"D": 512, "F": 2048, "V": 4096, "L": 8}
SCALAR_BYTES = 1024  # a collective result above this (per device, per launch) counts as parameter-sized
KINDS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")


def eigh_flops(n: float) -> float:
    """FLOPs of a symmetric eigendecomposition with eigenvectors of an n x n matrix: ~9 n^3.

    Golub & Van Loan, *Matrix Computations* (4th ed.), Sec. 8.3.6 ("symmetric QR algorithm"): about 4n^3/3
    flops for the eigenvalues alone and about 9n^3 with the eigenvectors (Householder tridiagonalisation
    4n^3/3, accumulating Q 4n^3/3, implicit QR sweeps with eigenvector updates ~6n^3).
    """
    return 9.0 * n**3


def root_flops(n: float) -> float:
    """One inverse root (A + eps)^(-1/p) = V diag(w) V^T: eigh plus the 2n^3 reconstruction matmul."""
    return eigh_flops(n) + 2.0 * n**3


def model(D: int, F: int, V: int, L: int) -> dict:
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    return {
        "embed": {"table": f(V, D)},
        "layers": {"qkv": f(L, D, 3 * D), "proj": f(L, D, D), "fc1": f(L, D, F), "fc2": f(L, F, D), "ln": f(L, D)},
        "head": {"w": f(D, V)},
    }


def units(path, leaf) -> str:
    """Default units, with leaves of per-layer rank < 2 moved to their own (stacked) unit."""
    u = vj.default_unit(path, leaf)
    return u if len(leaf.shape) - (u == "layers") >= 2 else u + "_vectors"


def make_plan(tree, mesh):
    return vj.plan(tree, mesh, stacked=["layers", "layers_vectors"], granularity=vj.rows(BLOCK), units=units)


def abstract_params(plan):
    """ShardedParams of ShapeDtypeStructs carrying the plan's shardings."""
    shapes = [jax.ShapeDtypeStruct(b.shape, jnp.dtype(b.dtype)) for b in plan.buckets]
    return jax.tree.map(
        lambda s, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        vj.ShardedParams(plan.shardings(), plan),
        vj.ShardedParams(shapes, plan),
    )


def place_state(shapes, plan):
    """The shardings ``vj.init_opt_state`` gives: bucket-shaped leaves like their bucket, vj.PerDevice on dim 0,
    the rest replicated."""
    by_shape = {tuple(b.shape): s for b, s in zip(plan.buckets, plan.shardings(), strict=True)}
    rep, per_dev = NamedSharding(plan.mesh, P()), NamedSharding(plan.mesh, P(plan.axis))

    def one(x):
        if isinstance(x, vj.PerDevice):
            v = x.value
            return x.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=per_dev))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_shape.get(tuple(x.shape), rep))

    return jax.tree.map(one, shapes, is_leaf=lambda x: isinstance(x, vj.PerDevice))


def bytes_per_device(tree) -> int:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, vj.PerDevice))
    leaves = [x.value if isinstance(x, vj.PerDevice) else x for x in leaves]
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


def compile_update(tx, plan):
    """``jax.jit(tx.update)`` lowered on sharded ShapeDtypeStructs and compiled; also returns the placed state."""
    sp = abstract_params(plan)
    with jax.set_mesh(plan.mesh):
        state = place_state(jax.eval_shape(tx.init, sp), plan)
        compiled = jax.jit(tx.update, donate_argnums=(1,)).lower(sp, state, sp).compile()
    return compiled, sp, state


def shampoo_tx(plan):
    return vj.optim.shampoo(1e-3, plan=plan, block_size=BLOCK)


def analytic_roots(tables, m: int) -> tuple[float, float]:
    """(busiest device's root FLOPs, total root FLOPs over the real blocks / m).

    Every slot costs two full b x b roots (edge blocks are zero-padded to b, empty slots still computed); a real
    r x c block would need an r x r and a c x c root.
    """
    per_device = tables.slots * 2 * root_flops(tables.block_size)
    real = tables.rows > 0
    total = float(np.sum(root_flops(tables.rows[real].astype(float)) + root_flops(tables.cols[real].astype(float))))
    return per_device, total / m


def mib(x: float) -> str:
    return f"{x / 2**20:,.2f} MiB"


def run_config(name: str, cfg: dict, one_device_check: bool) -> dict:
    t0 = time.perf_counter()
    tree = model(**cfg)
    mesh = jax.make_mesh((M,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    plan = make_plan(tree, mesh)
    tables = vj.optim.shampoo_blocks(plan, BLOCK)
    print(
        f"\n=== {name}: D={cfg['D']}, F={cfg['F']}, V={cfg['V']}, L={cfg['L']} stacked layers, "
        f"block {BLOCK}, {M} devices ==="
    )
    print(plan.summary())
    print(f"plan padding fraction: {plan.padding_fraction:.4f}")
    print(f"(a) {tables.summary()}")

    tx = shampoo_tx(plan)
    compiled, sp, state = compile_update(tx, plan)
    census = testing.census(compiled)
    print("(b) collectives of the compiled update (per device):")
    print("    " + census.table(ops=True).replace("\n", "\n    "))
    largest = max((op.result_bytes for op in census.ops), default=0)
    big = [op for op in census.ops if op.result_bytes > SCALAR_BYTES]
    print(f"    largest collective result: {largest} B; parameter-sized (> {SCALAR_BYTES} B): {len(big)}")

    flops8 = testing.cost(compiled)["flops"]
    per_dev_roots, mean_roots = analytic_roots(tables, M)
    root_ratio = per_dev_roots / mean_roots
    print(
        f"(c) compiled cost_analysis FLOPs of the update per device: {flops8 / 1e9:.3f} GFLOP "
        "(eigh is a custom call: 0 FLOPs in this count)"
    )
    print(
        f"    analytic root FLOPs per device: {tables.slots} slots x 2 roots x {root_flops(BLOCK) / 1e6:.2f} MFLOP "
        f"= {per_dev_roots / 1e9:.3f} GFLOP (per root: eigh 9b^3 [Golub & Van Loan 8.3.6] + 2b^3 for V w V^T)"
    )
    print(
        f"    total root FLOPs over the {tables.num_blocks} real blocks / {M} = {mean_roots / 1e9:.3f} GFLOP; "
        f"busiest / mean = {root_ratio:.3f} (bound {BOUND})"
    )
    flop_ratio = None
    if one_device_check:
        mesh1 = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
        plan1 = make_plan(tree, mesh1)
        tables1 = vj.optim.shampoo_blocks(plan1, BLOCK)
        compiled1, _, _ = compile_update(shampoo_tx(plan1), plan1)
        flops1 = testing.cost(compiled1)["flops"]
        flop_ratio = flops8 / (flops1 / M)
        print(f"    1 device: {tables1.summary()}")
        print(
            f"    1 device: compiled FLOPs {flops1 / 1e9:.3f} GFLOP; "
            f"flops(8 devices, per device) / (flops(1 device) / 8) = {flop_ratio:.3f}"
        )

    mem = testing.memory(compiled)
    params_b, state_b = bytes_per_device(sp), bytes_per_device(state)
    sh = state.shampoo[0]  # ShampooState; state.shampoo[1] is the momentum, state.adam the AdamW branch
    stats_b = bytes_per_device((sh.stats_left, sh.stats_right, sh.root_left, sh.root_right))
    parts = {
        "block stats+roots": stats_b,
        "graft": bytes_per_device(sh.graft),
        "momentum": bytes_per_device(state.shampoo[1].mu),
        "AdamW moments": bytes_per_device(state.adam),
    }
    adam = optax.adamw(1e-3)
    a_compiled, _, a_state = compile_update(adam, plan)
    a_mem, a_state_b = testing.memory(a_compiled), bytes_per_device(a_state)
    print(
        f"(d) per device: params {mib(params_b)}; shampoo state {mib(state_b)} = {state_b / params_b:.2f}x params "
        f"({', '.join(f'{k} {mib(v)}' for k, v in parts.items())}); update temp {mib(mem.temp)}"
    )
    full = 4 * tables.num_blocks * BLOCK**2 * 4
    print(
        f"    block stats+roots of all {tables.num_blocks} blocks: {mib(full)}; here {mib(stats_b)} per device "
        f"({full / stats_b:.2f}x less than keeping every block's statistics on every device)"
    )
    print(
        f"    optax.adamw on the same buffers: state {mib(a_state_b)} = {a_state_b / params_b:.2f}x params; "
        f"update temp {mib(a_mem.temp)}"
    )
    print(
        f"    update temp per device: vj.optim.shampoo {mib(mem.temp)} vs optax.adamw {mib(a_mem.temp)}, "
        f"{mem.temp / params_b:.2f}x vs {a_mem.temp / params_b:.2f}x params (not gated)"
    )
    print(f"    [{time.perf_counter() - t0:.1f} s]")
    return {
        "balance": tables.balance,
        "root_ratio": root_ratio,
        "big": len(big),
        "flop_ratio": flop_ratio,
        "temp": mem.temp,
        "adam_temp": a_mem.temp,
    }


def main() -> int:
    print(f"JAX {jax.__version__}, optax {optax.__version__}, {len(jax.devices())} {jax.devices()[0].platform} devices")
    main_fig = run_config("main configuration (gated)", MAIN, one_device_check=True)
    second = run_config("second configuration (reported, not gated)", SECOND, one_device_check=True)
    ok = main_fig["balance"] <= BOUND and main_fig["root_ratio"] <= BOUND and main_fig["big"] == 0
    print(
        f"\nmain: max/mean blocks {main_fig['balance']:.3f}, root-FLOP ratio {main_fig['root_ratio']:.3f}, "
        f"compiled-FLOP ratio {main_fig['flop_ratio']:.3f}, parameter-sized collectives {main_fig['big']} -> "
        f"{'PASS' if ok else 'FAIL'}"
    )
    print(
        f"second: max/mean blocks {second['balance']:.3f}, root-FLOP ratio {second['root_ratio']:.3f}, "
        f"compiled-FLOP ratio {second['flop_ratio']:.3f}, parameter-sized collectives {second['big']} (not gated)"
    )
    for name, fig in (("main", main_fig), ("second", second)):
        print(
            f"{name}: update temp per device vj.optim.shampoo {mib(fig['temp'])}, optax.adamw {mib(fig['adam_temp'])} "
            f"(reported, not gated)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
