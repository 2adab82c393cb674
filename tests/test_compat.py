"""Each JAX / optax internal the package relies on (``vescale_jax._compat``), pinned by one test.

A JAX or optax upgrade that breaks an assumption fails here first, with a message naming the assumption, the
``_compat`` entry and the vescale_jax modules that depend on it. The last test keeps those internals in
``_compat`` alone.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import subprocess
import sys
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh

from vescale_jax import _compat

ROOT = pathlib.Path(__file__).resolve().parent.parent
P = jax.sharding.PartitionSpec
VERSIONS = f"JAX {jax.__version__}, optax {optax.__version__}"


def broke(entry: str, assumption: str, users: str) -> str:
    """The failure message: which assumption of which ``_compat`` entry broke, and who depends on it."""
    return f"[{VERSIONS}] vescale_jax._compat.{entry}: {assumption} no longer holds; {users} depend on it."


def closed_of(f, *args):
    return jax.make_jaxpr(f)(*args)


def out_eqn(f, *args):
    """The equation producing ``f(*args)``'s (single) output."""
    jaxpr = closed_of(f, *args).jaxpr
    (out,) = jaxpr.outvars
    return next(e for e in jaxpr.eqns if out in e.outvars)


def run_by_equations(closed, *args):
    """Evaluates ``closed`` equation by equation with ``_compat.bind_equation``, as ``step/_jaxpr`` does."""
    return evaluate_with(closed, args, lambda eqn, vals: None)


def evaluate_with(closed, args, rerun):
    """Evaluates ``closed`` equation by equation: ``rerun(eqn, values)`` gives an equation's outputs, or None to
    bind it as it is (``_compat.bind_equation``)."""
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    rd = lambda v: v.val if _compat.is_literal(v) else env[v]
    for eqn in jaxpr.eqns:
        vals = [rd(v) for v in eqn.invars]
        outs = rerun(eqn, vals)
        env.update(zip(eqn.outvars, outs if outs is not None else _compat.bind_equation(eqn, vals), strict=True))
    return [rd(v) for v in jaxpr.outvars]


# ----------------------------------------------------------------------------------------------------------
# jaxpr types and equations


def test_literal_is_a_constant_atom():
    jaxpr = closed_of(lambda x: x * 3.0, jnp.ones(2)).jaxpr
    (eqn,) = jaxpr.eqns
    kinds = [_compat.is_literal(v) for v in eqn.invars]
    assert kinds == [False, True], broke(
        "is_literal",
        "a Python scalar operand is a jax.extend.core.Literal and a traced input is not",
        "step/_jaxpr, step/_point_of_use, step/_fp32_grads, step/_wire_segment",
    )
    assert float(eqn.invars[1].val) == 3.0, broke("is_literal", "a Literal holds its value in .val", "step/_jaxpr")
    hash(eqn.invars[0])  # variables are dictionary keys in every caller


def test_jaxpr_structure_is_the_public_one():
    import jax.extend.core as jex  # the public types whose fields the callers read

    closed = closed_of(lambda x, y: jnp.sin(x) * y, jnp.ones(2), jnp.ones(2))
    users = "step/_jaxpr, step/_point_of_use, step/_layer_split, step/_fp32_grads, step/_wire_segment"
    assert isinstance(closed, _compat.ClosedJaxpr) and isinstance(closed.jaxpr, jex.Jaxpr), broke(
        "ClosedJaxpr", "jax.make_jaxpr gives a jax.extend.core.ClosedJaxpr of a jax.extend.core.Jaxpr", users
    )
    for field in ("eqns", "constvars", "invars", "outvars"):
        assert hasattr(closed.jaxpr, field), broke("(module docstring)", f"a Jaxpr has .{field}", users)
    for eqn in closed.jaxpr.eqns:
        assert isinstance(eqn, jex.JaxprEqn), broke("(module docstring)", "equations are JaxprEqn", users)
        for field in ("invars", "outvars", "params", "effects"):
            assert hasattr(eqn, field), broke("(module docstring)", f"a JaxprEqn has .{field}", users)


def test_as_closed_closes_an_open_jaxpr():
    closed = closed_of(lambda x: jnp.sin(x) + 1.0, jnp.ones(3))
    again = _compat.as_closed(closed.jaxpr)
    assert isinstance(again, _compat.ClosedJaxpr) and tuple(again.consts) == (), broke(
        "as_closed", "ClosedJaxpr(jaxpr, ()) closes an open jaxpr over no constants", "step/_point_of_use"
    )
    assert _compat.as_closed(closed) is closed, broke("as_closed", "a ClosedJaxpr has .consts", "step/_point_of_use")
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(run_by_equations(again, x)[0], jnp.sin(x) + 1.0)


def test_nested_jit_is_a_nested_call_that_inlines():
    f = lambda x: jax.jit(lambda y: jnp.sin(y) * 2.0)(x)
    eqn = out_eqn(f, jnp.ones(3))
    assert _compat.is_nested_call(eqn), broke(
        "is_nested_call / NESTED_CALL_PRIMITIVES",
        f"jax.jit inside a traced function is an equation named in NESTED_CALL_PRIMITIVES (got "
        f"{_compat.primitive_name(eqn)!r}) holding params['jaxpr']",
        "step/_point_of_use (inlines nested jits to find each parameter's point of use), step/_layer_split",
    )
    inner = _compat.nested_call_jaxpr(eqn)
    assert "sin" in [_compat.primitive_name(e) for e in inner.jaxpr.eqns], broke(
        "nested_call_jaxpr", "params['jaxpr'] of a nested jit is the jitted function's jaxpr", "step/_point_of_use"
    )
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(run_by_equations(inner, x)[0], f(x))


@jax.custom_jvp
def _cube(x):
    return x**3


_cube.defjvp(lambda primals, tangents: (_cube(primals[0]), 3.0 * primals[0] ** 2 * tangents[0]))


@jax.custom_vjp
def _clip_grad(x):
    return jnp.sin(x)


_clip_grad.defvjp(lambda x: (jnp.sin(x), jnp.cos(x)), lambda c, g: (jnp.clip(c * g, -0.5, 0.5),))

WHOLE = {  # higher-order equations that stay whole (bound as they are), never inlined
    "scan": lambda x: jax.lax.scan(lambda c, s: (c * s + jnp.sin(c), None), x, jnp.stack([x, 2.0 * x]))[0],
    "cond": lambda x: jax.lax.cond(jnp.sum(x) > 0, jnp.sin, jnp.cos, x),
    "checkpoint": lambda x: jax.checkpoint(lambda y: jnp.sin(y) ** 2)(x),
    "custom_jvp": _cube,
    "custom_vjp": _clip_grad,
}


