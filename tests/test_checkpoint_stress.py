"""The checkpoint conversion runs back to back without aborting XLA:CPU (no collective inside a loop)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT, child_pythonpath

# A ~20M-parameter state (params and AdamW's two moments) on 8 simulated devices, converted to the logical
# form and back CONVERSIONS / 2 times. XLA:CPU aborted intermittently ("rendezvous.h: Check failed: id <
# num_threads") when the conversion ran one all-to-all per layer inside a while loop; an abort kills the process,
# hence the child.
CONVERSIONS = 200
SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, numpy as np
    import vescale_jax as vj
    from vescale_jax.relayout import _logical_leaves as logical
    from vescale_jax.testing import census

    d, f, layers = 384, 1536, 8
    shapes = {"embed": (16001, d), "lnf": (d,), "blocks": {"qkv": (layers, d, 3 * d), "proj": (layers, d, d),
              "up": (layers, d, f), "down": (layers, f, d), "ln": (layers, 2, d), "b_up": (layers, f)}}
    rng = np.random.default_rng(0)
    is_shape = lambda s: isinstance(s, tuple)
    trees = [jax.tree.map(lambda s: rng.standard_normal(s, np.float32), shapes, is_leaf=is_shape) for _ in "pmv"]
    plan = vj.plan(trees[0], jax.make_mesh((8,), ("fsdp",)), stacked=("blocks",))
    params = vj.shard(trees[0], plan)
    state = [params, vj.shard(trees[1], plan), vj.shard(trees[2], plan)]  # params, AdamW's mu and nu
    print("parameters", 3 * sum(x.size for x in jax.tree.leaves(trees[0])), flush=True)
    fn, shardings = logical._to_logical_fn(plan)
    ops = census(fn.lower(*[logical._relabel(b, s) for b, s in zip(params.buffers, shardings)]).compile())
    print("collectives in a loop", sum(op.in_loop for op in ops.ops), "of", len(ops.ops), flush=True)
    buffers = [s.buffers for s in state]
    for i in range(int(sys.argv[1]) // 2):
        leaves = [logical.to_logical(b, plan) for b in buffers]  # one conversion of the state
        buffers = [logical.from_logical(x, plan)[0] for x, _ in leaves]  # and one back
        jax.block_until_ready(buffers)
    for got, want in zip(buffers, state):
        for x, y in zip(got, want.buffers):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    print("conversions", 2 * (int(sys.argv[1]) // 2), "bitwise", flush=True)
""")


@pytest.mark.slow
def test_200_back_to_back_conversions_of_a_20m_state_never_abort(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(CONVERSIONS)],
        cwd=ROOT,
        env=child_pythonpath(),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    assert "collectives in a loop 0 of" in run.stdout, run.stdout
    assert f"conversions {CONVERSIONS} bitwise" in run.stdout, run.stdout
