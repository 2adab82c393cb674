"""The relayout engine alone (plan the moves between two placements, then run them) against a brute-force NumPy
reference: random ragged placements of stacked tensors on 1, 2, 3 and 8 devices, zero-size ranges, replicas."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import DEVICE_COUNTS, make_mesh

from vescale_jax import testing
from vescale_jax.relayout._execute import all_to_all, permute_rounds
from vescale_jax.relayout._moves import Moves, Placement, plan_moves


def random_placement(rng, sizes, m, *, replicas=False, gap=3):
    """Per key (tensor layer) of ``sizes[key]`` elements: random cuts over the devices (many empty ranges), the
    devices in a random order per key; with ``replicas`` some pieces also on a second device. Each device's
    pieces sit in a random order with random gaps. Returns the placement and each device's buffer size."""
    rows = []  # (device, key, start, length)
    for key, n in enumerate(sizes):
        cuts = np.sort(rng.integers(0, n + 1, m - 1))
        bounds = np.diff([0, *cuts, n])
        starts = np.concatenate([[0], np.cumsum(bounds)[:-1]])
        for dev, start, length in zip(rng.permutation(m), starts, bounds, strict=True):
            rows.append((int(dev), key, int(start), int(length)))
            if replicas and m > 1 and length and rng.random() < 0.5:
                other = int(rng.integers(m))
                if other != dev:
                    lo = int(rng.integers(start, start + length))
                    rows.append((other, key, lo, int(rng.integers(1, start + length - lo + 1))))
    offset, used = [0] * len(rows), [0] * m
    for i in rng.permutation(len(rows)):
        d, _, _, n = rows[i]
        offset[i] = used[d] + int(rng.integers(0, gap + 1))
        used[d] = offset[i] + n
    cols = np.asarray(rows, np.int64).reshape(-1, 4).T
    return Placement.of(m, cols[0], cols[1], cols[2], cols[3], np.asarray(offset, np.int64)), max([*used, 1])


def fill(placement, tensors, size):
    """``(m, size)`` buffers holding each piece's elements (zero elsewhere)."""
    out = np.zeros((placement.num_devices, size), np.float32)
    for d, key, start, n, at in zip(
        placement.device, placement.key, placement.start, placement.length, placement.offset, strict=True
    ):
        out[d, at : at + n] = tensors[key][start : start + n]
    return out


