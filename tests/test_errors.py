"""Ordinary mistakes fail early, with a message naming the key path / index, the offending value and the fix.

One catalogue: each case is a thunk, the exception type and the fragments its message must contain (what is
wrong, where, the value, what to do). Every case is cheap: nothing here compiles a real train step.
"""

import dataclasses
import re
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx

import vescale_jax as vj
from vescale_jax.kernels import pack, pack_reference, unpack_reference
from vescale_jax.layout._bucket_layout import BucketLayout


def tree():
    return {"a": {"b": jnp.ones((5,)), "w": jnp.ones((3, 5))}, "c": {"w": jnp.ones((5, 2))}}


@dataclasses.dataclass(frozen=True)
class World:
    mesh: jax.sharding.Mesh
    plan: vj.Plan
    sp: vj.ShardedParams
    batch: jax.Array  # placed, (4, 3)


@pytest.fixture(scope="module")
def w():
    mesh = make_mesh(2)
    plan = vj.plan(tree(), mesh)
    sp = vj.shard(tree(), plan)
    return World(mesh, plan, sp, vj.place_batch(np.ones((4, 3), np.float32), plan))


def model(t, x):
    return x @ t["a"]["w"] @ t["c"]["w"]


def loss(p, x):
    return jnp.mean(vj.apply(model, p, x))


SGD = optax.sgd(0.1)


def train_step(ret, tx=SGD):
    """A vj.fsdp step whose return value is ``ret(params, opt_state, loss)``."""

    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return ret(optax.apply_updates(params, updates), opt_state, value)

    return step


def other_devices(w):
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs 4 devices")
    return vj.plan(tree(), jax.make_mesh((2,), ("fsdp",), axis_types=w.mesh.axis_types, devices=devices[2:4]))


def fsdp_call(w, ret, *, opt_state=None, batch=None, tx=SGD, **kw):
    step = vj.fsdp(train_step(ret, tx), plan=w.plan, **kw)
    sp = vj.shard(tree(), w.plan)  # fresh: donated steps must not eat the fixture's
    state = vj.init_opt_state(tx, sp) if opt_state is None else opt_state
    return step(sp, state(sp) if callable(state) else state, w.batch if batch is None else batch)


def stacked_world(w, **scan):
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.ln = nnx.LayerNorm(4, rngs=rngs)
            self.lin = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return x + self.lin(self.ln(x))

    class Model(nnx.Module):
        def __init__(self):
            make = nnx.vmap(lambda key: Block(nnx.Rngs(key)), in_axes=0, out_axes=0)
            self.blocks = make(jax.random.split(jax.random.key(0), 3))

        def __call__(self, x):
            return nnx.scan(lambda b, x: b(x), in_axes=(0, nnx.Carry), out_axes=nnx.Carry, **scan)(self.blocks, x)

    graphdef, state = nnx.split(Model())
    plan = vj.plan(state, w.mesh, stacked=("blocks",))
    return graphdef, vj.shard(state, plan), vj.place_batch(np.ones((4, 4), np.float32), plan)


def nnx_scan_case(w):  # an nnx.scan over the stacked group runs as vj.scan_layers, but not in reverse
    graphdef, sp, x = stacked_world(w, reverse=True)
    return vj.flax.nnx_apply(graphdef, sp, x)


def lax_scan_case(w):  # a per-layer floating-point output of a scan over the stacked group
    _, sp, x = stacked_world(w)
    return vj.apply(lambda t, x: jax.lax.scan(lambda c, p: (c @ p["lin"]["kernel"], c), x, t["blocks"])[0], sp, x)


def stacked_index_case(w):
    _, sp, x = stacked_world(w)
    return vj.apply(lambda t, x: x @ t["blocks"]["lin"]["kernel"][0], sp, x)


def int_leaf_grad(w):
    params = {**tree(), "step": jnp.zeros((3,), jnp.int32)}
    plan = vj.plan(params, w.mesh)

    @vj.fsdp(plan=plan, donate=False)
    def grads(p, _, x):
        return jax.grad(lambda p: jnp.mean(vj.apply(model, p, x)))(p)

    return grads(vj.shard(params, plan), None, np.ones((4, 3), np.float32))


def accumulate_case(micro, *, batch_shape=(8, 3), leaf2=(2, 4, 3)):
    def run(w):
        step = vj.fsdp(lambda p, o, b: vj.accumulate(loss, p, b["x"]), plan=w.plan, microbatches=micro, donate=False)
        return step(w.sp, None, {"x": np.ones(batch_shape, np.float32)})

    return run


def bad_layout():
    # Slot 1 ends at 10, past a buffer of 2 x 4 = 8 elements.
    return BucketLayout(sizes=(4, 4), blocks=(1, 1), offsets=(0, 6), shard_size=4, num_devices=2)


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[World], object]
    exc: type
    fragments: tuple[str, ...]  # regexes: where (path / index), the value, the fix


