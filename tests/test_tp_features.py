"""Training features on plans whose leaves are split over tensor / expert axes (grouped buckets), against the
unsharded reference: per-leaf masks, labels and reductions (LAMB, LARS, block RMS clipping), the global norm,
8-bit AdamW, the FP8 and bf16 gathers, accumulation, prefetch, keep, split="leaves", HSDP; and the collective
census of the step: FSDP gathers and reduce-scatters within each TP/EP group, only all-reduces over tensor/expert.

The model is ``examples/gpt_tp.py`` on an fsdp × tensor (or × expert) mesh of 8 devices."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import ROOT, assert_trees_close, batches, loss_fn, reference_run

import vescale_jax as vj
import vescale_jax.testing as vt


def _load_example(name: str):
    # Registered in sys.modules before it runs: its dataclass needs its module there.
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


gpt_tp = _load_example("gpt_tp")

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

SIZES = dict(vocab=257, max_len=16, d_model=24, num_heads=4, num_layers=2, d_ff=40)
STEPS = 10


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def config(ax: str) -> "gpt_tp.Config":
    return (
        gpt_tp.Config(**SIZES, tensor="tensor") if ax == "tensor" else gpt_tp.Config(**SIZES, num_experts=8, expert=ax)
    )


def reference(ax: str = "tensor"):
    """``(graphdef, params)`` of the unsharded model (the axes ``None``): the same tree and values."""
    cfg = config(ax)
    return gpt_tp.split_model(gpt_tp.Config(**{**cfg.__dict__, "tensor": None, "expert": None}), jax.random.key(0))


def tp_mesh(ax: str = "tensor", shape=(2, 4), names=None):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names or ("fsdp", ax), devices=jax.devices()[:n])


def tp_plan(ax: str = "tensor", mesh=None, **kw):
    cfg = config(ax)
    _, shapes = gpt_tp.abstract_model(cfg)
    return vj.plan(shapes, mesh or tp_mesh(ax), stacked=("blocks",), tp=gpt_tp.partition_spec(cfg), **kw)


def fsdp_train(plan, tx, data, *, ax="tensor", params=None, accumulate=None, **fsdp_kw):
    """``STEPS`` vj.fsdp steps of the TP model: ``(final params (logical), losses)``."""
    g, _ = gpt_tp.abstract_model(config(ax))
    params = reference(ax)[1] if params is None else params

    def loss_of(p, b):
        return loss_fn(vj.flax.nnx_apply(g, p, b["x"]), b["y"])

    @vj.fsdp(plan=plan, **fsdp_kw)
    def step(p, o, batch):
        if accumulate:
            loss, grads = vj.accumulate(loss_of, p, batch, reduce=accumulate)
        else:
            loss, grads = jax.value_and_grad(loss_of)(p, batch)
        u, o = tx.update(grads, o, p)
        return vj.apply_updates(p, u), o, loss

    sp = vj.shard(params, plan)
    opt = vj.init_opt_state(tx, sp)
    losses = []
    for b in data:
        sp, opt, loss = step(sp, opt, b)
        losses.append(float(loss))
    return vj.unshard(sp), losses


def unsharded(tx, data, ax="tensor"):
    gref, params = reference(ax)
    return reference_run(params, lambda p, x: nnx.merge(gref, p)(x), tx, data)


def check(got, want, *, rtol=1e-5):
    (p, losses), (ref, ref_losses) = got, want
    np.testing.assert_allclose(losses, ref_losses, rtol=rtol)
    assert_trees_close(p, ref, rtol=rtol)


def decay_mask(tree):
    """Weight decay on the matrices except the embeddings (a per-leaf mask over the logical tree)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x.ndim >= 2 and "embed" not in vj.plan_path(p), tree)


def labels(tree):
    return jax.tree_util.tree_map_with_path(lambda p, x: "matrix" if x.ndim >= 2 else "vector", tree)


# --- Per-leaf reductions, masks and labels ---------------------------------------------------------------------


@pytest.mark.slow
def test_lamb_trust_ratios_sum_each_leaf_over_its_tensor_groups():
    data = list(batches(STEPS, batch=24))
    plan = tp_plan()
    got = fsdp_train(plan, vj.optim.lamb(1e-3, weight_decay=0.1, mask=decay_mask, plan=plan), data)
    check(got, unsharded(optax.lamb(1e-3, weight_decay=0.1, mask=decay_mask), data))


