"""What a survivor says when the coordinator of its multi-process job is gone.

When process 0 (the coordinator, which runs JAX's coordination service) dies, every other process loses the
service and JAX ends it with a fatal log line about RPCs and sockets ("Socket closed", "Connection reset by
peer") and ``abort()``. The line does not always say that the coordinator is what was lost. JAX 0.10's runtime
client takes a ``missed_heartbeat_callback``, but its binding cannot hand the status to Python (calling a Python
callback ends in ``std::bad_cast``), so the abort cannot be replaced from Python.

:func:`report_lost_coordinator` adds one line to it instead: a ``SIGABRT`` handler (installed with ``ctypes``,
chained to the previous one) that, when the process aborts, checks whether anything still accepts connections at
the coordinator's address and, if not, writes ``vj.distributed: process 1 of 2 is ending because the coordinator
(process 0, host:port) is gone ...`` to stderr. The abort then proceeds as before (exit status 134, ``-6`` for a
parent), so schedulers see the same failure. Nothing is written when the coordinator still answers (the abort
has another cause, which JAX's own message names).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from typing import Any

__all__ = ["coordinator_reachable", "lost_coordinator_message", "report_lost_coordinator"]

_HANDLER = ctypes.CFUNCTYPE(None, ctypes.c_int)
_INSTALLED: list[Any] = []  # the live ctypes callback (kept alive while installed) and the previous handler


def coordinator_reachable(address: str, *, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at ``address`` (``host:port``, ``[v6]:port``)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def lost_coordinator_message(*, address: str, process_id: int, num_processes: int) -> str:
    """The line a surviving process writes when the coordinator at ``address`` is gone."""
    return (
        f"vj.distributed: process {process_id} of {num_processes} is ending because the coordinator (process 0, "
        f"{address}) is gone: it died, was preempted or restarted, and nothing accepts connections at its address "
        "any more (JAX's fatal message above is the same event). Restart the whole job; it resumes from the newest "
        "checkpoint. Process 0's own log says why it ended."
    )


def report_lost_coordinator(address: str, *, process_id: int, num_processes: int) -> bool:
    """Installs the ``SIGABRT`` reporter for a process other than the coordinator (see the module docstring).

    Args:
      address: the coordinator's ``host:port``.
      process_id: this process's id (nothing is installed for process 0).
      num_processes: the job's process count.

    Returns:
      Whether the reporter is installed (False for process 0, or where ``ctypes`` cannot reach ``signal``).
    """
    if process_id == 0 or _INSTALLED:
        return bool(_INSTALLED)
    try:
        libc = ctypes.CDLL(None)
        set_handler = libc.signal
    except (OSError, AttributeError):
        return False
    set_handler.restype = ctypes.c_void_p
    set_handler.argtypes = [ctypes.c_int, ctypes.c_void_p]
    message = lost_coordinator_message(address=address, process_id=process_id, num_processes=num_processes)

    def on_abort(signum: int) -> None:
        if not coordinator_reachable(address, timeout_s=1.0):
            os.write(2, ("\n" + message + "\n").encode())
        previous = _INSTALLED[1] if len(_INSTALLED) > 1 else None
        if previous not in (None, 0, 1):  # SIG_DFL / SIG_IGN: abort() goes on with the default action
            _HANDLER(previous)(signum)

    callback = _HANDLER(on_abort)
    previous = set_handler(signal.SIGABRT, ctypes.cast(callback, ctypes.c_void_p))
    if previous == ctypes.c_void_p(-1).value:  # SIG_ERR
        return False
    _INSTALLED[:] = [callback, previous]
    return True
