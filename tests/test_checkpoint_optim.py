"""vj.checkpoint with the relocatable optimizer states: a Shampoo and a Muon opt_state (block statistics and
roots, compact AdamW moments, momentum, graft moments, counts) saved under one device count and restored under
another through ``vj.checkpoint.Manager``; exact, and training continues as on the saved plan."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trees_equal
from test_relayout import (
    BEFORE,
    GRADS,
    PARAMS,
    as_numpy,
    logical,
    per_device,
    plan_of,
    setup,
    train,
    trained,
)

import vescale_jax as vj
from vescale_jax.optim._logical_view import logical_view
from vescale_jax.state._sharded import ShardedParams


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


def sharded_views(state):
    return [
        logical(x)
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, ShardedParams))
        if isinstance(x, ShardedParams)
    ]


@pytest.mark.parametrize(
    ("opt", "a", "b"),
    [
        pytest.param("shampoo", "m8", "m3", id="shampoo-m8-m3"),
        pytest.param("muon", "m3", "m8", id="muon-m3-m8", marks=pytest.mark.slow),
        pytest.param("shampoo", "m1", "m8", id="shampoo-m1-m8", marks=pytest.mark.slow),
        pytest.param("muon", "m8", "m1", id="muon-m8-m1", marks=pytest.mark.slow),
    ],
)
def test_optimizer_state_restores_into_another_device_count(tmp_path, opt, a, b):
    sp_a, state_a = trained(opt, a)
    with vj.checkpoint.Manager(tmp_path) as mngr:
        mngr.save(BEFORE, params=sp_a, opt_state=state_a, metadata={"opt": opt})
        mngr.wait()
        plan_b, tx_b, _, _ = setup(opt, b)
        template = jax.eval_shape(tx_b.init, jax.eval_shape(lambda: vj.shard(PARAMS, plan_b)))
        r = mngr.restore(params=plan_b, opt_state=template)
    assert r.step == BEFORE and r.metadata == {"opt": opt}
    assert jax.tree.structure(r.opt_state) == jax.tree.structure(template)
    assert all(x.layout is not None and x.layout.plan == plan_b for x in per_device(r.opt_state))
    # Exact: the PerDevice leaves' logical views, the ShardedParams leaves' logical trees, the counts.
    assert_trees_equal(logical_view(per_device(r.opt_state)), logical_view(per_device(state_a)), what="PerDevice")
    assert_trees_equal(sharded_views(r.opt_state), sharded_views(state_a), what="ShardedParams")
    counts = lambda s: [
        np.asarray(x)
        for x in jax.tree.leaves(s, is_leaf=lambda x: isinstance(x, ShardedParams))
        if not isinstance(x, ShardedParams) and np.ndim(x) == 0
    ]
    assert_trees_equal(counts(r.opt_state), counts(state_a), what="counts")
    assert_trees_equal(logical(r.params), logical(sp_a), what="params")
    # Training continues on the new device count as on the old one.
    sp_a2, _ = train(opt, a, GRADS[BEFORE:], sp_a, state_a)
    sp_b2, _ = train(opt, b, GRADS[BEFORE:], r.params, r.opt_state)
    for x, y in zip(as_numpy(logical(sp_a2)), as_numpy(logical(sp_b2)), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)


def test_low_precision_state_restores_in_its_own_dtype(tmp_path):
    """A bf16 momentum over fp32 params (ShardedParams and compact PerDevice moments) keeps its dtype."""
    plans = {name: plan_of("muon", name) for name in ("m3", "m8")}
    txs = {n: vj.optim.muon(0.01, plan=p, mu_dtype=jnp.bfloat16) for n, p in plans.items()}
    _, _, _, shard = setup("muon", "m3")
    sp = shard(PARAMS)
    state = txs["m3"].init(sp)
    u, state = jax.jit(txs["m3"].update)(shard(GRADS[0]), state, sp)
    sp = optax.apply_updates(sp, u)
    low = [x for x in jax.tree.leaves(state) if x.dtype == jnp.bfloat16]
    assert low, "the test needs bf16 state"
    with vj.checkpoint.Manager(tmp_path) as mngr:
        mngr.save(1, params=sp, opt_state=state)
        mngr.wait()
        for name in ("m3", "m8"):
            template = jax.eval_shape(txs[name].init, jax.eval_shape(lambda n=name: vj.shard(PARAMS, plans[n])))
            r = mngr.restore(params=plans[name], opt_state=template)
            assert [x.dtype for x in jax.tree.leaves(r.opt_state)] == [x.dtype for x in jax.tree.leaves(template)]
            assert_trees_equal(sharded_views(r.opt_state), sharded_views(state), what=f"ShardedParams on {name}")
            assert_trees_equal(
                logical_view(per_device(r.opt_state)), logical_view(per_device(state)), what=f"PerDevice on {name}"
            )
