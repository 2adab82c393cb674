"""vj.checkpoint with offloaded optimizer state (``vj.Offload``): saved in the same logical form as the state on
the device, restored into offloaded or device-resident templates, bit for bit, under any plan."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_equal
from test_checkpoint import host_shard, host_unshard, per_device, plan_of

import vescale_jax as vj

TX = optax.adamw(1e-2)


def tree_of(seed: int = 0):
    """A small model: a plain leaf, a stacked group of two layers (offloaded as rows) and a bf16 leaf."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal(shape, np.float32)
    return {"embed": f32(20, 12), "blocks": {"w": f32(2, 6, 10)}, "head": f32(12, 7).astype(jnp.bfloat16)}


def trained_state(tree, plan):
    """Params and an AdamW state whose moments and count are non-zero (distinct values per leaf and moment)."""
    sp = host_shard(tree, plan)
    adam, *rest = vj.init_opt_state(TX, sp)
    mu, nu = (host_shard(tree_of(seed), plan) for seed in (1, 2))
    return sp, (adam._replace(count=jnp.asarray(3, jnp.int32), mu=mu, nu=nu), *rest)


def pieces(state):
    return [x for node in offloaded_nodes(state) for x in jax.tree.leaves(node)]


def offloaded_nodes(state):
    return [x for x in jax.tree.leaves(state, is_leaf=vj.Offloaded.__instancecheck__) if isinstance(x, vj.Offloaded)]


def abstract(state):
    """``state`` with every array a ``ShapeDtypeStruct`` of the same sharding (an abstract template)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One AdamW state on 8 devices saved from the device (step 1) and from host memory (step 2)."""
    tree = tree_of()
    plan = plan_of(tree, 8)
    sp, state = trained_state(tree, plan)
    off = vj.offload(state)
    assert all(x.sharding.memory_kind == "pinned_host" for x in pieces(off)) and pieces(off)
    assert any(getattr(s, "count", None) == 2 for node in offloaded_nodes(off) for s in node.form.splits)  # 2 rows
    directory = tmp_path_factory.mktemp("offload_ckpt")
    with vj.checkpoint.Manager(directory, async_save=True) as mngr:
        mngr.save(1, params=sp, opt_state=state)
        mngr.save(2, params=sp, opt_state=off)
        mngr.wait()
    assert_trees_equal(vj.onload(off), state, what="offloaded state after the save")  # the save left it as it was
    return tree, plan, sp, state, directory


def test_saved_from_host_memory_is_the_checkpoint_saved_from_the_device(saved):
    _, _, _, _, directory = saved
    items = {}
    for step in (1, 2):
        path = os.path.join(directory, str(step), "opt_state")
        stored = ocp.StandardCheckpointer().metadata(path).item_metadata.tree
        assert "pieces" not in json.dumps(jax.tree.map(lambda _: 0, stored))  # stored as nodes, not as pieces
        items[step] = jax.tree.map(np.asarray, ocp.StandardCheckpointer().restore(path))
        with open(os.path.join(directory, str(step), "vescale_jax", "metadata")) as f:
            items[step, "json"] = json.load(f)
    assert_trees_equal(items[2], items[1], what="opt_state item")
    assert items[2, "json"] == items[1, "json"]  # plan, per-leaf description and checksums, in the same order
    assert list(items[2, "json"]["checksums"]["opt_state"]) == list(items[1, "json"]["checksums"]["opt_state"])


def test_saved_from_host_memory_restores_into_a_device_target(saved):
    tree, plan, sp, state, directory = saved
    with vj.checkpoint.Manager(directory) as mngr:
        r = mngr.restore(2, params=plan, opt_state=jax.eval_shape(TX.init, host_shard(tree, plan)))
    assert not offloaded_nodes(r.opt_state)
    assert_trees_equal(r.opt_state, state, what="opt_state")
    assert_trees_equal(host_unshard(r.params), host_unshard(sp), what="params")
    assert all(x.sharding.memory_kind == "device" for x in jax.tree.leaves(r.opt_state))


