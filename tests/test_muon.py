"""vj.optim.muon against optax.contrib.muon applied to the unsharded logical tree; owners, census, sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import assert_trees_close, load_script

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax import testing
from vescale_jax.optim._muon._matrices import ns_macs, split_macs
from vescale_jax.optim._muon._transform import resolve_dimension_numbers

STEPS = 10
MDN = optax.contrib.MuonDimensionNumbers


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {
        "a": {"w": (37, 11), "b": (11,)},
        "b": {"w": (11, 5), "v": (6, 4, 5)},
        "layers": {"w": (3, 20, 52), "b": (3, 52)},
        "head": {"w": (16, 16)},
    }
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def dims_tree(params):
    """Explicit dimension numbers for the reference: the stacked leaf is batch x (20, 52); the 3-D "v" leaf
    is (6*4) x 5 (reduction over two axes)."""
    d = jax.tree.map(lambda x: MDN() if x.ndim == 2 else None, params)
    d["layers"]["w"] = MDN(reduction_axis=1, output_axis=2)
    d["b"]["v"] = MDN(reduction_axis=(0, 1), output_axis=2)
    return d


def grads_seq(params, n=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    return [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params) for _ in range(n)]


_REFS = {}


def reference(name, params, grads, **kw):
    """optax.contrib.muon on the unsharded logical tree; params after each step (cached per config)."""
    if name not in _REFS:
        tx = optax.contrib.muon(**kw)
        state = tx.init(params)

        @jax.jit
        def step(p, state, g):
            u, state = tx.update(g, state, p)
            return optax.apply_updates(p, u), state

        out = []
        for g in grads:
            params, state = step(params, state, g)
            out.append(params)
        _REFS[name] = out
    return _REFS[name]


def shard_fns(plan):
    """Cached (jitted once) shard / unshard for a plan: vj.shard / vj.unshard re-trace on every call."""
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())
    pack = jax.jit(
        lambda xs: vj.ShardedParams(vj.state._sharded.pack(jax.tree.leaves(xs), plan), plan),
        out_shardings=vj.ShardedParams(plan.shardings(), plan),
    )
    unpack_fn = jax.jit(
        lambda bufs: jax.tree_util.tree_unflatten(plan.treedef, vj.state._sharded.unpack(bufs, plan)),
        out_shardings=replicated,
    )
    return pack, lambda sp: unpack_fn([jax.device_put(x, replicated) for x in sp.buffers])


def run_sharded(params, grads, plan, **kw):
    tx = vjo.muon(plan=plan, **kw)
    pack, unpack = shard_fns(plan)
    sp = vj.shard(params, plan)
    state = vj.init_opt_state(tx, sp)

    @jax.jit
    def step(sp, state, g):
        u, state = tx.update(g, state, sp)
        return optax.apply_updates(sp, u), state

    out = []
    with jax.set_mesh(plan.mesh):
        for g in grads:
            sp, state = step(sp, state, pack(g))
            out.append(unpack(sp))
    return out, step, sp, state


PARAMS = make_params()
GRADS = grads_seq(PARAMS)
# ns_steps=3 keeps compile time down; OPTIONS runs the 5-step 'dion' table.
DEFAULT = dict(learning_rate=0.05, ns_steps=3, muon_weight_dimension_numbers=dims_tree)
OPTIONS = dict(
    learning_rate=0.03,
    nesterov=False,
    adaptive=True,
    weight_decay=0.1,
    weight_decay_mask=lambda p: jax.tree.map(lambda x: x.shape != (16, 16), p),
    consistent_rms=0.2,
    adam_weight_decay=0.01,
    adam_learning_rate=0.01,
    ns_coeffs="dion",
    ns_steps=5,
    beta=0.9,
    muon_weight_dimension_numbers=dims_tree,
)


@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_parity_element(m):
    plan = vj.plan(PARAMS, make_mesh(m), stacked=["layers"])
    got, step, sp, state = run_sharded(PARAMS, GRADS, plan, **DEFAULT)
    for g, r in zip(got, reference("default", PARAMS, GRADS, **DEFAULT), strict=True):
        assert_trees_close(g, r)
    assert step._cache_size() == 1  # no recompilation after the first step
    # Optimizer state is sharded like the params: every bucket-shaped state leaf has its bucket's sharding.
    by_shape = {b.shape: s for b, s in zip(plan.buckets, plan.shardings(), strict=True)}
    bucket_leaves = [x for x in jax.tree.leaves(state) if x.shape in by_shape]
    assert len(bucket_leaves) == len(plan.buckets)  # Muon's momentum
    for x in bucket_leaves:
        assert x.sharding.is_equivalent_to(by_shape[x.shape], x.ndim), (x.shape, x.sharding)
    # AdamW's moments cover the non-Muon leaves only, each device keeping those it holds.
    adam = [
        x.value
        for x in jax.tree.leaves(state.adam, is_leaf=lambda x: isinstance(x, vj.PerDevice))
        if isinstance(x, vj.PerDevice)
    ]
    dims = resolve_dimension_numbers(plan, dims_tree)
    non_muon = sum(s.size for s, d in zip(plan.leaves, dims, strict=True) if d is None)
    assert len(adam) == 2
    for x in adam:
        assert non_muon <= x.size <= m * non_muon and (m > 1 or x.size == non_muon)
        assert x.sharding.spec == jax.sharding.PartitionSpec(plan.axis)
    if m == 8:
        with jax.set_mesh(plan.mesh):
            compiled = step.lower(sp, state, sp).compile()
        # One all-to-all to the owners, one back.
        assert testing.census(compiled).count("all-to-all") == 2


@pytest.mark.parametrize("m,granularity", [(3, vj.rows(2)), (8, vj.whole())])
def test_parity_options(m, granularity):
    plan = vj.plan(PARAMS, make_mesh(m), stacked=["layers"], granularity=granularity)
    got, step, sp, state = run_sharded(PARAMS, GRADS, plan, **OPTIONS)
    for g, r in zip(got, reference("options", PARAMS, GRADS, **OPTIONS), strict=True):
        assert_trees_close(g, r)
    if granularity == vj.whole():
        # Every matrix sits whole on one device: orthogonalised there, no all-to-all at all.
        routing = vjo.muon_routing(plan, dims_tree)
        assert routing.width == 0
        assert all(r.devices == (r.owner,) for r in routing.matrices)
        with jax.set_mesh(plan.mesh):
            compiled = step.lower(sp, state, sp).compile()
        assert testing.census(compiled).count("all-to-all") == 0


def _abstract(shapes):
    return {f"l{i}": jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(shapes)}


def test_owners_slots_and_batching():
    # 24 matrices of 3 shapes cut across 8 devices element-wise. Every device runs K_c slots of class c (SPMD),
    # K_c = ceil(n_c / m) unless splitting the leftovers is cheaper; same-shape matrices on one owner share one
    # batched work array (transposes share a class); the reported balance is what every device computes.
    shapes = [(64, 48)] * 8 + [(48, 64)] * 4 + [(32, 96)] * 6 + [(96, 32)] * 6
    params = _abstract(shapes)
    plan = vj.plan(params, make_mesh(8), units=lambda path, leaf: "all")
    routing = vjo.muon_routing(plan)
    assert sorted((p, q) for p, q, _ in routing.classes) == [(32, 96), (48, 64)]
    assert routing.splits == ()  # 4 leftovers of each class: one more slot is cheaper than 4 split matrices
    counts = {}
    for r in routing.matrices:
        counts[(r.owner, r.shape)] = counts.get((r.owner, r.shape), 0) + 1
    for p, q, k in routing.classes:
        assert k == 2 == max(c for (o, sh), c in counts.items() if sh == (p, q))
        assert 4 * split_macs(p, q, 8) >= ns_macs(p, q)
    assert routing.slot_cost == 2 * ns_macs(48, 64) + 2 * ns_macs(32, 96)
    assert max(routing.loads) <= routing.slot_cost
    assert sum(r.transposed for r in routing.matrices) == 8 + 6  # the tall ones (p > q)


def test_leftover_matrices_are_split_by_columns():
    # 9 matrices of 64 x 256 on 8 devices: 8 owners, and the ninth split by columns (32 per device) instead of
    # a second slot everywhere; the update matches optax on the logical tree.
    params = {f"l{i}": jnp.asarray(np.random.default_rng(i).standard_normal((64, 256)), jnp.float32) for i in range(9)}
    plan = vj.plan(params, make_mesh(8), units=lambda path, leaf: "all")
    routing = vjo.muon_routing(plan)
    assert routing.classes == ((64, 256, 1),) and routing.splits == ((64, 256, 1),)
    assert sum(r.owner == -1 for r in routing.matrices) == 1
    assert routing.balance == pytest.approx(8 * (ns_macs(64, 256) + split_macs(64, 256, 8)) / (9 * ns_macs(64, 256)))
    assert routing.balance <= 1.25
    grads = [jax.tree.map(lambda x, s=s: x * (1 + s), params) for s in range(3)]
    kw = dict(learning_rate=0.05, ns_steps=3)
    got, *_ = run_sharded(params, grads, plan, **kw)
    for g, r in zip(got, reference("split", params, grads, **kw), strict=True):
        assert_trees_close(g, r)


def test_owners_whole_stays_put():
    params = _abstract([(40, 30), (30, 40), (7, 9), (100,)])
    plan = vj.plan(params, make_mesh(3), units=lambda path, leaf: "all", granularity=vj.whole())
    routing = vjo.muon_routing(plan)
    assert routing.width == 0
    for r in routing.matrices:
        shard = plan.shard_of(plan.leaves[r.leaf].path)
        assert shard.owner == r.owner
    assert len(routing.matrices) == 3  # the vector is an AdamW leaf


def test_rejects_unsharded_updates():
    plan = vj.plan(PARAMS, make_mesh(2), stacked=["layers"])
    tx = vjo.muon(0.1, plan=plan)
    with pytest.raises(TypeError, match="ShardedParams"):
        tx.init(PARAMS)


def test_muon_inside_a_vj_fsdp_step_matches_optax_unsharded():
    from flax import nnx
    from helpers import GPTConfig, abstract_model, batches, init_params, loss_fn, muon_dimension_numbers

    cfg = GPTConfig(vocab=67, max_len=16, d_model=20, num_heads=2, num_layers=2, d_ff=52)
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, make_mesh(3), stacked=("blocks",))
    params = init_params(cfg, jax.random.key(0))
    # Stacked (L, p, q) kernels are L matrices and the head one; embeddings, norms and biases go to AdamW.
    dims = muon_dimension_numbers

    kw = dict(learning_rate=0.02, adam_learning_rate=3e-3)
    ref_tx = optax.contrib.muon(**kw, muon_weight_dimension_numbers=dims(params))
    tx = vj.optim.muon(**kw, plan=plan, muon_weight_dimension_numbers=dims(params))
    data = list(batches(3, batch=12))

    @jax.jit
    def ref_step(p, state, batch):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p)(batch["x"] % 67), batch["y"] % 67))(p)
        u, state = ref_tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    @vj.fsdp(plan=plan)
    def step(p, state, batch):
        loss, g = jax.value_and_grad(
            lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"] % 67), batch["y"] % 67)
        )(p)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    ref, ref_state = params, ref_tx.init(params)
    sp = vj.shard(params, plan)
    state = vj.init_opt_state(tx, sp)
    for batch in data:
        ref, ref_state, ref_loss = ref_step(ref, ref_state, batch)
        sp, state, loss = step(sp, state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref)


# --- run tables ------------------------------------------------------------------------------------------------

RUN_SHAPES = {
    "tall": (40, 12),  # stored transposed (12, 40)
    "wide": (12, 40),
    "layers": {"w": (3, 20, 52), "t": (3, 52, 20), "b": (3, 52)},  # stacked; "t" is tall
    "nd": (6, 4, 5),  # reduction over two axes: (24, 5), tall
    "perm": (6, 5, 7),  # reduction 1, output 0: 7 matrices (5, 6) whose rows are strided
    "mixed": (4, 6, 5),  # output over axes 0 and 2: rows are not one arithmetic progression
    "split": {f"s{i}": (16, 64) for i in range(4)},  # leftovers of one class: split by columns
    "vec": (11,),
}
RUN_DIMS = {
    "tall": MDN(),
    "wide": MDN(),
    "layers": {"w": MDN(1, 2), "t": MDN(1, 2), "b": None},
    "nd": MDN(reduction_axis=(0, 1), output_axis=2),
    "perm": MDN(reduction_axis=1, output_axis=0),
    "mixed": MDN(reduction_axis=1, output_axis=(0, 2)),
    "split": {f"s{i}": MDN() for i in range(4)},
    "vec": None,
}


def _brute_force_matrices(shape, dims):
    """(batch, p, q) arrangement of a leaf's flat indices as optax reshapes it, tall ones transposed."""
    ndim = len(shape)
    norm = lambda a: tuple(x % ndim for x in ((a,) if isinstance(a, int) else a))
    red, out = norm(dims.reduction_axis), norm(dims.output_axis)
    batch = tuple(a for a in range(ndim) if a not in red + out)
    idx = np.arange(int(np.prod(shape))).reshape(shape).transpose(batch + red + out)
    size = lambda axes: int(np.prod([shape[a] for a in axes]))
    mats = idx.reshape(size(batch), size(red), size(out))
    tall = mats.shape[1] > mats.shape[2]
    return (mats.transpose(0, 2, 1) if tall else mats), tall


