"""Local checkpoint copies on 2 processes x 4 CPU devices on loopback (tests/checkpoint_local_worker.py).

SIGTERM to process 1: both save the agreed step (globally and locally) and exit 0. The restarted job restores
every process's local copy with the global step's data items moved away and no call into the global
directory's reads; with process 1's local copies deleted, or into another plan, every process restores the
global checkpoint. Bit for bit against the state the preempted job held, every way.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import numpy as np
import pytest
from test_multihost import HARD_TIMEOUT_S, free_port, launch, run_workers
from test_preemption import _wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "checkpoint_local_worker.py")


def job(tmp_path, mode: str, out: str):
    port, start = free_port(), time.monotonic()
    workers = [
        launch(
            f"{mode}: process {i} of 2x4",
            [str(i), "2", str(port), "4", mode, str(tmp_path / "global"), str(tmp_path / "local"), out],
            start,
            worker=WORKER,
        )
        for i in range(2)
    ]
    return workers, start


def said(workers, what: str) -> list[str]:
    out = []
    for w in workers:
        lines = [line for _, line in w.lines if what in line]
        assert len(lines) == 1, w.tail()
        out.append(lines[0].split("] ", 1)[1])
    return out


def assert_same(a, b):
    want, got = np.load(a), np.load(b)
    assert sorted(want.files) == sorted(got.files) and len(want.files) > 10
    for k in want.files:
        np.testing.assert_array_equal(got[k].reshape(-1).view(np.uint8), want[k].reshape(-1).view(np.uint8), err_msg=k)


@pytest.mark.slow
def test_restart_reads_local_copies_else_everyone_reads_global(tmp_path):
    workers, start = job(tmp_path, "train", str(tmp_path / "held.npz"))

    def both_at_5(workers) -> bool:
        return all(any(line == f"[p{i}] step 5" for _, line in w.lines) for i, w in enumerate(workers))

    _wait_for(workers, both_at_5, start)
    os.kill(workers[1].popen.pid, signal.SIGTERM)
    run_workers(workers, start, HARD_TIMEOUT_S)  # both exit 0; hang guards, not speed limits
    at = {int(s.rsplit(" ", 1)[1]) for s in said(workers, "preempted at step")}
    assert len(at) == 1
    (step,) = at
    held = str(tmp_path / "held.npz")

    # 1. the same plan and layout: local copies only, the global step's data moved away
    hidden = tmp_path / "hidden"
    os.makedirs(hidden)
    for item in ("params", "opt_state"):
        shutil.move(tmp_path / "global" / str(step) / item, hidden / item)
    workers, start = job(tmp_path, "restore", str(tmp_path / "local.npz"))
    run_workers(workers, start, HARD_TIMEOUT_S)
    assert said(workers, "source") == [f"source local step {step} global-reads 0"] * 2
    assert_same(held, tmp_path / "local.npz")
    for item in ("params", "opt_state"):
        shutil.move(hidden / item, tmp_path / "global" / str(step) / item)

    # 2. another plan: global, though every local copy is there
    workers, start = job(tmp_path, "restore-rows", str(tmp_path / "rows.npz"))
    run_workers(workers, start, HARD_TIMEOUT_S)
    assert [s.rsplit(" global-reads", 1)[0] for s in said(workers, "source")] == [f"source global step {step}"] * 2
    assert_same(held, tmp_path / "rows.npz")

    # 3. process 1's local copies deleted: every process falls back to global
    shutil.rmtree(tmp_path / "local" / "process_1_of_2")
    workers, start = job(tmp_path, "restore", str(tmp_path / "global.npz"))
    run_workers(workers, start, HARD_TIMEOUT_S)
    assert [s.rsplit(" global-reads", 1)[0] for s in said(workers, "source")] == [f"source global step {step}"] * 2
    assert_same(held, tmp_path / "global.npz")
