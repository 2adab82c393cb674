"""optim.relayout: PerDevice optimizer state (Shampoo block slots, compact AdamW vectors) to a plan-independent
logical view and back under another plan (device count, granularity, mesh)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import assert_trees_equal, edge_block_params

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax import testing
from vescale_jax.layout._paths import path_str
from vescale_jax.optim._logical_view import logical_view, restore_logical
from vescale_jax.optim._shampoo._transform import inverse_root
from vescale_jax.optim._state_layouts import BlockLayout, CompactLayout
from vescale_jax.state._sharded import PerDevice, ShardedParams

BLOCK = 4
BEFORE, AFTER = 2, 2  # steps before the move, and after it under both plans


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


make_params = edge_block_params


PARAMS = make_params()
_rng = np.random.default_rng(1)
GRADS = [
    jax.tree.map(lambda x: jnp.asarray(_rng.standard_normal(x.shape), x.dtype), PARAMS) for _ in range(BEFORE + AFTER)
]


def mesh_2x4():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    return jax.make_mesh((2, 4), ("replica", "fsdp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)


# name -> (mesh, granularity); "m3r" changes the granularity, "2x4" the mesh (replica x fsdp).
PLANS = {
    "shampoo": {
        "m1": (1, vj.rows(BLOCK)),
        "m3": (3, vj.rows(BLOCK)),
        "m8": (8, vj.rows(BLOCK)),
        "m3r": (3, vj.rows(2 * BLOCK)),
        "2x4": ("2x4", vj.rows(BLOCK)),
    },
    "muon": {
        "m1": (1, vj.element()),
        "m3": (3, vj.element()),
        "m8": (8, vj.element()),
        "m3r": (3, vj.rows(3)),
        "2x4": ("2x4", vj.element()),
    },
}
_CACHE = {}


def plan_of(opt, name):
    m, granularity = PLANS[opt][name]
    mesh = mesh_2x4() if m == "2x4" else make_mesh(m)
    return vj.plan(PARAMS, mesh, stacked=["layers"], granularity=granularity)


def setup(opt, name):
    """(plan, tx, jitted step, jitted shard) per optimizer and plan, built once."""
    key = (opt, name)
    if key not in _CACHE:
        plan = plan_of(opt, name)
        if opt == "shampoo":
            tx = vjo.shampoo(0.01, plan=plan, block_size=BLOCK, weight_decay=0.01)
        else:
            tx = vjo.muon(0.01, plan=plan, weight_decay=0.01)

        @jax.jit
        def step(sp, state, g):
            u, state = tx.update(g, state, sp)
            return optax.apply_updates(sp, u), state

        shard = jax.jit(lambda t: vj.state._sharded.pack(jax.tree.leaves(t), plan), out_shardings=plan.shardings())
        _CACHE[key] = plan, tx, step, lambda t: ShardedParams(shard(t), plan)
    return _CACHE[key]


def logical(sp):
    """ShardedParams -> the logical tree as numpy (test helper; gathers everything)."""
    return jax.tree_util.tree_unflatten(
        sp.plan.treedef, vj.state._sharded.unpack([np.asarray(b) for b in sp.buffers], sp.plan)
    )


def train(opt, name, grads, sp=None, state=None):
    plan, tx, step, shard = setup(opt, name)
    if sp is None:
        sp = shard(PARAMS)
        state = vj.init_opt_state(tx, sp)
    with jax.set_mesh(plan.mesh):
        for g in grads:
            sp, state = step(sp, state, shard(g))
    return sp, state


_TRAINED = {}


def trained(opt, name):
    if (opt, name) not in _TRAINED:
        _TRAINED[opt, name] = train(opt, name, GRADS[:BEFORE])
    return _TRAINED[opt, name]


def is_node(x):
    return isinstance(x, PerDevice | ShardedParams)


def per_device(state):
    return [x for x in jax.tree.leaves(state, is_leaf=is_node) if isinstance(x, PerDevice)]


def move(state, sp, opt, name):
    """The whole training state under plan ``name``: PerDevice leaves through their layouts (the code under
    test), ShardedParams through the logical tree, scalars replicated."""
    plan, tx, _, shard = setup(opt, name)
    target = jax.eval_shape(tx.init, jax.eval_shape(lambda: vj.shard(PARAMS, plan)))
    replicated = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec())

    def one(x, t):
        if isinstance(x, PerDevice):
            return t.replace(t.layout.from_logical(x.layout.to_logical(x.value)))
        if isinstance(x, ShardedParams):
            return shard(logical(x))
        return jax.device_put(np.asarray(x), replicated)

    return jax.tree.map(one, state, target, is_leaf=is_node), shard(logical(sp))


def as_numpy(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


PAIRS = [("m8", "m3"), ("m3", "m8"), ("m1", "m8"), ("m8", "m1"), ("m3", "m3r"), ("m8", "2x4")]


def pair_params(opt, default=()):
    return [
        pytest.param(opt, a, b, id=f"{opt}-{a}-{b}", marks=[] if (a, b) in default else [pytest.mark.slow])
        for a, b in PAIRS
    ]


@pytest.mark.parametrize(("opt", "a", "b"), pair_params("shampoo", [("m8", "m3")]) + pair_params("muon"))
def test_trained_state_moves_to_another_plan(opt, a, b):
    """Shampoo (block statistics, roots, and the compact AdamW state of its other leaves) and Muon (compact
    AdamW state) after real steps: moved, moved back, and trained on."""
    sp_a, state_a = trained(opt, a)
    state_b, sp_b = move(state_a, sp_a, opt, b)
    # Every PerDevice leaf keeps its layout, now of plan B.
    plan_b = setup(opt, b)[0]
    assert per_device(state_b) and all(x.layout is not None and x.layout.plan == plan_b for x in per_device(state_b))
    # B's logical view of the restored state is A's, bit for bit.
    assert_trees_equal(logical_view(per_device(state_b)), logical_view(per_device(state_a)), what=f"{a}->{b} view")
    # A -> B -> A gives back A's PerDevice values bit for bit (empty slots included).
    state_back, _ = move(state_b, sp_b, opt, a)
    assert_trees_equal(
        [x.value for x in per_device(state_back)], [x.value for x in per_device(state_a)], what=f"{a}->{b}->{a}"
    )
    # Training continues under B as it would have under A.
    sp_a2, _ = train(opt, a, GRADS[BEFORE:], sp_a, state_a)
    sp_b2, _ = train(opt, b, GRADS[BEFORE:], sp_b, state_b)
    for x, y in zip(as_numpy(logical(sp_a2)), as_numpy(logical(sp_b2)), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-6)


def layout_of(kind, name):
    if kind == "blocks":
        return BlockLayout(plan_of("shampoo", name), BLOCK)
    plan = plan_of("muon", name)
    return CompactLayout(plan, tuple(len(plan.layer_shape(s)) < 2 for s in plan.leaves))


@pytest.mark.parametrize("kind", ["blocks", "compact"])
@pytest.mark.parametrize(("a", "b"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_relayout_round_trips_exactly(kind, a, b):
    """Random logical arrays placed under plan A, moved to plan B and back: every conversion is exact, and the
    placement is injective (every logical element lands in its own row element)."""
    la, lb = layout_of(kind, a), layout_of(kind, b)
    shapes = la.logical_shapes()
    assert shapes.keys() == lb.logical_shapes().keys()
    assert all(shapes[k].shape == lb.logical_shapes()[k].shape for k in shapes)
    rng = np.random.default_rng(2)
    arrays = {k: (rng.standard_normal(s.shape) + 3.0).astype(np.float32) for k, s in shapes.items()}  # no zeros
    va = la.from_logical(arrays)
    want = jax.sharding.NamedSharding(la.plan.mesh, jax.sharding.PartitionSpec(la.plan.axis))
    assert va.sharding.is_equivalent_to(want, va.ndim)
    assert np.count_nonzero(np.asarray(va)) == sum(x.size for x in arrays.values())  # unused rows stay zero
    view_a = la.to_logical(va)
    for k, x in view_a.items():
        assert x.sharding == shapes[k].sharding, k
    assert_trees_equal(view_a, arrays, what=f"{kind} {a}")
    vb = lb.from_logical(view_a)
    assert_trees_equal(lb.to_logical(vb), arrays, what=f"{kind} {a}->{b}")
    assert_trees_equal(la.from_logical(lb.to_logical(vb)), va, what=f"{kind} {a}->{b}->{a}")


def blocks_of(x, b):
    """Numpy reference: the row-major (nb, b, b) zero-padded blocks of a 2-D matrix."""
    r, c = x.shape
    pr, pc = -(-r // b) * b, -(-c // b) * b
    padded = np.zeros((pr, pc), x.dtype)
    padded[:r, :c] = x
    return padded.reshape(pr // b, b, pc // b, b).transpose(0, 2, 1, 3).reshape(-1, b, b)


def test_logical_view_holds_the_optimizer_state_by_leaf():
    """The logical view of a trained Shampoo state is what the math says, per leaf and block (reference from the
    unsharded gradients): statistics, roots, and the AdamW moments of the non-matrix leaves."""
    plan, *_ = setup("shampoo", "m8")
    _, state = trained("shampoo", "m8")
    shampoo_state, adam_state = state.shampoo[0], state.adam[0]
    beta2, b1, b2 = 0.999, 0.9, 0.999
    paths = {path_str(p): i for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(PARAMS)[0])}
    grads = [[np.asarray(x, np.float64) for x in jax.tree.leaves(g)] for g in GRADS[:BEFORE]]
    left, right = (
        shampoo_state.stats_left.layout.to_logical(shampoo_state.stats_left.value),
        shampoo_state.stats_right.layout.to_logical(shampoo_state.stats_right.value),
    )
    roots = shampoo_state.root_left.layout.to_logical(shampoo_state.root_left.value)
    assert set(left) == {f"{p}/blocks" for p in ("a/w", "b/w", "b/v", "layers/w", "head/w")}
    for key, got in left.items():
        i = paths[key.removesuffix("/blocks")]
        per_layer = [g[i] for g in grads] if key.startswith("layers") else [g[i][None] for g in grads]
        for layer in range(per_layer[0].shape[0]):
            ls, rs = 0.0, 0.0
            for g in per_layer:
                blk = blocks_of(g[layer].reshape(-1, g.shape[-1]), BLOCK)
                ls = beta2 * ls + (1 - beta2) * blk @ blk.transpose(0, 2, 1)
                rs = beta2 * rs + (1 - beta2) * blk.transpose(0, 2, 1) @ blk
            at = (lambda x, layer=layer: np.asarray(x)[layer]) if key.startswith("layers") else np.asarray
            np.testing.assert_allclose(at(got), ls, rtol=1e-5, atol=1e-7, err_msg=key)
            np.testing.assert_allclose(at(right[key]), rs, rtol=1e-5, atol=1e-7, err_msg=key)
            want = np.asarray(inverse_root(jnp.asarray(at(got)), exponent=4.0, epsilon=1e-6))
            np.testing.assert_allclose(at(roots[key]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=key)
    mu = adam_state.mu.layout.to_logical(adam_state.mu.value)
    nu = adam_state.nu.layout.to_logical(adam_state.nu.value)
    assert set(mu) == set(nu) == {"a/b", "layers/b"}
    for key in mu:
        g1, g2 = (g[paths[key]] for g in grads)
        np.testing.assert_allclose(np.asarray(mu[key]), (1 - b1) * (b1 * g1 + g2), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(nu[key]), (1 - b2) * (b2 * g1**2 + g2**2), rtol=1e-6, atol=1e-9)
    # Every PerDevice leaf of the state (the nested AdamW mu and nu included) kept its layout through jit.
    layouts = [x.layout for x in per_device(state)]
    assert len(layouts) == 6 and all(isinstance(x, BlockLayout) for x in layouts[:4])
    assert all(isinstance(x, CompactLayout) and x.plan == plan for x in layouts[4:])


@pytest.mark.parametrize("block", [BLOCK, 8])
def test_relayout_moves_pieces_in_bounded_memory(block):
    """Three leaves in one bucket on 8 devices (each leaf on about 3 devices in the plan, spread over all 8 in the
    logical arrays), no all-gather either way. Blocks of 4 rows: each leaf's blocks split evenly, moved by a few
    collective-permutes carrying at most one device's rows in all. Blocks of 8 rows (the device count divides
    the block): every block's rows split over the devices by one all-to-all of exactly one device's rows.
    Temporaries stay a few times one device's rows (the whole state is 8)."""
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    abstract = {"l0": f32(64, 32), "l1": f32(32, 64), "l2": f32(64, 32)}
    plan = vj.plan(abstract, make_mesh(8), granularity=vj.rows(block), units=lambda path, leaf: "all")
    layout = BlockLayout(plan, block)
    slots = vjo.shampoo_blocks(plan, block).slots
    spec = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(plan.axis))
    value = jax.ShapeDtypeStruct((8 * slots, block, block), jnp.float32, sharding=spec)
    rows_bytes = slots * block * block * 4  # one device's rows
    shapes = layout.logical_shapes()
    split = 0 if block % 8 else 1  # the dim the logical arrays are split on: blocks, or rows inside a block
    assert all(s.sharding.spec[split] == plan.axis for s in shapes.values()), shapes
    from vescale_jax.optim._rows_to_logical import _from_logical_fn, _to_logical_fn

    for compiled in (
        _to_logical_fn(layout).lower(value).compile(),
        _from_logical_fn(layout, jnp.float32).lower(*shapes.values()).compile(),
    ):
        census = testing.census(compiled)
        assert census.count("all-gather") == census.count("all-reduce") == 0
        if block % 8:
            assert census.count("all-to-all") == 0 and census.count("collective-permute") >= 1
            assert census.bytes("collective-permute") <= rows_bytes
        else:
            assert census.count("collective-permute") == 0 and census.count("all-to-all") == 1
            assert census.bytes("all-to-all") == rows_bytes
        mem = testing.memory(compiled)
        assert mem.temp <= 3.5 * rows_bytes, str(mem)


