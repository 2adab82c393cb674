"""Layer bodies of ``vj.scan_layers`` / ``vj.flax.nnx_scan_layers`` that close over arrays of any dtype, as a real
model's do: int32 segment ids and a bool mask (batch-shaped, varying over the data axes), int32 ``vj.positions``
(varying over a context axis), PRNG keys (one the same on every device, per-example ones varying over the data
axes), an int32 permutation and a float scale computed from the parameters (the same on every device; the scale's
gradient flows through the closure) and the float embeddings (batch-shaped, gradient too). Loss and gradients of
one step match the same model run unsharded (1e-5, fp32) under FSDP on 1, 3 and 8 devices (with prefetch, kept
layers, remat), HSDP, TP and a context axis (K / V kept or gathered again)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_trees_close
from jax.sharding import PartitionSpec as P

import vescale_jax as vj

V, D, H, F, L, B = 19, 12, 2, 20, 3, 24
slow = pytest.mark.slow


def params_of(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    shapes = {
        "embed": (V, D),
        "scale": (D,),
        "blocks": {
            "q": (L, D, D),
            "kv": (L, D, 2 * D),
            "o": (L, D, D),
            "seg": (L, 3, D),
            "up": (L, D, F),
            "down": (L, F, D),
        },
        "head": (D, V),
    }
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 1 else 1), jnp.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def model(p, tok, tgt, seg, rid, *, attend=False, dropout=False, remat=False, tensor=None):
    """Next-token loss of a stack of layers whose body closes over ``seg`` (int32, a per-layer table's index and,
    with ``attend``, ``vj.attention``'s segment ids), ``mask`` (bool), ``pos`` (int32 ``vj.positions``, rotary
    angles), ``perm`` (int32, from the parameters), ``scale`` and ``x0`` (float, differentiable) and, with
    ``dropout``, a key the same everywhere (a dropout mask) and per-example keys from the row ids ``rid`` (a
    per-example factor). The MLP is Megatron-split over ``tensor`` when given."""
    b, t = tok.shape
    c = D // H
    pos = vj.positions(t)
    mask = seg > 0
    perm = jnp.argsort(p["scale"])
    scale = 1.0 + 0.1 * jnp.tanh(p["scale"])
    x0 = p["embed"][tok]
    key = jax.random.key(5)
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, rid)
    freq = np.float32(0.3) ** np.arange(c // 2, dtype=np.float32)

    def rotate(x):  # (b, t, heads, c): angles from the closed-over int positions
        ang = pos.astype(jnp.float32)[:, None] * freq
        cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
        x1, x2 = jnp.split(x, 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

    def block(lp, h):
        x = (h * scale)[..., perm] + lp["seg"][seg]
        q = rotate((x @ lp["q"]).reshape(b, t, H, c))
        if attend:
            k, v = jnp.split((x @ lp["kv"]).reshape(b, t, 2 * H, c), 2, axis=2)
            q = vj.attention(q, rotate(k), v, causal=True, segment_ids=seg)
        h = h + jnp.tanh(q.reshape(b, t, D)) @ lp["o"] + 0.1 * x0
        y = jnp.tanh(h @ lp["up"]) @ lp["down"]
        y = y if tensor is None else jax.lax.psum(y, tensor)
        y = jnp.where(mask[..., None], y, 0.5 * y)
        if dropout:
            y = jnp.where(
                jax.random.bernoulli(key, 0.75, (b, 1, D)), y, 0.0
            )  # per example (a small draw compiles fast)
            y = y * (0.5 + jax.vmap(lambda k: jax.random.uniform(k, ()))(row_keys))[:, None, None]
        return h + y

    h = vj.scan_layers(jax.checkpoint(block) if remat else block, p["blocks"], x0)
    logp = jax.nn.log_softmax(h @ p["head"], axis=-1)
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    return vj.batch_mean(nll, axis=None)


def batch_of(seq: int, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, V, size=(B, seq + 1)).astype(np.int32)
    seg = np.sort(rng.integers(0, 3, size=(B, seq)), axis=1).astype(np.int32)  # up to 3 documents per row
    return {"x": tok[:, :-1], "y": tok[:, 1:], "seg": seg, "rid": np.arange(B, dtype=np.int32) * 7 + 3}


def _args(b: dict) -> tuple:
    return b["x"], b["y"], b["seg"], b["rid"]


@functools.partial(jax.jit, static_argnames=("attend", "dropout"))
def reference(params, batch, *, attend, dropout):
    """The unsharded model's loss and gradients (remat changes no value: the reference runs without)."""
    return jax.value_and_grad(lambda p: model(p, *_args(batch), attend=attend, dropout=dropout))(params)