@pytest.mark.parametrize(
    ("step", "kind", "form"),
    [(1, "pinned_host", "concrete"), (2, "unpinned_host", "abstract")],
    ids=["from-device-pinned-concrete", "from-host-unpinned-abstract"],
)
def test_restores_into_an_offloaded_target(saved, step, kind, form):
    _, plan, sp, state, directory = saved
    policy = vj.Offload(memory_kind=kind, pieces="layer" if form == "concrete" else "bucket")
    target = vj.init_opt_state(TX, sp, offload=policy)
    with vj.checkpoint.Manager(directory) as mngr:
        r = mngr.restore(step, params=plan, opt_state=target if form == "concrete" else abstract(target))
    assert jax.tree.structure(r.opt_state) == jax.tree.structure(target)  # the same forms (rows, memory kind)
    assert all(x.sharding.memory_kind == kind for x in pieces(r.opt_state))
    assert all(x.sharding == t.sharding for x, t in zip(pieces(r.opt_state), pieces(target), strict=True))
    assert_trees_equal(vj.onload(r.opt_state), state, what="onload(restored)")


def test_offloaded_to_offloaded_on_another_device_count(saved):
    tree, _, _, state, directory = saved
    plan3 = plan_of(tree, 3)
    target = jax.eval_shape(vj.offload, jax.eval_shape(TX.init, host_shard(tree, plan3)))  # abstract
    with vj.checkpoint.Manager(directory) as mngr:
        r = mngr.restore(2, params=plan3, opt_state=target)
    assert jax.tree.structure(r.opt_state) == jax.tree.structure(target)
    assert all(x.sharding.memory_kind == "pinned_host" for x in pieces(r.opt_state))
    adam, adam_r = state[0], vj.onload(r.opt_state)[0]
    assert adam_r.mu.plan == plan3 and int(adam_r.count) == int(adam.count)
    assert_trees_equal(host_unshard(adam_r.mu), host_unshard(adam.mu), what="mu")
    assert_trees_equal(host_unshard(adam_r.nu), host_unshard(adam.nu), what="nu")


def test_per_device_state_offloaded(tmp_path):
    tree = tree_of()
    p8, p3 = plan_of(tree, 8), plan_of(tree, 3)
    sp = host_shard(tree, p8)
    state = {"stats": per_device(p8, 21, layout=True), "raw": per_device(p8, 5, layout=False)}
    off = vj.offload(state)
    with vj.checkpoint.Manager(tmp_path) as mngr:
        mngr.save(1, params=sp, opt_state=off)
        mngr.save(2, params=sp, opt_state={"stats": off["stats"]})
        same = mngr.restore(1, params=None, opt_state=off).opt_state
        assert jax.tree.structure(same) == jax.tree.structure(off)
        assert_trees_equal(vj.onload(same), state)
        assert_trees_equal(mngr.restore(1, params=None, opt_state=state).opt_state, state)
        # Another plan: the laid-out state moves through its layout; the one stored by device index is refused.
        target = vj.offload({"stats": per_device(p3, 21, layout=True), "raw": per_device(p3, 5, layout=False)})
        with pytest.raises(ValueError, match=r"'raw' is a PerDevice array without a layout.*restores only into"):
            mngr.restore(1, params=None, opt_state=target)
        # A node of another kind than the saved one: offloaded moments where PerDevice state was saved.
        with pytest.raises(ValueError, match=r"'raw' was saved as per_device, the template has an offloaded"):
            mngr.restore(1, params=None, opt_state={**off, "raw": vj.offload(sp)})
        r = mngr.restore(2, params=None, opt_state={"stats": target["stats"]}).opt_state
    assert jax.tree.structure(r) == jax.tree.structure({"stats": target["stats"]})
    assert all(x.sharding.memory_kind == "pinned_host" for x in pieces(r))
    got = vj.onload(r)["stats"]
    assert got.layout == target["stats"].form.layout and got.plan == p3
    np.testing.assert_array_equal(np.asarray(got.value)[:21], np.asarray(state["stats"].value)[:21])


def test_mismatches_name_the_key_path(saved):
    tree, plan, _, _, directory = saved
    other = {**tree, "embed": np.zeros((20, 13), np.float32)}
    target = jax.eval_shape(vj.offload, jax.eval_shape(TX.init, host_shard(other, plan_of(other, 8))))
    with vj.checkpoint.Manager(directory) as mngr:
        with pytest.raises(
            ValueError, match=r"opt_state leaf '0/mu/embed' is stored with shape \(20, 12\).*\(20, 13\)"
        ):
            mngr.restore(2, params=None, opt_state=target)
        # A node of another kind than the saved one: a PerDevice where the checkpoint has moments.
        raw = vj.offload(per_device(plan, 5, layout=False))
        with pytest.raises(ValueError, match=r"leaf '0/nu' is a PerDevice array without a layout"):
            mngr.restore(2, params=None, opt_state=(target[0]._replace(nu=raw), *target[1:]))
