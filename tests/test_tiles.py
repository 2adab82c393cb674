"""vj.tiles(bh, bw): tile-major storage through every path that reads a leaf's range (index math, planner,
shard / unshard, vj.fsdp training, checkpoints, optimizer-state relayouts, Muon, Shampoo, Pallas kernels)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import DEVICE_COUNTS, make_mesh
from flax import nnx
from helpers import (
    GPTConfig,
    abstract_model,
    assert_trees_close,
    assert_trees_equal,
    batches,
    init_params,
    loss_fn,
    reference_run,
)
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax.layout import _tiles as tiles
from vescale_jax.layout._granularity import Granularity
from vescale_jax.optim._leaf_tables import local_vector
from vescale_jax.optim._on_leaves import build_compact, compact
from vescale_jax.optim._shampoo._blocks import build_blocks, gather_blocks
from vescale_jax.optim._state_layouts import BlockLayout, CompactLayout
from vescale_jax.relayout import _logical_leaves as _logical


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


M = min(3, len(jax.devices()))  # the default tests' device count: 3 (an odd count), or what there is


def tiled_or_element(bh: int = 8, bw: int = 8):
    return lambda path, leaf: vj.tiles(bh, bw) if len(leaf.shape) >= 2 else vj.element()


# ------------------------------------------------------------------------------------------ NumPy reference
def reference_storage(x: np.ndarray, bh: int, bw: int) -> np.ndarray:
    """Tile-major order written out with loops: per segment (full, right, bottom, corner), per leading index,
    tiles in row-of-tiles order, each tile row-major."""
    *lead, h, w = x.shape
    x = x.reshape(math.prod(lead), h, w)
    hf, wf = h - h % bh, w - w % bw
    rows_of = {"full": (0, hf), "right": (0, hf), "bottom": (hf, h), "corner": (hf, h)}
    cols_of = {"full": (0, wf), "right": (wf, w), "bottom": (0, wf), "corner": (wf, w)}
    out = []
    for seg in ("full", "right", "bottom", "corner"):
        (r0, r1), (c0, c1) = rows_of[seg], cols_of[seg]
        if r1 <= r0 or c1 <= c0:
            continue
        th, tw = min(bh, r1 - r0), min(bw, c1 - c0)
        for a in range(x.shape[0]):
            for i in range(r0, r1, th):
                for j in range(c0, c1, tw):
                    out.append(x[a, i : i + th, j : j + tw].reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, x.dtype)


SHAPES = [
    (16, 24),
    (20, 36),
    (13, 7),
    (3, 20, 36),
    (2, 3, 9, 10),
    (5, 8),
    (8, 5),
    (4, 4),
    (0, 8),
    (8, 0),
    (3, 8, 0),
    (1, 1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(("bh", "bw"), [(8, 8), (4, 16), (3, 5)], ids=lambda v: str(v))
def test_storage_round_trip_matches_reference(shape, bh, bw):
    g = vj.tiles(bh, bw)
    x = np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    flat = tiles.to_storage(x, shape, g)
    np.testing.assert_array_equal(flat, reference_storage(x, bh, bw))
    np.testing.assert_array_equal(tiles.from_storage(flat, shape, g), x)
    np.testing.assert_array_equal(tiles.storage_index(shape, g), flat)
    # batch dims are mapped over; jnp agrees with numpy
    xb = np.stack([x, -x])
    np.testing.assert_array_equal(np.asarray(tiles.to_storage(jnp.asarray(xb), shape, g, jnp)), np.stack([flat, -flat]))
    # coords agree with storage_index
    j = np.arange(flat.size)
    lead, row, col = tiles.coords(j, shape, g)
    h, w = shape[-2:]
    np.testing.assert_array_equal((lead * h + row) * w + col, flat)
    np.testing.assert_array_equal(tiles.position(lead, row, col, shape, g), j)  # position inverts coords
    # every segment's blocks are single tiles (no block spans two tiles)
    tile_of = (lead * -(-h // bh) + row // bh) * -(-w // bw) + col // bw
    start = 0
    for n, b in tiles.segments(shape, g) or ():
        ids = tile_of[start : start + n].reshape(-1, b)
        assert (ids == ids[:, :1]).all(), (shape, n, b)
        assert len(np.unique(ids[:, 0])) == ids.shape[0]  # and a tile is one block
        start += n
    assert start == flat.size or tiles.segments(shape, g) is None


def test_fewer_than_two_dims_is_row_major():
    g = vj.tiles(4, 4)
    assert not tiles.is_tiled((10,), g) and tiles.segments((10,), g) is None
    np.testing.assert_array_equal(tiles.storage_index((10,), g), np.arange(10))
    assert g.block((10,)) == 4


def test_granularity_repr_round_trips():
    for g in (vj.tiles(8, 8), vj.tiles(3, 128), vj.element(), vj.rows(4), vj.whole(), vj.whole(max_padding=0.1)):
        assert Granularity.parse(repr(g)) == g
    with pytest.raises(ValueError, match="granularity"):
        Granularity.parse("tiles(8)")


# ----------------------------------------------------------------------------------------------- planner
def tile_ids(shape, g):
    """Per storage position, the id of the tile it belongs to."""
    h, w = shape[-2:]
    lead_i, row, col = tiles.coords(np.arange(math.prod(shape)), shape, g)
    return (lead_i * -(-h // g.bh) + row // g.bh) * -(-w // g.bw) + col // g.bw


def test_plan_bucket_never_cuts_a_tile():
    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 5))
        shapes, grans = [], []
        for _ in range(n):
            nd = int(rng.integers(1, 4))
            shape = tuple(int(d) for d in rng.integers(1, 23, nd))
            shapes.append(shape)
            grans.append(
                vj.tiles(int(rng.integers(1, 9)), int(rng.integers(1, 9))) if rng.random() < 0.7 else vj.element()
            )
        m, align = int(rng.integers(1, 9)), int(rng.choice([1, 2, 4]))
        sizes = [math.prod(s) for s in shapes]
        blocks = [g.block(s) for g, s in zip(grans, shapes, strict=True)]
        segments = [g.segments(s) for g, s in zip(grans, shapes, strict=True)]
        layout = vj.plan_bucket(sizes, blocks, m, align=align, segments=segments)
        layout.check()
        S = layout.shard_size
        for i, (shape, g) in enumerate(zip(shapes, grans, strict=True)):
            if not tiles.is_tiled(shape, g):
                continue
            ids, o = tile_ids(shape, g), layout.offsets[i]
            for k in range(1, m):
                d = k * S - o
                if 0 < d < sizes[i]:
                    assert ids[d - 1] != ids[d], (trial, i, shape, g, d)


def test_plan_bucket_rejects_invalid_segments():
    with pytest.raises(ValueError, match=r"index 1|tensor 1|\[1\]"):
        vj.plan_bucket([6, 12], [1, 4], 2, segments=[None, ((8, 4), (3, 1))])  # segments sum to 11, not 12


def test_plan_to_dict_names_the_tiles_and_their_segments(mesh):
    tree = {"w": jax.ShapeDtypeStruct((20, 36), jnp.float32), "b": jax.ShapeDtypeStruct((36,), jnp.float32)}
    plan = vj.plan(tree, mesh, granularity=tiled_or_element())
    d = plan.to_dict()
    by_path = {leaf["path"]: leaf for leaf in d["leaves"]}
    assert by_path["w"]["granularity"] == "tiles(8, 8)" and by_path["b"]["granularity"] == "element()"
    for spec in plan.leaves:
        g = Granularity.parse(by_path[spec.path]["granularity"])
        assert g == spec.granularity
        bucket = d["buckets"][spec.bucket]
        segs = g.segments(plan.layer_shape(spec))
        assert bucket["segments"][spec.slot] == (None if segs is None else [list(s) for s in segs])
        assert bucket["storage"][spec.slot] == (repr(g) if segs is not None else None)
    other = vj.plan(tree, mesh, granularity=lambda p, x: vj.tiles(4, 16) if len(x.shape) >= 2 else vj.element())
    assert other.fingerprint() != plan.fingerprint()


# -------------------------------------------------------------------------------------------- test trees
def tree_of(seed: int = 0):
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal(shape, np.float32)
    return {
        "embed": f32(50, 12),
        "bias": f32(3),
        "blocks": {"w": f32(2, 20, 36), "v": f32(2, 5)},
        "head": f32(12, 7).astype(jnp.bfloat16),
        "scale": np.asarray(1.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def plan_of(tree, m, granularity=None):
    units = lambda path, leaf: "blocks" if vj.plan_path(path).startswith("blocks") else "top"
    return vj.plan(tree, make_mesh(m), stacked=("blocks",), granularity=granularity, units=units)


def host_unshard(sp):
    """``vj.unshard`` by numpy: slices of the fetched buffers, relaid out by the NumPy reference's inverse."""
    plan, out = sp.plan, [None] * len(sp.plan.leaves)
    for bucket, buf in zip(plan.buckets, sp.buffers, strict=True):
        full = np.asarray(buf)
        for slot, i in enumerate(bucket.leaves):
            o, n = bucket.layout.offsets[slot], bucket.layout.sizes[slot]
            spec = plan.leaves[i]
            shape = plan.layer_shape(spec)
            piece = full[..., o : o + n].reshape(bucket.layers or 1, n)
            g = bucket.storage[slot] if bucket.storage else None
            if g is not None and tiles.is_tiled(shape, g):
                perm = np.argsort(reference_storage(np.arange(n).reshape(shape), g.bh, g.bw))
                piece = piece[:, perm]
            out[i] = piece.reshape(spec.shape)
    return jax.tree_util.tree_unflatten(plan.treedef, out)