@pytest.mark.slow
def test_leaf_norms_and_global_norm_of_a_grouped_plan_are_the_logical_ones():
    plan = tp_plan()
    params = reference()[1]
    assert any(b.groups for b in plan.buckets)

    @jax.jit
    def norms(sp):
        # Padding that went non-zero (an element-wise map over whole buffers) is excluded and zeroed again.
        dirty = vj.ShardedParams([x + 1.0 for x in sp.buffers], plan)
        return vj.optim.leaf_norms(sp), vj.global_norm(sp), vj.global_norm(dirty), vj.zero_padding(dirty)

    with jax.set_mesh(plan.mesh):  # an Explicit-axes mesh: arithmetic on its arrays needs the context
        leaf, total, dirty_total, cleaned = norms(vj.shard(params, plan))
    bumped = jax.tree.map(lambda x: x + 1.0, params)
    assert_trees_close(leaf, jax.tree.map(lambda x: jnp.linalg.norm(jnp.ravel(x)), params), rtol=1e-6)
    np.testing.assert_allclose(float(total), float(optax.global_norm(params)), rtol=1e-6)
    np.testing.assert_allclose(float(dirty_total), float(optax.global_norm(bumped)), rtol=1e-6)
    assert_trees_close(vj.unshard(cleaned), bumped, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw_mask", "multi_transform", "lars", "clip_by_block_rms"])
def test_masks_labels_and_per_leaf_transforms(name):
    data = list(batches(STEPS, batch=24))
    plan = tp_plan()
    pair = {
        "adamw_mask": lambda: (
            vj.optim.adamw(1e-3, weight_decay=0.1, mask=decay_mask, plan=plan),
            optax.adamw(1e-3, weight_decay=0.1, mask=decay_mask),
        ),
        "multi_transform": lambda: tuple(
            mt({"matrix": optax.adamw(1e-3, weight_decay=0.1), "vector": optax.sgd(1e-2)}, labels)
            for mt in (vj.optim.multi_transform, optax.multi_transform)
        ),
        "lars": lambda: (vj.optim.lars(1e-2, plan=plan), optax.lars(1e-2)),
        "clip_by_block_rms": lambda: (
            optax.chain(vj.optim.clip_by_block_rms(1e-4, plan=plan), optax.adam(1e-3)),
            optax.chain(optax.clip_by_block_rms(1e-4), optax.adam(1e-3)),
        ),
    }[name]
    tx, ref_tx = pair()
    check(fsdp_train(plan, tx, data), unsharded(ref_tx, data))


# --- The collective census -------------------------------------------------------------------------------------


def _compiled_step(ax: str, devices=None):
    cfg = config(ax)
    g, shapes = gpt_tp.abstract_model(cfg)
    mesh = jax.make_mesh((2, 4), ("fsdp", ax), devices=devices or jax.devices()[:8])
    plan = vj.plan(shapes, mesh, stacked=("blocks",), tp=gpt_tp.partition_spec(cfg))
    tx = optax.adamw(1e-3)

    @vj.fsdp(plan=plan)
    def step(p, o, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(g, p, batch["x"]), batch["y"]))(p)
        u, o = tx.update(grads, o, p)
        return vj.apply_updates(p, u), o, loss

    sp = vj.shard(reference(ax)[1], plan)
    return mesh, step.lower(sp, vj.init_opt_state(tx, sp), next(batches(1, batch=24))).compile()


@pytest.mark.parametrize("ax", ["tensor", pytest.param("expert", marks=pytest.mark.slow)])
def test_fsdp_collectives_stay_inside_each_group_and_only_all_reduces_cross_it(ax):
    # Devices in a permuted order: replica-group ids are positions in mesh.devices.flat, not device ids.
    devices = [jax.devices()[i] for i in (0, 2, 4, 6, 1, 3, 5, 7)] if ax == "tensor" else None
    mesh, compiled = _compiled_step(ax, devices)
    census = vt.census(compiled)
    fsdp_groups = {frozenset(int(i) for i in col) for col in np.arange(8).reshape(2, 4).T}
    for kind in ("all-gather", "reduce-scatter"):
        ops = census.of(kind)
        assert ops, kind
        for op in ops:
            assert {frozenset(g) for g in op.replica_groups} == fsdp_groups, (kind, op.name, op.replica_groups)
            assert vt.group_axes(op, mesh) == ("fsdp",), (kind, op.name)
    crossing = [op for op in census.ops if ax in vt.group_axes(op, mesh)]
    assert crossing, "the model's psums over the TP/EP axis are all-reduces"
    assert {op.kind for op in crossing} == {"all-reduce"}, [(op.kind, op.name) for op in crossing]
    assert not census.of("all-to-all") and not census.of("collective-permute")


