"""The step watchdog: a step that runs past its timeout prints every thread's stack, what the other processes are
doing, and ends the process, instead of hanging the job silently.

A daemon thread watches the step the training loop is in (:meth:`Watchdog.step`). A step's timeout is the user's
``timeout_s``, or ``max(floor_s, multiple x the median of the recent step times)``, or ``first_step_s`` while the
first (compiling) steps run. In a multi-process job a second daemon thread publishes this process's progress and a
heartbeat to JAX's coordination service (``vescale_jax/distributed/_progress.py``), so that a stuck process can say
which peers have not finished the step and whether they are alive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import io
import numbers
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from vescale_jax._compat import coordination_client, distributed_job
from vescale_jax.distributed._progress import Progress, Publisher, peer_report

__all__ = ["Watchdog", "step_timeout"]

_RECENT = 64  # the median is over this many most recent step times
_RPC_TIMEOUT_S = 10.0  # one call to the coordination service
_STOPPED_S = 5.0  # the monitor woke this much later than it asked: the process itself was stopped
_exit = os._exit  # replaced by tests that watch a healthy loop in-process


def step_timeout(
    durations: Sequence[float], *, timeout_s: float | None, multiple: float, floor_s: float, first_step_s: float
) -> tuple[float, str]:
    """The timeout of the next step, and the rule that gave it.

    Args:
      durations: the recent step times, the first (compiling) steps left out; empty while those run.
      timeout_s: the user's timeout, or None.
      multiple: times the median step time.
      floor_s: the least timeout the median rule gives.
      first_step_s: the timeout while ``durations`` is empty.

    Returns:
      ``(seconds, rule)``, the rule in words for the report.
    """
    if timeout_s is not None:
        return float(timeout_s), "timeout_s"
    if not durations:
        return float(first_step_s), "first_step_s, for the first (compiling) steps"
    median = statistics.median(durations)
    if multiple * median > floor_s:
        return multiple * median, f"{multiple:g} x the median step time {median:.3g} s"
    return float(floor_s), f"floor_s (above {multiple:g} x the median step time {median:.3g} s)"


def _check(name: str, value: Any, *, optional: bool = False, integer: bool = False, least: float = 0.0) -> None:
    fn = "vj.distributed.Watchdog"
    if value is None and optional:
        return
    kind = numbers.Integral if integer else numbers.Real
    if not isinstance(value, kind) or isinstance(value, bool):
        want = "an int" if integer else "a number" + (" of seconds" if name.endswith("_s") else "")
        raise TypeError(f"{fn}: {name} must be {want}{' (or None)' if optional else ''}, got {value!r}.")
    if not (value >= least if integer else value > least):
        example = {"exit_code": 75, "first_steps": 2, "multiple": 10, "timeout_s": 600}.get(name, 120)
        bound = f">= {least:g}" if integer else f"> {least:g}"
        raise ValueError(f"{fn}: {name}={value!r} must be {bound}; pass e.g. {name}={example}.")


@dataclasses.dataclass
class _Running:
    step: int
    start: float
    timeout_s: float
    rule: str
    stopped_s: float = 0.0  # time the whole process spent stopped (not counted)


class Watchdog:
    """Ends the process with a report when a training step runs past its timeout (a stuck peer never hangs a
    job silently).

    Use it around the training loop, and :meth:`step` around each step; the step must wait for its own results
    (``float(loss)``), or its time is only the time to dispatch it::

        with vj.distributed.Watchdog() as wd:
            for i in range(start, steps):
                with wd.step(i):
                    params, opt_state, metrics = train_step(params, opt_state, batch)
                    loss = float(metrics["loss"])

    A step past its timeout writes, to stderr (or ``stream``): which process and step, the time it has run and
    its timeout; the Python stack of every thread; in a multi-process job, which processes have and have not
    finished the step and whether those that have not are alive (then their own watchdogs print their stacks)
    or not responding (stopped, swapped out, hung in the OS), or that the coordinator (process 0) died or does
    not respond. Then the process exits with ``exit_code``. Time outside :meth:`step` is not watched (put
    evaluation or checkpointing inside a step, with its own ``timeout_s``, to watch it). Enter it after
    :func:`vj.distributed.initialize`: it reads the job (process index and count, the coordinator) on entering.

    JAX's own heartbeat (``heartbeat_timeout_s`` of :func:`vj.distributed.initialize`, 30 s by default) ends every
    process of the job when one stops answering at all (killed, stopped); a peer that is alive but stuck is not
    caught by it. To get this report rather than JAX's abort for a stopped peer, the step timeout must be below
    the heartbeat timeout.

    Args:
      timeout_s: seconds a step may run; None (default) derives it from the step times as below.
      multiple: without ``timeout_s``, a step may run ``multiple`` times the median of the recent step times ...
      floor_s: ... but at least ``floor_s`` seconds.
      first_step_s: without ``timeout_s``, the timeout of the first ``first_steps`` steps (compilation) and until
        one more step has finished.
      first_steps: how many first steps get ``first_step_s``; their times are left out of the median.
      heartbeat_s: how often the watchdog checks, and publishes this process's heartbeat.
      exit_code: the exit status of a process whose step timed out (non-zero).
      stream: where the report goes (default ``sys.stderr``).

    Raises:
      TypeError: an option has the wrong type (the message names it).
      ValueError: an option is out of range (the message names it and a value that works).
    """

    def __init__(
        self,
        timeout_s: float | None = None,
        *,
        multiple: float = 10.0,
        floor_s: float = 120.0,
        first_step_s: float = 900.0,
        first_steps: int = 2,
        heartbeat_s: float = 2.0,
        exit_code: int = 75,
        stream: TextIO | None = None,
    ) -> None:
        _check("timeout_s", timeout_s, optional=True)
        for name, value in (("multiple", multiple), ("floor_s", floor_s), ("first_step_s", first_step_s)):
            _check(name, value)
        _check("heartbeat_s", heartbeat_s)
        _check("first_steps", first_steps, integer=True)
        _check("exit_code", exit_code, integer=True, least=1)
        if exit_code > 255:
            raise ValueError(f"vj.distributed.Watchdog: exit_code={exit_code} must be 1..255; pass e.g. exit_code=75.")
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(f"vj.distributed.Watchdog: stream must be a text stream (or None), got {stream!r}.")
        self.timeout_s, self.multiple, self.floor_s, self.first_step_s = timeout_s, multiple, floor_s, first_step_s
        self.first_steps, self.heartbeat_s, self.exit_code, self.stream = first_steps, heartbeat_s, exit_code, stream
        self._cond = threading.Condition()
        self._durations: deque[float] = deque(maxlen=_RECENT)
        self._finished_count = 0
        self._finished: int | None = None
        self._running: _Running | None = None
        self._active = False
        self._threads: list[threading.Thread] = []
        self._changed = threading.Event()

    def __repr__(self) -> str:
        return (
            f"Watchdog(timeout_s={self.timeout_s}, multiple={self.multiple}, floor_s={self.floor_s}, "
            f"first_step_s={self.first_step_s}, first_steps={self.first_steps}, heartbeat_s={self.heartbeat_s}, "
            f"exit_code={self.exit_code})"
        )

    @property
    def step_timeout_s(self) -> float:
        """The timeout the next step gets (without a per-step ``timeout_s``)."""
        with self._cond:
            return self._timeout()[0]

    def _timeout(self) -> tuple[float, str]:
        return step_timeout(
            self._durations,
            timeout_s=self.timeout_s,
            multiple=self.multiple,
            floor_s=self.floor_s,
            first_step_s=self.first_step_s,
        )

    def __enter__(self) -> Watchdog:
        with self._cond:
            if self._active:
                raise RuntimeError("vj.distributed.Watchdog: already running; enter it once (`with wd:`).")
            self._active = True
        self._address, self._num_processes, self._process_id = distributed_job()
        self._client = coordination_client() if self._num_processes > 1 else None
        self._changed.clear()
        self._threads = [threading.Thread(target=self._monitor, name="vj-watchdog", daemon=True)]
        if self._client is not None:
            publisher = Publisher(self._client, self._process_id, _RPC_TIMEOUT_S)
            self._threads.append(
                threading.Thread(target=self._heartbeat, args=(publisher,), name="vj-watchdog-heartbeat", daemon=True)
            )
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._active = False
            self._running = None
            self._cond.notify_all()
        self._changed.set()
        for t in self._threads:
            t.join(self.heartbeat_s + _RPC_TIMEOUT_S)
        self._threads = []

    @contextlib.contextmanager
    def step(self, step: int, *, timeout_s: float | None = None) -> Iterator[None]:
        """Watches one step: it starts on entering, and is finished on leaving without an exception.

        Args:
          step: the step's index (the same on every process: the report compares them).
          timeout_s: this step's timeout, instead of the watchdog's rule (e.g. for a step that also saves a
            checkpoint).

        Raises:
          RuntimeError: outside ``with watchdog:``, or inside another step.
          TypeError, ValueError: ``step`` is not an int, or ``timeout_s`` is not a positive number.
        """
        if not isinstance(step, numbers.Integral) or isinstance(step, bool):
            raise TypeError(f"vj.distributed.Watchdog.step: step must be an int (the step's index), got {step!r}.")
        _check("timeout_s", timeout_s, optional=True)
        step = int(step)
        with self._cond:
            if not self._active:
                raise RuntimeError("vj.distributed.Watchdog.step: use it inside `with watchdog:` (start it first).")
            if self._running is not None:
                raise RuntimeError(
                    f"vj.distributed.Watchdog.step({step}): step {self._running.step} has not ended; steps do not nest."
                )
            seconds, rule = (float(timeout_s), "the step's timeout_s") if timeout_s is not None else self._timeout()
            self._running = _Running(step, time.monotonic(), seconds, rule)
            self._cond.notify_all()
        self._changed.set()
        ok = False
        try:
            yield
            ok = True
        finally:
            self._end(ok)

    def _end(self, ok: bool) -> None:
        with self._cond:
            running, self._running = self._running, None
            if running is not None and ok:
                self._finished = running.step
                self._finished_count += 1
                if self._finished_count > self.first_steps:
                    self._durations.append(time.monotonic() - running.start - running.stopped_s)
            self._cond.notify_all()
        self._changed.set()

    def _heartbeat(self, publisher: Publisher) -> None:
        beat = 0
        while True:
            with self._cond:
                active = self._active
                current = None if self._running is None else self._running.step
                progress = Progress(beat, self._finished, current)
            if not active:
                return
            publisher.publish(progress)
            beat += 1
            self._changed.wait(self.heartbeat_s)  # early after a step starts or ends
            self._changed.clear()
            time.sleep(min(self.heartbeat_s, 0.1))  # at most 10 writes a second

    def _monitor(self) -> None:
        asked, last = 0.0, time.monotonic()
        with self._cond:
            while self._active:
                now = time.monotonic()
                running = self._running
                late = now - last - asked
                if running is not None and late > max(_STOPPED_S, 2 * self.heartbeat_s):
                    running.stopped_s += late  # this whole process was stopped (SIGSTOP, suspend): not the step
                if running is not None and now - running.start - running.stopped_s >= running.timeout_s:
                    break
                asked = self.heartbeat_s
                if running is not None:
                    asked = min(asked, running.start + running.stopped_s + running.timeout_s - now)
                last = now
                self._cond.wait(max(asked, 0.0))
            else:
                return
        self._fire(running, time.monotonic() - running.start - running.stopped_s)

    def _fire(self, running: _Running, elapsed: float) -> None:
        out = self.stream if self.stream is not None else sys.stderr
        p, n = self._process_id, self._num_processes
        _write(
            out,
            f"\nvj.distributed.Watchdog: process {p} of {n} is stuck: step {running.step} has run {elapsed:.1f} s, "
            f"past its timeout of {running.timeout_s:.1f} s ({running.rule}). The stacks of all its threads follow"
            + (", then what the other processes are doing." if n > 1 else "."),
        )
        _dump_stacks(out)
        if self._client is not None:
            lines = peer_report(
                self._client,
                step=running.step,
                process_id=p,
                num_processes=n,
                address=self._address,
                window_s=3 * self.heartbeat_s + 1.0,
                timeout_s=_RPC_TIMEOUT_S,
            )
            _write(out, "\n".join(lines))
        elif n > 1:
            _write(out, "vj.distributed.Watchdog: no coordination service client: the other processes are unknown.")
        _write(
            out,
            f"vj.distributed.Watchdog: process {p} of {n} exits with status {self.exit_code} (step {running.step} "
            "timed out; see 'Step watchdog' in docs/multihost.md).",
        )
        for s in (out, sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                s.flush()
        _exit(self.exit_code)


def _write(out: TextIO, text: str) -> None:
    with contextlib.suppress(Exception):
        out.write(text + "\n")
        out.flush()


def _dump_stacks(out: TextIO) -> None:
    """Every thread's Python stack: faulthandler to the stream's file descriptor, else formatted in Python."""
    try:
        out.fileno()
        faulthandler.dump_traceback(file=out, all_threads=True)
        return
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        _write(out, f"Thread {ident:#x} ({names.get(ident, '?')}, most recent call last):\n{stack}")