@pytest.mark.parametrize("kind", sorted(WHOLE))
def test_higher_order_equations_stay_whole_and_rebind(kind):
    f = WHOLE[kind]
    x = jnp.linspace(-1.0, 2.0, 4)
    eqn = out_eqn(f, x)
    users = "step/_point_of_use, step/_layer_split, step/_fp32_grads, step/_wire_segment (they re-bind every equation)"
    assert not _compat.is_nested_call(eqn), broke(
        "NESTED_CALL_PRIMITIVES", f"a {kind} equation ({_compat.primitive_name(eqn)!r}) is not inlined", users
    )
    assert not _compat.is_view(eqn) and not _compat.is_linear_in(eqn, [0]), broke(
        "VIEW_PRIMITIVES / LINEAR_OPERANDS", f"a {kind} equation is neither a view nor linear", "step/_point_of_use"
    )
    closed = closed_of(f, x)
    np.testing.assert_allclose(
        run_by_equations(closed, x)[0],
        f(x),
        rtol=1e-6,
        err_msg=broke("bind_equation", f"re-binding a {kind} equation reproduces it", users),
    )
    np.testing.assert_allclose(
        jax.grad(lambda y: jnp.sum(run_by_equations(closed, y)[0]))(x),
        jax.grad(lambda y: jnp.sum(f(y)))(x),
        rtol=1e-6,
        err_msg=broke("bind_equation", f"the gradient through a re-bound {kind} equation is its own", users),
    )


SELECTIONS = {  # each a selection of elements of x (i: a traced index, 1), its result's dtype x's
    "slice": lambda x, i: x[1:],
    "index": lambda x, i: x[2],
    "dynamic index": lambda x, i: x[i],
    "reshape": lambda x, i: x.reshape(2, 2, 2),
    "transpose": lambda x, i: x.reshape(2, 4).T,
    "reverse": lambda x, i: x[::-1],
    "concatenate": lambda x, i: jnp.concatenate([x, x[:2]]),
}


@pytest.mark.parametrize("case", sorted(SELECTIONS))
def test_selections_are_recognised_and_rebind_on_fp32_copies(case):
    f = SELECTIONS[case]
    x, i = jnp.linspace(-1.0, 2.0, 8).astype(jnp.bfloat16), jnp.int32(1)
    eqns = closed_of(f, x, i).jaxpr.eqns
    assert all(_compat.is_selection(e) for e in eqns if e.outvars[0].aval.dtype == x.dtype), broke(
        "is_selection / SELECTION_PRIMITIVES",
        f"{case} is made of equations named in SELECTION_PRIMITIVES (got {[_compat.primitive_name(e) for e in eqns]})",
        "step/_interpret (a wide value stays wide through them)",
    )
    copy = x.astype(jnp.float32)
    wide = run_by_equations(closed_of(f, copy, i), copy, i)[0]
    np.testing.assert_array_equal(
        np.asarray(wide.astype(jnp.bfloat16), np.float32),
        np.asarray(f(x, i), np.float32),
        err_msg=broke("SELECTION_PRIMITIVES", f"{case} of the fp32 copy is the copy of {case}", "step/_interpret"),
    )
    assert not _compat.is_selection(out_eqn(lambda x: jnp.broadcast_to(x, (2, 8)), x))
    assert not _compat.is_selection(out_eqn(lambda x: x[jnp.array([0, 0, 1])], x))


def test_scan_params_re_express_the_scan():
    xs = jnp.arange(12.0).reshape(4, 3)
    f = lambda c, xs: jax.lax.scan(lambda c, x: (c * 0.5 + x + 1.0, c.sum()), c, xs, reverse=True, unroll=2)
    eqn = out_eqn(lambda c, xs: f(c, xs)[0], jnp.ones(3), xs)
    p = _compat.scan_params(eqn)
    assert p is not None and (p.length, p.reverse, p.unroll, p.num_carry) == (4, True, 2, 1), broke(
        "scan_params / SCAN",
        f"jax.lax.scan is a {_compat.SCAN!r} equation with params {sorted(_compat.ScanParams._fields)} (got "
        f"{_compat.primitive_name(eqn)!r}, {sorted(eqn.params)})",
        "step/_interpret (widening inside the model's own scan)",
    )
    consts = [jnp.ones(())] * p.num_consts
    body = lambda c, x: (lambda o: (o[: p.num_carry], o[p.num_carry :]))(run_by_equations(p.jaxpr, *consts, *c, x))
    got = jax.lax.scan(body, [jnp.ones(3)], xs, length=p.length, reverse=p.reverse, unroll=p.unroll)
    want = f(jnp.ones(3), xs)
    np.testing.assert_allclose(got[0][0], want[0], err_msg=broke("scan_params", "the body's order", "step/_interpret"))
    np.testing.assert_allclose(got[1][0], want[1], err_msg=broke("scan_params", "the ys", "step/_interpret"))
    assert _compat.scan_params(out_eqn(lambda x: jnp.sin(x), xs)) is None


def test_checkpoint_params_re_express_the_checkpoint():
    policy = jax.checkpoint_policies.dots_saveable
    f = jax.checkpoint(lambda x: jnp.sin(x @ x.T), policy=policy, prevent_cse=False)
    x = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    eqn = out_eqn(f, x)
    p = _compat.checkpoint_params(eqn)
    assert p is not None and p.policy is policy and p.prevent_cse is False, broke(
        "checkpoint_params / CHECKPOINT_PRIMITIVES",
        f"jax.checkpoint is an equation named in CHECKPOINT_PRIMITIVES with jaxpr, policy, prevent_cse, "
        f"differentiated (got {_compat.primitive_name(eqn)!r}, {sorted(eqn.params)})",
        "step/_interpret (widening inside jax.checkpoint / nnx.remat)",
    )
    np.testing.assert_allclose(run_by_equations(p.jaxpr, x)[0], f(x), rtol=1e-6)
    grad_eqns = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x))))(x).jaxpr.eqns
    assert all(_compat.checkpoint_params(e) is None for e in grad_eqns), broke(
        "checkpoint_params", "a differentiated checkpoint is not re-expressed", "step/_interpret"
    )


def test_cond_branches_re_express_the_cond():
    f = lambda i, x: jax.lax.switch(i, [jnp.sin, jnp.cos, lambda x: -x], x)
    x = jnp.linspace(-1.0, 1.0, 4)
    eqn = out_eqn(f, 1, x)
    branches = _compat.cond_branches(eqn)
    assert branches is not None and len(branches) == 3, broke(
        "cond_branches / COND",
        f"jax.lax.switch is a {_compat.COND!r} equation with params['branches'] (got {_compat.primitive_name(eqn)!r})",
        "step/_interpret (widening inside cond branches)",
    )
    for i in range(3):
        np.testing.assert_allclose(run_by_equations(branches[i], x)[0], f(i, x), rtol=1e-6)


def test_while_loop_rebinds():
    f = lambda x: jax.lax.while_loop(lambda c: jnp.sum(c) < 10.0, lambda c: c * 1.5 + 0.1, x)
    x = jnp.linspace(0.1, 1.0, 4)
    assert not _compat.is_nested_call(out_eqn(f, x))
    np.testing.assert_array_equal(
        run_by_equations(closed_of(f, x), x)[0],
        f(x),
        err_msg=broke("bind_equation", "re-binding a while equation reproduces it", "step/_jaxpr and its users"),
    )


def test_shard_map_equations_rebind_inside_and_out():
    mesh = make_mesh(2, "x", auto=True)

    def body(a, b):
        return jax.lax.psum(jax.lax.pcast(a, ("x",), to="varying") * b, "x")

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())
    a, b = jnp.arange(2.0), jnp.arange(4.0).reshape(2, 2)
    closed = closed_of(f, a, b)
    assert not _compat.is_nested_call(closed.jaxpr.eqns[-1])
    users = "step/_point_of_use, step/_wire_segment (they evaluate the model's jaxpr inside shard_map)"
    np.testing.assert_array_equal(
        run_by_equations(closed, a, b)[0],
        f(a, b),
        err_msg=broke("bind_equation", "re-binding a shard_map equation reproduces it", users),
    )
    inside = jax.shard_map(
        lambda a, b: run_by_equations(closed_of(body, a, b), a, b)[0], mesh=mesh, in_specs=(P(), P("x")), out_specs=P()
    )
    np.testing.assert_array_equal(
        inside(a, b),
        f(a, b),
        err_msg=broke("bind_equation", "re-binding pvary / psum equations inside shard_map reproduces them", users),
    )


