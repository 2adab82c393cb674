"""vj.checkpoint.Manager(local_dir=...): per-process local copies in the device layout, restored when they match.

One process of 8 devices here (tests/test_checkpoint_local_multihost.py runs 2 processes x 4 devices): the
local copy restores bit for bit without reading the global directory (its step's data items are moved away
first); a missing or changed local file, an older local step, a different plan or a different optimizer state
fall back to the global checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_checkpoint import host_shard, plan_of, tree_of

import vescale_jax as vj


def state_at(step: int, plan):
    """Params and an Adam state with distinct values at ``step``."""
    sp = host_shard(tree_of(step), plan)
    adam, *rest = vj.init_opt_state(optax.adam(1e-3), sp)
    mu = jax.tree.map(lambda x: x * 3, sp)  # zero padding stays zero (the padding invariant)
    nu = jax.tree.map(lambda x: x * x, sp)
    return sp, (adam._replace(count=jnp.asarray(step, jnp.int32), mu=mu, nu=nu), *rest)


def assert_bitwise(got, want):
    a, b = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        if isinstance(x, jax.Array) and isinstance(y, jax.Array) and x.ndim:
            assert x.sharding == y.sharding, (x.sharding, y.sharding)
        np.testing.assert_array_equal(
            np.asarray(x).reshape(-1).view(np.uint8), np.asarray(y).reshape(-1).view(np.uint8)
        )


def save_run(tmp_path, plan, steps=4):
    """Global every 2 steps, local every step (the newest 2 kept); returns each step's state."""
    states = {}
    with vj.checkpoint.Manager(
        tmp_path / "global", save_interval_steps=2, local_dir=tmp_path / "local", local_every=1, local_keep=2
    ) as mngr:
        for step in range(1, steps + 1):
            states[step] = state_at(step, plan)
            assert mngr.should_save(step)
            sp, opt = states[step]
            assert mngr.save(step, params=sp, opt_state=opt, metadata={"at": step})
        mngr.wait()
        assert mngr.all_steps() == list(range(2, steps + 1, 2))
        assert mngr.local_steps() == [steps - 1, steps]
    return states


def restore(tmp_path, plan, opt_template, step=None):
    with vj.checkpoint.Manager(tmp_path / "global", local_dir=tmp_path / "local") as mngr:
        return mngr.restore(step, params=plan, opt_state=opt_template)


def hide_global_data(tmp_path, step):
    """Moves the global step's params and opt_state away: a restore that reads them fails."""
    for item in ("params", "opt_state"):
        shutil.move(tmp_path / "global" / str(step) / item, tmp_path / f"hidden_{item}")


def test_local_copy_restores_bitwise_without_the_global_data(tmp_path, caplog):
    plan = plan_of(tree_of(), 8)
    states = save_run(tmp_path, plan)
    files = sorted(os.listdir(tmp_path / "local" / "process_0_of_1" / "4"))
    assert "manifest.json" in files and all(f.endswith(".npy") or f == "manifest.json" for f in files)
    hide_global_data(tmp_path, 4)
    template = jax.eval_shape(lambda: states[4][1])
    with caplog.at_level("INFO", logger="vescale_jax.checkpoint"):
        r = restore(tmp_path, plan, template)
    assert (r.step, r.source, r.metadata) == (4, "local", {"at": 4})
    assert "restored local step 4" in caplog.text
    assert_bitwise((r.params, r.opt_state), states[4])
    assert r.params.plan.fingerprint() == plan.fingerprint()


def test_a_newer_local_step_than_the_global_one_is_restored(tmp_path):
    plan = plan_of(tree_of(), 8)
    states = save_run(tmp_path, plan, steps=5)  # global 2, 4; local 4, 5
    r = restore(tmp_path, plan, states[5][1])
    assert (r.step, r.source) == (5, "local")
    assert_bitwise((r.params, r.opt_state), states[5])


@pytest.mark.parametrize("damage", ["deleted", "changed", "older"])
def test_a_missing_changed_or_older_local_copy_falls_back_to_global(tmp_path, damage, caplog):
    plan = plan_of(tree_of(), 8)
    states = save_run(tmp_path, plan)
    step_dir = tmp_path / "local" / "process_0_of_1" / "4"
    if damage == "deleted":
        shutil.rmtree(step_dir)  # step 3 stays local, but the global step 4 is newer
    elif damage == "changed":
        name = next(f for f in sorted(os.listdir(step_dir)) if f.endswith(".npy") and f.startswith("0."))
        data = np.load(step_dir / name)
        data.reshape(-1)[0] ^= 1
        np.save(step_dir / name, data)
    else:
        shutil.rmtree(step_dir)
        shutil.rmtree(tmp_path / "local" / "process_0_of_1" / "3")
    with caplog.at_level("INFO", logger="vescale_jax.checkpoint"):
        r = restore(tmp_path, plan, states[4][1])
    assert (r.step, r.source) == (4, "global")
    assert "restoring from the global checkpoint" in caplog.text
    assert_bitwise((r.params, r.opt_state), states[4])


def test_another_plan_or_state_restores_from_global(tmp_path):
    plan = plan_of(tree_of(), 8)
    states = save_run(tmp_path, plan)
    other = plan_of(tree_of(), 8, granularity=vj.rows(1))
    assert other.fingerprint() != plan.fingerprint()
    template = jax.eval_shape(optax.adam(1e-3).init, host_shard(tree_of(), other))
    r = restore(tmp_path, other, template)
    assert (r.step, r.source) == (4, "global")
    assert_bitwise(vj.unshard(r.params), vj.unshard(states[4][0]))
    sgd = jax.eval_shape(optax.sgd(1e-3, momentum=0.9).init, host_shard(tree_of(), plan))
    with vj.checkpoint.Manager(tmp_path / "global", local_dir=tmp_path / "local") as mngr:
        r = mngr.restore(params=plan, opt_state=None)  # the local copies hold an optimizer state: not this request
        assert (r.step, r.source) == (4, "global")
        with pytest.raises(ValueError):  # the global one is read, and its Adam state is not an SGD state
            mngr.restore(params=plan, opt_state=sgd)


def test_local_files_are_npy_and_json_without_pickle(tmp_path):
    plan = plan_of(tree_of(), 8)
    save_run(tmp_path, plan, steps=2)
    step_dir = tmp_path / "local" / "process_0_of_1" / "2"
    manifest = json.loads((step_dir / "manifest.json").read_text())
    assert (manifest["step"], manifest["process_index"], manifest["process_count"]) == (2, 0, 1)
    assert manifest["devices"] == list(range(8)) and manifest["metadata"] == {"at": 2}
    for entry in manifest["leaves"]:
        for shard in entry["shards"]:
            np.load(step_dir / shard["file"], allow_pickle=False)  # raises on a pickled file
    buffers = [e for e in manifest["leaves"] if e["path"].startswith("['params']")]
    assert len(buffers) == len(plan.buckets)
    assert all(len(e["shards"]) == 8 for e in buffers)  # each device's own shard of each bucket, as it is


def test_local_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="local_keep"):
        vj.checkpoint.Manager(tmp_path / "g", local_dir=tmp_path / "l", local_keep=0)
    with pytest.raises(ValueError, match="local_every"):
        vj.checkpoint.Manager(tmp_path / "g", local_dir=tmp_path / "l", local_every=0)