def test_relayout_errors_name_the_key_and_shapes():
    la = layout_of("blocks", "m3")
    arrays = {k: np.zeros(s.shape, np.float32) for k, s in la.logical_shapes().items()}
    with pytest.raises(ValueError, match=r"'a/w/blocks' has shape \(29, 4, 4\), this layout expects \(30, 4, 4\)"):
        la.from_logical({**arrays, "a/w/blocks": np.zeros((29, 4, 4), np.float32)})
    with pytest.raises(ValueError, match=r"missing keys \['head/w/blocks'\]"):
        la.from_logical({k: v for k, v in arrays.items() if k != "head/w/blocks"})
    with pytest.raises(ValueError, match="has shape"):
        la.to_logical(jnp.zeros((5, 4, 4), jnp.float32))
    # Layouts are static aux data: equal (and hash equal) for equal plans; PerDevice(value, plan) still works.
    assert la == layout_of("blocks", "m3") and hash(la) == hash(layout_of("blocks", "m3"))
    x = PerDevice(jnp.zeros(3), la.plan)
    assert x.layout is None and jax.tree.map(lambda v: v, x).plan == la.plan
    assert restore_logical(x, x).layout is None


def test_exchange_moves_random_ragged_placements_exactly():
    """The piece exchange alone, against numpy: three tensors of two layers each, random (some empty) device
    ranges on both sides, packed at arbitrary offsets of the source and target buffers on 8 devices."""
    from vescale_jax.layout._ragged import RaggedShard
    from vescale_jax.relayout._exchange import exchange as _exchange

    m, layers = 8, 2
    rng = np.random.default_rng(5)
    mesh = make_mesh(m)

    def ragged(n):
        cuts = np.sort(rng.integers(0, n + 1, m - 1))
        return RaggedShard((n,), 1, tuple(np.diff([0, *cuts, n])))

    moves = [(ragged(n), ragged(n)) for n in (37, 64, 5)]
    tensors = [rng.standard_normal((layers, a.size)).astype(np.float32) for a, _ in moves]

    def offsets(side):  # per device: each tensor's layers one after another, a gap of 3 between pieces
        at, size = [np.zeros((m, layers), np.int64) for _ in moves], [0] * m
        for k in range(m):
            for e, mv in enumerate(moves):
                for layer in range(layers):
                    at[e][k, layer] = size[k]
                    size[k] += mv[side].local_sizes[k] + 3
        return at, max(size)

    (src_at, src_size), (out_at, out_size) = offsets(0), offsets(1)
    src = np.zeros((m, src_size), np.float32)
    want = np.zeros((m, out_size), np.float32)
    for e, (a, b) in enumerate(moves):
        for k in range(m):
            for layer in range(layers):
                src[k, src_at[e][k, layer] : src_at[e][k, layer] + a.local_sizes[k]] = tensors[e][
                    layer, a.starts[k] : a.ends[k]
                ]
                want[k, out_at[e][k, layer] : out_at[e][k, layer] + b.local_sizes[k]] = tensors[e][
                    layer, b.starts[k] : b.ends[k]
                ]
    spec = jax.sharding.PartitionSpec("fsdp")
    fn = jax.jit(
        jax.shard_map(
            lambda s: _exchange(s, src_at, jnp.zeros((out_size,), s.dtype), out_at, moves, "fsdp", m),
            mesh=mesh,
            in_specs=spec,
            out_specs=spec,
            check_vma=False,
        )
    )
    x = jax.device_put(src.reshape(-1), jax.sharding.NamedSharding(mesh, spec))
    got = np.asarray(fn(x)).reshape(m, out_size)
    np.testing.assert_array_equal(got, want)


def test_layout_without_blocks_is_empty():
    """A tree without matrix leaves: no logical arrays, and from_logical gives the (empty) rows back."""
    params = {"v": jnp.ones((10,), jnp.float32)}
    plan = vj.plan(params, make_mesh(3), granularity=vj.rows(BLOCK))
    layout = BlockLayout(plan, BLOCK)
    assert layout.logical_shapes() == {}
    value = layout.from_logical({})
    assert value.shape == (0, BLOCK, BLOCK) and layout.to_logical(value) == {}
