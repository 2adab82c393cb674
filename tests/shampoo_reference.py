"""Single-device reference blocked Shampoo (an Optax ``GradientTransformation``): the spec the distributed
Shampoo is tested against. Clarity over speed: Python loops over leaves, layers and blocks; statistics, roots
and block math in numpy float64; called eagerly (not under ``jit``).

Math, with ``t`` the step count (1 on the first update), ``bs = block_size``, ``p = exponent_override or 4``:

* ``is_stacked`` (a bool, or a pytree of bools with the params' structure or a prefix of it): True means the
  leaf's first dim is a layer dim; the leaf is L independent layers. The per-layer shape is the shape without
  that dim (the whole shape when not stacked).
* A *matrix leaf* has per-layer ndim >= 2. Each layer is viewed (row-major reshape) as a 2-D ``G`` of shape
  ``(R, C) = (prod(layer_shape[:-1]), layer_shape[-1])``, cut into blocks ``Gb``: rows ``[i*bs, min((i+1)*bs, R))``
  x cols ``[j*bs, min((j+1)*bs, C))`` (edge blocks are smaller, r x c). Every block keeps its own state:

  - ``L  = beta2*L  + (1-beta2) * Gb @ Gb.T``  (r x r, zeros at init)
  - ``Rs = beta2*Rs + (1-beta2) * Gb.T @ Gb``  (c x c, zeros at init)
  - roots, identity at init, refreshed (after the statistics update) when ``t >= start_preconditioning_step``
    and ``(t - start_preconditioning_step) % preconditioning_compute_steps == 0``:
    ``PL = inv_root(L)``, ``PR = inv_root(Rs)``, ``inv_root(A) = V @ diag((max(w, 0) + matrix_epsilon)**(-1/p)) @ V.T``
    with ``(w, V) = eigh(A)``.
  - graft direction, elementwise on the leaf's gradient ``g``, ``gb2 = graft_beta2 or beta2`` (``None`` -> beta2),
    graft state ``v`` (zeros, leaf shape):
    ``adam``: ``v = gb2*v + (1-gb2)*g**2``, ``graft = g / (sqrt(v / (1 - gb2**t)) + diagonal_epsilon)``;
    ``rmsprop``: same ``v``, ``graft = g / (sqrt(v) + diagonal_epsilon)``;
    ``adagrad``: ``v = v + g**2``, ``graft = g / (sqrt(v) + diagonal_epsilon)``;
    ``sgd``: ``graft = g`` (no ``v``). Anything else: ``ValueError``.
  - block direction: if ``t >= start_preconditioning_step``: ``D = PL @ Gb @ PR``,
    ``u_b = D * (||graft_b||_F / (||D||_F + 1e-16))``; else ``u_b = graft_b`` (the graft's elements of the block).
  - over the whole leaf (elementwise): ``mom = beta1*mom + (1-beta1)*u`` (zeros at init);
    nesterov: ``dir = beta1*mom/(1 - beta1**(t+1)) + (1-beta1)*u/(1 - beta1**t)``, else ``dir = mom/(1 - beta1**t)``.
  - ``update = -learning_rate * (dir + weight_decay * param)`` (decoupled weight decay; ``params`` must be passed
    to ``update`` when ``weight_decay != 0``), cast to the param's dtype (the gradient's when no params).
* Every other leaf (scalars, vectors, per-layer vectors of stacked leaves): exactly
  ``optax.adamw(learning_rate, b1=beta1, b2=beta2, eps=diagonal_epsilon, weight_decay=weight_decay)`` run on the
  list of those leaves (decay applies to all of them).

State (:class:`ReferenceShampooState`): ``count`` (int32, steps done); ``matrix``: a tuple over the flattened
leaves, ``None`` for non-matrix leaves and :class:`MatrixLeafState` otherwise (per-layer tuples of per-block
:class:`BlockState`, blocks in row-major block order, plus the leaf's graft ``v`` and momentum, float64); ``adam``:
the ``optax.adamw`` state over the list of non-matrix leaves.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

GRAFT_TYPES = ("adam", "rmsprop", "adagrad", "sgd")


class BlockState(NamedTuple):
    left: np.ndarray  # L, r x r
    right: np.ndarray  # Rs, c x c
    left_root: np.ndarray  # PL = inv_root(L), r x r
    right_root: np.ndarray  # PR = inv_root(Rs), c x c


class MatrixLeafState(NamedTuple):
    blocks: tuple  # blocks[layer][i * n_col_blocks + j] -> BlockState (one layer when not stacked)
    graft_v: np.ndarray | None  # leaf shape, float64; None for graft "sgd"
    mom: np.ndarray  # leaf shape, float64


class ReferenceShampooState(NamedTuple):
    count: jax.Array  # int32 scalar: number of updates done
    matrix: tuple  # per flattened leaf: MatrixLeafState, or None for leaves handled by adamw
    adam: Any  # optax.adamw state over the list of non-matrix leaves


def stacked_flags(is_stacked: Any, tree: Any) -> list[bool]:
    """``is_stacked`` (bool, or a prefix pytree of bools) broadcast to one bool per leaf of ``tree``."""
    full = jax.tree.map(lambda s, x: jax.tree.map(lambda _: bool(s), x), is_stacked, tree)
    return [bool(f) for f in jax.tree.leaves(full)]


def layer_shape(shape: tuple[int, ...], stacked: bool) -> tuple[int, ...]:
    if stacked:
        if len(shape) == 0:
            raise ValueError("a stacked leaf needs a leading layer dim; got a scalar")
        return tuple(shape[1:])
    return tuple(shape)


def is_matrix(shape: tuple[int, ...], stacked: bool) -> bool:
    return len(layer_shape(shape, stacked)) >= 2


def matrix_view(lshape: tuple[int, ...]) -> tuple[int, int]:
    """(R, C) = (prod of all but the last per-layer dim, last dim)."""
    return math.prod(lshape[:-1]), lshape[-1]


def block_ranges(n: int, bs: int) -> list[tuple[int, int]]:
    return [(s, min(s + bs, n)) for s in range(0, n, bs)]


def inv_root(a: np.ndarray, p: float, eps: float) -> np.ndarray:
    """V diag((max(w, 0) + eps) ** (-1/p)) V^T from eigh(a), float64."""
    w, v = np.linalg.eigh(np.asarray(a, np.float64))
    return (v * (np.maximum(w, 0.0) + eps) ** (-1.0 / p)) @ v.T


def reference_shampoo(
    learning_rate: float,
    *,
    block_size: int,
    is_stacked: Any = False,
    beta1: float = 0.9,
    beta2: float = 0.999,
    diagonal_epsilon: float = 1e-10,
    matrix_epsilon: float = 1e-6,
    weight_decay: float = 0.0,
    start_preconditioning_step: int = 1,
    preconditioning_compute_steps: int = 1,
    graft_type: str = "adam",
    graft_beta2: float | None = None,
    nesterov: bool = False,
    exponent_override: int = 0,
) -> optax.GradientTransformation:
    """Blocked Shampoo with grafting, momentum and decoupled weight decay; see the module docstring."""
    if graft_type not in GRAFT_TYPES:
        raise ValueError(f"unknown graft_type {graft_type!r}; expected one of {GRAFT_TYPES}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if preconditioning_compute_steps < 1:
        raise ValueError(f"preconditioning_compute_steps must be >= 1, got {preconditioning_compute_steps}")
    p = exponent_override or 4
    gb2 = beta2 if graft_beta2 is None else graft_beta2
    adamw = optax.adamw(learning_rate, b1=beta1, b2=beta2, eps=diagonal_epsilon, weight_decay=weight_decay)

    def split(tree):
        leaves = jax.tree.leaves(tree)
        flags = stacked_flags(is_stacked, tree)
        matrix = [is_matrix(np.shape(x), s) for x, s in zip(leaves, flags, strict=True)]
        return leaves, flags, matrix

    def init_leaf(x, stacked) -> MatrixLeafState:
        shape = np.shape(x)
        n_layers = shape[0] if stacked else 1
        rows, cols = matrix_view(layer_shape(shape, stacked))
        layers = []
        for _ in range(n_layers):
            blocks = []
            for r0, r1 in block_ranges(rows, block_size):
                for c0, c1 in block_ranges(cols, block_size):
                    r, c = r1 - r0, c1 - c0
                    blocks.append(BlockState(np.zeros((r, r)), np.zeros((c, c)), np.eye(r), np.eye(c)))
            layers.append(tuple(blocks))
        graft_v = None if graft_type == "sgd" else np.zeros(shape, np.float64)
        return MatrixLeafState(tuple(layers), graft_v, np.zeros(shape, np.float64))

    def init_fn(params):
        leaves, flags, matrix = split(params)
        with jax.numpy_dtype_promotion("standard"):
            adam = adamw.init([x for x, m in zip(leaves, matrix, strict=True) if not m])
        mstate = tuple(init_leaf(x, s) if m else None for x, s, m in zip(leaves, flags, matrix, strict=True))
        return ReferenceShampooState(jnp.zeros([], jnp.int32), mstate, adam)

    def graft_direction(g, v, t):
        if graft_type == "sgd":
            return g, None
        if graft_type == "adagrad":
            v = v + g**2
            return g / (np.sqrt(v) + diagonal_epsilon), v
        v = gb2 * v + (1 - gb2) * g**2
        if graft_type == "adam":
            return g / (np.sqrt(v / (1 - gb2**t)) + diagonal_epsilon), v
        return g / (np.sqrt(v) + diagonal_epsilon), v  # rmsprop

    def update_leaf(g, param, st: MatrixLeafState, stacked, t, precondition, refresh):
        shape = g.shape
        graft, graft_v = graft_direction(g, st.graft_v, t)
        rows, cols = matrix_view(layer_shape(shape, stacked))
        g_layers = g.reshape(-1, rows, cols)  # one layer when not stacked
        graft_layers = graft.reshape(-1, rows, cols)
        u_layers = np.zeros_like(g_layers)
        new_layers = []
        for layer, layer_blocks in enumerate(st.blocks):
            new_blocks = []
            it = iter(layer_blocks)
            for r0, r1 in block_ranges(rows, block_size):
                for c0, c1 in block_ranges(cols, block_size):
                    b = next(it)
                    gb = g_layers[layer, r0:r1, c0:c1]
                    left = beta2 * b.left + (1 - beta2) * (gb @ gb.T)
                    right = beta2 * b.right + (1 - beta2) * (gb.T @ gb)
                    left_root, right_root = b.left_root, b.right_root
                    if refresh:
                        left_root = inv_root(left, p, matrix_epsilon)
                        right_root = inv_root(right, p, matrix_epsilon)
                    graft_b = graft_layers[layer, r0:r1, c0:c1]
                    if precondition:
                        d = left_root @ gb @ right_root
                        ub = d * (np.linalg.norm(graft_b) / (np.linalg.norm(d) + 1e-16))
                    else:
                        ub = graft_b
                    u_layers[layer, r0:r1, c0:c1] = ub
                    new_blocks.append(BlockState(left, right, left_root, right_root))
            new_layers.append(tuple(new_blocks))
        u = u_layers.reshape(shape)
        mom = beta1 * st.mom + (1 - beta1) * u
        if nesterov:
            direction = beta1 * mom / (1 - beta1 ** (t + 1)) + (1 - beta1) * u / (1 - beta1**t)
        else:
            direction = mom / (1 - beta1**t)
        if weight_decay != 0:
            direction = direction + weight_decay * param
        return -learning_rate * direction, MatrixLeafState(tuple(new_layers), graft_v, mom)

    def update_fn(updates, state: ReferenceShampooState, params=None):
        if weight_decay != 0 and params is None:
            raise ValueError("reference_shampoo with weight_decay != 0 needs params in update()")
        leaves, flags, matrix = split(updates)
        treedef = jax.tree.structure(updates)
        param_leaves = treedef.flatten_up_to(params) if params is not None else [None] * len(leaves)
        t = int(state.count) + 1
        precondition = t >= start_preconditioning_step
        refresh = precondition and (t - start_preconditioning_step) % preconditioning_compute_steps == 0

        out: list[Any] = [None] * len(leaves)
        new_matrix: list[Any] = [None] * len(leaves)
        for k, (g, s, m) in enumerate(zip(leaves, flags, matrix, strict=True)):
            if not m:
                continue
            param = param_leaves[k]
            dtype = (param if param is not None else g).dtype
            p64 = None if param is None else np.asarray(param, np.float64)
            upd, new_matrix[k] = update_leaf(
                np.asarray(g, np.float64), p64, state.matrix[k], s, t, precondition, refresh
            )
            out[k] = jnp.asarray(upd, dtype)

        vec_idx = [k for k, m in enumerate(matrix) if not m]
        if params is None:  # only with weight_decay == 0, where adamw's decay term is 0 * params
            vec_params = [jnp.zeros_like(leaves[k]) for k in vec_idx]
        else:
            vec_params = [param_leaves[k] for k in vec_idx]
        with jax.numpy_dtype_promotion("standard"):
            vec_updates, adam = adamw.update([leaves[k] for k in vec_idx], state.adam, vec_params)
        for k, upd in zip(vec_idx, vec_updates, strict=True):
            out[k] = upd
        new_state = ReferenceShampooState(jnp.asarray(t, jnp.int32), tuple(new_matrix), adam)
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformation(init_fn, update_fn)