def _mesh(shape, names):
    n = int(np.prod(shape))
    if n > len(jax.devices()):
        pytest.skip(f"needs {n} devices, {len(jax.devices())} available")
    return jax.make_mesh(
        shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(names), devices=jax.devices()[:n]
    )


_TP = {"up": P(None, None, "tensor"), "down": P(None, "tensor", None)}
CP = ("fsdp", "context")

CASES = [
    pytest.param((1,), ("fsdp",), {}, {}, id="fsdp1"),
    pytest.param((3,), ("fsdp",), {}, {}, id="fsdp3"),
    pytest.param((8,), ("fsdp",), {}, {"attend": True, "dropout": True}, id="fsdp8-attend-dropout"),
    pytest.param((3,), ("fsdp",), {"prefetch": True}, {"dropout": True}, id="fsdp3-prefetch-dropout"),
    pytest.param((3,), ("fsdp",), {"reshard_after_forward": False}, {}, id="fsdp3-keep", marks=slow),
    pytest.param(
        (3,), ("fsdp",), {"reshard_after_forward": False, "prefetch": True}, {}, id="fsdp3-keep-prefetch", marks=slow
    ),
    pytest.param((3,), ("fsdp",), {}, {"remat": True}, id="fsdp3-remat", marks=slow),
    pytest.param((2, 2), ("replica", "fsdp"), {"data_axes": ("replica", "fsdp")}, {"dropout": True}, id="hsdp2x2"),
    pytest.param((2, 2), ("fsdp", "tensor"), {}, {"tensor": "tensor"}, id="tp2x2"),
    pytest.param((2, 4), CP, {"context_axis": "context"}, {"attend": True, "seq": 16}, id="cp2x4-kv-keep"),
    pytest.param(
        (1, 3),
        CP,
        {"context_axis": "context", "context_kv": "regather", "prefetch": True},
        {"attend": True, "dropout": True, "seq": 12},
        id="cp1x3-regather-prefetch-dropout",
        marks=slow,
    ),
    pytest.param(
        (2, 2),
        CP,
        {"context_axis": "context"},
        {"attend": True, "dropout": True, "remat": True},
        id="cp2x2-remat-dropout",
    ),
]


