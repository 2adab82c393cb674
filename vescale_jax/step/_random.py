"""Random draws inside ``vj.apply`` that mean what they mean unsharded.

Inside ``vj.apply`` the model runs per device on that device's slice of the batch. A key that does not come
through the batch (closed over from ``nnx.Rngs``, a step argument, Linen's ``rngs=``) is the same on every
device, so ``jax.random.bernoulli(key, p, x.shape)`` would draw the same mask everywhere, at the local shape
``(b, ...)``. Unsharded, the draw has the global shape ``(B, ...)`` and device ``d``'s examples get rows
``[d*b, (d+1)*b)`` of it.

:func:`split_draws` re-runs the model's jaxpr with every such draw (``random_bits`` and ``random_split`` whose
key does not vary over the data axes and whose requested shape has the batch dim) replaced by this device's
part of the global draw:

* partitionable threefry (JAX's default key): the bits of element ``i`` of a draw depend only on the key and
  ``i``'s flat index, so only the local slice's bits are computed, from their global flat indices (64-bit,
  as uint32 pairs): bit for bit the unsharded draw, at per-device memory;
* other implementations (``rbg``, ``unsafe_rbg``, non-partitionable threefry): the local shape drawn from the
  key folded with the device's index over the data axes: independent per device, the same distribution.

Which dim is the batch dim: the model is traced again with the batch arguments at their global shape and the
draws are matched in order: a dim ``m`` times larger (``m`` devices over the data axes) is the batch dim, an
unchanged shape has none (a ``(D,)`` noise shared by all examples is drawn as unsharded). When that trace
fails or its draws do not match, a leading dim equal to the local batch size is the batch dim. Under a context
axis (the batch's dim 1, the sequence, split over it in the balanced order) one more trace, with the sequences
global and the batch local, names the sequence dim: a dim ``cp`` times larger there; along it each device
computes its tokens' global positions (``vescale_jax.step._context.local_positions``). Without the traces a
draw with the batch dim is drawn independently per device (data and context index folded in). Draws inside
``jit``, ``scan``, ``while``, ``cond`` and ``remat`` are reached; :func:`vj.scan_layers` bodies through
:func:`split_layer_draws`. A model without such a draw runs untouched.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vescale_jax._compat import (
    THREEFRY_IMPL,
    aval_varying_axes,
    bind_equation,
    draw_bit_width,
    draw_shape,
    is_literal,
    is_pvary,
    is_random_draw,
    is_random_split,
    key_impl_name,
    nested_jaxprs,
    pvary_axes,
    rerun_nested,
    threefry2x32,
    threefry_partitionable,
)
from vescale_jax.step._context import Context, local_positions
from vescale_jax.step._jaxpr import evaluate, read
from vescale_jax.step._sequence_positions import PositionRules, position_rules, rewrite
from vescale_jax.step._wire import varying_axes, varying_like

__all__ = ["bind_tolerant", "run_tolerant", "split_draws", "split_layer_draws", "tolerant"]

_U32 = jnp.uint32
_INDEPENDENT = -1  # a draw whose shape grows with the batch in no clean way: drawn independently per device


@dataclasses.dataclass(frozen=True)
class _Draws:
    """How the draws of one ``vj.apply`` are split: the data axes, their size ``m``, the batch dim per local
    draw shape (``None``: none; ``-1``: independent per device), the local batch size for shapes the table
    lacks, whether varying axes are typed (``check_vma``); under a context axis, the context, the sequence
    dim per local draw shape and the rules for the model's own positions (:mod:`._sequence_positions`)."""

    axes: tuple[str, ...]
    size: int
    table: dict[tuple[int, ...], int | None]
    local_batch: int | None
    check_vma: bool
    context: Context | None = None
    seq_table: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)
    positions: PositionRules | None = None

    def batch_dim(self, shape: tuple[int, ...]) -> int | None:
        if shape in self.table:
            return self.table[shape]
        if shape and self.local_batch is not None and shape[0] == self.local_batch:
            # without the global trace, a context split's sequence dim is unknown: drawn per device
            return 0 if self.context is None else _INDEPENDENT
        return None

    def seq_dim(self, shape: tuple[int, ...]) -> int | None:
        return self.seq_table.get(shape)

    @property
    def split_axes(self) -> tuple[str, ...]:
        """The axes a split draw varies over: the data axes, and the context axis under one."""
        return self.axes if self.context is None else (*self.axes, self.context.axis)


