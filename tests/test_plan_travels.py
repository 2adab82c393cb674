"""The plan travels with the data: ``vj.fsdp``, ``vj.apply``, ``vj.init_opt_state`` and every ``vj.optim``
transformation read it from the ``ShardedParams`` they see. Without ``plan=`` they give the same results, bit for
bit, as with it; a ``plan=`` other than the data's raises, saying how the two plans differ."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

import vescale_jax as vj


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's bias corrections mix a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def make_params():
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "w1": jax.random.normal(k[0], (8, 12), jnp.float32),
        "b1": jax.random.normal(k[1], (12,), jnp.float32),
        "w2": jax.random.normal(k[2], (12, 4), jnp.float32),
    }


def granularity(path, leaf):
    return vj.rows(4) if leaf.ndim >= 2 else vj.element()


def setup():
    params = make_params()
    mesh = make_mesh(3)
    plan = vj.plan(params, mesh, granularity=granularity)
    # Another plan of the same tree: b1 kept whole on one device.
    other = vj.plan(params, mesh, granularity=lambda p, x: vj.whole() if x.ndim == 1 else granularity(p, x))
    return params, plan, other


def model(p, x):
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]


def objective(sp):
    p = vj.unshard(sp)
    return sum(jnp.sum(jnp.sin(x) * x) for x in jax.tree.leaves(p))


MATRICES = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
LABELS = lambda p: jax.tree.map(lambda x: "adam" if x.ndim >= 2 else "sgd", p)

OPTIMIZERS = {
    "muon": lambda plan: vj.optim.muon(learning_rate=0.02, weight_decay=0.1, plan=plan),
    "scale_by_muon": lambda plan: vj.optim.scale_by_muon(plan=plan),
    "scale_by_shape": lambda plan: vj.optim.scale_by_shape(plan=plan),
    "shampoo": lambda plan: vj.optim.shampoo(1e-2, block_size=4, weight_decay=0.1, plan=plan),
    "scale_by_shampoo": lambda plan: vj.optim.scale_by_shampoo(block_size=4, plan=plan),
    "adamw_8bit": lambda plan: vj.optim.adamw_8bit(1e-2, block=(4, 4), min_size=16, plan=plan),
    "scale_by_adam_8bit": lambda plan: vj.optim.scale_by_adam_8bit(block=(4, 4), min_size=16, plan=plan),
    "adamw": lambda plan: vj.optim.adamw(1e-2, mask=MATRICES, plan=plan),
    "add_decayed_weights": lambda plan: vj.optim.add_decayed_weights(0.1, MATRICES, plan=plan),
    "masked": lambda plan: vj.optim.masked(optax.adam(1e-2), MATRICES, plan=plan),
    "masked_compact": lambda plan: vj.optim.masked(optax.adam(1e-2), MATRICES, plan=plan, compact=True),
    "partition": lambda plan: vj.optim.partition({"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2)}, LABELS, plan=plan),
    "multi_transform": lambda plan: vj.optim.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(1e-2)}, LABELS, plan=plan
    ),
    "lamb": lambda plan: vj.optim.lamb(1e-2, weight_decay=0.1, plan=plan),
    "lars": lambda plan: vj.optim.lars(1e-2, weight_decay=0.1, plan=plan),
    "scale_by_trust_ratio": lambda plan: vj.optim.scale_by_trust_ratio(plan=plan),
    "scale_by_param_block_norm": lambda plan: vj.optim.scale_by_param_block_norm(plan=plan),
    "scale_by_param_block_rms": lambda plan: vj.optim.scale_by_param_block_rms(plan=plan),
    "clip_by_block_rms": lambda plan: vj.optim.clip_by_block_rms(0.5, plan=plan),
}


def run(tx, sp, steps=3):
    """``steps`` jitted updates; every update, the final params and the final state as flat numpy arrays."""
    update = jax.jit(tx.update)
    grad = jax.jit(jax.grad(objective))
    state = vj.init_opt_state(tx, sp)
    out = []
    for _ in range(steps):
        u, state = update(grad(sp), state, sp)
        sp = optax.apply_updates(sp, u)
        out += [np.asarray(x) for x in jax.tree.leaves(u)]
    return out + [np.asarray(x) for x in jax.tree.leaves((sp, state))]


def assert_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


# The default run covers one optimizer of each kind (owner routing, blocks, 8-bit blocks, masks, labels, per-leaf
# reductions); the others compose the same mechanism and run with -m slow.
DEFAULT = {"muon", "shampoo", "adamw_8bit", "masked_compact", "partition", "lamb"}


@pytest.mark.parametrize(
    "name", [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in sorted(OPTIMIZERS)]
)
def test_optimizer_reads_the_plan_from_the_params(name):
    params, plan, _ = setup()
    factory = OPTIMIZERS[name]
    given = run(factory(plan), vj.shard(params, plan))
    free = run(factory(None), vj.shard(params, plan))
    assert_identical(free, given)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_refuses_another_plan(name):
    params, plan, other = setup()
    sp = vj.shard(params, plan)
    tx = OPTIMIZERS[name](other)
    with pytest.raises(ValueError, match=r"another plan.*leaf 'b1' differs.*whole.*plan=params\.plan"):
        state = tx.init(sp)
        tx.update(sp, state, sp)


def test_optax_wrappers_without_the_plan():
    """optax.chain, optax.inject_hyperparams, optax.MultiSteps and optax.tree.map_params over plan-free ones."""
    params, plan, _ = setup()
    for build in (
        lambda plan: optax.chain(optax.clip_by_global_norm(1.0), vj.optim.muon(0.02, plan=plan)),
        lambda plan: optax.inject_hyperparams(vj.optim.muon, static_args=("ns_steps",))(learning_rate=0.02, plan=plan),
        lambda plan: optax.MultiSteps(vj.optim.shampoo(1e-2, block_size=4, plan=plan), every_k_schedule=2),
    ):
        assert_identical(run(build(None), vj.shard(params, plan)), run(build(plan), vj.shard(params, plan)))
    tx = vj.optim.muon(0.02)
    sp = vj.shard(params, plan)
    with pytest.raises(ValueError, match=r"map_params calls init without params.*tx\.init\(params\) first"):
        optax.tree.map_params(tx, lambda v: v, None)
    state = tx.init(sp)
    same = optax.tree.map_params(tx, lambda v: v, state)
    assert jax.tree.structure(same) == jax.tree.structure(state)


def test_init_opt_state_reads_the_plan_from_the_params():
    params, plan, other = setup()
    sp = vj.shard(params, plan)
    tx = vj.optim.muon(0.02)
    free, given = vj.init_opt_state(tx, sp), vj.init_opt_state(tx, sp, plan=plan)
    assert_identical(jax.tree.leaves(free), jax.tree.leaves(given))
    assert jax.tree.structure(free) == jax.tree.structure(given)
    with pytest.raises(ValueError, match=r"vj.init_opt_state: .*another plan.*leaf 'b1' differs"):
        vj.init_opt_state(tx, sp, plan=other)


def test_apply_reads_the_plan_from_the_params():
    params, plan, other = setup()
    sp = vj.shard(params, plan)
    x = jax.device_put(jnp.arange(6 * 8, dtype=jnp.float32).reshape(6, 8) / 40, vj.data_sharding(plan))
    with jax.set_mesh(plan.mesh):
        free = vj.apply(model, sp, x)
        given = vj.apply(model, sp, x, plan=plan)
        np.testing.assert_array_equal(np.asarray(free), np.asarray(given))
        with pytest.raises(ValueError, match=r"vj.apply: .*another plan.*leaf 'b1' differs"):
            vj.apply(model, sp, x, plan=other)


def test_fsdp_reads_the_plan_from_the_params():
    params, plan, other = setup()
    tx = vj.optim.muon(0.02)
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.standard_normal((6, 8)).astype(np.float32), "y": rng.standard_normal((6, 4)).astype(np.float32)}
        for _ in range(3)
    ]

    def step(p, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda q: jnp.mean((vj.apply(model, q, batch["x"]) - batch["y"]) ** 2))(p)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    def train(compiled):
        sp = vj.shard(params, plan)
        opt_state = vj.init_opt_state(tx, sp)
        out = []
        for batch in batches:
            sp, opt_state, loss = compiled(sp, opt_state, batch)
            out.append(np.asarray(loss))
        return out + [np.asarray(x) for x in jax.tree.leaves((sp, opt_state))]

    assert_identical(train(vj.fsdp(step)), train(vj.fsdp(step, plan=plan)))
    sp = vj.shard(params, plan)
    with pytest.raises(ValueError, match=r"vj.fsdp: params were sharded with another plan.*leaf 'b1' differs"):
        vj.fsdp(step, plan=other)(sp, vj.init_opt_state(tx, sp), batches[0])


def test_stand_ins_hold_the_step_policy():
    """A stacked layer group's stand-ins carry the enclosing step's one policy (not copies of its options)."""
    params = {"layers": {"w": jax.random.normal(jax.random.key(1), (2, 8, 8), jnp.float32)}}
    plan = vj.plan(params, make_mesh(2), stacked=("layers",))
    seen = []

    def body(p, h):
        return jnp.tanh(h @ p["w"])

    def net(p, x):
        seen.append(p["layers"]["w"])
        return vj.scan_layers(body, p["layers"], x)

    @vj.fsdp(reshard_after_forward=False, prefetch=True, donate=False)
    def loss_step(p, _, x):
        return jnp.mean(vj.apply(net, p, x))

    loss_step(vj.shard(params, plan), None, np.ones((4, 8), np.float32))
    (shard,) = seen
    assert isinstance(shard, vj.LayerShard)
    policy = shard.policy
    assert (policy.reshard_after_forward, policy.prefetch, policy.data_axes) == (False, True, ("fsdp",))
    assert not hasattr(shard, "prefetch") and not hasattr(shard, "precision")


def test_plan_free_tables_are_built_when_the_params_are_first_seen():
    """Without plan= nothing plan-dependent happens at construction; a layout that cuts a block is refused when
    init first sees params of that plan, with the message the plan-given form gives at construction."""
    params = make_params()
    plan = vj.plan(params, make_mesh(3))  # element granularity: device boundaries inside rows
    tx = vj.optim.shampoo(1e-2, block_size=4)
    with pytest.raises(ValueError, match=r"vj\.rows\(4\)") as free:
        tx.init(vj.shard(params, plan))
    with pytest.raises(ValueError, match=r"vj\.rows\(4\)") as given:
        vj.optim.shampoo(1e-2, block_size=4, plan=plan)
    assert str(free.value) == str(given.value)
