"""Optax over ShardedParams: masks / labels over the logical tree, per-leaf segment reductions, clear errors for
per-leaf logic mapped over the flat buckets, and the element-wise transforms that are safe as they are."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import assert_trees_close

import vescale_jax as vj
from vescale_jax.state._guards import PerLeafOnBucketsError

STEPS = 3


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's bias corrections mix float and int32 counts: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def tree():
    """Matrices, vectors and a stacked group whose widths no device count divides (padding in every bucket)."""
    rng = np.random.default_rng(0)
    arr = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    return {
        "embed": {"w": arr(13, 7), "b": arr(7)},
        "layers": {"w": arr(3, 9, 5), "b": arr(3, 5)},
        "head": {"scale": arr(10), "w": arr(4, 6)},
    }


@functools.cache
def setup(m):
    params = tree()
    plan = vj.plan(params, make_mesh(m), stacked=["layers"])
    grads = [jax.tree.map(lambda x, k=k: jnp.sin((k + 2) * x) + 0.1 * k, params) for k in range(STEPS)]
    return params, plan, grads


@functools.cache
def sharded(m):
    """The params and grads of ``setup(m)`` as ShardedParams (one compile)."""
    params, plan, grads = setup(m)
    shard = jax.jit(lambda xs: vj.state._sharded.pack(xs, plan), out_shardings=plan.shardings())
    return [vj.ShardedParams(shard(jax.tree.leaves(t)), plan) for t in [params, *grads]]


def run_cases(cases, m, steps=STEPS):
    """For each ``name: (tx_ref, tx)``, ``steps`` updates of ``tx_ref`` on the logical tree and of ``tx`` on its
    ShardedParams, all in one jit (one compile); returns ``name: (reference params, unsharded params)``."""
    params, plan, grads = setup(m)

    def run(params, grads, sp, sgrads):
        out = {}
        for name, (tx_ref, tx) in cases.items():
            p_ref, s_ref, p, s = params, tx_ref.init(params), sp, tx.init(sp)
            for g, sg in zip(grads[:steps], sgrads, strict=False):
                u, s_ref = tx_ref.update(g, s_ref, p_ref)
                p_ref = optax.apply_updates(p_ref, u)
                u, s = tx.update(sg, s, p)
                p = optax.apply_updates(p, u)
            full = [jax.reshard(x, jax.sharding.PartitionSpec()) for x in p.buffers]  # gathered, as vj.unshard
            out[name] = (p_ref, jax.tree_util.tree_unflatten(plan.treedef, vj.state._sharded.unpack(full, plan)))
        return out

    with jax.set_mesh(plan.mesh):
        sp, *sgrads = sharded(m)
        return jax.jit(run)(params, grads, sp, sgrads)


def max_rel_diff(ref, got):
    out = {}
    for (path, r), g in zip(jax.tree_util.tree_flatten_with_path(ref)[0], jax.tree.leaves(got), strict=True):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        out[jax.tree_util.keystr(path)] = float(np.max(np.abs(r - g)) / max(np.max(np.abs(r)), 1e-30))
    return out


no_bias_decay = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)
labels_fn = lambda p: jax.tree.map(lambda x: "matrix" if x.ndim >= 2 else "vector", p)


# --- Per-leaf logic mapped over the buckets: a clear error, not a wrong answer -----------------------------------


def test_shape_based_masks_and_labels_on_sharded_params_raise():
    params, plan, grads = setup(3)
    sp, g = vj.shard(params, plan), vj.shard(grads[0], plan)
    with jax.set_mesh(plan.mesh):
        with pytest.raises(
            PerLeafOnBucketsError, match=r"optax\.masked.*'embed:float32' \(\d+,\) -> False.*vj\.optim\.adamw"
        ):
            tx = optax.adamw(0.1, mask=no_bias_decay)
            tx.update(g, tx.init(sp), sp)
        with pytest.raises(PerLeafOnBucketsError, match=r"partition.*vj\.optim\.partition"):
            tx = optax.partition({"matrix": optax.adam(0.1), "vector": optax.sgd(0.1)}, labels_fn)
            tx.update(g, tx.init(sp), sp)
        with pytest.raises(PerLeafOnBucketsError, match=r"optax\.contrib\.muon.*vj\.optim\.muon"):
            tx = optax.contrib.muon(0.1)
            tx.update(g, tx.init(sp), sp)
        with pytest.raises(
            PerLeafOnBucketsError,
            match=r"'head:float32' \(\d+,\) -> False.*'layers:float32' "
            r"\(3, \d+\) -> True.*vj\.optim\.masked",
        ):
            jax.tree.map(lambda x: x.ndim >= 2, sp)


PER_LEAF_OPTAX = {  # optax's per-leaf norm / shape transformations -> the replacement the error names
    "lamb": (lambda: optax.lamb(0.1), "scale_by_trust_ratio", r"vj\.optim\.lamb"),
    "lars": (lambda: optax.lars(0.1), "scale_by_trust_ratio", r"vj\.optim\.lars"),
    "fromage": (lambda: optax.fromage(0.1), "scale_by_trust_ratio", r"fromage has no vj\.optim version"),
    "inject_hyperparams(lamb)": (
        lambda: optax.inject_hyperparams(optax.lamb)(learning_rate=0.1),
        "scale_by_trust_ratio",
        r"vj\.optim\.lamb",
    ),
    "scale_by_trust_ratio": (
        lambda: optax.chain(optax.sgd(0.1), optax.scale_by_trust_ratio()),
        "scale_by_trust_ratio",
        r"vj\.optim\.scale_by_trust_ratio",
    ),
    "scale_by_param_block_norm": (
        lambda: optax.chain(optax.scale_by_param_block_norm(), optax.scale(-0.1)),
        "scale_by_param_block_norm",
        r"vj\.optim\.scale_by_param_block_norm",
    ),
    "scale_by_param_block_rms": (
        lambda: optax.chain(optax.scale_by_param_block_rms(), optax.scale(-0.1)),
        "scale_by_param_block_rms",
        r"vj\.optim\.scale_by_param_block_rms",
    ),
    "clip_by_block_rms": (
        lambda: optax.chain(optax.clip_by_block_rms(0.4), optax.sgd(0.1)),
        "clip_by_block_rms",
        r"vj\.optim\.clip_by_block_rms",
    ),
    "adafactor": (lambda: optax.adafactor(0.1), "scale_by_factored_rms", r"vj\.optim has no adafactor"),
    "sm3": (lambda: optax.sm3(0.1), "scale_by_sm3", r"vj\.optim has no sm3"),
    "novograd": (lambda: optax.novograd(0.1), "scale_by_novograd", r"vj\.optim has no novograd"),
}


@pytest.mark.parametrize("name", sorted(PER_LEAF_OPTAX))
def test_optax_per_leaf_transforms_on_sharded_params_raise_at_the_first_step(name):
    """optax.lamb & co. under vj.init_opt_state and a vj.fsdp step: raised at init or at the first update (was:
    one trust ratio per bucket, silently), naming a bucket's leaves and the vj.optim replacement."""
    params, plan, _ = setup(3)
    make, transform, fix = PER_LEAF_OPTAX[name]
    tx = make()
    sp = vj.shard(params, plan)

    @vj.fsdp(donate=False)
    def step(p, o, batch):
        u, o = tx.update(jax.tree.map(jnp.sin, p), o, p)  # element-wise gradients, computed on the shards
        return optax.apply_updates(p, u), o

    with pytest.raises(
        PerLeafOnBucketsError, match=rf"optax\.{transform} was applied to a vj\.ShardedParams.*{fix}"
    ) as e:
        step(sp, vj.init_opt_state(tx, sp), jnp.ones((3, 1)))
    assert "'embed:float32' (" in str(e.value) and "embed/b, embed/w" in str(e.value)