@pytest.mark.parametrize("m", DEVICE_COUNTS, ids=lambda m: f"m{m}")
def test_shard_unshard_bitwise(m):
    tree = tree_of()
    plan = plan_of(tree, m, tiled_or_element())
    assert any(b.storage for b in plan.buckets)
    sp = vj.shard(tree, plan)
    assert_trees_equal(vj.unshard(sp), tree)
    assert_trees_equal(host_unshard(sp), tree)  # the buffers hold the reference's tile-major order


def assert_padding_zero(sp):
    for bucket, buf in zip(sp.plan.buckets, sp.buffers, strict=True):
        full = np.asarray(buf).reshape(-1, bucket.layout.total_size)
        used = np.zeros(bucket.layout.total_size, bool)
        for o, n in zip(bucket.layout.offsets, bucket.layout.sizes, strict=True):
            used[o : o + n] = True
        assert not np.any(full[:, ~used]), bucket.name


# ----------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((3, "tiles"), (2, "element")),
        pytest.param((2, "tiles"), (3, "tiles48"), marks=pytest.mark.slow),
        pytest.param((8, "element"), (3, "tiles"), marks=pytest.mark.slow),
        pytest.param((2, "tiles"), (8, "tiles48"), marks=pytest.mark.slow),
        pytest.param((1, "tiles"), (3, "tiles"), marks=pytest.mark.slow),
    ],
    ids=["3tiles-2element", "2tiles-3tiles48", "8element-3tiles", "2tiles-8tiles48", "1tiles-3tiles"],
)
def test_checkpoint_round_trip_bitwise(tmp_path, src, dst):
    grans = {"tiles": tiled_or_element(), "element": None, "tiles48": tiled_or_element(4, 8)}
    tree = tree_of()
    src_plan, dst_plan = plan_of(tree, src[0], grans[src[1]]), plan_of(tree, dst[0], grans[dst[1]])
    sp = vj.shard(tree, src_plan)
    logical = jax.tree_util.tree_unflatten(src_plan.treedef, _logical.to_logical(sp.buffers, src_plan)[0])
    assert_trees_equal(logical, tree)
    tx = optax.adamw(1e-2)
    adam, *rest = vj.init_opt_state(tx, sp)
    mu = vj.shard(tree_of(1), src_plan)
    state = (adam._replace(mu=mu), *rest)
    with vj.checkpoint.Manager(tmp_path / "ckpt") as mngr:
        mngr.save(1, params=sp, opt_state=state)
        mngr.wait()
        target = jax.eval_shape(tx.init, vj.shard(tree, dst_plan))
        r = mngr.restore(params=dst_plan, opt_state=target)
        assert r.params.plan == dst_plan
        assert_trees_equal(vj.unshard(r.params), tree)
        assert_trees_equal(vj.unshard(r.opt_state[0].mu), tree_of(1))
        # and back into the source plan
        mngr.save(2, params=r.params)
        mngr.wait()
        assert_trees_equal(vj.unshard(mngr.restore(2, params=src_plan).params), tree)
    assert_padding_zero(r.params)


