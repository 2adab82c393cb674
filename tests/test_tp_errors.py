"""vj.plan(..., tp=): where the specs come from (vj.flax.partition_specs, tp="sharding", a callable) and how bad
inputs fail: every error names the leaf (or the argument) and says what to do."""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import vescale_jax as vj

S = jax.ShapeDtypeStruct
f32 = np.float32


@pytest.fixture
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    return jax.make_mesh((2, 4), ("fsdp", "tensor"), devices=jax.devices()[:8])


def shapes():
    return {"w": S((12, 16), f32), "b": S((10,), f32), "blocks": {"w": S((3, 8, 8), f32)}}


def units(path, leaf):
    return "blocks" if vj.plan_path(path).startswith("blocks") else "top"


def specs(**over):
    base = {"w": None, "b": None, "blocks": {"w": None}}
    for k, v in over.items():
        if k == "blocks_w":
            base["blocks"]["w"] = v
        else:
            base[k] = v
    return base


def plan_of(mesh, tp, tree=None):
    return vj.plan(shapes() if tree is None else tree, mesh, tp=tp, units=units, stacked=("blocks",))


# ------------------------------------------------------------------------------------------------ bad tp specs
BAD_SPECS = {
    "unknown_axis": (specs(w=P(None, "bogus")), ValueError, ["'w'", "'bogus'", "('fsdp', 'tensor')"]),
    "axis_twice": (specs(w=P("tensor", "tensor")), ValueError, ["'w'", "(12, 16)", "'tensor' twice", "name it once"]),
    "axis_twice_across_fsdp": (specs(w=P("fsdp", ("tensor", "fsdp"))), ValueError, ["'w'", "'fsdp' twice"]),
    "not_divisible": (specs(b=P("tensor")), ValueError, ["'b'", "(10,)", "dim 0", "not a multiple of"]),
    "too_long": (specs(w=P(None, None, "tensor")), ValueError, ["'w'", "(12, 16)", "names 3 dims"]),
    "layer_dim": (specs(blocks_w=P("tensor")), ValueError, ["'blocks/w'", "stacked layer group", "layer dim"]),
    "wrong_leaf_type": (specs(w=3), TypeError, ["'w'", "PartitionSpec"]),
    "tuple_not_spec": (specs(w=("tensor", None)), ValueError, ["'w'", "tuple or list", "P(...)"]),
    "missing_leaf": ({"w": None, "b": None}, ValueError, ["'blocks/w'", "params' structure"]),
    "extra_leaf": (specs() | {"c": None}, ValueError, ["'c'", "no params leaf"]),
    "int": (5, TypeError, ["tp= is int 5", "callable"]),
    "one_spec": (P("tensor"), TypeError, ["one PartitionSpec", "callable"]),
    "bad_string": ("shardings", ValueError, ["'shardings'", "'sharding'"]),
    "callable_bad_value": (lambda path, leaf: 1.5, TypeError, ["PartitionSpec"]),
    "callable_bad_axis": (
        lambda path, leaf: P("expert") if leaf.ndim == 1 else None,
        ValueError,
        ["'b'", "'expert'"],
    ),
    "callable_signature": (lambda path: None, TypeError, ["tp=", "(key_path, leaf)"]),
}


@pytest.mark.parametrize("case", list(BAD_SPECS))
def test_bad_tp_raises_naming_the_leaf(mesh, case):
    tp, error, parts = BAD_SPECS[case]
    with pytest.raises(error) as info:
        plan_of(mesh, tp)
    for part in parts:
        assert part in str(info.value), (case, part, str(info.value))


def test_not_divisible_names_the_dim_of_a_3d_leaf(mesh):
    tree = {"x": S((4, 6, 10), f32)}
    with pytest.raises(ValueError, match=re.escape("dim 2 (10)")) as info:
        vj.plan(tree, mesh, tp={"x": P(None, None, "tensor")})
    assert "'x'" in str(info.value) and "tensor" in str(info.value)


def test_a_one_array_tree_takes_one_spec(mesh):
    plan = vj.plan(S((12, 16), f32), mesh, tp=P(None, "tensor"))
    assert plan.leaves[0].tp == ((), ("tensor",))


# ------------------------------------------------------------------------------------ the fsdp axis is ignored
def test_spec_naming_the_fsdp_axis_is_ignored_for_the_fsdp_part(mesh):
    maxtext = plan_of(mesh, specs(w=P("fsdp", "tensor"), b=P("fsdp"), blocks_w=P(None, "fsdp")))
    plain = plan_of(mesh, specs(w=P(None, "tensor")))
    assert maxtext == plain
    assert maxtext.leaf("w").tp == ((), ("tensor",)) and maxtext.leaf("b").tp == ()
    assert maxtext.leaf("blocks/w").tp == ()
    # one dim over both axes: the tensor part stays
    assert plan_of(mesh, specs(w=P(("fsdp", "tensor")))) == plan_of(mesh, specs(w=P("tensor")))


