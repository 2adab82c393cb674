"""A rendezvous of every process of a job on the coordinator's port, before ``jax.distributed.initialize``.

When a process of a job is missing, ``jax.distributed.initialize`` waits for its whole timeout and then kills
the waiting processes from C++ with "another task died", naming no one. :func:`rendezvous` runs first, over a
plain TCP socket on the coordinator address: process 0 listens there and every other process says hello with
its id; once all are present process 0 says go, closes the socket, and JAX's coordinator binds the port. On a
timeout each process raises a Python error that names the missing process ids (process 0 knows them and tells
the processes that did connect) or, for a process that never reached process 0, the coordinator address.
"""

from __future__ import annotations

import socket
import time

__all__ = ["rendezvous"]

_MAGIC = "vj-rendezvous"


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"vj.distributed.initialize: coordinator_address must be 'host:port', got {address!r}.")
    return host.strip("[]") or "127.0.0.1", int(port)


def _send(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall((line + "\n").encode())
    except OSError:
        pass


def _read_line(conn: socket.socket, deadline: float) -> str | None:
    """One line from ``conn`` before ``deadline`` (None: closed, or nothing in time)."""
    data = b""
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(min(left, 1.0))
        try:
            chunk = conn.recv(256)
        except TimeoutError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace").strip()


def rendezvous(address: str, num_processes: int, process_id: int, *, timeout_s: float) -> None:
    """Waits until all ``num_processes`` processes have reached the coordinator address, or raises.

    Args:
      address: ``host:port`` of the coordinator (process 0 listens on its port).
      num_processes: processes in the job.
      process_id: this process's id.
      timeout_s: seconds to wait for every process.

    Raises:
      TimeoutError: not every process arrived in time; the message names the missing process ids (or, on a
        process that never reached process 0, the coordinator address).
      ValueError: the processes disagree on ``num_processes``, or two claim the same id.
      OSError: process 0 cannot listen on the coordinator's port (e.g. it is in use).
    """
    if num_processes <= 1:
        return
    host, port = _split(address)
    deadline = time.monotonic() + timeout_s
    if process_id == 0:
        _serve(address, port, num_processes, deadline, timeout_s)
    else:
        _join(address, host, port, num_processes, process_id, deadline, timeout_s)


def _serve(address: str, port: int, n: int, deadline: float, timeout_s: float) -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind(("", port))
    except OSError as e:
        server.close()
        raise OSError(
            f"vj.distributed.initialize: process 0 cannot listen on the coordinator port {port} ({address}): {e}. "
            "Pick a free port for coordinator_address (the same in every process)."
        ) from e
    server.listen(max(n, 8))
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < n - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i in range(1, n) if i not in peers]
                for conn in peers.values():
                    _send(conn, "missing " + ",".join(map(str, missing)))
                raise TimeoutError(
                    f"vj.distributed.initialize: process(es) {missing} of {n} did not reach the coordinator "
                    f"{address} within {timeout_s:g} s (present: process 0 and {sorted(peers) or 'no other'}). "
                    "Start every process with the same coordinator_address and num_processes, each with its own "
                    "process_id; raise timeout_s if they start slowly."
                )
            server.settimeout(min(left, 1.0))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            hello = _read_line(conn, min(deadline, time.monotonic() + 5.0))
            parts = (hello or "").split()
            if len(parts) != 3 or parts[0] != _MAGIC or not parts[1].isdigit() or not parts[2].isdigit():
                conn.close()  # not a vj process (a port scan, or a plain jax.distributed client): ignore it
                continue
            their_n, pid = int(parts[1]), int(parts[2])
            problem = None
            if their_n != n:
                problem = f"process {pid} says num_processes={their_n}, process 0 says {n}"
            elif not 0 < pid < n:
                problem = f"process_id {pid} is outside 1..{n - 1}"
            elif pid in peers:
                problem = f"two processes claim process_id {pid}"
            if problem:
                _send(conn, "error " + problem)
                conn.close()
                raise ValueError(
                    f"vj.distributed.initialize: {problem} (coordinator {address}); give every "
                    "process the same num_processes and a distinct process_id."
                )
            peers[pid] = conn
        for conn in peers.values():
            _send(conn, "go")
        # Let the peers close first (their side keeps TIME_WAIT), so JAX's coordinator binds the port at once.
        for conn in peers.values():
            _read_line(conn, time.monotonic() + 2.0)
    finally:
        for conn in peers.values():
            conn.close()
        server.close()


def _join(address: str, host: str, port: int, n: int, pid: int, deadline: float, timeout_s: float) -> None:
    reached = lost = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            if lost:
                raise TimeoutError(
                    f"vj.distributed.initialize: process {pid} of {n} reached the coordinator {address}, which then "
                    f"closed the connection before the job started and was not back within {timeout_s:g} s: was "
                    "process 0 killed?"
                )
            if reached:
                raise TimeoutError(
                    f"vj.distributed.initialize: process {pid} of {n} reached the coordinator {address} but the "
                    f"job did not start within {timeout_s:g} s."
                )
            raise TimeoutError(
                f"vj.distributed.initialize: process {pid} of {n} could not reach the coordinator (process 0) at "
                f"{address} within {timeout_s:g} s. Is process 0 running, with this coordinator_address, and is "
                "the address reachable from here?"
            )
        try:
            conn = socket.create_connection((host, port), timeout=min(left, 2.0))
        except OSError:
            time.sleep(min(0.2, max(left, 0)))
            continue
        reached = True
        with conn:
            _send(conn, f"{_MAGIC} {n} {pid}")
            reply = _read_line(conn, deadline)
        if reply == "go":
            return
        if reply is None:
            if time.monotonic() >= deadline:
                continue  # the timeout message above
            # Closed without a word: process 0 died, or we reached something else: retry until the deadline.
            lost = True
            time.sleep(0.2)
            continue
        if reply.startswith("missing "):
            raise TimeoutError(
                f"vj.distributed.initialize: process(es) [{reply[8:]}] of {n} did not reach the coordinator "
                f"{address} within {timeout_s:g} s (reported by process 0 to process {pid})."
            )
        raise ValueError(f"vj.distributed.initialize: the coordinator {address} refused process {pid}: {reply[6:]}.")
