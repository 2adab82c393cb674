"""The reference blocked Shampoo (tests/shampoo_reference.py) against computations written independently here:
SVD-based fractional powers, closed-form exponential averages, optax.adamw, and re-arrangements of the same
problem (blocks as separate leaves, zero padding, stacked layers as separate leaves, N-D leaves as reshapes)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from shampoo_reference import reference_shampoo

GRAFTS = ("adam", "rmsprop", "adagrad", "sgd")


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    # optax's Adam bias correction mixes a float with an int32 count: not clean under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def rand(shape, seed, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def grads_seq(params, n, seed=1):
    """n gradient trees, each step at a different scale so the exponential averages matter."""
    rng = np.random.default_rng(seed)
    return [
        jax.tree.map(lambda x, k=k: jnp.asarray((1 + k) * rng.standard_normal(x.shape), x.dtype), params)
        for k in range(n)
    ]


def run(tx, params, grads, pass_params=True):
    """Updates (float64 numpy trees) of each step and the state after each step; params held fixed."""
    state = tx.init(params)
    updates, states = [], []
    for g in grads:
        u, state = tx.update(g, state, params if pass_params else None)
        updates.append(jax.tree.map(lambda x: np.asarray(x, np.float64), u))
        states.append(state)
    return updates, states


def psd_power(a, p, eps):
    """(A + eps I) ** (-1/p) for a symmetric PSD A, via an SVD (singular values = eigenvalues for PSD)."""
    u, s, _ = np.linalg.svd(np.asarray(a, np.float64))
    return (u * (s + eps) ** (-1.0 / p)) @ u.T


def ema(values, beta, t):
    """sum_k (1-beta) beta^(t-k) x_k over steps 1..t (closed form of x <- beta x + (1-beta) x_t from zeros)."""
    return sum((1 - beta) * beta ** (t - k) * values[k - 1] for k in range(1, t + 1))


def hand_single_block(
    grads,
    param,
    *,
    lr,
    beta1=0.9,
    beta2=0.999,
    graft="adam",
    graft_beta2=None,
    deps=1e-10,
    meps=1e-6,
    wd=0.0,
    start=1,
    every=1,
    p=4,
    nesterov=False,
):
    """Shampoo for one 2-D leaf that is a single block, written from closed forms: the statistics and moments
    as explicit weighted sums, the roots of the latest refresh step <= t recomputed from that step's sums."""
    gs = [np.asarray(g, np.float64) for g in grads]
    param = np.asarray(param, np.float64)
    gb2 = beta2 if graft_beta2 is None else graft_beta2
    refresh_steps = list(range(start, len(gs) + 1, every))
    us, out = [], []
    for t in range(1, len(gs) + 1):
        g = gs[t - 1]
        sq = [x**2 for x in gs[:t]]
        if graft == "sgd":
            gr = g
        elif graft == "adagrad":
            gr = g / (np.sqrt(sum(sq)) + deps)
        elif graft == "rmsprop":
            gr = g / (np.sqrt(ema(sq, gb2, t)) + deps)
        else:
            gr = g / (np.sqrt(ema(sq, gb2, t) / (1 - gb2**t)) + deps)
        if t >= start:
            s = max(k for k in refresh_steps if k <= t)
            left = ema([x @ x.T for x in gs[:s]], beta2, s)
            right = ema([x.T @ x for x in gs[:s]], beta2, s)
            d = psd_power(left, p, meps) @ g @ psd_power(right, p, meps)
            u = d * np.linalg.norm(gr) / np.linalg.norm(d)
        else:
            u = gr
        us.append(u)
        mom = ema(us, beta1, t)
        if nesterov:
            direction = beta1 * mom / (1 - beta1 ** (t + 1)) + (1 - beta1) * u / (1 - beta1**t)
        else:
            direction = mom / (1 - beta1**t)
        out.append(-lr * (direction + wd * param))
    return out


def close(a, b, rtol=1e-5, atol=1e-7):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol)


