"""Runs that survive: a preempted job saves one step everywhere and exits 0, a killed job resumes anywhere, and a
checkpoint directory is never mixed between runs.

The multi-process cases run tests/resilience_worker.py as 2 processes × 4 CPU devices on loopback under the
harness of tests/test_multihost.py (fail-fast, hang guards far above a quiet run, clocks that start at events).
"""

from __future__ import annotations

import json
import os
import signal
import time

import jax
import numpy as np
import optax
import pytest
from test_multihost import HARD_TIMEOUT_S, free_port, launch, run_workers

import vescale_jax as vj

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "resilience_worker.py")
STEPS = 24


# ----------------------------------------------------------------------------------------- single process
@pytest.fixture(scope="module")
def small():
    shapes = {"w": jax.ShapeDtypeStruct((7, 5), np.float32), "b": jax.ShapeDtypeStruct((5,), np.float32)}
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    plan = vj.plan(shapes, mesh)
    params = vj.init_sharded(
        lambda k: {"w": jax.random.normal(k, (7, 5)), "b": jax.numpy.arange(5.0)}, plan, jax.random.key(0)
    )
    return plan, params


def test_sigterm_in_one_process_names_the_next_step(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    mngr = vj.checkpoint.Manager(tmp_path / "ck", save_interval_steps=5)
    try:
        assert signal.getsignal(signal.SIGTERM) is not before  # caught from the Manager's creation on
        assert not mngr.reached_preemption(1) and not mngr.should_save(1)
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode: the process lives
        assert mngr.reached_preemption(2) and mngr.should_save(2)  # the first boundary after the notice
        assert not mngr.reached_preemption(3) and not mngr.should_save(3)
        assert mngr.should_save(5)
    finally:
        mngr.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_catch_sigterm_false_leaves_the_signal_alone(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with vj.checkpoint.Manager(tmp_path / "ck", catch_sigterm=False) as mngr:
        assert not mngr.reached_preemption(1)
        assert signal.getsignal(signal.SIGTERM) is before


def test_another_runs_steps_are_refused(small, tmp_path):
    plan, params = small
    with vj.checkpoint.Manager(tmp_path / "ck") as first:
        for step in (20, 40, 60):
            first.save(step, params=params)
    # A new run (nothing restored) into the same directory: refused, naming the steps and the fixes.
    with vj.checkpoint.Manager(tmp_path / "ck", max_to_keep=2) as other:
        with pytest.raises(ValueError, match=r"not saving step 40 .* holds steps \[20, 40, 60\] \(\[40, 60\] at or"):
            other.save(40, params=params)
        assert other.all_steps() == [20, 40, 60]  # nothing deleted
    # Resumed from the latest step: its steps are this run's, later saves go on.
    with vj.checkpoint.Manager(tmp_path / "ck") as resumed:
        r = resumed.restore(params=plan)
        assert r.step == 60
        resumed.save(61, params=params)
        assert resumed.all_steps() == [20, 40, 60, 61]
    # Resumed from an older step: the later ones would stay "latest", so they are refused...
    with vj.checkpoint.Manager(tmp_path / "ck") as back:
        back.restore(40, params=plan)
        with pytest.raises(ValueError, match=r"\[60, 61\] at or after step 41"):
            back.save(41, params=params)
    # ...unless told to overwrite: then exactly those go, and the new step is the latest.
    with vj.checkpoint.Manager(tmp_path / "ck", overwrite=True) as back:
        back.restore(40, params=plan)
        back.save(41, params=params)
        assert back.all_steps() == [20, 40, 41] and back.latest_step() == 41


def test_overwrite_replaces_another_run(small, tmp_path):
    _, params = small
    with vj.checkpoint.Manager(tmp_path / "ck") as first:
        first.save(60, params=params)
    with vj.checkpoint.Manager(tmp_path / "ck", overwrite=True, max_to_keep=2) as again:
        again.save(20, params=params)
        again.save(40, params=params)
        assert again.all_steps() == [20, 40] and again.latest_step() == 40


def test_saving_an_earlier_step_than_ones_own_is_refused(small, tmp_path):
    _, params = small
    with vj.checkpoint.Manager(tmp_path / "ck") as mngr:
        mngr.save(10, params=params)
        with pytest.raises(ValueError, match=r"\[10\] at or after step 5"):
            mngr.save(5, params=params)


def test_prepare_compiles_the_save_before_it(tmp_path):
    shapes = {"w": jax.ShapeDtypeStruct((9, 3), np.float32), "v": jax.ShapeDtypeStruct((11,), np.float32)}
    plan = vj.plan(shapes, jax.make_mesh((jax.device_count(),), ("fsdp",)))  # a plan of its own: nothing cached
    params = vj.init_sharded(
        lambda k: {"w": jax.random.normal(k, (9, 3)), "v": jax.numpy.ones(11)}, plan, jax.random.key(0)
    )
    with jax.numpy_dtype_promotion("standard"):
        state = vj.init_opt_state(optax.adam(1e-3), params)
    with vj.checkpoint.Manager(tmp_path / "ck") as mngr:
        mngr.prepare(params=params, opt_state=state)
        assert mngr.all_steps() == []  # nothing written
        compiles: list[str] = []
        with jax.log_compiles(True), _capture_compiles(compiles):
            mngr.save(1, params=params, opt_state=state)
            mngr.wait()
        assert not compiles, compiles


class _capture_compiles:
    """Collects the names of computations JAX compiles (``jax.log_compiles`` writes them to its logger)."""

    def __init__(self, out: list[str]):
        import logging

        self.out, self.handler = out, logging.Handler()
        self.handler.emit = lambda record: (
            self.out.append(record.getMessage()) if "Finished XLA compilation" in record.getMessage() else None
        )
        self.logger = logging.getLogger("jax")

    def __enter__(self):
        import logging

        self.level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self.handler)

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)


