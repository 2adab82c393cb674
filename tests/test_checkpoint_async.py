"""vj.checkpoint.Manager(async_save=True): saves written by a worker thread while the next steps run."""

from __future__ import annotations

import threading

import jax
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import assert_trees_equal
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
from vescale_jax.checkpoint import _background as _background


def tree_of(seed: int = 0):
    """Two leaves in one bucket (numpy: no compiles); every kind of bucket is converted in test_checkpoint.py."""
    rng = np.random.default_rng(seed)
    return {"embed": rng.standard_normal((40, 12), np.float32), "bias": rng.standard_normal(12, np.float32)}


def plan_of(tree, m=4):
    return vj.plan(tree, make_mesh(m), axis="fsdp")


@pytest.fixture(scope="module")
def state():
    """Params, an optimizer state (AdamW's moments as ShardedParams; its count and an ``ema`` array stored as
    they are), and a step with and without donation."""
    tree = tree_of()
    plan = plan_of(tree)
    sp = vj.shard(tree, plan)
    ema = jax.device_put(np.arange(16, dtype=np.float32), NamedSharding(plan.mesh, P("fsdp")))
    opt = (vj.init_opt_state(optax.adamw(1e-2), sp), {"ema": ema})

    def change(x):
        return x + 1 if jax.numpy.issubdtype(x.dtype, jax.numpy.integer) else x * 0.5 + 1

    def step(sp, opt):  # a stand-in for a train step: every buffer and the count change
        return jax.tree.map(change, (sp, opt))

    return plan, sp, opt, jax.jit(step), jax.jit(step, donate_argnums=(0, 1))


def host(tree):
    """A host copy of every array, each ``ShardedParams`` as its logical tree (read before a donation)."""
    is_sp = lambda x: isinstance(x, vj.ShardedParams)
    logical = jax.tree.map(lambda x: vj.unshard(x) if is_sp(x) else x, tree, is_leaf=is_sp)
    return jax.tree.map(np.asarray, logical)


def test_the_worker_thread_writes_and_save_returns_before_the_write(tmp_path, state):
    plan, sp, opt, _, _ = state
    release, threads, kinds = threading.Event(), [], set()
    with vj.checkpoint.Manager(tmp_path, async_save=True) as mngr:
        orbax_save = mngr._mngr.save

        def held_save(*args, **kwargs):  # Orbax's save, held until the test has seen save() return
            threads.append(threading.current_thread())
            written = [x for x in jax.tree.leaves([kwargs["args"][k].item for k in ("params", "opt_state")])]
            kinds.update(x.sharding.memory_kind for x in written if isinstance(x, jax.Array))
            assert release.wait(60)
            return orbax_save(*args, **kwargs)

        mngr._mngr.save = held_save
        assert mngr.save(1, params=sp, opt_state=opt, metadata={"n": 1})
        assert not release.is_set()  # save() returned while Orbax's save had not started writing
        release.set()
        mngr.wait()
        assert [t.name for t in threads] == ["vj-checkpoint-save-1"]
        assert threads[0] is not threading.main_thread()
        # what the worker writes lives in pinned host memory: the device holds none of the save during the overlap
        assert kinds == {_background.HOST_MEMORY}
        assert mngr.all_steps() == [1]
        r = mngr.restore(params=plan, opt_state=jax.eval_shape(lambda: opt))
    assert_trees_equal(host(r.params), host(sp))
    assert_trees_equal(host(r.opt_state), host(opt))
    assert r.metadata == {"n": 1}


def test_save_then_donating_steps_then_wait_writes_the_values_at_the_save(tmp_path, state):
    plan, sp0, opt0, step, donating = state
    jax.block_until_ready(donating(*step(sp0, opt0)))  # compiled before the save: it donates at once
    sp, opt = step(sp0, opt0)  # arrays of our own: the donating step deletes them
    want_params, want_opt = host(sp), host(opt)
    saved = jax.tree.leaves((sp, opt))
    with vj.checkpoint.Manager(tmp_path, async_save=True) as mngr:
        mngr.save(1, params=sp, opt_state=opt)
        for _ in range(3):  # donated while the worker copies and writes
            sp, opt = donating(sp, opt)
        assert all(x.is_deleted() for x in saved if x.ndim)  # the count (a scalar) is not donated on CPU
        mngr.wait()
        r = mngr.restore(params=plan, opt_state=jax.eval_shape(lambda: opt0))
    assert_trees_equal(host(r.params), want_params)
    assert_trees_equal(host(r.opt_state), want_opt)  # ema too: stored as it is, from a copy made at the save


