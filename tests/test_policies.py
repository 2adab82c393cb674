"""Placement and caching policies: which arrays ``vj.fsdp`` / ``vj.init_opt_state`` shard like a bucket (by type,
never by shape), ``vj.place_batch`` on batches already on the mesh, and the bounded per-plan caches
(``vj.shard`` / ``vj.unshard`` compile once per plan; the optimizers' plan tables)."""

import contextlib
import dataclasses
import gc
import logging
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
from vescale_jax._cache import PLAN_CACHE_SIZE
from vescale_jax.state._sharded import PerDevice


def tree(seed=0):
    k = jax.random.split(jax.random.key(seed), 2)
    return {"w": jax.random.normal(k[0], (8, 5), jnp.float32), "b": jax.random.normal(k[1], (5,), jnp.float32)}


def setup(m, *, auto=True):
    mesh = make_mesh(m, auto=auto)
    params = tree()
    plan = vj.plan(params, mesh)
    return plan, params, vj.shard(params, plan)


def replicated(plan):
    return NamedSharding(plan.mesh, P())


def assert_sharding(x, want, what):
    assert x.sharding.is_equivalent_to(want, x.ndim), f"{what}: {x.sharding}, expected {want}"


# --- Shardings by type, not by shape -----------------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 3])
def test_step_output_of_a_bucket_shape_keeps_its_own_sharding(m):
    """An extra output (a metric) whose shape equals a bucket's is not a parameter: the step leaves its
    sharding as the computation gives it; params, gradients and state stay sharded like their buckets."""
    plan, _, sp = setup(m)
    bucket = plan.buckets[0]
    tx = optax.sgd(0.1, momentum=0.9)

    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: vj.apply(lambda t, x: x * jnp.sum(t["w"]) + jnp.sum(t["b"]), p, batch).sum())(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        metric = jax.lax.with_sharding_constraint(jnp.zeros(bucket.shape, jnp.float32) + batch.sum(), replicated(plan))
        return optax.apply_updates(params, updates), opt_state, metric, grads

    fn = vj.fsdp(step, plan=plan)
    params, opt_state, metric, grads = fn(sp, vj.init_opt_state(tx, sp), jnp.ones((2 * m,), jnp.float32))
    assert metric.shape == bucket.shape
    assert_sharding(metric, replicated(plan), "the metric")
    for what, tree in (("params", params), ("grads", grads), ("momentum", opt_state[0].trace)):
        for x, want in zip(tree.buffers, plan.shardings(), strict=True):
            assert_sharding(x, want, what)


@pytest.mark.parametrize("auto", [True, False])
def test_init_opt_state_places_by_type(auto):
    """A state leaf of a bucket's shape that is not a ShardedParams child is replicated; ShardedParams children
    are sharded like their bucket, PerDevice values split on dim 0."""
    m = 3
    plan, _, sp = setup(m, auto=auto)
    bucket = plan.buckets[0]

    def init(params):
        return {
            "mu": jax.tree.map(jnp.zeros_like, params),
            "table": jnp.zeros(bucket.shape, jnp.float32),
            "rows": PerDevice(jnp.zeros((m * 2, 4), jnp.float32), plan),
            "count": jnp.zeros((), jnp.int32),
        }

    tx = optax.GradientTransformation(init, lambda u, s, p=None: (u, s))
    state = vj.init_opt_state(tx, sp)
    for x, want in zip(state["mu"].buffers, plan.shardings(), strict=True):
        assert_sharding(x, want, "mu")
    assert_sharding(state["table"], replicated(plan), "table")
    assert_sharding(state["rows"].value, NamedSharding(plan.mesh, P(plan.axis, None)), "rows")
    assert_sharding(state["count"], replicated(plan), "count")


def test_per_device_step_output_keeps_dim0_split():
    """A PerDevice state the step computes replicated comes back split on dim 0, as init_opt_state placed it,
    so the next call does not recompile."""
    m = 3
    plan, _, sp = setup(m)
    rows = NamedSharding(plan.mesh, P(plan.axis, None))

    def init(params):
        return PerDevice(jnp.zeros((m * 2, 4), jnp.float32), plan)

    def update(u, s, p=None):
        return u, s.replace(jax.lax.with_sharding_constraint(s.value + 1, replicated(plan)))

    tx = optax.GradientTransformation(init, update)

    def step(params, opt_state, batch):
        _, opt_state = tx.update(params, opt_state)
        return params, opt_state

    fn = vj.fsdp(step, plan=plan)
    params, state = fn(sp, vj.init_opt_state(tx, sp), jnp.ones((m,)))
    assert_sharding(state.value, rows, "the PerDevice value")
    params, state = fn(params, state, jnp.ones((m,)))
    np.testing.assert_array_equal(np.asarray(state.value), np.full((m * 2, 4), 2.0, np.float32))


# --- vj.shard / vj.unshard compile once per plan -----------------------------------------------------------------


class _Compiles(logging.Handler):
    """Counts JAX's "Compiling ..." log records (``jax.log_compiles``) while installed."""

    def __init__(self):
        super().__init__()
        self.names = []

    def emit(self, record):
        if "Compiling" in record.getMessage():
            self.names.append(record.getMessage()[:80])

    def __enter__(self):
        self._log = jax.log_compiles(True)
        self._log.__enter__()
        logging.getLogger("jax").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("jax").removeHandler(self)
        self._log.__exit__(*exc)


@pytest.mark.parametrize("m", [1, 3])
def test_shard_and_unshard_compile_once_per_plan(m):
    plan, params, first = setup(m, auto=False)
    back = vj.unshard(first)
    other = tree(seed=1)
    with _Compiles() as compiles:
        again = vj.shard(other, plan)
        back_again = vj.unshard(again)
        vj.shard(params, vj.plan(params, plan.mesh))  # an equal plan built again: the same cache entry
    assert not compiles.names, compiles.names
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(back_again), jax.tree.leaves(other), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for x, want in zip(again.buffers, plan.shardings(), strict=True):
        assert_sharding(x, want, "vj.shard's buffer")


# --- Bounded plan-keyed caches -----------------------------------------------------------------------------------


def _describe(x):
    """A comparable description of a table object: dataclass fields, arrays by shape, dtype and bytes."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return (type(x).__name__, tuple((f.name, _describe(getattr(x, f.name))) for f in dataclasses.fields(x)))
    if isinstance(x, np.ndarray):
        return (x.shape, x.dtype.name, x.tobytes())
    if isinstance(x, list | tuple):
        return tuple(_describe(v) for v in x)
    if isinstance(x, dict):
        return tuple((k, _describe(v)) for k, v in x.items())
    return x


_TABLES = {
    "muon_routing": lambda plan: vj.optim.muon_routing(plan),
    "shampoo_blocks": lambda plan: vj.optim.shampoo_blocks(plan, 4),
    "block_layout": lambda plan: vj.optim.BlockLayout(plan, 4)._tables,
}


@pytest.mark.parametrize("which", sorted(_TABLES))
def test_plan_keyed_caches_are_bounded(which):
    """More distinct plans than the bound: the first plan is evicted (no longer kept alive by the cache), and
    its tables rebuilt for an equal plan equal the first ones."""
    mesh, table = make_mesh(3), _TABLES[which]

    def make(i):
        return vj.plan({"w": jax.ShapeDtypeStruct((8, 4 + i), jnp.float32)}, mesh, granularity=vj.rows(4))

    first = make(0)
    want, alive = _describe(table(first)), weakref.ref(first)
    del first
    for i in range(1, PLAN_CACHE_SIZE + 2):
        table(make(i))
    gc.collect()
    assert alive() is None, f"{which}: a plan-keyed cache keeps every plan alive"
    assert _describe(table(make(0))) == want


# --- vj.place_batch on arrays already on the mesh ----------------------------------------------------------------


@contextlib.contextmanager
def no_host_copy():
    """``np.asarray`` / ``np.array`` of a ``jax.Array`` (a device->host copy) raise inside."""

    def guarded(fn):
        def call(a, *args, **kw):
            if isinstance(a, jax.Array):
                raise AssertionError(f"device->host copy of a jax.Array {a.shape} {a.sharding}")
            return fn(a, *args, **kw)

        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(np, "asarray", guarded(np.asarray))
        mp.setattr(np, "array", guarded(np.array))
        yield


def host_batch(m, rows=4):
    return {"x": np.arange(rows * m * 3, dtype=np.float32).reshape(rows * m, 3), "y": np.arange(rows * m)}


def assert_same_placement(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.shape == b.shape and a.sharding == b.sharding, (a.shape, a.sharding, b.shape, b.sharding)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("microbatches", [None, 2])
@pytest.mark.parametrize("auto", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_place_batch_passes_placed_arrays_through(m, auto, microbatches):
    plan, _, _ = setup(m, auto=auto)
    placed = vj.place_batch(host_batch(m), plan, microbatches=microbatches)
    with no_host_copy():
        again = vj.place_batch(placed, plan, microbatches=microbatches)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(placed), strict=True):
        assert a is b


@pytest.mark.parametrize("microbatches", [None, 2])
@pytest.mark.parametrize("auto", [False, True])
def test_place_batch_moves_device_arrays_on_device(auto, microbatches):
    """Device arrays of another placement (one device, replicated, or the flat batch split on dim 0 when
    micro-batches are asked for) are moved between devices, never through the host; the result equals placing
    the host batch."""
    m = 3
    plan, _, _ = setup(m, auto=auto)
    host = host_batch(m)
    want = vj.place_batch(host, plan, microbatches=microbatches)
    inputs = [jax.tree.map(jnp.asarray, host), jax.device_put(host, replicated(plan)), vj.place_batch(host, plan)]
    with no_host_copy():
        got = [vj.place_batch(batch, plan, microbatches=microbatches) for batch in inputs]
    for g in got:
        assert_same_placement(g, want)


@pytest.mark.parametrize("auto", [False, True])
def test_place_batch_checks_device_arrays(auto):
    m = 3
    plan, _, _ = setup(m, auto=auto)
    with pytest.raises(ValueError, match=r"batch leaf \['x'\] has shape \(4, 2\).*divisible by the data-parallel"):
        vj.place_batch({"x": jnp.ones((4, 2))}, plan)
    with pytest.raises(ValueError, match=r"batch leaf \['x'\] has shape \(9, 2\).*does not split into 2 micro"):
        vj.place_batch({"x": jnp.ones((9, 2))}, plan, microbatches=2)
    with pytest.raises(ValueError, match=r"micro-batch leaf \['x'\] has shape \(2, 2\).*divisible by the data"):
        vj.place_batch({"x": jnp.ones((6, 2))}, plan, microbatches=3)
    with pytest.raises(ValueError, match=r"batch leaf \['x'\] is a scalar"):
        vj.place_batch({"x": jnp.ones(())}, plan)


def test_step_takes_a_batch_placed_with_its_microbatches():
    """A vj.fsdp step with microbatches= given a batch already placed by vj.place_batch(..., microbatches=k)
    uses it as it is (it is not split a second time)."""
    m = 3
    plan, _, sp = setup(m, auto=False)

    def step(params, opt_state, batch):
        return params, opt_state, batch

    fn = vj.fsdp(step, plan=plan, microbatches=2, donate=False)
    host = host_batch(m)
    want = fn(sp, None, host)[2]
    got = fn(sp, None, vj.place_batch(host, plan, microbatches=2))[2]
    assert_same_placement(got, want)
