"""vj.checkpoint with plans whose leaves are split over tensor / expert axes (grouped buckets): the stored form
is the logical tree at full shapes, whatever the TP split; restores go across TP and FSDP-only plans bit for
bit, AdamW moments included; what the path does not support raises."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_equal
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
from vescale_jax.checkpoint import _integrity as _integrity
from vescale_jax.checkpoint import _storable as _stored
from vescale_jax.relayout import _logical_leaves as _logical
from vescale_jax.state._sharded import PerDevice


def needs(n: int) -> None:
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, {len(jax.devices())} available")


def mesh_of(shape, names=("fsdp", "tensor")):
    n = int(np.prod(shape))
    needs(n)
    return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def tree_of(seed: int = 0):
    """TP leaves (column / row split, a stacked group, a bf16 leaf), dims the fsdp sizes do not divide, a
    replicated leaf, a scalar."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal(shape, np.float32)
    return {
        "embed": f32(50, 12),
        "up": {"kernel": f32(12, 24), "bias": f32(24)},
        "down": {"kernel": f32(24, 12).astype(jnp.bfloat16)},
        "blocks": {"w": f32(3, 7, 8), "v": f32(3, 8), "n": f32(3, 5)},
        "scale": np.asarray(1.5, np.float32),
    }


def tp_specs(tensor="tensor"):
    return {
        "embed": None,
        "up": {"kernel": P(None, tensor), "bias": P(tensor)},
        "down": {"kernel": P(tensor, None)},
        "blocks": {"w": P(None, None, tensor), "v": P(None, tensor), "n": None},
        "scale": None,
    }


def units(path, leaf):
    return "blocks" if vj.plan_path(path).startswith("blocks") else "top"


def plan_of(mesh, tp=None, **kw):
    return vj.plan(tree_of(), mesh, tp=tp, units=units, stacked=("blocks",), **kw)


def host(tree):
    return jax.tree.map(np.asarray, tree)


# ---------------------------------------------------------------------------------------------- the logical form
def test_logical_tree_of_a_tp_plan_is_the_full_tree_and_its_checksums():
    plan = plan_of(mesh_of((2, 4)), tp_specs())
    assert any(b.groups for b in plan.buckets) and any(not b.groups for b in plan.buckets)
    tree = tree_of()
    sp = vj.shard(tree, plan)
    logical, sums = _stored.logical_and_sums(sp)
    assert_trees_equal(host(logical), tree)
    assert sums == _integrity.checksums(tree)  # of the whole leaves: the same under any plan
    # each leaf stored at its full shape, split over its tensor axis and, inside its TP shard, over fsdp
    kernel = logical["up"]["kernel"]
    assert kernel.sharding.spec == P("vj_ckpt_0", "tensor")  # its TP shard (12, 6) split on dim 0
    assert _logical.leaf_sharding(plan, [s.path for s in plan.leaves].index("up/kernel")) == kernel.sharding
    assert {tuple(d.data.shape) for d in kernel.addressable_shards} == {(6, 6)}
    abstract = _stored.abstract_logical(plan)
    for a, x in zip(jax.tree.leaves(abstract), jax.tree.leaves(logical), strict=True):
        assert a.shape == x.shape and a.sharding.is_equivalent_to(x.sharding, x.ndim)
    # and back into the plan, bit for bit, padding zero
    buffers, back_sums = _logical.from_logical(jax.tree.leaves(logical), plan)
    assert (back_sums == np.asarray([sums[p] for p in _stored._leaf_paths(plan)])).all()
    for got, want, sh in zip(buffers, sp.buffers, plan.shardings(), strict=True):
        assert got.sharding == sh
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))


@pytest.mark.slow
def test_leaf_split_over_two_axes_and_one_dim_over_both():
    mesh = mesh_of((2, 2, 2), ("fsdp", "tensor", "expert"))
    tp = tp_specs() | {"embed": P(None, ("tensor", "expert")), "up": {"kernel": P("expert", "tensor"), "bias": None}}
    plan = plan_of(mesh, tp)
    assert {b.groups for b in plan.buckets} >= {("tensor",), ("tensor", "expert"), ()}
    tree = tree_of(1)
    logical, sums = _stored.logical_and_sums(vj.shard(tree, plan))
    assert_trees_equal(host(logical), tree)
    assert sums == _integrity.checksums(tree)
    fsdp_only = vj.plan(tree, mesh_of((8,), ("fsdp",)), units=units, stacked=("blocks",))
    back = _stored.pack(logical, fsdp_only, sums)
    assert_trees_equal(host(vj.unshard(back)), tree)