def test_tracers():
    seen = []
    probe = lambda x: seen.append(_compat.is_tracer(x)) or x
    probe(jnp.ones(2))
    jax.jit(probe)(jnp.ones(2))
    jax.grad(lambda x: jnp.sum(probe(x)))(jnp.ones(2))
    jax.vmap(probe)(jnp.ones(2))
    assert seen == [False, True, True, True], broke(
        "is_tracer / TRACER_TYPES",
        "values inside jit / grad / vmap are jax.core.Tracer instances and concrete arrays are not",
        "optim/_leaf_tables, optim/_rows_to_logical, optim/_shampoo/_transform",
    )


# ----------------------------------------------------------------------------------------------------------
# Primitive names

VIEW_CASES = {
    "astype": lambda x: x.astype(jnp.bfloat16),
    "reshape": lambda x: x.reshape(3, 2),
    "transpose": lambda x: x.T,
    "broadcast": lambda x: jnp.broadcast_to(x, (4, 2, 3)),
    "slice": lambda x: x[1:],
    "expand_dims": lambda x: jax.lax.expand_dims(x, (0,)),
    "squeeze": lambda x: jnp.squeeze(x[None]),
    "rev": lambda x: jax.lax.rev(x, (0,)),
    "dynamic_slice": lambda x: jax.lax.dynamic_slice(x, (jnp.int32(1), jnp.int32(0)), (1, 3)),
    "reduce_precision": lambda x: jax.lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10),
    "copy": lambda x: jnp.array(x, copy=True),
}


@pytest.mark.parametrize("case", sorted(VIEW_CASES))
def test_views_are_recognised(case):
    eqn = out_eqn(VIEW_CASES[case], jnp.ones((2, 3)))
    assert _compat.is_view(eqn), broke(
        "VIEW_PRIMITIVES",
        f"{case} of a leaf is an equation named in VIEW_PRIMITIVES (got {_compat.primitive_name(eqn)!r})",
        "step/_jaxpr (bucket_reads: a view of a parameter stands for it; step/_point_of_use, step/_layer_split)",
    )


def test_pcast_to_varying_is_pvary():
    mesh = make_mesh(2, "x", auto=True)
    found = []

    def body(a):
        inner = closed_of(lambda y: jax.lax.pcast(y, ("x",), to="varying"), a).jaxpr
        found.extend(inner.eqns)
        return a

    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.ones(2))
    (eqn,) = found
    users = "step/_wire_segment (anchored: a constant that varies already is not marked again)"
    assert _compat.is_pvary(eqn), broke(
        "is_pvary / PVARY", f"lax.pcast(to='varying') is a {_compat.PVARY!r} equation (got {eqn.primitive})", users
    )
    assert _compat.pvary_axes(eqn) == ("x",), broke("pvary_axes", "its params['axes'] are the mesh axes", users)
    assert _compat.is_view(eqn), broke("VIEW_PRIMITIVES", "a pvary equation is a view", "step/_jaxpr")


def test_varying_axes_inside_shard_map():
    mesh = make_mesh(2, "x", auto=True)
    seen = {}

    def body(a, b):
        seen["batch"], seen["mean"] = _compat.varying_axes(a), _compat.varying_axes(jax.lax.pmean(a.mean(0), "x"))
        seen["whole"] = _compat.varying_axes(b)
        return a

    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")))(jnp.ones(4), jnp.ones(2))
    users = "step/_model_call (model state that varies over the data axes is refused)"
    assert seen == {"batch": {"x"}, "mean": set(), "whole": set()}, broke(
        "varying_axes", f"a split input varies over its axis, a pmean and a P() input do not (got {seen})", users
    )


def test_astype_is_a_convert_with_its_dtype():
    users = "step/_fp32_grads (an fp32 cast of a low-precision leaf reads its exact fp32 copy)"
    for f in (lambda x: x.astype(jnp.float32), lambda x: jax.lax.convert_element_type(x, jnp.float32)):
        eqn = out_eqn(f, jnp.ones(3, jnp.bfloat16))
        assert _compat.is_convert(eqn), broke(
            "is_convert / CONVERT_ELEMENT_TYPE", f"astype is a {_compat.CONVERT_ELEMENT_TYPE!r} equation", users
        )
        assert _compat.convert_dtype(eqn) == np.dtype(jnp.float32), broke(
            "convert_dtype", "params['new_dtype'] is the target dtype", users
        )
    assert not _compat.is_convert(out_eqn(jnp.sin, jnp.ones(3)))


def _eval_inlined(closed, xs):
    jaxpr = closed.jaxpr
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    env.update(zip(jaxpr.invars, xs, strict=True))
    rd = lambda v: v.val if _compat.is_literal(v) else env[v]
    for eqn in jaxpr.eqns:
        invals = [rd(v) for v in eqn.invars]
        if _compat.is_nested_call(eqn):
            outs = _eval_inlined(_compat.nested_call_jaxpr(eqn), invals)
        else:
            outs = _compat.bind_equation(eqn, invals)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [rd(v) for v in jaxpr.outvars]


def inlined(f, *args):
    """``f``'s jaxpr with nested jits inlined, as ``step/_point_of_use`` reads a model."""
    return closed_of(lambda *xs: _eval_inlined(closed_of(f, *args), xs), *args)


def _linear_in_w(f, *args):
    """``is_linear_in`` of the equation producing ``f(w, *args)`` (nested jits inlined), at the positions
    reading ``w``."""
    jaxpr = inlined(f, jnp.ones((3, 3)), *args).jaxpr
    w = jaxpr.invars[0]
    (out,) = jaxpr.outvars
    eqn = next(e for e in jaxpr.eqns if out in e.outvars)
    pos = [i for i, v in enumerate(eqn.invars) if not _compat.is_literal(v) and v == w]
    assert pos, f"test set-up: the output equation {eqn} does not read w directly"
    return _compat.is_linear_in(eqn, pos)


LINEAR_CASES = {
    "x + w": (lambda w, x: x + w, True),
    "w - x": (lambda w, x: w - x, True),
    "x @ w": (lambda w, x: x @ w, True),
    "x * w": (lambda w, x: x * w, True),
    "w / 2": (lambda w, x: w / 2.0, True),
    "w[idx] (lookup)": (lambda w, x: w[jnp.array([2, 0])], True),
    "sum(w)": (lambda w, x: jnp.sum(w), True),
    "concatenate": (lambda w, x: jnp.concatenate([w, x]), True),
    "where(x > 0, w, x)": (lambda w, x: jnp.where(x > 0, w, x), True),
    "w @ w": (lambda w, x: w @ w, False),
    "w * w": (lambda w, x: w * w, False),
    "2 / w": (lambda w, x: 2.0 / w, False),
    "sin(w)": (lambda w, x: jnp.sin(w), False),
    "exp(w)": (lambda w, x: jnp.exp(w), False),
}