# 1. One step, one block: -lr * D * ||G|| / ||D|| with D from the SVD of G.
@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
@pytest.mark.parametrize("exponent", [0, 2])
def test_one_step_single_block_matches_svd(shape, exponent):
    lr, beta2, meps = 0.3, 0.95, 1e-6
    g = rand(shape, 0)
    tx = reference_shampoo(
        lr,
        block_size=max(shape),
        beta1=0.0,
        beta2=beta2,
        graft_type="sgd",
        matrix_epsilon=meps,
        exponent_override=exponent,
    )
    (upd,), _ = run(tx, {"w": g}, [{"w": g}], pass_params=False)

    p = exponent or 4
    g64 = np.asarray(g, np.float64)
    u, s, vt = np.linalg.svd(g64, full_matrices=True)
    s_left = np.zeros(shape[0])
    s_right = np.zeros(shape[1])
    s_left[: s.size] = s
    s_right[: s.size] = s
    pl = (u * ((1 - beta2) * s_left**2 + meps) ** (-1 / p)) @ u.T
    pr = (vt.T * ((1 - beta2) * s_right**2 + meps) ** (-1 / p)) @ vt
    d = pl @ g64 @ pr
    expected = -lr * d * np.linalg.norm(g64) / np.linalg.norm(d)
    close(upd["w"], expected)
    # The direction is not the gradient's (the preconditioner does something).
    assert not np.allclose(upd["w"] / np.linalg.norm(upd["w"]), -g64 / np.linalg.norm(g64), atol=1e-2)


# 2. Blocks are independent: a blocked 10x14 leaf equals its 12 blocks as separate unblocked leaves.
@pytest.mark.parametrize("graft", GRAFTS)
def test_blocks_equal_separate_leaves(graft):
    bs, (rows, cols) = 4, (10, 14)
    w = rand((rows, cols), 0)
    rr = [(r, min(r + bs, rows)) for r in range(0, rows, bs)]
    cr = [(c, min(c + bs, cols)) for c in range(0, cols, bs)]
    assert len(rr) == 3 and len(cr) == 4 and rr[-1] == (8, 10) and cr[-1] == (12, 14)  # edge blocks exist
    kw = dict(graft_type=graft, beta1=0.9, beta2=0.9, nesterov=True, weight_decay=0.01)
    grads = grads_seq({"w": w}, 3)

    blocked, _ = run(reference_shampoo(0.1, block_size=bs, **kw), {"w": w}, grads)

    def split(x):
        return {f"{i}_{j}": x[r0:r1, c0:c1] for i, (r0, r1) in enumerate(rr) for j, (c0, c1) in enumerate(cr)}

    separate, _ = run(reference_shampoo(0.1, block_size=10_000, **kw), split(w), [split(g["w"]) for g in grads])
    for step in range(3):
        for i, (r0, r1) in enumerate(rr):
            for j, (c0, c1) in enumerate(cr):
                close(blocked[step]["w"][r0:r1, c0:c1], separate[step][f"{i}_{j}"], rtol=1e-6, atol=1e-9)


# 3. Zero padding: a matrix in the top-left corner of a larger zero matrix gives the same updates there and
#    exactly zero on the padded part (the property a padded distributed implementation relies on).
@pytest.mark.parametrize("graft", GRAFTS)
def test_zero_padding_invariance(graft):
    rows, cols, prow, pcol = 7, 9, 12, 16
    w = rand((rows, cols), 0)
    grads = grads_seq({"w": w}, 4)

    def pad(x):
        return jnp.zeros((prow, pcol), x.dtype).at[:rows, :cols].set(x)

    kw = dict(graft_type=graft, beta1=0.9, beta2=0.95, weight_decay=0.0)
    real, _ = run(reference_shampoo(0.1, block_size=16, **kw), {"w": w}, grads, pass_params=False)
    padded, _ = run(
        reference_shampoo(0.1, block_size=16, **kw),
        {"w": pad(w)},
        [{"w": pad(g["w"])} for g in grads],
        pass_params=False,
    )
    for step in range(4):
        close(padded[step]["w"][:rows, :cols], real[step]["w"], rtol=1e-5, atol=1e-8)
        mask = np.ones((prow, pcol), bool)
        mask[:rows, :cols] = False
        np.testing.assert_array_equal(padded[step]["w"][mask], 0.0)


