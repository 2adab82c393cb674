"""vj.checkpoint.Manager.prepare compiles everything a save of a state and a restore into it run: the first save
and the first restore after it compile nothing. The state holds ``PerDevice`` leaves with layouts (Shampoo's
blocks and compact moments, 8-bit AdamW's scales), counts, and leaves whose storage blocks are replicated (Orbax
then has each replica write a slice of its block: ``jit(slice)`` per device, unless prepared)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from helpers import assert_trees_equal, counting_compiles

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax.checkpoint import _orbax_slices as _orbax_slices
from vescale_jax.checkpoint import _storable as _storable
from vescale_jax.state._sharded import PerDevice

P = jax.sharding.PartitionSpec
# No dim of "w" or "v" is a multiple of 8: their storage blocks are replicated (52 = 4 x 13: "w" is stored split
# over 4 devices, each block on 2).
SHAPES = {"w": (20, 52), "v": (37, 11), "b": (13,)}


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def _state(seed: int, rows: int, offload: bool = False):
    """Params under a plan of their own (``rows``: its granularity, so no other test has compiled its
    conversions) on 8 devices, and one optimizer state holding a Shampoo and an 8-bit AdamW state over them."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    rng = np.random.default_rng(seed)
    tree = jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )
    plan = vj.plan(tree, make_mesh(8), granularity=vj.rows(rows))
    sp = vj.shard(tree, plan)
    txs = {
        "shampoo": vjo.shampoo(0.01, plan=plan, block_size=4),
        "adamw_8bit": vjo.adamw_8bit(1e-3, plan=plan, block=(rows, 32), min_size=64),
    }
    policy = vj.Offload(piece_bytes=512) if offload else None  # flat buffers in column pieces
    state = {k: vj.init_opt_state(tx, sp, offload=policy) for k, tx in txs.items()}
    if offload:
        forms = [
            x.form
            for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, vj.Offloaded))
            if isinstance(x, vj.Offloaded)
        ]
        assert any(split not in (None, -1) for form in forms for split in form.splits), "no node is in pieces"
    return tree, plan, sp, state


def _check_coverage(plan, state) -> None:
    """The state has what the test is about: PerDevice leaves with layouts, and replicated storage blocks."""
    nodes = jax.tree.leaves(vj.onload(state), is_leaf=lambda x: isinstance(x, PerDevice))
    layouts = {type(n.layout).__name__ for n in nodes if isinstance(n, PerDevice) and n.layout is not None}
    assert {"BlockLayout", "CompactLayout", "ScaleLayout"} <= layouts, layouts
    stored = jax.tree.leaves(_storable.abstract_logical(plan))
    assert any(_orbax_slices.replica_count(x.shape, x.sharding) > 1 for x in stored)


def _save_and_restore_after_prepare(tmp_path, tree, plan, sp, state, prepare_args, async_save=False):
    template = jax.eval_shape(lambda: state)
    with vj.checkpoint.Manager(tmp_path, async_save=async_save) as mngr:
        with counting_compiles() as during_prepare:
            mngr.prepare(**prepare_args)
        assert mngr.all_steps() == []  # nothing written
        assert during_prepare, "prepare compiled nothing: the test would pass without it"
        with counting_compiles() as during_save:
            mngr.save(1, params=sp, opt_state=state)
            mngr.wait()
        assert not during_save, f"the first save after prepare compiled {during_save}"
        with counting_compiles() as during_restore:
            r = mngr.restore(1, params=plan, opt_state=template)
            jax.block_until_ready((r.params, r.opt_state))
        assert not during_restore, f"the first restore after prepare compiled {during_restore}"
    assert_trees_equal(vj.unshard(r.params), tree)
    assert_trees_equal(jax.tree.leaves(vj.onload(r.opt_state)), jax.tree.leaves(vj.onload(state)))


@pytest.mark.parametrize("async_save", [False, True], ids=["blocking", "async"])
def test_prepare_compiles_every_save_and_restore_executable(tmp_path, async_save):
    """Blocking saves, and background saves (each conversion writing its leaves to pinned host memory, the
    checksums fetched by the worker)."""
    tree, plan, sp, state = _state(0 if async_save else 2, rows=32 if async_save else 24)
    _check_coverage(plan, state)
    _save_and_restore_after_prepare(
        tmp_path, tree, plan, sp, state, dict(params=sp, opt_state=state), async_save=async_save
    )


@pytest.mark.parametrize(("abstract", "offload"), [(True, False), (False, True)], ids=["abstract", "offloaded"])
def test_prepare_of_an_abstract_or_offloaded_state(tmp_path, abstract, offload):
    """From ``jax.eval_shape`` of the state (only shapes, shardings and layouts known), and for a state kept in
    host memory (its stacked buffers in layer pieces, joined on the device for a save and cut again on a
    restore)."""
    tree, plan, sp, state = _state(1, rows=16 if abstract else 8, offload=offload)
    args = dict(params=sp, opt_state=state)
    if abstract:
        args = jax.eval_shape(lambda: args)
    _save_and_restore_after_prepare(tmp_path, tree, plan, sp, state, args)


def test_orbax_replica_slicing_is_what_prepare_runs():
    """Pins the Orbax internal of vescale_jax/checkpoint/_orbax_slices.py: the jax.Array handler's settings and
    replica_slices.get_replica_slices. After precompile of an array's shape and sharding, Orbax's slicing of
    another array like it compiles nothing."""
    from orbax.checkpoint._src.serialization import replica_slices

    settings = _orbax_slices.handler_settings()
    assert settings is not None, (
        "orbax.checkpoint's jax.Array handler no longer keeps _replica_id, _use_replica_parallel, "
        "_min_slice_bytes_for_replica_parallel and _max_replicas_for_replica_parallel; Manager.prepare cannot "
        "run Orbax's replica slicing ahead of a save (vescale_jax/checkpoint/_orbax_slices.py)"
    )
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("r", "x"))
    sharding = jax.sharding.NamedSharding(mesh, P(None, "x"))  # each block on 2 devices
    shape = (6, 44)  # a shape no other test slices
    assert _orbax_slices.replica_count(shape, sharding) == 2
    _orbax_slices.precompile([jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)])
    x = jax.device_put(np.arange(6 * 44, dtype=np.float32).reshape(shape), sharding)
    with counting_compiles() as compiles:
        got = replica_slices.get_replica_slices(x, *settings)
        sliced = [r.data() for r in got.replica_slices]
    assert any(r.slice_args is not None for r in got.replica_slices), "Orbax no longer slices replicated blocks"
    assert not compiles, f"Orbax's replica slicing compiled {compiles} after precompile"
    for r, data in zip(got.replica_slices, sliced, strict=True):
        np.testing.assert_array_equal(np.asarray(data), np.asarray(x)[r.index])