def _simulate_routing(plan, routing, dims_tree):
    """Moves element ids (1-based, 0 = nothing) through the dense form of the run tables exactly as
    route_newton_schulz moves values, and checks every step against a brute-force construction: the local
    vectors X from vj.pack and the devices' shards, the work arrays from the matrices' owners and slots."""
    m = plan.num_devices
    shapes = [leaf.shape for leaf in plan.leaves]
    sizes = [int(np.prod(s)) for s in shapes]
    bases = np.cumsum([1, *sizes[:-1]])
    ids = [jnp.asarray(b + np.arange(n).reshape(s), jnp.float32) for b, n, s in zip(bases, sizes, shapes, strict=True)]
    bufs = [jax.device_put(x, s) for x, s in zip(vj.state._sharded.pack(ids, plan), plan.shardings(), strict=True)]
    devices = list(plan.mesh.devices.flat)
    local = [[None] * m for _ in bufs]
    for b, buf in enumerate(bufs):
        for shard in buf.addressable_shards:
            local[b][devices.index(shard.device)] = np.asarray(shard.data).reshape(-1).astype(np.int64)
    x = [np.concatenate([local[b][k] for b in routing.buckets]) for k in range(m)]
    assert all(len(xk) == routing.local_size for xk in x)

    # The work arrays every device should hold: owner classes, then split classes (column pieces).
    dims = jax.tree.leaves(dims_tree, is_leaf=lambda d: isinstance(d, MDN) or d is None)
    expected = np.zeros((m, routing.work_size), np.int64)
    muon = set()
    class_base, split_base, base = {}, {}, 0
    for p, q, kc in routing.classes:
        class_base[(p, q)], base = base, base + kc * p * q
    for p, q, r in routing.splits:
        split_base[(p, q)], base = base, base + r * p * -(-q // m)
    assert base == routing.work_size
    for route in routing.matrices:
        mats, tall = _brute_force_matrices(shapes[route.leaf], dims[route.leaf])
        mat = bases[route.leaf] + mats[route.batch]
        assert mat.shape == route.shape and route.transposed == tall
        muon |= set(mat.ravel().tolist())
        p, q = route.shape
        if route.owner >= 0:
            at = class_base[(p, q)] + route.slot * p * q
            expected[route.owner, at : at + p * q] = mat.ravel()
        else:
            qs = -(-q // m)
            padded = np.zeros((p, qs * m), np.int64)
            padded[:, :q] = mat
            at = split_base[(p, q)] + route.slot * p * qs
            for k in range(m):
                expected[k, at : at + p * qs] = padded[:, k * qs : (k + 1) * qs].ravel()

    dense = routing.dense()
    rows = [np.append(x[k], 0)[dense["send"][k]] for k in range(m)]  # (m, W): to each owner
    received = [np.stack([rows[s][k] for s in range(m)]).reshape(-1) for k in range(m)]
    work = [np.concatenate([x[k], received[k], [0]])[dense["gather"][k]] for k in range(m)]
    np.testing.assert_array_equal(np.stack(work), expected)
    rows = [np.append(work[k], 0)[dense["back_send"][k]] for k in range(m)]
    received = [np.stack([rows[o][k] for o in range(m)]).reshape(-1) for k in range(m)]
    back = [np.concatenate([work[k], received[k], [0]])[dense["back_gather"][k]] for k in range(m)]
    for k in range(m):
        np.testing.assert_array_equal(back[k], np.where(np.isin(x[k], list(muon)), x[k], 0))
    return dense


@pytest.mark.parametrize("m,granularity", [(3, None), (3, vj.rows(2)), (8, None), (8, vj.rows(2))])
def test_run_tables_match_brute_force(m, granularity, monkeypatch):
    from vescale_jax.relayout import _run_lookup as runs

    shapes = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32), RUN_SHAPES, is_leaf=lambda x: isinstance(x, tuple)
    )
    plan = vj.plan(shapes, make_mesh(m), stacked=["layers"], granularity=granularity)
    routing = vjo.muon_routing(plan, RUN_DIMS)
    assert routing.splits and any(r.transposed for r in routing.matrices) and routing.width
    dense = _simulate_routing(plan, routing, RUN_DIMS)

    # The devices expand the lookups into exactly the dense tables (several chunks per loop here).
    monkeypatch.setattr(runs, "_CHUNK", 64)
    w, t = routing.width, routing.local_size
    for name, n in (("send", m * w), ("gather", routing.work_size), ("back_send", m * w), ("back_gather", t)):
        lookup = routing.lookups[name]
        expand = jax.jit(jax.vmap(lambda k, lookup=lookup, n=n: runs.run_indices(lookup, k, n, jnp.zeros(1))))
        got = np.asarray(expand(jnp.arange(m, dtype=jnp.int32)))
        np.testing.assert_array_equal(got, dense[name].reshape(m, n), err_msg=name)