def test_optax_trust_ratio_is_allowed_when_every_bucket_holds_one_leaf():
    """One leaf per bucket: a per-bucket norm is the leaf's (the padding is zero), so optax.lamb runs and
    matches optax on the logical tree."""
    params = {"w": tree()["embed"]["w"], "b": tree()["head"]["scale"]}
    plan = vj.plan(params, make_mesh(3))
    assert all(len(b.leaves) == 1 for b in plan.buckets)
    tx = optax.lamb(0.1)
    grads = jax.tree.map(lambda x: jnp.sin(2 * x), params)
    with jax.set_mesh(plan.mesh):
        sp = vj.shard(params, plan)
        u, _ = jax.jit(tx.update)(vj.shard(grads, plan), vj.init_opt_state(tx, sp), sp)
    want, _ = tx.update(grads, tx.init(params), params)
    assert_trees_close(vj.unshard(u), want)


def test_a_logical_mask_tree_that_does_not_match_names_the_plan_leaves():
    params, plan, _ = setup(1)
    sp = vj.shard(params, plan)
    tx = vj.optim.masked(optax.sgd(0.1), {"embed": True, "head": False})  # "layers" missing
    with pytest.raises(ValueError, match=r"does not match the plan's logical tree.*embed/w"):
        tx.init(sp)
    tx = vj.optim.partition({"matrix": optax.sgd(0.1)}, labels_fn)
    with pytest.raises(ValueError, match=r"leaf 'embed/b' has label 'vector'.*no transformation"):
        tx.init(sp)
    tx = vj.optim.masked(optax.sgd(0.1), lambda p: jax.tree.map(lambda x: x.sum() > 0, p))  # needs values
    with pytest.raises(TypeError, match=r"mask function failed on the plan's logical abstract tree.*ShapeDtypeStruct"):
        tx.init(sp)
    tx = vj.optim.masked(optax.sgd(0.1), {"embed": True, "layers": jnp.array(True), "head": False})
    with pytest.raises(TypeError, match=r"mask at \['layers'\] is Array.*not a mask value"):
        tx.init(sp)


