"""step/_forwarding: which outputs of a traced function are its inputs unchanged, through every lifted transform."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from vescale_jax.step._forwarding import forwarded_inputs


def _origins(fn, *args):
    return forwarded_inputs(jax.make_jaxpr(fn)(*args).jaxpr)


X, Y = jnp.ones((3,)), jnp.ones((3,))


def _ckpt(x, y):
    return jax.checkpoint(lambda a, b: (b, a))(x, y)


def _ckpt_policy(x, y):
    return jax.checkpoint(lambda a, b: (a, b * 2), policy=jax.checkpoint_policies.dots_saveable)(x, y)


def _jit(x, y):
    return jax.jit(lambda a, b: (a, a + b))(x, y)


def _cond(x, y):
    return jax.lax.cond(x[0] > 0, lambda a, b: (a, b), lambda a, b: (a, a), x, y)


def _switch(x, y):
    return jax.lax.switch(1, [lambda a, b: (a, b)] * 3, x, y)


def _scan_carry(x, y):
    (a, b), _ = jax.lax.scan(lambda c, _: ((c[0], c[1] + 1), None), (x, y), None, length=2)
    return a, b


def _scan_xs_to_ys(x, y):
    _, (a, b) = jax.lax.scan(lambda c, rows: (c, (rows[0], rows[1] * 2)), 0.0, (x, y))
    return a, b


def _scan_stacked_copy_to_ys(x, y):
    _, ys = jax.lax.scan(lambda c, row: (c, row), 0.0, jnp.stack([x, y]))
    return ys, y


def _scan_swapped_carry(x, y):
    (a, b), _ = jax.lax.scan(lambda c, _: ((c[1], c[0]), None), (x, y), None, length=2)
    return a, b  # after two swaps the values are back, but the analysis does not follow a permutation


def _while(x, y):
    _, a, b = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1], c[2] * 2), (0, x, y))
    return a, b


def _custom_vjp(x, y):
    @jax.custom_vjp
    def f(a):
        return a

    f.defvjp(lambda a: (a, None), lambda _, g: (g,))
    return f(x), y + 0


def _custom_jvp(x, y):
    @jax.custom_jvp
    def f(a):
        return a

    f.defjvp(lambda p, t: (p[0], t[0]))
    return f(x), -y


def _copies(x, y):
    a, b = jax.lax.optimization_barrier((x, y))
    return jnp.copy(a), b.astype(jnp.float32)


def _cast(x, y):
    return x.astype(jnp.bfloat16).astype(jnp.float32), y


def _nested(x, y):
    return jax.jit(lambda a, b: jax.checkpoint(lambda c, d: jax.lax.cond(True, lambda e: e, lambda e: e, c))(a, b))(
        x, y
    ), y


@pytest.mark.parametrize(
    "fn, want",
    [
        (_ckpt, [1, 0]),
        (_ckpt_policy, [0, None]),
        (_jit, [0, None]),
        (_cond, [0, None]),
        (_switch, [0, 1]),
        (_scan_carry, [0, None]),
        (_scan_xs_to_ys, [0, None]),
        (_scan_stacked_copy_to_ys, [None, 1]),
        (_scan_swapped_carry, [None, None]),
        (_while, [0, None]),
        (_custom_vjp, [0, None]),
        (_custom_jvp, [0, None]),
        (_copies, [0, 1]),
        (_cast, [None, 1]),
        (_nested, [0, 1]),
    ],
    ids=lambda v: getattr(v, "__name__", "").lstrip("_") or None,
)
def test_forwarded_inputs_follow_lifted_transforms(fn, want):
    assert _origins(fn, X, Y) == want


def test_a_closed_over_value_is_not_an_input():
    z = jnp.zeros((3,))
    assert _origins(lambda x: (z, x), X) == [None, 0]


def test_forwarding_inside_a_trace_of_outer_tracers():
    """The analysis runs on a jaxpr traced inside another trace (what vj.flax.nnx_apply does under the step)."""

    def outer(x, y):
        got = _origins(lambda a, b: jax.checkpoint(lambda c, d: (c, c * d))(a, b), x, y)
        assert got == [0, None]
        return x

    jax.jit(jax.grad(lambda x, y: outer(x, y).sum()))(X, Y)
