"""vj.checkpoint.load_safetensors / save_safetensors across processes: 2 processes x 4 CPU devices on loopback against
1 process x 8 devices, on one Llama-format checkpoint (several files and an index).

Each process of the 2-process job reads about half of the file data (its own devices' ranges only); both jobs load
the same leaves bit for bit and save byte-identical files. Uses the fail-fast harness of tests/test_multihost.py.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from test_multihost import HARD_TIMEOUT_S, free_port, launch, run_workers
from test_safetensors import llama_tensors, write_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "safetensors_worker.py")


def job(n: int, devices: int, ckpt: str, out: str, start: float):
    port = free_port()
    args = lambda i: [str(i), str(n), str(port), str(devices), ckpt, out]
    return [launch(f"process {i} of {n}x{devices}", args(i), start, worker=WORKER) for i in range(n)]


def test_two_processes_read_their_half_and_match_one(tmp_path):
    tensors = llama_tensors(11, layers=2, h=64, i=96, v=128, kv=32)
    ckpt = write_checkpoint(tensors, tmp_path / "ckpt", num_files=3)
    start = time.monotonic()
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    run_workers(job(2, 4, ckpt, two, start) + job(1, 8, ckpt, one, start), start, HARD_TIMEOUT_S)
    got, want = np.load(f"{two}.npz"), np.load(f"{one}.npz")
    assert sorted(got.files) == sorted(want.files) and len(want.files) == 21
    for k in want.files:
        assert got[k].tobytes() == want[k].tobytes(), k
    total = sum(x.nbytes for x in tensors.values())
    for pid in (0, 1):
        stats = json.load(open(f"{two}.p{pid}.json"))
        assert stats["data_bytes"] == total
        assert stats["bytes_read"] <= 0.55 * total, (pid, stats)
    assert json.load(open(f"{one}.p0.json"))["bytes_read"] >= total
    saved_two, saved_one = sorted(os.listdir(f"{two}.saved")), sorted(os.listdir(f"{one}.saved"))
    assert saved_two == saved_one and len(saved_one) > 2
    for name in saved_one:
        a = open(os.path.join(f"{two}.saved", name), "rb").read()
        assert a == open(os.path.join(f"{one}.saved", name), "rb").read(), name
