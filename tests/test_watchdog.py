"""vj.distributed.Watchdog: a step past its timeout prints every thread's stack and what the other processes are
doing, then ends the process; a healthy loop never sees it.

In-process tests check the timeout rule, the options, a healthy loop and the peer report (against a fake
coordination service); a subprocess checks a stuck single-process step; three loopback jobs (2 processes x 4
CPU devices, tests/watchdog_worker.py) check a stopped peer, a stopped coordinator and a killed coordinator.
Deadlines are hang guards, and the clocks of the loopback tests start at the event (the stop, the kill), not at
launch.
"""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
from test_multihost import ROOT, Worker, _stop, child_env, free_port, launch

import vescale_jax as vj
from vescale_jax.distributed import _progress, _watchdog

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "watchdog_worker.py")
GUARD_S = 300  # a hang guard, not a speed limit: a quiet machine ends each case within ~15 s of its event


def test_watchdog_is_public():
    assert "Watchdog" in vj.distributed.__all__ and vj.distributed.Watchdog is _watchdog.Watchdog


# --- the timeout rule ----------------------------------------------------------------------------------------------


def test_timeout_rule():
    rule = dict(timeout_s=None, multiple=10.0, floor_s=120.0, first_step_s=900.0)
    assert _watchdog.step_timeout([], **rule)[0] == 900.0  # the first (compiling) steps
    assert _watchdog.step_timeout([0.5, 1.0, 30.0], **rule)[0] == 120.0  # 10 x median 1.0 is below the floor
    seconds, words = _watchdog.step_timeout([20.0, 1.0, 30.0, 25.0], **rule)
    assert seconds == pytest.approx(225.0) and "median" in words  # 10 x median 22.5: one slow step moves it little
    assert _watchdog.step_timeout([1.0, 2.0], **(rule | {"timeout_s": 7})) == (7.0, "timeout_s")


def test_first_steps_get_first_step_s_and_stay_out_of_the_median():
    wd = vj.distributed.Watchdog(multiple=1e6, floor_s=50.0, first_step_s=500.0, first_steps=2, heartbeat_s=0.05)
    seen = []
    with wd:
        for i in range(4):
            seen.append(wd.step_timeout_s)
            with wd.step(i):
                time.sleep(0.01)
    assert seen[:3] == [500.0, 500.0, 500.0], seen  # steps 0 and 1, then step 2 while no later step has finished
    assert seen[3] >= 1e6 * 0.01, seen  # 1e6 x the median of step 2's time
    assert len(wd._durations) == 2  # steps 2 and 3: the first two steps' times stay out of the median
    assert vj.distributed.Watchdog(5).step_timeout_s == 5.0  # the user's timeout


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"timeout_s": 0}, ValueError, r"timeout_s=0 must be > 0; pass e.g. timeout_s=600"),
        ({"timeout_s": "60"}, TypeError, r"timeout_s must be a number of seconds \(or None\), got '60'"),
        ({"multiple": -1}, ValueError, r"multiple=-1 must be > 0"),
        ({"floor_s": None}, TypeError, r"floor_s must be a number of seconds"),
        ({"first_step_s": 0.0}, ValueError, r"first_step_s=0.0 must be > 0"),
        ({"first_steps": 1.5}, TypeError, r"first_steps must be an int"),
        ({"first_steps": -1}, ValueError, r"first_steps=-1 must be >= 0"),
        ({"heartbeat_s": 0}, ValueError, r"heartbeat_s=0 must be > 0"),
        ({"exit_code": 0}, ValueError, r"exit_code=0 must be >= 1; pass e.g. exit_code=75"),
        ({"exit_code": 256}, ValueError, r"exit_code=256 must be 1..255"),
        ({"exit_code": True}, TypeError, r"exit_code must be an int"),
        ({"stream": "stderr"}, TypeError, r"stream must be a text stream"),
    ],
)
def test_options_are_checked(options, error, match):
    with pytest.raises(error, match=r"vj\.distributed\.Watchdog: " + match):
        vj.distributed.Watchdog(**options)


def test_steps_are_checked():
    wd = vj.distributed.Watchdog(heartbeat_s=0.05)
    with pytest.raises(RuntimeError, match=r"inside `with watchdog:`"), wd.step(0):
        pass
    with wd:
        with pytest.raises(TypeError, match=r"step must be an int"), wd.step("0"):
            pass
        with pytest.raises(ValueError, match=r"timeout_s=-1 must be > 0"), wd.step(0, timeout_s=-1):
            pass
        with wd.step(0), pytest.raises(RuntimeError, match=r"step 0 has not ended; steps do not nest"), wd.step(1):
            pass
        with pytest.raises(RuntimeError, match="already running"), wd:
            pass


# --- a healthy loop, a stuck step -----------------------------------------------------------------------------------