_ACTIVE: contextvars.ContextVar[_Draws | None] = contextvars.ContextVar("vescale_jax_draws", default=None)


@contextlib.contextmanager
def _active(draws: _Draws | None) -> Iterator[None]:
    token = _ACTIVE.set(draws)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def split_draws(
    fn: Callable[..., Any],
    *,
    axes: Sequence[str],
    size: int,
    check_vma: bool,
    global_args: Callable[[Sequence[Any]], Sequence[Any] | None] | None = None,
    context: Context | None = None,
) -> Callable[..., Any]:
    """``fn(tree, *args)`` whose draws from keys not varying over ``axes`` are this device's part of the draw
    the unsharded model makes (see the module docstring); call inside ``shard_map``.

    Args:
      fn: the model ``(tree, *args) -> outputs``; ``args`` are the batch (local slices).
      axes: the data axes the batch is split over.
      size: the number of devices over ``axes``.
      check_vma: whether the enclosing ``shard_map`` types varying axes; without it a key counts as the same on
        every device unless it is computed from ``args``.
      global_args: ``local arg leaves -> global shape structs`` for the batch-dim trace (None: the leading-dim
        rule only).
      context: the context axis the batch's sequence dim (dim 1) is split over, or None.

    Returns:
      The wrapped model (same signature and outputs' types, up to varying axes).

    Sharding:
      Inside ``shard_map`` over ``axes``; a replaced draw varies over ``axes``.
    """
    axes = tuple(axes)
    if size == 1 and (context is None or context.size == 1):
        return fn
    if context is not None and context.size == 1:
        context = None
    split_axes = axes if context is None else (*axes, context.axis)

    def run(tree, *args):
        in_flat, in_tree = jax.tree.flatten((tree, args))
        n_tree = len(jax.tree.leaves(tree))

        def flat_fn(*xs):
            t, a = jax.tree.unflatten(in_tree, xs)
            return fn(t, *a)

        with _active(None):
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*in_flat)
        local = list(_draw_shapes(closed.jaxpr))
        arg_leaves = in_flat[n_tree:]
        to_split = any(s and (not check_vma or not (v & set(split_axes))) for s, v in local)
        glob, mid = _global_traces(flat_fn, in_flat, n_tree, global_args, context, needed=to_split)
        positions = None
        if context is not None:
            length = next((int(np.shape(x)[1]) for x in arg_leaves if np.ndim(x) >= 2), None)
            positions = None if length is None else position_rules(closed.jaxpr, mid, context, length)
        if not to_split and positions is None:
            # nothing to split or place: the model as it is, from its trace (the model's Python runs once)
            env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
            env.update(zip(closed.jaxpr.invars, in_flat, strict=True))
            evaluate(closed.jaxpr.eqns, env)
            outs = [read(env, v) for v in closed.jaxpr.outvars]
            return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
        batch = next((int(np.shape(x)[0]) for x in arg_leaves if np.ndim(x)), None)
        table, seqs = _batch_dims([s for s, _ in local], glob, mid, size, context)
        draws = _Draws(axes, size, table, batch, check_vma, context, seqs, positions)
        with _active(draws):  # vj.scan_layers bodies are split as they are traced (a new function: no cached trace)
            closed, out_shape = jax.make_jaxpr(lambda *xs: flat_fn(*xs), return_shape=True)(*in_flat)
        outs = _run(closed, in_flat, [False] * n_tree + [True] * len(arg_leaves), draws)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return run


