"""vj.optim.muon and vj.optim.shampoo on plans with tensor-parallel leaves (``vj.plan(..., tp=...)``), against
optax.contrib.muon and the Shampoo reference on the unsharded logical tree; Muon's routing over (tensor, fsdp),
Shampoo's grouped block state and its TP block check."""

import dataclasses
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import ROOT, assert_trees_close
from jax.sharding import PartitionSpec as P
from shampoo_reference import reference_shampoo

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax import testing

MDN = optax.contrib.MuonDimensionNumbers
STEPS = 10


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def tp_mesh(f, t):
    if f * t > len(jax.devices()):
        pytest.skip(f"needs {f * t} devices, {len(jax.devices())} available")
    return jax.make_mesh((f, t), ("fsdp", "tensor"), devices=jax.devices()[: f * t])


def load_gpt_tp():
    """examples/gpt_tp.py as a module, registered in ``sys.modules`` (its dataclass needs its module there)."""
    name = "script_examples_gpt_tp"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", "gpt_tp.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def random_tree(shapes, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def grads_seq(params, n=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    return [jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params) for _ in range(n)]


# --- Muon --------------------------------------------------------------------------------------------------------

# Column-parallel (dim -1 over tensor) and row-parallel (dim 0) matrices with their biases, a stacked group with a
# column-split (L, p, q) kernel, a row-split tall one and a split per-layer vector, a replicated matrix and vector.
MUON_SHAPES = {
    "col": {"w": (12, 40), "b": (40,)},
    "row": {"w": (40, 12)},
    "layers": {"w": (3, 20, 24), "v": (3, 24, 20), "b": (3, 24)},
    "head": {"w": (16, 16), "b": (16,)},
}
MUON_TP = {
    "col": {"w": P(None, "tensor"), "b": P("tensor")},
    "row": {"w": P("tensor", None)},
    "layers": {"w": P(None, None, "tensor"), "v": P(None, "tensor", None), "b": P(None, "tensor")},
    "head": {"w": None, "b": None},
}


def muon_dims(params):
    """Muon for the 2-D leaves and the stacked kernels (one matrix per layer); AdamW for the vectors."""
    d = jax.tree.map(lambda x: MDN() if x.ndim == 2 and x.shape[0] > 3 else None, params)
    d["layers"]["w"], d["layers"]["v"] = MDN(1, 2), MDN(1, 2)
    return d


MUON_PARAMS = random_tree(MUON_SHAPES)
MUON_GRADS = grads_seq(MUON_PARAMS)
MUON_KW = dict(learning_rate=0.05, ns_steps=3, adam_learning_rate=0.01, muon_weight_dimension_numbers=muon_dims)

_REFS = {}


def muon_reference(name, params, grads, **kw):
    """optax.contrib.muon on the unsharded logical tree: params after each step (cached per config)."""
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


def host_round_trip(state):
    """The state through host memory and back with its own shardings: exact only if every array's sharding says
    where its values are (state that differs per tensor group but claims to be replicated over tensor is not)."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.device_put(jax.tree.map(np.asarray, state), shardings)


def shard_fns(plan):
    """Shard / unshard for a plan, jitted once (vj.shard / vj.unshard re-trace on every call)."""
    replicated = jax.sharding.NamedSharding(plan.mesh, P())
    pack = jax.jit(
        lambda xs: vj.ShardedParams(vj.state._sharded.pack(jax.tree.leaves(xs), plan), plan),
        out_shardings=vj.ShardedParams(plan.shardings(), plan),
    )
    unpack = jax.jit(
        lambda bufs: jax.tree_util.tree_unflatten(plan.treedef, vj.state._sharded.unpack(bufs, plan)),
        out_shardings=replicated,
    )
    return pack, lambda sp: unpack([jax.device_put(x, replicated) for x in sp.buffers])


def run_muon(params, grads, plan, **kw):
    tx = vjo.muon(plan=plan, **kw)
    pack, unpack = shard_fns(plan)
    sp = pack(params)
    state = vj.init_opt_state(tx, sp)

    @jax.jit
    def step(sp, state, g):
        u, state = tx.update(g, state, sp)
        return optax.apply_updates(sp, u), state

    out = []
    with jax.set_mesh(plan.mesh):
        for i, g in enumerate(grads):
            g = pack(g)
            sp, state = step(sp, state, g)
            if i == 1:
                state = host_round_trip(state)
            out.append(unpack(sp))
    return out, step, sp, state, g


@pytest.mark.parametrize("f,t", [(2, 4), pytest.param(3, 2, marks=pytest.mark.slow)], ids=["2x4", "3x2"])
def test_muon_parity_on_a_tp_plan(f, t):
    # Every TP-split matrix is orthogonalised as the whole logical matrix: 10 steps equal optax on the unsharded
    # tree, AdamW leaves (split and replicated vectors) included.
    plan = vj.plan(MUON_PARAMS, tp_mesh(f, t), stacked=["layers"], tp=MUON_TP)
    assert {b.groups for b in plan.buckets} == {(), ("tensor",)}
    routing = vjo.muon_routing(plan, muon_dims)
    assert routing.axes == ("tensor", "fsdp") and len(routing.loads) == f * t
    got, step, sp, state, g = run_muon(MUON_PARAMS, MUON_GRADS, plan, **MUON_KW)
    for p, r in zip(got, muon_reference("tp", MUON_PARAMS, MUON_GRADS, **MUON_KW), strict=True):
        assert_trees_close(p, r, rtol=1e-5)
    assert step._cache_size() == 1

    # The only collectives of the compiled step are the routing's two all-to-alls over (tensor, fsdp) and the split
    # classes' small Gram all-reduces: no all-gather of a bucket over tensor.
    with jax.set_mesh(plan.mesh):
        c = testing.census(step.lower(sp, state, g).compile())
    a2a = c.of("all-to-all")
    assert len(a2a) == 2 and all(op.group_size == f * t for op in a2a), c
    for kind in ("all-gather", "reduce-scatter", "collective-permute"):
        assert c.count(kind) == 0, (kind, c)
    assert routing.splits
    gram = max(4 * r * p * p for p, _, r in routing.splits)
    assert all(op.result_bytes <= gram for op in c.of("all-reduce")), c


MUON_OPTIONS = dict(
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
    muon_weight_dimension_numbers=muon_dims,
)


@pytest.mark.slow
@pytest.mark.parametrize("f,t", [(2, 4), (3, 2)], ids=["2x4", "3x2"])
def test_muon_options_on_a_tp_plan(f, t):
    # adaptive (a sum over each leaf's matrices: a replicated matrix's copies count once), masked weight decay,
    # consistent_rms, no Nesterov, the 'dion' table, and vj.rows(2) granularity.
    plan = vj.plan(MUON_PARAMS, tp_mesh(f, t), stacked=["layers"], tp=MUON_TP, granularity=vj.rows(2))
    got, *_ = run_muon(MUON_PARAMS, MUON_GRADS, plan, **MUON_OPTIONS)
    for g, r in zip(got, muon_reference("tp-options", MUON_PARAMS, MUON_GRADS, **MUON_OPTIONS), strict=True):
        assert_trees_close(g, r, rtol=1e-5)


@pytest.mark.slow
def test_muon_parity_on_an_expert_plan():
    # Stacked experts split over an expert axis: each (12, 16) expert matrix lies in one expert group, and the
    # routing runs over (expert, fsdp); the replicated router is orthogonalised once per expert group.
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("fsdp", "expert"), devices=jax.devices()[:8])
    params = random_tree({"experts": (8, 12, 16), "router": (12, 8), "b": (8,)})
    tp = {"experts": P("expert"), "router": None, "b": None}
    dims = {"experts": MDN(1, 2), "router": MDN(), "b": None}
    plan = vj.plan(params, mesh, tp=tp)
    assert vjo.muon_routing(plan, dims).axes == ("expert", "fsdp")
    grads = grads_seq(params, 4)
    kw = dict(learning_rate=0.05, ns_steps=3, muon_weight_dimension_numbers=dims)
    got, *_ = run_muon(params, grads, plan, **kw)
    for g, r in zip(got, muon_reference("expert", params, grads, **kw), strict=True):
        assert_trees_close(g, r, rtol=1e-5)


def test_muon_routing_over_tensor_and_fsdp():
    # A split matrix has one owner across all 8 devices; the replicated head is orthogonalised once per tensor
    # group (4 copies), at the same owner position and slot in each group, from and back to that group only.
    plan = vj.plan(MUON_PARAMS, tp_mesh(2, 4), stacked=["layers"], tp=MUON_TP)
    routing = vjo.muon_routing(plan, muon_dims)
    head = plan.leaves.index(plan.leaf("head/w"))
    copies = [r for r in routing.matrices if r.leaf == head]
    assert len(copies) == 4
    m = plan.num_devices
    assert sorted(r.owner // m for r in copies) == [0, 1, 2, 3]  # one per tensor group
    assert len({(r.owner % m, r.slot) for r in copies}) == 1  # the same position and slot in every group
    for r in copies:
        assert {d // m for d in r.devices} == {r.owner // m}  # its elements come from its own group
    split = [r for r in routing.matrices if plan.leaves[r.leaf].tp]
    assert split and all(r.owner < 0 or len({d // m for d in r.devices}) > 1 for r in split)
    assert len(routing.matrices) == 4 + 1 + 1 + 3 + 3


@pytest.mark.slow
def test_muon_split_classes_on_a_tp_plan():
    # 9 column-parallel 64 x 256 matrices over 2 x 4 devices: 8 owners and one split by columns over all 8
    # devices (its Gram sums over tensor and fsdp); equal to optax on the logical tree.
    params = random_tree({f"l{i}": (64, 256) for i in range(9)})
    plan = vj.plan(params, tp_mesh(2, 4), units=lambda path, leaf: "all", tp=lambda path, leaf: P(None, "tensor"))
    routing = vjo.muon_routing(plan)
    assert routing.classes == ((64, 256, 1),) and routing.splits == ((64, 256, 1),)
    grads = grads_seq(params, 3)
    kw = dict(learning_rate=0.05, ns_steps=3)
    got, *_ = run_muon(params, grads, plan, **kw)
    for g, r in zip(got, muon_reference("split", params, grads, **kw), strict=True):
        assert_trees_close(g, r, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("f,t", [(2, 4), (3, 2)], ids=["2x4", "3x2"])
def test_muon_gpt_tp_inside_vj_fsdp_matches_optax(f, t):
    # examples/gpt_tp.py (column/row-parallel attention and MLP): a vj.fsdp step with vj.optim.muon equals the
    # unsharded model with optax.contrib.muon.
    from flax import nnx
    from helpers import batches, loss_fn

    mesh = tp_mesh(f, t)
    gpt = load_gpt_tp()
    cfg = gpt.Config(vocab=257, max_len=16, d_model=24, num_heads=4, num_layers=2, d_ff=40, tensor="tensor")
    ref_cfg = dataclasses.replace(cfg, tensor=None)
    graphdef, params = gpt.split_model(cfg, jax.random.key(0))
    ref_graphdef, _ = gpt.split_model(ref_cfg, jax.random.key(0))
    plan = vj.plan(params, mesh, stacked=("blocks",), tp=gpt.partition_spec(cfg))

    def dims(p):
        def leaf(path, x):
            name = vj.plan_path(path)
            if name.startswith("blocks/") and name.endswith("kernel"):
                return MDN(reduction_axis=1, output_axis=2)
            return MDN() if name == "head/kernel" else None

        return jax.tree_util.tree_map_with_path(leaf, p)

    kw = dict(learning_rate=0.02, adam_learning_rate=3e-3, ns_steps=3)
    ref_tx = optax.contrib.muon(**kw, muon_weight_dimension_numbers=dims(params))
    tx = vjo.muon(**kw, plan=plan, muon_weight_dimension_numbers=dims(params))

    @jax.jit
    def ref_step(p, state, batch):
        loss, g = jax.value_and_grad(lambda p: loss_fn(nnx.merge(ref_graphdef, p)(batch["x"]), batch["y"]))(p)
        u, state = ref_tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    @vj.fsdp(plan=plan)
    def step(p, state, batch):
        loss, g = jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"]))(p)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    ref, ref_state = params, ref_tx.init(params)
    sp = vj.shard(params, plan)
    state = vj.init_opt_state(tx, sp)
    for batch in batches(4, batch=24):
        ref, ref_state, ref_loss = ref_step(ref, ref_state, batch)
        sp, state, loss = step(sp, state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref, rtol=1e-4)


# --- Shampoo -----------------------------------------------------------------------------------------------------

BLOCK = 4
SHAMPOO_SHAPES = {
    "col": {"w": (12, 16), "b": (16,)},
    "row": {"w": (16, 10), "b": (10,)},
    "layers": {"w": (3, 8, 16), "b": (3, 16)},
    "head": {"w": (6, 10)},  # replicated, with edge blocks
}
SHAMPOO_TP = {
    "col": {"w": P(None, "tensor"), "b": P("tensor")},
    "row": {"w": P("tensor", None), "b": None},
    "layers": {"w": P(None, None, "tensor"), "b": P(None, "tensor")},
    "head": {"w": None},
}
STACKED = {"col": False, "row": False, "layers": True, "head": False}
SHAMPOO_PARAMS = random_tree(SHAMPOO_SHAPES)
SHAMPOO_GRADS = grads_seq(SHAMPOO_PARAMS, 4)
SHAMPOO_KW = dict(learning_rate=0.01, block_size=BLOCK, weight_decay=0.01)


def shampoo_reference(params, grads, **kw):
    tx = reference_shampoo(is_stacked=STACKED, **kw)
    state, out = tx.init(params), []
    for g in grads:
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
        out.append(params)
    return out


def test_shampoo_on_a_tp_plan_matches_the_reference():
    # Blocks are cut from each TP shard (local shapes) and equal the logical leaf's blocks; every tensor group keeps
    # the statistics of its own blocks: the state is sharded over (tensor, fsdp) and survives a round trip through
    # host memory (a state replicated over tensor would keep one group's blocks only).
    plan = vj.plan(SHAMPOO_PARAMS, tp_mesh(2, 4), stacked=["layers"], tp=SHAMPOO_TP, granularity=vj.rows(BLOCK))
    tx = vjo.shampoo(plan=plan, **SHAMPOO_KW)
    pack, unpack = shard_fns(plan)
    sp = pack(SHAMPOO_PARAMS)
    state = vj.init_opt_state(tx, sp)
    tables = vjo.shampoo_blocks(plan, BLOCK)
    stats = state.shampoo[0].stats_left
    assert stats.value.shape == (4 * 2 * tables.slots, BLOCK, BLOCK)
    assert stats.axes == ("tensor", "fsdp")
    want = jax.sharding.NamedSharding(plan.mesh, P(("tensor", "fsdp")))
    assert stats.value.sharding.is_equivalent_to(want, 3)

    @jax.jit
    def step(sp, state, g):
        u, state = tx.update(g, state, sp)
        return optax.apply_updates(sp, u), state

    ref = shampoo_reference(SHAMPOO_PARAMS, SHAMPOO_GRADS, **SHAMPOO_KW)
    with jax.set_mesh(plan.mesh):
        for i, g in enumerate(SHAMPOO_GRADS):
            sp, state = step(sp, state, pack(g))
            if i == 1:
                state = host_round_trip(state)
            assert_trees_close(unpack(sp), ref[i], rtol=1e-4)
    assert step._cache_size() == 1
    assert state.shampoo[0].stats_left.value.sharding.is_equivalent_to(want, 3)
    # Every block is preconditioned where it lies: no collective beyond scalars.
    with jax.set_mesh(plan.mesh):
        c = testing.census(step.lower(sp, state, pack(SHAMPOO_GRADS[0])).compile())
    for kind in ("all-gather", "all-to-all", "reduce-scatter", "collective-permute"):
        assert c.count(kind) == 0, (kind, c)
    assert c.bytes("all-reduce") <= 64, c


@pytest.mark.slow
def test_shampoo_gpt_tp_inside_vj_fsdp_matches_the_reference():
    # examples/gpt_tp.py on 2 x 4: 2 x 2 blocks of every TP shard (q/k/v (24, 6), up (24, 10), proj (6, 24), down
    # (10, 24)) are blocks of the logical kernels; a vj.fsdp step equals the reference on the unsharded model.
    from flax import nnx
    from helpers import batches, loss_fn

    mesh = tp_mesh(2, 4)
    gpt = load_gpt_tp()
    cfg = gpt.Config(vocab=257, max_len=16, d_model=24, num_heads=4, num_layers=2, d_ff=40, tensor="tensor")
    graphdef, params = gpt.split_model(cfg, jax.random.key(0))
    ref_graphdef, _ = gpt.split_model(dataclasses.replace(cfg, tensor=None), jax.random.key(0))
    plan = vj.plan(params, mesh, stacked=("blocks",), tp=gpt.partition_spec(cfg), granularity=vj.rows(2))
    stacked = jax.tree_util.tree_map_with_path(lambda path, _: vj.plan_path(path).startswith("blocks/"), params)
    kw = dict(learning_rate=3e-3, block_size=2, weight_decay=0.1, preconditioning_compute_steps=2)
    ref_tx = reference_shampoo(is_stacked=stacked, **kw)
    tx = vjo.shampoo(plan=plan, **kw)
    grad_fn = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(nnx.merge(ref_graphdef, p)(b["x"]), b["y"])))

    @vj.fsdp(plan=plan)
    def step(p, state, batch):
        loss, g = jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"]))(p)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    ref, ref_state = params, ref_tx.init(params)
    sp = vj.shard(params, plan)
    state = vj.init_opt_state(tx, sp)
    for batch in batches(3, batch=24):
        ref_loss, g = grad_fn(ref, batch)
        u, ref_state = ref_tx.update(g, ref_state, ref)
        ref = optax.apply_updates(ref, u)
        sp, state, loss = step(sp, state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(vj.unshard(sp), ref, rtol=1e-4)


def test_shampoo_rejects_blocks_spanning_tp_shards():
    # (12, 16) split over 4 tensor devices by columns: (12, 4) shards; 8-wide blocks would span two shards.
    params = {"col": jax.ShapeDtypeStruct((12, 16), jnp.float32)}
    plan = vj.plan(params, tp_mesh(2, 4), tp={"col": P(None, "tensor")}, granularity=vj.rows(8))
    with pytest.raises(ValueError, match=r"'col'.*\(12, 16\).*tensor.*\(12, 4\).*block_size=8"):
        vjo.shampoo(0.1, plan=plan, block_size=8)
    # Row-parallel: (16, 12) split into (4, 12) shards by rows; 8-row blocks would span two shards.
    params = {"row": jax.ShapeDtypeStruct((16, 12), jnp.float32)}
    plan = vj.plan(params, tp_mesh(2, 4), tp={"row": P("tensor", None)}, granularity=vj.rows(8))
    with pytest.raises(ValueError, match=r"'row'.*\(16, 12\).*\(4, 12\).*block_size=8"):
        vjo.shampoo_blocks(plan, 8)
    # 4-row blocks of 4-row shards are the leaf's blocks.
    assert vjo.shampoo_blocks(vj.plan(params, plan.mesh, tp={"row": P("tensor", None)}, granularity=vj.rows(4)), 4)


def test_shampoo_block_state_logical_view_refuses_tp_plans():
    plan = vj.plan(SHAMPOO_PARAMS, tp_mesh(2, 4), stacked=["layers"], tp=SHAMPOO_TP, granularity=vj.rows(BLOCK))
    layout = vjo.BlockLayout(plan, BLOCK)
    with pytest.raises(NotImplementedError, match="tensor"):
        layout.logical_shapes()
