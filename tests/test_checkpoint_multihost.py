"""vj.checkpoint across process counts: 2 processes x 4 CPU devices on loopback <-> 1 process x 8 devices.

Saves from one job and restores in the other (both directions), then compares every logical leaf of the params
and the Adam moments, bit for bit. Uses the fail-fast harness of tests/test_multihost.py.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from test_multihost import HARD_TIMEOUT_S, Worker, free_port, run_workers
from test_multihost import launch as multihost_launch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "checkpoint_worker.py")


def launch(name: str, args: list[str], start: float) -> Worker:
    return multihost_launch(name, args, start, worker=WORKER)


def job(n: int, devices: int, mode: str, directory: str, out: str, start: float) -> list[Worker]:
    port = free_port()
    return [
        launch(
            f"{mode} process {i} of {n}x{devices}",
            [str(i), str(n), str(port), str(devices), mode, directory, out],
            start,
        )
        for i in range(n)
    ]


@pytest.mark.slow
def test_save_on_two_processes_restore_on_one_and_back(tmp_path):
    start = time.monotonic()
    a, b = str(tmp_path / "from2x4"), str(tmp_path / "from1x8")
    saved = job(2, 4, "save", a, str(tmp_path / "saved2x4.npz"), start) + job(
        1, 8, "save", b, str(tmp_path / "saved1x8.npz"), start
    )
    run_workers(saved, start, HARD_TIMEOUT_S)  # hang guards, not speed limits
    restored = job(1, 8, "restore", a, str(tmp_path / "restored1x8.npz"), start) + job(
        2, 4, "restore", b, str(tmp_path / "restored2x4.npz"), start
    )
    wall = run_workers(restored, start, HARD_TIMEOUT_S)
    for want_file, got_file in (("saved2x4", "restored1x8"), ("saved1x8", "restored2x4")):
        want, got = np.load(tmp_path / f"{want_file}.npz"), np.load(tmp_path / f"{got_file}.npz")
        assert sorted(want.files) == sorted(got.files) and len(want.files) > 30
        for k in want.files:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{want_file} -> {got_file}: {k}")
        assert int(got["count"]) == 7
    print(f"2x4 -> 1x8 and 1x8 -> 2x4 checkpoints round-tripped bitwise in {wall:.1f} s")