def test_healthy_loop_never_fires(monkeypatch):
    exits = []
    monkeypatch.setattr(_watchdog, "_exit", exits.append)
    out = io.StringIO()
    # Generous as the defaults are, relative to these steps: only a hang of 30 s would fire.
    wd = vj.distributed.Watchdog(multiple=10.0, floor_s=30.0, first_step_s=60.0, heartbeat_s=0.01, stream=out)
    with wd:
        for i in range(40):
            with wd.step(i):
                time.sleep(0.001 * (i % 7))  # uneven steps
            if i == 20:
                time.sleep(0.3)  # time between steps (evaluation, logging) is not watched
        with pytest.raises(KeyError), wd.step(40):  # a failing step ends the step, not the watchdog
            raise KeyError("boom")
    assert exits == [] and out.getvalue() == ""
    assert not [t for t in threading.enumerate() if t.name in ("vj-watchdog", "vj-watchdog-heartbeat")]  # ended


def test_time_the_process_spent_stopped_is_not_the_steps(monkeypatch):
    # The process's clock jumps 100 s during a step, as when the whole process was stopped (SIGSTOP / SIGCONT, a
    # suspended machine): the monitor wakes 100 s late and takes the gap off the step's time instead of firing.
    exits, jump, real = [], [0.0], time.monotonic
    monkeypatch.setattr(_watchdog, "_exit", exits.append)
    monkeypatch.setattr(_watchdog, "time", types.SimpleNamespace(monotonic=lambda: real() + jump[0], sleep=time.sleep))
    out = io.StringIO()
    with vj.distributed.Watchdog(timeout_s=30.0, heartbeat_s=0.01, stream=out) as wd, wd.step(0):
        time.sleep(0.05)
        jump[0] = 100.0
        time.sleep(0.2)  # the monitor wakes (every 0.01 s) and sees the gap
    assert exits == [] and out.getvalue() == ""


STUCK = """
import threading
import vescale_jax as vj

def stuck_in_a_deadlock_here():
    threading.Event().wait()

with vj.distributed.Watchdog(timeout_s=1.0, heartbeat_s=0.1) as wd:
    for i in range(5):
        with wd.step(i):
            if i == 3:
                stuck_in_a_deadlock_here()
"""


def test_stuck_step_prints_its_stack_and_exits():
    run = subprocess.run(
        [sys.executable, "-c", STUCK], cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=GUARD_S
    )
    err = run.stderr
    assert run.returncode == 75, (run.returncode, err[-3000:])
    assert "vj.distributed.Watchdog: process 0 of 1 is stuck: step 3 has run " in err, err[-3000:]
    assert "past its timeout of 1.0 s (timeout_s)" in err, err[-3000:]
    assert "(most recent call first)" in err and "in stuck_in_a_deadlock_here" in err, err[-3000:]  # the stacks
    assert "exits with status 75 (step 3 timed out" in err, err[-3000:]


# --- the peer report, against a fake coordination service ------------------------------------------------------------


class FakeStore:
    """A key-value store like the coordination service's; ``alive`` processes' beats advance at every read."""

    def __init__(self, values: dict[int, str], alive: set[int]):
        self.values, self.alive = dict(values), alive

    def key_value_dir_get(self, prefix):
        for pid in self.alive:
            p = _progress.Progress.decode(self.values[pid])
            self.values[pid] = _progress.Progress(p.beat + 1, p.finished, p.current).encode()
        return [(f"{prefix}{pid}", v) for pid, v in self.values.items()] + [(f"{prefix}junk", "x")]


def report(client, address="127.0.0.1:1", **kw):
    kw = {"step": 5, "process_id": 0, "num_processes": 5, "address": address, "window_s": 0.0, "timeout_s": 2.0} | kw
    return "\n".join(_progress.peer_report(client, **kw))


def test_peer_report_tells_finished_alive_and_stopped_peers():
    store = FakeStore({0: "9 4 5", 1: "7 5 6", 2: "3 4 5", 3: "8 4 5"}, alive={0, 1, 2})  # process 4: no key
    text = report(store)
    assert "the 5 processes on step 5" in text
    assert "process 0 (this one): has not finished step 5" in text
    assert "process 1: finished step 5; alive, now in step 6" in text
    assert (
        "process 2: has not finished step 5 (the last it reported finished: step 4); alive but stuck in step 5: "
        "its own watchdog prints its stacks" in text
    )
    assert (
        "process 3: has not finished step 5 (the last it reported finished: step 4); not responding: its "
        "heartbeat did not advance"
        in text
        and "stopped (SIGSTOP), swapped out or hung in the OS" in text
    )
    assert "process 4: has not reported its progress" in text


def test_peer_report_tells_a_stopped_coordinator_from_a_dead_one():
    class Hangs:
        def key_value_dir_get(self, prefix):
            time.sleep(5)  # longer than the report waits

    class Gone:
        def key_value_dir_get(self, prefix):
            raise RuntimeError("UNAVAILABLE: Connection reset by peer")

    with socket.socket() as server:  # something accepts connections: the coordinator is there but does not answer
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        text = report(Hangs(), address, process_id=1, num_processes=2, timeout_s=0.3)
        assert text == (
            f"vj.distributed.Watchdog: process 1 of 2 cannot read its peers' progress: process 0 (the coordinator, "
            f"{address}) does not respond: it accepts connections but its coordination service did not answer "
            "within 0.3 s (stopped (SIGSTOP), swapped out or hung in the OS)."
        )
    text = report(Gone(), address, process_id=1, num_processes=2)  # the port is closed now
    assert f"process 1 of 2 cannot read its peers' progress: the coordinator (process 0, {address}) died" in text