@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_linearity_table(case):
    f, linear = LINEAR_CASES[case]
    assert _linear_in_w(f, jnp.ones((3, 3))) == linear, broke(
        "is_linear_in / LINEAR_OPERANDS / BILINEAR_PRIMITIVES",
        f"{case} is {'linear' if linear else 'not linear'} in w by its primitive's name",
        "step/_point_of_use (an affine segment reduce-scatters before gathering again)",
    )


def test_select_predicate_is_not_linear():
    jaxpr = inlined(lambda w: jnp.where(w > 0, w, 2.0), jnp.ones(3)).jaxpr
    eqn = next(e for e in jaxpr.eqns if _compat.primitive_name(e) == _compat.SELECT_N)
    assert not _compat.is_linear_in(eqn, [0]) and _compat.is_linear_in(eqn, [1]), broke(
        "SELECT_N", "jnp.where is a select_n whose operand 0 is the predicate", "step/_point_of_use"
    )


# ----------------------------------------------------------------------------------------------------------
# Control flow


CONTROL_USERS = "step/_control_flow (the batch dependence of the model's values; refusing a per-device branch)"


def test_cond_while_scan_parts():
    def f(x, c):
        y = jax.lax.cond(x[0] > 0, lambda a, b: a * b, lambda a, b: a - b, x, c)
        z = jax.lax.while_loop(lambda s: s[0] < c, lambda s: (s[0] + 1.0, s[1] * 2.0), (c, y))[1]
        return jax.lax.scan(lambda k, v: (k + v * c, k * 2.0), jnp.zeros(()), z)

    jaxpr = closed_of(f, jnp.ones(3), jnp.float32(2.0)).jaxpr
    eqns = {_compat.primitive_name(e): e for e in jaxpr.eqns}
    index, branches, operands = _compat.cond_parts(eqns[_compat.COND])
    assert index is eqns[_compat.COND].invars[0] and len(branches) == 2, broke(
        "cond_parts / COND",
        "a cond equation's operand 0 is the index and params['branches'] its branches",
        CONTROL_USERS,
    )
    assert all(len(b.invars) == len(operands) == 2 and hasattr(b, "eqns") for b in branches), broke(
        "cond_parts", "each branch is a jaxpr over operands 1...", CONTROL_USERS
    )
    cond, body, cc, bc, carry = _compat.while_parts(eqns[_compat.WHILE])
    assert len(cond.invars) == len(cc) + len(carry) and len(body.invars) == len(bc) + len(carry), broke(
        "while_parts / WHILE", "the condition reads cond_consts + carry and the body body_consts + carry", CONTROL_USERS
    )
    assert len(cond.outvars) == 1 and len(body.outvars) == len(carry) == 2, broke(
        "while_parts", "the condition returns the predicate and the body the carry", CONTROL_USERS
    )
    body, n_consts, n_carry = _compat.scan_parts(eqns[_compat.SCAN])
    assert (n_consts, n_carry) == (1, 1) and len(body.invars) == len(eqns[_compat.SCAN].invars), broke(
        "scan_parts / SCAN", "the body reads the equation's operands consts + carry + xs", CONTROL_USERS
    )
    assert len(body.outvars) == len(eqns[_compat.SCAN].outvars), broke(
        "scan_parts", "the body returns carry + ys", CONTROL_USERS
    )
    assert _compat.cond_parts(eqns[_compat.SCAN]) is None and _compat.scan_parts(eqns[_compat.COND]) is None


@pytest.mark.parametrize("check_vma", [True, False])
def test_psum_names_and_varying_axes(check_vma):
    mesh = make_mesh(2, "x", auto=True)
    seen = {}

    def body(a):
        jaxpr = closed_of(lambda y: (jax.lax.psum(jnp.sum(y), "x"), y * 2.0), a).jaxpr
        seen["sum"] = next(e for e in jaxpr.eqns if _compat.summed_axes(e))
        seen["vary"] = [_compat.aval_varying_axes(v.aval) for v in (jaxpr.invars[0], *jaxpr.outvars)]
        return a

    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=check_vma))(jnp.ones(4))
    assert _compat.summed_axes(seen["sum"]) == ("x",), broke(
        "PSUM_PRIMITIVES / summed_axes",
        f"lax.psum is one of {sorted(_compat.PSUM_PRIMITIVES)} with its axes",
        CONTROL_USERS,
    )
    want = [frozenset({"x"}), frozenset(), frozenset({"x"})] if check_vma else [frozenset()] * 3
    assert seen["vary"] == want, broke(
        "aval_varying_axes",
        "a jaxpr variable's aval names the mesh axes it varies over (none unchecked)",
        CONTROL_USERS,
    )


def test_nested_jaxprs_and_source():
    @jax.custom_vjp
    def cv(x):
        return jnp.sin(x)

    cv.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))
    f = lambda x: jax.jit(jnp.cos)(jax.checkpoint(jnp.tanh)(cv(x)))
    jaxpr = closed_of(f, jnp.ones(2)).jaxpr
    for eqn in jaxpr.eqns:
        (closed,) = _compat.nested_jaxprs(eqn)
        sub = closed.jaxpr
        assert len(sub.invars) == len(eqn.invars) and len(sub.outvars) == len(eqn.outvars), broke(
            "nested_jaxprs", f"a {_compat.primitive_name(eqn)} equation runs one jaxpr over its operands", CONTROL_USERS
        )
    assert _compat.nested_jaxprs(closed_of(jnp.sin, jnp.ones(2)).jaxpr.eqns[0]) == []
    names = [_compat.body_name(e) for e in jaxpr.eqns]
    assert names[1:] == ["jax.checkpoint", "jit"], broke("body_name", "checkpoint is remat2, jit is jit", CONTROL_USERS)
    where = _compat.equation_source(jaxpr.eqns[0])
    assert where is not None and "test_compat.py" in where, broke(
        "equation_source", "an equation's source_info summarises to the user's file and line", CONTROL_USERS
    )


# ----------------------------------------------------------------------------------------------------------
# The process's JAX runtime


def test_backends_are_initialized_does_not_start_them():
    jax.devices()
    assert _compat.backends_are_initialized() is True, broke(
        "backends_are_initialized", "it returns True once jax.devices() ran", "distributed (initialize)"
    )
    code = (
        "import jax, vescale_jax, vescale_jax._compat as c; a = c.backends_are_initialized(); "
        "b = c.backends_are_initialized(); jax.devices(); print(a, b, c.backends_are_initialized())"
    )
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "False", "True"], broke(
        "backends_are_initialized",
        f"after `import jax, vescale_jax` it is False and asking does not start the backends (got {out.stdout!r}, "
        f"stderr {out.stderr[-2000:]!r})",
        "distributed (initialize refuses to join a job once backends started)",
    )


def test_cluster_types_are_detectors():
    types = _compat.cluster_types()
    names = {t.__name__ for t in types}
    users = "distributed (detect_cluster, initialize)"
    assert {"SlurmCluster", "OmpiCluster", "K8sCluster"} <= names, broke(
        "cluster_types",
        f"jax._src.clusters.ClusterEnv._cluster_types lists JAX's detectors (got {sorted(names)})",
        users,
    )
    for t in types:
        for attr in ("is_env_present", "get_process_count", "opt_in_only_method"):
            assert hasattr(t, attr), broke("cluster_types", f"each detector has {attr} ({t.__name__} has not)", users)
        if not t.opt_in_only_method:
            assert isinstance(t.is_env_present(), bool), broke("cluster_types", "is_env_present() is a bool", users)


