"""One process of a 2-process x 4-device job for tests/test_watchdog.py: a tiny sharded step (one cross-process
all-reduce each) in a loop under ``vj.distributed.Watchdog``.

Usage: ``python watchdog_worker.py PROCESS_ID PORT FLOOR_S JAX_HEARTBEAT_S``; prints ``[pK] step i`` after each
step. The test stops or kills a process once both are past their first steps; the watchdog (or JAX) ends the
others.
"""

import sys
import time

import jax
import jax.numpy as jnp

import vescale_jax as vj

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py


def main(pid: int, port: int, floor_s: float, heartbeat_timeout_s: int) -> None:
    vj.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=pid,
        local_device_count=4,
        heartbeat_timeout_s=heartbeat_timeout_s,
    )
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    x = jax.jit(lambda: jnp.arange(64.0), out_shardings=sharded)()
    step = jax.jit(lambda x: (x * 0.5 + 1.0, jnp.sum(x)))  # the sum is an all-reduce over both processes
    # The first steps (compilation) get first_step_s; then max(floor_s, 10 x the median step time).
    with vj.distributed.Watchdog(floor_s=floor_s, first_step_s=300.0, heartbeat_s=0.5) as wd:
        for i in range(100_000):
            with wd.step(i):
                x, loss = step(x)
                float(loss)
            print(f"[p{pid}] step {i}", flush=True)
            time.sleep(0.05)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
