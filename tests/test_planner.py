"""plan_bucket: invariants on random instances, optimality against brute force, errors."""

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vescale_jax as vj
from vescale_jax.layout._bucket_layout import BucketLayout
from vescale_jax.layout._bucket_placement import Placer, _earliest


def assert_invariants(layout: BucketLayout, sizes, blocks, m, align):
    """The invariants of DESIGN.md §3, written out independently of BucketLayout.check."""
    s = layout.shard_size
    assert layout.num_devices == m
    assert s % align == 0
    assert len(layout.offsets) == len(sizes)
    spans = []
    for i, (n, b, o) in enumerate(zip(sizes, blocks, layout.offsets, strict=True)):
        assert o % align == 0, (i, o)
        assert 0 <= o and o + n <= m * s, (i, o, n, m * s)
        for k in range(1, m):
            if o < k * s < o + n:
                assert (k * s - o) % b == 0, f"tensor {i} cut at {k * s} (offset {o}, block {b})"
        if n:
            spans.append((o, o + n))
    spans.sort()
    for (_, e0), (s1, _) in itertools.pairwise(spans):
        assert e0 <= s1
    total = m * s
    assert layout.padding_fraction == pytest.approx((total - sum(sizes)) / total if total else 0.0)


def brute_force_min_s(sizes, blocks, m, align):
    """Smallest S for which *some* placement (any order, any offsets) satisfies the invariants."""
    items = [(n, b) for n, b in zip(sizes, blocks, strict=True) if n]
    if not items:
        return 0

    def valid(o, n, b, s):
        return all((k * s - o) % b == 0 for k in range(1, m) if o < k * s < o + n)

    for s in range(align, sum(-(-n // align) * align for n in sizes) + align, align):
        limit = m * s

        @functools.cache
        def place(mask, cursor, s=s, limit=limit):
            if mask == (1 << len(items)) - 1:
                return True
            for j, (n, b) in enumerate(items):
                if mask >> j & 1:
                    continue
                for o in range(-(-cursor // align) * align, limit - n + 1, align):
                    if valid(o, n, b, s) and place(mask | 1 << j, o + n):
                        return True
            return False

        if place(0, 0):
            return s
    raise AssertionError("unreachable: S = sum(sizes) is always feasible")


instances = st.integers(1, 6).flatmap(
    lambda k: st.tuples(
        st.lists(st.integers(0, 12), min_size=k, max_size=k),
        st.lists(st.integers(1, 8), min_size=k, max_size=k),
        st.integers(1, 4),
        st.sampled_from([1, 1, 2, 4]),
    )
)


@settings(max_examples=400, deadline=None)
@given(instances)
def test_matches_brute_force_on_small_instances(inst):
    sizes, blocks, m, align = inst
    layout = vj.plan_bucket(sizes, blocks, m, align=align)
    assert_invariants(layout, sizes, blocks, m, align)
    assert layout.shard_size == brute_force_min_s(sizes, blocks, m, align)


large_instances = st.integers(1, 60).flatmap(
    lambda k: st.tuples(
        st.lists(st.integers(0, 5000), min_size=k, max_size=k),
        st.lists(st.one_of(st.integers(1, 64), st.integers(1, 6000)), min_size=k, max_size=k),
        st.sampled_from([1, 2, 3, 5, 8, 16, 64, 256]),
        st.sampled_from([1, 2, 4, 8, 16]),
    )
)


@settings(max_examples=2000, deadline=None)
@given(large_instances)
def test_invariants_hold_on_random_instances(inst):
    sizes, blocks, m, align = inst
    layout = vj.plan_bucket(sizes, blocks, m, align=align)
    assert_invariants(layout, sizes, blocks, m, align)
    layout.check()


def test_whole_tensor_blocks_stay_on_one_device():
    sizes = [30, 30, 30, 10]
    layout = vj.plan_bucket(sizes, sizes, 4)
    for i in range(len(sizes)):
        rs = layout.ragged_shard(i)
        assert rs.owner is not None
    assert layout.shard_size == 30


def test_element_granularity_is_padding_free_up_to_alignment():
    sizes = [50257 * 768, 768, 3 * 768 * 768, 7]
    layout = vj.plan_bucket(sizes, [1] * 4, 8, align=4)
    per_device = -(-sum(sizes) // 8)
    assert layout.shard_size == -(-per_device // 4) * 4  # the lower bound, rounded up to the alignment


def test_spanning_two_boundaries_forces_multiple_of_block():
    # 100 elements in blocks of 7 over 4 devices: S >= 25 and a tensor > 2S needs S % 7 == 0 -> S = 28.
    layout = vj.plan_bucket([100], [7], 4)
    assert layout.shard_size == 28


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([1, -2], [1, 1], 2), r"sizes\[1\]"),
        (([1, 2], [1, 0], 2), r"blocks\[1\]"),
        (([1, 2], [1], 2), r"index 1"),
        (([1, 2], [1, 1], 0), "num_devices"),
        (([1.5], [1], 2), r"sizes\[0\]"),
    ],
)
def test_invalid_input_names_the_index(args, match):
    with pytest.raises(ValueError, match=match):
        vj.plan_bucket(*args)


def test_invalid_align():
    with pytest.raises(ValueError, match="align"):
        vj.plan_bucket([4], [1], 2, align=0)


def test_ragged_shard_derived_from_layout_matches_buffer_ranges():
    sizes, blocks, m = [10, 37, 5, 64], [1, 4, 5, 16], 3
    layout = vj.plan_bucket(sizes, blocks, m)
    s = layout.shard_size
    for i, (n, o) in enumerate(zip(sizes, layout.offsets, strict=True)):
        rs = layout.ragged_shard(i)
        assert sum(rs.local_sizes) == n
        for k, (lo, hi) in enumerate(rs.ranges):
            glo, ghi = max(o, k * s), min(o + n, (k + 1) * s)
            assert hi - lo == max(0, ghi - glo)
            if hi > lo:
                assert lo == glo - o
                assert layout.local_offsets(i)[k] == glo - k * s
    assert sum(layout.device_loads()) == sum(sizes)


def _reference_sequential(order, sizes, grids, s, a):
    """The placement rule written out tensor by tensor: each at its earliest valid offset after the previous."""
    offsets, c = [0] * len(sizes), 0
    for i in order:
        if sizes[i]:
            o = _earliest(c, sizes[i], grids[i], s, a)
            if o is None:
                return None
            offsets[i], c = o, o + sizes[i]
    return offsets, c


def _reference_first_fit(order, sizes, grids, s, a):
    """First-fit written out tensor by tensor: the first padding gap (in address order) where it is valid."""
    offsets, gaps, c = [0] * len(sizes), [], 0
    for i in order:
        n = sizes[i]
        if not n:
            continue
        for g, (lo, hi) in enumerate(gaps):
            o = _earliest(lo, n, grids[i], s, a)
            if o is not None and o + n <= hi:
                gaps[g : g + 1] = [(x, y) for x, y in ((lo, o), (o + n, hi)) if y > x]
                break
        else:
            o = _earliest(c, n, grids[i], s, a)
            if o is None:
                return None
            if o > c:
                gaps.append((c, o))
            c = o + n
        offsets[i] = o
    return offsets, c


def _reference_try(sizes, grids, s, a, m, orders):
    """Every order, sequentially then by first-fit: the first layout that fits in ``m*s``, else the smallest
    overflow (the strategies only, without the exact dynamic program)."""
    overflow = None
    for order in orders:
        for strategy in (_reference_sequential, _reference_first_fit):
            placed = strategy(order, sizes, grids, s, a)
            if placed is not None and placed[1] <= m * s:
                return placed[0], 0
            if placed is not None:
                overflow = placed[1] - m * s if overflow is None else min(overflow, placed[1] - m * s)
    return None, overflow or 0


placements = st.integers(1, 40).flatmap(
    lambda k: st.tuples(
        st.lists(
            st.one_of(st.integers(0, 64), st.integers(0, 3000), st.sampled_from([8, 24, 96])), min_size=k, max_size=k
        ),
        st.lists(st.one_of(st.integers(1, 16), st.integers(1, 3000)), min_size=k, max_size=k),
        st.sampled_from([1, 2, 4, 8]),
        st.integers(1, 64),
        st.integers(1, 3000),
        st.randoms(use_true_random=False),
    )
)


@settings(max_examples=400, deadline=None)
@given(placements)
def test_placement_at_fixed_shard_size_matches_reference(inst):
    """The run-at-a-time placement (gaps pruned, runs placed by bisection, early stop) gives exactly the layout,
    or the overflow, of the tensor-by-tensor rule, for the planner's orders and shuffled ones."""
    sizes, blocks, a, m, s, rng = inst
    s = -(-s // a) * a
    grids = [min(b, max(n, 1)) for n, b in zip(sizes, blocks, strict=True)]
    natural = list(range(len(sizes)))
    shuffled = rng.sample(natural, len(natural))
    orders = [natural, sorted(natural, key=lambda i: (-sizes[i], i)), shuffled]
    placer = Placer(sizes, grids, a, orders, exact=False)
    assert placer.try_shard_size(s, m) == _reference_try(sizes, grids, s, a, m, orders)


def test_sizes_beyond_int64():
    """Sizes whose sums overflow int64 plan as Python ints (the invariants, written out, hold)."""
    sizes = [2**70, 3, 2**69 + 5, 7, 9, 11, 13, 17, 19, 23]
    blocks = [2**35, 1, 5, 1, 2, 2, 2, 2, 2, 2]
    layout = vj.plan_bucket(sizes, blocks, 3, align=4)
    assert_invariants(layout, sizes, blocks, 3, 4)


def test_integer_arrays_and_plain_lists_give_the_same_layout():
    """The fast validation path (plain ints, integer arrays) and the general one (NumPy scalars, integral
    floats) accept the same values and give the same layout; a bool is still refused, with its index."""
    sizes, blocks = [96, 96 * 288, 0, 96 * 96], [1, 288, 4, 96]
    expected = vj.plan_bucket(sizes, blocks, 8, align=4)
    assert vj.plan_bucket(np.array(sizes), np.array(blocks, dtype=np.uint32), 8, align=4) == expected
    assert vj.plan_bucket([np.int64(n) for n in sizes], [float(b) for b in blocks], 8, align=4) == expected
    with pytest.raises(ValueError, match=r"sizes\[1\]"):
        vj.plan_bucket([96, True], [1, 1], 8)
    with pytest.raises(ValueError, match=r"blocks\[0\]"):
        vj.plan_bucket([96, 4], [-1, 1], 8)