def split_layer_draws(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a :func:`vj.scan_layers` layer body ``(params, carry, x) -> carry``) with its draws split as the
    enclosing :func:`split_draws` splits the model's, or ``fn`` itself outside one. The carry counts as the
    batch (without ``check_vma``)."""

    def run(*a):
        draws = _ACTIVE.get()
        if draws is None:
            return fn(*a)
        in_flat, in_tree = jax.tree.flatten(a)
        dep = [i == 1 for i, x in enumerate(a) for _ in jax.tree.leaves(x)]
        closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(in_tree, xs)), return_shape=True)(
            *in_flat
        )
        return jax.tree.unflatten(jax.tree.structure(out_shape), _run(closed, in_flat, dep, draws))

    return run


def tolerant(fn: Callable[..., Any], *example: Any) -> Callable[..., Any]:
    """``fn`` traced once on ``example`` and evaluated on later arguments that may vary over more mesh axes than
    the example did: operands are marked varying where they meet a varying value (as JAX's own operations do
    when traced). A :func:`vj.scan_layers` backward receives its per-layer inputs as ``shard_map`` residuals,
    varying over every axis, where the forward had them invariant (``fold_in(key, layer_index)``)."""
    flat, tree = jax.tree.flatten(example)
    closed, out_shape = jax.make_jaxpr(lambda *xs: fn(*jax.tree.unflatten(tree, xs)), return_shape=True)(*flat)
    out_tree = jax.tree.structure(out_shape)

    def run(*args):
        outs = _run(closed, jax.tree.leaves(args), [False] * len(flat), None)
        return jax.tree.unflatten(out_tree, outs)

    return run


def _draw_shapes(jaxpr: Any) -> Iterator[tuple[tuple[int, ...], frozenset[str]]]:
    """Per draw of ``jaxpr`` and its nested jaxprs, in order: its per-key shape and its key's varying axes."""
    for eqn in jaxpr.eqns:
        if is_random_draw(eqn):
            yield draw_shape(eqn), aval_varying_axes(eqn.invars[0].aval)
        for sub in nested_jaxprs(eqn):
            yield from _draw_shapes(sub.jaxpr)


def _global_traces(
    flat_fn, in_flat, n_tree, global_args, context, *, needed: bool
) -> tuple[list[tuple[int, ...]] | None, Any | None]:
    """The model traced again: its draws' shapes at the global batch shapes (when ``needed``: there are draws to
    split), and under a context axis its jaxpr with the sequences global and the batch local (dim 0 local, the
    others global). None for a trace not made or that fails (a model that traces only at its local shapes)."""
    if global_args is None or not (needed or context is not None):
        return None, None
    try:
        shapes = global_args(in_flat[n_tree:])
    except Exception:
        return None, None
    if shapes is None:
        return None, None
    glob = mid = None
    try:
        if needed:
            glob = [s for s, _ in _draw_shapes(_traced(flat_fn, in_flat[:n_tree], shapes))]
        if context is not None:
            mixed = [
                jax.ShapeDtypeStruct((*np.shape(x)[:1], *g.shape[1:]), g.dtype) if np.ndim(x) else g
                for x, g in zip(in_flat[n_tree:], shapes, strict=True)
            ]
            mid = _traced(flat_fn, in_flat[:n_tree], mixed)
    except Exception:
        return None, None
    return glob, mid


def _batch_dims(
    local, glob, mid_jaxpr, size, context=None
) -> tuple[dict[tuple[int, ...], int | None], dict[tuple[int, ...], int]]:
    """Per local draw shape, its batch dim, from the draws of the trace at the global batch shapes ``glob``
    (empty when that trace failed or its draws do not match the local ones); and under a context axis its
    sequence dim, from the trace with the sequences global and the batch local ``mid_jaxpr`` (a dim that grows
    ``cp`` times there)."""
    if glob is None:
        return {}, {}
    mid = list(local) if context is None else None
    if context is not None:
        if mid_jaxpr is None:
            return {}, {}
        mid = [s for s, _ in _draw_shapes(mid_jaxpr)]
    if not (len(glob) == len(mid) == len(local)):
        return {}, {}
    table: dict[tuple[int, ...], int | None] = {}
    seqs: dict[tuple[int, ...], int] = {}
    for lo, md, gl in zip(local, mid, glob, strict=True):
        seq = None
        if context is not None:
            seq = _grown(lo, md, context.size)
            md = lo if seq is None else md
        dim = None if md == gl else _grown(md, gl, size)
        dim = _INDEPENDENT if dim is None and md != gl else dim
        if seq == _INDEPENDENT:
            dim, seq = _INDEPENDENT, None
        if table.get(lo, dim) != dim or seqs.get(lo, seq) != seq:
            dim, seq = _INDEPENDENT, None  # one local shape, two meanings: never the same draw on every device
        table[lo] = dim
        if seq is not None:
            seqs[lo] = seq
    return table, seqs


def _traced(flat_fn, tree_leaves, shapes) -> Any:
    with _active(None):
        return jax.make_jaxpr(lambda *xs: flat_fn(*xs))(*tree_leaves, *shapes).jaxpr