# -------------------------------------------------------------------------------------------------- round trips
def adamw_state(sp, seed):
    """AdamW state after one update with random gradients: mu, nu are ShardedParams of the plan."""
    tx = optax.adamw(1e-2)
    grads = vj.shard(tree_of(seed), sp.plan)
    state = vj.init_opt_state(tx, sp)
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes a float and the int count
        _, state = jax.jit(tx.update)(grads, state, sp)
    return tx, state


def moments(state):
    return [
        host(vj.unshard(x))
        for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, vj.ShardedParams))
        if isinstance(x, vj.ShardedParams)
    ]


def save_and_restore(tmp_path, src, dst, step, *, tx=None):
    tree = tree_of()
    sp = vj.shard(tree, src)
    tx, state = adamw_state(sp, seed=7)
    with vj.checkpoint.Manager(tmp_path) as mngr:
        mngr.save(step, params=sp, opt_state=state)
        template = vj.init_opt_state(tx, vj.shard(tree, dst))
        r = mngr.restore(step, params=dst, opt_state=template)
    assert r.params.plan == dst
    assert_trees_equal(host(vj.unshard(r.params)), tree, what="params")
    for got, want in zip(moments(r.opt_state), moments(state), strict=True):
        assert_trees_equal(got, want, what="moment")
    assert int(r.opt_state[0].count) == int(state[0].count)
    for x, bucket in zip(r.params.buffers, dst.buckets, strict=True):
        assert x.sharding.spec == dst.partition_spec(bucket)
    return r


def test_tp_to_fsdp_only_and_back_with_adamw_is_bitwise(tmp_path):
    tp = plan_of(mesh_of((2, 4)), tp_specs())
    fsdp = plan_of(mesh_of((8,), ("fsdp",)))
    r = save_and_restore(tmp_path / "a", tp, fsdp, 1)
    # ... and the FSDP-only state back into the TP plan
    with vj.checkpoint.Manager(tmp_path / "b") as mngr:
        mngr.save(2, params=r.params, opt_state=r.opt_state)
        template = vj.init_opt_state(optax.adamw(1e-2), vj.shard(tree_of(), tp))
        back = mngr.restore(2, params=tp, opt_state=template)
    assert_trees_equal(host(vj.unshard(back.params)), tree_of())
    for got, want in zip(moments(back.opt_state), moments(r.opt_state), strict=True):
        assert_trees_equal(got, want)


@pytest.mark.slow
@pytest.mark.parametrize(("src", "dst"), [((4, 2), (2, 4)), ((3, 2), (2, 4)), ((2, 4), (3, 2))], ids=str)
def test_tp_to_another_tp_mesh_is_bitwise(tmp_path, src, dst):
    save_and_restore(tmp_path, plan_of(mesh_of(src), tp_specs()), plan_of(mesh_of(dst), tp_specs()), 3)


@pytest.mark.slow
def test_tp_to_tp_with_tiles_and_rows(tmp_path):
    mesh = mesh_of((2, 4))
    src = plan_of(mesh, tp_specs(), granularity=vj.rows(1))
    dst = plan_of(mesh, tp_specs(), granularity=lambda p, x: vj.tiles(4, 4) if x.ndim >= 2 else vj.element())
    assert any(b.storage for b in dst.buckets if b.groups)
    save_and_restore(tmp_path, src, dst, 4)


def test_the_stored_form_does_not_depend_on_the_tp_split(tmp_path):
    """Plain Orbax reads a TP plan's params at their full shapes; the same tree under an FSDP-only plan is
    stored with the same key paths, shapes, dtypes and checksums."""
    tree = tree_of()
    tp_plan = plan_of(mesh_of((2, 4)), tp_specs())
    vj.checkpoint.save_params(tmp_path / "tp", vj.shard(tree, tp_plan))
    restored = ocp.StandardCheckpointer().restore(
        tmp_path / "tp", jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    )
    assert_trees_equal(host(restored), tree)
    fsdp_plan = plan_of(mesh_of((8,), ("fsdp",)))
    vj.checkpoint.save_params(tmp_path / "fsdp", vj.shard(tree, fsdp_plan))
    meta = lambda d: _integrity.stored_shapes(ocp.StandardCheckpointer().metadata(tmp_path / d).item_metadata)
    assert meta("tp") == meta("fsdp") == _integrity.flat_shapes(tree)
    sp = vj.checkpoint.restore_params(tmp_path / "fsdp", tp_plan)
    assert_trees_equal(host(vj.unshard(sp)), tree)


