"""vj.plan over pytrees, RaggedShard views, shard / unshard / init_sharded."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import linen as nn
from flax import nnx
from helpers import assert_trees_equal, child_pythonpath

import vescale_jax as vj

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8)


def random_tree(seed: int, *, big: bool = False):
    """Leaves whose dims do not divide 8 (or 3), with mixed dtypes."""
    rng = np.random.default_rng(seed)

    def arr(shape, dtype):
        if jnp.issubdtype(dtype, jnp.floating):
            x = rng.standard_normal(shape).astype(np.float32)
        else:
            info = jnp.iinfo(dtype)
            x = rng.integers(info.min, info.max, size=shape, endpoint=True)
        return jnp.asarray(x, dtype=dtype)

    tree = {
        "embed": {"table": arr((50257, 768 if big else 24), jnp.float32)},
        "blocks": {
            "w": arr((37, 13), jnp.bfloat16),
            "b": arr((13,), jnp.bfloat16),
            "scale": arr((), jnp.float32),
            "ids": arr((5, 7), jnp.int32),
        },
        "head": [arr((11, 17, 3), jnp.float16), arr((29,), jnp.int8), arr((0, 4), jnp.float32)],
        "q": arr((9, 9), jnp.uint8),
    }
    for i, dtype in enumerate(DTYPES):
        tree[f"extra{i}"] = arr(tuple(int(d) for d in rng.integers(1, 40, size=rng.integers(1, 4))), dtype)
    return tree


@pytest.mark.parametrize("granularity", [vj.element(), vj.rows(1), vj.rows(4), vj.whole()], ids=repr)
def test_shard_unshard_bit_exact(mesh, granularity):
    tree = random_tree(0)
    plan = vj.plan(tree, mesh, granularity=granularity)
    sp = vj.shard(tree, plan)
    m = mesh.size
    for bucket, buf in zip(plan.buckets, sp.buffers, strict=True):
        assert buf.shape == bucket.shape and buf.shape[-1] == m * bucket.layout.shard_size
        assert buf.dtype == jnp.dtype(bucket.dtype)
        assert buf.sharding.spec == plan.partition_spec(bucket)
        shards = buf.addressable_shards
        assert {s.data.shape for s in shards} == {bucket.local_shape}
    assert_trees_equal(vj.unshard(sp), tree)


def test_big_embedding_on_eight_devices_bit_exact():
    mesh = make_mesh(8)
    tree = random_tree(1, big=True)
    plan = vj.plan(tree, mesh, granularity=vj.rows(1))
    assert_trees_equal(vj.unshard(vj.shard(tree, plan)), tree)
    rs = plan.shard_of("embed/table")
    assert rs.block == 768 and sum(rs.local_sizes) == 50257 * 768
    assert all(start % 768 == 0 for start in rs.starts)


def test_padding_is_zero_and_leaves_sit_at_offsets(mesh):
    tree = random_tree(2)
    plan = vj.plan(tree, mesh, granularity=vj.rows(1))
    sp = vj.shard(tree, plan)
    leaves = jax.tree.leaves(tree)
    for bucket, buf in zip(plan.buckets, sp.buffers, strict=True):
        host = np.asarray(buf)
        used = np.zeros(host.shape[-1], bool)
        for slot, i in enumerate(bucket.leaves):
            o, n = bucket.layout.offsets[slot], bucket.layout.sizes[slot]
            assert host[o : o + n].tobytes() == np.asarray(leaves[i]).reshape(-1).tobytes()
            used[o : o + n] = True
        assert not np.any(host[~used])


def test_blocks_never_cut(mesh):
    tree = random_tree(3)
    plan = vj.plan(tree, mesh, granularity=lambda path, leaf: vj.rows(2) if leaf.ndim >= 2 else vj.element())
    for spec in plan.leaves:
        rs = plan.shard_of(spec.path)
        expected = 2 * spec.shape[-1] if len(spec.shape) >= 2 else 1
        assert rs.block == min(expected, max(spec.size, 1))
        for start, end in rs.ranges:
            if end > start:
                assert start % rs.block == 0
                assert end % rs.block == 0 or end == rs.size


def test_whole_granularity_puts_each_leaf_on_one_device(mesh):
    tree = random_tree(4)
    plan = vj.plan(tree, mesh, granularity=vj.whole())
    for spec in plan.leaves:
        if spec.size:
            assert plan.shard_of(spec.path).owner is not None, spec.path


def test_whole_where_cheap_releases_the_largest_leaves_first():
    # 4 matrices of 64x32 fill one device each; a 256x32 one kept whole would force S >= 8192 (75 % padding).
    # whole(max_padding=0.05) releases the big one to element() (it spans the other 4 devices) and keeps the
    # small ones whole.
    tree = {f"m{i}": jax.ShapeDtypeStruct((64, 32), jnp.float32) for i in range(4)}
    tree["big"] = jax.ShapeDtypeStruct((256, 32), jnp.float32)
    units = lambda path, leaf: "all"
    always = vj.plan(tree, make_mesh(8), units=units, granularity=vj.whole())
    assert always.padding_fraction > 0.5
    plan = vj.plan(tree, make_mesh(8), units=units, granularity=vj.whole(max_padding=0.05))
    assert plan.padding_fraction <= 0.05
    assert plan.leaf("big").granularity == vj.element()
    for i in range(4):
        spec = plan.leaf(f"m{i}")
        assert spec.granularity == vj.whole(max_padding=0.05)
        assert plan.shard_of(spec.path).owner is not None
    assert plan.shard_of("big").owner is None
    # Muon orthogonalises the whole ones where they are: no elements move for them.
    routing = vj.optim.muon_routing(plan)
    for r in routing.matrices:
        if plan.leaves[r.leaf].path != "big":
            assert r.devices == (r.owner,)
    # A budget that holds with everything whole releases nothing.
    loose = vj.plan(tree, make_mesh(8), units=units, granularity=vj.whole(max_padding=0.9))
    assert all(s.granularity.kind == "whole" for s in loose.leaves)
    assert repr(vj.whole(max_padding=0.05)) == "whole(max_padding=0.05)"
    with pytest.raises(ValueError, match="max_padding"):
        vj.whole(max_padding=1.5)


def test_buckets_group_units_and_never_mix_dtypes(mesh):
    tree = random_tree(5)
    plan = vj.plan(tree, mesh)
    names = {b.name for b in plan.buckets}
    assert {"blocks:bfloat16", "blocks:float32", "blocks:int32"} <= names
    for b in plan.buckets:
        assert {plan.leaves[i].dtype for i in b.leaves} == {b.dtype}
        itemsize = np.dtype(b.dtype).itemsize
        assert b.layout.align == max(1, 16 // itemsize)
        assert all(o % b.layout.align == 0 for o in b.layout.offsets)
        assert b.layout.shard_size % b.layout.align == 0


def test_stacked_layer_group(mesh):
    layers, rng = 5, np.random.default_rng(6)
    tree = {
        "layers": {
            "w": jnp.asarray(rng.standard_normal((layers, 7, 11)), jnp.float32),
            "b": jnp.asarray(rng.standard_normal((layers, 11)), jnp.float32),
        },
        "head": jnp.asarray(rng.standard_normal((11, 3)), jnp.float32),
    }
    plan = vj.plan(tree, mesh, stacked=("layers",), granularity=vj.rows(1))
    (bucket,) = [b for b in plan.buckets if b.unit == "layers"]
    assert bucket.layers == layers
    assert bucket.layout.sizes == (11, 77) or bucket.layout.sizes == (77, 11)
    sp = vj.shard(tree, plan)
    buf = sp.buffers[plan.buckets.index(bucket)]
    assert buf.shape == (layers, mesh.size * bucket.layout.shard_size)
    assert buf.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert_trees_equal(vj.unshard(sp), tree)
    assert plan.shard_of("layers/w").shape == (7, 11)


def test_linen_and_nnx_trees(mesh):
    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(5)(nn.Dense(7)(x))

    params = Lin().init(jax.random.key(0), jnp.ones((1, 3)))
    plan = vj.plan(params, mesh)
    assert {b.unit for b in plan.buckets} == {"Dense_0", "Dense_1"}
    assert_trees_equal(vj.unshard(vj.shard(params, plan)), params)

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(19, 6, rngs=rngs)
            self.out = nnx.Linear(6, 5, rngs=rngs)

    state = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    plan = vj.plan(state, mesh)
    assert {s.path for s in plan.leaves} == {"embed/embedding", "out/kernel", "out/bias"}
    back = vj.unshard(vj.shard(state, plan))
    assert isinstance(back, nnx.State)
    assert_trees_equal(back, state)


def test_plan_from_shape_dtype_structs_and_init_sharded_never_holds_the_model():
    mesh = make_mesh(8)

    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {
            "embed": jax.random.normal(k1, (50257, 256)),
            "mlp": {"w": jax.random.normal(k2, (256, 1024)), "b": jnp.zeros((1024,), jnp.bfloat16)},
            "head": jax.random.normal(k3, (256, 50257)),
        }

    shapes = jax.eval_shape(init, jax.random.key(0))
    plan = vj.plan(shapes, mesh, granularity=vj.rows(1))
    sp = vj.init_sharded(init, plan, jax.random.key(0))
    assert_trees_equal(vj.unshard(sp), init(jax.random.key(0)))
    for bucket, buf in zip(plan.buckets, sp.buffers, strict=True):
        assert buf.sharding == jax.sharding.NamedSharding(mesh, plan.partition_spec(bucket))

    model_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    largest = max(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    # The compiled init behind init_sharded: its transient memory stays near one leaf, not the model.
    compiled = vj.state._sharded.init_sharded_fn(init, plan).lower(jax.random.key(0)).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 0.75 * model_bytes, (temp, model_bytes)
    assert temp <= 1.25 * largest, (temp, largest)


def test_plan_is_hashable_and_deterministic():
    mesh = make_mesh(3)
    tree = random_tree(7)
    p1 = vj.plan(tree, mesh, granularity=vj.rows(1))
    p2 = vj.plan(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree), mesh, granularity=vj.rows(1))
    assert p1 == p2 and hash(p1) == hash(p2)
    assert p1.fingerprint() == p2.fingerprint()
    code = textwrap.dedent(
        """
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=3"
        import jax
        from test_plan import random_tree
        import vescale_jax as vj
        mesh = jax.make_mesh((3,), ("fsdp",))
        print(vj.plan(random_tree(7), mesh, granularity=vj.rows(1)).fingerprint())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**child_pythonpath(), "PYTHONHASHSEED": "123"},
    )
    assert out.stdout.strip() == p1.fingerprint()


