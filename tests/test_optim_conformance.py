"""vj.optim.muon / vj.optim.shampoo behave like Optax optimizers: the patterns of optax's own contrib tests
(``optax/contrib/_common_test.py``, ``_muon_test.py``) on ShardedParams, on 1, 3 and 8 devices.

State sharded like the params after eager init, jitted init and jitted update (so a jitted step compiles
once), ``update(..., **extra_args)``, ``optax.inject_hyperparams``, ``optax.tree.map_params``,
``optax.MultiSteps``, and complex parameters (Muon orthogonalises them as optax does; Shampoo rejects them).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import vescale_jax as vj
from vescale_jax.state._sharded import PerDevice


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's bias corrections mix a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def make_params(dtype=jnp.float32):
    k = jax.random.split(jax.random.key(0), 3)
    # A split matrix, a small matrix and a vector (the AdamW branch).
    return {
        "w": jax.random.normal(k[0], (8, 12), dtype),
        "v": jax.random.normal(k[1], (4, 6), dtype),
        "b": jax.random.normal(k[2], (12,), dtype),
    }


def setup(name, m, *, auto=False):
    mesh = make_mesh(m, auto=auto)
    params = make_params()
    plan = vj.plan(params, mesh, granularity=vj.rows(4) if name == "shampoo" else vj.element())
    factory = (
        functools.partial(vj.optim.muon, plan=plan)
        if name == "muon"
        else functools.partial(vj.optim.shampoo, plan=plan, block_size=4)
    )
    return mesh, plan, factory, vj.shard(params, plan)


def objective(p):
    return sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree.leaves(vj.unshard(p)))


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def assert_placed(state, plan, where):
    """Bucket-shaped state like its bucket, PerDevice state split on dim 0, the rest replicated."""
    by_shape = {b.shape: plan.partition_spec(b) for b in plan.buckets}
    per_device = {
        id(x.value)
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, PerDevice))
        if isinstance(x, PerDevice)
    }
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        spec = by_shape.get(x.shape, jax.sharding.PartitionSpec())
        if id(x) in per_device:
            spec = jax.sharding.PartitionSpec(plan.axis, *[None] * (x.ndim - 1))
        want = jax.sharding.NamedSharding(plan.mesh, spec)
        assert x.sharding.is_equivalent_to(want, x.ndim), (
            f"{where}: state leaf {jax.tree_util.keystr(path)} {x.shape} has {x.sharding}, expected {spec}"
        )


# 3 devices (ragged, split matrices) run by default; 1 and 8 are slow (each case compiles several steps).
DEVICES = [pytest.param(1, marks=pytest.mark.slow), 3, pytest.param(8, marks=pytest.mark.slow)]


@pytest.mark.parametrize("m", DEVICES)
@pytest.mark.parametrize("name", ["muon", pytest.param("shampoo", marks=pytest.mark.slow)])
def test_optax_patterns(name, m):
    mesh, plan, factory, sp = setup(name, m)
    tx = factory(learning_rate=1e-2, weight_decay=0.1)
    with jax.set_mesh(mesh):
        assert_placed(tx.init(sp), plan, "tx.init")
        state0 = jax.jit(tx.init)(sp)  # was: the compact AdamW state came back replicated
        assert_placed(state0, plan, "jax.jit(tx.init)")

        @jax.jit
        def step(p, s):
            u, s = tx.update(jax.grad(objective)(p), s, p, unexpected_extra_args_your_optimizer_doesnt_expect=1)
            return optax.apply_updates(p, u), s

        p1, s1 = step(sp, state0)  # was: TypeError, unexpected keyword argument
        assert_placed(s1, plan, "after a jitted update")
        p2, _ = step(p1, s1)
        assert step._cache_size() == 1, "the step recompiled on its second call"

        # Extra args change nothing: the same update without them.
        update_plain = jax.jit(tx.update)
        g1 = jax.jit(jax.grad(objective))(sp)
        u, _ = update_plain(g1, state0, sp)
        np.testing.assert_allclose(flat(p1), flat(optax.apply_updates(sp, u)), rtol=1e-6, atol=1e-7)
        assert np.all(np.isfinite(flat(p2))) and not np.allclose(flat(p2), flat(p1))

        # optax.tree.map_params: the identity, and specs for the params' copies in the state.
        same = optax.tree.map_params(tx, lambda v: v, state0)  # was: TypeError, _ParamsPlaceholder
        assert jax.tree.structure(same) == jax.tree.structure(state0)
        np.testing.assert_array_equal(flat(same), flat(state0))
        marked = optax.tree.map_params(tx, lambda v: v + 1, state0, transform_non_params=lambda v: v)
        mu = marked[0][0].mu if name == "muon" else marked[0][1].mu
        np.testing.assert_array_equal(flat(mu), flat(jax.tree.map(jnp.ones_like, sp)))

        # optax.MultiSteps: k - 1 zero updates, then the update of the mean gradient.
        ms = optax.MultiSteps(tx, every_k_schedule=2)
        ms_state = jax.jit(ms.init)(sp)  # was: "select cases must have the same shardings"
        g2 = jax.jit(jax.grad(lambda p: objective(p) ** 2 / 100))(sp)
        update = jax.jit(ms.update)
        z, ms_state = update(g1, ms_state, sp)
        assert not np.any(flat(z))
        u_ms, ms_state = update(g2, ms_state, sp)
        u_ref, _ = update_plain(jax.tree.map(lambda a, b: (a + b) / 2, g1, g2), state0, sp)
        # (Shampoo's inverse roots amplify the rounding of MultiSteps' running mean.)
        np.testing.assert_allclose(flat(u_ms), flat(u_ref), rtol=1e-5, atol=1e-7 if name == "muon" else 2e-6)
        assert update._cache_size() == 1


@pytest.mark.parametrize("m", DEVICES)
@pytest.mark.parametrize("name", ["muon", pytest.param("shampoo", marks=pytest.mark.slow)])
def test_inject_hyperparams(name, m):
    mesh, _, factory, sp = setup(name, m)
    hparams = {"learning_rate": 1e-2, "weight_decay": 0.1}
    static = ("ns_steps",) if name == "muon" else ("block_size",)  # they fix shapes (optax's test: ns_steps)
    inject = optax.inject_hyperparams(factory, static_args=static)(**hparams)  # was: `if weight_decay` on a tracer
    tx = factory(**hparams)
    with jax.set_mesh(mesh):
        grads = jax.jit(jax.grad(objective))(sp)
        u, s = jax.jit(tx.update)(grads, tx.init(sp), sp)
        u_inj, s_inj = jax.jit(inject.update)(grads, jax.jit(inject.init)(sp), sp)
    np.testing.assert_allclose(flat(u_inj), flat(u), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(flat(s_inj.inner_state), flat(s), rtol=1e-5, atol=1e-5)


def test_shape_hyperparameter_must_be_static():
    _, _, factory, sp = setup("shampoo", 3)
    inject = optax.inject_hyperparams(factory)(learning_rate=1e-2)
    with pytest.raises(ValueError, match=r"block_size .*static_args=\('block_size',\)"):
        jax.jit(inject.init)(sp)


def test_jit_init_sharded_on_auto_axes():
    """Auto axes, no mesh context: jax.jit(tx.init) keeps the state sharded (no out_shardings needed)."""
    _, plan, factory, sp = setup("muon", 3, auto=True)
    tx = factory(learning_rate=1e-2)
    state = jax.jit(tx.init)(sp)
    assert_placed(state, plan, "jax.jit(tx.init), Auto axes")

    @jax.jit
    def step(p, s):
        u, s = tx.update(jax.grad(objective)(p), s, p)
        return optax.apply_updates(p, u), s

    p, s = step(sp, state)
    step(p, s)
    assert step._cache_size() == 1


def complex_params():
    k = jax.random.split(jax.random.key(1), 3)
    c = lambda k, s: (jax.random.normal(k, s) + 1j * jax.random.normal(jax.random.fold_in(k, 1), s)).astype(
        jnp.complex64
    )
    return {"w": c(k[0], (8, 12)), "v": c(k[1], (13, 5)), "b": c(k[2], (12,))}, c


@pytest.mark.parametrize("m", [pytest.param(1, marks=pytest.mark.slow), 3])
@pytest.mark.parametrize("adaptive", [pytest.param(False, marks=pytest.mark.slow), True])
def test_muon_complex_matches_optax(m, adaptive):
    """Complex matrices are orthogonalised like optax.contrib.muon (was: NaN); on 3 devices ``w`` is split by
    columns over all devices (the split path), on 1 it is whole on its owner."""
    mesh = make_mesh(m, auto=True)
    params, c = complex_params()
    grads = jax.tree.map(lambda x: c(jax.random.key(2), x.shape), params)
    plan = vj.plan(params, mesh)
    tx, ref = vj.optim.muon(1e-2, plan=plan, adaptive=adaptive), optax.contrib.muon(1e-2, adaptive=adaptive)
    sp, sg = vj.shard(params, plan), vj.shard(grads, plan)
    update = jax.jit(tx.update)
    u, s = update(sg, tx.init(sp), sp)
    u, s = update(sg, s, sp)
    ref_update = jax.jit(ref.update)
    r, rs = ref_update(grads, ref.init(params), params)
    r, _ = ref_update(grads, rs, params)
    u = vj.unshard(u)
    for key in params:
        assert np.all(np.isfinite(np.asarray(u[key]))), key
        np.testing.assert_allclose(
            np.asarray(u[key]),
            np.asarray(r[key]),
            rtol=1e-4,
            atol=1e-6 * (1 + float(np.max(np.abs(np.asarray(r[key]))))),
            err_msg=key,
        )


def test_shampoo_rejects_complex():
    params, _ = complex_params()
    plan = vj.plan(params, make_mesh(3), granularity=vj.rows(4))
    with pytest.raises(ValueError, match=r"leaf b is complex64.*not supported"):
        vj.optim.shampoo(1e-2, plan=plan, block_size=4)


@pytest.mark.parametrize("name", ["scale_by_trust_ratio", "scale_by_param_block_norm", "scale_by_param_block_rms"])
def test_params_required(name):
    # Like optax: a transformation that reads the parameters refuses an update without them, naming itself.
    plan = vj.plan(make_params(), make_mesh(1))
    sp = vj.shard(make_params(), plan)
    tx = getattr(vj.optim, name)(plan=plan)
    with pytest.raises(ValueError, match=f"vj.optim.{name} needs the current parameters"):
        tx.update(sp, tx.init(sp))