def _grown(lo: tuple[int, ...], gl: tuple[int, ...], factor: int) -> int | None:
    """The one dim of ``lo`` that is ``factor`` times larger in ``gl`` (None: none grew; ``-1``: another change)."""
    if lo == gl:
        return None
    grown = [j for j in range(len(lo)) if len(lo) == len(gl) and gl[j] != lo[j]]
    return grown[0] if len(grown) == 1 and gl[grown[0]] == factor * lo[grown[0]] else _INDEPENDENT


def _run(closed: Any, invals: Sequence[Any], dep: Sequence[bool], draws: _Draws | None) -> list[Any]:
    """Evaluates ``closed`` with its replicated batch draws split (nested jaxprs included; ``draws`` None: none
    split, operands only matched in varying axes). ``dep``: per input, whether it comes from the batch (read
    only without ``check_vma``)."""
    jaxpr = closed.jaxpr
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, invals, strict=True))
    from_batch = {v for v, d in zip(jaxpr.invars, dep, strict=True) if d}
    for eqn in jaxpr.eqns:
        vals = [read(env, v) for v in eqn.invars]
        d = any(v in from_batch for v in eqn.invars if not is_literal(v))
        outs = None
        if draws is not None and draws.positions is not None:
            outs = rewrite(eqn, vals, draws.positions)  # positions made from the local length: the global ones
        if outs is None and is_random_draw(eqn):
            outs = None if draws is None else _split_draw(eqn, vals[0], d, draws)
        elif outs is None:
            keyish = any(
                v in from_batch and _is_keyish(x) for v, x in zip(eqn.invars, vals, strict=True) if not is_literal(v)
            )
            outs = rerun_nested(eqn, vals, lambda c, a, k=keyish: _run(c, a, [k] * len(a), draws))
        if outs is None:
            outs = _bind(eqn, vals, draws is None or draws.check_vma)
        env.update(zip(eqn.outvars, outs, strict=True))
        if d:
            from_batch.update(eqn.outvars)
    return [read(env, v) for v in jaxpr.outvars]


def _bind(eqn: Any, vals: list[Any], check_vma: bool) -> list[Any]:
    """Binds ``eqn``, its operands first marked varying over the union of their varying axes where a split draw
    made some of them vary (as JAX's own operations do when traced), and a ``pvary`` of a value that already
    varies passing it through.

    Only operands the trace typed alike are made alike: an operation that takes operands of different varying
    axes (``sort`` of a varying key with an invariant ``iota``, as ``jnp.argsort`` traces; an invariant index)
    keeps them different, so its results keep the varying axes they were traced with."""
    if check_vma:
        seen = [varying_axes(x) for x in vals]
        if is_pvary(eqn) and len(vals) == 1 and set(pvary_axes(eqn)) & seen[0]:
            # a pvary of a value that already varies over some of its axes: only the others
            return [varying_like(vals[0], frozenset(pvary_axes(eqn)) | seen[0])]
        traced = [aval_varying_axes(v.aval) for v in eqn.invars]
        if nested_jaxprs(eqn):
            # a call (custom_vjp, jit, a loop) types each operand on its own: each varies at least as traced
            return bind_equation(eqn, [varying_like(jnp.asarray(x), w) for x, w in zip(vals, traced, strict=True)])
        if not is_pvary(eqn):
            alike: dict[frozenset[str], frozenset[str]] = {}
            for t, a in zip(traced, seen, strict=True):
                alike[t] = alike.get(t, frozenset()) | a
            want = [alike[t] for t in traced]
            vals = [x if a == w else varying_like(jnp.asarray(x), w) for x, a, w in zip(vals, seen, want, strict=True)]
    return bind_equation(eqn, vals)


def run_tolerant(closed: Any, args: Sequence[Any]) -> list[Any]:
    """Evaluates ``closed`` on ``args`` as :func:`tolerant` does (operands matched in varying axes, nested jaxprs
    traced again, no draw split)."""
    return _run(closed, list(args), [False] * len(args), None)


def bind_tolerant(eqn: Any, vals: list[Any]) -> list[Any]:
    """Binds ``eqn`` with its operands matched in varying axes, as :func:`tolerant` does."""
    return _bind(eqn, vals, True)


def _is_keyish(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) or dtype == np.uint32)