# --------------------------------------------------------------------------------------------------- NNX specs
class Annotated(nnx.Module):
    """A column / row-parallel MLP annotated with nnx.with_partitioning, a replicated norm and embedding."""

    def __init__(self, rngs: nnx.Rngs, *, fsdp_too: bool = False):
        init = nnx.initializers.lecun_normal()
        col = ("fsdp", "tensor") if fsdp_too else (None, "tensor")
        self.embed = nnx.Embed(10, 16, rngs=rngs)
        self.up = nnx.Linear(
            16,
            32,
            kernel_init=nnx.with_partitioning(init, col),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("tensor",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(32, 16, kernel_init=nnx.with_partitioning(init, ("tensor", None)), rngs=rngs)
        self.ln = nnx.LayerNorm(16, rngs=rngs)


def explicit(path, leaf):
    name = vj.plan_path(path)
    return {"up/kernel": P(None, "tensor"), "up/bias": P("tensor"), "down/kernel": P("tensor", None)}.get(name)


@pytest.mark.parametrize("fsdp_too", [False, True], ids=["tensor", "fsdp_and_tensor"])
def test_nnx_partition_specs_and_sharding_give_the_explicit_plan(mesh, fsdp_too):
    with jax.set_mesh(mesh):
        state = nnx.split(nnx.eval_shape(lambda: Annotated(nnx.Rngs(0), fsdp_too=fsdp_too)))[1]
    want = vj.plan(state, mesh, tp=explicit)
    assert want.leaf("up/kernel").tp == ((), ("tensor",)) and want.leaf("embed/embedding").tp == ()
    assert vj.plan(state, mesh, tp=vj.flax.partition_specs(state)) == want
    assert vj.plan(state, mesh, tp="sharding") == want
    assert vj.plan(state, mesh, tp=nnx.get_partition_spec(state)) == want


def test_nnx_partition_specs_of_a_real_model_shard_and_unshard(mesh):
    with jax.set_mesh(mesh):
        model = Annotated(nnx.Rngs(0))
    state = nnx.split(model)[1]
    plan = vj.plan(state, mesh, tp=vj.flax.partition_specs(state))
    assert plan == vj.plan(state, mesh, tp=explicit)
    host = jax.tree.map(np.asarray, state)
    back = vj.unshard(vj.shard(host, plan))
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(host), strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_nnx_logical_names_in_metadata_map_through_rules(mesh):
    """Variables not placed on a mesh: their out_sharding metadata, logical names mapped by the rules."""
    state = nnx.State(
        {
            "w": nnx.Param(np.zeros((12, 16), f32), out_sharding=("embed", "mlp"), eager_sharding=False),
            "b": nnx.Param(np.zeros((16,), f32), out_sharding=("mlp",), eager_sharding=False),
            "n": nnx.Param(np.zeros((5,), f32)),
        }
    )
    tp = vj.flax.partition_specs(state, rules=(("embed", "fsdp"), ("mlp", "tensor")))
    plan = vj.plan(state, mesh, tp=tp)
    assert (plan.leaf("w").tp, plan.leaf("b").tp, plan.leaf("n").tp) == (((), ("tensor",)), (("tensor",),), ())
    with pytest.raises(ValueError, match=r"leaf 'b'.*'mlp'"):
        vj.plan(state, mesh, tp=vj.flax.partition_specs(state))  # no rules: the logical names reach vj.plan


class StackedBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tensor"))
        self.up = nnx.Linear(16, 32, kernel_init=init, rngs=rngs)


class Stacked(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> StackedBlock:
            return StackedBlock(rngs)

        self.blocks = stack(rngs)


def test_nnx_partition_specs_of_a_vmapped_layer_group_split_the_right_dim(mesh):
    with jax.set_mesh(mesh):
        state = nnx.split(nnx.eval_shape(lambda: Stacked(nnx.Rngs(0))))[1]
    assert state["blocks"]["up"]["kernel"].get_metadata()["out_sharding"] == (None, "tensor")  # no layer dim
    plan = vj.plan(state, mesh, tp=vj.flax.partition_specs(state), stacked=("blocks",))
    assert plan.leaf("blocks/up/kernel").tp == ((), (), ("tensor",))
    assert plan == vj.plan(state, mesh, tp="sharding", stacked=("blocks",))


# ------------------------------------------------------------------------------------------------- Linen specs
class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")), name="up")(x)
        y = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")), name="down")(h)
        return nn.Dense(8, kernel_init=nn.with_partitioning(init, (None, "tensor")), name="head")(y)


RULES = (("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "tensor"))


def test_linen_logical_partitioning_with_rules(mesh):
    variables = jax.eval_shape(LinenMLP().init, jax.random.key(0), jnp.ones((2, 16)))
    tp = vj.flax.partition_specs(variables, rules=RULES)
    assert tp["params"]["up"]["kernel"] == P("fsdp", "tensor") and tp["params"]["up"]["bias"] is None
    for tree in (variables, nn.unbox(variables)):  # the boxed tree and the unboxed one plan alike
        plan = vj.plan(tree, mesh, tp=tp)
        assert plan.leaf("params/up/kernel").tp == ((), ("tensor",))  # "embed" -> fsdp: dropped
        assert plan.leaf("params/down/kernel").tp == (("tensor",), ())
        assert plan.leaf("params/head/kernel").tp == ((), ("tensor",))
        assert plan.leaf("params/up/bias").tp == ()
    # the rules of the nn.logical_axis_rules context, as Flax reads them
    with nn.logical_axis_rules(RULES):
        assert vj.flax.partition_specs(variables) == tp


def test_linen_logical_names_without_rules_raise_in_plan(mesh):
    variables = jax.eval_shape(LinenMLP().init, jax.random.key(0), jnp.ones((2, 16)))
    tp = vj.flax.partition_specs(variables)
    assert tp["params"]["up"]["kernel"] == P("embed", "mlp")
    with pytest.raises(ValueError, match=r"'params/down/kernel'.*'mlp'"):
        vj.plan(nn.unbox(variables), mesh, tp=tp)


def test_partition_specs_of_a_tree_without_leaves_raises():
    with pytest.raises(TypeError, match="no array leaves"):
        vj.flax.partition_specs({})
