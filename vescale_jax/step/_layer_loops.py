"""The model's own loop over a stacked layer group (``nnx.scan``, ``nn.scan``, ``jax.lax.scan``) run as
:func:`vj.scan_layers`.

Inside ``vj.apply`` the leaves of a stacked layer group are :class:`vescale_jax.LayerShard` stand-ins for this
device's ``(L, S)`` rows. A MaxText-style Flax model loops over its layers with ``nnx.scan`` / ``nn.scan`` (with
``nnx.remat`` / ``nn.remat`` and split RNGs), which call ``jax.lax.scan`` with the layers' variables among the
scanned inputs. While the model is traced inside ``vj.apply`` (:func:`layer_loops`), ``jax.lax.scan`` is
:func:`_scan`: a scan whose ``xs`` hold stand-ins, scanned forward along their leading layer dim, runs as
``vj.scan_layers`` over those stand-ins (one layer gathered per iteration, its gradient reduce-scattered in the
backward, each layer's input carry saved and the layer recomputed: the same memory as ``vj.scan_layers``), with
the scan's other ``xs`` as per-layer inputs. Its per-layer outputs (``ys``) may be the scanned inputs handed back
unchanged (``nnx.scan`` / ``nn.scan`` hand the layers' variables back), which come back as the same stand-ins, and
integer, boolean or key values (an RNG stream's count), stacked in a buffer carried through the loop. Carry
leaves the body hands back unchanged (``nnx.scan``'s broadcast variables, ``in_axes=None``) are closed over by the
layer instead of carried, so they are not saved once per layer. Linen's
``nn.scan`` first traces its body once on its own (its constancy check, which also advances Linen's RNG counters
as in the unsharded run): it is handed a placeholder of each stand-in's stacked shape there. Any other scan runs
as ``jax.lax.scan``.

What stays refused, naming the fix (loop with ``vj.scan_layers`` / ``vj.flax.nnx_scan_layers``, or plan the group
without ``stacked=``): a reverse scan over the group, a scan over another dim than the leading layer dim
(``in_axes=1``: moving a stand-in), a ``length`` that is not the group's layer count, and floating-point per-layer
outputs computed in the loop (they would need a gradient through the loop's per-layer buffer).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from vescale_jax.step._forwarding import forwarded_inputs
from vescale_jax.step._jaxpr import evaluate, read
from vescale_jax.step._scan_layers import LayerShard, scan_layers

__all__ = ["layer_loops"]

_ORIGINAL = jax.lax.scan
_LOCK = threading.Lock()
_DEPTH = 0


def _is_shard(x: Any) -> bool:
    return isinstance(x, LayerShard)


def _refusal(shard: LayerShard, why: str) -> ValueError:
    unit = shard.plan.buckets[shard.spec.bucket].unit
    return ValueError(
        f"vj.apply: a scan (jax.lax.scan, nnx.scan, nn.scan) over the stacked layer group {unit!r}, planned with "
        f"vj.plan(stacked=...), {why}; its leaf {shard.spec.path} (shape {shard.shape}) is a stand-in for this "
        "device's rows. Such a scan runs as vj.scan_layers (one layer gathered per iteration) when it goes "
        "forward over the leading layer dim for the group's layer count and its per-layer outputs are only "
        f"the layers' variables handed back or integer / key values. Loop the group with vj.scan_layers(body, "
        f"params[{unit!r}], carry) (NNX: vj.flax.nnx_scan_layers(model.{unit}, x)), or leave {unit!r} out of "
        "vj.plan(stacked=...) to gather it whole."
    )


class _Retrace(Exception):
    """Raised from a trace of a loop body that the loop was not set up for: the shapes and dtypes of the per-layer
    outputs it computes (each gets a buffer in the carry) and the carry leaves it hands back unchanged (closed
    over instead of carried), to trace the loop again so."""

    def __init__(self, stacked: tuple[jax.ShapeDtypeStruct, ...], fixed: tuple[int, ...]):
        super().__init__("per-layer outputs to stack, carry leaves to close over")
        self.stacked, self.fixed = stacked, fixed


def _is_key(aval: Any) -> bool:
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key)


def _buffer(aval: Any, num_layers: int) -> jax.Array:
    """An empty ``(L, ...)`` buffer for a computed per-layer output (a PRNG key as its key data)."""
    if _is_key(aval):
        data = jax.eval_shape(jax.random.key_data, aval)
        return jnp.zeros((num_layers, *data.shape), data.dtype)
    return jnp.zeros((num_layers, *aval.shape), aval.dtype)


def _scan(f: Callable, init: Any, xs: Any = None, length: int | None = None, reverse: bool = False, unroll=1, **kw):
    """``jax.lax.scan`` while a model is traced inside ``vj.apply``: over stacked stand-ins, ``vj.scan_layers``."""
    xs = jax.tree.map(lambda x: x.shard if isinstance(x, _Placeholder) else x, xs, is_leaf=_is_shard)
    leaves = jax.tree.leaves(xs, is_leaf=_is_shard)
    if not any(_is_shard(x) for x in leaves):
        return _SAVED.get("lax", _ORIGINAL)(f, init, xs, length=length, reverse=reverse, unroll=unroll, **kw)
    first = next(x for x in leaves if _is_shard(x))
    if reverse:
        raise _refusal(first, "runs in reverse (reverse=True)")
    num_layers = first.rows.shape[0]
    if length is not None and length != num_layers:
        raise _refusal(first, f"has length={length}, not the group's {num_layers} layers")
    if any(kw.values()):
        raise _refusal(first, f"passes {sorted(k for k, v in kw.items() if v)}")
    stacked: tuple[Any, ...] = ()
    fixed: tuple[int, ...] = ()
    for _ in range(3):  # a trace that shows computed per-layer outputs or loop-invariant carry leaves: again
        try:
            return _LayerLoop(f, xs, num_layers, first, stacked, fixed)(init, unroll)
        except _Retrace as e:
            stacked, fixed = e.stacked, e.fixed
    return _LayerLoop(f, xs, num_layers, first, stacked, fixed)(init, unroll)


class _LayerLoop:
    """One ``jax.lax.scan`` over a stacked group's stand-ins, run as :func:`vj.scan_layers`.

    Attributes:
      f: the scan's body ``(carry, x) -> (carry, y)``.
      xs: the scanned inputs: stand-ins and arrays with a leading layer dim.
      num_layers: the group's layer count.
      first: a stand-in, named in refusals.
      stacked: shapes and dtypes of the per-layer outputs the body computes (not inputs handed back): each is
        written into an ``(L, ...)`` buffer carried through the loop (only integer, boolean and key values:
        a floating-point one would need a gradient through the buffer).
      fixed: the carry leaves (flat positions) the body hands back unchanged (``nnx.scan``'s broadcast
        variables): closed over by the layer instead of carried, so they are not saved once per layer.
    """

    def __init__(
        self,
        f: Callable,
        xs: Any,
        num_layers: int,
        first: LayerShard,
        stacked: tuple[Any, ...],
        fixed: tuple[int, ...],
    ):
        self.f, self.num_layers, self.first, self.stacked, self.fixed = f, num_layers, first, stacked, fixed
        self.leaves, self.tree = jax.tree.flatten(xs, is_leaf=_is_shard)
        self.at = [i for i, x in enumerate(self.leaves) if _is_shard(x)]
        self.others = [i for i, x in enumerate(self.leaves) if not _is_shard(x)]
        self.y_tree: Any = None
        self.source: list[int | None] = []  # per y leaf: the xs leaf it hands back, or None (computed)
        self.impls: tuple[Any, ...] = ()  # per computed y: its PRNG key implementation, or None

    def __call__(self, init: Any, unroll: Any) -> tuple[Any, Any]:
        shards = [self.leaves[i] for i in self.at]
        bufs = tuple(_buffer(a, self.num_layers) for a in self.stacked)
        xs = (tuple(self.leaves[i] for i in self.others), jnp.arange(self.num_layers))
        c_flat, c_tree = jax.tree.flatten(init)
        fixed = {i: c_flat[i] for i in self.fixed}
        moving = tuple(c for i, c in enumerate(c_flat) if i not in fixed)
        body = lambda params, state, x: self._body(params, state, x, fixed, c_tree)
        moved, bufs = scan_layers(body, shards, (moving, bufs), xs, unroll=unroll)
        it_c = iter(moved)
        carry = jax.tree.unflatten(c_tree, [fixed[i] if i in fixed else next(it_c) for i in range(len(c_flat))])
        it = iter(zip(bufs, self.impls, strict=True))
        ys = []
        for j in self.source:
            if j is not None:
                ys.append(self.leaves[j])
                continue
            buf, impl = next(it)
            ys.append(buf if impl is None else jax.random.wrap_key_data(buf, impl=impl))
        return carry, jax.tree.unflatten(self.y_tree, ys)

    def _body(self, params: list[Any], state: Any, x: Any, fixed: dict[int, Any], c_tree: Any) -> Any:
        moving, bufs = state
        others, index = x
        flat = list(self.leaves)
        for i, p in zip(self.at, params, strict=True):
            flat[i] = p
        for i, v in zip(self.others, others, strict=True):
            flat[i] = v
        it_c = iter(moving)
        n_c = c_tree.num_leaves
        c_flat = [fixed[i] if i in fixed else next(it_c) for i in range(n_c)]

        def step(*vals: Any) -> Any:
            return self.f(jax.tree.unflatten(c_tree, vals[:n_c]), jax.tree.unflatten(self.tree, vals[n_c:]))

        # traced once: which per-layer outputs hand an input back unchanged (through nnx.remat, jit ...)
        closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*c_flat, *flat)
        n_out = len(jax.tree.leaves(out_shape[0]))
        forwarded = forwarded_inputs(closed.jaxpr)
        same = tuple(i for i in range(min(n_c, n_out)) if forwarded[i] == i)  # carry leaves handed back as they are
        origin = forwarded[n_out:]
        y_avals = jax.tree.leaves(out_shape[1])
        source = [o - n_c if o is not None and o >= n_c else None for o in origin]
        computed = tuple(a for a, j in zip(y_avals, source, strict=True) if j is None)
        for a in computed:
            if jnp.issubdtype(a.dtype, jnp.inexact):
                raise _refusal(
                    self.first,
                    f"returns a per-layer floating-point output computed in the loop (shape {a.shape}), which "
                    "vj.scan_layers does not stack: return it through the carry",
                )
        if [(a.shape, a.dtype) for a in computed] != [(a.shape, a.dtype) for a in self.stacked] or (
            same != self.fixed and jax.tree.structure(out_shape[0]) == c_tree
        ):
            raise _Retrace(tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in computed), same)
        self.y_tree, self.source = jax.tree.structure(out_shape[1]), source
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(closed.jaxpr.invars, [*c_flat, *flat], strict=True))
        evaluate(closed.jaxpr.eqns, env)
        outs = [read(env, v) for v in closed.jaxpr.outvars]
        ys = [y for y, j in zip(outs[n_out:], source, strict=True) if j is None]
        self.impls = tuple(
            jax.random.key_impl(y) if _is_key(a) else None for y, a in zip(ys, self.stacked, strict=True)
        )
        bufs = tuple(
            jax.lax.dynamic_update_index_in_dim(buf, jax.random.key_data(y) if _is_key(a) else y, index, 0)
            for buf, y, a in zip(bufs, ys, self.stacked, strict=True)
        )
        if jax.tree.structure(out_shape[0]) != c_tree:  # lax.scan's own error
            return jax.tree.unflatten(jax.tree.structure(out_shape[0]), outs[:n_out]), bufs
        return tuple(c for i, c in enumerate(outs[:n_out]) if i not in fixed), bufs


class _Placeholder(jax.ShapeDtypeStruct):
    """A stand-in's stacked shape and model dtype, in place of the stand-in while Linen's ``nn.scan`` traces its
    body once on its own (to check that broadcast variables are loop invariants, and advancing Linen's RNG
    counters as the unsharded run does); :func:`_scan` puts the stand-in back. Any other use refuses."""

    def __init__(self, shard: LayerShard):
        how, plan = shard.policy.wire(), shard.plan
        dtype = plan.buckets[shard.spec.bucket].dtype
        layers = shard.rows.shape[0]
        super().__init__((layers, *plan.layer_shape(shard.spec)), how.model_dtype(dtype) or how.leaf_dtype(dtype))
        self.shard = shard

    def __jax_array__(self) -> Any:
        raise _refusal(
            self.shard, "moves or reads the stacked leaf outside the loop (nn.scan with variable_axes other than 0?)"
        )


def _axes_scan(original: Callable) -> Callable:
    """Flax Linen's ``flax.core.axes_scan.scan`` (what ``nn.scan`` runs) for a loop over stand-ins: each stand-in
    handed in as a :class:`_Placeholder` of its stacked shape, so that the loop's own trace of its body reads
    arrays; the loop's ``jax.lax.scan`` is then :func:`_scan`, which puts the stand-ins back."""

    def scan(fn: Callable, in_axes: Any, out_axes: Any, *a: Any, **kw: Any) -> Callable:
        inner = original(fn, in_axes, out_axes, *a, **kw)

        def run(broadcast_in: Any, init: Any, *args: Any) -> Any:
            placed = jax.tree.map(lambda x: _Placeholder(x) if _is_shard(x) else x, args, is_leaf=_is_shard)
            return inner(broadcast_in, init, *placed)

        return run

    return scan


def _flax_axes_scan() -> Any:
    try:
        from flax.core import axes_scan
    except ImportError:  # without Flax: jax.lax.scan alone
        return None
    return axes_scan


_SAVED: dict[str, Any] = {}  # while active: the functions replaced


@contextlib.contextmanager
def layer_loops() -> Iterator[None]:
    """While active, ``jax.lax.scan`` over a stacked group's stand-ins runs as ``vj.scan_layers`` (module
    docstring) and Linen's ``nn.scan`` reaches it; any other scan is unchanged. Re-entrant."""
    global _DEPTH
    with _LOCK:
        if _DEPTH == 0:
            _SAVED["lax"] = jax.lax.scan
            jax.lax.scan = _scan
            axes = _flax_axes_scan()
            if axes is not None:
                _SAVED["axes"] = axes.scan
                axes.scan = _axes_scan(axes.scan)
        _DEPTH += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                jax.lax.scan = _SAVED.pop("lax")
                if "axes" in _SAVED:
                    _flax_axes_scan().scan = _SAVED.pop("axes")


def with_layer_loops(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with :func:`layer_loops` active."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with layer_loops():
            return fn(*args, **kwargs)

    return run
