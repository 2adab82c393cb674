"""Multi-process vj.fsdp: 2 processes × 4 CPU devices on loopback against 1 process × 8 devices.

Each test launches tests/multihost_worker.py as subprocesses (the simulated-device XLA flag of conftest.py is
removed from their environment: they set ``jax_num_cpu_devices`` instead) under a small harness that fails
fast: as soon as one process exits non-zero the others are killed and the test fails with its stderr tail; past
a deadline every process still running is asked for its Python stack (SIGUSR1), killed, and the one silent the
longest is named as the one that hung.

No assertion depends on how fast a loaded machine runs: deadlines are hang guards far above a quiet run, or
start at an event (the hung test's clock starts once both processes are where the test puts them).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "multihost_worker.py")
STEPS = 10
# A hang guard, not a speed limit: a quiet 2-core machine runs test_two_processes_match_one in about 30 s.
HARD_TIMEOUT_S = 900
# SIGUSR1 makes faulthandler write "Thread 0x... (most recent call first)" (all threads) or "Current thread ...".
STACK_HEADER = "(most recent call first)"


class WorkerFailure(AssertionError):
    """A worker exited non-zero or hung; the message says which and shows its output."""


@dataclasses.dataclass
class Worker:
    name: str
    popen: subprocess.Popen
    lines: list[tuple[float, str]] = dataclasses.field(default_factory=list)
    reader: threading.Thread | None = None

    def tail(self, n: int = 25) -> str:
        noise = ("[Gloo]", "    @ ", "*** Check failure stack trace")
        lines = [line for _, line in self.lines if line.strip() and not line.startswith(noise)]
        return "\n".join(f"    {line}" for line in lines[-n:]) or "    (no output)"

    def last_progress(self) -> tuple[float, str]:
        for t, line in reversed(self.lines):
            if line.startswith("[p"):
                return t, line
        return self.lines[-1] if self.lines else (0.0, "(no output)")


def status(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"status {rc}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Not conftest's --xla_force_host_platform_device_count: the workers set jax_num_cpu_devices. LLVM at -O0
    # compiles these tiny programs ~3x faster (the same in every process, so the comparison is unaffected).
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORM_NAME"):
        env.pop(var, None)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launch(name: str, args: list[str], start: float, *, worker: str = WORKER) -> Worker:
    popen = subprocess.Popen(
        [sys.executable, worker, *args],
        env=child_env(),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
    )
    worker = Worker(name, popen)

    def read():
        for line in popen.stdout:
            worker.lines.append((time.monotonic() - start, line.rstrip("\n")))

    worker.reader = threading.Thread(target=read, daemon=True)
    worker.reader.start()
    return worker


def _stop(workers: list[Worker]) -> None:
    for w in workers:
        if w.popen.poll() is None:
            w.popen.kill()
    for w in workers:
        w.popen.wait()  # killed: reaped at once
        if w.reader is not None:
            w.reader.join(timeout=60)  # returns at the pipe's end, once the output left in it is read


def _ask_for_stacks(workers: list[Worker], wait_s: float) -> None:
    """SIGUSR1 to each worker; waits (event-driven, at most ``wait_s``) until each one's stack dump has arrived."""
    for w in workers:
        os.kill(w.popen.pid, signal.SIGUSR1)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if all(w.popen.poll() is not None or any(STACK_HEADER in line for _, line in w.lines) for w in workers):
            return
        time.sleep(0.05)