# -------------------------------------------------------------------------------------------- multi-process
def job(tmp_path, name: str, processes: int, devices: int, directory, *extra: str):
    port, out, start = free_port(), str(tmp_path / f"{name}.json"), time.monotonic()
    workers = [
        launch(
            f"{name}: process {i} of {processes}×{devices}",
            [str(i), str(processes), str(port), str(devices), str(directory), out, str(STEPS), *extra],
            start,
            worker=WORKER,
        )
        for i in range(processes)
    ]
    return workers, out, start


def losses(path: str) -> dict[int, float]:
    with open(path) as f:
        return {int(k): v for k, v in json.load(f)["losses"].items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    workers, out, start = job(tmp, "uninterrupted", 2, 4, tmp / "ck")
    run_workers(workers, start, HARD_TIMEOUT_S)
    got = losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)) and np.all(np.isfinite(list(got.values())))
    return got


def _both_at(step: int):
    def ready(workers) -> bool:
        return all(any(line.startswith(f"[p{i}] step {step} ") for _, line in w.lines) for i, w in enumerate(workers))

    return ready


def _wait_for(workers, ready, start: float) -> None:
    deadline = time.monotonic() + HARD_TIMEOUT_S
    while not ready(workers):
        dead = [w for w in workers if w.popen.poll() is not None]
        assert not dead and time.monotonic() < deadline, "\n".join(f"{w.name}:\n{w.tail()}" for w in workers)
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_saves_one_step_everywhere_and_resumes_bitwise(tmp_path, uninterrupted):
    """SIGTERM to process 1 of 2: both save the same step, exit 0; the resumed job's losses are the
    uninterrupted job's bit for bit."""
    ck = tmp_path / "ck"
    workers, out, start = job(tmp_path, "preempted", 2, 4, ck, "--step-sleep", "0.3")
    _wait_for(workers, _both_at(3), start)
    os.kill(workers[1].popen.pid, signal.SIGTERM)
    run_workers(workers, start, HARD_TIMEOUT_S)  # both exit 0
    at = []
    for w in workers:
        said = [line for _, line in w.lines if "preempted at step" in line]
        assert len(said) == 1, w.tail()
        at.append(int(said[0].rsplit(" ", 1)[1]))
    assert at[0] == at[1] and 3 < at[0] < STEPS, at
    assert vj.checkpoint.Manager(ck).all_steps() == [at[0]]
    first = losses(out)
    assert max(first) == at[0]

    workers, out, start = job(tmp_path, "resumed", 2, 4, ck, "--resume")
    run_workers(workers, start, HARD_TIMEOUT_S)
    rest = losses(out)
    assert min(rest) == at[0] + 1
    merged = {**first, **rest}
    assert merged == uninterrupted  # bit for bit: float repr equality of every step's loss


@pytest.mark.slow
def test_killed_job_resumes_on_another_process_count(tmp_path, uninterrupted):
    """Both processes SIGKILLed after a checkpoint; the job restarts as 1 process × 8 devices from the newest
    complete checkpoint and its losses match the uninterrupted 2 × 4 run within 1e-5."""
    ck = tmp_path / "ck"
    workers, _, start = job(tmp_path, "killed", 2, 4, ck, "--save-every", "5", "--step-sleep", "0.3")

    def saved_and_on(workers) -> bool:
        return all(any(line == f"[p{i}] saved step 10" for _, line in w.lines) for i, w in enumerate(workers))

    _wait_for(workers, saved_and_on, start)
    _wait_for(workers, _both_at(12), start)
    for w in workers:
        w.popen.send_signal(signal.SIGKILL)
    for w in workers:
        w.popen.wait()
    newest = vj.checkpoint.Manager(ck).latest_step()
    assert newest is not None and newest >= 10

    workers, out, start = job(tmp_path, "one", 1, 8, ck, "--resume")
    run_workers(workers, start, HARD_TIMEOUT_S)
    assert any(f"resumed from step {newest} on 8 devices" in line for _, line in workers[0].lines)
    rest = losses(out)
    assert sorted(rest) == list(range(newest + 1, STEPS + 1))
    for step, loss in rest.items():
        assert abs(loss - uninterrupted[step]) <= 1e-5 * abs(uninterrupted[step]), (step, loss, uninterrupted[step])
