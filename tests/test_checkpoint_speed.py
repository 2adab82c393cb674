"""vj.checkpoint speed: the logical conversion compiles once per plan, and its temporary memory is one layer."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import assert_trees_equal, counting_compiles

import vescale_jax as vj
from vescale_jax.checkpoint import _integrity as _integrity
from vescale_jax.checkpoint import _storable as _storable
from vescale_jax.relayout import _logical_leaves as _logical


def stacked_tree(seed: int = 0, layers: int = 6, even: bool = False, scale: int = 1):
    """A stacked group whose leaves do not line up with the shards (local copies and collective-permute rounds
    for contiguous storage blocks, row windows for strided ones), a single-leaf group that does line up, one of
    long strided rows, and a ragged embedding.
    ``even``: every leaf has a dim divisible by 8, so no storage block is replicated (Orbax then slices no
    replica: it compiles nothing of its own either). ``scale`` multiplies every dim but the layers'."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal([shape[0], *(scale * d for d in shape[1:])], np.float32)
    odd = (12, 20), (7, 9), 13, 50
    (w, u, b, rows) = ((12, 24), (8, 9), 16, 48) if even else odd
    return {
        "embed": f32(1, rows, 12)[0],
        "blocks": {
            "w": f32(layers, *w),
            "u": f32(layers, *u),
            "b": f32(layers, b),
            # 27 rows, columns split 8 ways: strided storage blocks (row windows), whatever the scale.
            "c": rng.standard_normal((layers, 27, 40 * scale), np.float32),
        },
        "aligned": {"w": f32(layers, 32, 16)},  # split on dim 0: each device's range is its storage block
        # Strided blocks of two rows, each longer than two shards: permute rounds.
        "wide": {"w": rng.standard_normal((layers, 2, 64 * scale), np.float32)},
    }


def plan_of(tree, m: int, granularity=None):
    units = lambda path, leaf: vj.plan_path(path).split("/")[0]
    return vj.plan(tree, make_mesh(m), stacked=("blocks", "aligned", "wide"), units=units, granularity=granularity)


def state_of(tree, plan, seed: int):
    """Params and an Adam state with distinct non-zero moments."""
    sp = vj.shard(tree, plan)
    adam, *rest = vj.init_opt_state(optax.adam(1e-3), sp)
    layers, even = tree["aligned"]["w"].shape[0], tree["embed"].shape[0] % 8 == 0
    mu, nu = (vj.shard(stacked_tree(seed + s, layers, even), plan) for s in (1, 2))
    return sp, (adam._replace(mu=mu, nu=nu), *rest)


def compiles_during(fn):
    with counting_compiles() as compiles:
        out = fn()
        jax.block_until_ready(out)
    return out, len(compiles)


def test_a_second_save_and_a_save_after_a_restore_compile_nothing(tmp_path):
    tree = stacked_tree()
    plan = plan_of(tree, 8)
    sp, state = state_of(tree, plan, 0)
    sp2, state2 = state_of(stacked_tree(10), plan, 10)  # another state under the same plan
    template = jax.eval_shape(lambda: state)
    with vj.checkpoint.Manager(tmp_path) as mngr:
        mngr.save(1, params=sp, opt_state=state)
        mngr.wait()
        _, n = compiles_during(lambda: (mngr.save(2, params=sp2, opt_state=state2), mngr.wait()))
        assert n == 0, f"the second save compiled {n} executables"
        r = mngr.restore(2, params=plan, opt_state=template)
        _, n = compiles_during(lambda: (mngr.save(3, params=r.params, opt_state=r.opt_state), mngr.wait()))
        assert n == 0, f"the save after a restore compiled {n} executables"
        _, n = compiles_during(lambda: mngr.restore(3, params=plan, opt_state=template))
        assert n == 0, f"the second restore compiled {n} executables"
    assert_trees_equal(vj.unshard(r.params), vj.unshard(sp2))
    assert_trees_equal(vj.unshard(r.opt_state[0].mu), vj.unshard(state2[0].mu))


