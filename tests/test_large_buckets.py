"""Buckets past 2**31 elements (a Llama-405B layer is ~3.2e9): per-element tables use indices relative to each
device's shard, so nothing wraps in int32. Abstract plans only (ShapeDtypeStruct), no memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh

import vescale_jax as vj
from vescale_jax.optim import _leaf_tables as leaves


def huge_plan(m):
    # One bucket of ~4.3e9 elements: two matrices of over 2**31 elements each (whichever comes second starts
    # past 2**31), a bias and a small matrix.
    tree = {
        "layer": {
            "w": jax.ShapeDtypeStruct((2**16 + 1, 2**15), jnp.float32),
            "u": jax.ShapeDtypeStruct((2**16 + 3, 2**15), jnp.float32),
            "b": jax.ShapeDtypeStruct((7,), jnp.float32),
            "v": jax.ShapeDtypeStruct((3, 5), jnp.float32),
        }
    }
    return vj.plan(tree, make_mesh(m), units=lambda path, leaf: "layer", split="none")


def reference_leaf(plan, bucket, k, positions):
    """numpy int64: the leaf of global element k * S + i."""
    layout = bucket.layout
    g = np.int64(k) * layout.shard_size + positions.astype(np.int64)
    out = np.full(positions.shape, len(plan.leaves), np.int64)
    for slot, leaf in enumerate(bucket.leaves):
        o, n = layout.offsets[slot], layout.sizes[slot]
        out[(g >= o) & (g < o + n)] = leaf
    return out


@pytest.mark.parametrize("m", [3, 8])
def test_per_element_past_int32(m):
    plan = huge_plan(m)
    (bucket,) = plan.buckets
    size = bucket.layout.shard_size
    assert max(bucket.layout.offsets) > 2**31 and plan.num_devices * size > 2**31
    lo, hi, leaf_of = leaves._local_runs(plan)[0]
    pad = len(plan.leaves)
    local_leaf = jax.jit(leaves.local_leaf, static_argnums=4)
    checked = 0
    for k in range(m):
        # Positions around every leaf boundary that falls on device k, and the shard's ends.
        edges = [
            o + d
            for slot in range(len(bucket.leaves))
            for o in (bucket.layout.offsets[slot], bucket.layout.offsets[slot] + bucket.layout.sizes[slot])
            for d in (-1, 0, 1)
        ]
        local = sorted({e - k * size for e in edges if 0 <= e - k * size < size} | {0, size - 1})
        i = np.array(local, np.int64)
        got = local_leaf(lo[k], hi[k], leaf_of[k], jnp.asarray(i, jnp.int32), pad)
        np.testing.assert_array_equal(np.asarray(got), reference_leaf(plan, bucket, k, i), err_msg=f"device {k}")
        checked += int(np.sum(np.int64(k) * size + i >= 2**31))
    assert checked > 0  # positions past 2**31 were checked
    # The table spread over the buffers compiles for the abstract bucket (nothing is allocated).
    table = np.arange(len(plan.leaves) + 1, dtype=np.float32)
    abstract = jax.ShapeDtypeStruct(
        bucket.shape, jnp.float32, sharding=jax.sharding.NamedSharding(plan.mesh, plan.partition_spec(bucket))
    )
    with jax.set_mesh(plan.mesh):
        lowered = jax.jit(lambda b: leaves.per_element(plan, [b], table)[0]).lower(abstract)
    assert "s64" not in lowered.as_text()  # int32 indices only (x64 is off), and none of them wraps