def test_distributed_job_before_initialize():
    assert not jax.distributed.is_initialized(), "test set-up: this process must not have joined a job"
    job = _compat.distributed_job()
    assert job == (None, 1, 0), broke(
        "distributed_job",
        f"jax._src.distributed.global_state reads (None, 1, 0) before jax.distributed.initialize (got {job})",
        "distributed (initialize, is_multiprocess)",
    )


def test_coordination_client_is_a_key_value_store():
    assert _compat.coordination_client() is None, broke(
        "coordination_client", "global_state.client is None before jax.distributed.initialize", "distributed (Watchdog)"
    )
    # A one-process job on a free loopback port, in a fresh interpreter: set (and overwrite) keys, read a prefix.
    code = (
        "import socket, jax, vescale_jax._compat as c\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "jax.distributed.initialize(f'127.0.0.1:{port}', 1, 0)\n"
        "k = c.coordination_client()\n"
        "k.key_value_set('vj_pin/0', 'a', allow_overwrite=True)\n"
        "k.key_value_set('vj_pin/0', 'b', allow_overwrite=True)\n"
        "k.key_value_set('vj_pin/1', 'c', allow_overwrite=True)\n"
        "print(sorted(k.key_value_dir_get('vj_pin/')))\n"
    )
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "[('vj_pin/0', 'b'), ('vj_pin/1', 'c')]", broke(
        "coordination_client",
        "after jax.distributed.initialize it has key_value_set(key, value, allow_overwrite=True) and "
        f"key_value_dir_get(prefix) -> [(full key, value)] (got {out.stdout!r}, stderr {out.stderr[-2000:]!r})",
        "distributed (Watchdog: each process's progress and heartbeat)",
    )


# ----------------------------------------------------------------------------------------------------------
# optax


def test_params_placeholder_is_what_map_params_passes():
    tx = optax.sgd(0.1, momentum=0.9)
    seen = []

    def init(p):
        seen.append(p)
        return tx.init(p)

    params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
    state = tx.init(params)
    mapped = optax.tree.map_params(init, lambda x: x.shape, state, transform_non_params=lambda _: None)
    users = "optim/_masks (masked / partition pass the placeholder on to the inner transformation)"
    assert len(seen) == 1 and _compat.is_params_placeholder(seen[0]), broke(
        "is_params_placeholder",
        f"optax.tree.map_params calls init with an optax.tree_utils._state_utils._ParamsPlaceholder (got {seen})",
        users,
    )
    assert not _compat.is_params_placeholder(params) and not _compat.is_params_placeholder(None)
    assert jax.tree.leaves(seen[0]) == [], broke("is_params_placeholder", "the placeholder has no leaves", users)
    assert mapped[0].trace == {"w": (2, 3), "b": (3,)}


def _muon_update(tx, g):
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes a float and the int count
        return jax.jit(lambda g: tx.update(g, tx.init(g), g)[0])(g)


def test_muon_presets_are_optax_strings():
    g = {"w": jax.random.normal(jax.random.key(0), (6, 4))}
    users = "optim/_muon/_transform (vj.optim.muon's ns_coeffs presets)"
    assert {"standard", "dion"} <= set(_compat.MUON_NS_COEFFS_PRESETS), broke(
        "MUON_NS_COEFFS_PRESETS", "optax.contrib._muon._NS_COEFFS_PRESET_DICT holds 'standard' and 'dion'", users
    )
    for name, coeffs in _compat.MUON_NS_COEFFS_PRESETS.items():
        np.testing.assert_array_equal(
            _muon_update(optax.contrib.muon(0.1, ns_coeffs=coeffs), g)["w"],
            _muon_update(optax.contrib.muon(0.1, ns_coeffs=name), g)["w"],
            err_msg=broke("MUON_NS_COEFFS_PRESETS", f"ns_coeffs={name!r} means the table's coefficients", users),
        )


def test_muon_default_coeffs_are_optax_default():
    for fn in (optax.contrib.muon, optax.contrib.scale_by_muon):
        default = inspect.signature(fn).parameters["ns_coeffs"].default
        assert np.array_equal(np.asarray(default), np.asarray(_compat.MUON_DEFAULT_NS_COEFFS)), broke(
            "MUON_DEFAULT_NS_COEFFS",
            f"optax.contrib._muon._DEFAULT_NS_COEFFS is {fn.__name__}'s default ns_coeffs ({default})",
            "optim/_muon/_transform (vj.optim.muon's default)",
        )


def test_muon_preconditionings_and_orthogonalize_match_optax():
    users = "optim/_muon/_transform (vj.optim.muon's preconditioning=)"
    annotation = inspect.signature(optax.contrib.scale_by_muon).parameters["preconditioning"].annotation
    accepted = set(typing.get_args(annotation)) or set(re.findall(r"'(\w+)'", str(annotation)))
    assert set(_compat.MUON_PRECONDITIONINGS) == accepted, broke(
        "MUON_PRECONDITIONINGS", f"optax.contrib._muon._PRECONDITIONINGS is what optax accepts ({accepted})", users
    )
    g = jax.random.normal(jax.random.key(1), (6, 4))
    coeffs = jnp.asarray(_compat.MUON_DEFAULT_NS_COEFFS, jnp.float32)
    for p in _compat.MUON_PRECONDITIONINGS:
        tx = optax.contrib.scale_by_muon(
            beta=0.0,
            nesterov=False,
            preconditioning=p,
            eps=1e-8,
            weight_dimension_numbers={"w": optax.contrib.MuonDimensionNumbers(0, 1)},
        )
        want = _muon_update(tx, {"w": g})["w"]  # beta=0: the update is the orthogonalised gradient
        np.testing.assert_allclose(
            jax.jit(lambda x, p=p: _compat.muon_orthogonalize(x, coeffs, 5, p, 1e-8))(g),
            want,
            rtol=1e-5,
            atol=1e-6,
            err_msg=broke(
                "muon_orthogonalize",
                f"optax.contrib._muon.orthogonalize_via_newton_schulz(x, coeffs, steps, {p!r}, eps) is what "
                "optax.contrib.scale_by_muon applies to a 2-D leaf",
                users,
            ),
        )


def test_muon_normalize_axes():
    dims = optax.contrib.MuonDimensionNumbers
    users = "optim/_muon/_transform (fan-in / fan-out of the shape scaling)"
    for shape, d in (((3, 4), dims(0, 1)), ((2, 3, 4), dims(-2, -1)), ((2, 3, 4), dims((0, 1), 2))):
        as_tuple = lambda a: tuple(a) if isinstance(a, tuple) else (a,)
        want = tuple(tuple(a % len(shape) for a in as_tuple(ax)) for ax in (d.reduction_axis, d.output_axis))
        got = _compat.muon_normalize_axes(shape, d)
        assert tuple(map(tuple, got)) == want, broke(
            "muon_normalize_axes",
            f"optax.contrib._muon._normalize_axes gives non-negative (reduction, output) axis tuples ({got} for "
            f"{d} on {shape})",
            users,
        )


