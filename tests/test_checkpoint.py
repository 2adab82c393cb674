"""vj.checkpoint: logical storage through Orbax, restore into any plan, interop with plain Orbax, faults."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import make_mesh
from flax import nnx
from helpers import ROOT, GPTConfig, abstract_model, assert_trees_equal, child_pythonpath, init_params
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
from vescale_jax.checkpoint import _integrity as _integrity
from vescale_jax.relayout import _logical_leaves as _logical
from vescale_jax.state._sharded import PerDevice
from vescale_jax.testing import census, memory


def tree_of(seed: int = 0):
    """Leaves that exercise every case: indivisible dims, a scalar, an empty leaf, a stacked group (numpy: no
    compiles)."""
    rng = np.random.default_rng(seed)
    f32 = lambda *shape: rng.standard_normal(shape, np.float32)
    return {
        "embed": f32(50, 12),
        "bias": f32(3),
        "blocks": {"w": f32(2, 6, 10), "v": f32(2, 5)},
        "head": f32(12, 7).astype(jnp.bfloat16),
        "scale": np.asarray(1.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
    }


def plan_of(tree, m, granularity=None, mesh=None, axis="fsdp"):
    """Two units (the stacked group and the rest): three buckets with the bf16 leaf, few compiles."""
    mesh = make_mesh(m) if mesh is None else mesh
    units = lambda path, leaf: "blocks" if vj.plan_path(path).startswith("blocks") else "top"
    stacked = ("blocks",) if "blocks" in tree else ()
    return vj.plan(tree, mesh, axis=axis, stacked=stacked, granularity=granularity, units=units)


def host_shard(tree, plan):
    """``vj.shard`` by numpy on the host (an independent reference, and no compile)."""
    leaves = [np.asarray(x) for x in jax.tree.leaves(tree)]
    buffers = []
    for bucket, sharding in zip(plan.buckets, plan.shardings(), strict=True):
        lead = () if bucket.layers is None else (bucket.layers,)
        buf = np.zeros(
            (*lead, bucket.layout.total_size), leaves[bucket.leaves[0]].dtype if bucket.leaves else np.float32
        )
        for slot, i in enumerate(bucket.leaves):
            o, n = bucket.layout.offsets[slot], bucket.layout.sizes[slot]
            buf[..., o : o + n] = leaves[i].reshape(*lead, n)
        buffers.append(jax.device_put(buf, sharding))
    return vj.ShardedParams(buffers, plan)


def host_unshard(sp):
    """``vj.unshard`` by numpy slicing of the fetched global buffers."""
    plan, out = sp.plan, [None] * len(sp.plan.leaves)
    for bucket, buf in zip(plan.buckets, sp.buffers, strict=True):
        full = np.asarray(buf)
        for slot, i in enumerate(bucket.leaves):
            o, n = bucket.layout.offsets[slot], bucket.layout.sizes[slot]
            out[i] = full[..., o : o + n].reshape(plan.leaves[i].shape)
    return jax.tree_util.tree_unflatten(plan.treedef, out)


def trained_state(tree, plan, tx):
    """Params and an Adam state whose moments and count are non-zero (distinct values per leaf and moment)."""
    sp = host_shard(tree, plan)
    adam, *rest = vj.init_opt_state(tx, sp)
    mu, nu = (host_shard(tree_of(seed), plan) for seed in (1, 2))
    return sp, (adam._replace(count=jnp.asarray(3, jnp.int32), mu=mu, nu=nu), *rest)


# ------------------------------------------------------------------------------------------------ conversion
@pytest.mark.parametrize("m", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_to_logical_is_one_all_to_all_per_leaf_and_never_gathers(m):
    tree = tree_of()
    plan = plan_of(tree, m, vj.rows(2))
    sp = host_shard(tree, plan)
    # Compile each direction once, inspect it, and run that executable (what to_logical / from_logical call).
    fn, in_shardings = _logical._to_logical_fn(plan)
    out = fn.lower(*[_logical._relabel(b, s) for b, s in zip(sp.buffers, in_shardings, strict=True)]).compile()
    leaves, sums = out(*[_logical._relabel(b, s) for b, s in zip(sp.buffers, in_shardings, strict=True)])
    assert_trees_equal(jax.tree_util.tree_unflatten(plan.treedef, leaves), tree)
    want = _integrity.checksums(tree)  # the in-kernel checksums are those of the whole logical leaves
    assert [list(map(int, r)) for r in np.asarray(sums)] == [
        want[_integrity.raw_path(p)] for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]
    for leaf, sh in zip(leaves, _logical.logical_shardings(plan), strict=True):
        assert leaf.sharding.is_equivalent_to(sh, leaf.ndim)
    fn, in_shardings = _logical._from_logical_fn(plan)
    back = fn.lower(*leaves).compile()
    bufs, back_sums = back(*leaves)
    np.testing.assert_array_equal(np.asarray(back_sums), np.asarray(sums))
    for x, y in zip(bufs, sp.buffers, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    nonempty = sum(1 for s in plan.leaves if s.size)
    layers = {i: b.layers or 1 for b in plan.buckets for i in b.leaves}
    stacked_launches = sum(layers[i] for i, s in enumerate(plan.leaves) if s.size)
    own = sum(b.nbytes for b in plan.buckets) // m  # what one device owns of the buckets
    for compiled in (out, back):
        ops = census(compiled)
        # One all-to-all per leaf and layer (stacked leaves one layer at a time), a static sequence: no
        # collective inside a loop (XLA:CPU's rendezvous intermittently aborts on one there).
        assert ops.count("all-gather") == 0 and ops.instructions("all-to-all") == stacked_launches > nonempty, ops
        assert ops.count("all-to-all") == stacked_launches and not any(op.in_loop for op in ops.ops), ops
        # Transient: the all-to-all buffers, never the whole tree (the model here is tiny: allow index tables).
        mem = memory(compiled)
        assert mem.temp <= 4 * own + 64 * 1024, mem


def test_storage_split_rule():
    plan = plan_of(jax.eval_shape(tree_of), 8)
    st = _logical.leaf_storage((50, 12), plan)
    assert (st.dim, st.g) == (1, 4)  # 12 = 4 * 3 shares 2 * 2 with 8; 50 only 2
    # A tie in g goes to the earlier dim (contiguous row blocks); before issue 42 the larger dim won it.
    assert (_logical.leaf_storage((16, 24), plan).dim, _logical.leaf_storage((16, 24), plan).g) == (0, 8)
    assert _logical.leaf_storage((16, 24), plan, earlier=False).dim == 1
    assert _logical.leaf_storage((2, 24), plan).dim == 1  # 2 splits only 2 ways: the dim split 8 ways wins
    assert _logical.leaf_storage((3, 5), plan).g == 1 and _logical.leaf_storage((), plan).dim is None
    plan6 = plan_of(jax.eval_shape(tree_of), 6) if len(jax.devices()) >= 6 else None
    if plan6 is not None:
        assert _logical.leaf_storage((9, 4), plan6).g == 2  # factors (2, 3): the prefix 2 divides 4


def _clear_conversions():
    for fn in (_logical._out_executables, _logical._in_executables, _logical._to_logical_fn, _logical._from_logical_fn):
        fn.cache_clear()


def test_checkpoint_written_under_the_former_split_rule_restores(tmp_path, monkeypatch):
    """A checkpoint whose (d, 3d)-like leaves were stored in column blocks (the split rule before issue 42: the
    larger dim on a tie) restores under the current rule (row blocks), into its plan and into another one."""
    rng = np.random.default_rng(5)
    tree = {
        "qkv": rng.standard_normal((16, 48), np.float32),
        "blocks": {"w": rng.standard_normal((2, 8, 32), np.float32)},
    }
    plan = plan_of(tree, 8)
    former = _logical.leaf_storage
    assert former((16, 48), plan, earlier=False).dim == 1 and former((16, 48), plan).dim == 0
    sp = host_shard(tree, plan)
    monkeypatch.setattr(_logical, "leaf_storage", lambda shape, plan, earlier=True: former(shape, plan, earlier=False))
    _clear_conversions()
    try:
        qkv = vj.checkpoint.logical_tree(sp)["qkv"]
        assert qkv.sharding.spec[0] is None and qkv.sharding.spec[1] is not None  # column blocks, as written then
        with vj.checkpoint.Manager(tmp_path / "ckpt") as mngr:
            mngr.save(1, params=sp)
            mngr.wait()
    finally:
        monkeypatch.undo()
        _clear_conversions()
    assert _logical.leaf_storage((16, 48), plan).dim == 0
    with vj.checkpoint.Manager(tmp_path / "ckpt") as mngr:
        for target in (plan, plan_of(tree, 3, vj.rows(2))):
            r = mngr.restore(params=target)
            assert r.params.plan == target
            assert_trees_equal(host_unshard(r.params), tree)


# ---------------------------------------------------------------------------------------- restore anywhere
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ((8, None), (3, vj.rows(2))),
        ((3, vj.rows(2)), (8, None)),
        pytest.param((1, None), (8, vj.whole()), marks=pytest.mark.slow),
        pytest.param((8, vj.rows(1)), (1, None), marks=pytest.mark.slow),
    ],
    ids=["8to3-element-to-rows2", "3to8", "1to8-whole", "8to1"],
)
def test_round_trip_into_another_plan_is_bitwise(tmp_path, src, dst):
    tree = tree_of()
    tx = optax.adamw(1e-2)
    src_plan, dst_plan = plan_of(tree, src[0], src[1]), plan_of(tree, dst[0], dst[1])
    sp, state = trained_state(tree, src_plan, tx)
    with vj.checkpoint.Manager(tmp_path / "ckpt") as mngr:
        mngr.save(7, params=sp, opt_state=state, metadata={"loader": {"pos": 3}})
        mngr.wait()
        target = jax.eval_shape(tx.init, host_shard(tree, dst_plan))
        r = mngr.restore(params=dst_plan, opt_state=target)
    assert r.step == 7 and r.metadata == {"loader": {"pos": 3}}
    assert r.params.plan == dst_plan and all(
        x.sharding == s for x, s in zip(r.params.buffers, dst_plan.shardings(), strict=True)
    )
    assert_trees_equal(host_unshard(r.params), host_unshard(sp))
    adam, adam_r = state[0], r.opt_state[0]
    assert int(adam_r.count) == int(adam.count) == 3
    assert_trees_equal(host_unshard(adam_r.mu), host_unshard(adam.mu))
    assert_trees_equal(host_unshard(adam_r.nu), host_unshard(adam.nu))
    for buf, bucket in zip(adam_r.mu.buffers, dst_plan.buckets, strict=True):  # padding is zero
        full = np.asarray(buf).reshape(-1, bucket.layout.total_size)
        used = np.zeros(bucket.layout.total_size, bool)
        for o, n in zip(bucket.layout.offsets, bucket.layout.sizes, strict=True):
            used[o : o + n] = True
        assert not np.any(full[:, ~used])


def test_round_trip_into_replica_by_fsdp_mesh_and_back(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    tree = tree_of(1)
    flat = plan_of(tree, 8)
    hsdp_mesh = jax.make_mesh((2, 4), ("replica", "fsdp"), devices=jax.devices()[:8])
    hsdp = plan_of(tree, 4, mesh=hsdp_mesh)
    sp = host_shard(tree, flat)
    mngr = vj.checkpoint.Manager(tmp_path)
    mngr.save(1, params=sp)
    r = mngr.restore(params=hsdp)
    assert r.params.buffers[0].sharding.spec == P("fsdp")
    assert_trees_equal(host_unshard(r.params), tree)
    mngr.save(2, params=r.params)
    assert_trees_equal(host_unshard(mngr.restore(2, params=flat).params), tree)
    mngr.close()


# -------------------------------------------------------------------------------------------- PerDevice
@dataclasses.dataclass(frozen=True)
class EvenChunks:
    """A test layout: a length-n vector kept as m equal (padded) chunks, device k holding chunk k."""

    plan: vj.Plan
    n: int

    @property
    def width(self) -> int:
        return -(-self.n // self.plan.num_devices)

    def to_logical(self, value):  # a test stand-in: replicates (a real layout moves only the owned blocks)
        return {"v": jax.device_put(value, NamedSharding(self.plan.mesh, P()))[: self.n], "n": jnp.asarray(self.n)}

    def logical_shapes(self, dtype=None):
        return {"v": jax.ShapeDtypeStruct((self.n,), jnp.float32), "n": jax.ShapeDtypeStruct((), jnp.int32)}

    def from_logical(self, arrays):
        m = self.plan.num_devices
        pad = jax.jit(
            lambda v: jnp.pad(v, (0, m * self.width - self.n)),
            out_shardings=NamedSharding(self.plan.mesh, P(self.plan.axis)),
        )
        return pad(arrays["v"])


def per_device(plan, n, *, layout: bool):
    lay = EvenChunks(plan, n)
    v = jnp.pad(jnp.arange(n, dtype=jnp.float32) + 0.5, (0, plan.num_devices * lay.width - n))
    v = jax.device_put(v, NamedSharding(plan.mesh, P(plan.axis)))
    return PerDevice(v, plan, lay if layout else None)


def test_per_device_state_with_a_layout_moves_to_another_plan(tmp_path):
    tree = tree_of()
    p8, p3 = plan_of(tree, 8), plan_of(tree, 3)
    sp = host_shard(tree, p8)
    state = {"stats": per_device(p8, 21, layout=True), "raw": per_device(p8, 5, layout=False)}
    mngr = vj.checkpoint.Manager(tmp_path)
    mngr.save(1, params=sp, opt_state=state)
    mngr.save(2, params=sp, opt_state={"stats": state["stats"]})
    # Identical plan: both restore, the raw one by device index.
    same = mngr.restore(1, params=p8, opt_state=state).opt_state
    np.testing.assert_array_equal(np.asarray(same["raw"].value), np.asarray(state["raw"].value))
    np.testing.assert_array_equal(np.asarray(same["stats"].value), np.asarray(state["stats"].value))
    # Another plan: the laid-out state is re-placed through its target's layout ...
    target = {"stats": per_device(p3, 21, layout=True), "raw": per_device(p3, 5, layout=False)}
    with pytest.raises(ValueError, match=r"'raw' is a PerDevice array without a layout.*restores only into the plan"):
        mngr.restore(1, params=p3, opt_state=target)
    r = mngr.restore(2, params=p3, opt_state={"stats": jax.eval_shape(lambda: target["stats"])})
    got = r.opt_state["stats"]
    assert got.layout == target["stats"].layout and got.value.shape == (21,)
    np.testing.assert_array_equal(np.asarray(got.value), np.arange(21, dtype=np.float32) + 0.5)
    assert got.value.sharding.spec == P("fsdp")
    mngr.close()


# ----------------------------------------------------------------------------------------------- interop
def small_gpt():
    cfg = GPTConfig(vocab=64, max_len=16, d_model=32, num_heads=2, num_layers=2, d_ff=64)
    graphdef, shapes = abstract_model(cfg)
    return cfg, graphdef, shapes


@pytest.mark.parametrize("train", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["moved", "trained"])
def test_plain_orbax_restores_vj_params_into_an_nnx_model(tmp_path, train):
    cfg, graphdef, shapes = small_gpt()
    plan = vj.plan(shapes, make_mesh(3), stacked=("blocks",))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (6, 16)), jnp.int32)
    if train:  # two vj.fsdp Adam steps
        sp = vj.init_sharded(lambda k: init_params(cfg, k), plan, jax.random.key(0))
        tx = optax.adam(1e-2)
        state = vj.init_opt_state(tx, sp)

        @vj.fsdp(plan=plan)
        def step(params, opt_state, batch):
            grads = jax.grad(lambda p: jnp.mean(vj.flax.nnx_apply(graphdef, p, batch) ** 2))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        with jax.numpy_dtype_promotion("standard"):
            for _ in range(2):
                sp, state = step(sp, state, tokens)
    else:  # parameters that are not an initialisation, written by numpy
        rng = np.random.default_rng(5)
        sp = host_shard(jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32) * 0.1, shapes), plan)
    want = vj.flax.nnx_apply(graphdef, sp, vj.place_batch(tokens, plan))
    with vj.checkpoint.Manager(tmp_path) as mngr:
        mngr.save(2, params=sp)
    # A user without vescale_jax: the step's `params` item is an ordinary NNX State checkpoint.
    abstract = nnx.state(nnx.eval_shape(lambda: nnx.merge(graphdef, shapes)))
    restored = ocp.StandardCheckpointer().restore(tmp_path / "2" / "params", abstract)
    model = nnx.merge(graphdef, restored)
    np.testing.assert_allclose(np.asarray(model(tokens)), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert_trees_equal(restored, host_unshard(sp))  # the parameters themselves: bitwise


def test_plain_orbax_restores_vj_params_into_linen(tmp_path):
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(5)(jax.nn.relu(nn.Dense(13)(x)))

    x = jax.random.normal(jax.random.key(2), (4, 7))
    variables = MLP().init(jax.random.key(3), x)
    plan = vj.plan(variables, make_mesh(3))
    sp = host_shard(variables, plan)
    with vj.checkpoint.Manager(tmp_path) as mngr:
        mngr.save(1, params=sp)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), variables)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "1" / "params", target)
    np.testing.assert_array_equal(np.asarray(MLP().apply(restored, x)), np.asarray(MLP().apply(variables, x)))


PLAIN_RECIPE = textwrap.dedent("""
    import json, os, sys
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[2]}"
    import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
    leaf = lambda spec: jax.ShapeDtypeStruct(tuple(spec[0]), jnp.dtype(spec[1]))
    abstract = jax.tree.map(leaf, json.loads(sys.argv[3]), is_leaf=lambda x: isinstance(x, list))
    # docs/checkpoint.md's recipe: every leaf of the target given the sharding to restore into.
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
    state = ocp.StandardCheckpointer().restore(sys.argv[1], abstract)
    words = lambda x: np.asarray(x).view(np.uint16 if np.asarray(x).dtype.itemsize == 2 else np.uint32)
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    np.savez(sys.argv[4], devices=jax.device_count(),
             **{"|".join(k.key for k in p): words(x) for p, x in flat})
