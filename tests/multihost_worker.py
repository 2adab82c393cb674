"""One process of a multi-process vj.fsdp run (launched by tests/test_multihost.py), or the 1-process reference.

    python tests/multihost_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES_PER_PROCESS STEPS OUT.npz

Trains the small test GPT of tests/helpers.py for STEPS AdamW steps on a mesh over all processes' devices, each
process feeding only its rows of every global batch, and (process 0) writes the losses and the final logical
parameters to OUT.npz. With NUM_PROCESSES=1 it is the single-process reference (DEVICES_PER_PROCESS CPU
devices, no distributed runtime). Progress lines (``[p0] step 3 loss ...``) go to stderr so that a harness can
tell where a process stopped. ``--die P`` / ``--hang P`` make process P exit(3) / sleep forever after joining;
SIGUSR1 dumps the Python stack to stderr.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time

import jax  # importing is fine; nothing may touch devices before initialize

from vescale_jax import distributed

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py

T0 = time.perf_counter()


def log(pid: int, msg: str) -> None:
    sys.stderr.write(f"[p{pid}] {time.perf_counter() - T0:5.1f} s: {msg}\n")
    sys.stderr.flush()


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("process_id", type=int)
    p.add_argument("num_processes", type=int)
    p.add_argument("port", type=int)
    p.add_argument("devices", type=int, help="CPU devices per process")
    p.add_argument("steps", type=int)
    p.add_argument("out", help=".npz written by process 0")
    p.add_argument("--batch", type=int, default=16, help="global batch size")
    p.add_argument("--die", type=int, default=-1, help="this process exits with status 3 after joining")
    p.add_argument("--hang", type=int, default=-1, help="this process sleeps forever after joining")
    p.add_argument("--heartbeat", type=int, default=30, help="seconds before a silent peer is declared dead")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    pid, n = args.process_id, args.num_processes
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks a hung process where it is
    if n > 1:
        setup = dict(
            coordinator_address=f"127.0.0.1:{args.port}",
            num_processes=n,
            process_id=pid,
            local_device_count=args.devices,
        )
        joined = distributed.initialize(
            # Generous: these limits only end a failed job; a loaded machine must not trip them on a good one.
            **setup,
            timeout_s=120,
            heartbeat_timeout_s=args.heartbeat,
            shutdown_timeout_s=120,
        )
        assert joined and distributed.initialize(**setup) and distributed.is_multiprocess()  # idempotent
    else:
        jax.config.update("jax_num_cpu_devices", args.devices)
    assert jax.process_count() == n and jax.process_index() == pid, (jax.process_count(), jax.process_index())
    assert jax.local_device_count() == args.devices, jax.local_devices()
    log(pid, f"joined: process {pid} of {n}, {jax.device_count()} devices")
    if pid == args.die:
        log(pid, "exiting with status 3 (--die)")
        os._exit(3)
    if pid == args.hang:
        log(pid, "hanging (--hang)")
        while True:
            time.sleep(60)

    import numpy as np
    import optax
    from helpers import GPTConfig, abstract_model, batches, init_params, loss_fn  # tests/: this script's directory
    from jax.experimental import multihost_utils

    import vescale_jax as vj

    cfg = GPTConfig(vocab=257, max_len=16, d_model=20, num_heads=2, num_layers=3, d_ff=52)
    seq = 16
    log(pid, "imported")
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    graphdef, shapes = abstract_model(cfg)
    plan = vj.plan(shapes, mesh, stacked=("blocks",))
    distributed.assert_same_plan(plan)
    tx = optax.adamw(1e-3)
    params = vj.init_sharded(lambda k: init_params(cfg, k), plan, jax.random.key(0))
    log(pid, "init_sharded")
    opt_state = vj.init_opt_state(tx, params)
    log(pid, f"initialised {sum(s.size for s in plan.leaves)} parameters, plan {plan.fingerprint()[:12]}")

    @vj.fsdp(plan=plan)
    def step(p, opt_state, batch):
        def loss_of(q):
            return loss_fn(vj.flax.nnx_apply(graphdef, q, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_of)(p)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes a float with an int32 count
            updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, {"loss": loss}

    # The same global batches on every process (a fixed seed); each process feeds only its rows.
    rows = distributed.local_batch_slice(args.batch, vj.data_sharding(plan))
    assert rows == distributed.local_batch_slice(args.batch), rows
    losses = []
    for i, window in enumerate(batches(args.steps, batch=args.batch, seq=seq, seed=0)):
        batch = {k: v[rows] for k, v in window.items()}
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(metrics["loss"]))
        log(pid, f"step {i + 1} loss {losses[-1]:.6f}")

    logical = vj.unshard(params)
    leaves, _ = jax.tree_util.tree_flatten_with_path(logical)
    gathered = multihost_utils.process_allgather([x for _, x in leaves], tiled=True)
    if pid == 0:
        arrays = {jax.tree_util.keystr(path): np.asarray(x) for (path, _), x in zip(leaves, gathered, strict=True)}
        np.savez(args.out, losses=np.asarray(losses), **{f"param:{k}": v for k, v in arrays.items()})
    log(pid, "done")


if __name__ == "__main__":
    main()