class _Recorder:
    """A pytree node that records the modules on the stack whenever it is rebuilt with bool / str children."""

    stacks: typing.ClassVar[list[set[str]]] = []

    def __init__(self, children):
        self.children = list(children)


def _unflatten(aux, children):
    children = list(children)
    if any(isinstance(c, bool | str) for c in children):
        frame, mods = sys._getframe(1), set()
        while frame is not None:
            mods.add(frame.f_globals.get("__name__", ""))
            frame = frame.f_back
        _Recorder.stacks.append(mods)
    return _Recorder(children)


jax.tree_util.register_pytree_node(_Recorder, lambda r: (r.children, None), _unflatten)

PER_LEAF = {
    "OPTAX_MUON_MODULE": (lambda p: optax.contrib.muon(0.1).init(p), optax.contrib.muon),
    "OPTAX_MASKING_MODULE": (
        lambda p: optax.masked(optax.sgd(0.1), lambda t: jax.tree.map(lambda x: x.ndim > 1, t)).init(p),
        optax.masked,
    ),
    "OPTAX_PARTITION_MODULE": (
        lambda p: optax.partition(
            {"a": optax.sgd(0.1), "b": optax.sgd(0.2)}, lambda t: jax.tree.map(lambda x: "ab"[x.ndim > 1], t)
        ).init(p),
        optax.partition,
    ),
}


@pytest.mark.parametrize("entry", sorted(PER_LEAF))
def test_optax_per_leaf_code_runs_in_its_module(entry):
    run, public = PER_LEAF[entry]
    module = getattr(_compat, entry)
    users = "state/_guards (names the optax code that mapped a per-leaf function over bucket buffers)"
    assert getattr(sys.modules.get(module), public.__name__, None) is public, broke(
        entry, f"{module} defines optax.{public.__name__}", users
    )
    _Recorder.stacks.clear()
    try:
        run(_Recorder([jnp.ones((2, 3)), jnp.ones(3)]))
    except Exception:  # what optax does with a _Recorder afterwards does not matter, only where it labelled
        pass
    assert any(any(m.startswith(module) for m in mods) for mods in _Recorder.stacks), broke(
        entry,
        f"optax.{public.__name__} builds its per-leaf mask / labels in a frame of {module} (frames seen: "
        f"{[sorted(m for m in mods if m.startswith('optax')) for mods in _Recorder.stacks]})",
        users,
    )


class _CodeRecorder:
    """A pytree node that records the code objects on the stack each time it is flattened."""

    codes: typing.ClassVar[list[set[typing.Any]]] = []

    def __init__(self, children):
        self.children = list(children)

    def tree_flatten(self):
        frame, codes = sys._getframe(1), set()
        while frame is not None:
            codes.add(frame.f_code)
            frame = frame.f_back
        _CodeRecorder.codes.append(codes)
        return self.children, None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children)


jax.tree_util.register_pytree_node_class(_CodeRecorder)

PER_LEAF_TRANSFORMS = {  # public optax optimizer -> the name OPTAX_PER_LEAF_CODES gives its per-leaf code
    "lamb": (lambda: optax.lamb(0.1), "scale_by_trust_ratio"),
    "lars": (lambda: optax.lars(0.1), "scale_by_trust_ratio"),
    "fromage": (lambda: optax.fromage(0.1), "scale_by_trust_ratio"),
    "scale_by_param_block_norm": (optax.scale_by_param_block_norm, "scale_by_param_block_norm"),
    "scale_by_param_block_rms": (optax.scale_by_param_block_rms, "scale_by_param_block_rms"),
    "clip_by_block_rms": (lambda: optax.clip_by_block_rms(1.0), "clip_by_block_rms"),
    "adafactor": (lambda: optax.adafactor(0.1), "scale_by_factored_rms"),
    "sm3": (lambda: optax.sm3(0.1), "scale_by_sm3"),
    "novograd": (lambda: optax.novograd(0.1), "scale_by_novograd"),
}


@pytest.mark.parametrize("name", sorted(PER_LEAF_TRANSFORMS))
def test_optax_per_leaf_transforms_map_in_their_own_frames(name):
    make, want = PER_LEAF_TRANSFORMS[name]
    users = "state/_guards (optax's per-leaf norm / shape transformations on ShardedParams raise)"
    tx = make()
    tree = _CodeRecorder([jnp.ones((2, 3)), jnp.ones(3)])
    _CodeRecorder.codes.clear()
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(tree)
        tx.update(tree, state, tree)
    seen = {_compat.OPTAX_PER_LEAF_CODES.get(c) for codes in _CodeRecorder.codes for c in codes}
    assert want in seen, broke(
        "OPTAX_PER_LEAF_CODES",
        f"optax.{name} maps over the tree inside the init / update function of optax.{want} (names seen: "
        f"{sorted(n for n in seen if n)})",
        users,
    )


def test_optax_norms_map_in_their_own_frames():
    users = "state/_guards (optax.global_norm of a ShardedParams outside jax.set_mesh is explained)"
    tree = _CodeRecorder([jnp.ones((2, 3)), jnp.ones(3)])
    _CodeRecorder.codes.clear()
    with warnings.catch_warnings():  # optax deprecates global_norm for tree.norm; users still call it
        warnings.simplefilter("ignore", DeprecationWarning)
        optax.global_norm(tree)
    seen = {_compat.OPTAX_NORM_CODES.get(c) for codes in _CodeRecorder.codes for c in codes}
    assert {"global_norm", "tree.norm"} <= seen, broke(
        "OPTAX_NORM_CODES", f"optax.global_norm flattens the tree in its own frame (names seen: {seen})", users
    )


@pytest.mark.parametrize("kind", ["jit", "remat", "custom_jvp", "custom_vjp"])
def test_call_body_is_the_equations_own_computation(kind):
    """The body call_body returns takes the equation's operands and gives its outputs: evaluating it gives the
    equation's values."""
    users = "step/_forwarding (model variables handed through lifted transforms)"

    @jax.custom_jvp
    def jvp_fn(x, y):
        return x * y, x

    jvp_fn.defjvp(lambda p, t: (jvp_fn(*p), (t[0] * p[1] + p[0] * t[1], t[0])))

    @jax.custom_vjp
    def vjp_fn(x, y):
        return x * y, x

    vjp_fn.defvjp(lambda x, y: (vjp_fn(x, y), (x, y)), lambda r, g: (g[0] * r[1] + g[1], g[0] * r[0]))
    fns = {
        "jit": jax.jit(lambda x, y: (x * y, x)),
        "remat": jax.checkpoint(lambda x, y: (x * y, x)),
        "custom_jvp": jvp_fn,
        "custom_vjp": vjp_fn,
    }
    x, y = jnp.arange(3.0), jnp.full(3, 2.0)
    closed = closed_of(fns[kind], x, y)
    (eqn,) = closed.jaxpr.eqns
    body = _compat.call_body(eqn)
    assert body is not None, broke("call_body", f"{_compat.primitive_name(eqn)} holds its body", users)
    got = jax.core.eval_jaxpr(body.jaxpr, body.consts, x, y)
    np.testing.assert_array_equal(got[0], x * y)
    np.testing.assert_array_equal(got[1], x)
    assert _compat.call_body(out_eqn(lambda x: jnp.sin(x), x)) is None