def test_prepare_compiles_every_conversion_ahead(tmp_path):
    tree = stacked_tree(layers=3, even=True)  # a plan no other test has compiled
    plan = plan_of(tree, 8, vj.rows(1))
    sp, state = state_of(tree, plan, 0)
    template = jax.eval_shape(lambda: state)
    _storable.prepare(sp, state)
    with vj.checkpoint.Manager(tmp_path) as mngr:
        _, n = compiles_during(lambda: (mngr.save(1, params=sp, opt_state=state), mngr.wait()))
        assert n == 0, f"a save after prepare compiled {n} executables"
        r, n = compiles_during(lambda: mngr.restore(1, params=plan, opt_state=template))
        assert n == 0, f"a restore after prepare compiled {n} executables"
    assert_trees_equal(vj.unshard(r.params), tree)


def layer_bound(plan) -> int:
    """Bytes of one layer of a stacked bucket across all devices (the whole bucket if unstacked), the largest."""
    return max(b.num_groups * plan.num_devices * b.layout.shard_size * np.dtype(b.dtype).itemsize for b in plan.buckets)


@pytest.mark.parametrize("granularity", [None, vj.rows(1)], ids=["element", "rows1"])
def test_conversion_temp_is_at_most_one_layer(granularity):
    tree = stacked_tree(layers=12, scale=8)  # big enough that index tables do not dominate
    plan = plan_of(tree, 8, granularity)
    bound = layer_bound(plan)
    share = sum(b.nbytes for b in plan.buckets) // plan.num_devices
    assert bound < share, "the model is meant to hold more than one layer per device"
    for b, bucket in enumerate(plan.buckets):
        for direction in (_logical._out_executables, _logical._in_executables):
            for compiled in direction(plan, b, bucket.dtype):
                if compiled is None:
                    continue
                temp = compiled.memory_analysis().temp_size_in_bytes
                assert temp <= bound, (direction.__name__, bucket.name, temp, bound)
    # Every way a leaf moves is covered: a bucket converted whole, one layer by layer, whole rows, all-to-all.
    stays = [_logical._whole(plan, b, _routes(plan, i), "to_blocks") for i, b in enumerate(plan.buckets)]
    stacked = [b.layers is not None for b in plan.buckets]
    assert any(s and w for s, w in zip(stacked, stays, strict=True))
    assert any(s and not w for s, w in zip(stacked, stays, strict=True))
    routes = [rt for b in range(len(plan.buckets)) for rt in _routes(plan, b) if rt.n]
    strided = [rt for rt in routes if not _logical._by_permutes(rt.to_blocks)]
    assert any(_logical._RowOwners.of(rt) is not None for rt in strided)  # whole rows


def _routes(plan, b):
    storages = _logical._bucket_storages(plan, b)
    return [_logical._Route(plan.buckets[b], j, st, plan.num_devices) for j, st in enumerate(storages)]


@pytest.fixture
def all_to_all_only(monkeypatch):
    """Every strided leaf by the padded all-to-all (the path of many long rows, which needs more than 16 devices),
    the conversions compiled afresh before and after."""
    monkeypatch.setattr(_logical, "_FEW_RUNS", 0)
    monkeypatch.setattr(_logical._RowOwners, "of", classmethod(lambda cls, rt: None))
    for cached in (_logical._out_executables, _logical._in_executables):
        cached.cache_clear()
    yield
    for cached in (_logical._out_executables, _logical._in_executables):
        cached.cache_clear()


@pytest.mark.parametrize("m", [3, 8])
def test_conversion_round_trip_is_bitwise_with_checksums(m):
    tree = stacked_tree(3)
    plan = plan_of(tree, m)
    sp = vj.shard(tree, plan)
    leaves, sums = _logical.to_logical(sp.buffers, plan)
    assert_trees_equal(jax.tree_util.tree_unflatten(plan.treedef, leaves), tree)
    want = _integrity.checksums(tree)
    paths = [_integrity.raw_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    assert [list(map(int, r)) for r in sums] == [want[p] for p in paths]
    bufs, back = _logical.from_logical(leaves, plan)
    np.testing.assert_array_equal(back, sums)
    for x, y in zip(bufs, sp.buffers, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.usefixtures("all_to_all_only")
def test_the_all_to_all_path_round_trips_bitwise():
    test_conversion_round_trip_is_bitwise_with_checksums(8)
