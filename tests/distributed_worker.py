"""One process of a 2-process job for tests/test_distributed_failures.py: joins the job, then all-gathers in a loop.

Usage: ``python distributed_worker.py PROCESS_ID PORT TIMEOUT_S [STEPS]``; prints ``[pK] ready`` once joined and
``[pK] step i`` per step; a failed join prints ``[pK] init failed: <error>`` and exits 3.
"""

import sys
import time

import jax

import vescale_jax as vj

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py


def main(pid: int, port: int, timeout_s: int, steps: int) -> None:
    try:
        vj.distributed.initialize(
            coordinator_address=f"127.0.0.1:{port}",
            num_processes=2,
            process_id=pid,
            local_device_count=1,
            timeout_s=timeout_s,
        )
    except Exception as e:
        print(f"[p{pid}] init failed: {type(e).__name__}: {e}", flush=True)
        sys.exit(3)
    print(f"[p{pid}] ready", flush=True)
    from jax.experimental import multihost_utils

    for i in range(steps):
        multihost_utils.process_allgather(jax.numpy.ones(1) * pid)
        print(f"[p{pid}] step {i}", flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else 0)
