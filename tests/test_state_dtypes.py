"""Optimizer state whose dtype differs from its params': fp32 moments of bf16 params (``optax.adamw(...,
mu_dtype=jnp.float32)``), the 8-bit codes of ``vj.optim.adamw_8bit``, the fp32 graft moments of ``vj.optim.shampoo``
over a bf16 leaf. ``vj.unshard`` gives each in its own dtype (against optax / the logical quantizer run on the
unsharded tree), ``vj.checkpoint`` stores and restores it bit for bit (into the same and another device count),
and buffers of another plan's shape are still refused."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import assert_trees_equal

import vescale_jax as vj
import vescale_jax.optim as vjo
from vescale_jax import quant
from vescale_jax.state._sharded import PerDevice, ShardedParams

STEPS = 2
BLOCK = (8, 8)
MIN_SIZE = 128  # 8-bit: leaves (per layer) of at least this many elements and two dims are quantized
COUNTS = (1, 3, 8)
NEXT = {3: 8}  # a checkpoint saved under 3 devices is also restored under 8 (the others: under their own count)
# Gradients 2**k with a random sign, k in [-4, 4], and b1 = b2 = 1/2: every product in Adam's moment updates is exact
# and each sum rounds once, so the moments do not depend on how XLA fuses the step (one program computes a bf16
# product in fp32 without rounding it, or fuses b1 * mu + ... into an FMA, where another rounds each op; a 0.9 and
# random gradients then differ in a bf16 rounding or an fp32 ulp). Two steps leave fp32 first moments (sums of
# powers of two up to 9 binades apart) that bf16 cannot hold.
B1 = B2 = 0.5
EPS = 1e-8


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def make_params(shapes, seed=0):
    """``{unit: {name: (*shape, dtype)}}`` -> standard normal leaves of those shapes and dtypes."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s[:-1]), s[-1]), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def dyadic_grads(params, seed=1):
    """``STEPS`` gradient trees of signed powers of two (see ``B1``)."""
    rng = np.random.default_rng(seed)
    one = lambda x: jnp.asarray(rng.choice([-1.0, 1.0], x.shape) * 2.0 ** rng.integers(-4, 5, x.shape), x.dtype)
    return [jax.tree.map(one, params) for _ in range(STEPS)]


# bf16 leaves: a matrix with partial edge tiles, a vector, a matrix below MIN_SIZE; a stacked group (its own bucket)
PARAMS = make_params(
    {
        "a": {"w": (20, 12, jnp.bfloat16), "b": (12, jnp.bfloat16), "small": (4, 8, jnp.bfloat16)},
        "layers": {"w": (2, 16, 16, jnp.bfloat16), "n": (2, 16, jnp.bfloat16)},
    }
)
GRADS = dyadic_grads(PARAMS)
# fp32 leaves and one bf16 matrix (its own bucket), with edge blocks (13 and 6 are not multiples of 4)
SHAMPOO_PARAMS = make_params({"a": {"w": (13, 8, jnp.float32), "b": (8, jnp.float32), "h": (8, 6, jnp.bfloat16)}})
SHAMPOO_GRADS = dyadic_grads(SHAMPOO_PARAMS)
TILES = lambda path, leaf: vj.tiles(*BLOCK) if leaf.ndim >= 2 else vj.element()

# name -> (params, grads, granularity, optimizer)
OPTIMIZERS = {
    "adamw_fp32": (
        PARAMS,
        GRADS,
        TILES,
        lambda: optax.adamw(1e-2, b1=B1, b2=B2, eps=EPS, weight_decay=0.1, mu_dtype=jnp.float32),
    ),
    "adamw_8bit": (
        PARAMS,
        GRADS,
        TILES,
        lambda: vjo.adamw_8bit(1e-2, block=BLOCK, b1=B1, b2=B2, eps=EPS, min_size=MIN_SIZE),
    ),
    "shampoo": (SHAMPOO_PARAMS, SHAMPOO_GRADS, vj.rows(4), lambda: vjo.shampoo(1e-2, block_size=4)),
}


def plan_for(opt, m):
    params, _, granularity, _ = OPTIMIZERS[opt]
    return vj.plan(params, make_mesh(m), stacked=[u for u in params if u == "layers"], granularity=granularity)