CASES = [
    # --- the tree against the plan ---------------------------------------------------------------------------
    Case(
        "extra_leaf",
        lambda w: vj.shard({**tree(), "d": {"w": jnp.ones(2)}}, w.plan),
        ValueError,
        ("extra", r"'d/w'", r"4 leaves, the plan has 3", "re-run vj.plan"),
    ),
    Case(
        "missing_leaf",
        lambda w: vj.shard({"a": {"w": jnp.ones((3, 5))}, "c": {"w": jnp.ones((5, 2))}}, w.plan),
        ValueError,
        ("missing", r"'a/b'", r"2 leaves, the plan has 3", "re-run vj.plan"),
    ),
    Case(
        "renamed_leaf",
        lambda w: vj.shard({"a": {"bias": jnp.ones(5), "w": jnp.ones((3, 5))}, "c": {"w": jnp.ones((5, 2))}}, w.plan),
        ValueError,
        ("renamed", r"'a/b' -> 'a/bias'", "re-run vj.plan"),
    ),
    Case(
        "init_fn_extra_leaf",
        lambda w: vj.init_sharded(lambda: {**tree(), "z": jnp.ones(3)}, w.plan),
        ValueError,
        ("init_fn output", "extra", r"'z'"),
    ),
    Case(
        "shard_abstract_leaves",
        lambda w: vj.shard(jax.eval_shape(tree), w.plan),
        TypeError,
        ("'a/b'", "ShapeDtypeStruct", r"\(5,\) float32", r"vj\.init_sharded\(init_fn, plan, key\)"),
    ),
    Case(
        "shard_already_sharded",
        lambda w: vj.shard(w.sp, w.plan),
        TypeError,
        ("already a vj.ShardedParams", "pass them as they are"),
    ),
    Case(
        "shard_swapped_args",
        lambda w: vj.shard(w.plan, tree()),
        TypeError,
        ("expected a vj.Plan", "dict", r"\(params, plan\)"),
    ),
    Case(
        "params_other_devices",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan)(vj.shard(tree(), other_devices(w)), None, w.batch),
        ValueError,
        ("another plan", r"devices \[2, 3\] vs .* devices \[0, 1\]", "re-shard"),
    ),
    Case(
        "opt_state_other_plan",
        lambda w: fsdp_call(
            w,
            lambda p, o, v: (p, o, v),
            tx=optax.adam(1e-3),
            opt_state=lambda sp: vj.init_opt_state(
                optax.adam(1e-3), vj.shard(tree(), vj.plan(tree(), w.mesh, granularity=vj.whole()))
            ),
        ),
        ValueError,
        (r"opt_state\[0\]\.mu", "another plan", r"'a/b'.*whole\(\)", r"vj\.init_opt_state\(tx, params\)"),
    ),
    Case(
        "opt_state_other_devices",
        lambda w: fsdp_call(
            w,
            lambda p, o, v: (p, o, v),
            tx=optax.adam(1e-3),
            opt_state=lambda sp: vj.init_opt_state(optax.adam(1e-3), vj.shard(tree(), other_devices(w))),
        ),
        ValueError,
        (r"opt_state\[0\]\.mu", r"devices \[2, 3\]", "vj.init_opt_state"),
    ),
    Case(
        "opt_state_of_the_logical_tree",
        lambda w: fsdp_call(
            w, lambda p, o, v: (p, o, v), tx=optax.adam(1e-3), opt_state=lambda sp: optax.adam(1e-3).init(tree())
        ),
        ValueError,
        (r"opt_state\[0\]\.mu", "logical parameter tree", r"vj\.init_opt_state\(tx, params\)"),
    ),
    # --- vj.plan arguments -------------------------------------------------------------------------------------
    Case(
        "stacked_typo",
        lambda w: vj.plan(tree(), w.mesh, stacked=("aa",)),
        ValueError,
        (r"stacked=\('aa',\)", r"'aa'", r"units are \['a', 'c'\]"),
    ),
    Case(
        "zero_layers",
        lambda w: vj.plan({"l": {"w": jnp.ones((0, 3, 3))}}, w.mesh, stacked=("l",)),
        ValueError,
        ("'l' has 0 layers", r"\['l'\]\['w'\]", r"\(0, 3, 3\)", "at least one layer"),
    ),
    Case(
        "float64_x64_off",
        lambda w: vj.plan({"a": np.ones(3)}, w.mesh),
        ValueError,
        (r"leaf \['a'\]", "float64", "jax_enable_x64 is off", r"astype\(jnp\.float32\)"),
    ),
    Case(
        "int64_x64_off",
        lambda w: vj.plan({"n": jax.ShapeDtypeStruct((3,), np.int64)}, w.mesh),
        ValueError,
        (r"leaf \['n'\]", "int64", r"astype\(jnp\.int32\)"),
    ),
    Case(
        "duplicate_axis",
        lambda w: vj.plan(tree(), w.mesh, axis=("fsdp", "fsdp")),
        ValueError,
        (r"axis=\('fsdp', 'fsdp'\)", "'fsdp' twice", r"axis=\('fsdp',\)"),
    ),
    Case("empty_axis", lambda w: vj.plan(tree(), w.mesh, axis=()), ValueError, (r"axis=\(\)", "axis='fsdp'")),
    Case(
        "rows_uncalled",
        lambda w: vj.plan(tree(), w.mesh, granularity=vj.rows),
        TypeError,
        ("function vj.rows", r"granularity=vj\.rows\(1\)"),
    ),
    Case(
        "element_uncalled",
        lambda w: vj.plan(tree(), w.mesh, granularity=vj.element),
        TypeError,
        ("function vj.element", r"vj\.element\(\)"),
    ),
    Case(
        "callable_returns_uncalled",
        lambda w: vj.plan(tree(), w.mesh, granularity=lambda path, x: vj.whole),
        TypeError,
        (r"leaf \['a'\]\['b'\]", "function vj.whole", r"vj\.whole\(\)"),
    ),
    Case("rows_zero", lambda w: vj.rows(0), ValueError, ("k >= 1", "got 0", r"vj\.rows\(1\)")),
    Case("rows_negative", lambda w: vj.rows(-1), ValueError, ("k >= 1", "got -1", r"vj\.rows\(1\)")),
    Case("rows_fraction", lambda w: vj.rows(1.5), ValueError, ("k >= 1", "got 1.5", r"vj\.rows\(1\)")),
    Case(
        "plan_sharded_params",
        lambda w: vj.plan(w.sp, w.mesh),
        TypeError,
        ("already a vj.ShardedParams", r"vj\.unshard\(sp\)", "sp.plan"),
    ),
    Case(
        "plan_not_a_mesh",
        lambda w: vj.plan(tree(), jax.devices()),
        TypeError,
        ("jax.sharding.Mesh", "got list", r"jax\.make_mesh"),
    ),
    Case("plan_empty_tree", lambda w: vj.plan({}, w.mesh), ValueError, ("no array leaves", r"nnx\.state")),
    # --- vj.fsdp / vj.apply / vj.place_batch -------------------------------------------------------------------
    Case(
        "microbatches_zero",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan, microbatches=0),
        ValueError,
        ("microbatches=0", "integer >= 1"),
    ),
    Case(
        "microbatches_negative",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan, microbatches=-2),
        ValueError,
        ("microbatches=-2", "integer >= 1"),
    ),
    Case(
        "microbatches_place_batch",
        lambda w: vj.place_batch(np.ones((4, 3)), w.plan, microbatches=0),
        ValueError,
        ("vj.place_batch", "microbatches=0", "integer >= 1"),
    ),
    Case(
        "microbatches_not_dividing",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan, microbatches=3)(w.sp, None, {"x": np.ones((8, 3))}),
        ValueError,
        (r"batch leaf \['x'\]", r"\(8, 3\)", "does not split into 3 micro-batches", "multiple of 3"),
    ),
    Case(
        "microbatched_batch_without_accumulate",
        lambda w: vj.fsdp(lambda p, o, b: jax.grad(loss)(p, b), plan=w.plan, microbatches=2, donate=False)(
            w.sp, None, np.ones((8, 3), np.float32)
        ),
        ValueError,
        ("batch argument 0", r"\(2, 4, 3\)", "micro-batch dim", r"vj\.accumulate\(loss_fn"),
    ),
    Case(
        "accumulate_without_microbatches",
        accumulate_case(None),
        ValueError,
        ("without microbatches=", r"microbatches=k"),
    ),
    Case(
        "scalar_batch_leaf",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan)(w.sp, None, {"x": np.ones((4, 3)), "t": np.float32(2.0)}),
        ValueError,
        (r"\['t'\]", "is a scalar", "leading batch dim", "step arguments"),
    ),
    Case(
        "batch_not_divisible",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan)(w.sp, None, {"x": np.ones((5, 3))}),
        ValueError,
        (r"\['x'\]", r"\(5, 3\)", "divisible by the data-parallel size 2"),
    ),
    Case(
        "precision_dtype",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan, precision=jnp.bfloat16),
        TypeError,
        ("vj.MixedPrecision policy", "the dtype bfloat16", r"vj\.MixedPrecision\(compute_dtype=jnp\.bfloat16\)"),
    ),
    Case(
        "precision_string",
        lambda w: vj.apply(model, w.sp, w.batch, precision="bfloat16"),
        TypeError,
        ("vj.apply", "the dtype bfloat16", r"vj\.MixedPrecision\(compute_dtype="),
    ),
    Case("fsdp_plan_positional", lambda w: vj.fsdp(w.plan), TypeError, (r"@vj\.fsdp\(plan=plan\)",)),
    Case(
        "fsdp_data_axes_duplicate",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan, data_axes=("fsdp", "fsdp")),
        ValueError,
        (r"\('fsdp', 'fsdp'\)", "'fsdp' twice", r"\('fsdp',\)"),
    ),
    Case(
        "fsdp_params_dict",
        lambda w: vj.fsdp(lambda *a: a, plan=w.plan)(tree(), None, w.batch),
        TypeError,
        ("params must be a vj.ShardedParams", "got dict", r"vj\.shard\(params, plan\)"),
    ),
    Case(
        "step_outputs_swapped",
        lambda w: fsdp_call(w, lambda p, o, v: (o, p, v)),
        ValueError,
        ("output 0", "order looks like", r"\(params, opt_state, \*rest\)"),
    ),
    Case(
        "step_outputs_missing_opt_state",
        lambda w: fsdp_call(w, lambda p, o, v: (p, v)),
        ValueError,
        ("output 1", "opt_state", "an array of shape ()", r"\(params, opt_state, \*rest\)"),
    ),
    Case(
        "step_outputs_loss_only",
        lambda w: fsdp_call(w, lambda p, o, v: v),
        ValueError,
        ("one value", r"\(params, opt_state, \*rest\)", r"donate=False"),
    ),
    Case(
        "int_leaf_under_grad",
        int_leaf_grad,
        TypeError,
        (r"'step' \(int32\[3\]\)", "integer leaves", r"nnx\.state\(model, nnx\.Param\)"),
    ),
    Case(
        "apply_unplaced_batch",
        lambda w: vj.apply(model, w.sp, np.ones((4, 3), np.float32)),
        ValueError,
        ("argument 0", r"\(4, 3\)", "Explicit", r"vj\.place_batch\(batch, plan\)"),
    ),
    Case(
        "apply_scalar_output",
        lambda w: vj.apply(lambda t, x: jnp.sum(model(t, x)), w.sp, w.batch),
        ValueError,
        ("output <root>", "scalar", r"jnp\.mean\(vj\.apply", r"vj\.batch_mean"),
    ),
    Case(
        "apply_scalar_output_in_dict",
        lambda w: vj.apply(lambda t, x: {"y": model(t, x), "l": jnp.sum(x)}, w.sp, w.batch),
        ValueError,
        (r"output \['l'\]", "scalar"),
    ),
    Case(
        "apply_empty_data_axes",
        lambda w: vj.apply(model, w.sp, w.batch, data_axes=()),
        ValueError,
        (r"data_axes=\(\)", "the plan's axis 'fsdp'", "Leave data_axes unset"),
    ),
    Case(
        "apply_unknown_data_axis",
        lambda w: vj.apply(model, w.sp, w.batch, data_axes="data"),
        ValueError,
        (r"\['data'\]", "not axes of the mesh", r"\{'fsdp': 2\}"),
    ),
    Case(
        "apply_args_swapped",
        lambda w: vj.apply(w.sp, model, w.batch),
        TypeError,
        ("model function", "ShardedParams", r"vj\.apply\(fn, params, \*batch\)"),
    ),
    Case(
        "apply_dict_params",
        lambda w: vj.apply(model, tree(), w.batch),
        TypeError,
        ("vj.apply", "got dict", r"vj\.shard\(params, plan\)"),
    ),
    Case(
        "nnx_scan_over_stacked_in_reverse",
        nnx_scan_case,
        ValueError,
        (r"blocks/\w+/\w+ \(shape \(3, 4(, 4)?\)\)", "reverse", r"vj\.flax\.nnx_scan_layers\(model\.blocks"),
    ),
    Case(
        "lax_scan_over_stacked_with_per_layer_outputs",
        lax_scan_case,
        ValueError,
        (
            r"blocks/\w+/\w+ \(shape \(3, 4(, 4)?\)\)",
            "per-layer floating-point",
            r"vj\.scan_layers\(body, params\['blocks'\]",
        ),
    ),
    Case(
        "stacked_leaf_indexed",
        stacked_index_case,
        TypeError,
        (r"'blocks/lin/kernel' \(shape \(3, 4, 4\)\)", "LayerShard", r"vj\.scan_layers\(body, params\['blocks'\]"),
    ),
    Case(
        "scan_layers_body_returns_pair",
        lambda w: vj.scan_layers(lambda p, c: (c @ p["w"], c), {"w": jnp.ones((3, 4, 4))}, jnp.ones((2, 4))),
        TypeError,
        ("vj.scan_layers", r"lax\.scan's \(carry, y\)", "return the carry"),
    ),
    Case(
        "init_opt_state_dict",
        lambda w: vj.init_opt_state(optax.adam(1e-3), tree()),
        TypeError,
        ("vj.init_opt_state", "got dict", r"vj\.shard\(params, plan\)"),
    ),
    Case(
        "init_opt_state_factory",
        lambda w: vj.init_opt_state(optax.adam, w.sp),
        TypeError,
        ("GradientTransformation", "'adam'", r"optax\.adamw\(1e-3\)"),
    ),
    Case(
        "init_opt_state_swapped",
        lambda w: vj.init_opt_state(w.sp, optax.adam(1e-3)),
        TypeError,
        (r"\(tx, params\)", "params first"),
    ),
    Case(
        "unshard_dict",
        lambda w: vj.unshard(tree()),
        TypeError,
        ("vj.unshard", "got dict", "logical tree is not sharded"),
    ),
    Case(
        "unshard_container",
        lambda w: vj.unshard({"p": w.sp}),
        TypeError,
        ("vj.unshard", "got dict", "holds a vj.ShardedParams inside"),
    ),
    Case(
        "units_wrong_arity",
        lambda w: vj.plan(tree(), w.mesh, units=lambda path: "x"),
        TypeError,
        ("units=", r"\(key_path, leaf\)", r"units=lambda path, leaf"),
    ),
    Case(
        "mixed_precision_bad_dtype",
        lambda w: vj.MixedPrecision(compute_dtype="bf16"),
        ValueError,
        ("compute_dtype='bf16'", "not a dtype", "jnp.bfloat16"),
    ),
    Case(
        "mixed_precision_int",
        lambda w: vj.MixedPrecision(compute_dtype=jnp.int8),
        ValueError,
        ("compute_dtype", "int8", "jnp.bfloat16"),
    ),
    Case(
        "nnx_apply_module",
        lambda w: vj.flax.nnx_apply(nnx.Linear(3, 5, rngs=nnx.Rngs(0)), w.sp, w.batch),
        TypeError,
        ("Linear module", r"nnx\.split\(model\)"),
    ),
    Case(
        "linen_apply_params_only",
        lambda w: vj.flax.linen_apply(None, w.sp, w.batch),
        ValueError,
        (r"\['a', 'c'\]", "not Linen collections", r"vj\.plan\(\{'params'"),
    ),
    # --- vj.optim -----------------------------------------------------------------------------------------------
    Case(
        "muon_on_a_dict",
        lambda w: vj.optim.muon(0.1, plan=w.plan).init(tree()),
        TypeError,
        ("vj.optim", "got dict", r"vj\.shard\(params, plan\)"),
    ),
    Case(
        "muon_other_plan",
        lambda w: vj.optim.muon(0.1, plan=other_devices(w)).init(w.sp),
        ValueError,
        ("another plan", r"devices \[0, 1\] vs .* devices \[2, 3\]", "plan=params.plan"),
    ),
    Case(
        "shampoo_block_split",
        lambda w: vj.optim.shampoo(0.1, plan=w.plan, block_size=2),
        ValueError,
        (r"'a/w'", r"\(3, 5\)", r"vj\.rows\(2\)"),
    ),
    # --- redistribute, kernels ---------------------------------------------------------------------------------
    Case(
        "redistribute_outside_shard_map",
        lambda w: vj.redistribute.to_ragged(jnp.ones((3, 5)), w.plan.shard_of("a/w"), axis="fsdp"),
        ValueError,
        ("to_ragged", "'fsdp' is not bound", r"jax\.shard_map"),
    ),
    Case(
        "reshard_outside_shard_map",
        lambda w: vj.redistribute.reshard(
            jnp.ones((w.plan.shard_of("a/w").max_local_size,)),
            w.plan.shard_of("a/w"),
            w.plan.shard_of("a/w"),
            axis="fsdp",
        ),
        ValueError,
        ("reshard", "'fsdp' is not bound", r"jax\.shard_map"),
    ),
    Case(
        "pack_reference_past_end",
        lambda w: pack_reference([jnp.ones(4), jnp.ones(4)], bad_layout()),
        ValueError,
        ("pack_reference", "slot 1", "ends at element 10", "8 elements", r"vj\.plan_bucket"),
    ),
    Case(
        "pack_past_end",
        lambda w: pack([jnp.ones(4), jnp.ones(4)], bad_layout(), interpret=True),
        ValueError,
        ("pack", "slot 1", "ends at element 10"),
    ),
    Case(
        "unpack_reference_past_end",
        lambda w: unpack_reference(jnp.ones(8), bad_layout(), [(4,), (4,)]),
        ValueError,
        ("unpack_reference", "slot 1", "ends at element 10"),
    ),
    Case(
        "pack_reference_overlap",
        lambda w: pack_reference(
            [jnp.ones(4), jnp.ones(4)],
            BucketLayout(sizes=(4, 4), blocks=(1, 1), offsets=(0, 2), shard_size=4, num_devices=2),
        ),
        ValueError,
        ("slot 1", "offset 2 overlaps", "ending at 4"),
    ),
    # --- plan_bucket's arguments -------------------------------------------------------------------------------
    Case(
        "plan_bucket_sizes_none",
        lambda w: vj.plan_bucket(None, [1], 2),
        ValueError,
        ("sizes must be a sequence of integers", "NoneType None", r"sizes=\["),
    ),
    Case(
        "plan_bucket_blocks_int",
        lambda w: vj.plan_bucket([4, 4], 1, 2),
        ValueError,
        ("blocks must be a sequence of integers", "int 1", r"blocks=\["),
    ),
    Case(
        "plan_bucket_sizes_string",
        lambda w: vj.plan_bucket("44", [1, 1], 2),
        ValueError,
        ("sizes must be a sequence", "str '44'"),
    ),
    Case(
        "plan_bucket_size_none",
        lambda w: vj.plan_bucket([4, None], [1, 1], 2),
        ValueError,
        (r"sizes\[1\] = None", "non-negative integer"),
    ),
    Case(
        "plan_bucket_size_nan",
        lambda w: vj.plan_bucket([4, float("nan")], [1, 1], 2),
        ValueError,
        (r"sizes\[1\] = nan", "non-negative integer"),
    ),
    Case(
        "plan_bucket_devices_string",
        lambda w: vj.plan_bucket([4], [1], "2"),
        ValueError,
        ("num_devices must be an integer >= 1", "str '2'", "num_devices=8"),
    ),
    Case(
        "plan_bucket_devices_none",
        lambda w: vj.plan_bucket([4], [1], None),
        ValueError,
        ("num_devices", "NoneType None"),
    ),
    Case(
        "plan_bucket_align_none",
        lambda w: vj.plan_bucket([4], [1], 2, align=None),
        ValueError,
        ("align must be an integer >= 1", "NoneType None", "align=1"),
    ),
    # --- vj.distributed.initialize's arguments (checked before anything reaches JAX) ----------------------------
    Case(
        "initialize_num_processes_string",
        lambda w: vj.distributed.initialize(coordinator_address="127.0.0.1:12345", num_processes="2", process_id=0),
        TypeError,
        ("num_processes must be an int", "str '2'", "num_processes=2"),
    ),
    Case(
        "initialize_process_id_float",
        lambda w: vj.distributed.initialize(coordinator_address="127.0.0.1:12345", num_processes=2, process_id=1.0),
        TypeError,
        ("process_id must be an int", "float 1.0", "process_id=1"),
    ),
    Case(
        "initialize_address_int",
        lambda w: vj.distributed.initialize(coordinator_address=12345, num_processes=2, process_id=0),
        TypeError,
        ('coordinator_address must be a "host:port" string', "int 12345", "127.0.0.1:12345"),
    ),
    Case(
        "initialize_address_without_port",
        lambda w: vj.distributed.initialize(coordinator_address="127.0.0.1", num_processes=2, process_id=0),
        ValueError,
        ("coordinator_address='127.0.0.1'", "host:port", "127.0.0.1:12345"),
    ),
    Case(
        "initialize_local_device_count_string",
        lambda w: vj.distributed.initialize(local_device_count="4"),
        TypeError,
        ("local_device_count must be an int", "str '4'", "local_device_count=4"),
    ),
    Case(
        "initialize_local_device_ids_int",
        lambda w: vj.distributed.initialize(local_device_ids=0),
        TypeError,
        ("local_device_ids must be a sequence of ints", "int 0", r"local_device_ids=\[0\]"),
    ),
    Case(
        "initialize_heartbeat_string",
        lambda w: vj.distributed.initialize(heartbeat_timeout_s="30"),
        TypeError,
        ("heartbeat_timeout_s must be a number of seconds", "str '30'", "heartbeat_timeout_s=30"),
    ),
    Case(
        "initialize_timeout_negative",
        lambda w: vj.distributed.initialize(timeout_s=-1),
        ValueError,
        ("timeout_s=-1", "> 0", "timeout_s=30"),
    ),
    Case(
        "initialize_cpu_collectives_unknown",
        lambda w: vj.distributed.initialize(cpu_collectives="nccl"),
        ValueError,
        ("cpu_collectives='nccl'", "'gloo'", "'mpi'"),
    ),
    # --- buffers that do not fit their plan; a Muon dims tree over other keys ------------------------------------
    Case(
        "unshard_buffers_of_another_length",
        lambda w: vj.unshard(vj.ShardedParams([jnp.zeros(x.shape[0] - 2, x.dtype) for x in w.sp.buffers], w.plan)),
        ValueError,
        (
            "vj.unshard",
            r"buffer 0 \(bucket 'a:float32'",
            r"shape \(\d+,\)",
            "its plan stores that bucket as",
            "vj.shard",
        ),
    ),
    Case(
        "muon_dims_key_not_in_params",
        lambda w: vj.optim.muon(
            0.1, plan=w.plan, muon_weight_dimension_numbers={"a": None, "c": None, "d": vj.optim.MuonDimensionNumbers()}
        ).init(w.sp),
        ValueError,
        ("weight_dimension_numbers", r"not in the params: \['d'\]", "MuonDimensionNumbers or None", "callable"),
    ),
    Case(
        "muon_dims_leaf_not_covered",
        lambda w: vj.optim.muon(0.1, plan=w.plan, muon_weight_dimension_numbers={"a": {"w": None}, "c": None}).init(
            w.sp
        ),
        ValueError,
        ("weight_dimension_numbers", r"params it does not cover: \['a'\]\['b'\]"),
    ),
    # --- donated (deleted) params ----------------------------------------------------------------------------
    Case(
        "unshard_donated",
        lambda w: vj.unshard(deleted(w)),
        ValueError,
        ("vj.unshard", "donated", r"bucket 'a:float32' \(\d+,\) is deleted", "params, opt_state", "donate=False"),
    ),
    Case(
        "zero_padding_donated",
        lambda w: vj.zero_padding(deleted(w)),
        ValueError,
        ("vj.zero_padding", "donated", "is deleted", "donate=False"),
    ),
]


