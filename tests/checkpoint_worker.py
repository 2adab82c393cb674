"""One process of a multi-process checkpoint job (launched by tests/test_checkpoint_multihost.py).

    python tests/checkpoint_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS MODE DIR OUT.npz

MODE ``save``: plans the small test GPT of tests/helpers.py over every process's devices, initialises it into shards,
builds an Adam state with distinct non-zero moments and saves step 1 to DIR with ``vj.checkpoint.Manager``.
MODE ``restore``: restores the latest step of DIR into this job's plan (``rows(1)`` instead of ``element()``).
Either way process 0 writes the logical params, moments and count to OUT.npz.
"""

from __future__ import annotations

import sys

import jax

from vescale_jax import distributed

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py


def main() -> None:
    pid, n, port, devices, mode, directory, out = sys.argv[1:8]
    pid, n, devices = int(pid), int(n), int(devices)
    if n > 1:
        assert distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=n,
            process_id=pid,
            local_device_count=devices,
            timeout_s=120,  # generous: only a failed job waits this long
            heartbeat_timeout_s=30,
        )
    else:
        jax.config.update("jax_num_cpu_devices", devices)
    import numpy as np
    import optax
    from helpers import GPTConfig, abstract_model, init_params  # tests/: this script's directory
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import vescale_jax as vj

    cfg = GPTConfig(vocab=61, max_len=16, d_model=24, num_heads=2, num_layers=2, d_ff=40)
    _, shapes = abstract_model(cfg)
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    granularity = vj.element() if mode == "save" else vj.rows(1)
    plan = vj.plan(shapes, mesh, stacked=("blocks",), granularity=granularity)
    tx = optax.adam(1e-3)
    mngr = vj.checkpoint.Manager(directory)
    if mode == "save":
        params = vj.init_sharded(lambda k: init_params(cfg, k), plan, jax.random.key(0))
        adam, *rest = vj.init_opt_state(tx, params)
        mu, nu = jax.tree.map(lambda x: x * 3 - 1, params), jax.tree.map(lambda x: x * x + 0.5, params)
        state = (adam._replace(count=jax.numpy.asarray(7, jax.numpy.int32), mu=mu, nu=nu), *rest)
        mngr.save(1, params=params, opt_state=state, metadata={"processes": n})
        mngr.wait()
    else:
        template = jax.eval_shape(tx.init, vj.init_sharded(lambda k: init_params(cfg, k), plan, jax.random.key(1)))
        r = mngr.restore(params=plan, opt_state=template)
        assert r.params.plan == plan and r.metadata["processes"] in (1, 2), r.metadata
        params, state = r.params, r.opt_state
    mngr.close()
    replicated = NamedSharding(mesh, P())
    gather = jax.jit(lambda t: t, out_shardings=replicated)  # tests only: every leaf on every process
    arrays = {}
    for name, sp in (("params", params), ("mu", state[0].mu), ("nu", state[0].nu)):
        flat, _ = jax.tree_util.tree_flatten_with_path(vj.checkpoint.logical_tree(sp))
        for path, x in flat:
            arrays[f"{name}:{jax.tree_util.keystr(path)}"] = np.asarray(gather(x))
    arrays["count"] = np.asarray(gather(state[0].count))
    if pid == 0:
        np.savez(out, **arrays)
    print(f"[p{pid}] {mode} done on {jax.device_count()} devices in {n} processes", file=sys.stderr)


if __name__ == "__main__":
    main()
