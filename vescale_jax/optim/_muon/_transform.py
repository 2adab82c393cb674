"""Distributed Muon over :class:`vescale_jax.ShardedParams`, each matrix orthogonalised once, on one owner.

``optax.contrib.muon`` under JAX's sharding all-gathers every matrix and runs Newton–Schulz on every device.
Here momentum, shape scaling, weight decay and the AdamW branch are element-wise on the flat local shards,
and Newton–Schulz runs on an *owner* device per matrix (see :mod:`vescale_jax.optim.owners`): a matrix the
plan keeps whole on one device is orthogonalised there with no communication; a matrix split across devices
is gathered to a load-balanced owner by one padded all-to-all and scattered back by another.

Use inside a ``vj.fsdp`` step (or any ``jit``) like any Optax transformation::

    tx = vj.optim.muon(1e-3)
    opt_state = vj.init_opt_state(tx, params)
    updates, opt_state = tx.update(grads, opt_state, params)

Tensor / expert parallelism (a plan made with ``vj.plan(..., tp=...)``): Newton–Schulz needs the whole *logical*
matrix, so a matrix whose leaf is split over ``tensor`` (e.g. a column-parallel ``(d, 4f)`` kernel held as
``(d, f)`` by each of 4 ``tensor`` devices, each piece ragged over ``fsdp``) has its pieces routed to one owner
device of the whole ``tensor x fsdp`` device set: the owner routing runs over the routed buckets' group axes and
the plan's axis together (``muon_routing(plan).axes``, e.g. ``("tensor", "fsdp")``), its two all-to-alls span
those axes, and a split class's Gram sums run over them too. A matrix of a bucket replicated over ``tensor``
(not split) is orthogonalised once per ``tensor`` group, each copy from and back to its own group's devices (no
traffic over ``tensor`` for it) at the same owner position and slot in every group, so the copies stay equal.
No bucket is gathered over ``tensor``; the AdamW leaves stay element-wise on each device's shards.

The math is ``optax.contrib.muon``'s (same arguments where they overlap) applied to the logical tree, with
one difference in the default: a leaf whose per-layer shape is 2-D is a Muon matrix, so a stacked layer
group's ``(L, p, q)`` leaf is ``L`` matrices (optax's default would hand a 3-D leaf to AdamW; pass
``muon_weight_dimension_numbers`` to choose otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from vescale_jax._cache import plan_cache
from vescale_jax._compat import (
    MUON_DEFAULT_NS_COEFFS,
    MUON_NS_COEFFS_PRESETS,
    MUON_PRECONDITIONINGS,
    muon_normalize_axes,
    muon_orthogonalize,
)
from vescale_jax.layout._plan import Plan
from vescale_jax.optim._leaf_tables import (
    abstract_params,
    check_sharded,
    is_placeholder,
    leaf_mask,
    masked_decay,
    per_element,
    place_state,
    prefix_per_leaf,
    static_int,
)
from vescale_jax.optim._muon._owners import route_newton_schulz
from vescale_jax.optim._muon._routing import Routing, build_routing
from vescale_jax.optim._on_leaves import split_leaves
from vescale_jax.optim._per_plan import per_plan
from vescale_jax.state._sharded import ShardedParams

__all__ = [
    "MuonDimensionNumbers",
    "MuonState",
    "muon",
    "muon_routing",
    "newton_schulz",
    "scale_by_muon",
    "scale_by_shape",
]

MuonDimensionNumbers = optax.contrib.MuonDimensionNumbers
_is_dims = lambda x: x is None or isinstance(x, MuonDimensionNumbers)


class MuonState(NamedTuple):
    """State of :func:`scale_by_muon`: step count and momentum (sharded like the params).

    Unlike optax's, the Newton–Schulz coefficients are compile-time constants, not state (a 1-D state leaf
    would come back from ``jit`` with a different, equivalent spec and force a second compilation).
    """

    count: jax.Array
    mu: Any


def resolve_dimension_numbers(plan: Plan, weight_dimension_numbers: Any = None) -> list[tuple[Any, Any] | None]:
    """Per leaf: ``(reduction_axis, output_axis)`` of a Muon leaf, or ``None`` for an AdamW leaf.

    Args:
      plan: the plan.
      weight_dimension_numbers: ``None`` (default: leaves whose per-layer shape is 2-D; stacked ones with the
        layer dim as batch), a (prefix) tree of ``MuonDimensionNumbers`` / ``None`` over the logical tree, or a
        callable of the logical tree (``ShapeDtypeStruct`` leaves) returning one.
    """
    if weight_dimension_numbers is None:
        dims = []
        for spec in plan.leaves:
            if len(plan.layer_shape(spec)) != 2:
                dims.append(None)
            elif len(spec.shape) == 3:
                dims.append((1, 2))
            else:
                dims.append((0, 1))
        return _drop_empty(plan, dims)
    abstract = abstract_params(plan)
    tree = weight_dimension_numbers(abstract) if callable(weight_dimension_numbers) else weight_dimension_numbers
    if isinstance(tree, MuonDimensionNumbers):
        per_leaf = [tree] * len(plan.leaves)
    else:
        per_leaf = prefix_per_leaf(
            tree,
            abstract,
            _is_dims,
            what="vj.optim.muon: weight_dimension_numbers",
            fix="Give a MuonDimensionNumbers or None for each key of the params (a subtree's entry covers its "
            "leaves), or a callable of the params' tree that returns one (e.g. lambda p: jax.tree.map(lambda x: "
            "MuonDimensionNumbers() if x.ndim == 2 else None, p)).",
        )
    return _drop_empty(plan, [None if d is None else (d.reduction_axis, d.output_axis) for d in per_leaf])


def _drop_empty(plan: Plan, dims: list[Any]) -> list[Any]:
    """A zero-size matrix (e.g. ``(0, n)``) has nothing to orthogonalise: it takes the element-wise branch."""
    return [None if spec.size == 0 else d for spec, d in zip(plan.leaves, dims, strict=True)]


def _coeffs(ns_coeffs: Any, ns_steps: int) -> np.ndarray:
    if isinstance(ns_coeffs, str):
        if ns_coeffs not in MUON_NS_COEFFS_PRESETS:
            raise ValueError(f"Unknown ns_coeff preset string: {ns_coeffs}")
        ns_coeffs = MUON_NS_COEFFS_PRESETS[ns_coeffs]
    c = np.asarray(ns_coeffs, np.float32)
    if c.ndim > 2 or c.shape[-1] != 3:
        raise ValueError(f"ns_coeffs must have shape (3,) or (n, 3), got {c.shape}")
    if c.ndim == 2:
        if not c.shape[0] <= ns_steps:
            raise ValueError(f"Not enough coeffs to perform {ns_steps} steps")
        c = c[-ns_steps:]
    return c


def muon_routing(plan: Plan, weight_dimension_numbers: Any = None, *, split: bool = True) -> Routing:
    """The owner routing :func:`scale_by_muon` uses for ``plan`` (owners, classes, loads; see ``.summary()``).

    ``split``: let leftover matrices of a shape class be split by columns over all devices (Frobenius
    preconditioning only; :func:`scale_by_muon` decides)."""
    dims = resolve_dimension_numbers(plan, weight_dimension_numbers)
    return _routing(plan, tuple(None if d is None else (_hashable(d[0]), _hashable(d[1])) for d in dims), split)


@plan_cache
def _routing(plan: Plan, dims: tuple[tuple[Any, Any] | None, ...], split: bool) -> Routing:
    return build_routing(plan, dims, split=split)


def newton_schulz(
    x: jax.Array, coeffs: np.ndarray, ns_steps: int, eps: float, *, axis: Any = None, unroll: bool = False
) -> jax.Array:
    """Batched Newton–Schulz with Frobenius preconditioning, ``optax.contrib``'s iteration
    ``X <- a X + (b A + c A A) X``, ``A = X X^T``, in a loop (one carried ``X``: temp memory stays at a few
    copies of the batch however many steps run).

    Args:
      x: ``(r, p, q)`` matrices with ``p <= q`` (zero matrices stay zero). With ``axis``, this device's
        columns of ``r`` matrices spread over that mesh axis (zero columns pad): the Frobenius norm and ``A``
        are summed over it (one ``(r, p, p)`` all-reduce per iteration; inside ``shard_map``).
      coeffs: ``(3,)`` or ``(n, 3)`` coefficients as in ``optax.contrib``.
      ns_steps: iterations when ``coeffs`` is ``(3,)``.
      eps: added to the Frobenius norm.
      axis: see ``x``.
      unroll: unroll the loop (XLA may overlap iterations, and its cost analysis counts every iteration; a
        rolled loop is counted once) at the price of more temp memory.

    Returns:
      The result, laid out like ``x``.
    """
    total = (lambda v: jax.lax.psum(v, axis)) if axis is not None else (lambda v: v)
    # Complex matrices: |x|^2 in the norm and X X^H in the Gram product (X stays X for real ones).
    real = jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else x * x
    norm = jnp.sqrt(total(jnp.sum(real, axis=(1, 2))))
    x = x / (norm + jnp.asarray(eps).astype(norm.dtype)).astype(x.dtype)[:, None, None]
    rows = np.broadcast_to(coeffs, (ns_steps, 3)) if coeffs.ndim == 1 else coeffs

    def step(x, c):
        a = total(jnp.einsum("rik,rjk->rij", x, jnp.conj(x)))
        b = c[1] * a + c[2] * jnp.matmul(a, a)
        return c[0] * x + jnp.matmul(b, x), None

    x, _ = jax.lax.scan(step, x, jnp.asarray(rows).astype(x.dtype), unroll=bool(unroll))
    return x


def _hashable(axes: Any) -> Any:
    return axes if isinstance(axes, int) else tuple(axes)


def scale_by_muon(
    ns_coeffs: Any = MUON_DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: Any = None,
    *,
    plan: Plan | None = None,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    weight_dimension_numbers: Any = None,
    ns_unroll: bool = False,
) -> optax.GradientTransformation:
    """Momentum, then Newton–Schulz orthogonalisation of each Muon matrix on its owner device.

    Same math as ``optax.contrib.scale_by_muon`` applied to the logical tree's Muon leaves; elements of other
    leaves (and padding) come out zero.

    Args:
      ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov, adaptive, preconditioning: as in optax.
      plan: optional: the plan the params are sharded with (default: read from the params it sees; given, the
        params must carry it).
      weight_dimension_numbers: see :func:`resolve_dimension_numbers`.
      ns_unroll: unroll the Newton–Schulz loop (see :func:`newton_schulz`).

    Returns:
      An ``optax.GradientTransformation`` over :class:`~vescale_jax.ShardedParams`.

    Sharding:
      Momentum is sharded like the params. Newton–Schulz work per device is its owned matrices only.
    """
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)
    ns_steps = static_int(ns_steps, "ns_steps", "scale_by_muon")
    coeffs = _coeffs(ns_coeffs, ns_steps)
    if preconditioning not in MUON_PRECONDITIONINGS:
        raise ValueError(f"Unknown preconditioning {preconditioning}")

    # eps reaches the owners' shard_map as an operand: it may be a traced hyperparameter (inject_hyperparams).
    def orthogonalize_split(x, axis, eps):
        return newton_schulz(x, coeffs, ns_steps, eps, axis=axis, unroll=ns_unroll)

    def orthogonalize(x_kpq, eps):
        if preconditioning == "frobenius":
            return newton_schulz(x_kpq, coeffs, ns_steps, eps, unroll=ns_unroll)
        c = jnp.asarray(coeffs).astype(x_kpq.dtype)
        ns = lambda x: muon_orthogonalize(x, c, ns_steps, preconditioning, eps)
        return jax.vmap(ns)(x_kpq)

    def build(plan: Plan) -> optax.GradientTransformation:
        routing = muon_routing(plan, weight_dimension_numbers, split=preconditioning == "frobenius")
        return _scale_by_muon(
            plan, routing, orthogonalize, orthogonalize_split, beta, eps, mu_dtype, nesterov, adaptive
        )

    return per_plan(build, plan, "scale_by_muon")


def _scale_by_muon(
    plan: Plan, routing: Routing, orthogonalize, orthogonalize_split, beta, eps, mu_dtype, nesterov, adaptive
) -> optax.GradientTransformation:
    """:func:`scale_by_muon` over ``plan`` with its owner ``routing``."""

    def init_fn(params):
        if is_placeholder(params):  # optax.tree.map_params
            return MuonState(count=jnp.zeros([], jnp.int32), mu=params)
        check_sharded(params, plan, "scale_by_muon")
        return place_state(
            MuonState(
                count=jnp.zeros([], jnp.int32),
                mu=optax.tree.zeros_like(params, dtype=mu_dtype),
            ),
            plan,
        )

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        check_sharded(updates, plan, "scale_by_muon")
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count_inc = optax.safe_increment(state.count)
        if nesterov:
            mu_hat = jax.tree.map(
                lambda m, g: beta * m + (1 - beta) * g,
                optax.tree.bias_correction(mu, beta, optax.safe_increment(count_inc)),
                optax.tree.bias_correction(updates, beta, count_inc),
            )
        else:
            mu_hat = optax.tree.bias_correction(mu, beta, count_inc)
        out = route_newton_schulz(
            mu_hat.buffers,
            plan,
            routing,
            orthogonalize,
            orthogonalize_split=orthogonalize_split,
            adaptive=adaptive,
            operands=(jnp.asarray(eps, jnp.float32),),
        )
        mu = optax.tree.cast(mu, mu_dtype)
        return ShardedParams(out, plan), MuonState(count=count_inc, mu=mu)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _shape_scales(plan: Plan, dims: Sequence[Any], consistent_rms: Any) -> np.ndarray | jax.Array:
    table = np.ones(len(plan.leaves) + 1, np.float32)
    table[-1] = 0.0
    for i, d in enumerate(dims):
        if d is None:
            continue
        shape = plan.leaves[i].shape
        red = muon_normalize_axes(shape, MuonDimensionNumbers(*d))
        fan_in = math.prod(shape[a] for a in red[0])
        fan_out = math.prod(shape[a] for a in red[1])
        if consistent_rms is None:
            table[i] = np.sqrt(np.float32(max(1.0, fan_out / fan_in)))
        else:
            table[i] = np.sqrt(np.float32(max(fan_in, fan_out)))
    if consistent_rms is None:
        return table
    # ``consistent_rms`` may be a traced hyperparameter (``optax.inject_hyperparams``): scale the Muon entries only.
    is_muon = np.array([d is not None for d in dims] + [False])
    return jnp.where(is_muon, table * jnp.asarray(consistent_rms, jnp.float32), table)


def scale_by_shape(
    *, plan: Plan | None = None, weight_dimension_numbers: Any = None, consistent_rms: float | None = None
) -> optax.GradientTransformation:
    """``optax.contrib``'s shape scaling per Muon leaf (other leaves unchanged), element-wise on the shards.

    ``plan``: optional (default: the plan of the updates it sees; given, they must carry it)."""

    def build(plan: Plan) -> optax.GradientTransformation:
        table = _shape_scales(plan, resolve_dimension_numbers(plan, weight_dimension_numbers), consistent_rms)

        def update_fn(updates, state, params=None, **extra_args):
            del params, extra_args
            check_sharded(updates, plan, "scale_by_shape")
            scales = per_element(plan, updates.buffers, table)
            out = [u * s.astype(u.dtype) for u, s in zip(updates.buffers, scales, strict=True)]
            return ShardedParams(out, plan), state

        return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)

    return per_plan(build, plan, "scale_by_shape")


def _is_zero(value: Any) -> bool:
    """Whether a hyperparameter is a static zero (a traced one, from ``optax.inject_hyperparams``, is not)."""
    return isinstance(value, int | float) and value == 0


class SelectState(NamedTuple):
    """State of :func:`muon`: the Muon branch's (sharded like the params) and the AdamW branch's (over the
    non-Muon leaves' elements only, ``PerDevice``; see :func:`vescale_jax.optim._on_leaves.on_leaves`)."""

    muon: Any
    adam: Any


def muon(
    learning_rate: optax.ScalarOrSchedule,
    ns_coeffs: Any = MUON_DEFAULT_NS_COEFFS,
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: Any = None,
    *,
    plan: Plan | None = None,
    nesterov: bool = True,
    adaptive: bool = False,
    preconditioning: str = "frobenius",
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    adam_learning_rate: optax.ScalarOrSchedule | None = None,
    muon_weight_dimension_numbers: Any = None,
    consistent_rms: float | None = None,
    ns_unroll: bool = False,
) -> optax.GradientTransformation:
    """Muon (momentum orthogonalised by Newton–Schulz) for Muon leaves, AdamW for the rest, over ShardedParams.

    Arguments follow ``optax.contrib.muon``. ``plan``: optional, the plan the params are sharded with (default:
    read from the params it sees, the tables built when ``init`` / ``update`` first sees them; given, they must
    carry it).
    ``muon_weight_dimension_numbers``: see :func:`resolve_dimension_numbers` (default: per-layer 2-D leaves).
    ``weight_decay_mask``: a (prefix) tree of bools over the logical tree, or a callable of it.
    ``ns_unroll``: unroll the Newton–Schulz loop (more temp memory; see :func:`newton_schulz`).
    The AdamW branch computes and keeps its moments in each leaf's dtype, as ``optax.contrib.muon`` does (bf16
    for a bf16 leaf; the first moment in ``mu_dtype`` when given). With a ``mu_dtype`` wider than a leaf, optax
    returns that leaf's updates in ``mu_dtype`` and rounds once in ``apply_updates``; here updates keep the
    bucket's dtype (one rounding more).

    Returns:
      An ``optax.GradientTransformation``; its ``update`` takes and returns :class:`~vescale_jax.ShardedParams`.

    Sharding:
      Every state buffer is sharded like the params; each matrix's Newton–Schulz runs on one owner device
      (:func:`muon_routing` shows which).
    """
    if adam_learning_rate is None:
        adam_learning_rate = learning_rate

    # Built now (their checks run here), their tables when they first see the params.
    orthogonal = scale_by_muon(
        ns_coeffs,
        ns_steps,
        beta,
        eps,
        mu_dtype,
        plan=plan,
        nesterov=nesterov,
        adaptive=adaptive,
        preconditioning=preconditioning,
        weight_dimension_numbers=muon_weight_dimension_numbers,
        ns_unroll=ns_unroll,
    )
    shape = scale_by_shape(
        plan=plan, weight_dimension_numbers=muon_weight_dimension_numbers, consistent_rms=consistent_rms
    )

    def build(plan: Plan) -> optax.GradientTransformation:
        dims = resolve_dimension_numbers(plan, muon_weight_dimension_numbers)
        is_muon = np.array([d is not None for d in dims] + [False])
        muon_tx = optax.chain(
            orthogonal,
            shape,
            optax.identity()
            if _is_zero(weight_decay)
            else masked_decay(plan, weight_decay, leaf_mask(plan, weight_decay_mask) & is_muon),
            optax.scale_by_learning_rate(learning_rate),
        )
        adam_tx = optax.adamw(
            adam_learning_rate,
            b1=adam_b1,
            b2=adam_b2,
            eps=eps,
            eps_root=adam_eps_root,
            weight_decay=adam_weight_decay,
            mu_dtype=mu_dtype,
            nesterov=nesterov,
        )
        return split_leaves(muon_tx, adam_tx, plan=plan, main_leaves=is_muon[:-1], state=SelectState, what="muon")

    return per_plan(build, plan, "muon")