# 4. Before start_preconditioning_step: the matrix update is the graft direction with momentum; vectors and
#    scalars are optax.adamw's updates throughout.
@pytest.mark.parametrize("graft", GRAFTS)
def test_before_start_is_graft_and_vectors_are_adamw(graft):
    lr, beta1, beta2, deps, wd, start, steps = 0.05, 0.8, 0.9, 1e-8, 0.1, 4, 5
    params = {"w": rand((6, 8), 0), "b": rand((8,), 1), "s": rand((), 2), "stk": {"v": rand((3, 5), 3)}}
    grads = grads_seq(params, steps)
    tx = reference_shampoo(
        lr,
        block_size=3,
        is_stacked={"w": False, "b": False, "s": False, "stk": True},
        beta1=beta1,
        beta2=beta2,
        diagonal_epsilon=deps,
        weight_decay=wd,
        start_preconditioning_step=start,
        graft_type=graft,
    )
    ups, _ = run(tx, params, grads)

    gw = [np.asarray(g["w"], np.float64) for g in grads]
    w = np.asarray(params["w"], np.float64)
    grafted = []
    for t in range(1, start):
        sq = [x**2 for x in gw[:t]]
        gr = {
            "sgd": gw[t - 1],
            "adagrad": gw[t - 1] / (np.sqrt(sum(sq)) + deps),
            "rmsprop": gw[t - 1] / (np.sqrt(ema(sq, beta2, t)) + deps),
            "adam": gw[t - 1] / (np.sqrt(ema(sq, beta2, t) / (1 - beta2**t)) + deps),
        }[graft]
        grafted.append(gr)
        expected = -lr * (ema(grafted, beta1, t) / (1 - beta1**t) + wd * w)
        close(ups[t - 1]["w"], expected)
    # From the start step on, the preconditioner changes the direction.
    assert not np.allclose(
        ups[start - 1]["w"],
        hand_single_block(
            grads=[g["w"] for g in grads[:start]],
            param=w,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            graft=graft,
            deps=deps,
            wd=wd,
            start=10**6,
        )[start - 1],
        rtol=1e-3,
    )

    vec = lambda tree: {"b": tree["b"], "s": tree["s"], "v": tree["stk"]["v"]}
    adamw = optax.adamw(lr, b1=beta1, b2=beta2, eps=deps, weight_decay=wd)
    ref, _ = run(adamw, vec(params), [vec(g) for g in grads])
    for step in range(steps):
        for k in ("b", "s", "v"):
            close(vec(ups[step])[k], ref[step][k], rtol=1e-6, atol=0)


