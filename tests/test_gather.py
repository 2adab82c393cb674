"""gather_bucket inside shard_map: values, gradients against an unsharded reference, collective census."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICE_COUNTS, make_mesh
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
from vescale_jax.step._wire import gather_bucket, gather_params


@pytest.fixture(params=DEVICE_COUNTS, ids=lambda m: f"m{m}")
def mesh(request):
    return make_mesh(request.param, auto=True)


def model_params(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"embed": (37, 5), "mlp": {"w1": (5, 11), "b1": (11,), "w2": (11, 5)}, "head": (5, 37)}
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def loss_fn(params, x):
    h = params["embed"][x]
    h = jnp.tanh(h @ params["mlp"]["w1"] + params["mlp"]["b1"]) @ params["mlp"]["w2"]
    return jnp.mean(jax.nn.logsumexp(h @ params["head"], axis=-1))


def sharded_loss_and_grad(plan, mesh):
    specs = tuple(plan.partition_spec(b) for b in plan.buckets)

    def local(buffers, x):
        def f(bufs):
            return jax.lax.pmean(loss_fn(gather_params(bufs, plan), x), "fsdp")

        loss, grads = jax.value_and_grad(f)(buffers)
        return loss, grads

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, P()), out_specs=(P(), specs)))


def test_gradients_match_unsharded_reference(mesh):
    params = model_params()
    x = jnp.asarray(np.random.default_rng(1).integers(0, 37, size=(6,)))
    plan = vj.plan(params, mesh, granularity=vj.rows(1))
    sp = vj.shard(params, plan)
    loss, grads = sharded_loss_and_grad(plan, mesh)(sp.buffers, x)
    ref_loss, ref_grads = jax.value_and_grad(loss_fn)(params, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    # Every device computes the same loss, so the reduce-scattered gradient is m times the reference/m.
    got = vj.unshard(vj.ShardedParams(grads, plan))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    for bucket, g in zip(plan.buckets, grads, strict=True):  # padding gets exactly zero gradient
        used = np.zeros(bucket.layout.total_size, bool)
        for n, o in zip(bucket.layout.sizes, bucket.layout.offsets, strict=True):
            used[o : o + n] = True
        assert not np.any(np.asarray(g)[~used])


def test_census_one_all_gather_and_one_reduce_scatter_per_bucket():
    mesh = make_mesh(8, auto=True)
    params = model_params()
    plan = vj.plan(params, mesh, granularity=vj.rows(1))
    x = jnp.zeros((6,), jnp.int32)
    hlo = sharded_loss_and_grad(plan, mesh).lower(vj.shard(params, plan).buffers, x).compile().as_text()
    n = len(plan.buckets)
    assert len(re.findall(r"all-gather(?:-start)?\(", hlo)) == n
    assert len(re.findall(r"reduce-scatter(?:-start)?\(", hlo)) == n
    for line in re.findall(r".*all-reduce(?:-start)?\(.*", hlo):  # only the scalar loss is all-reduced
        assert re.search(r"f32\[\]", line), line


def test_gather_bucket_checks_the_local_shape():
    mesh = make_mesh(2, auto=True)
    plan = vj.plan(model_params(), mesh)
    with pytest.raises(ValueError, match="expects a local shard of shape"):
        jax.shard_map(lambda v: gather_bucket(v, plan.buckets[0], plan)[0], mesh=mesh, in_specs=P(), out_specs=P())(
            jnp.zeros((3,))
        )