def test_saves_are_written_in_order_and_max_to_keep_holds(tmp_path, state):
    plan, sp, opt, step, _ = state
    order = []
    want = {}
    with vj.checkpoint.Manager(tmp_path, async_save=True, max_to_keep=2) as mngr:
        orbax_save = mngr._mngr.save
        mngr._mngr.save = lambda s, **kw: (order.append(s), orbax_save(s, **kw))[1]
        for s in (1, 2, 3):
            mngr.save(s, params=sp, opt_state=opt, metadata={"s": s})  # waits for the previous save first
            want[s] = host(sp)
            sp, opt = step(sp, opt)
        assert mngr.latest_step() == 3 and mngr.all_steps() == [2, 3]
        assert order == [1, 2, 3]
        for s in (2, 3):
            r = mngr.restore(s, params=plan)
            assert_trees_equal(host(r.params), want[s])
            assert r.metadata == {"s": s}


def test_an_error_in_the_background_surfaces_at_wait_naming_the_step(tmp_path, state):
    _, sp, _, _, _ = state
    mngr = vj.checkpoint.Manager(tmp_path, async_save=True)
    orbax_save = mngr._mngr.save

    def failing(s, **kwargs):
        if s == 2:
            raise OSError("No space left on device")
        return orbax_save(s, **kwargs)

    mngr._mngr.save = failing
    mngr.save(1, params=sp)
    assert mngr.save(2, params=sp)  # returns: the error is the worker's
    with pytest.raises(RuntimeError, match=r"background save of step 2 .*OSError: No space left on device") as e:
        mngr.wait()
    assert isinstance(e.value.__cause__, OSError)
    mngr.wait()  # raised once
    assert mngr.all_steps() == [1]
    mngr._mngr.save = orbax_save
    mngr.save(2, params=sp)  # the failed step is not this run's: saving it again is allowed
    mngr.wait()  # written before Orbax's save is replaced again (the worker calls it after the checksums)
    mngr._mngr.save = lambda s, **kw: (_ for _ in ()).throw(OSError("read-only file system"))
    mngr.save(3, params=sp)
    with pytest.raises(RuntimeError, match="background save of step 3"):
        mngr.save(4, params=sp)  # the next save raises it too
    mngr._mngr.save = orbax_save
    mngr.close()
    assert vj.checkpoint.Manager(tmp_path).all_steps() == [1, 2]


def test_async_save_keeps_local_copies(tmp_path, state):
    plan, sp, opt, step, _ = state
    release = threading.Event()
    with vj.checkpoint.Manager(
        tmp_path / "global", async_save=True, save_interval_steps=4, local_dir=tmp_path / "local", local_every=2
    ) as mngr:
        orbax_save = mngr._mngr.save
        mngr._mngr.save = lambda *a, **kw: (release.wait(60), orbax_save(*a, **kw))[1]  # held until released
        for s in (2, 4, 6):
            sp, opt = step(sp, opt)
            assert mngr.should_save(s)
            mngr.save(s, params=sp, opt_state=opt)
            if s == 4:
                want = host(sp)
        assert not release.is_set() and mngr.local_steps() == [4, 6]  # step 6's local copy: not behind step 4
        release.set()
        mngr.wait()
        assert mngr.all_steps() == [4]
    with vj.checkpoint.Manager(tmp_path / "global", local_dir=tmp_path / "local") as mngr:
        r = mngr.restore(4, params=plan, opt_state=jax.eval_shape(lambda: opt))
    assert r.source == "local" and r.step == 4
    assert_trees_equal(host(r.params), want)


def test_detach_copies_only_arrays_sharing_the_states_buffers():
    x = jax.numpy.arange(8.0)
    fresh = x + 1
    same_buffer = jax.make_array_from_single_device_arrays(x.shape, x.sharding, [s.data for s in x.addressable_shards])
    got = _background.detach({"a": x, "b": fresh, "c": same_buffer, "d": np.ones(2)}, [x])
    assert got["b"] is fresh and got["d"] is not None
    for k in ("a", "c"):
        assert got[k] is not x and got[k].unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
        np.testing.assert_array_equal(got[k], x)