def test_summary_lists_every_bucket(mesh):
    plan = vj.plan(random_tree(8), mesh)
    text = plan.summary()
    for b in plan.buckets:
        assert b.name in text
    assert f"over {mesh.size} devices" in text


# ----------------------------------------------------------------------------------------- errors


def test_error_non_array_leaf():
    with pytest.raises(TypeError, match=r"\['a'\]\['b'\].*not an array"):
        vj.plan({"a": {"b": 3.0}}, make_mesh(2))


def test_error_prng_key_leaf():
    with pytest.raises(TypeError, match="PRNG keys"):
        vj.plan({"rng": jax.random.key(0)}, make_mesh(2))


def test_error_mesh_without_axis():
    with pytest.raises(ValueError, match="no axis 'data'"):
        vj.plan({"w": jnp.ones(4)}, make_mesh(2), axis="data")


def test_error_bad_granularity():
    with pytest.raises(TypeError, match=r"\['w'\].*vj.rows"):
        vj.plan({"w": jnp.ones(4)}, make_mesh(2), granularity=lambda p, x: 16)
    with pytest.raises(ValueError, match="k >= 1"):
        vj.rows(0)


def test_error_stacked_without_layer_dim():
    tree = {"layers": {"w": jnp.ones((3, 4)), "b": jnp.ones((2,))}}
    with pytest.raises(ValueError, match="leading layer dim"):
        vj.plan(tree, make_mesh(2), stacked=("layers",))