def deleted(w):
    """Fresh params whose buffers are deleted, as a step that donated them leaves them."""
    sp = vj.shard(tree(), w.plan)
    for x in sp.buffers:
        x.delete()
    return sp


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_error_names_the_thing(case, w):
    with pytest.raises(case.exc) as info:
        case.run(w)
    message = str(info.value)
    for fragment in case.fragments:
        assert re.search(fragment, message), f"{fragment!r} not in: {message}"


# --- near-misses that now do the right thing ---------------------------------------------------------------------


def test_global_norms_outside_set_mesh(w):
    """vj.global_norm enters the plan's mesh itself; optax.global_norm of the ShardedParams gives the same value
    where this JAX can take it outside a mesh, else our error naming both ways out (never JAX's own)."""
    want = np.sqrt(sum(np.sum(np.square(np.asarray(x))) for x in jax.tree.leaves(tree())))
    assert jax.sharding.get_abstract_mesh().empty
    np.testing.assert_allclose(vj.global_norm(w.sp), want, rtol=1e-6)
    try:
        with warnings.catch_warnings():  # optax deprecates global_norm for tree.norm; users still call it
            warnings.simplefilter("ignore", DeprecationWarning)
            got = optax.global_norm(w.sp)
    except ValueError as e:
        for fragment in ("optax.global_norm", "outside jax.set_mesh", r"vj.global_norm\(params\)", r"set_mesh\(params"):
            assert re.search(fragment, str(e)), f"{fragment!r} not in: {e}"
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6)
    with jax.set_mesh(w.mesh):
        np.testing.assert_allclose(optax.tree.norm(w.sp), want, rtol=1e-6)