def test_passes_values_through_copies_barriers_and_same_dtype_casts():
    users = "step/_forwarding"
    x = jnp.arange(3.0)
    barrier = closed_of(lambda a, b: jax.lax.optimization_barrier((a, b)), x, x).jaxpr.eqns[0]
    assert _compat.passes_values_through(barrier), broke("VALUE_PRESERVING_PRIMITIVES", "optimization_barrier", users)
    copy = closed_of(lambda a: jnp.copy(a), x).jaxpr.eqns
    assert copy and all(_compat.passes_values_through(e) for e in copy), broke(
        "VALUE_PRESERVING_PRIMITIVES", "copy", users
    )
    same = out_eqn(lambda a: jax.lax.convert_element_type(a, jnp.float32), x.astype(jnp.float16))
    assert not _compat.passes_values_through(same)  # a real cast
    assert not _compat.passes_values_through(out_eqn(lambda a: a * 2, x))


# ----------------------------------------------------------------------------------------------------------
# Internals in one place

INTERNALS = re.compile(
    r"jax\._src|jax\.extend|jax\.core\b|from jax import (?:core|extend|_src)\b"
    r"|optax\._\w|optax(?:\.\w+)+\._\w|from optax(?:\.\w+)* import _\w"
    r"|\.primitive\b"
)


def test_internals_only_in_compat():
    pkg = ROOT / "vescale_jax"
    found = []
    for path in sorted(pkg.rglob("*.py")):
        if path == pkg / "_compat.py":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if INTERNALS.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, (
        "JAX / optax internals (jax._src, jax.extend, jax.core, private optax modules, jaxpr primitive names) "
        "belong in vescale_jax/_compat.py, each pinned by a test in tests/test_compat.py; found elsewhere:\n"
        + "\n".join(found)
    )


# ----------------------------------------------------------------------------------------------------------
# Random draws


@pytest.mark.parametrize("make_key", [lambda: jax.random.key(0), lambda: jax.random.PRNGKey(0)], ids=["typed", "raw"])
def test_random_draws_are_random_bits_and_random_split(make_key):
    users = "step/_random (draws from a replicated key split as the unsharded run draws them)"
    key = make_key()

    def draws(k):
        return (
            jax.random.bernoulli(k, 0.5, (4, 3)),
            jax.random.normal(jax.random.fold_in(k, 1), (5,)),
            jax.random.uniform(k, (2, 6)),
            jax.random.split(k, 7),
            jax.random.bits(k, (3,), jnp.uint8),
        )

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if _compat.is_random_draw(eqn):
                found.append(eqn)
            for sub in _compat.nested_jaxprs(eqn):
                walk(sub.jaxpr)

    walk(closed_of(draws, key).jaxpr)
    shapes = [(_compat.draw_shape(e), _compat.is_random_split(e)) for e in found]
    assert shapes == [((4, 3), False), ((5,), False), ((2, 6), False), ((7,), True), ((3,), False)], broke(
        "RANDOM_DRAW_PRIMITIVES / nested_jaxprs / draw_shape",
        f"samplers reach random_bits / random_split (in nested jits) with params['shape'] (got {shapes})",
        users,
    )
    assert [_compat.draw_bit_width(e) for e in found if not _compat.is_random_split(e)] == [32, 32, 32, 8], broke(
        "draw_bit_width", "params['bit_width'] is the draw's width", users
    )


def test_partitionable_threefry_is_the_hash_of_flat_indices():
    users = "step/_random (the local slice of a draw computed from its global flat indices)"
    key = jax.random.key(3)
    assert _compat.key_impl_name(key) == _compat.THREEFRY_IMPL, broke("key_impl_name", "the default key", users)
    assert _compat.key_impl_name(jax.random.key(0, impl="rbg")) == "rbg", broke("key_impl_name", "rbg keys", users)
    assert _compat.threefry_partitionable(), broke("threefry_partitionable", "on by default", users)
    words = jax.random.key_data(key)
    n = 2 * 3 * 5
    lo = jnp.arange(n, dtype=jnp.uint32).reshape(2, 3, 5)
    b1, b2 = _compat.threefry2x32(words[0], words[1], jnp.zeros_like(lo), lo)
    np.testing.assert_array_equal(
        np.asarray(b1 ^ b2), np.asarray(jax.random.bits(key, (2, 3, 5))), err_msg=broke("threefry2x32", "bits", users)
    )
    keys = jax.random.key_data(jax.random.split(key, 4))
    b1, b2 = _compat.threefry2x32(words[0], words[1], jnp.zeros(4, jnp.uint32), jnp.arange(4, dtype=jnp.uint32))
    np.testing.assert_array_equal(
        np.stack([b1, b2], -1), np.asarray(keys), err_msg=broke("threefry2x32", "split keys are (bits1, bits2)", users)
    )


def test_rerun_nested_covers_scan_while_cond_remat_and_jit():
    users = "step/_random (draws inside nested jaxprs re-run through the public API)"

    def f(x):
        x = jax.jit(jnp.sin)(x)
        x = jax.lax.scan(lambda c, y: (c + y, c * y), x, jnp.ones((3, 2)))[0]
        x = jax.lax.while_loop(lambda c: c[0] < 5.0, lambda c: c + 1.0, x)
        x = jax.lax.cond(x[0] > 0, jnp.cos, jnp.sin, x)
        return jax.checkpoint(jnp.tanh)(x)

    x = jnp.array([0.5, -1.0])
    closed = closed_of(f, x)

    def run(c, args):
        return evaluate_with(c, args, lambda eqn, vals: _compat.rerun_nested(eqn, vals, run))

    names = {_compat.primitive_name(e) for e in closed.jaxpr.eqns}
    assert {"jit", "scan", "while", "cond"} <= names and names & {"remat2", "checkpoint"}, broke(
        "rerun_nested", f"the nested primitives are named jit / scan / while / cond / remat2 (got {names})", users
    )
    np.testing.assert_allclose(run(closed, [x])[0], f(x), rtol=1e-6, err_msg=broke("rerun_nested", "values", users))


def test_aval_varying_axes_reads_shard_map_types():
    mesh = make_mesh(2, "x", auto=True)
    seen = []

    def body(a):
        seen.append(closed_of(lambda y, z: y + z, a, jnp.ones(1)).jaxpr.invars)
        return a

    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(jnp.ones(2))
    (varying, invariant) = seen[0]
    assert _compat.aval_varying_axes(varying.aval) == {"x"} and not _compat.aval_varying_axes(invariant.aval), broke(
        "aval_varying_axes", "a jaxpr variable's aval says which manual axes it varies over", "step/_random"
    )


# ----------------------------------------------------------------------------------------------------------
# Both forms of a scan equation (JAX <= 0.10: counts; JAX >= 0.11: flat trees)


class _Groups:
    """A stand-in for ``jax._src.flattree``'s trees: ``unpack()`` gives the groups."""

    def __init__(self, *groups):
        self.groups = groups

    def unpack(self):
        return self.groups


