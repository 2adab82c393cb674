"""Shared test helpers: tree comparisons whose failures name the leaf's key path, a small NNX GPT with one stacked
layer group (``blocks``), its training batches, an unsharded reference training loop, and loading a repository
script as a module.

Imported as ``helpers``: pytest puts ``tests/`` on ``sys.path`` for the test modules, and the worker scripts run
as ``python tests/<worker>.py`` have it as their script directory. A ``python -c`` child gets it from
:func:`child_pythonpath`. Importing this module touches no device (the multi-process workers import it before
``vj.distributed.initialize``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import vescale_jax as vj

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# --- Tree comparisons ------------------------------------------------------------------------------------------


def _pairs(got: Any, want: Any, what: str) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(key path, got leaf, want leaf)`` for every leaf, paths from ``want``; ``got`` may be any tree (or list)
    with as many leaves."""
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    leaves = jax.tree.leaves(got)
    prefix = f"{what}: " if what else ""
    assert len(leaves) == len(flat), f"{prefix}{len(leaves)} leaves, expected {len(flat)}"
    return [
        (f"{prefix}{jax.tree_util.keystr(path)}", np.asarray(g), np.asarray(w))
        for (path, w), g in zip(flat, leaves, strict=True)
    ]


def assert_trees_close(got: Any, want: Any, *, rtol: float = 1e-5, what: str = "") -> None:
    """Every leaf within ``rtol`` of the reference, relative to the reference leaf's largest magnitude:
    ``max|got - want| <= rtol * max|want|`` (NaN fails).

    Args:
      got: the tree (or flat list) under test.
      want: the reference tree; its key paths name the leaves in the failure message.
      rtol: the bound on the relative difference.
      what: prefix of the failure message.
    """
    for name, g, w in _pairs(got, want, what):
        assert g.shape == w.shape, f"{name}: shape {g.shape}, expected {w.shape}"
        wide = np.complex128 if np.iscomplexobj(g) or np.iscomplexobj(w) else np.float64
        g, w = g.astype(wide), w.astype(wide)
        err = np.max(np.abs(g - w), initial=0.0) / max(np.max(np.abs(w), initial=0.0), 1e-30)
        _record(name, float(err), rtol)
        assert err <= rtol, f"{name}: max|diff|/max|ref| = {err:.2e} > {rtol:.0e}"


def _record(name: str, err: float, bound: float) -> None:
    """With ``VESCALE_JAX_RECORD_ERRORS=path``, appends the measured error of a comparison as one JSON line
    (the test, the leaf, the error, the bound asserted): the figures behind a closing note or a doc."""
    path = os.environ.get("VESCALE_JAX_RECORD_ERRORS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, "leaf": name, "error": err, "bound": bound}) + "\n")


def assert_trees_equal(got: Any, want: Any, *, what: str = "") -> None:
    """Bit for bit: the same tree structure, and every leaf of the same shape, dtype and bytes (``-0.0`` differs
    from ``0.0``, NaN payloads count).

    Args:
      got: the tree under test (a leaf alone is a tree too).
      want: the reference tree; its key paths name the leaves in the failure message.
      what: prefix of the failure message.
    """
    prefix = f"{what}: " if what else ""
    assert jax.tree.structure(got) == jax.tree.structure(want), (
        f"{prefix}tree structure {jax.tree.structure(got)}, expected {jax.tree.structure(want)}"
    )
    for name, g, w in _pairs(got, want, what):
        assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{name}: {g.dtype}{g.shape}, expected {w.dtype}{w.shape}"
        if g.tobytes() != w.tobytes():
            np.testing.assert_array_equal(g, w, err_msg=name)  # a readable diff when the values differ
            raise AssertionError(f"{name}: equal values but different bits (signed zeros or NaN payloads)")


# --- A small GPT -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of the test GPT; the defaults are widths that no tested device count divides."""

    vocab: int = 257
    max_len: int = 16
    d_model: int = 20
    num_heads: int = 2
    num_layers: int = 3
    d_ff: int = 52


class Block(nnx.Module):
    """Pre-norm block: causal self-attention (``ln1``, ``qkv``, ``proj``) and a GELU MLP (``ln2``, ``up``, ``down``)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_ff
        self.heads = cfg.num_heads
        self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(d, d, rngs=rngs)
        self.up, self.down = nnx.Linear(d, f, rngs=rngs), nnx.Linear(f, d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        heads = self.qkv(self.ln1(x)).reshape(b, t, 3 * self.heads, d // self.heads)
        q, k, v = jnp.split(heads, 3, axis=2)
        x = x + self.proj(jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d))
        return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))


class GPT(nnx.Module):
    """Embeddings ``embed`` and ``pos``, the stacked group ``blocks`` (looped with ``vj.flax.nnx_scan_layers``),
    ``ln_f`` and an untied ``head``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.max_len, cfg.d_model)))

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = stack(rngs)
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        return self.head(self.ln_f(vj.flax.nnx_scan_layers(self.blocks, x)))