def test_fingerprint_includes_the_mesh_devices(w):
    same = vj.plan(tree(), w.mesh)
    assert same.fingerprint() == w.plan.fingerprint()
    assert other_devices(w).fingerprint() != w.plan.fingerprint()
    assert other_devices(w).to_dict() == w.plan.to_dict()  # the layout itself is the same


def test_stacked_accepts_one_unit_name(w):
    params = {"blocks": {"w": jnp.ones((3, 4, 4))}, "head": jnp.ones((4,))}
    by_name = vj.plan(params, w.mesh, stacked="blocks")  # not the letters of "blocks"
    assert [b.layers for b in by_name.buckets] == [3, None]
    assert by_name == vj.plan(params, w.mesh, stacked=("blocks",))


def test_rows_accepts_numpy_integers(w):
    assert vj.rows(np.int64(2)) == vj.rows(2)


def test_step_outputs_are_not_checked_without_donation(w):
    # An evaluation step (donate=False) may return anything; the params stay usable.
    step = vj.fsdp(train_step(lambda p, o, v: v), plan=w.plan, donate=False)
    value = step(w.sp, optax.sgd(0.1).init(w.sp), w.batch)
    ref = jnp.mean(np.ones((4, 3), np.float32) @ np.ones((3, 5), np.float32) @ np.ones((5, 2), np.float32))
    np.testing.assert_allclose(float(value), float(ref), rtol=1e-6)


