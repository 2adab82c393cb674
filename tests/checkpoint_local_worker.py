"""One process of a job with local checkpoint copies (launched by tests/test_checkpoint_local_multihost.py).

    python tests/checkpoint_local_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES MODE DIR LOCAL OUT.npz

MODE ``train``: the small test GPT of tests/helpers.py and an Adam state, every array scaled by 1.25 (the count
incremented) per "step", 0.3 s apart; ``Manager(DIR, save_interval_steps=4, local_dir=LOCAL, local_every=1)``
saves what is due; at the preemption step (after a SIGTERM to any process) every process saves, waits, and
process 0 writes the logical state to OUT.npz, then all exit 0. MODE ``restore`` / ``restore-rows``: restores
the newest step into the same plan / a ``rows(1)`` plan, prints ``source S step N global-reads K`` (K: calls
into the global directory's Orbax reads) and process 0 writes the logical state to OUT.npz.
"""

from __future__ import annotations

import sys
import time

import jax

from vescale_jax import distributed

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py


def main() -> None:
    pid, n, port, devices, mode, directory, local_dir, out = sys.argv[1:9]
    pid, n, devices = int(pid), int(n), int(devices)
    assert distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=n,
        process_id=pid,
        local_device_count=devices,
        timeout_s=120,  # generous: only a failed job waits this long
        heartbeat_timeout_s=60,
    )
    import numpy as np
    import optax
    from helpers import GPTConfig, abstract_model, init_params  # tests/: this script's directory

    import vescale_jax as vj

    cfg = GPTConfig(vocab=61, max_len=16, d_model=24, num_heads=2, num_layers=2, d_ff=40)
    _, shapes = abstract_model(cfg)
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    granularity = vj.rows(1) if mode == "restore-rows" else vj.element()
    plan = vj.plan(shapes, mesh, stacked=("blocks",), granularity=granularity)
    tx = optax.adam(1e-3)

    def dump(params, opt_state) -> None:
        adam = opt_state[0]
        flat = {"count": np.asarray(adam.count)}
        for name, tree in (("params", params), ("mu", adam.mu), ("nu", adam.nu)):
            for path, x in jax.tree_util.tree_flatten_with_path(vj.unshard(tree))[0]:
                flat[name + jax.tree_util.keystr(path)] = np.asarray(x)
        if pid == 0:
            np.savez(out, **flat)

    if mode == "train":
        params = vj.init_sharded(lambda k: init_params(cfg, k), plan, jax.random.key(0))
        adam, *rest = vj.init_opt_state(tx, params)
        mu, nu = jax.tree.map(lambda x: x * 3, params), jax.tree.map(lambda x: x * x, params)
        state = (params, (adam._replace(mu=mu, nu=nu), *rest))
        mngr = vj.checkpoint.Manager(directory, save_interval_steps=4, local_dir=local_dir, local_every=1)
        for step in range(1, 1000):
            state = jax.tree.map(lambda x: x + 1 if x.dtype == np.int32 else x * 1.25, state)
            print(f"[p{pid}] step {step}", flush=True)
            preempted = mngr.reached_preemption(step)
            if preempted or mngr.should_save(step):
                mngr.save(step, params=state[0], opt_state=state[1], force=preempted)
            if preempted:
                mngr.wait()
                dump(*state)
                print(f"[p{pid}] preempted at step {step}", flush=True)
                break
            time.sleep(0.3)
        mngr.close()
        return
    template = jax.eval_shape(tx.init, vj.init_sharded(lambda k: init_params(cfg, k), plan, jax.random.key(1)))
    mngr = vj.checkpoint.Manager(directory, local_dir=local_dir)
    reads = [0]
    for name in ("restore", "item_metadata"):  # every read of the global directory's items goes through these
        method = getattr(mngr._mngr, name)

        def counted(*args, _method=method, **kwargs):
            reads[0] += 1
            return _method(*args, **kwargs)

        setattr(mngr._mngr, name, counted)
    r = mngr.restore(params=plan, opt_state=template)
    print(f"[p{pid}] source {r.source} step {r.step} global-reads {reads[0]}", flush=True)
    dump(r.params, r.opt_state)
    mngr.close()


if __name__ == "__main__":
    main()
    sys.exit(0)
