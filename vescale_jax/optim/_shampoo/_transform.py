"""Distributed blocked Shampoo over :class:`~vescale_jax.ShardedParams`, every block preconditioned where it lies.

Each matrix leaf (per-layer rank >= 2, viewed as ``(prod(shape[:-1]), shape[-1])`` per layer) is cut into
``block_size x block_size`` blocks. With the planner's ``vj.rows(block_size)`` granularity every block lies
whole on one device (:mod:`vescale_jax.optim.blocks`), so statistics, inverse roots and the preconditioned
block are computed from the local shard: the optimizer step adds no collective beyond scalars.

Math per block ``G`` (``t`` counts steps from 1):

* ``L <- beta2 L + (1 - beta2) G G^T``, ``R <- beta2 R + (1 - beta2) G^T G``;
* when ``t >= start_preconditioning_step`` and ``(t - start) % preconditioning_compute_steps == 0``:
  ``PL = (L + eps)^(-1/p)``, ``PR = (R + eps)^(-1/p)`` by an fp32 eigendecomposition (eigenvalues clipped at 0
  before ``matrix_epsilon`` is added; ``p = 4`` unless ``exponent_override``);
* direction ``D = PL G PR`` grafted onto the block's norm of an Adam / RMSprop / AdaGrad / SGD direction
  (``graft_type``); before the start step the graft direction itself;
* then, element-wise on the flat buffers: bias-corrected momentum (``beta1``, optionally Nesterov), decoupled
  weight decay and the learning rate. Other leaves use ``optax.adamw`` with the same betas.

Tensor / expert parallelism (``vj.plan(..., tp=...)``): blocks are cut from each TP/EP shard (the local shape the
model sees) and stay on the devices holding that shard; they must be blocks of the logical leaf (no block spans two
shards, checked by :func:`._blocks.check_tp_blocks`), so the update equals Shampoo on the logical
tree. Every TP/EP group holds different blocks in the same slots: the block state is sharded over the plan's TP/EP
axes and its axis together (``PerDevice.axes``, e.g. ``("tensor", "fsdp")``), ``G * m * B`` rows.

Edge blocks are zero-padded to ``block_size``; the padding changes nothing (a zero row of ``G`` stays a zero
row of ``PL G PR``) but costs a full block's roots.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vescale_jax._cache import plan_cache
from vescale_jax._compat import is_tracer
from vescale_jax.layout._plan import Plan
from vescale_jax.optim._leaf_tables import (
    check_sharded,
    is_placeholder,
    local_vector,
    masked_decay,
    place_state,
    split_local,
    static_int,
)
from vescale_jax.optim._on_leaves import split_leaves
from vescale_jax.optim._per_plan import per_plan
from vescale_jax.optim._shampoo._blocks import (
    BlockTables,
    build_blocks,
    gather_blocks,
    logical_layer,
    matrix_view,
    scatter_blocks,
)
from vescale_jax.optim._state_layouts import BlockLayout
from vescale_jax.state._sharded import PerDevice, ShardedParams

__all__ = ["ShampooState", "inverse_root", "scale_by_shampoo", "shampoo", "shampoo_blocks"]

GRAFT_TYPES = ("adam", "rmsprop", "adagrad", "sgd")
_HIGHEST = jax.lax.Precision.HIGHEST


class ShampooState(NamedTuple):
    """State of :func:`scale_by_shampoo`.

    Attributes:
      count: steps taken.
      graft: the graft's second moment, sharded like the params (``()`` for ``graft_type="sgd"``).
      stats_left, stats_right, root_left, root_right: ``PerDevice`` arrays ``(m * B, b, b)`` fp32 (``G * m * B``
        over ``G`` TP/EP groups): each device's block slots (empty slots are zero), with a
        :class:`~vescale_jax.optim._state_layouts.BlockLayout` to re-place them under another plan.
    """

    count: jax.Array
    graft: Any
    stats_left: PerDevice
    stats_right: PerDevice
    root_left: PerDevice
    root_right: PerDevice


def shampoo_blocks(plan: Plan, block_size: int) -> BlockTables:
    """The block placement :func:`scale_by_shampoo` uses (see ``.summary()`` for the max/mean balance).

    A ``block_size`` larger than every matrix is clipped to the largest matrix dim (``tables.block_size``):
    the statistics are then that size instead of ``block_size x block_size`` of zero padding, for the same
    update (a padded block's extra rows and columns are zero in the preconditioned block).
    """
    for spec in plan.leaves:
        if jnp.issubdtype(np.dtype(spec.dtype), jnp.complexfloating):
            raise ValueError(
                f"vj.optim.shampoo: leaf {spec.path} is {np.dtype(spec.dtype).name}; Shampoo's statistics and "
                "inverse roots are real, so complex parameters are not supported: optimise the real and imaginary "
                "parts as separate real leaves, or use vj.optim.muon (complex-aware)."
            )
    if not isinstance(block_size, bool) and isinstance(block_size, int) and block_size > 1:
        # Logical dims (a TP/EP-split leaf's blocks are its logical blocks, cut from each shard).
        views = (matrix_view(logical_layer(plan, i)[0]) for i in range(len(plan.leaves)))
        dims = [max(v) for v in views if v is not None]
        block_size = min(block_size, max(dims, default=block_size))
    return _blocks(plan, block_size)


@plan_cache
def _blocks(plan: Plan, block_size: int) -> BlockTables:
    return build_blocks(plan, block_size, what="shampoo")


def inverse_root(a: jax.Array, *, exponent: float, epsilon: float) -> jax.Array:
    """``(A + eps I)^(-1/exponent)`` of symmetric PSD ``(..., n, n)`` matrices by eigendecomposition (fp32).

    Eigenvalues are clipped at zero before ``epsilon`` is added, so rounding cannot make them negative. On
    CPU the matrices go through LAPACK one at a time (``lax.map``): a batched CPU ``eigh`` splits its batch
    over XLA's intra-op thread pool, which several simulated devices on few cores can exhaust and deadlock.
    """

    def roots(x):
        w, v = jnp.linalg.eigh(x)
        w = (jnp.maximum(w, 0.0) + epsilon) ** (-1.0 / exponent)
        return jnp.matmul(v * w[..., None, :], jnp.swapaxes(v, -1, -2), precision=_HIGHEST)

    a = a.astype(jnp.float32)
    if a.ndim < 3 or a.shape[0] == 0:
        return roots(a)
    flat = jnp.reshape(a, (-1, *a.shape[-2:]))
    out = jax.lax.platform_dependent(flat, cpu=lambda x: jax.lax.map(roots, x), default=roots)
    return jnp.reshape(out, a.shape)


def _graft(graft_type: str, g: jax.Array, v: Any, t: jax.Array, beta2: float, eps: float) -> tuple[jax.Array, Any]:
    g = g.astype(jnp.float32)
    if graft_type == "sgd":
        return g, v
    if graft_type == "adagrad":
        v = v + g * g
        return g / (jnp.sqrt(v) + eps), v
    v = beta2 * v + (1 - beta2) * g * g
    if graft_type == "adam":
        return g / (jnp.sqrt(v / (1 - beta2 ** t.astype(jnp.float32))) + eps), v
    return g / (jnp.sqrt(v) + eps), v


def scale_by_shampoo(
    *,
    plan: Plan | None = None,
    block_size: int,
    beta2: float = 0.999,
    diagonal_epsilon: float = 1e-10,
    matrix_epsilon: float = 1e-6,
    start_preconditioning_step: int = 1,
    preconditioning_compute_steps: int = 1,
    graft_type: str = "adam",
    graft_beta2: float | None = None,
    exponent_override: int = 0,
) -> optax.GradientTransformation:
    """Grafted, blocked Shampoo direction for every matrix leaf; other leaves (and padding) come out zero.

    Args:
      plan: optional: the plan the params are sharded with (default: read from the params it sees; given, they
        must carry it). Its granularity for matrix leaves: ``vj.rows(block_size)``, or ``vj.tiles(bh, bw)`` with
        ``bh`` and ``bw`` multiples of ``block_size``.
      block_size: ``b``; blocks are ``b x b`` (edge blocks smaller).
      beta2: decay of the block statistics (and of the graft's second moment unless ``graft_beta2``).
      diagonal_epsilon: added to the graft's root second moment.
      matrix_epsilon: added to the statistics' eigenvalues before the inverse root.
      start_preconditioning_step: first step (from 1) using the Shampoo direction; earlier steps use the graft.
      preconditioning_compute_steps: roots are recomputed every this many steps from the start step.
      graft_type: ``"adam"`` (bias-corrected RMS), ``"rmsprop"``, ``"adagrad"`` or ``"sgd"``.
      graft_beta2: decay of the graft's second moment (default ``beta2``).
      exponent_override: root exponent ``p`` (default 4: ``L^(-1/4) G R^(-1/4)``).

    Returns:
      An ``optax.GradientTransformation`` over :class:`~vescale_jax.ShardedParams`.

    Sharding:
      The graft moment is sharded like the params; the block statistics and roots are ``PerDevice``: each
      device keeps the blocks it holds. The update runs one ``shard_map`` with no collective.
    """
    if graft_type not in GRAFT_TYPES:
        raise ValueError(f"vj.optim.shampoo: graft_type must be one of {GRAFT_TYPES}, got {graft_type!r}")
    block_size = static_int(block_size, "block_size", "scale_by_shampoo")
    if _concrete(preconditioning_compute_steps) and preconditioning_compute_steps < 1:
        raise ValueError(
            f"vj.optim.shampoo: preconditioning_compute_steps must be >= 1, got {preconditioning_compute_steps}"
        )
    hyper = dict(
        beta2=beta2,
        diagonal_epsilon=diagonal_epsilon,
        matrix_epsilon=matrix_epsilon,
        start_preconditioning_step=start_preconditioning_step,
        preconditioning_compute_steps=preconditioning_compute_steps,
        graft_type=graft_type,
        graft_beta2=graft_beta2,
        exponent_override=exponent_override,
    )
    return per_plan(lambda p: _scale_by_shampoo(p, block_size, **hyper), plan, "scale_by_shampoo")


def _scale_by_shampoo(
    plan: Plan,
    block_size: int,
    *,
    beta2,
    diagonal_epsilon,
    matrix_epsilon,
    start_preconditioning_step,
    preconditioning_compute_steps,
    graft_type,
    graft_beta2,
    exponent_override,
) -> optax.GradientTransformation:
    """:func:`scale_by_shampoo` over ``plan`` (options checked)."""
    tables = shampoo_blocks(plan, block_size)
    layout = BlockLayout(plan, tables.block_size)
    axes = layout.axes  # with tp: every TP/EP group's devices hold the blocks of their own shards
    # Rows of the state: m * B per TP/EP group (the block tables are the same in every group).
    b, m = tables.block_size, plan.num_devices * math.prod(plan.mesh.shape[a] for a in plan.tp_axes)
    # Numeric hyperparameters may be traced (optax.inject_hyperparams); only block_size fixes shapes.
    exponent = (
        float(exponent_override or 4)
        if _concrete(exponent_override)
        else jnp.where(exponent_override == 0, 4.0, exponent_override).astype(jnp.float32)
    )
    gb2 = beta2 if graft_beta2 is None else graft_beta2
    axis = plan.axis
    P = jax.sharding.PartitionSpec
    per_device = lambda x: PerDevice(x, plan, layout)
    # Empty slots (beyond a device's blocks) are padding of the state: kept exactly zero, roots included.
    used = np.tile((tables.rows > 0).reshape(-1), m // plan.num_devices)

    def init_fn(params):
        if is_placeholder(params):  # optax.tree.map_params: the structure, block slots abstract
            slots = jax.ShapeDtypeStruct((m * tables.slots, b, b), jnp.float32)
            return ShampooState(
                jnp.zeros([], jnp.int32), () if graft_type == "sgd" else params, *(per_device(slots) for _ in range(4))
            )
        check_sharded(params, plan, "scale_by_shampoo")
        zeros = jnp.zeros((m * tables.slots, b, b), jnp.float32)
        eye = jnp.where(used[:, None, None], jnp.eye(b, dtype=jnp.float32), zeros)
        graft = () if graft_type == "sgd" else optax.tree.zeros_like(params, dtype=jnp.float32)
        return place_state(
            ShampooState(
                jnp.zeros([], jnp.int32), graft, per_device(zeros), per_device(zeros), per_device(eye), per_device(eye)
            ),
            plan,
        )

    def blocks(grads, graft, state, refresh, use):
        specs = tuple(plan.partition_spec(bk) for bk in plan.buckets)
        n = len(specs)

        def local(*args):
            g_shards, d_shards = args[:n], args[n : 2 * n]
            left, right, root_l, root_r, refresh, use, beta2, matrix_epsilon, exponent = args[2 * n :]
            k = jax.lax.axis_index(axis)
            g = gather_blocks(local_vector(g_shards, tables.buckets, jnp.float32), tables, k)
            d = gather_blocks(local_vector(d_shards, tables.buckets, jnp.float32), tables, k)
            gram = lambda x, y: jnp.einsum("sij,skj->sik", x, y, precision=_HIGHEST)
            left = beta2 * left + (1 - beta2) * gram(g, g)
            gt = jnp.swapaxes(g, -1, -2)
            right = beta2 * right + (1 - beta2) * gram(gt, gt)
            real = (jnp.asarray(tables.rows)[k] > 0)[:, None, None]
            root_l, root_r = jax.lax.cond(
                refresh,
                lambda: (
                    jnp.where(real, inverse_root(left, exponent=exponent, epsilon=matrix_epsilon), 0.0),
                    jnp.where(real, inverse_root(right, exponent=exponent, epsilon=matrix_epsilon), 0.0),
                ),
                lambda: (root_l, root_r),
            )
            pre = jnp.matmul(jnp.matmul(root_l, g, precision=_HIGHEST), root_r, precision=_HIGHEST)
            norm = lambda x: jnp.sqrt(jnp.sum(x * x, axis=(1, 2), keepdims=True))
            grafted = pre * (norm(d) / (norm(pre) + 1e-16))
            u = jnp.where(use, grafted, d)
            out = split_local(scatter_blocks(u, tables, k), g_shards, tables.buckets)
            return (*out, left, right, root_l, root_r)

        blocked = P(axes)
        mapped = jax.shard_map(
            local,
            mesh=plan.mesh,
            in_specs=(*specs, *specs, blocked, blocked, blocked, blocked, *[P()] * 5),
            out_specs=(*specs, blocked, blocked, blocked, blocked),
            check_vma=False,
        )
        # Hyperparameters are operands, not closures: they may be traced (optax.inject_hyperparams).
        hyper = [jnp.asarray(v, jnp.float32) for v in (beta2, matrix_epsilon, exponent)]
        out = mapped(
            *grads,
            *graft,
            state.stats_left.value,
            state.stats_right.value,
            state.root_left.value,
            state.root_right.value,
            refresh,
            use,
            *hyper,
        )
        return list(out[:n]), [per_device(x) for x in out[n:]]

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        check_sharded(updates, plan, "scale_by_shampoo")
        t = optax.safe_increment(state.count)
        moments = [None] * len(updates.buffers) if graft_type == "sgd" else state.graft.buffers
        pairs = [
            _graft(graft_type, g, v, t, gb2, diagonal_epsilon) for g, v in zip(updates.buffers, moments, strict=True)
        ]
        direction = [d for d, _ in pairs]
        graft = () if graft_type == "sgd" else ShardedParams([v for _, v in pairs], plan)
        if tables.slots == 0:
            out = [jnp.zeros_like(g) for g in updates.buffers]
            return ShardedParams(out, plan), ShampooState(t, graft, *state[2:])
        refresh = (t >= start_preconditioning_step) & (
            (t - start_preconditioning_step) % preconditioning_compute_steps == 0
        )
        use = t >= start_preconditioning_step
        out, stats = blocks(updates.buffers, direction, state, refresh, use)
        return ShardedParams(out, plan), ShampooState(t, graft, *stats)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _concrete(value: Any) -> bool:
    return not is_tracer(value)


class MomentumState(NamedTuple):
    """Bias-corrected momentum of :func:`shampoo`."""

    count: jax.Array
    mu: Any


def _momentum(beta1: float, nesterov: bool) -> optax.GradientTransformation:
    """``mu <- beta1 mu + (1 - beta1) u``, returned bias-corrected (Nesterov: Adam's look-ahead form)."""

    def init_fn(params):
        return MomentumState(jnp.zeros([], jnp.int32), optax.tree.zeros_like(params))

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        t = optax.safe_increment(state.count)
        mu = optax.tree.update_moment(updates, state.mu, beta1, 1)
        if nesterov:
            out = jax.tree.map(
                lambda a, g: beta1 * a + (1 - beta1) * g,
                optax.tree.bias_correction(mu, beta1, optax.safe_increment(t)),
                optax.tree.bias_correction(updates, beta1, t),
            )
        else:
            out = optax.tree.bias_correction(mu, beta1, t)
        return out, MomentumState(t, mu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class SplitState(NamedTuple):
    """State of :func:`shampoo`: the Shampoo branch's (matrix leaves) and the AdamW branch's (the other leaves'
    elements only, ``PerDevice``; see :func:`vescale_jax.optim._on_leaves.on_leaves`)."""

    shampoo: Any
    adam: Any


def shampoo(
    learning_rate: optax.ScalarOrSchedule,
    *,
    plan: Plan | None = None,
    block_size: int,
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
    """Blocked Shampoo for matrix leaves, AdamW for the rest, over :class:`~vescale_jax.ShardedParams`.

    Arguments follow the distributed Shampoo implementations (``block_size``, ``beta1``/``beta2``,
    ``diagonal_epsilon``, ``matrix_epsilon``, ``start_preconditioning_step``, ``preconditioning_compute_steps``,
    ``graft_type``, ``nesterov``, ``exponent_override``); see :func:`scale_by_shampoo` for the block math.
    Matrix leaves then get bias-corrected momentum ``beta1`` and decoupled weight decay:
    ``-lr * (momentum + weight_decay * param)``. Other leaves: ``optax.adamw(learning_rate, b1=beta1,
    b2=beta2, eps=diagonal_epsilon, weight_decay=weight_decay)``.

    Args:
      learning_rate: a float or an Optax schedule.
      plan: optional: the plan the params are sharded with (default: read from the params it sees, the block
        tables built when ``init`` / ``update`` first sees them; given, they must carry it). Plan matrix leaves
        with ``granularity=vj.rows(block_size)`` (or ``vj.tiles(bh, bw)``, ``bh`` and ``bw`` multiples of
        ``block_size``: each block inside one tile).
      block_size: Shampoo block edge ``b``.

    Returns:
      An ``optax.GradientTransformation``; its ``update`` takes and returns ShardedParams.

    Sharding:
      Momentum and graft moments are sharded like the params; AdamW's moments cover the non-matrix elements
      only, per device; block statistics and roots stay on the device holding the block
      (:func:`shampoo_blocks` reports the max/mean blocks per device).
    """
    block_size = static_int(block_size, "block_size", "shampoo")
    # Built now (its checks run here), its tables when it first sees the params.
    direction = scale_by_shampoo(
        plan=plan,
        block_size=block_size,
        beta2=beta2,
        diagonal_epsilon=diagonal_epsilon,
        matrix_epsilon=matrix_epsilon,
        start_preconditioning_step=start_preconditioning_step,
        preconditioning_compute_steps=preconditioning_compute_steps,
        graft_type=graft_type,
        graft_beta2=graft_beta2,
        exponent_override=exponent_override,
    )

    def build(plan: Plan) -> optax.GradientTransformation:
        tables = shampoo_blocks(plan, block_size)
        is_matrix = np.array([*tables.matrix_leaves, False])
        branch = optax.chain(
            direction,
            _momentum(beta1, nesterov),
            optax.identity()
            if isinstance(weight_decay, int | float) and weight_decay == 0
            else masked_decay(plan, weight_decay, is_matrix),
            optax.scale_by_learning_rate(learning_rate),
        )
        adam = optax.adamw(learning_rate, b1=beta1, b2=beta2, eps=diagonal_epsilon, weight_decay=weight_decay)
        return split_leaves(branch, adam, plan=plan, main_leaves=is_matrix[:-1], state=SplitState, what="shampoo")

    return per_plan(build, plan, "shampoo")
