"""plan_bucket: invariants on random instances, optimality against brute force, errors."""

import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import vescale_jax as vj
from vescale_jax.layout._bucket_layout import BucketLayout


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
