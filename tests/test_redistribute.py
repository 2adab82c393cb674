"""Redistribution between placements inside shard_map: values and gradients against numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICE_COUNTS, make_mesh
from jax.sharding import PartitionSpec as P

import vescale_jax as vj
from vescale_jax import redistribute as rd


@pytest.fixture(params=DEVICE_COUNTS, ids=lambda m: f"m{m}")
def mesh(request):
    return make_mesh(request.param, auto=True)


def placements(shape, m, seed):
    """A few placements of one tensor: even, rows, one-hot, random uneven units with zeros."""
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    row = shape[-1] if len(shape) >= 2 else 1
    out = [vj.RaggedShard.even(shape, m), vj.RaggedShard.even(shape, m, block=row)]
    out.append(vj.RaggedShard.on_device(shape, m, int(rng.integers(m))))
    block = int(rng.integers(1, 9))
    nb = -(-size // block)
    cuts = np.sort(rng.integers(0, nb + 1, size=m - 1))
    units = np.diff(np.concatenate([[0], cuts, [nb]]))
    out.append(vj.RaggedShard(shape, block, tuple(int(u) for u in units)))
    return out


def local_pieces(x, rs):
    """numpy reference: (m, max_local) padded pieces."""
    flat = np.asarray(x).reshape(-1)
    out = np.zeros((rs.num_devices, max(rs.max_local_size, 1)), flat.dtype)
    for k, (s, e) in enumerate(rs.ranges):
        out[k, : e - s] = flat[s:e]
    return out[:, : rs.max_local_size]


def smap(mesh, f, in_specs, out_specs):
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


SHAPES = [(23, 7), (5,), (3, 4, 5), (64, 3)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_to_and_from_ragged(mesh, shape):
    m = mesh.size
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), jnp.float32)
    for rs in placements(shape, m, seed=1):
        f = smap(mesh, lambda v, rs=rs: rd.to_ragged(v, rs, axis="fsdp")[None], P(), P("fsdp"))
        np.testing.assert_array_equal(np.asarray(f(x)), local_pieces(x, rs))
        g = smap(mesh, lambda v, rs=rs: rd.from_ragged(v[0], rs, axis="fsdp")[None], P("fsdp"), P("fsdp"))
        full = np.asarray(g(jnp.asarray(local_pieces(x, rs))))
        for k in range(m):
            np.testing.assert_array_equal(full[k], np.asarray(x))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reshard_between_placements(mesh, shape):
    m = mesh.size
    x = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    ps = placements(shape, m, seed=3)
    for src in ps:
        for dst in ps:
            f = smap(mesh, lambda v, s=src, d=dst: rd.reshard(v[0], s, d, axis="fsdp")[None], P("fsdp"), P("fsdp"))
            got = np.asarray(f(jnp.asarray(local_pieces(x, src))))
            np.testing.assert_array_equal(got, local_pieces(x, dst), err_msg=f"{src} -> {dst}")


def test_reshard_is_one_all_to_all(mesh):
    shape = (23, 7)
    src, dst = placements(shape, mesh.size, seed=4)[3], vj.RaggedShard.even(shape, mesh.size)
    f = smap(mesh, lambda v: rd.reshard(v[0], src, dst, axis="fsdp")[None], P("fsdp"), P("fsdp"))
    hlo = f.lower(jnp.zeros((mesh.size, src.max_local_size))).compile().as_text()
    if mesh.size > 1:
        assert hlo.count("all-to-all(") == 1
    assert "all-gather(" not in hlo and "all-reduce(" not in hlo


def test_reshard_gradient_is_the_reverse_move(mesh):
    m, shape = mesh.size, (19, 5)
    src, dst = placements(shape, m, seed=5)[3], placements(shape, m, seed=6)[1]
    x = np.random.default_rng(7).standard_normal(shape).astype(np.float32)
    w = np.random.default_rng(8).standard_normal(shape).astype(np.float32)
    f = smap(mesh, lambda v: rd.reshard(v[0], src, dst, axis="fsdp")[None], P("fsdp"), P("fsdp"))
    w_dst = jnp.asarray(local_pieces(w, dst))
    grad = jax.grad(lambda v: jnp.sum(f(v) * w_dst))(jnp.asarray(local_pieces(x, src)))
    np.testing.assert_allclose(np.asarray(grad), local_pieces(w, src), rtol=0, atol=0)


def test_from_ragged_gradient_reduce_scatters(mesh):
    m, shape = mesh.size, (11, 3)
    rs = placements(shape, m, seed=9)[3]
    w = np.random.default_rng(10).standard_normal(shape).astype(np.float32)
    g = smap(mesh, lambda v: rd.from_ragged(v[0], rs, axis="fsdp")[None], P("fsdp"), P("fsdp"))
    x = jnp.asarray(local_pieces(np.ones(shape, np.float32), rs))
    grad = jax.grad(lambda v: jnp.sum(g(v) * jnp.asarray(w)[None]))(x)
    # Every device uses the full tensor once, so each element's gradient is m * w, on its owner only.
    np.testing.assert_allclose(np.asarray(grad), m * local_pieces(w, rs), rtol=1e-6)


def test_dim0_round_trip(mesh):
    m = mesh.size
    shape = (4 * m, 5)
    x = np.random.default_rng(11).standard_normal(shape).astype(np.float32)
    rs = placements(shape, m, seed=12)[3]
    f = smap(mesh, lambda v: rd.to_dim0(v[0], rs, axis="fsdp"), P("fsdp"), P("fsdp"))
    rows = f(jnp.asarray(local_pieces(x, rs)))
    np.testing.assert_array_equal(np.asarray(rows), x)
    g = smap(mesh, lambda r: rd.from_dim0(r, rs, axis="fsdp")[None], P("fsdp"), P("fsdp"))
    np.testing.assert_array_equal(np.asarray(g(rows)), local_pieces(x, rs))


def test_dim0_needs_divisible_rows():
    with pytest.raises(ValueError, match="divisible by 8"):
        vj.RaggedShard.dim0((50257, 4), 8)


def test_ragged_shard_validation():
    with pytest.raises(ValueError, match="sum to 2 blocks"):
        vj.RaggedShard((10,), 4, (1, 1))
    with pytest.raises(ValueError, match=r"units\[1\] = -1"):
        vj.RaggedShard((4,), 4, (2, -1))
    rs = vj.RaggedShard((10,), 4, (0, 2, 1))
    assert rs.ranges == ((0, 0), (0, 8), (8, 10)) and rs.owner is None and rs.max_local_size == 8
    assert vj.RaggedShard.on_device((3, 3), 4, 2).owner == 2
    assert vj.RaggedShard.from_ranges((10,), 4, rs.ranges) == rs
    with pytest.raises(ValueError, match="cutting a block"):
        vj.RaggedShard.from_ranges((10,), 4, ((0, 6), (6, 10)))