@pytest.fixture
def standard_promotion():
    # optax's bias corrections mix a Python float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.usefixtures("standard_promotion")
def test_muon_skips_an_empty_matrix(w):
    # A (0, n) matrix has nothing to orthogonalise: it takes the element-wise branch, the others are unchanged.
    full = {"l": {"e": jnp.ones((0, 4)), "m": jnp.arange(16.0).reshape(4, 4) / 16}}
    part = {"l": {"m": full["l"]["m"]}}
    updates = []
    for params in (full, part):
        plan = vj.plan(params, w.mesh)
        tx = vj.optim.muon(0.1, plan=plan)
        sp = vj.shard(params, plan)
        u, _ = jax.jit(tx.update)(sp, vj.init_opt_state(tx, sp), sp)
        updates.append(vj.unshard(u))
    assert updates[0]["l"]["e"].shape == (0, 4)
    np.testing.assert_allclose(np.asarray(updates[0]["l"]["m"]), np.asarray(updates[1]["l"]["m"]), rtol=1e-6)


@pytest.mark.usefixtures("standard_promotion")
def test_shampoo_clips_a_block_larger_than_every_matrix(w):
    # block_size=64 on 3x5 and 5x2 matrices: statistics clipped to 5x5 (the largest matrix dim), and the update
    # still equals the reference's, whose blocks are min(64, dim) wide.
    from shampoo_reference import reference_shampoo

    params = {"a": {"w": jnp.arange(15.0).reshape(3, 5) / 15 - 0.4}, "c": {"w": jnp.arange(10.0).reshape(5, 2) / 9}}
    plan = vj.plan(params, w.mesh, granularity=vj.rows(64))
    tx = vj.optim.shampoo(0.1, plan=plan, block_size=64)
    sp = vj.shard(params, plan)
    state = vj.init_opt_state(tx, sp)
    assert state.shampoo[0].stats_left.value.shape[1:] == (5, 5)
    grads = vj.shard(jax.tree.map(lambda x: jnp.sin(3 * x), params), plan)
    got = vj.unshard(jax.jit(tx.update)(grads, state, sp)[0])
    ref_tx = reference_shampoo(0.1, block_size=64)
    np_params = jax.tree.map(np.asarray, params)
    ref, _ = ref_tx.update(jax.tree.map(lambda x: np.sin(3 * x), np_params), ref_tx.init(np_params), np_params)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5 * np.abs(r).max())


