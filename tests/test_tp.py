"""FSDP composed with tensor and expert parallelism: a Megatron-style GPT (column/row-parallel attention and MLP)
and a mixture of experts split over ``expert``, each against the unsharded model."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_trees_close, assert_trees_equal, batches, load_script, loss_fn, reference_run

import vescale_jax as vj

gpt_tp = load_script("examples/gpt_tp.py")

# Widths no fsdp size divides; 4 heads and an MLP width of 40 split over tensor = 2 or 4.
BASE = dict(vocab=257, max_len=16, d_model=24, num_heads=4, num_layers=2, d_ff=40)
MESHES = {  # id: (fsdp, other axis size, other axis name, experts)
    "fsdp2xtensor4": (2, 4, "tensor", 0),
    "fsdp4xtensor2": (4, 2, "tensor", 0),
    "fsdp3xtensor2": (3, 2, "tensor", 0),
    "fsdp2xexpert4": (2, 4, "expert", 8),
    "fsdp2xexpert4-data": (2, 4, "expert", 8),  # the batch split over expert too (tokens travel to the experts)
}


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam bias correction mixes float and int32
        yield


def make_tx():
    # A clip that binds: the global norm must see every shard of every TP group once.
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3, weight_decay=0.1))


def configs(experts: int, axis: str):
    """(reference config without axes, config with the TP/EP axis)."""
    ref = gpt_tp.Config(**BASE, num_experts=experts)
    return ref, gpt_tp.Config(**BASE, num_experts=experts, **{axis: axis})


def tp_mesh(fsdp: int, size: int, axis: str) -> jax.sharding.Mesh:
    if fsdp * size > len(jax.devices()):
        pytest.skip(f"needs {fsdp * size} devices")
    return jax.make_mesh((fsdp, size), ("fsdp", axis), devices=jax.devices()[: fsdp * size])


def tp_plan(cfg, mesh, **kw):
    _, shapes = gpt_tp.abstract_model(cfg)
    return vj.plan(shapes, mesh, stacked=("blocks",), tp=gpt_tp.partition_spec(cfg), **kw)


_REFERENCES = {}


def reference(experts: int):
    """The unsharded run's final params and losses (once per model)."""
    if experts not in _REFERENCES:
        ref_cfg, _ = configs(experts, "expert" if experts else "tensor")
        graphdef, params = gpt_tp.split_model(ref_cfg, jax.random.key(0))
        out = reference_run(params, lambda p, x: nnx.merge(graphdef, p)(x), make_tx(), batches(20, batch=24))
        _REFERENCES[experts] = (params, *out)
    return _REFERENCES[experts]


@pytest.mark.parametrize(
    "mesh_id",
    [
        "fsdp2xtensor4",
        pytest.param("fsdp4xtensor2", marks=pytest.mark.slow),
        pytest.param("fsdp3xtensor2", marks=pytest.mark.slow),  # odd fsdp: one step of it runs by default below
        "fsdp2xexpert4",
        pytest.param("fsdp2xexpert4-data", marks=pytest.mark.slow),
    ],
)
def test_tp_training_matches_unsharded(mesh_id):
    fsdp, size, axis, experts = MESHES[mesh_id]
    params, ref, ref_losses = reference(experts)
    _, cfg = configs(experts, axis)
    data_axes = None
    if mesh_id.endswith("-data"):  # expert parallelism as data parallelism for everything but the experts
        cfg, data_axes = dataclasses.replace(cfg, expert_data=True), ("fsdp", axis)
    mesh = tp_mesh(fsdp, size, axis)
    plan = tp_plan(cfg, mesh)
    assert plan.tp_axes == (axis,)
    graphdef, _ = gpt_tp.abstract_model(cfg)
    tx = make_tx()

    @vj.fsdp(plan=plan, data_axes=data_axes)
    def step(p, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"]))(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, {"loss": loss}

    sp, opt_state, losses = vj.shard(params, plan), None, []
    opt_state = vj.init_opt_state(tx, sp)
    for batch in batches(20, batch=24):
        sp, opt_state, metrics = step(sp, opt_state, batch)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref)
    for buf, bucket in zip(opt_state[1][0].mu.buffers, plan.buckets, strict=True):  # Adam state sharded like params
        assert buf.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, plan.partition_spec(bucket)), buf.ndim)