_TRAINED = {}


def trained(opt, m):
    """``STEPS`` steps of optimizer ``opt`` on the shards under ``m`` devices: (params, state), once per process."""
    if (opt, m) not in _TRAINED:
        params, grads, _, make_tx = OPTIMIZERS[opt]
        plan, tx = plan_for(opt, m), make_tx()

        @jax.jit
        def step(sp, state, g):
            u, state = tx.update(g, state, sp)
            return optax.apply_updates(sp, u), state

        sp = vj.shard(params, plan)
        state = vj.init_opt_state(tx, sp)
        with jax.set_mesh(plan.mesh):
            for g in grads:
                sp, state = step(sp, state, vj.shard(g, plan))
        _TRAINED[opt, m] = sp, state
    return _TRAINED[opt, m]


def dtypes(tree):
    return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


# ------------------------------------------------------------------------------------------------------ vj.unshard
@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_fp32_moments_of_bf16_params_unshard_as_optax(m):
    _, state = trained("adamw_fp32", m)
    tx = OPTIMIZERS["adamw_fp32"][3]()
    ref, params = tx.init(PARAMS), PARAMS
    for g in GRADS:
        u, ref = jax.jit(tx.update)(g, ref, params)
        params = optax.apply_updates(params, u)
    mu, nu = vj.unshard(state[0].mu), vj.unshard(state[0].nu)
    assert dtypes(mu) == {np.dtype(np.float32)}, "fp32 moments come back fp32, not in the params' dtype"
    assert_trees_equal(mu, ref[0].mu, what="mu")
    assert_trees_equal(nu, ref[0].nu, what="nu")  # optax keeps nu in the params' dtype
    assert any(
        not np.array_equal(np.asarray(x), np.asarray(x.astype(jnp.bfloat16).astype(x.dtype)))
        for x in jax.tree.leaves(mu)
    ), "the test needs fp32 moments that bf16 cannot hold"


def quantized(path, shape):
    per_layer = shape[1:] if jax.tree_util.keystr(path).startswith("['layers']") else shape
    return len(per_layer) >= 2 and math.prod(per_layer) >= MIN_SIZE


@jax.jit
def adam_moments(grads, mu, nu):
    """optax's Adam moments of the logical tree, in fp32 (as vj.optim.scale_by_adam_8bit computes them)."""
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    return optax.tree.update_moment(grads, mu, B1, 1), optax.tree.update_moment_per_elem_norm(grads, nu, B2, 2)