def test_error_tree_does_not_match_plan():
    mesh = make_mesh(2)
    plan = vj.plan({"w": jnp.ones((4, 3)), "b": jnp.ones(3)}, mesh)
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4, 4\).*expects \(4, 3\)"):
        vj.shard({"w": jnp.ones((4, 4)), "b": jnp.ones(3)}, plan)
    with pytest.raises(ValueError, match="tree structure"):
        vj.shard({"w": jnp.ones((4, 3))}, plan)
    with pytest.raises(ValueError, match="dtype bfloat16"):
        vj.shard({"w": jnp.ones((4, 3), jnp.bfloat16), "b": jnp.ones(3)}, plan)


def test_split_cuts_large_units_into_per_leaf_buckets(mesh):
    big = {
        "layers": {
            "w1": jax.ShapeDtypeStruct((2, 512, 1024), jnp.float32),  # 2 MiB per layer
            "w2": jax.ShapeDtypeStruct((2, 1024, 512), jnp.float32),
            "b": jax.ShapeDtypeStruct((2, 512), jnp.float32),
        },
        "small": {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32), "b": jax.ShapeDtypeStruct((8,), jnp.float32)},
    }
    auto = vj.plan(big, mesh, stacked=("layers",))
    # the 4 MiB-per-layer unit is cut (each matrix alone, the bias with the rest); the small unit stays whole
    assert sorted(b.name for b in auto.buckets) == [
        "layers/rest:float32",
        "layers/w1:float32",
        "layers/w2:float32",
        "small:float32",
    ]
    assert {b.unit for b in auto.buckets} == {"layers", "small"}
    none = vj.plan(big, mesh, stacked=("layers",), split="none")
    assert sorted(b.name for b in none.buckets) == ["layers:float32", "small:float32"]
    leaves = vj.plan(big, mesh, stacked=("layers",), split="leaves")
    assert len(leaves.buckets) == 5  # every matrix alone, the vectors of each unit together
    rng = np.random.default_rng(0)
    tree = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), big)
    for p in (auto, none, leaves):
        assert_trees_equal(vj.unshard(vj.shard(tree, p)), tree)
    with pytest.raises(ValueError, match="split="):
        vj.plan(big, mesh, split="matrices")