def run_workers(
    workers: list[Worker],
    start: float,
    timeout_s: float,
    *,
    fail_fast: bool = True,
    grace_s: float = 120.0,
    clock_starts: Callable[[list[Worker]], bool] | None = None,
) -> float:
    """Waits for every worker to exit 0; returns the wall time. Raises :class:`WorkerFailure` otherwise.

    Args:
      workers: the launched processes.
      start: ``time.monotonic()`` at launch.
      timeout_s: seconds after ``start`` (or after ``clock_starts`` first holds) past which the workers still
        running are declared hung.
      fail_fast: the first non-zero exit kills the others; without it, the others are given ``grace_s`` after
        that exit to exit on their own (and the failure lists every non-zero exit, in order).
      grace_s: see ``fail_fast``.
      clock_starts: the deadline counts from the first moment this holds (an event, not a wall-clock guess of
        how long start-up takes); :data:`HARD_TIMEOUT_S` after ``start`` still ends a run where it never holds.
    """
    order: list[Worker] = []  # non-zero exits, first first
    first_exit = None
    clock = None if clock_starts is not None else 0.0
    try:
        while True:
            now = time.monotonic() - start
            for w in workers:
                rc = w.popen.poll()
                if rc not in (None, 0) and w not in order:
                    order.append(w)
                    first_exit = now if first_exit is None else first_exit
            running = [w for w in workers if w.popen.poll() is None]
            if order and (fail_fast or not running or now > first_exit + grace_s):
                _stop(workers)
                first = order[0]
                others = "".join(
                    f"\n  then {w.name} exited with {status(w.popen.returncode)}:\n{w.tail(8)}" for w in order[1:]
                )
                killed = [w.name for w in running]
                raise WorkerFailure(
                    f"{first.name} exited with {status(first.popen.returncode)} after {now:.1f} s"
                    + (f" (killed the others: {', '.join(killed)})" if killed else "")
                    + f"; its output ends:\n{first.tail()}{others}"
                )
            if not running:
                return now
            if clock is None and clock_starts(workers):
                clock = now
            if (clock is not None and now > clock + timeout_s) or now > HARD_TIMEOUT_S:
                _ask_for_stacks(running, wait_s=60.0)  # where is each one stuck?
                _stop(workers)
                hung = min(running, key=lambda w: w.last_progress()[0])
                t, line = hung.last_progress()
                report = "\n".join(
                    f"  {w.name} (last output at {w.last_progress()[0]:.1f} s):\n{w.tail(20)}" for w in running
                )
                raise WorkerFailure(
                    f"timed out after {now:.0f} s: {', '.join(w.name for w in running)} still running; "
                    f"{hung.name} hung (silent since {t:.1f} s, last line {line!r}); killed them all.\n{report}"
                )
            time.sleep(0.05)
    finally:
        _stop(workers)


def launch_job(tmp_path, num_processes: int, devices: int, start: float, *extra: str) -> tuple[list[Worker], str]:
    port, out = free_port(), str(tmp_path / f"{num_processes}x{devices}.npz")
    workers = [
        launch(
            f"process {i} of {num_processes}×{devices}",
            [str(i), str(num_processes), str(port), str(devices), str(STEPS), out, *extra],
            start,
        )
        for i in range(num_processes)
    ]
    return workers, out


def test_two_processes_match_one(tmp_path):
    start = time.monotonic()
    multi, multi_out = launch_job(tmp_path, 2, 4, start)
    ref, ref_out = launch_job(tmp_path, 1, 8, start)
    wall = run_workers(multi + ref, start, HARD_TIMEOUT_S)
    got, want = np.load(multi_out), np.load(ref_out)
    assert sorted(got.files) == sorted(want.files)
    assert len(want["losses"]) == STEPS and np.all(np.isfinite(want["losses"]))
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-5)
    for k in want.files:
        if k.startswith("param:"):
            g, r = got[k], want[k]
            assert g.shape == r.shape, (k, g.shape, r.shape)
            err = np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30)
            assert err <= 1e-5, f"{k}: max|diff|/max|ref| = {err:.2e}"
    print(f"2×4 and 1×8 processes ran {STEPS} steps in {wall:.1f} s")


@pytest.mark.parametrize("fail_fast", [True, False], ids=["harness-kills", "runtime-aborts"])
def test_dead_peer_fails_fast(tmp_path, fail_fast):
    # Process 1 exits right after joining. The harness reports it at once and kills process 0 (which would wait
    # 30 s for a heartbeat); without the harness killing it, process 0 must abort on its own (missed heartbeats,
    # 3 s) within the grace period.
    start = time.monotonic()
    workers, _ = launch_job(tmp_path, 2, 4, start, "--die", "1", "--heartbeat", "30" if fail_fast else "3")
    with pytest.raises(WorkerFailure, match=r"process 1 of 2×4 exited with status 3") as info:
        run_workers(workers, start, HARD_TIMEOUT_S, fail_fast=fail_fast, grace_s=120)
    message = str(info.value)
    assert "exiting with status 3 (--die)" in message
    if fail_fast:  # reported at process 1's exit, not at a deadline: process 0 was still waiting for it
        assert "(killed the others: process 0 of 2×4)" in message, message
    else:  # process 0 ended by itself, with an error, before the harness would have killed it
        assert workers[0].popen.returncode not in (None, 0, -signal.SIGKILL), workers[0].popen.returncode
        assert "then process 0 of 2×4 exited" in message, message