# --- Masks, labels and per-leaf reductions match optax on the logical tree ----------------------------------------


@pytest.mark.parametrize("m", [1, 3, 8], ids=lambda m: f"m{m}")
def test_masks_partition_and_lamb_match_optax_on_the_logical_tree(m):
    """adamw(mask), lamb and partition on every device count; the other masked / partition forms on 3."""
    mask_tree = {"embed": {"w": True, "b": False}, "layers": True, "head": False}  # a prefix tree
    label_tree = {"embed": "matrix", "layers": {"w": "matrix", "b": "vector"}, "head": "vector"}
    cases = {
        "adamw(mask=fn)": (
            optax.adamw(0.1, weight_decay=0.5, mask=no_bias_decay),
            vj.optim.adamw(0.1, weight_decay=0.5, mask=no_bias_decay),
        ),
        "lamb(mask=tree)": (
            optax.lamb(0.1, weight_decay=0.2, mask=mask_tree),
            vj.optim.lamb(0.1, weight_decay=0.2, mask=mask_tree),
        ),
        "masked(adam)": (optax.masked(optax.adam(0.1), mask_tree), vj.optim.masked(optax.adam(0.1), mask_tree)),
        "partition(fn)": (
            optax.partition({"matrix": optax.adam(0.1), "vector": optax.sgd(0.05, 0.9)}, labels_fn),
            vj.optim.partition({"matrix": optax.adam(0.1), "vector": optax.sgd(0.05, 0.9)}, labels_fn),
        ),
        "partition(tree, compact)": (
            optax.partition({"matrix": optax.adam(0.1), "vector": optax.lion(0.05)}, label_tree),
            vj.optim.partition({"matrix": optax.adam(0.1), "vector": optax.lion(0.05)}, label_tree, compact=True),
        ),
        "partition(lamb, clip)": (
            optax.partition(
                {"matrix": optax.lamb(0.1), "vector": optax.chain(optax.clip_by_global_norm(0.3), optax.sgd(0.1))},
                labels_fn,
            ),
            vj.optim.partition(
                {"matrix": vj.optim.lamb(0.1), "vector": optax.chain(optax.clip_by_global_norm(0.3), optax.sgd(0.1))},
                labels_fn,
            ),
        ),
    }
    if m != 3:
        cases = {k: cases[k] for k in ("adamw(mask=fn)", "lamb(mask=tree)", "partition(fn)")}
    params = setup(m)[0]
    for name, case in cases.items():  # one jit each: XLA:CPU compiles several small programs faster than one
        ref, got = run_cases({name: case}, m, steps=2)[name]
        assert_trees_close(got, ref, what=name)
        assert max(max_rel_diff(params, got).values()) > 1e-2, name  # the steps moved the params