def test_auto_split_keeps_a_unit_whole_when_cutting_it_would_pad_more():
    # rows(128) blocks: alone, a 3-block matrix pads to one block per device; together two fill 6 of 8 slots
    shape = jax.ShapeDtypeStruct((384, 2048), jnp.float32)
    tree = {"u": {"a": shape, "b": shape}}
    mesh = make_mesh(8)
    plan = vj.plan(tree, mesh, granularity=vj.rows(128))
    assert [b.name for b in plan.buckets] == ["u:float32"]
    cut = vj.plan(tree, mesh, granularity=vj.rows(128), split="leaves")
    assert len(cut.buckets) == 2 and cut.padding_fraction > plan.padding_fraction


def test_default_units_find_repeated_layers_wherever_they_sit():
    f = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    layer = lambda: {"attn": {"w": f(4, 4)}, "experts": {"0": {"w": f(4, 2)}, "1": {"w": f(4, 2)}}, "ln": f(4)}
    tree = {
        "params": {  # a Linen collection key: never part of a unit name
            "transformer": {"wte": f(10, 4), "h": {str(i): layer() for i in range(3)}, "ln_f": f(4)},
            "lm_head": {"kernel": f(4, 10)},
        }
    }
    plan = vj.plan(tree, make_mesh(2))
    units = {s.path: plan.buckets[s.bucket].unit for s in plan.leaves}
    assert units["params/transformer/h/1/experts/0/w"] == "transformer/h/1"  # the outermost repeated module
    assert units["params/transformer/h/2/ln"] == "transformer/h/2"
    assert units["params/transformer/wte"] == "transformer/wte"  # beside the layers, under their parent
    assert units["params/transformer/ln_f"] == "transformer/ln_f"
    assert units["params/lm_head/kernel"] == "lm_head"
    summary = plan.summary()
    assert "units: one per repeated layer of transformer/h/0..2 (3 layers)" in summary
    assert "other units: lm_head, transformer/ln_f, transformer/wte" in summary
    # the same rule as a units= callable to start from
    base = vj.default_units(tree)
    again = vj.plan(tree, make_mesh(2), units=lambda p, x: "norms" if len(x.shape) == 1 else base(p, x))
    assert {b.unit for b in again.buckets} == {
        "norms",
        "lm_head",
        "transformer/wte",
        "transformer/h/0",
        "transformer/h/1",
        "transformer/h/2",
    }
    # a list of NNX-style layers at the top; a tree without repeated modules keeps one unit per top-level module
    listed = {"embed": f(10, 4), "layers": [{"w": f(4, 4)}, {"w": f(4, 4)}]}
    assert {b.unit for b in vj.plan(listed, make_mesh(2)).buckets} == {"embed", "layers/0", "layers/1"}
    flat = {"embed": {"w": f(10, 4)}, "mlp": {"a": f(4, 4), "b": f(4)}}
    assert {b.unit for b in vj.plan(flat, make_mesh(2)).buckets} == {"embed", "mlp"}
    assert "units:" not in vj.plan(flat, make_mesh(2)).summary()
    with pytest.raises(KeyError, match="not a leaf path"):
        base((jax.tree_util.DictKey("nope"),), f(1))
