"""Scan over a stacked layer group, gathering one layer per loop iteration.

Inside :func:`vescale_jax.apply` (and so inside a ``vj.fsdp`` step) the leaves of a stacked bucket are
:class:`LayerShard` stand-ins for this device's ``(L, S)`` rows, not arrays. :func:`scan_layers` runs the layer
loop over them with a custom VJP:

* forward: iteration ``j`` all-gathers layer ``j`` of each stacked bucket and computes the layer; only each
  layer's input carry is saved (as ``jax.checkpoint`` over the body would).
* backward: the reverse loop gathers each layer again, recomputes the layer's VJP and reduce-scatters the
  layer's packed gradient into the local ``(S,)`` row — one all-gather and one reduce-scatter per layer and
  bucket, inside the while loop.
* with ``prefetch=True`` the all-gather of the next layer (the one below, in backward) is issued before the
  current layer's compute so the collective can overlap it; the first layer is gathered before the loop.

With ``reshard_after_forward=False`` the forward keeps the gathered layers for the backward instead of gathering
them again (``L`` full layers of memory, no second all-gather).

Outside ``vj.apply`` the same call is an ordinary ``lax.scan`` over arrays with a leading layer dim, so one
model definition serves the sharded step and the unsharded reference.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax.layout._plan import Plan
from vescale_jax.step._closure import hoist_closure
from vescale_jax.step._context_kv import keep_context_gathers
from vescale_jax.step._fp32_grads import widened
from vescale_jax.step._layer_split import split_layer
from vescale_jax.step._policy import StepPolicy
from vescale_jax.step._random import split_layer_draws, tolerant
from vescale_jax.step._wire import (
    example_leaves,
    gather_leaves,
    gather_stacked,
    scatter_leaves,
    tie,
    varying_axes,
)

__all__ = ["LayerShard", "scan_layers"]


@jax.tree_util.register_pytree_node_class
class LayerShard:
    """Stand-in for one stacked leaf inside ``vj.apply``: this device's rows of its bucket.

    Attributes:
      rows: the bucket's local ``(L, S)`` shard (shared by every leaf of the bucket).
      plan: the plan.
      index: the leaf's index in ``plan.leaves``.
      policy: the step's :class:`vescale_jax.step._policy.StepPolicy` (reshard-after-forward, prefetch,
        precision, replica axes, kernels), which :func:`scan_layers` gathers and reduces each layer by.

    Sharding:
      ``rows`` varies over ``plan.axis``; :func:`scan_layers` all-gathers one layer at a time.
    """

    __slots__ = ("index", "plan", "policy", "rows")

    def __init__(self, rows: Any, plan: Plan, index: int, policy: StepPolicy):
        self.rows, self.plan, self.index, self.policy = rows, plan, index, policy

    def tree_flatten(self):
        return (self.rows,), (self.plan, self.index, self.policy)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    @property
    def spec(self):
        return self.plan.leaves[self.index]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.spec.local_shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.spec.dtype)

    def __repr__(self) -> str:
        return f"LayerShard({self.spec.path}, shape={self.shape}, dtype={self.spec.dtype})"

    def _not_an_array(self, *_: Any, **__: Any) -> Any:
        unit = self.plan.buckets[self.spec.bucket].unit
        raise TypeError(
            f"vj.apply: {self.spec.path!r} (shape {self.shape}) belongs to a stacked layer group: inside vj.apply it "
            "is a vj.LayerShard stand-in for this device's rows, not an array, so it cannot be indexed, used in "
            "math, moved (an nnx.scan in_axes other than 0), or read outside a loop over its layers. A "
            "jax.lax.scan / nnx.scan / nn.scan over its leading layer dim runs as vj.scan_layers; or loop the "
            f"group with vj.scan_layers(body, params[{unit!r}], carry) (NNX: "
            f"vj.flax.nnx_scan_layers(model.{unit}, x)), which gathers one layer per iteration; or leave {unit!r} "
            "out of vj.plan(stacked=...) to gather it whole."
        )

    # Any use as an array ends here with the message above (instead of a TypeError deep inside Flax or jnp).
    __jax_array__ = __array__ = __len__ = __iter__ = __getitem__ = __bool__ = __index__ = _not_an_array
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _not_an_array
    __matmul__ = __rmatmul__ = __pow__ = __neg__ = __lt__ = __le__ = __gt__ = __ge__ = _not_an_array
    astype = reshape = sum = mean = _not_an_array


def _is_shard(x: Any) -> bool:
    return isinstance(x, LayerShard)


def _call(body: Callable, params: Any, carry: Any, x: Any, has_xs: bool) -> Any:
    return body(params, carry, x) if has_xs else body(params, carry)


def scan_layers(
    body: Callable,
    layer_params: Any,
    carry: Any,
    xs: Any = None,
    *,
    unroll: int | bool = 1,
    prefetch: bool | None = None,
) -> Any:
    """Applies ``body`` once per layer of a stacked layer group: ``carry = body(params_l, carry[, x_l])``.

    Args:
      body: ``(params_of_one_layer, carry) -> carry``, or ``(params, carry, x) -> carry`` when ``xs`` is given.
        It may close over other arrays of any dtype and sharding (gradients flow to the floating-point ones;
        integer, boolean and PRNG-key ones, e.g. token or segment ids, ``vj.positions``, masks, keys, are
        constants of the derivative), as an unsharded ``lax.scan`` body may.
      layer_params: the stacked layer group: a pytree whose leaves have a leading layer dim ``L`` (plain
        arrays: an ordinary ``lax.scan``), or the :class:`LayerShard` stand-ins ``vj.apply`` puts there.
      carry: the loop carry (e.g. the activations); floating-point arrays.
      xs: optional per-layer inputs with leading dim ``L``.
      unroll: passed to ``lax.scan`` (``True`` unrolls the loop; the sharded path unrolls its forward and
        backward loops alike).
      prefetch: on the sharded path, issue the next layer's all-gather before computing the current one so it
        can overlap compute, at the cost of a second gathered layer in memory (default: the stand-ins' setting,
        i.e. ``vj.fsdp(prefetch=...)``).

    Returns:
      The final carry.

    Sharding:
      On the sharded path each iteration all-gathers one layer of every stacked bucket in ``layer_params`` and
      the backward reduce-scatters that layer's gradient; per-layer parameters exist in full on each device only
      for the layer being computed and the one being prefetched.
    """
    body = _carry_checked(body, carry)
    leaves, treedef = jax.tree_util.tree_flatten(layer_params, is_leaf=_is_shard)
    has_xs = xs is not None
    shards = [x for x in leaves if _is_shard(x)]
    if not shards:

        def step(c, px):
            p, x = px
            return _call(body, p, c, x, has_xs), None

        return jax.lax.scan(step, carry, (layer_params, xs), unroll=unroll)[0]
    if len(shards) != len(leaves):
        bad = next(x for x in leaves if not _is_shard(x))
        raise ValueError(
            f"vj.scan_layers: layer_params mixes gathered stand-ins with a plain array of shape "
            f"{getattr(bad, 'shape', None)}; pass one stacked layer group (a unit named in vj.plan(stacked=...))."
        )
    if prefetch is None:
        prefetch = shards[0].policy.prefetch
    return _sharded_scan(body, shards, treedef, carry, xs, has_xs, unroll, prefetch)


def _carry_checked(body: Callable, carry: Any) -> Callable:
    """``body`` that raises, at trace time, when it returns something else than a carry like ``carry``."""
    want = jax.tree.structure(carry)

    def checked(*a):
        out = body(*a)
        if jax.tree.structure(out) != want:
            extra = (
                " (it looks like lax.scan's (carry, y))"
                if isinstance(out, tuple) and len(out) == 2 and jax.tree.structure(out[0]) == want
                else ""
            )
            raise TypeError(
                f"vj.scan_layers: body returned {jax.tree.structure(out)}{extra}, but it must return the new carry "
                f"only, structured like the carry passed in ({want}); there are no per-layer outputs: return the "
                "carry (collect per-layer values in the carry, or pass per-layer inputs as xs)."
            )
        return out

    return checked


def _sharded_scan(body, shards, treedef, carry, xs, has_xs, unroll, prefetch):
    plan = shards[0].plan
    bucket_ids = sorted({plan.leaves[s.index].bucket for s in shards})
    rows = {}
    for s in shards:
        rows.setdefault(plan.leaves[s.index].bucket, s.rows)
    rows = tuple(rows[b] for b in bucket_ids)
    keep = not shards[0].policy.reshard_after_forward
    how = shards[0].policy.wire()
    buckets = [plan.buckets[b] for b in bucket_ids]
    like_axes = tuple(varying_axes(r) for r in rows)
    # A low-precision bucket whose gradient reduces wider (bf16 -> fp32 by default) is gathered wide: the layer
    # body sees its leaves in the gather dtype, but their per-device gradient partial sums stay fp32 until the
    # reduce-scatter (as unsharded, where the batch sum is rounded once; see vescale_jax.step._fp32_grads).
    narrow = [how.model_dtype(plan.buckets[plan.leaves[s.index].bucket].dtype) for s in shards]
    num_layers = rows[0].shape[0]
    if has_xs:
        for x in jax.tree.leaves(xs):
            if x.shape[:1] != (num_layers,):
                raise ValueError(f"vj.scan_layers: xs leaves need a leading dim of {num_layers} layers, got {x.shape}")
    # Small buckets beside larger ones (a cut layer's norms and biases) are gathered for all layers at once and
    # enter the loop as per-layer inputs: one collective per step each way instead of one per layer.
    whole = _whole_buckets(plan, bucket_ids)
    whole_leaves = tuple(
        tuple(gather_stacked(r, plan.buckets[b], plan, how))
        for b, r in zip(bucket_ids, rows, strict=True)
        if b in whole
    )
    whole_ids = [b for b in bucket_ids if b in whole]
    keep_b = [k for k, b in enumerate(bucket_ids) if b not in whole]
    bucket_ids = [bucket_ids[k] for k in keep_b]
    rows = tuple(rows[k] for k in keep_b)
    buckets = [buckets[k] for k in keep_b]
    like_axes = tuple(like_axes[k] for k in keep_b)
    xs = (xs, whole_leaves)

    def tree_of(gathered, whole_j):  # gathered: per loop bucket, its leaves in slot order; whole_j: this layer's
        by_bucket = {**dict(zip(bucket_ids, gathered, strict=True)), **dict(zip(whole_ids, whole_j, strict=True))}
        out = [by_bucket[plan.leaves[s.index].bucket][plan.leaves[s.index].slot] for s in shards]
        return jax.tree_util.tree_unflatten(treedef, out)

    def call(params, c, x):
        return _call(body, params, c, x[0], has_xs)

    wide_body = widened(call, narrow)

    def layer(gathered, c, x):
        return wide_body(tree_of(gathered, x[1]), c, x)

    # Example leaves with the right dtypes and varying-axes types (dead code once converted; no collective).
    example = tuple(tuple(example_leaves(r[0], bucket, plan, how)) for r, bucket in zip(rows, buckets, strict=True))
    x0 = jax.tree.map(lambda a: a[0], xs)
    # Draws from keys that are the same on every device are split as vj.apply splits them (step/_random); the
    # backward evaluates the layer on residuals that vary over every axis (tolerant). Every traced value the body
    # closes over, of any dtype, becomes an argument (consts) of the custom VJP below; the floating-point ones
    # receive gradients, the others (ids, positions, masks, keys) are constants of the derivative.
    fn, consts = hoist_closure(split_layer_draws(layer), example, carry, x0)
    fn = tolerant(fn, example, carry, x0, *consts)
    # Under a context axis, the layer's K / V gathers are kept for the backward (vescale_jax.step._context_kv).
    ctx = shards[0].policy.context
    kv = None
    if ctx is not None and ctx.size > 1 and ctx.kv == "keep":
        kv = keep_context_gathers(fn, (example, carry, x0, *consts), ctx.axis)
    phases = None
    if kv is None and not prefetch and not keep and num_layers > 1:
        phases = _split(fn, example, carry, x0, consts, num_layers)

    def gather(rows_, i):  # layer i of every bucket: cast, vary, all-gather, unpack (vescale_jax.step._wire)
        return tuple(
            tuple(gather_leaves(jax.lax.dynamic_index_in_dim(r, i, keepdims=False), bucket, plan, how))
            for r, bucket in zip(rows_, buckets, strict=True)
        )

    def x_at(xs_, i):
        return jax.tree.map(lambda a: a[i], xs_)

    def apply(g, c, x, consts_, save):
        """The layer's output carry and, when saving under a context axis, its kept K / V gathers (else None)."""
        if kv is not None and save:
            return kv.record(g, c, x, *consts_)
        return fn(g, c, x, *consts_), None

    def forward(rows_, c, xs_, consts_, save):
        """Returns the output carry and, when saving, (carries into layers, gathered layers if keep, kept K / V
        gathers under a context axis)."""
        if not prefetch or num_layers == 1:

            def step(c, inp):
                j, x = inp
                g = gather(rows_, j)
                if save and phases is not None:  # the layer in two halves: the cut values are saved
                    ph, carry_tree = phases
                    flat = jax.tree.leaves((g, c, x, list(consts_)))
                    cut = ph.first(flat)
                    return jax.tree.unflatten(carry_tree, ph.second(flat, cut)), (c, cut, None)
                out, kept = apply(g, c, x, consts_, save)
                return out, ((c, g if keep else None, kept) if save else None)

            return jax.lax.scan(step, c, (jnp.arange(num_layers), xs_), unroll=unroll)

        def step(state, inp):
            c, g_prev = state
            j, x_prev = inp
            g_j = gather(rows_, j)  # prefetch: issued before the previous layer's compute
            c, kept = apply(g_prev, c, x_prev, consts_, save)
            return (c, g_j), ((c, g_j if keep else None, kept) if save else None)

        g0 = gather(rows_, 0)
        head = jax.tree.map(lambda a: a[:-1], xs_)
        (c_last, g_last), saved = jax.lax.scan(step, (c, g0), (jnp.arange(1, num_layers), head), unroll=unroll)
        out, kept_last = apply(g_last, c_last, x_at(xs_, num_layers - 1), consts_, save)
        if not save:
            return out, None
        c_stack, g_stack, kept = saved  # carries into layers 1..L-1 (and those layers, gathered, if keep)
        if kv is not None:  # kept gathers of layers 0..L-2, then L-1
            kept = tuple(jnp.concatenate([a, b[None]]) for a, b in zip(kept, kept_last, strict=True))
        return out, ((c, c_stack), (g0, g_stack) if keep else None, kept)

    def reduce_scatter(dg):  # the transpose of gather: pack, cast, reduce-scatter, replica sum, per bucket
        return tuple(
            scatter_leaves(d, bucket, plan, how, like_axes=like)
            for d, bucket, like in zip(dg, buckets, like_axes, strict=True)
        )

    def layer_vjp(g, c_in, x, consts_, ct, kept=None):
        xd, x_of = _inexact_part(x)
        kd, k_of = _inexact_part(list(consts_))

        def f(g_, c_, kd_, xd_):
            k_ = k_of(list(kd_))
            if kept is not None:  # the forward's K / V gathers in place of gathering again
                return kv.replay(kept, g_, c_, x_of(xd_), *k_)
            return fn(g_, c_, x_of(xd_), *k_)

        _, f_vjp = jax.vjp(f, g, c_in, tuple(kd), xd)
        dg, dc, dk, dxd = f_vjp(ct)
        return reduce_scatter(dg), dc, dk, dxd

    def phased_vjp(rows_, j, c_in, x, consts_, cut, ct):
        """The layer's VJP in two halves: the second half's buckets gathered (tied to the cotangent) and its
        gradients reduce-scattered first; then the first half's buckets, tied to those reduce-scatters."""
        ph, carry_tree = phases
        xd, x_of = _inexact_part(x)
        kd, k_of = _inexact_part(list(consts_))
        n = len(buckets)

        def gather_one(b, anchor):
            row = jax.lax.dynamic_index_in_dim(rows_[b], j, keepdims=False)
            return tuple(gather_leaves(tie([row], anchor)[0], buckets[b], plan, how))

        def full(part):  # buckets a half does not read: their example leaves (dead code there)
            return tuple(part.get(b, example[b]) for b in range(n))

        second = sorted(ph.second_buckets)
        g2 = {b: gather_one(b, ct) for b in second}

        def f2(g_, cut_, c_, kd_, xd_):
            flat = jax.tree.leaves((full(dict(zip(second, g_, strict=True))), c_, x_of(xd_), k_of(list(kd_))))
            return jax.tree.unflatten(carry_tree, ph.second(flat, cut_))

        _, vjp2 = jax.vjp(f2, tuple(g2[b] for b in second), list(cut), c_in, tuple(kd), xd)
        dg2, dcut, dc2, dk2, dxd2 = vjp2(ct)
        dg = dict(zip(second, dg2, strict=True))
        out = {}
        for b in second:
            if b not in ph.first_buckets:
                out[b] = scatter_leaves(dg[b], buckets[b], plan, how, like_axes=like_axes[b])
        anchor = [out[b] for b in sorted(out)] or [ct]
        g1 = {b: g2[b] if b in g2 else gather_one(b, anchor) for b in sorted(ph.first_buckets)}
        order = sorted(ph.first_buckets)

        def f1(g_, c_, kd_, xd_):
            flat = jax.tree.leaves((full(dict(zip(order, g_, strict=True))), c_, x_of(xd_), k_of(list(kd_))))
            return ph.first(flat)

        _, vjp1 = jax.vjp(f1, tuple(g1[b] for b in order), c_in, tuple(kd), xd)
        dg1, dc1, dk1, dxd1 = vjp1(dcut)
        for b, d in zip(order, dg1, strict=True):
            if b in dg:
                d = tuple(a + c for a, c in zip(d, dg[b], strict=True))
            out[b] = scatter_leaves(d, buckets[b], plan, how, like_axes=like_axes[b])
        for b in range(n):  # a bucket the layer never reads: zero gradient
            if b not in out:
                zeros = [jnp.zeros_like(leaf) for leaf in example[b]]
                out[b] = scatter_leaves(zeros, buckets[b], plan, how, like_axes=like_axes[b])
        add = lambda a, c: jax.tree.map(jnp.add, a, c)
        return tuple(out[b] for b in range(n)), add(dc1, dc2), add(dk1, dk2), add(dxd1, dxd2)

    def full_dx(xs_, dxd_stacked):
        it = iter(dxd_stacked)
        return jax.tree.map(lambda a: next(it) if jnp.issubdtype(a.dtype, jnp.inexact) else _zero_cotangent(a), xs_)

    def full_dk(consts_, dk):  # the differentiable consts' gradients; float0 zeros for the others
        it = iter(dk)
        return [next(it) if jnp.issubdtype(a.dtype, jnp.inexact) else _zero_cotangent(a) for a in consts_]

    @jax.custom_vjp
    def run(rows_, c, xs_, consts_):
        return forward(rows_, c, xs_, consts_, save=False)[0]

    def run_fwd(rows_, c, xs_, consts_):
        out, res = forward(rows_, c, xs_, consts_, save=True)
        return out, (rows_, xs_, consts_, res)

    def run_bwd(saved, ct):
        rows_, xs_, consts_, (c_saved, g_saved, kept) = saved
        zero_k = tuple(jnp.zeros_like(a) for a in _inexact_part(list(consts_))[0])
        # The gradient rows are filled in place, one layer per iteration, in a buffer tied to the cotangent: as a
        # scan output (or untied) XLA may allocate it at the start of the step, alive through the whole forward.
        # (Under HSDP the cotangent varies over the replica axes too, which the rows must not: left untied there.)
        d_rows = tuple(
            tie([jnp.zeros_like(r)], ct)[0] if _axes_of(ct) <= varying_axes(r) else jnp.zeros_like(r) for r in rows_
        )
        if not prefetch or num_layers == 1:

            def step(state, inp):
                ct_, dk_acc, d_rows = state
                j, c_in, x_j, g_kept, kept_j = inp
                if phases is not None:
                    d_row, dc_, dk_, dxd_ = phased_vjp(rows_, j, c_in, x_j, consts_, g_kept, ct_)
                else:
                    g_j = g_kept if keep else gather(rows_, j)
                    d_row, dc_, dk_, dxd_ = layer_vjp(g_j, c_in, x_j, consts_, ct_, kept_j)
                d_rows = tuple(
                    jax.lax.dynamic_update_index_in_dim(a, r, j, 0) for a, r in zip(d_rows, d_row, strict=True)
                )
                return (dc_, jax.tree.map(jnp.add, dk_acc, dk_), d_rows), dxd_

            (dc, dk, d_rows), dxd = jax.lax.scan(
                step,
                (ct, zero_k, d_rows),
                (jnp.arange(num_layers), c_saved, xs_, g_saved, kept),
                reverse=True,
                unroll=unroll,
            )
            return d_rows, dc, full_dx(xs_, dxd), full_dk(consts_, dk)

        c0, c_stack = c_saved
        g0, g_stack = g_saved if keep else (None, None)

        def step(state, inp):
            ct_, g_next, dk_acc, d_rows = state
            j, c_in, x_j, g_kept, kept_j = inp
            if keep:
                g_j, g_below = g_kept, g_next
            else:
                g_j, g_below = g_next, gather(rows_, j - 1)  # prefetch the layer below
            d_row, dc_, dk_, dxd_ = layer_vjp(g_j, c_in, x_j, consts_, ct_, kept_j)
            d_rows = tuple(jax.lax.dynamic_update_index_in_dim(a, r, j, 0) for a, r in zip(d_rows, d_row, strict=True))
            return (dc_, g_below, jax.tree.map(jnp.add, dk_acc, dk_), d_rows), dxd_

        g_top = g0 if keep else gather(rows_, num_layers - 1)
        tail = jax.tree.map(lambda a: a[1:], xs_)
        kept_hi, kept_0 = jax.tree.map(lambda a: a[1:], kept), jax.tree.map(lambda a: a[0], kept)
        (ct1, g_0, dk_acc, d_rows), dxd_hi = jax.lax.scan(
            step,
            (ct, g_top, zero_k, d_rows),
            (jnp.arange(1, num_layers), c_stack, tail, g_stack, kept_hi),
            reverse=True,
            unroll=unroll,
        )
        d_row0, dc, dk0, dxd0 = layer_vjp(g_0, c0, x_at(xs_, 0), consts_, ct1, kept_0)
        d_rows = tuple(jax.lax.dynamic_update_index_in_dim(a, r, 0, 0) for a, r in zip(d_rows, d_row0, strict=True))
        dk = jax.tree.map(jnp.add, dk_acc, dk0)
        dxd = [jnp.concatenate([d0[None], dh]) for d0, dh in zip(dxd0, dxd_hi, strict=True)]
        return d_rows, dc, full_dx(xs_, dxd), full_dk(consts_, dk)

    run.defvjp(run_fwd, run_bwd)
    return run(rows, carry, xs, list(consts))