def test_run_tables_are_small_for_the_benchmark_model():
    # The dense index tables were ~4 x (all Muon elements) int32; the run tables are a few entries per row.
    bench = load_script("benchmarks/muon.py")

    plan = vj.plan(bench.model(), make_mesh(8), stacked=["layers"])
    routing = vjo.muon_routing(plan, bench.DIMS)
    elements = sum(r.shape[0] * r.shape[1] for r in routing.matrices)
    runs = sum(getattr(routing, name).size for name in ("send", "gather", "back_send", "back_gather"))
    assert runs < 0.05 * elements
    assert routing.index_bytes < 0.05 * 4 * elements


def _bf16_ulps(got, ref):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    spacing = np.spacing(np.abs(ref)) * 2.0**16  # bf16 spacing: 16 fewer mantissa bits than fp32
    return np.max(np.abs(got - ref) / np.maximum(spacing, np.finfo(np.float32).tiny), initial=0.0)


def _moment_dtypes(state):
    is_rows = lambda x: isinstance(x, vj.PerDevice)
    return sorted({str(x.value.dtype) for x in jax.tree.leaves(state, is_leaf=is_rows) if is_rows(x)})


@pytest.mark.parametrize(("m", "mu_dtype"), [(1, None), (3, None), (8, None), (3, jnp.float32)])
def test_parity_with_bf16_leaves(m, mu_dtype):
    """bf16 leaves of the AdamW branch keep their moments (and compute) in bf16 as optax.contrib.muon does, or
    the first moment in ``mu_dtype`` where it is given; fp32 leaves stay fp32. (With a ``mu_dtype`` wider than
    the leaf, optax returns fp32 updates for the bf16 leaf and rounds once in ``apply_updates``; here updates
    keep the bucket's dtype, a rounding more: only the moments' dtypes are compared then.)"""
    rng = np.random.default_rng(3)
    params = {
        "a": {"w": jnp.asarray(rng.standard_normal((37, 11)), jnp.float32), "b": jnp.zeros((11,), jnp.bfloat16)},
        "n": {"scale": jnp.asarray(rng.standard_normal((13,)), jnp.bfloat16), "g": jnp.ones((7,), jnp.float32)},
    }
    grads = grads_seq(params, n=4)
    kw = dict(learning_rate=0.05, ns_steps=3, mu_dtype=mu_dtype, adam_weight_decay=0.01)
    plan = vj.plan(params, make_mesh(m))
    got, _, _, state = run_sharded(params, grads, plan, **kw)
    want = reference(f"bf16-{mu_dtype}", params, grads, **kw)
    for g, w in zip(got, jax.tree.map(lambda x: x, want), strict=True):
        if mu_dtype is not None:
            break
        for key in ("b", "scale"):
            parent = "a" if key == "b" else "n"
            b, rb = g[parent].pop(key), w[parent].pop(key)
            assert b.dtype == jnp.bfloat16
            assert _bf16_ulps(b, rb) <= 1, (key, _bf16_ulps(b, rb))
        assert_trees_close(g, w)
    # optax's AdamW moments: mu in mu_dtype (else the leaf's), nu in the leaf's dtype.
    ref_state = optax.contrib.muon(**kw).init(params)
    adam = ref_state.inner_states["adam"].inner_state[0]
    want_dtypes = sorted({str(x.dtype) for x in jax.tree.leaves((adam.mu, adam.nu))})
    assert _moment_dtypes(state.adam) == want_dtypes
