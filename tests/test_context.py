"""Context parallelism composed with FSDP: ``vj.fsdp(..., context_axis=...)`` gives the unsharded model's losses
and parameters (5 AdamW steps) for a causal transformer that attends with ``vj.attention``, takes positions
from ``vj.positions`` and reduces over tokens with ``vj.batch_mean``; a hand-written token mix is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import vescale_jax as vj

V, D, H, NL, F = 23, 16, 4, 2, 32


def params_of(seq, seed=0, kv_heads=H):
    rng = np.random.default_rng(seed)
    c = D // H
    shapes = {
        "embed": (V, D),
        "pos": (seq, D),
        "blocks": {
            "q": (NL, D, D),
            "kv": (NL, D, 2 * kv_heads * c),
            "o": (NL, D, D),
            "up": (NL, D, F),
            "down": (NL, F, D),
        },
        "head": (D, V),
    }
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 1), jnp.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def rope(x, pos):
    """Rotary position embedding of ``x`` ``(b, t, n, c)`` at positions ``pos`` ``(t,)``."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    angle = pos.astype(jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def model(
    p,
    tok,
    tgt,
    seg=None,
    *,
    causal=True,
    kv_heads=H,
    dtype=jnp.float32,
    tensor=None,
    impl="all_gather",
    dropout=0.0,
    positions="vj",
):
    """A causal (or not) transformer, GQA with ``kv_heads < H``, packed documents with segment ids ``seg``, its
    MLP Megatron-split over ``tensor`` when given, dropout on the embeddings and each layer's attention output
    (a key closed over: the same on every device); the mean next-token cross-entropy over every token.

    ``positions``: how the model makes its positions: ``"vj"`` (``vj.positions``), or as written for one device:
    ``"arange"`` (the table indexed by ``jnp.arange(t)``), ``"slice"`` (``pos[:t]``), ``"rope"`` (``pos[:t]``
    and rotary embeddings of q and k from ``jnp.arange(t)`` made inside each scanned layer)."""
    b, t = tok.shape
    c = D // H
    table = {"vj": lambda: p["pos"][vj.positions(t)], "arange": lambda: p["pos"][jnp.arange(t)]}
    h = p["embed"][tok] + table.get(positions, lambda: p["pos"][:t])()
    drop = lambda key, x: x if not dropout else jnp.where(jax.random.bernoulli(key, 1 - dropout, x.shape), x, 0)
    h = drop(jax.random.key(11), h)
    # the layers close over the ids as floats: vj.scan_layers leaks an integer array its body closes over
    seg_f = None if seg is None else seg.astype(jnp.float32)

    def block(lp, h):
        lp = jax.tree.map(lambda w: w.astype(dtype), lp)
        x = h.astype(dtype)
        q = (x @ lp["q"]).reshape(b, t, H, c)
        k, v = jnp.split((x @ lp["kv"]).reshape(b, t, 2 * kv_heads, c), 2, axis=2)
        if positions == "rope":
            q, k = rope(q, jnp.arange(t)), rope(k, jnp.arange(t))
        ids = None if seg_f is None else seg_f.astype(jnp.int32)
        att = vj.attention(q, k, v, causal=causal, segment_ids=ids, implementation=impl).reshape(b, t, D)
        h = h + drop(jax.random.key(12), (att @ lp["o"]).astype(h.dtype))
        y = jnp.tanh(h.astype(dtype) @ lp["up"]) @ lp["down"]
        return h + (y if tensor is None else jax.lax.psum(y, tensor)).astype(h.dtype)

    h = vj.scan_layers(block, p["blocks"], h)
    logp = jax.nn.log_softmax(h @ p["head"], axis=-1)
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    return vj.batch_mean(nll, axis=None)


def data(batch, seq, seed=1):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, V, size=(batch, seq + 1)).astype(np.int32)
    return {"x": tok[:, :-1], "y": tok[:, 1:]}


def _args(b):
    return (b["x"], b["y"], b["seg"]) if "seg" in b else (b["x"], b["y"])


def reference(params, batches, tx, **kw):
    opt = tx.init(params)

    @jax.jit
    def step(p, o, b):
        loss, g = jax.value_and_grad(lambda q: model(q, *_args(b), **kw))(p)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: a float ** an int32 count
            u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    losses = []
    for b in batches:
        params, opt, loss = step(params, opt, b)
        losses.append(float(loss))
    return params, losses