@pytest.mark.parametrize("shape,names,step_kw,model_kw", CASES)
def test_closures_of_any_dtype_give_the_unsharded_gradients(shape, names, step_kw, model_kw):
    """Loss and gradients of one step within 1e-5 of the unsharded model's."""
    mesh = _mesh(shape, names)
    model_kw = dict(model_kw)
    batch = batch_of(model_kw.pop("seq", 8))
    params = params_of()
    want_loss, want = reference(
        params, batch, attend=model_kw.get("attend", False), dropout=model_kw.get("dropout", False)
    )
    tp = (lambda path, leaf: _TP.get(path[-1].key)) if "tensor" in names else None
    plan = vj.plan(params, mesh, axis="fsdp", stacked=("blocks",), tp=tp)

    @vj.fsdp(donate=False, **step_kw)
    def step(sp, _, b):
        return jax.value_and_grad(lambda q: vj.apply(lambda r, *a: model(r, *a, **model_kw), q, *_args(b)))(sp)

    loss, grads = step(vj.shard(params, plan), None, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_trees_close(vj.unshard(grads), want, rtol=1e-5)


# --- NNX: vj.flax.nnx_scan_layers with a layer function closing over ids, a mask and positions -----------------


class Layer(nnx.Module):
    """One layer: a projection plus a per-segment bias, gated by a mask, shifted by positions."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.seg = nnx.Param(0.3 * jax.random.normal(rngs.params(), (3, D)))

    def __call__(self, h, seg, mask, pos):
        y = jnp.tanh(self.proj(h) + self.seg[seg] + jnp.sin(pos.astype(jnp.float32))[:, None])
        return h + jnp.where(mask[..., None], y, -y)


class Net(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)

        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(r: nnx.Rngs) -> Layer:
            return Layer(rngs=r)

        self.layers = stack(rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tok, seg):
        pos, mask = vj.positions(tok), seg > 0
        h = vj.flax.nnx_scan_layers(self.layers, self.embed(tok), lambda layer, c: layer(c, seg, mask, pos))
        return self.head(h)


def _nnx_loss(logits, tgt):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tgt[..., None], axis=-1))


@pytest.mark.parametrize(
    "m,step_kw",
    [(1, {}), (3, {}), (8, {}), (3, {"prefetch": True}), (3, {"reshard_after_forward": False})],
    ids=["m1", "m3", "m8", "m3-prefetch", "m3-keep"],
)
def test_nnx_layers_closing_over_ints_give_the_unsharded_gradients(m, step_kw):
    mesh = _mesh((m,), ("fsdp",))
    graphdef, params = nnx.split(Net(rngs=nnx.Rngs(0)))
    b = batch_of(8)
    ref = jax.jit(jax.value_and_grad(lambda p, b: _nnx_loss(nnx.merge(graphdef, p)(b["x"], b["seg"]), b["y"])))
    want_loss, want = ref(params, b)
    plan = vj.plan(params, mesh, stacked=("layers",))

    @vj.fsdp(donate=False, **step_kw)
    def step(sp, _, b):
        return jax.value_and_grad(lambda q: _nnx_loss(vj.flax.nnx_apply(graphdef, q, b["x"], b["seg"]), b["y"]))(sp)

    loss, grads = step(vj.shard(params, plan), None, b)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_trees_close(vj.unshard(grads), want, rtol=1e-5)


# --- A layer cut in two halves (step/_layer_split): an int value crosses the cut -------------------------------


def _cut_params(seed=0, d=128, f=512):
    rng = np.random.default_rng(seed)
    g = lambda *s: jnp.asarray(rng.standard_normal(s) / np.sqrt(s[-2] if len(s) > 2 else 1), jnp.float32)
    return {"layers": {"a": g(L, d, f), "b": g(L, f, d), "s": 1.0 + 0.1 * g(L, d), "c": g(L, d, d)}, "head": g(d, 4)}


def _cut_model(p, x, seg):
    mask = seg % 2 == 0

    def body(q, h):
        idx = (seg + jnp.argmax(h, axis=-1).astype(jnp.int32)) % 3  # int, from the carry: crosses the cut
        h = h * q["s"]
        h = h + jnp.tanh(h @ q["a"]) @ q["b"]  # the first half reads a and b
        y = jnp.sin(h @ q["c"]) * (1.0 + idx.astype(h.dtype))[:, None]  # the second half reads c
        return h + jnp.where(mask[:, None], y, -y)

    return vj.batch_mean((vj.scan_layers(body, p["layers"], x) @ p["head"]) ** 2, axis=None)


def test_a_layer_cut_in_two_with_int_values_across_the_cut(monkeypatch):
    from vescale_jax.step import _scan_layers as _layers

    mesh = _mesh((3,), ("fsdp",))
    tree = _cut_params()
    rng = np.random.default_rng(2)
    b = {"x": rng.standard_normal((B, 128)).astype(np.float32), "seg": rng.integers(0, 5, B).astype(np.int32)}
    want_loss, want = jax.jit(jax.value_and_grad(_cut_model))(tree, b["x"], b["seg"])
    plan = vj.plan(tree, mesh, stacked=("layers",), split="leaves")
    calls = []
    real = _layers._split
    monkeypatch.setattr(_layers, "_split", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])

    @vj.fsdp(donate=False)
    def step(sp, _, b):
        return jax.value_and_grad(lambda q: vj.apply(_cut_model, q, b["x"], b["seg"]))(sp)

    loss, grads = step(vj.shard(tree, plan), None, b)
    assert calls and calls[0] is not None, "the layer was not cut"
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_trees_close(vj.unshard(grads), want, rtol=1e-5)
