"""Reusing inputs donated to a vj.fsdp step raises a clear error (was: SIGSEGV of the whole process)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import make_mesh

import vescale_jax as vj


def test_donated_params_and_opt_state_raise():
    mesh = make_mesh(3)
    params = {"w": jnp.ones((8, 12)), "b": jnp.ones((12,))}
    plan = vj.plan(params, mesh)
    tx = optax.sgd(1e-2, momentum=0.9)
    sp = vj.shard(params, plan)
    state = vj.init_opt_state(tx, sp)

    @vj.fsdp(plan=plan)
    def step(p, o, x):
        g = jax.grad(lambda p: jnp.mean(vj.apply(lambda t, x: x @ t["w"] + t["b"], p, x) ** 2))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    x = jnp.ones((6, 8))
    new_params, new_state = step(sp, state, x)
    with pytest.raises(
        ValueError,
        match=r"these params were donated to the last step; use the returned ones "
        r"\(the buffer of bucket '.+' is deleted\)",
    ):
        step(sp, new_state, x)
    with pytest.raises(
        ValueError,
        match=r"this opt_state was donated to the last step; use the returned one "
        r"\(opt_state leaf .*trace.* is deleted\)",
    ):
        step(new_params, state, x)
    # The returned ones work, and donate=False keeps the inputs alive.
    new_params, new_state = step(new_params, new_state, x)
    keep = vj.fsdp(step.__wrapped__, plan=plan, donate=False)
    keep(new_params, new_state, x)
    keep(new_params, new_state, x)