# 5. A stacked (L, R, C) leaf equals L separate 2-D leaves (is_stacked as a prefix tree); an N-D leaf equals its
#    2-D reshape, stacked or not.
def test_stacked_equals_separate_layers():
    stacked = {"layers": {"w": rand((3, 6, 10), 0), "b": rand((3, 10), 1)}, "emb": rand((5, 7), 2)}
    kw = dict(block_size=4, beta1=0.9, weight_decay=0.01, graft_type="adam", nesterov=True)
    grads = grads_seq(stacked, 3)

    def unstack(tree):
        out = {"emb": tree["emb"]}
        for i in range(3):
            out[f"w{i}"] = tree["layers"]["w"][i]
            out[f"b{i}"] = tree["layers"]["b"][i]
        return out

    ups_st, _ = run(reference_shampoo(0.1, is_stacked={"layers": True, "emb": False}, **kw), stacked, grads)
    ups_sep, _ = run(reference_shampoo(0.1, **kw), unstack(stacked), [unstack(g) for g in grads])
    for a, b in zip(ups_st, ups_sep, strict=True):
        for k, x in unstack(a).items():
            close(x, b[k], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("is_stacked", [False, True])
def test_nd_leaf_equals_2d_reshape(is_stacked):
    shape = (2, 4, 3, 10) if is_stacked else (4, 3, 10)
    flat = (2, 12, 10) if is_stacked else (12, 10)
    x = rand(shape, 0)
    kw = dict(block_size=5, is_stacked=is_stacked, beta1=0.9, graft_type="rmsprop")
    grads = grads_seq({"x": x}, 3)
    nd, _ = run(reference_shampoo(0.1, **kw), {"x": x}, grads)
    two, _ = run(reference_shampoo(0.1, **kw), {"x": x.reshape(flat)}, [{"x": g["x"].reshape(flat)} for g in grads])
    for a, b in zip(nd, two, strict=True):
        assert a["x"].shape == shape
        close(a["x"].reshape(flat), b["x"], rtol=1e-6, atol=1e-9)


# 6. Variants (nesterov, weight decay, compute steps, start step, graft_beta2, exponent) against the closed-form
#    single-block run; and the roots in the state are refreshed on the right steps only.
VARIANTS = [
    dict(graft="sgd", beta1=0.0, every=3),
    dict(graft="adam", beta1=0.9, nesterov=True),
    dict(graft="rmsprop", beta1=0.5, wd=0.1, every=2, start=3),
    dict(graft="adagrad", beta1=0.9, nesterov=True, wd=0.05, graft_beta2=0.9, p=2, every=3, start=2),
    dict(graft="adam", beta1=0.9, graft_beta2=0.99, every=3, wd=0.02),
]


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_variants_match_closed_form(cfg):
    lr, beta2, steps = 0.1, 0.9, 7
    w = rand((6, 9), 0)
    grads = grads_seq({"w": w}, steps)
    tx = reference_shampoo(
        lr,
        block_size=9,
        beta1=cfg["beta1"],
        beta2=beta2,
        weight_decay=cfg.get("wd", 0.0),
        start_preconditioning_step=cfg.get("start", 1),
        preconditioning_compute_steps=cfg.get("every", 1),
        graft_type=cfg["graft"],
        graft_beta2=cfg.get("graft_beta2"),
        nesterov=cfg.get("nesterov", False),
        exponent_override=cfg.get("p", 0),
    )
    ups, _ = run(tx, {"w": w}, grads)
    expected = hand_single_block(
        [g["w"] for g in grads],
        w,
        lr=lr,
        beta1=cfg["beta1"],
        beta2=beta2,
        graft=cfg["graft"],
        graft_beta2=cfg.get("graft_beta2"),
        wd=cfg.get("wd", 0.0),
        start=cfg.get("start", 1),
        every=cfg.get("every", 1),
        p=cfg.get("p", 4),
        nesterov=cfg.get("nesterov", False),
    )
    for step in range(steps):
        close(ups[step]["w"], expected[step])


@pytest.mark.parametrize(("start", "every", "refresh_steps"), [(1, 3, {1, 4, 7}), (2, 3, {2, 5})])
def test_roots_refreshed_on_the_right_steps(start, every, refresh_steps):
    beta2, meps, steps = 0.9, 1e-6, 7
    w = rand((5, 4), 0)
    grads = grads_seq({"w": w}, steps)
    tx = reference_shampoo(
        0.1,
        block_size=8,
        beta2=beta2,
        matrix_epsilon=meps,
        start_preconditioning_step=start,
        preconditioning_compute_steps=every,
    )
    _, states = run(tx, {"w": w}, grads)
    gw = [np.asarray(g["w"], np.float64) for g in grads]
    for t in range(1, steps + 1):
        assert int(states[t - 1].count) == t
        block = states[t - 1].matrix[0].blocks[0][0]
        close(block.left, ema([x @ x.T for x in gw[:t]], beta2, t), rtol=1e-12, atol=0)  # statistics every step
        refreshed = [k for k in refresh_steps if k <= t]
        if not refreshed:
            np.testing.assert_array_equal(block.left_root, np.eye(5))
            np.testing.assert_array_equal(block.right_root, np.eye(4))
            continue
        s = max(refreshed)
        close(block.left_root, psd_power(ema([x @ x.T for x in gw[:s]], beta2, s), 4, meps), rtol=1e-9, atol=1e-12)
        close(block.right_root, psd_power(ema([x.T @ x for x in gw[:s]], beta2, s), 4, meps), rtol=1e-9, atol=1e-12)
        if t not in refresh_steps:  # held over unchanged from the previous step
            prev = states[t - 2].matrix[0].blocks[0][0]
            np.testing.assert_array_equal(block.left_root, prev.left_root)
            np.testing.assert_array_equal(block.right_root, prev.right_root)


# Odds and ends: dtypes, errors, beta1 == 0 with nesterov.
def test_update_dtype_follows_params():
    params = {"w": rand((6, 5), 0, jnp.bfloat16), "b": rand((5,), 1, jnp.bfloat16), "v": rand((4, 4), 2)}
    tx = reference_shampoo(0.1, block_size=4, weight_decay=0.1)
    state = tx.init(params)
    u, _ = tx.update(grads_seq(params, 1)[0], state, params)
    assert u["w"].dtype == jnp.bfloat16 and u["b"].dtype == jnp.bfloat16 and u["v"].dtype == jnp.float32
    assert state.matrix[0] is None and state.matrix[2].blocks[0][0].left.dtype == np.float64  # leaves: b, v, w


def test_errors():
    with pytest.raises(ValueError, match="graft_type"):
        reference_shampoo(0.1, block_size=4, graft_type="adafactor")
    params = {"w": rand((4, 4), 0)}
    tx = reference_shampoo(0.1, block_size=4, weight_decay=0.1)
    with pytest.raises(ValueError, match="params"):
        tx.update(params, tx.init(params))


def test_nesterov_with_zero_beta1_is_plain_direction():
    w = rand((6, 7), 0)
    grads = grads_seq({"w": w}, 3)
    a, _ = run(reference_shampoo(0.1, block_size=4, beta1=0.0, nesterov=True), {"w": w}, grads, pass_params=False)
    b, _ = run(reference_shampoo(0.1, block_size=4, beta1=0.0), {"w": w}, grads, pass_params=False)
    for x, y in zip(a, b, strict=True):
        close(x["w"], y["w"], rtol=1e-7, atol=0)
