"""Each process's step progress in JAX's coordination service, and what a stuck process can tell about its peers.

Every process that runs a :class:`vj.distributed.Watchdog` keeps one key in the key-value store of JAX's
coordination service (which process 0 serves), ``vj_watchdog/<process id>``, with the value
``"<beat> <finished> <current>"``: a heartbeat counter that its watchdog's own thread advances every
``heartbeat_s`` seconds, the last step it finished and the step it is in (``-`` for none). The counter is not
JAX's heartbeat: it says that the process itself still runs Python, whatever its main thread waits on.

When a step of one process runs past its timeout, :func:`peer_report` reads every process's key twice, a short
window apart: a peer that has not finished the step and whose counter advanced is alive but stuck (its own
watchdog prints its stacks); one whose counter stood still is not responding (stopped with ``SIGSTOP``, swapped
out, or hung in the OS). Every call to the store runs in a helper thread with a time limit
(:func:`call_within`): while process 0 is stopped its RPCs never return, and once it is gone they fail. Either
way the report then says what happened to the coordinator.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from vescale_jax.distributed._lost import coordinator_reachable

__all__ = ["PREFIX", "Progress", "Publisher", "call_within", "coordinator_trouble", "peer_report", "read_progress"]

PREFIX = "vj_watchdog/"


@dataclasses.dataclass(frozen=True)
class Progress:
    """One process's published progress.

    Attributes:
      beat: the heartbeat counter (advances every ``heartbeat_s`` while the process runs).
      finished: the last step it finished, or None.
      current: the step it is in, or None between steps.
    """

    beat: int
    finished: int | None
    current: int | None

    def encode(self) -> str:
        """The stored value, ``"<beat> <finished> <current>"`` with ``-`` for None."""
        return " ".join("-" if v is None else str(v) for v in (self.beat, self.finished, self.current))

    @staticmethod
    def decode(value: str) -> Progress | None:
        """The progress stored as ``value``, or None when it is not one (a key some other program wrote)."""
        try:
            beat, finished, current = (None if v == "-" else int(v) for v in value.split())
        except ValueError:
            return None
        return Progress(int(beat or 0), finished, current)


def call_within(fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
    """Runs ``fn(*args)`` in a daemon thread and waits at most ``timeout_s`` for it.

    Args:
      fn: the call (an RPC to the coordination service).
      *args: its arguments.
      timeout_s: seconds to wait.

    Returns:
      What ``fn`` returned.

    Raises:
      TimeoutError: it has not returned within ``timeout_s`` (the thread is left behind, blocked).
      Exception: whatever ``fn`` raised.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="vj-watchdog-rpc", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Publisher:
    """Writes one process's :class:`Progress` to the store, each write bounded in time, one write at a time.

    Args:
      client: the coordination service client (``vescale_jax._compat.coordination_client()``).
      process_id: this process's id (its key is ``vj_watchdog/<process_id>``).
      timeout_s: seconds to wait for one write.
    """

    def __init__(self, client: Any, process_id: int, timeout_s: float) -> None:
        self._client = client
        self._key = f"{PREFIX}{process_id}"
        self._timeout_s = timeout_s
        self._pending: threading.Thread | None = None

    def publish(self, progress: Progress) -> bool:
        """Writes ``progress``; skipped while an earlier write still hangs (so that threads do not pile up).

        Returns:
          Whether the write completed in time.
        """
        if self._pending is not None and self._pending.is_alive():
            return False
        done = threading.Event()

        def write() -> None:
            try:
                self._client.key_value_set(self._key, progress.encode(), allow_overwrite=True)
                done.set()
            except Exception:  # the coordinator is gone: the report says so when a step is stuck
                pass

        self._pending = threading.Thread(target=write, name="vj-watchdog-publish", daemon=True)
        self._pending.start()
        self._pending.join(self._timeout_s)
        return done.is_set()