# ------------------------------------------------------------------------------------------------ what raises
def compact_adam(plan, mask, seed=3):
    """``vj.optim.masked(scale_by_adam, mask, compact=True)`` after one update: its moments are PerDevice
    vectors with a CompactLayout; and the unsharded optax reference state."""
    tree, grads = tree_of(), tree_of(seed)
    tx = vj.optim.masked(optax.scale_by_adam(), mask, compact=True)
    ref = optax.masked(optax.scale_by_adam(), mask)
    sp = vj.shard(tree, plan)
    with jax.numpy_dtype_promotion("standard"):
        _, state = jax.jit(tx.update)(vj.shard(grads, plan), vj.init_opt_state(tx, sp), sp)
        _, ref_state = jax.jit(ref.update)(grads, ref.init(tree), tree)
    return state, ref_state


def test_per_device_state_of_tp_leaves_raises(tmp_path):
    plan = plan_of(mesh_of((2, 4)), tp_specs())
    sp = vj.shard(tree_of(), plan)
    state, _ = compact_adam(plan, lambda p: jax.tree.map(lambda x: x.ndim == 2, p))
    with pytest.raises(NotImplementedError, match=r"CompactLayout.*'down/kernel'.*tensor / expert.*compact=False"):
        vj.optim.logical_view(state)
    with vj.checkpoint.Manager(tmp_path) as mngr:
        with pytest.raises(NotImplementedError, match=r"'inner_state/(\w+/)?mu'.*opt_state=None"):
            mngr.save(1, params=sp, opt_state=state)
    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=_stored.is_node)[0]
    saved = {n: {"path": n, "kind": "per_device_logical"} for n in (_integrity.raw_path(p) for p, _ in flat)}
    with pytest.raises(NotImplementedError, match=r"'inner_state/(\w+/)?mu'"):
        _stored.opt_state_target(state, saved, plan)


@pytest.mark.slow
def test_compact_state_on_a_tp_plan_is_refused_not_stored_wrong(tmp_path):
    # The compact AdamW moments are PerDevice rows split over (tensor, fsdp): their layout has no logical view
    # of grouped buckets yet, so the view and the save raise instead of storing one group's shards.
    plan = plan_of(mesh_of((2, 4)), tp_specs())
    state, _ = compact_adam(plan, lambda p: jax.tree.map(lambda x: x.shape == (50, 12), p))
    with pytest.raises(NotImplementedError, match="CompactLayout"):
        vj.optim.logical_view(state)
    with vj.checkpoint.Manager(tmp_path) as mngr, pytest.raises(NotImplementedError, match="CompactLayout"):
        mngr.save(2, params=vj.shard(tree_of(), plan), opt_state=state)


@pytest.mark.slow
def test_masks_over_the_logical_tree_of_a_tp_plan_match_optax():
    """vj.optim.adamw's decay mask sees the full logical shapes and applies per element in every TP group."""
    plan = plan_of(mesh_of((2, 4)), tp_specs())
    tree, grads = tree_of(), [tree_of(s) for s in (5, 6)]
    mask = lambda p: jax.tree.map(lambda x: x.ndim == 2 and x.shape[0] != 24, p)  # not down/kernel (24, 12)
    tx = vj.optim.adamw(1e-2, weight_decay=0.5, mask=mask)
    ref = optax.adamw(1e-2, weight_decay=0.5, mask=mask)
    sp, ref_params = vj.shard(tree, plan), jax.tree.map(jnp.asarray, tree)
    state, ref_state = vj.init_opt_state(tx, sp), ref.init(ref_params)
    with jax.numpy_dtype_promotion("standard"):
        for g in grads:
            updates, state = jax.jit(tx.update)(vj.shard(g, plan), state, sp)
            sp = optax.apply_updates(sp, updates)
            ref_updates, ref_state = jax.jit(ref.update)(g, ref_state, ref_params)
            ref_params = optax.apply_updates(ref_params, ref_updates)
    assert_trees_equal(host(vj.unshard(sp)), host(ref_params))