def _stacked_tree(seed: int = 0):
    """A stacked group converted one layer per call (its leaves do not line up with the shards) beside a plain
    bucket converted in one call."""
    rng = np.random.default_rng(seed)
    return {
        "embed": rng.standard_normal((13, 12), np.float32),
        "blocks": {"w": rng.standard_normal((3, 12, 20), np.float32), "b": rng.standard_normal((3, 7), np.float32)},
    }


def test_each_conversion_writes_its_leaves_to_host_memory_itself():
    """A background save's conversions end in pinned host memory inside their own programs (an unstacked
    bucket's conversion; a stacked bucket's last program after its layers), bit-equal to the device path."""
    from vescale_jax.relayout import _logical_leaves as _logical

    tree = _stacked_tree()
    plan = vj.plan(tree, make_mesh(8 if len(jax.devices()) >= 8 else len(jax.devices())), stacked=("blocks",))
    kind = _background.host_memory(plan.mesh)
    if kind is None:
        pytest.skip("no pinned host memory on these devices")
    sp = vj.shard(tree, plan)
    on_device, sums = _logical.to_logical(sp.buffers, plan)
    on_host, deferred = _logical.to_logical(sp.buffers, plan, memory_kind=kind, defer_sums=True)
    assert {x.sharding.memory_kind for x in on_host} == {kind}
    assert_trees_equal([np.asarray(x) for x in on_host], [np.asarray(x) for x in on_device])
    np.testing.assert_array_equal(deferred(), sums)
    if "unpinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}:
        # another host kind (an offloaded node's) is reached by a copy after the program, not inside it
        unpinned, _ = _logical.to_logical(sp.buffers, plan, memory_kind="unpinned_host")
        assert {x.sharding.memory_kind for x in unpinned} == {"unpinned_host"}
        assert_trees_equal([np.asarray(x) for x in unpinned], [np.asarray(x) for x in on_device])
    kinds = set()
    for b, bucket in enumerate(plan.buckets):
        start, step, finish = _logical._out_executables(plan, b, bucket.dtype, kind)
        last = step if finish is None else finish
        leaves = last.output_shardings[0] if finish is None else last.output_shardings
        assert {s.memory_kind for s in jax.tree.leaves(leaves)} == {kind}, bucket.name
        kinds.add(start is None)
    assert kinds == {True, False}, "the tree has a bucket converted whole and one layer by layer"


def test_a_save_only_enqueues_where_the_device_runs_programs_in_order(tmp_path, monkeypatch):
    """Where the device runs each program in launch order (a GPU), ``save`` waits for nothing: it enqueues the
    conversions and their moves to host memory and returns; the worker fetches the checksums and writes. Shown
    on one CPU device (no collective to rendezvous) with the platform's answer switched: no call from the
    saving thread waits on an array, and the step's values are written."""
    from vescale_jax.relayout import _logical_leaves as _logical

    tree = _stacked_tree(1)
    plan = vj.plan(tree, make_mesh(1), stacked=("blocks",))
    sp = vj.shard(tree, plan)
    opt = vj.init_opt_state(optax.adam(1e-2), sp)
    expected = host((sp, opt))
    waits: list[str] = []
    main = threading.current_thread()

    def recording(name, fn):
        def call(*args, **kwargs):
            if threading.current_thread() is main:
                waits.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(_logical, "must_wait", lambda results: False)
    with vj.checkpoint.Manager(tmp_path, async_save=True) as mngr:
        mngr.prepare(params=sp, opt_state=opt)
        for name in ("block_until_ready", "device_get"):
            monkeypatch.setattr(jax, name, recording(name, getattr(jax, name)))
        assert mngr.save(1, params=sp, opt_state=opt)
        assert waits == [], f"save waited on the devices: {waits}"
        monkeypatch.undo()
        mngr.wait()
        r = mngr.restore(1, params=plan, opt_state=jax.eval_shape(lambda: opt))
    assert_trees_equal(host((r.params, r.opt_state)), expected)