def read_progress(client: Any, *, timeout_s: float) -> dict[int, Progress]:
    """Every process's published progress, by process id.

    Args:
      client: the coordination service client.
      timeout_s: seconds to wait for the store.

    Returns:
      ``{process id: Progress}`` for each process that has published one.

    Raises:
      TimeoutError: the store did not answer within ``timeout_s``.
      Exception: the store's error (the coordinator is gone).
    """
    out = {}
    for key, value in call_within(client.key_value_dir_get, PREFIX, timeout_s=timeout_s):
        pid, progress = key.rpartition("/")[2], Progress.decode(value)
        if pid.isdigit() and progress is not None:
            out[int(pid)] = progress
    return out


def coordinator_trouble(address: str | None, *, process_id: int, num_processes: int, timeout_s: float) -> str:
    """What a process that cannot read the store says about the coordinator (process 0) at ``address``."""
    who = f"vj.distributed.Watchdog: process {process_id} of {num_processes} cannot read its peers' progress"
    if address and not coordinator_reachable(address, timeout_s=min(timeout_s, 5.0)):
        return (
            f"{who}: the coordinator (process 0, {address}) died: it was killed, preempted or restarted, and nothing "
            "accepts connections at its address any more. Restart the whole job; it resumes from the newest "
            "checkpoint. Process 0's own log says why it ended."
        )
    return (
        f"{who}: process 0 (the coordinator, {address}) does not respond: it accepts connections but its "
        f"coordination service did not answer within {timeout_s:g} s (stopped (SIGSTOP), swapped out or hung in "
        "the OS)."
    )


def _describe(pid: int, step: int, before: Progress | None, after: Progress | None, window_s: float) -> str:
    if after is None:
        return (
            f"process {pid}: has not reported its progress (it runs no vj.distributed.Watchdog, or has not "
            "started one yet)"
        )
    last = "none yet" if after.finished is None else f"step {after.finished}"
    done = after.finished is not None and after.finished >= step
    alive = before is not None and after.beat > before.beat
    state = f"finished step {step}" if done else f"has not finished step {step} (the last it reported finished: {last})"
    if not alive:
        return (
            f"process {pid}: {state}; not responding: its heartbeat did not advance in {window_s:.1f} s: "
            "stopped (SIGSTOP), swapped out or hung in the OS"
        )
    if done:
        where = f"now in step {after.current}" if after.current is not None else "now between steps"
        return f"process {pid}: {state}; alive, {where} (waiting for the processes that have not finished it)"
    if after.current is None:
        return f"process {pid}: {state}; alive, between steps (outside any watched step)"
    return f"process {pid}: {state}; alive but stuck in step {after.current}: its own watchdog prints its stacks"


def peer_report(
    client: Any,
    *,
    step: int,
    process_id: int,
    num_processes: int,
    address: str | None,
    window_s: float,
    timeout_s: float,
) -> list[str]:
    """Which processes have and have not finished ``step``, and whether those that have not are alive.

    Args:
      client: the coordination service client.
      step: the step this process is stuck in.
      process_id: this process's id.
      num_processes: the job's process count.
      address: the coordinator's ``host:port`` (to tell a dead coordinator from a stopped one).
      window_s: seconds between the two reads; a heartbeat that advanced in between is alive.
      timeout_s: seconds to wait for each read of the store.

    Returns:
      The report's lines. When the store does not answer, one line about the coordinator instead.
    """
    try:
        before = read_progress(client, timeout_s=timeout_s)
        time.sleep(window_s)
        after = read_progress(client, timeout_s=timeout_s)
    except Exception:  # TimeoutError (stopped) or the client's error (gone): the coordinator tells which
        return [coordinator_trouble(address, process_id=process_id, num_processes=num_processes, timeout_s=timeout_s)]
    lines = [f"vj.distributed.Watchdog: the {num_processes} processes on step {step} (from the coordination service):"]
    for pid in range(num_processes):
        if pid == process_id:
            lines.append(f"  process {pid} (this one): has not finished step {step} (its stacks are above)")
        else:
            lines.append("  " + _describe(pid, step, before.get(pid), after.get(pid), window_s))
    return lines