def test_progress_values_and_bounded_writes():
    p = _progress.Progress(3, None, 7)
    assert p.encode() == "3 - 7" and _progress.Progress.decode("3 - 7") == p
    assert _progress.Progress.decode("not progress") is None
    release = threading.Event()

    class Hangs:
        calls = 0

        def key_value_set(self, key, value, allow_overwrite=False):
            Hangs.calls += 1
            release.wait()

    publisher = _progress.Publisher(Hangs(), 2, timeout_s=0.2)
    assert publisher.publish(p) is False  # bounded: returns after 0.2 s
    assert publisher.publish(p) is False and Hangs.calls == 1  # no second write while the first still hangs
    release.set()
    hang = threading.Event()
    with pytest.raises(TimeoutError, match=r"no answer within 0\.1 s"):
        _progress.call_within(hang.wait, timeout_s=0.1)
    hang.set()


# --- loopback jobs: 2 processes x 4 CPU devices --------------------------------------------------------------------


def start_job(floor_s: float, jax_heartbeat_s: int) -> list[Worker]:
    port, start = free_port(), time.monotonic()
    args = [str(port), str(floor_s), str(jax_heartbeat_s)]
    return [launch(f"process {i}", [str(i), *args], start, worker=WORKER) for i in range(2)]


def wait_for_step(workers: list[Worker], step: int) -> None:
    """Waits (a hang guard of GUARD_S) until every worker has printed ``step``: both are past the compiling steps."""
    deadline = time.monotonic() + GUARD_S
    while not all(any(line.endswith(f"] step {step}") for _, line in w.lines) for w in workers):
        for w in workers:
            assert w.popen.poll() is None, f"{w.name} exited early ({w.popen.returncode}):\n{w.tail()}"
        assert time.monotonic() < deadline, "\n".join(f"{w.name}:\n{w.tail()}" for w in workers)
        time.sleep(0.05)


def wait_exit(worker: Worker) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        rc = worker.popen.wait(timeout=GUARD_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{worker.name} did not end within {GUARD_S} s of the event:\n{worker.tail(40)}")
    worker.reader.join(timeout=60)
    return rc, "\n".join(line for _, line in worker.lines), time.monotonic() - t0


@pytest.mark.parametrize("stopped", [1, 0], ids=["peer", "coordinator"])
def test_stopped_process_is_reported(stopped):
    # JAX's heartbeat (120 s) is far above the watchdog's timeout (floor_s=10 s): the watchdog reports first.
    workers = start_job(floor_s=10.0, jax_heartbeat_s=120)
    survivor = 1 - stopped
    try:
        wait_for_step(workers, 3)
        os.kill(workers[stopped].popen.pid, signal.SIGSTOP)
        rc, out, seconds = wait_exit(workers[survivor])
    finally:
        if workers[stopped].popen.poll() is None:
            os.kill(workers[stopped].popen.pid, signal.SIGCONT)
        _stop(workers)
    assert rc == 75, (rc, out[-3000:])
    assert f"vj.distributed.Watchdog: process {survivor} of 2 is stuck: step " in out, out[-3000:]
    assert "past its timeout of 10.0 s (floor_s" in out, out[-3000:]  # the median rule, not the first steps'
    assert "watchdog_worker.py" in out  # the survivor's stacks: its main thread waits on the step's result
    if stopped == 1:  # process 0 reads the store it serves itself: process 1's heartbeat stood still
        assert "process 1: has not finished step" in out and "not responding: its heartbeat did not advance" in out
        assert "stopped (SIGSTOP)" in out, out[-3000:]
    else:  # the store is on the stopped process 0: it accepts connections but does not answer
        address = f"127.0.0.1:{workers[0].popen.args[3]}"
        assert f"process 0 (the coordinator, {address}) does not respond" in out, out[-3000:]
    print(f"process {survivor} reported the stopped process {stopped} and exited {seconds:.1f} s after the stop")


def test_killed_coordinator_is_reported():
    workers = start_job(floor_s=10.0, jax_heartbeat_s=30)
    try:
        wait_for_step(workers, 3)
        workers[0].popen.kill()
        rc, out, seconds = wait_exit(workers[1])
    finally:
        _stop(workers)
    address = f"the coordinator (process 0, 127.0.0.1:{workers[0].popen.args[3]})"
    assert rc != 0, (rc, out[-3000:])
    # JAX's abort with the SIGABRT reporter's line, or the watchdog's report: both name the dead coordinator.
    assert f"process 1 of 2 is ending because {address} is gone: it died" in out or f"{address} died" in out, out
    print(f"process 1 ended {seconds:.1f} s after the coordinator was killed")