def abstract_model(cfg: GPTConfig) -> tuple[nnx.GraphDef, nnx.State]:
    """``(graphdef, parameter shapes)``, allocating nothing."""
    return nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))


def init_params(cfg: GPTConfig, key: jax.Array) -> nnx.State:
    """The parameters drawn from ``key`` (a function of the key, for ``vj.init_sharded``)."""
    return nnx.split(GPT(cfg, rngs=nnx.Rngs(params=key)))[1]


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def muon_dimension_numbers(params: nnx.State) -> nnx.State:
    """Muon for the block kernels (``(L, p, q)``: one matrix per layer) and the head; AdamW (``None``) for the rest."""

    def leaf(path, _):
        name = vj.plan_path(path)
        if name.startswith("blocks/") and name.endswith("kernel"):
            return optax.contrib.MuonDimensionNumbers(reduction_axis=1, output_axis=2)
        return optax.contrib.MuonDimensionNumbers() if name == "head/kernel" else None

    return jax.tree_util.tree_map_with_path(leaf, params)


# --- Training data and the unsharded reference -----------------------------------------------------------------

#: Byte tokens (< 256) of a fixed text: Python's ``inspect`` module source.
TEXT = np.frombuffer(inspect.getsource(inspect).encode()[:100_000], np.uint8).astype(np.int32)


def edge_block_params(seed: int = 0) -> dict[str, Any]:
    """A small fp32 tree with edge blocks everywhere (37, 11, 5, 6*4, 20, 52 are not multiples of 4), a
    stacked group ``layers`` with a matrix and a vector leaf, an N-D leaf (viewed as 24 x 5), a small square
    matrix and vectors: the blocked optimizers' and relayouts' test tree."""
    rng = np.random.default_rng(seed)
    shapes = {
        "a": {"w": (37, 11), "b": (11,)},
        "b": {"w": (11, 5), "v": (6, 4, 5)},
        "layers": {"w": (3, 20, 52), "b": (3, 52)},
        "head": {"w": (4, 4)},
    }
    return jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s), jnp.float32), shapes, is_leaf=lambda x: isinstance(x, tuple)
    )


def batches(n: int = 20, batch: int = 24, seq: int = 16, seed: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """``n`` next-token batches ``{"x", "y"}`` of ``(batch, seq)`` windows of :data:`TEXT` (the same for a seed)."""
    rng = np.random.default_rng(seed)
    for _ in range(n):
        start = rng.integers(0, len(TEXT) - seq - 1, batch)
        window = np.stack([TEXT[s : s + seq + 1] for s in start])
        yield {"x": window[:, :-1], "y": window[:, 1:]}


def reference_run(
    params: Any,
    model_fn: Callable[[Any, jax.Array], jax.Array],
    tx: optax.GradientTransformation,
    data: Iterable[dict[str, np.ndarray]],
) -> tuple[Any, list[float]]:
    """Unsharded training under ``jax.jit``: the final parameters and the loss of every step."""

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(model_fn(p, batch["x"]), batch["y"]))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for batch in data:
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return params, losses


# --- Scripts of the repository ---------------------------------------------------------------------------------


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[str]]:
    """Collects one name per program this process gets compiled while the context is open (the function JAX
    names in the event, e.g. ``jit(slice)``). JAX records the event around its compile-or-read-the-persistent-cache
    call, so an executable that tests/conftest.py's persistent cache hands back (compiled by an earlier test) is
    counted as well."""
    compiles: list[str] = []

    def on_duration(name: str, *_: Any, **kwargs: Any) -> None:
        if name == BACKEND_COMPILE:
            compiles.append(str(kwargs.get("fun_name", name)))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)


def load_script(relative_path: str) -> ModuleType:
    """A script of the repository (e.g. ``benchmarks/muon.py``) imported as a module, without touching
    ``sys.path`` (so it must not import its siblings)."""
    path = os.path.join(ROOT, relative_path)
    name = "script_" + os.path.splitext(relative_path)[0].replace(os.sep, "_").replace("/", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def child_pythonpath(*dirs: str) -> dict[str, str]:
    """The environment of a child Python process that imports ``dirs`` (absolute), ``tests/`` and the package of
    this checkout before anything on the parent's ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*dirs, HERE, ROOT, env.get("PYTHONPATH")) if p)
    return env