def _split_draw(eqn: Any, key: Any, from_batch: bool, draws: _Draws) -> list[Any] | None:
    """This device's part of a replicated draw with the batch dim (or, under a context axis, the sequence dim),
    or None to draw as the model does."""
    varies = bool(varying_axes(key) & set(draws.split_axes)) if draws.check_vma else from_batch
    shape = draw_shape(eqn)
    dim = draws.batch_dim(shape) if shape else None
    seq = draws.seq_dim(shape) if shape else None
    if varies or (dim is None and seq is None):
        return None
    exact = (dim is None or dim >= 0) and threefry_partitionable() and key_impl_name(key) == THREEFRY_IMPL
    if exact:
        global_shape, offsets = list(shape), {}
        if dim is not None:
            global_shape[dim] *= draws.size
            index = jax.lax.axis_index(draws.axes) if draws.axes else 0
            offsets[dim] = lambda c, index=index, b=shape[dim]: c + jnp.asarray(index * b).astype(_U32)
        if seq is not None:
            global_shape[seq] *= draws.context.size
            where = local_positions(shape[seq], draws.context).astype(_U32)
            offsets[seq] = lambda c, where=where, s=seq: _take_along(where, c, s)
        one = lambda k: _threefry_part(k, eqn, shape, global_shape, offsets)
    else:
        index = jax.lax.axis_index(draws.split_axes)
        one = lambda k: bind_equation(eqn, [jax.random.fold_in(k, index)])[0]
    for _ in range(np.ndim(key)):  # a key array: one draw per key
        one = jax.vmap(one)
    return [one(key)]


def _take_along(where: Any, coord: Any, dim: int) -> Any:
    """``where[coord]`` for a coordinate array ``coord`` that varies along ``dim`` only (a broadcast iota)."""
    shape = [1] * coord.ndim
    shape[dim] = where.shape[0]
    return jnp.broadcast_to(jnp.reshape(where, shape), coord.shape)


def _threefry_part(
    key: Any, eqn: Any, shape: tuple[int, ...], global_shape: Sequence[int], offsets: dict[int, Callable]
) -> Any:
    """This device's elements of the partitionable threefry draw of ``eqn`` at ``global_shape``, from their
    global flat indices: along each dim of ``offsets`` the local coordinate ``c`` is the global ``offsets[dim](c)``
    (rows ``[index*b, (index+1)*b)`` of the batch dim; a context split's token positions), elsewhere itself."""
    strides = [math.prod(global_shape[j + 1 :]) for j in range(len(shape))]
    acc = (jnp.zeros(shape, _U32), jnp.zeros(shape, _U32))
    for j, stride in enumerate(strides):
        coord = jax.lax.broadcasted_iota(_U32, shape, j)
        if j in offsets:
            coord = offsets[j](coord)
        acc = _add64(acc, _mul64(coord, stride))
    words = jax.random.key_data(key)
    bits1, bits2 = threefry2x32(words[0], words[1], acc[0], acc[1])
    if is_random_split(eqn):
        return jax.random.wrap_key_data(jnp.stack([bits1, bits2], axis=-1), impl=key_impl_name(key))
    width = draw_bit_width(eqn)
    if width == 64:
        u64 = jnp.dtype("uint64")
        return (bits1.astype(u64) << np.uint64(32)) | bits2.astype(u64)
    bits = bits1 ^ bits2
    return bits if width == 32 else bits.astype(jnp.dtype(f"uint{width}"))


def _mul64(x: Any, c: int) -> tuple[Any, Any]:
    """``x * c`` modulo 2**64 as ``(hi, lo)`` uint32 words, for a uint32 array ``x`` and an integer ``c``."""
    c_lo, c_hi = c & 0xFFFFFFFF, (c >> 32) & 0xFFFFFFFF
    x_lo, x_hi = x & _U32(0xFFFF), x >> _U32(16)
    c0, c1 = c_lo & 0xFFFF, c_lo >> 16
    lo = x_lo * _U32(c0)
    mid_a, mid_b = x_lo * _U32(c1), x_hi * _U32(c0)
    hi = x_hi * _U32(c1) + (mid_a >> _U32(16)) + (mid_b >> _U32(16))
    for part in (mid_a << _U32(16), mid_b << _U32(16)):
        new = lo + part
        hi = hi + (new < lo).astype(_U32)
        lo = new
    return hi + x * _U32(c_hi), lo


def _add64(a: tuple[Any, Any], b: tuple[Any, Any]) -> tuple[Any, Any]:
    """``a + b`` modulo 2**64 on ``(hi, lo)`` uint32 words."""
    lo = a[1] + b[1]
    return a[0] + b[0] + (lo < a[1]).astype(_U32), lo