@pytest.mark.parametrize(
    ("attrs", "groups"),
    [
        ("replica_groups={{0,1,2},{3,4,5}}, dimensions={0}", ((0, 1, 2), (3, 4, 5))),
        ("replica_groups=[2,4]<=[8], dimensions={0}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("replica_groups=mesh['a'=2,'b'=4] {'a'}, use_global_device_ids=true", ((0, 4), (1, 5), (2, 6), (3, 7))),
        ("replica_groups=mesh['a'=2,'b'=4] {'b'}, dimensions={0}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        ("replica_groups=mesh['x'=8] {'x':(2)4}, dimensions={0}", ((0, 1, 2, 3), (4, 5, 6, 7))),
        (
            "replica_groups=mesh[a=2,b=4], device_ids=([[0,2,1,3],[4,6,5,7]]) {b}, dimensions={0}",
            ((0, 2, 1, 3), (4, 6, 5, 7)),
        ),
        ("replica_groups={}, dimensions={0}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ],
)
def test_replica_groups_are_parsed_in_every_form(attrs, groups):
    assert vt.parse_replica_groups(attrs, 8) == groups
    assert vt.parse_replica_group_size(attrs, 8) == len(groups[0])


def test_group_axes_names_the_axes_a_group_spans_and_refuses_a_partial_one():
    mesh = jax.make_mesh((2, 4), ("a", "b"), devices=jax.devices()[:8])
    op = lambda groups: vt.CollectiveOp("all-gather", "ag", "main", "f32[8]", 32, len(groups[0]), replica_groups=groups)
    assert vt.group_axes(op(((0, 4), (1, 5), (2, 6), (3, 7))), mesh) == ("a",)
    assert vt.group_axes(op(((0, 1, 2, 3), (4, 5, 6, 7))), mesh) == ("b",)
    assert vt.group_axes(op((tuple(range(8)),)), mesh) == ("a", "b")
    assert vt.group_axes(op(tuple((i,) for i in range(8))), mesh) == ()
    with pytest.raises(ValueError, match="not a whole sub-mesh"):
        vt.group_axes(op(((0, 5), (1, 4), (2, 7), (3, 6))), mesh)
    with pytest.raises(ValueError, match="not a whole sub-mesh"):
        vt.group_axes(op(((0, 1), (2, 3), (4, 5), (6, 7))), mesh)


# --- 8-bit AdamW ------------------------------------------------------------------------------------------------

BLOCK8 = (2, 2)  # divides every TP-local split dim (6, 10 of d_model 24 / 4 heads and d_ff 40 over 4)
ROWS2 = lambda path, leaf: vj.rows(2) if leaf.ndim >= 2 else vj.element()


def _grads(params, n, seed=1):
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * 10.0 ** rng.uniform(-4, 1, x.shape)), params)
        for _ in range(n)
    ]


def _scales(view):
    """``{(moment, "<leaf path>/scales"): array}`` of a logical view of the 8-bit state (buckets differ per plan)."""
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(view)[0]:
        key = getattr(path[-1], "key", None)
        if isinstance(key, str) and key.endswith("/scales"):
            out[(next(p.name for p in path if hasattr(p, "name")), key)] = x
    return out


def test_adamw_8bit_scales_of_a_grouped_bucket_are_split_over_its_groups():
    plan = tp_plan(granularity=ROWS2)
    tx = vj.optim.adamw_8bit(1e-3, plan=plan, block=BLOCK8, min_size=64)
    state = vj.init_opt_state(tx, vj.shard(reference()[1], plan))
    for b, scales in zip(plan.buckets, state[0].mu_scales, strict=True):
        assert scales.value.shape[0] % (b.num_groups * plan.num_devices) == 0
        assert scales.value.sharding.spec[0] == ((*b.groups, "fsdp") if b.groups else "fsdp"), b.name


@pytest.mark.slow
def test_adamw_8bit_on_tp_tiles_equals_the_fsdp_only_plan():
    params = reference()[1]
    tp = tp_plan(granularity=ROWS2)
    flat = vj.plan(
        params, jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2]), stacked=("blocks",), granularity=ROWS2
    )
    assert any(b.groups for b in tp.buckets) and not any(b.groups for b in flat.buckets)
    results = []
    for plan in (tp, flat):
        tx = vj.optim.adamw_8bit(1e-3, plan=plan, block=BLOCK8, min_size=64, weight_decay=0.1)
        sp = vj.shard(params, plan)
        state = vj.init_opt_state(tx, sp)
        # Scales of a grouped bucket differ per group: split over (*groups, fsdp) like the bucket.
        specs = [s.value.sharding.spec[0] for s in state[0].mu_scales]
        assert specs == [(*b.groups, "fsdp") if b.groups else "fsdp" for b in plan.buckets]
        step = jax.jit(tx.update)
        for g in _grads(params, 4):
            u, state = step(vj.shard(g, plan), state, sp)
            sp = vj.apply_updates(sp, u)
        mu, nu = vj.optim.adam_8bit_moments(state)
        for scales in state[0].mu_scales:  # the logical form goes back into the same rows (the groups' too)
            back = scales.layout.from_logical(scales.layout.to_logical(scales.value))
            np.testing.assert_array_equal(np.asarray(back), np.asarray(scales.value))
        results.append((vj.unshard(sp), vj.unshard(mu), vj.unshard(nu), _scales(vj.optim.logical_view(state))))
    (p, mu, nu, view), (p0, mu0, nu0, view0) = results
    # The same blocks on both plans: the moments, their logical scales and the params agree to the rounding of
    # the moment and update multiply-adds (XLA:CPU fuses the two programs differently; no code flips).
    assert sorted(view) == sorted(view0) and len(view) == 2 * len(tp.leaves)
    for name, got, want in (("params", p, p0), ("mu", mu, mu0), ("nu", nu, nu0), ("logical scales", view, view0)):
        assert_trees_close(got, want, rtol=1e-6, what=name)