def test_the_model_sees_tp_local_leaves_and_gradients_match():
    fsdp, size, axis, _ = MESHES["fsdp3xtensor2"]
    ref_cfg, cfg = configs(0, axis)
    mesh = tp_mesh(fsdp, size, axis)
    plan = tp_plan(cfg, mesh)
    graphdef, _ = gpt_tp.abstract_model(cfg)
    ref_graphdef, params = gpt_tp.split_model(ref_cfg, jax.random.key(1))
    batch = next(batches(1, batch=24, seed=3))
    seen = {}

    def model(state, x):
        flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, vj.LayerShard))[0]
        seen.update({vj.plan_path(p): tuple(v.shape) for p, v in flat})
        return nnx.merge(graphdef, state)(x)

    @vj.fsdp(plan=plan, donate=False)
    def grad_step(p, _, batch):
        return jax.value_and_grad(lambda p: loss_fn(vj.apply(model, p, batch["x"]), batch["y"]))(p)

    loss, grads = grad_step(vj.shard(params, plan), None, batch)
    want_loss, want = jax.value_and_grad(lambda p: loss_fn(nnx.merge(ref_graphdef, p)(batch["x"]), batch["y"]))(params)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    assert_trees_close(vj.unshard(grads), want, rtol=2e-6)
    assert seen["head/kernel"] == (24, 257)  # replicated over tensor: the whole leaf
    assert seen["blocks/q/kernel"] == (2, 24, 12)  # column-parallel: half the output features
    assert seen["blocks/down/kernel"] == (2, 20, 24)  # row-parallel: half the input features
    assert seen["blocks/up/bias"] == (2, 20)


@pytest.mark.parametrize(
    "mesh_id",
    [
        pytest.param("fsdp2xtensor4", marks=pytest.mark.slow),
        pytest.param("fsdp3xtensor2", marks=pytest.mark.slow),
        pytest.param("fsdp2xexpert4", marks=pytest.mark.slow),
    ],
)
def test_shard_unshard_and_init_sharded_are_exact(mesh_id):
    fsdp, size, axis, experts = MESHES[mesh_id]
    ref_cfg, cfg = configs(experts, axis)
    plan = tp_plan(cfg, tp_mesh(fsdp, size, axis))
    init = lambda key: gpt_tp.split_model(ref_cfg, key)[1]
    params = init(jax.random.key(2))
    sp = vj.shard(params, plan)
    assert_trees_equal(vj.unshard(sp), params)
    assert_trees_equal(vj.unshard(vj.init_sharded(init, plan, jax.random.key(2))), jax.jit(init)(jax.random.key(2)))
    for bucket, buf in zip(plan.buckets, sp.buffers, strict=True):
        assert buf.shape == bucket.shape
        assert bucket.shape[-1] == bucket.num_groups * bucket.layout.total_size