def sharded(params, batches, tx, shape, names, *, balance="causal", precision=None, step_kw=None, **kw):
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(names))
    tp = None
    if "tensor" in names:  # the MLP column- then row-parallel
        tp = lambda path, leaf: {"up": P(None, None, "tensor"), "down": P(None, "tensor", None)}.get(path[-1].key)
        kw = {**kw, "tensor": "tensor"}
    plan = vj.plan(params, mesh, axis="fsdp", stacked=("blocks",), tp=tp)
    p = vj.shard(params, plan)
    opt = vj.init_opt_state(tx, p)

    step_kw = step_kw or {}

    def loss_of(q, b):
        return vj.apply(lambda r, *a: model(r, *a, **kw), q, *_args(b))

    @vj.fsdp(context_axis="context", balance=balance, precision=precision, **step_kw)
    def step(p, o, b):
        if step_kw.get("microbatches"):  # one micro-batch at a time through vj.accumulate
            loss, g = vj.accumulate(loss_of, p, b)
        else:
            loss, g = jax.value_and_grad(loss_of)(p, b)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction: a float ** an int32 count
            u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    losses = []
    for b in batches:
        p, opt, loss = step(p, opt, b)
        losses.append(float(loss))
    return vj.unshard(p), losses


def _compare(
    shape,
    names,
    *,
    batch=None,
    seq=16,
    tol=1e-5,
    steps=5,
    balance="causal",
    precision=None,
    packed=False,
    step_kw=None,
    **kw,
):
    if np.prod(shape) > len(jax.devices()):
        pytest.skip(f"needs {np.prod(shape)} devices")
    batch = batch or 2 * shape[0]
    params = params_of(seq, kv_heads=kw.get("kv_heads", H))
    batches = [data(batch, seq, seed=s) for s in range(steps)]
    if packed:  # packed documents: up to 3 documents per sequence
        rng = np.random.default_rng(7)
        for b in batches:
            b["seg"] = np.sort(rng.integers(0, 3, size=(batch, seq)), axis=1).astype(np.int32)
    tx = optax.adamw(1e-3, weight_decay=0.1)
    ref_p, ref_l = reference(params, batches, tx, **kw)
    got_p, got_l = sharded(
        params, batches, tx, shape, names, balance=balance, precision=precision, step_kw=step_kw, **kw
    )
    loss_err = max(abs(g - r) / abs(r) for g, r in zip(got_l, ref_l, strict=True))
    assert loss_err <= tol, (got_l, ref_l)
    errs = {}
    for (path, g), r in zip(jax.tree_util.tree_flatten_with_path(got_p)[0], jax.tree.leaves(ref_p), strict=True):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        errs[jax.tree_util.keystr(path)] = float(np.linalg.norm(g - r) / np.linalg.norm(r))
    assert max(errs.values()) <= tol, errs  # each leaf's relative error (norm of the difference / norm)
    return loss_err, max(errs.values())


CP = ("fsdp", "context")
slow = pytest.mark.slow


@pytest.mark.parametrize(
    "shape,names,kw",
    [
        pytest.param((2, 4), CP, {}, id="2x4-causal"),
        pytest.param((3, 2), CP, {}, id="3x2-causal-uneven", marks=slow),
        pytest.param((4, 2), CP, {}, id="4x2-causal", marks=slow),
        pytest.param((1, 8), CP, {}, id="1x8-causal", marks=slow),
        pytest.param((2, 4), CP, {"causal": False}, id="2x4-non-causal", marks=slow),
        pytest.param((3, 2), CP, {"causal": False, "balance": None}, id="3x2-non-causal-unbalanced", marks=slow),
        pytest.param((2, 4), CP, {"kv_heads": 2, "packed": True}, id="2x4-gqa-packed", marks=slow),
        # dropout: each device draws its tokens' part of the unsharded mask (batch rows and balanced positions)
        pytest.param((2, 4), CP, {"dropout": 0.25}, id="2x4-dropout"),
        pytest.param((1, 8), CP, {"dropout": 0.25, "balance": None}, id="1x8-dropout-unbalanced", marks=slow),
        pytest.param((2, 4), CP, {"balance": None}, id="2x4-causal-unbalanced", marks=slow),
        pytest.param((2, 2, 2), (*CP, "tensor"), {}, id="2x2x2-tensor", marks=slow),
        # the ring inside vj.scan_layers (the layer's backward replays its forward with positions typed anew)
        pytest.param((2, 4), CP, {"impl": "ring"}, id="2x4-causal-ring"),
        pytest.param((3, 2), CP, {"impl": "ring", "kv_heads": 2, "packed": True}, id="3x2-ring-gqa-packed", marks=slow),
        # positions as written for one device: jnp.arange(t) and pos[:t] mean the tokens' global positions
        pytest.param((2, 4), CP, {"positions": "rope"}, id="2x4-rope-arange"),
        pytest.param((3, 2), CP, {"positions": "rope", "kv_heads": 2, "packed": True}, id="3x2-rope-arange-packed"),
        pytest.param((2, 4), CP, {"positions": "arange", "balance": None}, id="2x4-arange-table-unbalanced"),
        pytest.param((1, 8), CP, {"positions": "rope", "impl": "ring"}, id="1x8-rope-arange-ring", marks=slow),
    ],
)
def test_context_parallel_steps_are_the_unsharded_models(shape, names, kw):
    """Losses and parameters after 5 AdamW steps within 1e-5 (relative) of the unsharded model's."""
    _compare(shape, names, **kw)


