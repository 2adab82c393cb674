"""vj.optim.shampoo against the single-device reference (tests/shampoo_reference.py) on the logical tree;
block placement, census, state sharding, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import ROOT, assert_trees_close, child_pythonpath, edge_block_params
from shampoo_reference import reference_shampoo

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax import testing
from vescale_jax.layout._paths import path_str
from vescale_jax.optim._shampoo._transform import inverse_root

STEPS = 10
BLOCK = 4


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


make_params = edge_block_params


def grads_seq(params, n=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    return [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params) for _ in range(n)]


PARAMS = make_params()
GRADS = grads_seq(PARAMS)
STACKED = {"a": False, "b": False, "layers": True, "head": False}
DEFAULT = dict(learning_rate=0.01, block_size=BLOCK)
OPTIONS = dict(
    learning_rate=0.02,
    block_size=BLOCK,
    beta1=0.8,
    beta2=0.99,
    weight_decay=0.1,
    nesterov=True,
    start_preconditioning_step=3,
    preconditioning_compute_steps=3,
    graft_type="rmsprop",
    graft_beta2=0.9,
    matrix_epsilon=1e-4,
)

_REFS = {}


def reference(name, **kw):
    """The reference on the unsharded logical tree, eagerly: params after each step (cached per config)."""
    if name not in _REFS:
        tx = reference_shampoo(is_stacked=STACKED, **kw)
        params, state, out = PARAMS, None, []
        state = tx.init(params)
        for g in GRADS:
            u, state = tx.update(g, state, params)
            params = optax.apply_updates(params, u)
            out.append(params)
        _REFS[name] = out
    return _REFS[name]


def run_sharded(plan, **kw):
    tx = vjo.shampoo(plan=plan, **kw)
    sp = vj.shard(PARAMS, plan)
    state = vj.init_opt_state(tx, sp)

    @jax.jit
    def step(sp, state, g):
        u, state = tx.update(g, state, sp)
        return optax.apply_updates(sp, u), state

    out = []
    with jax.set_mesh(plan.mesh):
        grads = [vj.shard(g, plan) for g in GRADS]
        for g in grads:
            sp, state = step(sp, state, g)
            out.append([np.asarray(x) for x in jax.tree.leaves(vj.unshard(sp))])
    return out, step, sp, state, grads[0]


def plan_for(m):
    return vj.plan(PARAMS, make_mesh(m), stacked=["layers"], granularity=vj.rows(BLOCK))


@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_parity_with_reference(m):
    plan = plan_for(m)
    got, step, _, state, _ = run_sharded(plan, **DEFAULT)
    for a, r in zip(got, reference("default", **DEFAULT), strict=True):
        assert_trees_close(a, r, rtol=1e-4)
    assert step._cache_size() == 1  # no recompilation after the first step
    # State: graft moment, momentum and AdamW moments sharded like the params; block statistics per device.
    by_shape = {b.shape: s for b, s in zip(plan.buckets, plan.shardings(), strict=True)}
    bucket_leaves = [x for x in jax.tree.leaves(state) if x.shape in by_shape]
    assert len(bucket_leaves) == 2 * len(plan.buckets)  # graft v and momentum; AdamW's moments are compact
    for x in bucket_leaves:
        assert x.sharding.is_equivalent_to(by_shape[x.shape], x.ndim), (x.shape, x.sharding)
    tables = vjo.shampoo_blocks(plan, BLOCK)
    stats = state.shampoo[0].stats_left.value
    assert stats.shape == (m * tables.slots, BLOCK, BLOCK)
    assert stats.sharding.is_equivalent_to(
        jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(plan.axis)), 3
    )
    # Every block of every matrix leaf (edge blocks included) is placed exactly once.
    expected = 0
    for spec in plan.leaves:
        shape = plan.layer_shape(spec)
        if len(shape) >= 2:
            rows, cols = int(np.prod(shape[:-1])), shape[-1]
            layers = spec.shape[0] if len(spec.shape) > len(shape) else 1
            expected += layers * -(-rows // BLOCK) * -(-cols // BLOCK)
    assert tables.num_blocks == expected


@pytest.mark.parametrize("m", [3, 8])
def test_parity_options(m):
    got, *_ = run_sharded(plan_for(m), **OPTIONS)
    for a, r in zip(got, reference("options", **OPTIONS), strict=True):
        assert_trees_close(a, r, rtol=1e-4)


@pytest.mark.parametrize("graft_type", ["adam", "adagrad", "sgd"])
def test_parity_grafts(graft_type):
    kw = dict(DEFAULT, graft_type=graft_type, exponent_override=2)
    got, *_ = run_sharded(plan_for(3), **kw)
    for a, r in zip(got, reference(f"graft-{graft_type}", **kw), strict=True):
        assert_trees_close(a, r, rtol=1e-4)


def test_update_has_no_parameter_sized_collective():
    plan = plan_for(8)
    _, step, sp, state, g = run_sharded(plan, **DEFAULT)
    with jax.set_mesh(plan.mesh):
        compiled = step.lower(sp, state, g).compile()
    c = testing.census(compiled)
    for kind in ("all-gather", "all-to-all", "reduce-scatter", "collective-permute"):
        assert c.count(kind) == 0, (kind, c)
    assert c.bytes("all-reduce") <= 64, c  # scalars at most


def test_blocks_cut_by_the_plan_are_rejected_with_the_fix():
    plan = vj.plan(PARAMS, make_mesh(3), stacked=["layers"])  # element granularity cuts blocks
    with pytest.raises(ValueError, match=r"'a/w'.*\(37, 11\).*vj\.rows\(4\)"):
        vjo.shampoo(0.1, plan=plan, block_size=BLOCK)


def test_rejects_unknown_graft_and_unsharded_params():
    plan = plan_for(2)
    with pytest.raises(ValueError, match="graft_type"):
        vjo.shampoo(0.1, plan=plan, block_size=BLOCK, graft_type="adafactor")
    with pytest.raises(TypeError, match="ShardedParams"):
        vjo.shampoo(0.1, plan=plan, block_size=BLOCK).init(PARAMS)


def test_inverse_root_matches_numpy():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 6, 6))
    a = a @ np.swapaxes(a, 1, 2)
    got = np.asarray(inverse_root(jnp.asarray(a, jnp.float32), exponent=4, epsilon=1e-3))
    w, v = np.linalg.eigh(a)
    ref = (v * (w + 1e-3)[:, None, :] ** -0.25) @ np.swapaxes(v, 1, 2)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-5)


def test_shampoo_inside_a_vj_fsdp_step_matches_the_reference():
    from flax import nnx
    from helpers import GPTConfig, abstract_model, batches, init_params, loss_fn

    cfg = GPTConfig(vocab=67, max_len=16, d_model=20, num_heads=2, num_layers=2, d_ff=52)
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, make_mesh(3), stacked=("blocks",), granularity=vj.rows(BLOCK))
    params = init_params(cfg, jax.random.key(0))
    stacked = jax.tree_util.tree_map_with_path(lambda path, _: path_str(path).startswith("blocks/"), params)
    kw = dict(learning_rate=3e-3, block_size=BLOCK, weight_decay=0.1, preconditioning_compute_steps=2)
    ref_tx = reference_shampoo(is_stacked=stacked, **kw)
    tx = vjo.shampoo(plan=plan, **kw)
    data = list(batches(4, batch=12))
    loss_of = lambda p, batch: loss_fn(nnx.merge(graphdef, p)(batch["x"] % 67), batch["y"] % 67)
    grad_fn = jax.jit(jax.value_and_grad(loss_of))

    @vj.fsdp(plan=plan)
    def step(p, state, batch):
        loss, g = jax.value_and_grad(
            lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"] % 67), batch["y"] % 67)
        )(p)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    ref, ref_state = params, ref_tx.init(params)
    sp = vj.shard(params, plan)
    state = vj.init_opt_state(tx, sp)
    for batch in data:
        ref_loss, g = grad_fn(ref, batch)
        u, ref_state = ref_tx.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
        sp, state, loss = step(sp, state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref, rtol=1e-4)


def test_large_blocks_on_eight_cpu_devices_do_not_deadlock():
    # A batched CPU eigh splits its batch over XLA's intra-op pool; eight simulated devices doing that at once
    # on a small machine used to exhaust the pool and hang. inverse_root maps over the slots on CPU.
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax, jax.numpy as jnp, optax
        import vescale_jax as vj
        from gpt import GPTConfig, abstract_model, init_params
        from train_gpt import shampoo_plan
        cfg = GPTConfig(vocab=256, max_len=128, d_model=128, num_heads=4, num_layers=4, d_ff=512)
        plan = shampoo_plan(abstract_model(cfg)[1], jax.make_mesh((8,), ("fsdp",)), 64)
        tx = vj.optim.shampoo(1e-3, plan=plan, block_size=64)
        params = vj.init_sharded(lambda key: init_params(cfg, key), plan, jax.random.key(0))
        state = vj.init_opt_state(tx, params)

        @jax.jit
        def step(p, s):
            u, s = tx.update(jax.tree.map(lambda x: 0.01 * jnp.sin(7 * x) + 1e-3, p), s, p)
            return optax.apply_updates(p, u), s

        for _ in range(2):
            params, state = step(params, state)
        jax.block_until_ready(params)
        print("done", vj.optim.shampoo_blocks(plan, 64).slots)
    """)
    # The example's model and plan, imported from examples/ (on the child's PYTHONPATH).
    env = child_pythonpath(os.path.join(ROOT, "examples"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("done")