def _past_the_join(workers: list[Worker]) -> bool:
    """Process 1 says it hangs and process 0 has printed since (it is past the join, on to its first collective)."""
    hanging = [t for t, line in workers[1].lines if "hanging (--hang)" in line]
    return bool(hanging) and any(t > hanging[0] and line.startswith("[p0]") for t, line in workers[0].lines)


def test_hung_peer_is_named(tmp_path):
    # Process 1 joins then sleeps (its heartbeats go on): process 0 blocks in the first collective. The deadline
    # counts from the moment both are there, so a slow start-up on a loaded machine cannot name the wrong one.
    start = time.monotonic()
    workers, _ = launch_job(tmp_path, 2, 4, start, "--hang", "1")
    with pytest.raises(WorkerFailure, match=r"process 1 of 2×4 hung") as info:
        run_workers(workers, start, 8, clock_starts=_past_the_join)
    message = str(info.value)
    assert "last line '[p1]" in message and "hanging (--hang)" in message
    assert "multihost_worker.py" in message  # the stacks of the processes still running (SIGUSR1)
    assert all(w.popen.returncode is not None for w in workers)


# --- vj.distributed in this (single-process) test process --------------------------------------------------------

CLUSTER_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_NTASKS",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "OMPI_MCA_orte_hnp_uri",
    "KUBERNETES_SERVICE_HOST",
    "JAX_COORDINATOR_ADDRESS",
)


@pytest.fixture
def fresh(monkeypatch):
    from vescale_jax import distributed

    for var in CLUSTER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(distributed, "_SETUP", None)
    return distributed


def test_initialize_without_cluster_is_a_noop(fresh):
    import jax

    assert fresh.detect_cluster() is None
    assert fresh.initialize() is False
    assert fresh.initialize() is False  # idempotent
    assert fresh.initialize(local_device_count=jax.local_device_count()) is False
    assert not fresh.is_multiprocess() and not fresh.is_initialized()
    with pytest.raises(ValueError, match="already called and set this process up as a single process"):
        fresh.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)


def test_initialize_errors(fresh, monkeypatch):
    import jax

    with pytest.raises(ValueError, match="pass coordinator_address, num_processes and process_id together"):
        fresh.initialize(coordinator_address="127.0.0.1:1")
    with pytest.raises(ValueError, match="0 <= process_id < num_processes"):
        fresh.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=2)
    jax.devices()  # backends are up: too late to join a job
    with pytest.raises(RuntimeError, match=r"backends are already initialised.*at the very start"):
        fresh.initialize(coordinator_address="127.0.0.1:1", num_processes=2, process_id=0)
    # A detected 2-task SLURM step is a multi-process job: the same error, naming the environment.
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node001",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
    }
    for var, value in slurm.items():
        monkeypatch.setenv(var, value)
    assert fresh.detect_cluster() == "SlurmCluster"
    with pytest.raises(RuntimeError, match="SlurmCluster cluster environment"):
        fresh.initialize()
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a 1-task step runs alone
    assert fresh.initialize() is False


def test_local_batch_slice(monkeypatch):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from vescale_jax import distributed

    assert distributed.local_batch_slice(16) == slice(0, 16)
    with monkeypatch.context() as m:  # process 1 of 3
        m.setattr(jax, "process_count", lambda: 3)
        m.setattr(jax, "process_index", lambda: 1)
        assert distributed.local_batch_slice(12) == slice(4, 8)
        with pytest.raises(ValueError, match="16 is not divisible by the process count 3"):
            distributed.local_batch_slice(16)
    mesh = jax.make_mesh((8,), ("fsdp",), devices=jax.devices()[:8]) if len(jax.devices()) >= 8 else None
    if mesh is not None:
        assert distributed.local_batch_slice(16, NamedSharding(mesh, P("fsdp"))) == slice(0, 16)
        with pytest.raises(ValueError, match="does not split over the batch sharding"):
            distributed.local_batch_slice(12, NamedSharding(mesh, P("fsdp")))
