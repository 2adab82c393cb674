"""One process of a training job that checkpoints, honours preemption and resumes (tests/test_preemption.py).

    python tests/resilience_worker.py PROCESS_ID NUM_PROCESSES PORT DEVICES DIR OUT.json STEPS
        [--resume] [--save-every K] [--step-sleep S]

Trains the small test GPT of tests/helpers.py with ``vj.fsdp`` and AdamW for STEPS steps on batches that are a
function of the step number (so a resumed run sees the same data without a loader state). After every step it
asks ``Manager.reached_preemption``: at the agreed step it saves, waits, prints ``preempted at step S`` and exits
0. Every ``--save-every`` steps it saves (synchronously) and prints ``saved step S``. With ``--resume`` it
restores the newest complete checkpoint of DIR into this job's plan (any process or device count) and goes on
from the next step. Process 0 rewrites OUT.json (``{"first": step, "losses": {step: loss}}``) after every step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

from vescale_jax import distributed

jax.config.update("jax_numpy_dtype_promotion", "strict")  # as tests/conftest.py


def main() -> None:
    p = argparse.ArgumentParser()
    for name in ("pid", "n", "port", "devices"):
        p.add_argument(name, type=int)
    p.add_argument("directory")
    p.add_argument("out")
    p.add_argument("steps", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    a = p.parse_args()
    if a.n > 1:
        assert distributed.initialize(
            coordinator_address=f"127.0.0.1:{a.port}",
            num_processes=a.n,
            process_id=a.pid,
            local_device_count=a.devices,
            timeout_s=120,  # generous: only a failed job waits this long
            heartbeat_timeout_s=60,
        )
    else:
        jax.config.update("jax_num_cpu_devices", a.devices)
    import numpy as np
    import optax
    from helpers import GPTConfig, abstract_model, init_params, loss_fn  # tests/: this script's directory

    import vescale_jax as vj

    cfg = GPTConfig(vocab=61, max_len=16, d_model=24, num_heads=2, num_layers=2, d_ff=40)
    graphdef, shapes = abstract_model(cfg)
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    plan = vj.plan(shapes, mesh, stacked=("blocks",))
    tx = optax.adamw(1e-2, weight_decay=0.1)
    params = vj.init_sharded(lambda k: init_params(cfg, k), plan, jax.random.key(0))
    with jax.numpy_dtype_promotion("standard"):
        opt_state = vj.init_opt_state(tx, params)
    mngr = vj.checkpoint.Manager(a.directory)
    first = 1
    if a.resume:
        r = mngr.restore(params=plan, opt_state=jax.eval_shape(lambda: opt_state))
        params, opt_state, first = r.params, r.opt_state, r.step + 1
        print(f"[p{a.pid}] resumed from step {r.step} on {jax.device_count()} devices", flush=True)

    @vj.fsdp(plan=plan)
    def train_step(params, opt_state, batch):
        def loss_of(p):
            return loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_of)(params)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def batch(step: int) -> dict[str, np.ndarray]:
        tokens = np.random.default_rng(step).integers(0, cfg.vocab, (8, cfg.max_len + 1)).astype(np.int32)
        rows = distributed.local_batch_slice(8)
        return {"x": tokens[rows, :-1], "y": tokens[rows, 1:]}

    losses: dict[int, float] = {}
    for step in range(first, a.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, batch(step))
        losses[step] = float(loss)
        if a.pid == 0:
            with open(a.out + ".tmp", "w") as f:
                json.dump({"first": first, "losses": losses}, f)
            os.replace(a.out + ".tmp", a.out)
        print(f"[p{a.pid}] step {step} loss {losses[step]!r}", flush=True)
        preempted = mngr.reached_preemption(step)
        if preempted or (a.save_every and step % a.save_every == 0):
            mngr.save(step, params=params, opt_state=opt_state, force=True)
            mngr.wait()
            print(f"[p{a.pid}] saved step {step}", flush=True)
        if preempted:
            print(f"[p{a.pid}] preempted at step {step}", flush=True)
            mngr.close()
            return
        time.sleep(a.step_sleep)
    mngr.close()
    print(f"[p{a.pid}] finished {a.steps} steps", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