@pytest.mark.slow
def test_bf16_compute_under_context_parallelism_is_the_unsharded_bf16_model():
    """The blocks computing in bfloat16 (the reference too): the same losses and parameters up to bf16 rounding
    of values summed in another order."""
    with jax.numpy_dtype_promotion("standard"):  # jax.nn.dot_product_attention promotes bf16 logits to fp32
        _compare((2, 4), CP, dtype=jnp.bfloat16, tol=2e-3)


@pytest.mark.parametrize(
    "step_kw",
    [
        pytest.param({"prefetch": True}, id="prefetch"),
        pytest.param({"reshard_after_forward": False}, id="layers-kept"),
        pytest.param({"context_kv": "regather"}, id="regather"),
    ],
)
def test_kept_or_regathered_kv_in_every_scan_path(step_kw):
    """Each layer's gathered K / V (and packed documents' key segment ids) kept from forward for backward, on the
    prefetching and the layers-kept loops too, or gathered again: the unsharded model's losses and parameters."""
    _compare((2, 4), CP, step_kw=step_kw, kv_heads=2, packed=True, steps=3)


def _context_traffic(context_kv, seq=16, kv_heads=2):
    """Wire bytes per device of the step's collectives over the context axis alone, by kind, and the bytes of
    K and V gathered once over all layers ((cp - 1) / cp of them arrive from the other devices)."""
    params = params_of(seq, kv_heads=kv_heads)
    mesh = jax.make_mesh((2, 4), CP, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    plan = vj.plan(params, mesh, axis="fsdp", stacked=("blocks",))
    tx = optax.sgd(0.1)
    p = vj.shard(params, plan)

    @vj.fsdp(context_axis="context", context_kv=context_kv, donate=False)
    def step(p, o, b):
        g = jax.grad(lambda q: vj.apply(lambda r, *a: model(r, *a, kv_heads=kv_heads), q, *_args(b)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    ops = vj.testing.census(step.lower(p, vj.init_opt_state(tx, p), data(4, seq)).compile()).ops
    wire: dict[str, float] = {}
    for op in ops:
        if vj.testing.group_axes(op, mesh) == ("context",):
            wire[op.kind] = wire.get(op.kind, 0.0) + op.total_wire_bytes
    kv = NL * 2 * seq * 2 * kv_heads * (D // H) * 4  # 2 sequences per device, K and V, fp32
    return wire, kv * 3 / 4


def test_kept_kv_are_gathered_once_per_layer():
    """context_kv="keep" (the default): K and V all-gathered once per layer and their gradients reduce-scattered
    once: the ideal; "regather": gathered a second time when the backward recomputes the layer."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    kept, ideal = _context_traffic("keep")
    again, _ = _context_traffic("regather")
    assert kept["all-gather"] == pytest.approx(ideal), kept
    assert kept["reduce-scatter"] == pytest.approx(ideal), kept
    assert again["all-gather"] == pytest.approx(2 * ideal), again
    assert again["reduce-scatter"] == pytest.approx(ideal), again


def test_context_kv_must_be_keep_or_regather():
    with pytest.raises(ValueError, match=r"context_kv='save'.*'keep'.*'regather'"):
        vj.fsdp(lambda p, o, b: (p, o), context_axis="context", context_kv="save")


def _by_hand(q, k, v, *, causal=True, segment_ids=None, implementation=None):
    s = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.float32(np.sqrt(q.shape[-1]))  # refused: the line named
    if causal:
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, np.float32(-1e30))
    return jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("mix", ["attention", "mean", "shift"])
def test_a_hand_written_token_mix_is_refused_naming_its_line(monkeypatch, mix):
    """softmax(q @ k.T) @ v, a mean over the sequence or a shift under a context axis would see only this
    device's tokens: refused when the step is traced, naming the line and vj.attention."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    params = params_of(8)
    mesh = jax.make_mesh((2, 2), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    plan = vj.plan(params, mesh, axis="fsdp", stacked=("blocks",))
    if mix == "attention":
        monkeypatch.setattr(vj, "attention", _by_hand)
        fn, line = model, "_by_hand"
    elif mix == "mean":
        fn, line = (lambda p, x, y: jnp.mean(p["embed"][x], axis=1).sum()), "test_context.py"
    else:
        fn, line = (lambda p, x, y: vj.batch_mean(p["embed"][x][:, 1:], axis=None)), "test_context.py"

    @vj.fsdp(context_axis="context", donate=False)
    def step(p, o, b):
        return vj.apply(fn, p, b["x"], b["y"])

    with pytest.raises(ValueError, match=rf"(?s){line}.*context axis 'context'.*vj\.attention"):
        step(vj.shard(params, plan), None, data(4, 8))


def _positions_by_hand(p, x, y, how):
    t = x.shape[1]
    if how == "double":  # an iota twice the sequence's length
        pos = p["pos"][(jnp.arange(2 * t) // 2)[:t]]
    elif how == "offset":  # a cut of the table from an offset
        pos = p["pos"][1 : t + 1]
    elif how == "count":  # positions counted by a cumulative sum of ones along the sequence
        pos = p["pos"][jnp.cumsum(jnp.ones_like(x), axis=1)[0] - 1]
    else:  # positions within documents by a cumulative sum of the tokens' document starts
        pos = p["pos"][jnp.cumsum(x == 0, axis=1)[0]]
    return vj.batch_mean(p["embed"][x] + pos, axis=None)


@pytest.mark.parametrize("how", ["double", "offset", "count", "starts"])
def test_positions_that_cannot_be_told_are_refused_naming_vj_positions(how):
    """An iota, cut or cumulative sum along the sequence whose meaning under a context axis cannot be told (not
    jnp.arange(T) nor pos[:T]) is refused when the step is traced, naming its line and vj.positions; never silent."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    params = params_of(18)
    mesh = jax.make_mesh((2, 2), ("fsdp", "context"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    plan = vj.plan(params, mesh, axis="fsdp", stacked=("blocks",))

    @vj.fsdp(context_axis="context", donate=False)
    def step(p, o, b):
        return vj.apply(lambda q, x, y: _positions_by_hand(q, x, y, how), p, b["x"], b["y"])

    with pytest.raises(ValueError, match=r"(?s)test_context\.py.*context axis 'context'.*vj\.positions\(tokens"):
        step(vj.shard(params, plan), None, data(4, 8))


def test_a_context_parallel_run_restores_into_a_run_without_one_bit_for_bit(tmp_path):
    """Parameters are not sharded over the context axis: a checkpoint of a CP run (fsdp x context = 2 x 4) restores
    into a plan on 8 devices of fsdp alone bit for bit, parameters and AdamW state, and the next step there gives
    the CP run's next loss and parameters."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    seq = 16
    params = params_of(seq)
    batches = [data(8, seq, seed=s) for s in range(3)]
    tx = optax.adamw(1e-3, weight_decay=0.1)

    def run(plan, p, o, batch, **options):
        @vj.fsdp(**options)
        def step(p, o, b):
            loss, g = jax.value_and_grad(lambda q: vj.apply(model, q, b["x"], b["y"]))(p)
            with jax.numpy_dtype_promotion("standard"):
                u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o, loss

        return step(p, o, batch)

    cp_mesh = jax.make_mesh((2, 4), CP, axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    cp_plan = vj.plan(params, cp_mesh, axis="fsdp", stacked=("blocks",))
    p = vj.shard(params, cp_plan)
    o = vj.init_opt_state(tx, p)
    for b in batches[:2]:
        p, o, _ = run(cp_plan, p, o, b, context_axis="context")
    mngr = vj.checkpoint.Manager(tmp_path / "ckpt")
    mngr.save(2, params=p, opt_state=o)
    mngr.wait()

    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
    plan = vj.plan(params, mesh, axis="fsdp", stacked=("blocks",))
    template = vj.init_opt_state(tx, vj.shard(params, plan))
    got = mngr.restore(params=plan, opt_state=template)
    mngr.close()
    logical = lambda tree: jax.tree.map(
        lambda x: vj.unshard(x) if isinstance(x, vj.ShardedParams) else x,
        tree,
        is_leaf=lambda x: isinstance(x, vj.ShardedParams),
    )
    for a, b in zip(
        jax.tree.leaves(logical((p, o))), jax.tree.leaves(logical((got.params, got.opt_state))), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    p_cp, _, loss_cp = run(cp_plan, p, o, batches[2], context_axis="context")
    p_flat, _, loss_flat = run(plan, got.params, got.opt_state, batches[2])
    assert abs(float(loss_flat) - float(loss_cp)) <= 1e-5 * abs(float(loss_cp))
    for a, b in zip(jax.tree.leaves(vj.unshard(p_cp)), jax.tree.leaves(vj.unshard(p_flat)), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_micro_batches_under_context_parallelism_are_one_big_batch():
    """vj.fsdp(microbatches=2) with vj.accumulate on fsdp x context = 2 x 4: each micro-batch's sequences split
    over the context axis, the gradients summed over micro-batches: the unsharded step on the whole batch."""
    _compare((2, 4), CP, batch=8, steps=3, step_kw={"microbatches": 2})
