"""transformers' own Flax GPT-2 and Llama (random configs, nothing downloaded) train under ``vj.fsdp`` with the
default plan: one bucket per layer found in Hugging Face's nested trees, the tied embedding gathered at each use,
and the run equal to the same model trained unsharded."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from helpers import assert_trees_close

import vescale_jax as vj
from vescale_jax import testing

transformers = pytest.importorskip("transformers")

B, T = 24, 8


@pytest.fixture(autouse=True)
def standard_promotion():
    # transformers' Flax models mix bool / int32 / float inputs (attention masks): they need JAX's standard
    # dtype promotion, which the rest of the suite runs strict.
    with jax.numpy_dtype_promotion("standard"):
        yield


def gpt2(*, layers=2, vocab=97, width=32, tied=True, seed=0):
    cfg = transformers.GPT2Config(
        vocab_size=vocab, n_positions=16, n_embd=width, n_layer=layers, n_head=4, tie_word_embeddings=tied
    )
    return transformers.FlaxGPT2LMHeadModel(cfg, seed=seed)


def llama(*, layers=2, vocab=97, tied=False, seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
    )
    return transformers.FlaxLlamaForCausalLM(cfg, seed=seed)


def batch(vocab, seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (B, T)).astype(np.int32)
    mask = np.ones((B, T), np.int32)
    pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()
    return ids, mask, pos


def xent(logits, ids):
    logits = logits[:, :-1].astype(jnp.float32)
    target = ids[:, 1:]
    return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, target[..., None], -1)[..., 0])


def run(model, *, mesh=None, steps=3):
    """Losses and step-1 gradients of AdamW on the HF module: under vj.fsdp with the default plan (``mesh``) or
    plain jax.jit (``mesh=None``)."""
    module = model.module
    ids, mask, pos = batch(model.config.vocab_size)
    tree = {"params": model.params}
    with jax.numpy_dtype_promotion("standard"):
        tx = optax.adamw(1e-2)
    if mesh is None:
        params, opt = tree, tx.init(tree)

        @jax.jit
        def step(params, opt, data):
            ids, mask, pos = data
            forward = lambda p: module.apply(p, ids, mask, pos, deterministic=True, return_dict=False)[0]
            with jax.numpy_dtype_promotion("standard"):
                loss, g = jax.value_and_grad(lambda p: xent(forward(p), ids))(params)
                up, opt = tx.update(g, opt, params)
                return optax.apply_updates(params, up), opt, loss, g

    else:
        plan = vj.plan(tree, mesh)
        params = vj.shard(tree, plan)
        opt = vj.init_opt_state(tx, params)

        @vj.fsdp
        def step(params, opt, data):
            ids, mask, pos = data

            def loss_of(p):
                out = vj.flax.linen_apply(module, p, ids, mask, pos, deterministic=True, return_dict=False)
                return xent(out[0], ids)

            with jax.numpy_dtype_promotion("standard"):
                loss, g = jax.value_and_grad(loss_of)(params)
                up, opt = tx.update(g, opt, params)
                return optax.apply_updates(params, up), opt, loss, g

    losses, first = [], None
    for _ in range(steps):
        params, opt, loss, g = step(params, opt, (ids, mask, pos))
        losses.append(float(loss))
        first = g if first is None else first
    unshard = (lambda x: x) if mesh is None else vj.unshard
    return np.array(losses), unshard(first), unshard(params)


@pytest.mark.parametrize(
    "kind, m",
    [
        pytest.param("gpt2", 3, id="gpt2-m3"),
        pytest.param("llama", 8, id="llama-m8"),
        pytest.param("gpt2", 8, id="gpt2-m8", marks=pytest.mark.slow),
        pytest.param("llama", 3, id="llama-m3", marks=pytest.mark.slow),
    ],
)
def test_hf_flax_model_trains_under_fsdp_as_unsharded(kind, m):
    model = gpt2() if kind == "gpt2" else llama()
    mesh = make_mesh(m)
    plan = vj.plan({"params": model.params}, mesh)
    layers = "transformer/h" if kind == "gpt2" else "model/layers"
    units = {b.unit for b in plan.buckets}
    assert {f"{layers}/0", f"{layers}/1"} <= units, units  # one bucket per layer, found inside the HF tree
    assert f"units: one per repeated layer of {layers}/0..1 (2 layers)" in plan.summary()
    want_losses, want_grads, _ = run(model)
    losses, grads, _ = run(model, mesh=mesh)
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6, atol=5e-7)
    assert_trees_close(grads, want_grads, rtol=2e-5, what=f"{kind} step-1 gradients")
    # (params after Adam steps are not compared: Adam divides gradients that are zero up to rounding, such as
    # GPT-2's key bias (softmax ignores it), by their own size, so their updates are rounding noise either way)


def _temp(model, m):
    """Per-device temp bytes of the compiled vj.fsdp train step of ``model`` on ``m`` devices."""
    module = model.module
    ids, mask, pos = batch(model.config.vocab_size)
    plan = vj.plan({"params": model.params}, make_mesh(m))
    params = vj.shard({"params": model.params}, plan)

    @vj.fsdp
    def step(params, opt, data):
        ids, mask, pos = data

        def loss_of(p):
            out = vj.flax.linen_apply(module, p, ids, mask, pos, deterministic=True, return_dict=False)
            return xent(out[0], ids)

        with jax.numpy_dtype_promotion("standard"):
            g = jax.grad(loss_of)(params)
            return jax.tree.map(lambda a, b: a - 0.01 * b, params, g), opt

    return testing.memory(step.lower(params, None, (ids, mask, pos)).compile()).temp


def test_tied_embedding_is_gathered_at_each_use_not_held_across_the_model():
    # 6-layer GPT-2, vocab 1000, width 256 on 8 devices: the tied table is read by the lookup and again by the
    # head; gathered at each use its temp stays near the untied model's (where wte and lm_head are two buckets).
    tied = _temp(gpt2(layers=6, vocab=1000, width=256, tied=True), 8)
    untied = _temp(gpt2(layers=6, vocab=1000, width=256, tied=False), 8)
    assert tied <= 1.2 * untied, (tied / 2**20, untied / 2**20)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_module_dtype_decides_the_matmul_dtype_under_mixed_precision(dtype):
    # Gathers carry bf16 either way; a Flax module with dtype=float32 (transformers' default) casts the leaves
    # back and multiplies in fp32, dtype=bfloat16 multiplies in bf16 (params stay fp32): as docs/scale.md says.
    model = transformers.FlaxGPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4),
        seed=0,
        dtype=getattr(jnp, dtype),
    )
    assert {x.dtype for x in jax.tree.leaves(model.params)} == {jnp.dtype(jnp.float32)}
    plan = vj.plan({"params": model.params}, make_mesh(2))

    @vj.fsdp(precision=vj.MixedPrecision(compute_dtype=jnp.bfloat16))
    def step(p, o, data):
        out = vj.flax.linen_apply(model.module, p, *data, deterministic=True, return_dict=False)[0]
        return p, o, out

    text = step.lower(vj.shard({"params": model.params}, plan), None, batch(97)).as_text()
    dots = re.findall(r"stablehlo.dot_general[^\n]*", text)
    kinds = {re.findall(r"tensor<[^>]*x(\w+)>", d)[0] for d in dots}
    assert dots and kinds == {"f32" if dtype == "float32" else "bf16"}, kinds