""")


@pytest.mark.parametrize("m", [1, 3])
def test_plain_orbax_recipe_restores_an_8_device_checkpoint_on_m_devices(tmp_path, m):
    rng = np.random.default_rng(7)
    tree = {
        "embed": rng.standard_normal((50, 12), np.float32),
        "head": rng.standard_normal((12, 7), np.float32).astype(jnp.bfloat16),
        "blocks": {"w": rng.standard_normal((2, 6, 10), np.float32)},
    }
    plan = vj.plan(tree, make_mesh(8), stacked=("blocks",))
    with vj.checkpoint.Manager(tmp_path / "ckpt") as mngr:
        mngr.save(250, params=host_shard(tree, plan))
    specs = jax.tree.map(lambda x: [list(x.shape), np.dtype(x.dtype).name], tree)
    out = tmp_path / "restored.npz"
    run = subprocess.run(
        [sys.executable, "-c", PLAIN_RECIPE, str(tmp_path / "ckpt" / "250" / "params"), str(m), json.dumps(specs), out],
        env=child_pythonpath(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.load(out)
    assert int(got["devices"]) == m
    for path, want in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = "|".join(k.key for k in path)
        bits = np.asarray(want).view(np.uint16 if np.asarray(want).dtype.itemsize == 2 else np.uint32)
        np.testing.assert_array_equal(got[key], bits, err_msg=key)  # bitwise


def test_warm_start_from_a_plain_unsharded_flax_checkpoint(tmp_path):
    _, _, shapes = small_gpt()
    rng = np.random.default_rng(4)  # an ordinary, unsharded NNX State (numpy values)
    pretrained = jax.tree.map(lambda s: rng.standard_normal(s.shape, np.float32), shapes)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "pretrained", pretrained)
    ckptr.wait_until_finished()
    plan = vj.plan(shapes, make_mesh(3), stacked=("blocks",), granularity=vj.rows(1))
    sp = vj.checkpoint.restore_params(tmp_path / "pretrained", plan)
    assert sp.plan == plan
    assert_trees_equal(host_unshard(sp), pretrained)


# -------------------------------------------------------------------------------------------------- faults
@pytest.mark.parametrize("shapes", ["recorded", "orbax_metadata"])
def test_mismatched_tree_raises_naming_the_leaf(tmp_path, monkeypatch, shapes):
    """Checked against the shapes the save recorded in its description (Orbax's metadata is not read), and
    against Orbax's metadata for a checkpoint whose description has none (written by an earlier release)."""
    tree = tree_of()
    plan = plan_of(tree, 2)
    mngr = vj.checkpoint.Manager(tmp_path)
    opt = optax.sgd(0.1, momentum=0.9).init(host_shard(tree, plan))
    mngr.save(1, params=host_shard(tree, plan), opt_state=opt)
    if shapes == "recorded":
        assert set(mngr._description(1)["shapes"]) == {"params", "opt_state"}
        monkeypatch.setattr(mngr._mngr, "item_metadata", lambda step: pytest.fail("Orbax's metadata was read"))
    else:
        described = vj.checkpoint.Manager._description
        monkeypatch.setattr(
            vj.checkpoint.Manager,
            "_description",
            lambda self, step: {k: v for k, v in described(self, step).items() if k != "shapes"},
        )
    restored = mngr.restore(params=plan, opt_state=jax.eval_shape(lambda: opt))
    assert_trees_equal(host_unshard(restored.params), tree)
    renamed = {("head2" if k == "head" else k): v for k, v in tree.items()}
    with pytest.raises(
        ValueError,
        match=r"params leaf 'head2' \(shape \(12, 7\), bfloat16\) of the target is not "
        r"in the checkpoint; the checkpoint has \['head'\].*renamed",
    ):
        mngr.restore(params=plan_of(renamed, 2))
    wider = dict(tree, embed=jnp.zeros((50, 13)))
    with pytest.raises(
        ValueError,
        match=r"leaf 'embed' is stored with shape \(50, 12\) and dtype float32, but "
        r"the target expects shape \(50, 13\) and dtype float32\. Plan the target",
    ):
        mngr.restore(params=plan_of(wider, 2))
    cast = dict(tree, bias=tree["bias"].astype(jnp.bfloat16))
    with pytest.raises(
        ValueError,
        match=r"leaf 'bias' is stored with shape \(3,\) and dtype float32, but the "
        r"target expects shape \(3,\) and dtype bfloat16",
    ):
        mngr.restore(params=plan_of(cast, 2))
    missing = {k: v for k, v in tree.items() if k != "bias"}
    with pytest.raises(ValueError, match=r"checkpoint's params leaf 'bias' \(shape \(3,\), float32\) has no place"):
        mngr.restore(params=plan_of(missing, 2))
    adam = jax.eval_shape(optax.adam(0.1).init, host_shard(tree, plan))
    with pytest.raises(
        ValueError,
        match=r"optimizer-state leaf '0/count' of the target template is not in the "
        r"checkpoint",
    ):
        mngr.restore(params=plan, opt_state=adam)
    mngr.close()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_corrupt_or_truncated_file_raises(tmp_path, damage):
    tree = {"w": jax.random.normal(jax.random.key(0), (256, 64)), "b": jnp.arange(64.0)}
    plan = plan_of(tree, 2)
    mngr = vj.checkpoint.Manager(tmp_path)
    mngr.save(1, params=host_shard(tree, plan))
    assert_trees_equal(host_unshard(mngr.restore(params=plan).params), tree)
    files = sorted(glob.glob(str(tmp_path / "1" / "params" / "ocdbt.process_*" / "d" / "*")), key=os.path.getsize)
    path = files[-1]  # the largest data file: it holds array chunks
    data = bytearray(open(path, "rb").read())
    if damage == "delete":
        os.remove(path)
    else:
        if damage == "truncate":
            data = data[: len(data) // 2]
        else:
            for i in range(len(data) // 3, len(data) // 3 + 16):
                data[i] ^= 0x5A
        with open(path, "wb") as f:
            f.write(bytes(data))
    with pytest.raises(ValueError, match="corrupt"):
        mngr.restore(params=plan)
    mngr.close()


def _damaged_step(tmp_path):
    """A saved step whose only leaves big enough for a data file (not inlined in the index) are ``w/k``'s."""
    tree = {"w": {"k": jax.random.normal(jax.random.key(0), (256, 64))}, "b": jnp.arange(64.0)}
    plan = plan_of(tree, 2)
    sp = host_shard(tree, plan)
    opt_state = vj.init_opt_state(optax.adam(0.1), sp)
    rng = np.random.default_rng(1)
    mu, nu = (host_shard(jax.tree.map(lambda x: rng.standard_normal(x.shape, np.float32), tree), plan) for _ in "mn")
    opt_state = (opt_state[0]._replace(mu=mu, nu=nu), *opt_state[1:])
    mngr = vj.checkpoint.Manager(tmp_path)
    mngr.save(1, params=sp, opt_state=opt_state)
    return mngr, plan, opt_state


@pytest.mark.parametrize(
    "item, damage",
    [("params", "truncate"), ("params", "delete"), ("opt_state", "truncate"), ("params", "manifest.ocdbt")],
)
def test_truncated_or_missing_file_names_the_leaf_and_the_file(tmp_path, item, damage):
    mngr, plan, opt_state = _damaged_step(tmp_path)
    item_dir = tmp_path / "1" / item
    if damage in ("truncate", "delete"):
        path = max(glob.glob(str(item_dir / "ocdbt.process_*" / "d" / "*")), key=os.path.getsize)
        data = open(path, "rb").read()
        if damage == "delete":
            os.remove(path)
        else:
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
        leaf = r"params leaf 'w/k' \(chunk \d+\.0\)" if item == "params" else r"opt_state leaf '0/(mu|nu)/w/k'"
        why = "missing" if damage == "delete" else rf"{len(data) // 2} bytes, needs \d+"
    else:  # the item's index of its data files
        path = str(item_dir / damage)
        os.remove(path)
        leaf, why = r"params leaf '(b|w/k)' \(its array metadata\)", "missing"
    with pytest.raises(ValueError) as info:
        mngr.restore(params=plan, opt_state=opt_state)
    message = str(info.value)
    assert re.search(rf"reading step 1 at {re.escape(str(tmp_path / '1'))} failed: {leaf}", message), message
    assert re.search(rf"file {re.escape(path)} \((bytes \d+\.\.\d+; )?{why}", message), message
    assert "restore another step (Manager.all_steps())" in message and "bound method" not in message, message
    if item == "params" and damage == "truncate":  # the one-shot reader says the same
        with pytest.raises(ValueError, match=rf"params leaf 'w/k' \(chunk \d+\.0\) in file {re.escape(path)}"):
            vj.checkpoint.restore_params(item_dir, plan)
    mngr.close()


@pytest.mark.parametrize("part", ["_METADATA", "item", "vescale_jax"])
def test_missing_item_or_metadata_names_the_file(tmp_path, part):
    mngr, plan, _ = _damaged_step(tmp_path)
    step = tmp_path / "1"
    if part == "vescale_jax":
        shutil.rmtree(step / "vescale_jax")
        match = rf"step 1 in .* has no readable description {re.escape(str(step / 'vescale_jax'))}.*another step"
    elif part == "item":
        shutil.rmtree(step / "params")
        match = rf"params item cannot be read: its directory {re.escape(str(step / 'params'))} is missing"
    else:
        os.remove(step / "params" / "_METADATA")
        match = rf"params item cannot be read: its metadata file {re.escape(str(step / 'params' / '_METADATA'))} is"
    with pytest.raises(ValueError, match=match):
        mngr.restore(params=plan)
    mngr.close()


@pytest.mark.parametrize("how", ["standard", "pytree", "opt_state"])
def test_plain_orbax_on_sharded_params_points_at_vj_checkpoint(tmp_path, how):
    tree = {"w": np.arange(48.0, dtype=np.float32).reshape(8, 6), "b": np.ones(6, np.float32)}
    plan = plan_of(tree, 2)
    sp = host_shard(tree, plan)
    match = r"orbax\.checkpoint was given a vj\.ShardedParams.*not the model's leaves.*vj\.checkpoint\.Manager"
    with pytest.raises(vj.PerLeafOnBucketsError, match=match) as info:
        if how == "standard":
            ocp.StandardCheckpointer().save(tmp_path / "a", sp)
        elif how == "pytree":
            ocp.PyTreeCheckpointer().save(tmp_path / "a", sp)
        else:
            ocp.StandardCheckpointer().save(tmp_path / "a", {"opt": vj.init_opt_state(optax.adam(0.1), sp)})
    message = str(info.value)
    assert "vj.checkpoint.logical_tree(params)" in message and "vj.unshard(params)" in message, message
    assert "mask" not in message, message  # not the message for optax's per-leaf masks
    # The per-leaf guard keeps its own message where optax maps a mask.
    with pytest.raises(vj.PerLeafOnBucketsError, match=r"optax\.masked.*vj\.optim"):
        optax.masked(optax.sgd(0.1), lambda t: jax.tree.map(lambda x: x.ndim > 1, t)).init(sp)


KILL_MID_SAVE = textwrap.dedent("""
    import os, signal, sys, threading, time
    import jax, jax.numpy as jnp
    import vescale_jax as vj
    root = sys.argv[1]
    mesh = jax.make_mesh((2,), ("fsdp",))
    tree = {"w": jnp.arange(2 ** 22, dtype=jnp.float32).reshape(2048, 2048), "b": jnp.ones(16)}
    plan = vj.plan(tree, mesh)
    mngr = vj.checkpoint.Manager(root, async_save=True)
    mngr.save(1, params=vj.shard(tree, plan))
    mngr.wait()
    def killer():  # SIGKILL as soon as step 2's temporary directory exists, while its files are written
        while not any(".orbax-checkpoint-tmp" in d for d in os.listdir(root)):
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=killer, daemon=True).start()
    mngr.save(2, params=vj.shard(jax.tree.map(lambda x: x + 1, tree), plan))
    mngr.wait()
    print("finished step 2 before the kill")
""")


def test_sigkill_mid_save_keeps_the_previous_checkpoint(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", KILL_MID_SAVE, str(tmp_path)], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr[-2000:])
    assert any(".orbax-checkpoint-tmp" in d for d in os.listdir(tmp_path))  # the partial step is left behind
    tree = {"w": jnp.arange(2**22, dtype=jnp.float32).reshape(2048, 2048), "b": jnp.ones(16)}
    plan = plan_of(tree, 2)
    mngr = vj.checkpoint.Manager(tmp_path)
    assert mngr.latest_step() == 1 and mngr.all_steps() == [1]
    assert_trees_equal(host_unshard(mngr.restore(params=plan).params), tree)
    mngr.save(2, params=host_shard(tree, plan))  # and saving that step again works
    assert mngr.all_steps() == [1, 2]
    mngr.close()


def test_manager_keeps_max_to_keep_and_async_save_finishes(tmp_path):
    tree = tree_of()
    plan = plan_of(tree, 2)
    sp = host_shard(tree, plan)
    mngr = vj.checkpoint.Manager(tmp_path, max_to_keep=2, async_save=True)
    for step in (10, 20, 30):
        assert mngr.save(step, params=sp, metadata={"step": step})
    mngr.wait()
    assert mngr.all_steps() == [20, 30] and mngr.latest_step() == 30
    assert mngr.metadata() == {"step": 30} and mngr.saved_plan(20) == plan.to_dict()
    with pytest.raises(FileNotFoundError, match="no finished step 10"):
        mngr.restore(10, params=plan)
    with pytest.raises(ValueError, match="has no optimizer state"):
        mngr.restore(params=plan, opt_state=optax.sgd(0.1, momentum=0.9).init(sp))
    assert mngr.restore(params=None).params is None
    mngr.close()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_train_gpt_resume_gives_the_uninterrupted_losses(tmp_path, optimizer):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    small = [
        "--steps",
        "20",
        "--plot=",
        "--data-mb",
        "0.5",
        "--layers",
        "2",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--batch",
        "8",
        "--seq",
        "32",
        "--save-every",
        "5",
        "--optimizer",
        optimizer,
    ]
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]

    def run(name, *extra):
        out = tmp_path / f"{name}.json"
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), *small, *extra, "--log-json", str(out)],
            env=env,
            check=True,
            capture_output=True,
            timeout=1800,  # a hang guard: about a minute on a quiet machine
        )
        return json.loads(out.read_text())["train"]

    full = run("full")
    first = run("first", *ckpt, "--stop-after", "8")
    rest = run("rest", *ckpt, "--resume")
    assert sorted(map(int, first)) == list(range(1, 9)) and sorted(map(int, rest)) == list(range(9, 21))
    assert {**first, **rest} == full  # bitwise: same device count, same programs


@pytest.mark.parametrize("named", [True, False], ids=["target", "no_target"])
def test_a_leaf_orbax_names_with_dots_is_named_with_slashes(tmp_path, named):
    """Orbax's error names a leaf 'w.k' (keys joined with '.'); the message names it 'w/k', from the restore
    target where one is at hand, else by the separator (the metadata read, before the targets are built)."""
    from vescale_jax.checkpoint import _read_errors

    item = tmp_path / "params"
    error = ValueError(f'NOT_FOUND: Metadata at "w.k/.zarray" in OCDBT database at local file "{item}/" does not exist')
    trees = {"params": {"b": jnp.zeros(3), "w": {"k": jnp.zeros((2, 2))}}} if named else {}
    text = _read_errors.describe(error, trees)
    assert text is not None and text.startswith("params leaf 'w/k' (its array metadata)"), text