def _inexact_part(x: Any) -> tuple[list[jax.Array], Callable[[list[jax.Array]], Any]]:
    """The inexact leaves of ``x`` (what a VJP differentiates) and ``x`` rebuilt around new values for them."""
    leaves, tree = jax.tree.flatten(x)
    diff = [jnp.issubdtype(a.dtype, jnp.inexact) for a in leaves]

    def rebuild(values):
        it = iter(values)
        return jax.tree.unflatten(tree, [next(it) if d else a for a, d in zip(leaves, diff, strict=True)])

    return [a for a, d in zip(leaves, diff, strict=True) if d], rebuild


def _split(fn, example, carry, x0, consts, num_layers):
    """``(Phases, carry treedef)`` cutting the layer ``fn(g, c, x, *consts)`` in two, or None."""
    flat, tree = jax.tree.flatten((example, carry, x0, list(consts)))
    n_g = len(jax.tree.leaves(example))
    leaf_bucket = [b for b, leaves in enumerate(example) for _ in leaves] + [None] * (len(flat) - n_g)
    bucket_bytes = [sum(leaf.size * leaf.dtype.itemsize for leaf in leaves) for leaves in example]

    def flat_fn(*xs):
        g, c, x, k = jax.tree.unflatten(tree, xs)
        return jax.tree.leaves(fn(g, c, x, *k))

    got = split_layer(flat_fn, flat, leaf_bucket, bucket_bytes, num_layers)
    return None if got is None else (got[0], jax.tree.structure(carry))


_WHOLE_BYTES = 1 << 20


def _whole_buckets(plan: Plan, bucket_ids: list[int]) -> set[int]:
    """Stacked buckets gathered for all layers at once: at most 1 MiB over all layers and no larger than one
    layer of the group's largest bucket (so a layer group of small buckets keeps its per-layer gathers)."""
    per_layer = {b: plan.buckets[b].nbytes // plan.buckets[b].layers for b in bucket_ids}
    out = set()
    for b in bucket_ids:
        total = plan.buckets[b].nbytes
        if 0 < total <= _WHOLE_BYTES and any(total <= per_layer[o] for o in bucket_ids if o != b):
            out.add(b)
    return out


def _axes_of(tree: Any) -> frozenset[str]:
    return frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(tree)))


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)