def test_leaf_norms_match_the_logical_leaves():
    params, plan, _ = setup(8)
    sp = vj.shard(params, plan)
    with jax.set_mesh(plan.mesh):
        norms = jax.jit(vj.optim.leaf_norms)(sp)
    for (path, x), n in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(norms), strict=True):
        np.testing.assert_allclose(float(n), float(jnp.linalg.norm(x)), rtol=1e-6, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_per_leaf_reductions_match_optax():
    cases = {
        "trust_ratio": (
            optax.chain(optax.sgd(0.1), optax.scale_by_trust_ratio(min_norm=0.1, eps=1e-3)),
            optax.chain(optax.sgd(0.1), vj.optim.scale_by_trust_ratio(min_norm=0.1, eps=1e-3)),
        ),
        "block_norm_rms": (
            optax.chain(optax.clip_by_block_rms(0.4), optax.scale_by_param_block_rms(), optax.scale(-0.1)),
            optax.chain(vj.optim.clip_by_block_rms(0.4), vj.optim.scale_by_param_block_rms(), optax.scale(-0.1)),
        ),
        "lars": (
            optax.lars(
                0.1,
                weight_decay=0.1,
                weight_decay_mask=no_bias_decay,
                trust_coefficient=0.01,
                trust_ratio_mask={"embed": True, "layers": False, "head": True},
            ),
            vj.optim.lars(
                0.1,
                weight_decay=0.1,
                weight_decay_mask=no_bias_decay,
                trust_coefficient=0.01,
                trust_ratio_mask={"embed": True, "layers": False, "head": True},
            ),
        ),
        "block_norm": (
            optax.chain(optax.scale_by_param_block_norm(), optax.scale(-0.01)),
            optax.chain(vj.optim.scale_by_param_block_norm(), optax.scale(-0.01)),
        ),
    }
    for name, (ref, got) in run_cases(cases, 3).items():
        assert_trees_close(got, ref, what=name)


# --- Element-wise optax transforms: safe on ShardedParams as they are (the list docs/optax.md gives) --------------


ELEMENTWISE = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd(momentum, nesterov)": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(0.1),
    "adamw": lambda: optax.adamw(0.1, weight_decay=0.1),
    "nadamw": lambda: optax.nadamw(0.1),
    "adamax": lambda: optax.adamax(0.1),
    "amsgrad": lambda: optax.amsgrad(0.1),
    "adabelief": lambda: optax.adabelief(0.1),
    "adagrad": lambda: optax.adagrad(0.1),
    "adadelta": lambda: optax.adadelta(0.1),
    "rmsprop": lambda: optax.rmsprop(0.1, momentum=0.5),
    "yogi": lambda: optax.yogi(0.1),
    "lion": lambda: optax.lion(0.1),
    "sign_sgd": lambda: optax.sign_sgd(0.1),
    "rprop": lambda: optax.rprop(0.1),
    "clip + zero_nans + ema": lambda: optax.chain(
        optax.zero_nans(), optax.clip(0.5), optax.ema(0.9), optax.scale(-0.1)
    ),
    "clip_by_global_norm + adamw": lambda: optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(0.1)),
    "apply_if_finite(adam)": lambda: optax.apply_if_finite(optax.adam(0.1), 3),
    "MultiSteps(adam)": lambda: optax.MultiSteps(optax.adam(0.1), 2),
    "schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(0.1),
}


def test_elementwise_transforms_match_optax_as_they_are():
    results = run_cases({name: (make(), make()) for name, make in ELEMENTWISE.items()}, 3, steps=2)
    worst = {name: max(max_rel_diff(ref, got).values()) for name, (ref, got) in results.items()}
    assert max(worst.values()) <= 1e-5, worst
