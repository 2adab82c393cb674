"""optim.compact: a subset of leaves gathered into per-device compact vectors and back; on_leaves(tx)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import vescale_jax as vj
from vescale_jax.optim._on_leaves import build_compact, compact, expand, on_leaves


def tree():
    rng = np.random.default_rng(0)
    arr = lambda *s, dt=jnp.float32: jnp.asarray(rng.standard_normal(s), dt)
    return {
        "a": {"w": arr(13, 7), "b": arr(7)},
        "layers": {"w": arr(3, 9, 5), "b": arr(3, 5)},
        "h": {"s": arr(10, dt=jnp.bfloat16), "w": arr(4, 6, dt=jnp.bfloat16)},
    }


@pytest.mark.parametrize("m", [1, 3, 8])
def test_compact_then_expand_keeps_the_chosen_leaves_and_zeroes_the_rest(m):
    params = tree()
    plan = vj.plan(params, make_mesh(m), stacked=["layers"])
    chosen = [len(plan.layer_shape(s)) < 2 for s in plan.leaves]
    tables = build_compact(plan, chosen)
    assert sum(tables.counts) == sum(s.size for s, c in zip(plan.leaves, chosen, strict=True) if c)
    sp = vj.shard(params, plan)
    with jax.set_mesh(plan.mesh):
        c = jax.jit(lambda b: compact(b, plan, tables))(sp.buffers)
        assert c.shape == (m * tables.size,)
        back = jax.jit(lambda v, b: expand(v, b, plan, tables))(c, sp.buffers)
    out = vj.unshard(vj.ShardedParams(back, plan))
    for (path, x), y, keep in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(out), chosen, strict=True
    ):
        want = np.asarray(x) if keep else np.zeros(x.shape, x.dtype)
        np.testing.assert_array_equal(np.asarray(y), want, err_msg=jax.tree_util.keystr(path))


def test_on_leaves_adamw_matches_optax_on_those_leaves():
    params = tree()
    plan = vj.plan(params, make_mesh(3), stacked=["layers"])
    chosen = [len(plan.layer_shape(s)) < 2 for s in plan.leaves]
    tx = on_leaves(optax.adamw(0.1, weight_decay=0.1), plan, chosen)
    ref_tx = optax.adamw(0.1, weight_decay=0.1)
    sp = vj.shard(params, plan)
    with jax.numpy_dtype_promotion("standard"), jax.set_mesh(plan.mesh):
        state = vj.init_opt_state(tx, sp)
        ref_state = ref_tx.init(params)
        for step in range(3):
            grads = jax.tree.map(lambda x, s=step: (x * (s + 1.5)).astype(x.dtype), params)
            u, state = jax.jit(tx.update)(vj.shard(grads, plan), state, sp)
            ref_u, ref_state = ref_tx.update(grads, ref_state, params)
    got = vj.unshard(u)
    for x, y, keep in zip(jax.tree.leaves(ref_u), jax.tree.leaves(got), chosen, strict=True):
        want = np.asarray(x, np.float32) if keep else np.zeros(x.shape, np.float32)
        np.testing.assert_allclose(
            np.asarray(y, np.float32), want, rtol=1e-2 if x.dtype == jnp.bfloat16 else 1e-6, atol=1e-6
        )
    moments = [
        x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, vj.PerDevice)) if isinstance(x, vj.PerDevice)
    ]
    # one compact vector per dtype among the chosen leaves (each moment in its leaf's dtype), for mu and for nu
    dtypes = {np.dtype(s.dtype) for s, keep in zip(plan.leaves, chosen, strict=True) if keep}
    assert len(moments) == 2 * len(dtypes), [x.value.shape for x in moments]
    assert sum(x.value.shape[0] for x in moments) == 2 * 3 * build_compact(plan, chosen).size