class _Layout:
    """A PerDevice layout whose logical keys are leaves' paths, saying it handles grouped buckets."""

    supports_groups = True

    def logical_shapes(self, dtype=None):
        return {"up/kernel": jax.ShapeDtypeStruct((12, 24), np.float32)}


def test_a_layout_that_supports_groups_is_not_refused():
    plan = plan_of(mesh_of((2, 4)), tp_specs())
    _stored.check_layout_groups(PerDevice(jnp.zeros((4,)), plan, _Layout()), "s")
    _Layout.supports_groups = False
    try:
        with pytest.raises(NotImplementedError, match=r"'s'.*_Layout.*\['up/kernel'\]"):
            _stored.check_layout_groups(PerDevice(jnp.zeros((4,)), plan, _Layout()), "s")
    finally:
        _Layout.supports_groups = True


# ------------------------------------------------------------------------------------------ training resumes
@pytest.mark.slow
def test_gpt_tp_training_resumes_across_tp_and_fsdp_only_plans(tmp_path):
    """3 AdamW steps on fsdp x tensor 2x4, a checkpoint restored into an FSDP-only plan of 8 devices for 2
    steps, then back into 2x4 for 2 more: the losses and parameters follow the unsharded run."""
    from flax import nnx
    from helpers import assert_trees_close, batches, load_script, loss_fn, reference_run

    gpt_tp = load_script("examples/gpt_tp.py")
    base = gpt_tp.Config(vocab=257, max_len=16, d_model=24, num_heads=4, num_layers=2, d_ff=40)
    graph_ref, params = gpt_tp.split_model(base, jax.random.key(0))
    cfg = gpt_tp.Config(**{**base.__dict__, "tensor": "tensor"})
    graph_tp, shapes = gpt_tp.abstract_model(cfg)
    tp_plan = vj.plan(shapes, mesh_of((2, 4)), stacked=("blocks",), tp=gpt_tp.partition_spec(cfg))
    fsdp_plan = vj.plan(shapes, mesh_of((8,), ("fsdp",)), stacked=("blocks",))
    tx = optax.adamw(1e-3, weight_decay=0.1)
    data = list(batches(7, batch=24))

    def make_step(plan, graph):
        @vj.fsdp(plan=plan)
        def step(p, o, batch):
            fn = lambda p: loss_fn(vj.flax.nnx_apply(graph, p, batch["x"]), batch["y"])
            loss, grads = jax.value_and_grad(fn)(p)
            u, o = tx.update(grads, o, p)
            return optax.apply_updates(p, u), o, loss

        return step

    def train(plan, graph, sp, state, batches_):
        step, losses = make_step(plan, graph), []
        for b in batches_:
            sp, state, loss = step(sp, state, b)
            losses.append(float(loss))
        return sp, state, losses

    def resume(mngr, step, sp, state, plan):
        mngr.save(step, params=sp, opt_state=state)
        template = jax.eval_shape(tx.init, jax.eval_shape(lambda: vj.shard(params, plan)))
        r = mngr.restore(step, params=plan, opt_state=template)
        assert r.params.plan == plan
        return r.params, r.opt_state

    with jax.numpy_dtype_promotion("standard"):
        ref, ref_losses = reference_run(params, lambda p, x: nnx.merge(graph_ref, p)(x), tx, data)
        sp = vj.shard(params, tp_plan)
        sp, state, losses = train(tp_plan, graph_tp, sp, vj.init_opt_state(tx, sp), data[:3])
        with vj.checkpoint.Manager(tmp_path) as mngr:
            sp, state = resume(mngr, 3, sp, state, fsdp_plan)
            sp, state, more = train(fsdp_plan, graph_ref, sp, state, data[3:5])
            losses += more
            sp, state = resume(mngr, 5, sp, state, tp_plan)
            sp, state, more = train(tp_plan, graph_tp, sp, state, data[5:])
            losses += more
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref, rtol=1e-5)