def test_plain_orbax_save_params_of_a_tiles_plan_is_logical(tmp_path):
    tree = tree_of(2)
    plan = plan_of(tree, M, tiled_or_element())
    vj.checkpoint.save_params(tmp_path / "p", vj.shard(tree, plan))
    back = vj.checkpoint.restore_params(tmp_path / "p", plan_of(tree, 2))
    assert_trees_equal(vj.unshard(back), tree)


# ------------------------------------------------------------------------------------------- vj.fsdp training
CFG = GPTConfig(vocab=257, max_len=16, d_model=20, num_heads=2, num_layers=3, d_ff=52)  # edge tiles everywhere


def make_tx():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3, weight_decay=0.1))


def fsdp_step(plan, apply_model, tx, **kw):
    @vj.fsdp(plan=plan, **kw)
    def step(params, opt_state, batch):
        def f(p):
            return loss_fn(apply_model(p, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(f)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss}

    return step


def run_fsdp(sp, step, tx, data):
    opt_state, losses = vj.init_opt_state(tx, sp), []
    for batch in data:
        sp, opt_state, metrics = step(sp, opt_state, batch)
        losses.append(float(metrics["loss"]))
    return sp, opt_state, losses


@pytest.fixture(scope="module")
def gpt_reference():
    graphdef, _ = abstract_model(CFG)
    params = init_params(CFG, jax.random.key(0))
    ref, losses = reference_run(params, lambda p, x: nnx.merge(graphdef, p)(x), make_tx(), batches())
    return params, ref, losses


def train_gpt(m, granularity, params, **kw):
    graphdef, shapes = abstract_model(CFG)
    plan = vj.plan(shapes, make_mesh(m), stacked=("blocks",), granularity=granularity)
    tx = make_tx()
    step = fsdp_step(plan, lambda p, x: vj.flax.nnx_apply(graphdef, p, x), tx, **kw)
    sp, _, losses = run_fsdp(vj.shard(params, plan), step, tx, batches())
    return plan, sp, losses


V, D, L = 37, 20, 3  # 8 x 8 tiles: partial edge tiles in every matrix


def mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"embed": (V, D), "blocks": {"w": (L, D, D), "b": (L, D)}, "head": (D, V)}
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s) * 0.5, jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def mlp(p, tokens):
    h = p["embed"][tokens]
    h = vj.scan_layers(lambda lp, h: jnp.tanh(h @ lp["w"] + lp["b"]), p["blocks"], h)
    return h @ p["head"]