def reference_8bit():
    """The last step's (mu codes, nu codes, dequantized mu, dequantized nu, mu scales, nu scales) per logical leaf:
    optax's moments and vj.quant's dynamic quantizer (NumPy) on the unsharded tree."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(PARAMS)
    blocks = [BLOCK if quantized(p, x.shape) else None for p, x in flat]
    mu = nu = jax.tree.map(lambda x: np.zeros(x.shape, np.float32), PARAMS)
    for grads in GRADS:
        out = ([], [], [], [], [], [])
        for m, v, block in zip(*map(jax.tree.leaves, adam_moments(grads, mu, nu)), blocks, strict=True):
            cm, sm = quant.dynamic_quantize(m, block=block, signed=True)
            cv, sv = quant.dynamic_quantize(v, block=block, signed=False)
            dm = quant.dynamic_dequantize(cm, sm, block=block, signed=True)
            dv = quant.dynamic_dequantize(cv, sv, block=block, signed=False)
            for lst, x in zip(out, (cm, cv, dm, dv, sm, sv), strict=True):
                lst.append(np.asarray(x))
        mu, nu = (jax.tree_util.tree_unflatten(treedef, x) for x in out[2:4])
    return [jax.tree_util.tree_unflatten(treedef, x) for x in out]


def logical_scales(views, plan):
    """The per-bucket logical views of the scales as one tree like the params."""
    merged = {k: v for view in views for k, v in view.items()}
    return jax.tree_util.tree_unflatten(plan.treedef, [merged[f"{s.path}/scales"] for s in plan.leaves])


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
def test_8bit_moments_of_bf16_params_unshard_as_the_logical_quantizer(m):
    _, state = trained("adamw_8bit", m)
    s, plan = state[0], state[0].mu_codes.plan
    mu_codes, nu_codes, mu, nu, mu_scales, nu_scales = reference_8bit()
    flat = jax.tree_util.tree_flatten_with_path(PARAMS)[0]
    assert {quantized(p, x.shape) for p, x in flat} == {True, False}, "the test needs quantized and exact leaves"
    got_mu, got_nu = vjo.adam_8bit_moments(state)  # fp32 ShardedParams over the bf16 plan
    assert dtypes(vj.unshard(s.mu_codes)) == {np.dtype(np.int8)}
    assert_trees_equal(vj.unshard(s.mu_codes), mu_codes, what="mu codes")
    assert_trees_equal(vj.unshard(s.nu_codes), nu_codes, what="nu codes")
    assert_trees_equal(vj.unshard(got_mu), mu, what="dequantized mu")
    assert_trees_equal(vj.unshard(got_nu), nu, what="dequantized nu")
    assert_trees_equal(logical_scales(vjo.logical_view(s.mu_scales), plan), mu_scales, what="mu scales")
    assert_trees_equal(logical_scales(vjo.logical_view(s.nu_scales), plan), nu_scales, what="nu scales")


def test_buffers_of_another_plans_shape_are_still_refused():
    """Any dtype is accepted, another plan's geometry is not: fp32 moments made under 3 devices on an 8-device
    plan (their buffers a different length) name the bucket and both shapes."""
    state = vj.init_opt_state(OPTIMIZERS["adamw_fp32"][3](), vj.shard(PARAMS, plan_for("adamw_fp32", 3)))
    other = plan_for("adamw_fp32", 8)
    mu = state[0].mu.buffers
    assert any(x.shape != b.shape for b, x in zip(other.buckets, mu, strict=True)), "the test needs other lengths"
    with pytest.raises(ValueError, match=r"vj\.unshard: buffer \d+ \(bucket '[\w:]+'.*shape \(.*of any dtype"):
        vj.unshard(ShardedParams(mu, other))


# --------------------------------------------------------------------------------------------------- vj.checkpoint
def is_node(x):
    return isinstance(x, ShardedParams | PerDevice)


def views(state):
    """The plan-independent form of a state: ShardedParams unsharded, PerDevice with a layout viewed, the rest."""
    view = vjo.logical_view(state)
    return [vj.unshard(x) if isinstance(x, ShardedParams) else x for x in jax.tree.leaves(view, is_leaf=is_node)]


@pytest.mark.parametrize("m", COUNTS, ids=lambda m: f"m{m}")
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_state_of_another_dtype_round_trips_through_a_checkpoint(tmp_path, opt, m):
    params, _, _, make_tx = OPTIMIZERS[opt]
    sp, state = trained(opt, m)
    other = [
        b.name
        for node in jax.tree.leaves(state, is_leaf=is_node)
        if isinstance(node, ShardedParams)
        for b, x in zip(node.plan.buckets, node.buffers, strict=True)
        if np.dtype(x.dtype) != np.dtype(b.dtype)
    ]
    assert other, "the test needs parameter-shaped state of another dtype than its bucket's"
    restored = {}
    with vj.checkpoint.Manager(tmp_path) as mngr:
        mngr.save(STEPS, params=sp, opt_state=state)
        mngr.wait()
        for n in (m, NEXT.get(m, m)):
            plan = plan_for(opt, n)
            template = jax.eval_shape(make_tx().init, jax.eval_shape(lambda p=plan: vj.shard(params, p)))
            restored[n] = mngr.restore(params=plan, opt_state=template)
    # The same plan: every buffer back bit for bit, in its own dtype.
    assert_trees_equal(restored[m].opt_state, state, what=f"opt_state restored under {m} devices")
    assert_trees_equal(restored[m].params, sp, what=f"params restored under {m} devices")
    if m in NEXT:  # another device count: the same logical state
        assert_trees_equal(views(restored[NEXT[m]].opt_state), views(state), what=f"opt_state under {NEXT[m]} devices")