def apply(moves: Moves, src: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The moves run in NumPy, run by run."""
    out = out.copy()
    for s, d, so, do, n in zip(moves.src, moves.dst, moves.src_offset, moves.dst_offset, moves.length, strict=True):
        out[d, do : do + n] = src[s, so : so + n]
    return out


def case(m, seed, *, replicas=False):
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(0, 40, 7)] + [0, 1]  # zero-size and one-element tensors too
    tensors = [rng.standard_normal(n).astype(np.float32) + 10 * k for k, n in enumerate(sizes)]
    src, src_size = random_placement(rng, sizes, m, replicas=replicas)
    dst, dst_size = random_placement(rng, sizes, m)
    return tensors, (src, src_size), (dst, dst_size)


@pytest.mark.parametrize("m", DEVICE_COUNTS)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("replicas", [False, True], ids=["disjoint", "replicas"])
def test_plan_moves_against_brute_force(m, seed, replicas):
    """Running the planned moves in NumPy gives every target piece its elements; every element is moved once per
    target piece that wants it; without replicas the runs are fewer than the pieces on both sides."""
    tensors, (src, src_size), (dst, dst_size) = case(m, seed, replicas=replicas)
    moves = plan_moves(src, dst)
    want = fill(dst, tensors, dst_size)
    got = apply(moves, fill(src, tensors, src_size), np.zeros_like(want))
    np.testing.assert_array_equal(got, want)
    assert int(moves.length.sum()) == int(dst.length.sum())
    assert (moves.length > 0).all()
    if not replicas:
        assert len(moves) <= len(src) + len(dst)
    # The message offsets pack each pair's runs back to back, within the width.
    mo = moves.message_offset()
    assert (mo + moves.length <= moves.width).all()
    sizes = moves.pair_sizes()
    for s in range(m):
        for d in range(m):
            sel = (moves.src == s) & (moves.dst == d)
            np.testing.assert_array_equal(mo[sel], np.cumsum(moves.length[sel]) - moves.length[sel])
            assert moves.length[sel].sum() == sizes[s, d]
    # The inverse moves bring the elements back.
    back = apply(moves.inverse(), got, np.zeros((m, src_size), np.float32))
    covered = apply(moves.inverse(), np.ones_like(got), np.zeros((m, src_size), np.float32)) > 0
    np.testing.assert_array_equal(back[covered], fill(src, tensors, src_size)[covered])


def test_replicas_follow_the_preference():
    """An element held by several devices is read from the one ``prefer`` ranks first."""
    m, n = 4, 12
    src = Placement.of(m, [0, 1, 2, 3], 0, 0, n, 0)  # every device holds everything
    dst = Placement.of(m, [0, 1, 2, 3], 0, [0, 3, 6, 9], 3, 0)
    assert (plan_moves(src, dst).src == [0, 1, 2, 3]).all()  # default: the receiver itself
    moves = plan_moves(src, dst, prefer=lambda s, d: (s - d - 1) % m)
    assert (moves.src == (moves.dst + 1) % m).all() and len(moves) == m


def test_missing_elements_name_the_piece():
    src = Placement.of(2, 0, 0, 0, 5, 0)
    dst = Placement.of(2, 1, 0, 3, 4, 0)
    with pytest.raises(ValueError, match=r"device 1 wants elements \[3, 7\) of key 0"):
        plan_moves(src, dst)
    assert int(plan_moves(src, dst, complete=False).length.sum()) == 2


def test_stacked_layers_move_by_key():
    """Placement.ragged numbers the layers of a stacked tensor as keys: layer l of the source goes to layer l."""
    from vescale_jax.layout._ragged import RaggedShard

    m, layers = 3, 4
    a, b = RaggedShard((10,), 1, (2, 0, 8)), RaggedShard((10,), 2, (1, 3, 1))
    at_a = np.array([[0, 10, 20, 30]] * m) + np.arange(m)[:, None]
    at_b = np.array([[30, 20, 10, 0]] * m)
    moves = plan_moves(Placement.ragged(a, at_a), Placement.ragged(b, at_b))
    data = np.arange(layers * 10, dtype=np.float32).reshape(layers, 10)
    src = np.zeros((m, 50), np.float32)
    want = np.zeros((m, 40), np.float32)
    for k in range(m):
        for layer in range(layers):
            src[k, at_a[k, layer] : at_a[k, layer] + a.local_sizes[k]] = data[layer, a.starts[k] : a.ends[k]]
            want[k, at_b[k, layer] : at_b[k, layer] + b.local_sizes[k]] = data[layer, b.starts[k] : b.ends[k]]
    np.testing.assert_array_equal(apply(moves, src, np.zeros_like(want)), want)


def test_planning_is_vectorised_for_large_models():
    """Ten thousand tensors of a million elements each on 8 devices: the tables are O(pieces), built fast."""
    import time

    m, n, t = 8, 10**6, 10_000
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.integers(0, n + 1, (t, m - 1)), axis=1)
    lens = np.diff(np.concatenate([np.zeros((t, 1), np.int64), cuts, np.full((t, 1), n)], axis=1), axis=1)
    starts = np.cumsum(lens, axis=1) - lens
    offsets = np.cumsum(lens, axis=0) - lens  # device d holds its pieces of every tensor one after another
    keys = np.repeat(np.arange(t), m)
    src = Placement.of(m, np.tile(np.arange(m), t), keys, starts.reshape(-1), lens.reshape(-1), offsets.reshape(-1))
    per = n // m
    dst = Placement.of(m, np.tile(np.arange(m), t), keys, np.tile(np.arange(m) * per, t), per, keys * per)
    t0 = time.perf_counter()
    moves = plan_moves(src, dst)
    assert time.perf_counter() - t0 < 5.0
    assert len(moves) <= len(src) + len(dst) and int(moves.length.sum()) == n * t


@pytest.mark.parametrize("m", DEVICE_COUNTS)
@pytest.mark.parametrize("strategy", ["all_to_all", "permute_rounds"])
def test_executors_match_numpy(m, strategy):
    """Both executors inside shard_map give what the NumPy run of the same moves gives, stacked rows included
    (all-to-all), uncovered positions keeping the destination's values; the census is one all-to-all of
    ``m * width`` elements, or collective-permutes only."""
    mesh = make_mesh(m)
    tensors, (src, src_size), (dst, dst_size) = case(m, 11, replicas=True)
    moves = plan_moves(src, dst)
    x = fill(src, tensors, src_size)
    base = np.full((m, dst_size), -1.0, np.float32)
    want = apply(moves, x, base)
    spec = jax.sharding.PartitionSpec("fsdp")
    if strategy == "all_to_all":
        x, base, want = (np.stack([v, 2 * v], axis=1) for v in (x, base, want))  # (m, 2, n): two stacked rows
        run = lambda v, o: all_to_all(v[0], moves, axis="fsdp", size=dst_size, out=o[0])[None]
    else:
        run = lambda v, o: permute_rounds(v[0], o[0], moves, axis="fsdp")[None]
    fn = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False))
    put = lambda v: jax.device_put(jnp.asarray(v), jax.sharding.NamedSharding(mesh, spec))
    np.testing.assert_array_equal(np.asarray(fn(put(x), put(base))), want)
    census = testing.census(fn.lower(put(x), put(base)).compile())
    if m == 1:
        return
    if strategy == "all_to_all":
        assert census.count("all-to-all") == 1 and census.count("collective-permute") == 0
        assert census.bytes("all-to-all") == 2 * m * moves.width * 4
    else:
        assert census.count("all-to-all") == 0 and census.count("collective-permute") >= 1


@pytest.mark.parametrize("seed", range(3))
def test_periodic_runs_compress_and_expand_exactly(seed):
    """Block columns of every row (interleaved across pairs, strided on either side) compress to a few periodic
    runs per device, and the device lookup (unrolled selects, or a loop past ``_UNROLLED`` runs) expands them
    to exactly the per-element mapping."""
    from vescale_jax.relayout import _runs

    rng = np.random.default_rng(seed)
    m, rows, width, parts = 3, 7, 12, 3
    keys, groups, pos, val, ln = [], [], [], [], []
    want = np.full((m, rows * width), -1, np.int64)
    for k in range(m):
        for g in range(parts):  # group g: block column g of every row, values back to back (a message)
            lo, hi = sorted(rng.integers(0, rows + 1, 2))
            for r in range(lo, hi):
                at, v = r * width + g * (width // parts), 1000 * g + (r - lo) * (width // parts)
                keys.append(k), groups.append(g), pos.append(at), val.append(v), ln.append(width // parts)
                want[k, at : at + width // parts] = v + np.arange(width // parts)
    table = _runs.compress(*(np.asarray(x) for x in (keys, groups, pos, val, ln)), m)
    assert table.shape[2] <= parts  # one periodic run per group and device
    np.testing.assert_array_equal(_runs.expand(table, rows * width, -1), want)
    for unrolled in (_runs._UNROLLED, 0):
        old, _runs._UNROLLED = _runs._UNROLLED, unrolled
        try:
            got = np.stack(
                [
                    np.asarray(jnp.where(ok, idx, -1))
                    for idx, ok in (_runs.lookup(table, k, rows * width) for k in range(m))
                ]
            )
        finally:
            _runs._UNROLLED = old
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(2))
def test_run_lookup_paths_agree(seed, monkeypatch):
    """The three device lookups of a periodic table (one select per run, the block index over its strided runs,
    the loop of selects) and the strided form expanded in NumPy all give the per-element mapping, for runs of
    single positions (back to back or strided) and of pieces."""
    from vescale_jax.relayout import _run_lookup, _runs

    rng = np.random.default_rng(seed)
    m, n = 3, 240
    keys, groups, pos, val, ln = [], [], [], [], []
    want = np.full((m, n), -1, np.int64)
    for k in range(m):
        for g, (piece, pstep, vstep) in enumerate([(1, 1, 7), (1, 3, 2), (4, 5, 9)]):
            at0, v0 = 80 * g + int(rng.integers(0, 3)), 10_000 * g + int(rng.integers(0, 50))
            for c in range(int(rng.integers(1, 12))):
                at, v = at0 + c * pstep, v0 + c * vstep
                keys.append(k), groups.append(g), pos.append(at), val.append(v), ln.append(piece)
                want[k, at : at + piece] = v + np.arange(piece)
    table = _runs.compress(*(np.asarray(x) for x in (keys, groups, pos, val, ln)), m)
    np.testing.assert_array_equal(_runs.expand(table, n, -1), want)
    np.testing.assert_array_equal(_run_lookup.expand_strided(_runs.strided(table), n, -1), want)
    for unrolled, block in ((_runs._UNROLLED, _runs._BLOCK_SEGMENTS), (0, _runs._BLOCK_SEGMENTS), (0, 0)):
        monkeypatch.setattr(_runs, "_UNROLLED", unrolled)
        monkeypatch.setattr(_runs, "_BLOCK_SEGMENTS", block)
        got = [_runs.lookup(table, k, n) for k in range(m)]
        np.testing.assert_array_equal(np.stack([np.asarray(jnp.where(ok, i, -1)) for i, ok in got]), want)
        np.testing.assert_array_equal(np.stack([np.asarray(jnp.where(ok, 0, i)) for i, ok in got]), 0)