@pytest.mark.parametrize("reduce", ["each", pytest.param("once", marks=pytest.mark.slow)])
def test_buckets_of_only_zero_size_leaves_train_like_the_reference(reduce):
    # A unit (and a stacked layer group's dtype bucket) holding only zero-size leaves has S = 0: nothing to
    # gather or reduce-scatter (XLA rejects empty collectives); the rest of the step is unchanged.
    mesh = make_mesh(3)
    params = {
        "e": {"z": jnp.ones((0, 3))},
        "a": {"w": jnp.full((3, 3), 0.5), "z": jnp.ones((0,), jnp.bfloat16)},
        "blocks": {"w": jnp.full((2, 3, 3), 0.1), "z": jnp.ones((2, 0), jnp.bfloat16)},
    }
    plan = vj.plan(params, mesh, stacked=("blocks",))
    assert sorted(b.layout.total_size for b in plan.buckets)[:3] == [0, 0, 0]

    def net(t, x):
        x = x @ t["a"]["w"] + jnp.sum(t["e"]["z"]) + jnp.sum(t["a"]["z"]).astype(jnp.float32)
        return vj.scan_layers(lambda p, c: jnp.tanh(c @ p["w"]) + jnp.sum(p["z"]).astype(jnp.float32), t["blocks"], x)

    def loss_of(p, x):
        return jnp.mean(vj.apply(net, p, x) ** 2)

    @vj.fsdp(plan=plan, microbatches=2, donate=False)
    def step(p, _, x):
        return vj.accumulate(loss_of, p, x, reduce=reduce)

    x = np.linspace(-1, 1, 18, dtype=np.float32).reshape(6, 3)
    value, grads = step(vj.shard(params, plan), None, x)
    ref_value, ref_grads = jax.value_and_grad(lambda p: jnp.mean(net(p, x) ** 2))(params)
    np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-6)
    for g, r in zip(jax.tree.leaves(vj.unshard(grads)), jax.tree.leaves(ref_grads), strict=True):
        assert g.shape == r.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=1e-5, atol=1e-7)
