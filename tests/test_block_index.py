"""The block index of the layout layer (``vescale_jax.layout._blocks``, used by the FP8 gather and 8-bit AdamW)
against a brute-force reference computed from the logical shapes.

The reference labels every element of every leaf with its block, computed on the leaf's (TP-local, per-layer)
shape: ``lead * nbh * nbw + (row // bh) * nbw + col // bw`` for a quantized leaf, its flat index for an exact one.
``vj.shard`` then packs these labels (and the leaf of each element) into the buckets like any params, so each
device's local shard holds the true block of each of its elements. The index must give every device a slot per
block it holds (``0 .. n_k - 1``, padding ``nb``), one block to one slot, no block on two devices, the
documented slot order, and the placement of each logical block; and it must refuse exactly the layouts in which
a device boundary cuts a block.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh

import vescale_jax as vj
from vescale_jax.layout import _blocks

P = jax.sharding.PartitionSpec
BLOCK = (8, 8)

SHAPES = {
    "a": {"w": ((21, 19), "float32"), "b": ((19,), "float32"), "v": ((3, 16, 20), "float32")},
    "b": {"w": ((16, 24), "float32"), "small": ((4, 4), "float32"), "i": ((5, 6), "int32")},
    "layers": {"w": ((3, 17, 16), "float32"), "n": ((3, 16), "float32"), "e": ((3, 2, 16, 24), "float32")},
}
PARAMS = jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(s[0], jnp.dtype(s[1])), SHAPES, is_leaf=lambda x: isinstance(x, tuple)
)

GRANULARITIES = {
    "rows": lambda p, x: vj.rows(BLOCK[0]) if x.ndim >= 2 else vj.element(),
    "rows2": lambda p, x: vj.rows(2 * BLOCK[0]) if x.ndim >= 2 else vj.element(),
    "element": vj.element(),
    "whole": vj.whole(),
    "tiles": lambda p, x: vj.tiles(*BLOCK) if x.ndim >= 2 else vj.element(),
    "tiles_multiple": lambda p, x: vj.tiles(2 * BLOCK[0], BLOCK[1]) if x.ndim >= 2 else vj.element(),
    "tiles_smaller": lambda p, x: vj.tiles(4, 4) if x.ndim >= 2 else vj.element(),
}


def quantized(spec, shape, min_size):
    return len(shape) >= 2 and math.prod(shape) >= min_size and jnp.issubdtype(jnp.dtype(spec.dtype), jnp.floating)


def local_labels(shape, is_quantized):
    """The block of each element of a per-layer (TP-local) leaf of ``shape``, in logical layout."""
    if not is_quantized:
        return np.arange(math.prod(shape)).reshape(shape)
    *lead, h, w = shape
    bh, bw = BLOCK
    nbh, nbw = -(-h // bh), -(-w // bw)
    ld, r, c = np.indices((math.prod(lead), h, w))
    return (ld * nbh * nbw + r // bh * nbw + c // bw).reshape(shape)


def reference(plan, min_size, *, logical=False):
    """Per bucket ``(leaf, block)`` arrays like the bucket's global buffer: the leaf's index in the bucket's
    slot order (-1 at padding) and the block label of every element. ``logical``: label a TP-split leaf's
    blocks over its logical shape (else over its shards', tiled over the split dims)."""
    sizes = dict(plan.mesh.shape)
    label_tree, leaf_tree = [], []
    for i, spec in enumerate(plan.leaves):
        b = plan.buckets[spec.bucket]
        shape = plan.layer_shape(spec)
        q = quantized(spec, shape, min_size)
        if logical and spec.tp:
            x = local_labels(spec.shape[1:] if b.layers else spec.shape, q)
        else:
            x = local_labels(shape, q)
            reps = [math.prod(sizes[a] for a in axes) for axes in (spec.tp[1:] if b.layers else spec.tp)]
            x = np.tile(x, reps) if spec.tp else x
        if b.layers:
            x = np.broadcast_to(x, spec.shape)
        assert x.shape == spec.shape and x.max(initial=0) < 2**24
        label_tree.append(jnp.asarray(x, spec.dtype))
        leaf_tree.append(jnp.full(spec.shape, b.leaves.index(i) + 1, spec.dtype))
    unflat = lambda xs: jax.tree.unflatten(plan.treedef, xs)
    labels, leaves = vj.shard(unflat(label_tree), plan), vj.shard(unflat(leaf_tree), plan)
    return [
        (np.asarray(lf).astype(np.int64) - 1, np.asarray(lb).astype(np.int64))
        for lf, lb in zip(leaves.buffers, labels.buffers, strict=True)
    ]


def cuts(plan, refs):
    """Whether some block (of some group and layer) has elements on two devices."""
    m = plan.num_devices
    for b, (leaf, label) in zip(plan.buckets, refs, strict=True):
        s = b.layout.shard_size
        for row_leaf, row_label in zip(np.reshape(leaf, (-1, m * s)), np.reshape(label, (-1, m * s)), strict=True):
            owner = {}
            for k in range(m):
                sl = slice(k * s, (k + 1) * s)
                for key in set(zip(row_leaf[sl].tolist(), row_label[sl].tolist(), strict=True)):
                    if key[0] >= 0 and owner.setdefault(key, k) != k:
                        return True
    return False


def check_index(plan, min_size, refs):
    """The index of every bucket against the reference's per-device labels."""
    m = plan.num_devices
    for bi, (b, (leaf, label)) in enumerate(zip(plan.buckets, refs, strict=True)):
        t = _blocks.block_index(plan, bi, BLOCK, min_size)
        s = b.layout.shard_size
        assert t.layers == (b.layers or 1)
        kinds = {lb.leaf: j for j, lb in enumerate(t.leaves)}
        positions = {j: b.leaves.index(lb.leaf) for j, lb in enumerate(t.leaves)}
        for j, lb in enumerate(t.leaves):
            spec = plan.leaves[lb.leaf]
            q = quantized(spec, lb.shape, min_size)
            tiled = bool(b.storage) and b.storage[positions[j]] is not None
            spread = len({(b.layout.offsets[positions[j]] + e) // s for e in (0, math.prod(lb.shape) - 1)}) > 1
            want = "exact" if not q else ("storage" if tiled and spread else "logical")
            assert lb.numbering == want, (spec.path, lb.numbering, want)
            assert lb.num_blocks == (math.prod(lb.grid) if q else math.prod(lb.shape))
        slots = [_blocks.local_slots(t, k, s) for k in range(m)]
        used = []
        rows_leaf, rows_label = np.reshape(leaf, (-1, m * s)), np.reshape(label, (-1, m * s))
        for row_leaf, row_label in zip(rows_leaf, rows_label, strict=True):  # each layer of each group
            where = {}  # (leaf slot, label) -> (device, slot)
            for k in range(m):
                lf, lb_, sl = row_leaf[k * s : (k + 1) * s], row_label[k * s : (k + 1) * s], slots[k]
                assert sl.dtype == np.int32 and sl.shape == (s,)
                np.testing.assert_array_equal(lf < 0, sl == t.nb)  # padding <-> the padding slot
                pairs = {}
                for a, c, z in zip(lf.tolist(), lb_.tolist(), sl.tolist(), strict=True):
                    if a >= 0:
                        assert pairs.setdefault((a, c), z) == z, "one block, two slots"
                        assert where.setdefault((a, c), (k, z)) == (k, z), "a block on two devices"
                inverse = {z: key for key, z in pairs.items()}
                assert len(inverse) == len(pairs), "two blocks, one slot"
                assert sorted(inverse) == list(range(len(inverse))), "the slots of a device are 0 .. n_k - 1"
                used.append(len(inverse))
                exact = t.exact_slots[k]
                assert not exact[t.nb]
                for z, (a, _) in inverse.items():
                    assert exact[z] == t.leaves[kinds[b.leaves[a]]].exact
                # slot order: the leaves in slot order, each leaf's blocks in its numbering's order
                first = {}
                for e, (a, c) in enumerate(zip(lf.tolist(), lb_.tolist(), strict=True)):
                    if a >= 0:
                        first.setdefault((a, c), e)
                numbering = {key: t.leaves[kinds[b.leaves[key[0]]]].numbering for key in pairs}
                order = sorted(pairs, key=lambda key: (key[0], key[1] if numbering[key] == "logical" else first[key]))
                assert [pairs[key] for key in order] == list(range(len(order)))
            if b.groups:
                continue  # placement is the local shard's: checked on the ungrouped buckets
            for j, lb in enumerate(t.leaves):
                device, slot = t.placement(j)
                a = positions[j]
                want = [where[(a, c)] for c in range(lb.num_blocks)]
                assert [(int(d), int(z)) for d, z in zip(device, slot, strict=True)] == want
        assert t.nb == max(1, max(used))


FAST = {(1, "rows", 0), (2, "rows", 0), (8, "tiles", 0), (2, "tiles_multiple", 0)} | {(3, g, 0) for g in GRANULARITIES}
CASES = [
    pytest.param(m, gran, min_size, marks=() if (m, gran, min_size) in FAST else pytest.mark.slow)
    for m in (1, 2, 3, 8)
    for gran in GRANULARITIES
    for min_size in (0, 100)
    if not (gran in ("rows2", "whole", "tiles_smaller") and min_size == 100)
]


@pytest.mark.parametrize(("m", "gran", "min_size"), CASES, ids=lambda x: str(x))
def test_index_equals_the_brute_force_blocks(m, gran, min_size, params=PARAMS):
    plan = vj.plan(params, make_mesh(m), stacked=("layers",), granularity=GRANULARITIES[gran])
    refs = reference(plan, min_size)
    try:
        for bi in range(len(plan.buckets)):
            _blocks.block_index(plan, bi, BLOCK, min_size)
    except _blocks.BlockCut as cut:
        assert m > 1 and gran not in ("tiles", "tiles_multiple", "whole", "rows"), (cut, cut.reason)
        if cut.reason == "rows":  # a row-major leaf is refused exactly when a block spans two devices
            assert cuts(plan, refs)
        else:  # tile-major, tiles the block does not divide, spread over devices
            assert cut.reason == "tiles" and cut.storage == vj.tiles(4, 4)
        return
    assert not cuts(plan, refs)
    check_index(plan, min_size, refs)


@pytest.mark.parametrize("m", [2, 3, pytest.param(8, marks=pytest.mark.slow)])
def test_bands_that_straddle_matrices_are_refused_exactly_when_they_cut_a_block(m):
    params = {"e": jax.ShapeDtypeStruct((3, 9, 24), jnp.float32), "w": jax.ShapeDtypeStruct((11, 8), jnp.float32)}
    plan = vj.plan(params, make_mesh(m), granularity=GRANULARITIES["rows"])
    refs = reference(plan, 0)
    try:
        _blocks.block_index(plan, 0, BLOCK, 0)
    except _blocks.BlockCut as cut:
        assert cut.reason == "rows" and cut.spec.path == "e" and cuts(plan, refs)
        return
    assert not cuts(plan, refs)
    check_index(plan, 0, refs)


def test_all_exact():
    plan = vj.plan(PARAMS, make_mesh(3), stacked=("layers",), granularity=vj.element())
    refs = reference(plan, 10**9)
    check_index(plan, 10**9, refs)
    for bi in range(len(plan.buckets)):
        t = _blocks.block_index(plan, bi, BLOCK, 10**9)
        assert all(lb.exact for lb in t.leaves) and t.exact_slots[:, : t.nb].sum() == sum(
            math.prod(lb.shape) for lb in t.leaves
        )


TP_PARAMS = {  # shards of (21, 16), (64,), (16, 21), (2, 21, 16), (2, 16, 21): split dims multiples of 8
    "up": jax.ShapeDtypeStruct((21, 64), jnp.float32),
    "up_b": jax.ShapeDtypeStruct((64,), jnp.float32),
    "down": jax.ShapeDtypeStruct((64, 21), jnp.float32),
    "norm": jax.ShapeDtypeStruct((21,), jnp.float32),
    "layers": {
        "q": jax.ShapeDtypeStruct((2, 21, 64), jnp.float32),
        "o": jax.ShapeDtypeStruct((2, 64, 21), jnp.float32),
    },
}
TP_SPECS = {
    "up": P(None, "tensor"),
    "up_b": P("tensor"),
    "down": P("tensor", None),
    "norm": None,
    "layers": {"q": P(None, None, "tensor"), "o": P(None, "tensor", None)},
}


@pytest.mark.parametrize("gran", ["rows", "tiles"])
def test_tp_plan(gran):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=jax.devices()[:8])
    plan = vj.plan(TP_PARAMS, mesh, stacked=("layers",), tp=TP_SPECS, granularity=GRANULARITIES[gran])
    assert any(b.groups for b in plan.buckets)
    check_index(plan, 0, reference(plan, 0))
    # the shards' blocks are the logical leaf's: labelled over the logical shapes, no block spans two devices
    # and each device's blocks map one to one onto its slots
    check_index(plan, 0, reference(plan, 0, logical=True))


def test_tp_split_the_block_does_not_divide_is_refused():
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=jax.devices()[:8])
    plan = vj.plan({"w": jax.ShapeDtypeStruct((24, 40), jnp.float32)}, mesh, tp={"w": P(None, "tensor")})
    with pytest.raises(_blocks.BlockCut) as e:
        _blocks.block_index(plan, 0, BLOCK, 0)  # shards of (24, 10): 10 is not a multiple of 8
    assert e.value.reason == "split" and e.value.split == (1, 8, ("tensor",))