def test_each_group_holds_its_shards_in_the_shared_layout():
    # The device at (fsdp k, tensor t) holds [k*S, (k+1)*S) of group t's buffer, and group t's buffer is the
    # plain layout of the leaves' t-th tensor-parallel blocks.
    fsdp, size, axis, _ = MESHES["fsdp3xtensor2"]
    ref_cfg, cfg = configs(0, axis)
    mesh = tp_mesh(fsdp, size, axis)
    plan = tp_plan(cfg, mesh)
    init = lambda key: gpt_tp.split_model(ref_cfg, key)[1]
    params = jax.jit(init)(jax.random.key(0))
    sp = vj.init_sharded(init, plan, jax.random.key(0))  # each group packs its own blocks
    leaves = {vj.plan_path(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    grouped = [b for b in plan.buckets if b.groups]
    assert grouped and all(b.groups == (axis,) and b.num_groups == size for b in grouped)
    for bucket in grouped:
        buf = sp.buffers[plan.buckets.index(bucket)]
        n, s = bucket.layout.total_size, bucket.layout.shard_size
        for shard in buf.addressable_shards:
            coords = {a: int(np.argwhere(mesh.devices == shard.device)[0][i]) for i, a in enumerate(mesh.axis_names)}
            t, k = coords[axis], coords["fsdp"]
            want = np.zeros((*buf.shape[:-1], n), buf.dtype)
            for slot, i in enumerate(bucket.leaves):
                spec = plan.leaves[i]
                (d,) = [d for d, axes in enumerate(spec.tp) if axes]
                block = np.split(leaves[spec.path], size, axis=d)[t]
                o = bucket.layout.offsets[slot]
                want[..., o : o + block[0].size] = block.reshape(block.shape[0], -1)
            np.testing.assert_array_equal(np.asarray(shard.data), want[..., k * s : (k + 1) * s])
    # Replicated leaves never share a bucket with split ones; buckets of one unit differ in their groups.
    for bucket in plan.buckets:
        assert {bool(plan.leaves[i].tp) for i in bucket.leaves} == {bool(bucket.groups)}


def test_plan_description_names_the_groups():
    # The summary and the JSON description name the groups; plans without tp are unchanged.
    fsdp, size, axis, _ = MESHES["fsdp2xtensor4"]
    _, cfg = configs(0, axis)
    mesh = tp_mesh(fsdp, size, axis)
    plan = tp_plan(cfg, mesh)
    d = plan.to_dict()
    assert any(b.get("groups") == [axis] for b in d["buckets"])
    assert any(leaf.get("tp") for leaf in d["leaves"])
    assert "split over ('tensor',)" in plan.summary()
    _, shapes = gpt_tp.abstract_model(cfg)
    plain = vj.plan(shapes, mesh, stacked=("blocks",))
    assert not plain.tp_axes and all("groups" not in b for b in plain.to_dict()["buckets"])


def _mlp(params, x, tensor=None):
    """A Megatron MLP: ``w_up`` column-parallel, ``w_down`` row-parallel (the doc page's example)."""
    h = jax.nn.gelu(x @ params["w_up"] + params["b_up"])
    y = h @ params["w_down"]
    return (y if tensor is None else jax.lax.psum(y, tensor)) + params["b_down"]


@pytest.mark.parametrize("kernels", ["xla", "pallas"])
def test_megatron_mlp_gradients_for_each_kernel_policy(kernels):
    # The Pallas interpreter turns shard_map's varying-axes check off: the TP sums must still come out right.
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(0)
    params = {
        "w_up": jax.numpy.asarray(rng.standard_normal((20, 36)) / 5, np.float32),
        "b_up": jax.numpy.asarray(rng.standard_normal(36) / 9, np.float32),
        "w_down": jax.numpy.asarray(rng.standard_normal((36, 20)) / 6, np.float32),
        "b_down": jax.numpy.asarray(rng.standard_normal(20) / 9, np.float32),
    }
    specs = {"w_up": P(None, "tensor"), "b_up": P("tensor"), "w_down": P("tensor", None), "b_down": None}
    plan = vj.plan(params, tp_mesh(2, 4, "tensor"), tp=specs)
    x = jax.numpy.asarray(rng.standard_normal((16, 20)), np.float32)
    loss = lambda out: jax.numpy.mean(jax.numpy.sin(out))

    @vj.fsdp(plan=plan, donate=False, kernels=vj.kernels.KernelPolicy(mode=kernels))
    def value_and_grad(sp, _, x):
        return jax.value_and_grad(lambda p: loss(vj.apply(lambda q, x: _mlp(q, x, "tensor"), p, x)))(sp)

    value, grads = value_and_grad(vj.shard(params, plan), None, x)
    want, want_grads = jax.value_and_grad(lambda p: loss(_mlp(p, x)))(params)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-5)
    assert_trees_close(vj.unshard(grads), want_grads, rtol=1e-5)


def test_tp_step_nested_in_jit_gives_the_steps_own_results():
    """The FSDP x tensor step called from an outer ``jax.jit`` (host batch, as in an export) traces in the plan's
    mesh as its context mesh: the same loss and parameters as the step called directly, with a loss whose
    backward gathers by integer labels (optax's cross entropy)."""
    cfg = gpt_tp.Config(vocab=64, max_len=8, d_model=16, num_heads=4, num_layers=1, d_ff=32, tensor="tensor")
    mesh = tp_mesh(2, 4, "tensor")
    plan = tp_plan(cfg, mesh)
    graphdef, params = gpt_tp.split_model(cfg, jax.random.key(0))
    tx = optax.sgd(0.1)

    @vj.fsdp(plan=plan)
    def step(p, opt_state, x):
        def loss_of(p):
            logits = vj.flax.nnx_apply(graphdef, p, x[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, x[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_of)(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    x = np.random.default_rng(0).integers(0, cfg.vocab, (8, cfg.max_len)).astype(np.int32)
    sp = vj.shard(params, plan)
    opt_state = vj.init_opt_state(tx, sp)
    nested = jax.jit(lambda p, o, b: step(p, o, b))(sp, opt_state, x)
    direct = step(sp, opt_state, x)
    np.testing.assert_array_equal(np.asarray(nested[2]), np.asarray(direct[2]))
    assert_trees_equal(vj.unshard(nested[0]), vj.unshard(direct[0]))