# --- Gather paths, accumulation, HSDP -----------------------------------------------------------------------------


def _hsdp_plan():
    return tp_plan(mesh=tp_mesh(shape=(2, 2, 2), names=("replica", "fsdp", "tensor")))


PATHS = {
    "prefetch": lambda: (tp_plan(), dict(prefetch=True)),
    "keep": lambda: (tp_plan(), dict(reshard_after_forward=False)),
    "split_leaves": lambda: (tp_plan(split="leaves"), {}),
    "accumulate_each": lambda: (tp_plan(), dict(microbatches=2, accumulate="each")),
    "accumulate_once": lambda: (tp_plan(), dict(microbatches=2, accumulate="once")),
    "hsdp": lambda: (_hsdp_plan(), dict(data_axes=("replica", "fsdp"))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PATHS))
def test_gather_paths_accumulation_and_hsdp_equal_the_unsharded_run(name):
    data = list(batches(STEPS, batch=24))
    plan, kw = PATHS[name]()
    tx = optax.adamw(1e-3, weight_decay=0.1)
    check(fsdp_train(plan, tx, data, **kw), unsharded(tx, data))


# --- Low-precision and FP8 gathers --------------------------------------------------------------------------------


def _step_grads(plan, cfg, precision, batch):
    """``(loss, logical grads)`` of one vj.fsdp step of ``cfg``'s model under ``precision``."""
    g, _ = gpt_tp.abstract_model(cfg)

    @vj.fsdp(plan=plan, precision=precision, donate=False)
    def step(p, o, b):
        return jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(g, p, b["x"]), b["y"]))(p)

    loss, grads = step(vj.shard(reference()[1], plan), {}, batch)
    return float(loss), vj.unshard(grads)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp8"])
def test_bf16_and_fp8_gathers_equal_the_fsdp_only_plan(name):
    # FP8 tiles of 2x2 divide every split dim of the TP shards: they are the logical leaf's tiles.
    precision = (
        vj.MixedPrecision(compute_dtype=jnp.bfloat16) if name == "bf16" else vj.MixedPrecision(fp8_gather=(2, 2))
    )
    kw = {} if name == "bf16" else dict(granularity=ROWS2)
    batch = next(batches(1, batch=24))
    params = reference()[1]
    flat = vj.plan(params, jax.make_mesh((2,), ("fsdp",), devices=jax.devices()[:2]), stacked=("blocks",), **kw)
    want = _step_grads(flat, gpt_tp.Config(**SIZES), precision, batch)
    got = _step_grads(tp_plan(**kw), config("tensor"), precision, batch)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_trees_close(got[1], want[1], rtol=1e-5)


def test_blocks_that_do_not_divide_a_tp_shard_are_refused_naming_the_leaf():
    plan = tp_plan(granularity=lambda path, leaf: vj.rows(8) if leaf.ndim >= 2 else vj.element())
    # Kernels split over 4 tensor devices: shards (24, 6) of q/k/v, (10, 24) of down, which 8x8 blocks do not tile.
    split = r"leaf 'blocks/\w+/kernel' of shape \(2, \d+, \d+\) is split over tensor into shards of \(\d+, \d+\)"
    with pytest.raises(ValueError, match=split):
        vj.optim.adamw_8bit(1e-3, plan=plan, block=(8, 8), min_size=64)
    with pytest.raises(ValueError, match=r"fp8_gather=\(8, 8\).*" + split):
        _step_grads(plan, config("tensor"), vj.MixedPrecision(fp8_gather=(8, 8)), next(batches(1, batch=24)))