def mlp_batches(n=20, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        t = rng.integers(0, V, size=(6, 9)).astype(np.int32)
        yield {"x": t[:, :-1], "y": t[:, 1:]}


def test_fsdp_training_with_tiles_equals_element_and_unsharded_mlp():
    """20 AdamW steps of a scanned MLP whose matrices are 8 x 8 tiles with partial edge tiles (the stacked
    layers included): the same losses and parameters as under vj.element() and unsharded."""
    params = mlp_params()
    tx = make_tx()
    ref, ref_losses = reference_run(params, mlp, tx, mlp_batches())
    results = {}
    for name, gran in (("tiles", tiled_or_element()), ("element", vj.element())):
        plan = vj.plan(params, make_mesh(M), stacked=("blocks",), granularity=gran)
        results[name] = (
            plan,
            *run_fsdp(vj.shard(params, plan), fsdp_step(plan, lambda p, x: vj.apply(mlp, p, x), tx), tx, mlp_batches()),
        )
    plan, sp, _, losses = results["tiles"]
    assert {b.name for b in plan.buckets if b.storage} == {b.name for b in plan.buckets}  # every bucket tiled
    _, sp_e, _, losses_e = results["element"]
    np.testing.assert_allclose(losses, losses_e, rtol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(vj.unshard(sp), vj.unshard(sp_e))
    assert_trees_close(vj.unshard(sp), ref)
    assert_padding_zero(sp)


@pytest.mark.slow
@pytest.mark.parametrize("m", DEVICE_COUNTS, ids=lambda m: f"m{m}")
def test_fsdp_training_with_tiles_equals_element_and_unsharded(m, gpt_reference):
    params, ref, ref_losses = gpt_reference
    _, sp, losses = train_gpt(m, tiled_or_element(), params)
    _, sp_e, losses_e = train_gpt(m, vj.element(), params)
    np.testing.assert_allclose(losses, losses_e, rtol=1e-5)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(vj.unshard(sp), vj.unshard(sp_e))
    assert_trees_close(vj.unshard(sp), ref)
    assert_padding_zero(sp)


# ------------------------------------------------------------------------------------------ Muon and Shampoo
@pytest.mark.parametrize("m", [M, pytest.param(8, marks=pytest.mark.slow)], ids=lambda m: f"m{m}")
def test_muon_on_a_tiles_plan_matches_optax(m):
    import test_muon as tm

    plan = vj.plan(tm.PARAMS, make_mesh(m), stacked=["layers"], granularity=tiled_or_element(4, 8))
    assert any(b.storage for b in plan.buckets)
    got, *_ = tm.run_sharded(tm.PARAMS, tm.GRADS, plan, **tm.DEFAULT)
    for g, r in zip(got, tm.reference("default", tm.PARAMS, tm.GRADS, **tm.DEFAULT), strict=True):
        assert_trees_close(g, r)


SHAMPOO_GRAN = tiled_or_element(8, 8)  # 8 x 8 tiles hold 2 x 2 Shampoo blocks of 4: blocks in storage order


@pytest.mark.parametrize("m", [M, pytest.param(8, marks=pytest.mark.slow)], ids=lambda m: f"m{m}")
def test_shampoo_on_a_tiles_plan_matches_the_reference(m):
    import test_shampoo as ts

    plan = vj.plan(ts.PARAMS, make_mesh(m), stacked=["layers"], granularity=SHAMPOO_GRAN)
    assert any(b.storage for b in plan.buckets)
    got, *_ = ts.run_sharded(plan, **ts.DEFAULT)
    for a, r in zip(got, ts.reference("default", **ts.DEFAULT), strict=True):
        assert_trees_close(a, r, rtol=1e-4)


def test_shampoo_rejects_blocks_that_span_tiles():
    import test_shampoo as ts

    plan = vj.plan(ts.PARAMS, make_mesh(M), stacked=["layers"], granularity=tiled_or_element(6, 6))
    with pytest.raises(ValueError, match=r"'a/w'.*\(37, 11\).*tiles\(6, 6\).*vj\.rows\(4\)"):
        vjo.shampoo(0.1, plan=plan, block_size=4)


def local_blocks(sp, tables):
    """Shampoo's PerDevice rows of the params themselves: each device's b x b blocks of its shards."""
    plan = sp.plan

    def local(*shards):
        k = jax.lax.axis_index(plan.axis)
        return gather_blocks(local_vector(shards, tables.buckets, jnp.float32), tables, k)

    specs = tuple(plan.partition_spec(b) for b in plan.buckets)
    fn = jax.shard_map(local, mesh=plan.mesh, in_specs=specs, out_specs=P(plan.axis), check_vma=False)
    return jax.jit(fn)(*sp.buffers)


def reference_blocks(x, b):
    """``(.., nb, b, b)``: the zero-padded b x b blocks of the matrix view, row-major block order."""
    r, c = math.prod(x.shape[:-1]), x.shape[-1]
    v = np.zeros((-(-r // b) * b, -(-c // b) * b), x.dtype)
    v[:r, :c] = x.reshape(r, c)
    return v.reshape(-(-r // b), b, -(-c // b), b).transpose(0, 2, 1, 3).reshape(-1, b, b)


@pytest.mark.parametrize(("m", "other"), [(M, min(2, M)), pytest.param(8, 3, marks=pytest.mark.slow)])
def test_block_and_compact_layouts_of_a_tiles_plan_are_logical(m, other):
    from helpers import edge_block_params

    params = edge_block_params()
    plan = vj.plan(params, make_mesh(m), stacked=["layers"], granularity=SHAMPOO_GRAN)
    plan_b = vj.plan(params, make_mesh(other), stacked=["layers"], granularity=vj.rows(4))
    sp = vj.shard(params, plan)
    flat = {spec.path: np.asarray(x) for spec, x in zip(plan.leaves, jax.tree.leaves(params), strict=True)}
    # Blocks: the logical view is each matrix leaf's blocks in row-major block order, whatever the storage.
    layout = BlockLayout(plan, 4)
    value = local_blocks(sp, build_blocks(plan, 4))
    view = layout.to_logical(value)
    for spec in plan.leaves:
        if len(plan.layer_shape(spec)) < 2:
            continue
        x = flat[spec.path]
        want = np.stack([reference_blocks(y, 4) for y in x]) if spec.shape != plan.layer_shape(spec) else None
        want = reference_blocks(x, 4) if want is None else want
        np.testing.assert_array_equal(np.asarray(view[f"{spec.path}/blocks"]), want, err_msg=spec.path)
    # ... and moves to a rows plan on another device count and back, bit for bit.
    moved = BlockLayout(plan_b, 4).from_logical(view)
    assert_trees_equal(BlockLayout(plan_b, 4).to_logical(moved), view)
    np.testing.assert_array_equal(np.asarray(layout.from_logical(BlockLayout(plan_b, 4).to_logical(moved))), value)
    # Compact vectors (AdamW state of the leaves Muon / Shampoo hand over): each chosen leaf at its shape.
    chosen = tuple(spec.path in ("a/w", "b/v", "layers/w", "a/b") for spec in plan.leaves)
    compact_layout = CompactLayout(plan, chosen)
    value = compact(sp.buffers, plan, build_compact(plan, chosen))
    view = compact_layout.to_logical(value)
    for spec, on in zip(plan.leaves, chosen, strict=True):
        if on:
            np.testing.assert_array_equal(np.asarray(view[spec.path]), flat[spec.path], err_msg=spec.path)
    for key, s in compact_layout.logical_shapes().items():
        assert s.shape == view[key].shape and view[key].sharding.is_equivalent_to(s.sharding, len(s.shape))
    other_layout = CompactLayout(plan_b, chosen)
    moved = other_layout.from_logical(view)
    assert_trees_equal(other_layout.to_logical(moved), view)
    np.testing.assert_array_equal(np.asarray(compact_layout.from_logical(other_layout.to_logical(moved))), value)


# ------------------------------------------------------------------------------------------- Pallas kernels
def test_pallas_pack_and_unpack_of_tiled_buckets_match_xla(monkeypatch):
    from vescale_jax.step import _wire as collectives

    tree = tree_of(3)
    plan = plan_of(tree, M, tiled_or_element())
    leaves = jax.tree.leaves(tree)
    calls = {"pack": [], "unpack": []}  # the tile kernels (relayout fused) see every tiled bucket
    for name in calls:
        real = getattr(vj.kernels._tiles, f"{name}_tiled_mapped")
        monkeypatch.setattr(
            vj.kernels._tiles,
            f"{name}_tiled_mapped",
            lambda *a, _r=real, _n=name, **k: calls[_n].append(a[1]) or _r(*a, **k),
        )
    for bucket in plan.buckets:
        lead = () if bucket.layers is None else (bucket.layers,)
        xs = [jnp.asarray(leaves[i]) for i in bucket.leaves]
        shapes = [plan.leaves[i].shape for i in bucket.leaves]
        out = {}
        for policy in (vj.kernels.KernelPolicy(mode="xla"), vj.kernels.KernelPolicy(mode="pallas", interpret=True)):
            kw = dict(kernels_policy=policy, storage=bucket.storage)
            buf = collectives.pack(xs, bucket.layout, dtype=jnp.dtype(bucket.dtype), lead=lead, **kw)
            out[policy.mode] = buf, collectives.unpack(buf, bucket.layout, shapes, **kw)
        np.testing.assert_array_equal(np.asarray(out["pallas"][0]), np.asarray(out["xla"][0]), err_msg=bucket.name)
        for got, want in zip(out["pallas"][1], xs, strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=bucket.name)
    tiled = {b.layout for b in plan.buckets if b.storage and b.layout.total_size}
    assert tiled and tiled <= set(calls["pack"]) and tiled <= set(calls["unpack"])


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_pallas_kernels_on_a_tiles_plan_give_identical_gradients(monkeypatch, reshard):
    cfg = GPTConfig(vocab=67, max_len=8, d_model=12, num_heads=2, num_layers=2, d_ff=20)
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, make_mesh(M), stacked=("blocks",), granularity=tiled_or_element(8, 8))
    assert any(b.storage and b.layers for b in plan.buckets) and any(b.storage and not b.layers for b in plan.buckets)
    sp = vj.shard(init_params(cfg, jax.random.key(0)), plan)
    batch = {"x": np.arange(48).reshape(6, 8) % cfg.vocab, "y": (np.arange(48).reshape(6, 8) + 1) % cfg.vocab}
    calls = []
    real = vj.kernels.unpack
    monkeypatch.setattr(vj.kernels._ragged, "unpack", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    results = {}
    for policy in (vj.kernels.KernelPolicy(mode="xla"), vj.kernels.KernelPolicy(mode="pallas", interpret=True)):

        @vj.fsdp(plan=plan, donate=False, reshard_after_forward=reshard, kernels=policy)
        def grad_step(params, _, batch):
            return jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"]))(params)

        results[policy.mode] = grad_step(sp, None, batch)
    assert {b.layout for b in plan.buckets if b.storage} <= set(calls)  # the kernels ran on the tiled buckets
    (loss_x, g_x), (loss_p, g_p) = results["xla"], results["pallas"]
    assert float(loss_x) == float(loss_p)
    for a, b in zip(g_x.buffers, g_p.buffers, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the tiles plan's gradients are the element plan's (relaid out)
    plan_e = vj.plan(shapes, make_mesh(M), stacked=("blocks",))

    @vj.fsdp(plan=plan_e, donate=False)
    def grad_e(params, _, batch):
        return jax.value_and_grad(lambda p: loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"]))(params)

    loss_e, g_e = grad_e(vj.shard(init_params(cfg, jax.random.key(0)), plan_e), None, batch)
    np.testing.assert_allclose(float(loss_e), float(loss_x), rtol=1e-6)
    assert_trees_close(vj.unshard(g_p), vj.unshard(g_e))