def test_scan_counts_reads_both_forms():
    users = "scan_params / scan_parts / rerun_nested (step/_interpret, step/_control_flow, step/_random)"
    c1, c2 = jnp.ones(()), jnp.full((3,), 2.0)
    eqn = out_eqn(
        lambda x, xs: jax.lax.scan(lambda c, y: (c * c1 + y * c2, c), x, xs)[0], jnp.ones(3), jnp.ones((4, 3))
    )
    forms = {
        "counts": {"num_consts", "num_carry"} <= set(eqn.params),
        "trees": {"ft_in", "ft_out"} <= set(eqn.params),
    }
    assert sum(forms.values()) == 1, broke(
        "scan_counts / SCAN", f"a scan holds num_consts / num_carry or ft_in / ft_out (got {sorted(eqn.params)})", users
    )
    n_consts = len(eqn.invars) - 1 - 1  # the operands: consts, one carry, one xs
    assert _compat.scan_counts(eqn.params) == (n_consts, 1), broke(
        "scan_counts", f"the {'counts' if forms['counts'] else 'trees'} form gives (consts, carry)", users
    )
    # the form this JAX does not emit, read the same way
    assert _compat.scan_counts({"num_consts": 2, "num_carry": 1}) == (2, 1)
    assert _compat.scan_counts({"ft_in": _Groups((0, 0), (0,), (0, 0, 0)), "ft_out": _Groups((0,), (0, 0))}) == (2, 1)
    assert _compat.scan_counts({"ft_in": _Groups((0,), (0,)), "ft_out": _Groups((0,), ())}) is None  # not 3 groups
    assert _compat.scan_counts({"ft_in": _Groups((), (0, 0), ()), "ft_out": _Groups((0,), ())}) is None  # carries
    assert _compat.scan_counts({"length": 3}) is None


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_re_expressed_keeps_values_and_gradients(reverse):
    """A scan with closed-over constants, re-expressed through ``scan_params`` and ``jax.lax.scan`` (as
    ``step/_interpret`` does) and through ``rerun_nested`` (as ``step/_random`` does): the same values and
    gradients as the scan itself, in the running JAX's form."""
    w, b = jnp.linspace(0.5, 1.5, 3), jnp.float32(0.25)

    def f(x, xs):
        carry, ys = jax.lax.scan(lambda c, y: (jnp.tanh(c * w + y) + b, c.sum() * y), x, xs, reverse=reverse)
        return carry.sum() + ys.sum()

    def by_scan_params(eqn, vals):  # a scan re-expressed as step/_interpret does; anything else by rerun_nested
        p = _compat.scan_params(eqn)
        if p is None:
            return _compat.rerun_nested(eqn, vals, rerun)
        nc, nk = p.num_consts, p.num_carry

        def body(carry, x):
            outs = rerun(p.jaxpr, [*vals[:nc], *carry, *x])
            return outs[:nk], outs[nk:]

        carry, ys = jax.lax.scan(body, vals[nc : nc + nk], vals[nc + nk :], length=p.length, reverse=p.reverse)
        return [*carry, *ys]

    def rerun(c, args):
        return evaluate_with(c, args, by_scan_params)

    x, xs = jnp.array([0.1, -0.2, 0.3]), jnp.linspace(-1, 1, 12).reshape(4, 3)
    closed = closed_of(f, x, xs)
    assert any(_compat.scan_params(e) is not None for e in closed.jaxpr.eqns), broke(
        "scan_params", "a scan equation's parameters are one of the two known forms", "step/_interpret"
    )
    users = "step/_interpret, step/_random"
    np.testing.assert_allclose(
        rerun(closed, [x, xs])[0], f(x, xs), rtol=1e-6, err_msg=broke("scan_params", "values", users)
    )
    got = jax.grad(lambda x, xs: rerun(closed_of(f, x, xs), [x, xs])[0], argnums=(0, 1))(x, xs)
    want = jax.grad(f, argnums=(0, 1))(x, xs)
    for g, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w_, rtol=1e-6, err_msg=broke("scan_params", "gradients", users))


# ----------------------------------------------------------------------------------------------------------
# Pallas: the Triton target without a GPU, Mosaic GPU's pallas_call


def _triton_add_one(n: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pltriton

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1.0

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n,), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
    )


def _export_for_cuda(f, *avals):
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    return jax.export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[triton])(*avals).mlir_module()


def test_triton_lowering_target_lowers_inside_shard_map_without_a_gpu():
    pytest.importorskip("jax.experimental.pallas.triton")
    users = "kernels (vj.kernels.gpu_lowering_target; tests/test_cuda_lowering.py, tests/test_fused_kernels.py)"
    if _compat._has_gpu():
        pytest.skip("a GPU is present: the lowering reads it")
    mesh = make_mesh(2, "x", auto=True)
    aval = jax.ShapeDtypeStruct((256,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, P("x")))

    def lowered():  # a new function each time: nothing from an earlier lowering is reused
        step = jax.shard_map(_triton_add_one(128), mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False)
        return _export_for_cuda(lambda x: step(x), aval)

    if _compat._triton_reads_gpu_info():  # JAX >= 0.11: without the target the lowering refuses, as the entry says
        with pytest.raises(RuntimeError, match="No supported GPU devices"):
            lowered()
        with _compat.triton_lowering_target("NVIDIA B200"):
            assert "__gpu$xla.gpu.triton" in lowered()
    else:  # JAX <= 0.10: compute capability 9.0 is assumed, and only that one can be had
        assert "__gpu$xla.gpu.triton" in lowered()
        with (
            pytest.raises(ValueError, match=r"compute capability 9\.0 only"),
            _compat.triton_lowering_target("NVIDIA B200"),
        ):
            pass
    with _compat.triton_lowering_target():
        assert "__gpu$xla.gpu.triton" in lowered(), broke("triton_lowering_target", "the Triton kernel lowers", users)
    with pytest.raises(ValueError, match="device_kind"), _compat.triton_lowering_target("NVIDIA GeForce 256"):
        pass


def test_mosaic_gpu_kernel_api_lowers_for_cuda_and_interprets():
    """``mosaic_gpu_kernel``: ``plgpu.kernel`` with a strided register layout lowers for CUDA without a GPU
    (``mosaic_gpu_load`` on this JAX's ``plgpu.load`` signature); ``mosaic_gpu_interpret_params`` runs it on CPU
    where JAX has Mosaic GPU's interpreter; ``pallas_triton_deprecated`` matches the version the warning came with."""
    from jax.experimental import pallas as pl

    assert _compat.mosaic_gpu_kernel(), broke("mosaic_gpu_kernel", "this JAX has plgpu.kernel and layouts", "kernels")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(x_ref, o_ref):
        layout = plgpu.Layout.WG_STRIDED((256,), vec_size=1)  # offset 1: one element per load
        o_ref[pl.ds(0, 256)] = (_compat.mosaic_gpu_load(x_ref, 1, 256, layout) * 2.0).astype(jnp.bfloat16)

    def call(x, **kw):
        return plgpu.kernel(
            body, out_type=jax.ShapeDtypeStruct((256,), jnp.bfloat16), grid=(1,), grid_names=("g",), **kw
        )(x)

    x = jnp.arange(258, dtype=jnp.float32)
    text = jax.export.export(jax.jit(call), platforms=["cuda"])(x).mlir_module()
    assert "mosaic_gpu" in text, broke("mosaic_gpu_load", "a plgpu.kernel with a strided load lowers", "kernels")
    params = _compat.mosaic_gpu_interpret_params()
    if params is not None:
        got = jax.jit(lambda x: call(x, interpret=params))(x)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.arange(1, 257) * 2.0)
    assert _compat.pallas_triton_deprecated() == (jax.__version_info__ >= (0, 11))
