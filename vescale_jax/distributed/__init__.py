"""Multi-process jobs: ``vj.distributed.initialize`` and helpers for feeding each process its part of the batch.

A multi-process (multi-host) job runs the same program in every process. Each process plans the same tree the
same way (:meth:`Plan.fingerprint` is equal everywhere; :func:`assert_same_plan` checks it), initialises only the
shards its devices own (:func:`vj.init_sharded`) and feeds only its rows of the global batch
(:func:`local_batch_slice`, then :func:`vj.place_batch` assembles the global batch without a host copy)::

    import vescale_jax as vj
    from vescale_jax import distributed

    distributed.initialize()          # SLURM, Open MPI, Kubernetes, TPU...: detected; a no-op for one process
    mesh = jax.make_mesh((jax.device_count(),), ("fsdp",))
    ...
    rows = distributed.local_batch_slice(global_batch, vj.data_sharding(plan))
    params, opt_state, metrics = step(params, opt_state, {k: v[rows] for k, v in batch.items()})

For tests on one machine, pass everything explicitly (CPU devices, gloo collectives)::

    distributed.initialize(coordinator_address="127.0.0.1:12345", num_processes=2, process_id=i,
                           local_device_count=4)

A step that hangs (a stuck or stopped peer, a deadlock) is reported rather than waited on forever by
:class:`Watchdog`: every thread's stack, which processes have not finished the step and whether they are alive,
then the process exits non-zero.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from vescale_jax._compat import backends_are_initialized, cluster_types, distributed_job
from vescale_jax.distributed._lost import report_lost_coordinator
from vescale_jax.distributed._rendezvous import rendezvous
from vescale_jax.distributed._watchdog import Watchdog

__all__ = [
    "Watchdog",
    "assert_same_plan",
    "detect_cluster",
    "initialize",
    "is_initialized",
    "is_multiprocess",
    "local_batch_slice",
]

logger = logging.getLogger(__name__)

_XLA_DEVICE_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass(frozen=True)
class _Setup:
    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_count: int | None


_SETUP: _Setup | None = None


def _job() -> _Setup:
    """The job ``jax.distributed`` was initialised with (however it was called)."""
    return _Setup(*distributed_job(), None)


def detect_cluster() -> str | None:
    """The cluster environment ``jax.distributed.initialize()`` would bootstrap from, if any.

    Looks for ``JAX_COORDINATOR_ADDRESS`` and then asks JAX's cluster detectors (SLURM, Open MPI, Kubernetes /
    JobSet, Cloud TPU; opt-in ones such as ``mpi4py`` are skipped). Starts no backend.

    Returns:
      The detector's name (e.g. ``"SlurmCluster"``, ``"OmpiCluster"``, ``"K8sCluster"``), ``"env"`` when only
      ``JAX_COORDINATOR_ADDRESS`` is set, or ``None`` when no cluster is detected.
    """
    for env in cluster_types():  # empty if the private API moved: then JAX's own call detects
        if getattr(env, "opt_in_only_method", False):
            continue
        try:
            if env.is_env_present():
                return env.__name__
        except Exception as e:  # a detector that cannot tell (e.g. no metadata server) means "not this one"
            logger.debug("cluster detector %s failed: %s", env.__name__, e)
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return "env"
    return None


def _detected_process_count(name: str) -> int | None:
    try:
        env = next(e for e in cluster_types() if e.__name__ == name)
        return int(env.get_process_count())
    except Exception:
        return None


def _supported(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Drops keyword arguments this JAX version's ``jax.distributed.initialize`` does not take."""
    params = inspect.signature(jax.distributed.initialize).parameters
    return {k: v for k, v in kwargs.items() if k in params and v is not None}


def initialize(
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    cpu_collectives: str | None = "gloo",
    timeout_s: int = 45,
    heartbeat_timeout_s: int | None = 30,
    shutdown_timeout_s: int | None = None,
) -> bool:
    """Joins (or starts) a multi-process JAX job; call it first, before anything touches JAX devices.

    With no arguments, the cluster is auto-detected by ``jax.distributed.initialize()`` (SLURM ``srun``, Open
    MPI ``mpirun``, Kubernetes / JobSet, Cloud TPU, or ``JAX_COORDINATOR_ADDRESS`` plus a detector); when no
    cluster is detected, or the detected job has one process, this is a no-op and the job runs single-process.
    With explicit arguments (loopback tests, custom launchers), ``coordinator_address``, ``num_processes``
    and ``process_id`` are all required.

    Calling it again with the same (or no) arguments is a no-op; so is calling it after
    ``jax.distributed.initialize`` was called directly.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator (e.g. ``"127.0.0.1:12345"``); every
        process passes the same value.
      num_processes: number of processes in the job.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      local_device_count: CPU devices this process exposes (sets ``jax_num_cpu_devices``; CPU only, ignored
        by GPU/TPU backends). Do not combine with ``XLA_FLAGS=--xla_force_host_platform_device_count``.
      local_device_ids: GPU devices this process uses (e.g. ``[local_rank]`` for one process per GPU); by
        default all visible devices, or one per process under SLURM / Open MPI.
      cpu_collectives: cross-process collectives on CPU (``jax_cpu_collectives_implementation``): ``"gloo"``
        (default) or ``"mpi"``; ``None`` leaves JAX's setting alone.
      timeout_s: seconds to wait for all processes to connect to the coordinator before failing (default 45,
        so that a job with a missing process ends within a minute of its start, imports included).
        With an explicit ``coordinator_address`` every process first meets the others on that port (see
        :mod:`vescale_jax.rendezvous`), so a missing process is named in a Python error on every process that
        is waiting (process 0 names the missing ids; a process that cannot reach process 0 names the
        coordinator address), within ``timeout_s``.
      heartbeat_timeout_s: seconds without a heartbeat after which a peer is declared dead and every process
        of the job aborts, JAX reporting that another task died (default 30, JAX's own is 100; ``None`` keeps
        JAX's). A killed process or coordinator thus ends the job within about this time. When the coordinator
        (process 0) is gone, each survivor also writes one line saying so (``vj.distributed: process 1 of 2 is
        ending because the coordinator (process 0, host:port) is gone ...``) before JAX's abort ends it.
      shutdown_timeout_s: seconds a finishing process waits at exit for its peers (JAX's default: 300).

    Returns:
      True if this process is now part of a job of more than one process, False if it runs alone.

    Raises:
      ValueError: explicit arguments are incomplete or inconsistent, or differ from an earlier call.
      RuntimeError: JAX backends were already initialised (something called ``jax.devices()``, created an
        array or ran a computation) before a multi-process job could be joined.
    """
    global _SETUP
    _check_types(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_count=local_device_count,
        local_device_ids=local_device_ids,
        cpu_collectives=cpu_collectives,
        timeout_s=timeout_s,
        heartbeat_timeout_s=heartbeat_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
    )
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise ValueError(
            "vj.distributed.initialize: pass coordinator_address, num_processes and process_id together (got "
            f"coordinator_address={coordinator_address!r}, num_processes={num_processes!r}, "
            f"process_id={process_id!r}), or none of them to auto-detect the cluster."
        )
    if num_processes is not None and (num_processes < 1 or not 0 <= process_id < num_processes):
        raise ValueError(
            f"vj.distributed.initialize: need num_processes >= 1 and 0 <= process_id < num_processes, got "
            f"num_processes={num_processes}, process_id={process_id}."
        )
    if local_device_count is not None and local_device_count < 1:
        raise ValueError(f"vj.distributed.initialize: local_device_count must be >= 1, got {local_device_count}.")

    if _SETUP is not None or jax.distributed.is_initialized():
        return _check_repeat(coordinator_address, num_processes, process_id, local_device_count)

    cluster = None
    if coordinator_address is None:
        cluster = detect_cluster()
        if cluster is None or _detected_process_count(cluster) == 1:
            logger.info("vj.distributed.initialize: no multi-process cluster detected (%s); running alone.", cluster)
            _configure_cpu(local_device_count, cpu_collectives, multiprocess=False)
            _SETUP = _Setup(None, 1, 0, local_device_count)
            return False
    elif num_processes == 1:
        _configure_cpu(local_device_count, cpu_collectives, multiprocess=False)
        _SETUP = _Setup(None, 1, 0, local_device_count)
        return False

    if backends_are_initialized():
        where = f"the {cluster} cluster environment" if cluster else f"coordinator {coordinator_address}"
        raise RuntimeError(
            f"vj.distributed.initialize: cannot join the multi-process job ({where}): JAX backends are already "
            "initialised in this process. Call vj.distributed.initialize() at the very start of the program, "
            "before jax.devices(), jax.device_count(), creating arrays, jax.random.key(...) or running any "
            "computation (importing jax and vescale_jax is fine)."
        )
    _configure_cpu(local_device_count, cpu_collectives, multiprocess=True)
    if coordinator_address is not None:
        rendezvous(coordinator_address, num_processes, process_id, timeout_s=timeout_s)
    kwargs = _supported(
        {
            "coordinator_address": coordinator_address,
            "num_processes": num_processes,
            "process_id": process_id,
            "local_device_ids": list(local_device_ids) if local_device_ids is not None else None,
            "initialization_timeout": int(timeout_s),
            "heartbeat_timeout_seconds": heartbeat_timeout_s,
            "shutdown_timeout_seconds": shutdown_timeout_s,
        }
    )
    jax.distributed.initialize(**kwargs)
    _SETUP = dataclasses.replace(_job(), local_device_count=local_device_count)
    if _SETUP.coordinator_address and _SETUP.num_processes > 1:
        report_lost_coordinator(
            _SETUP.coordinator_address, process_id=_SETUP.process_id, num_processes=_SETUP.num_processes
        )
    logger.info(
        "vj.distributed.initialize: process %d of %d (coordinator %s)",
        _SETUP.process_id,
        _SETUP.num_processes,
        _SETUP.coordinator_address,
    )
    return _SETUP.num_processes > 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _fix(name: str, value: Any, want: str) -> str:
    """``name=<value as the right type>`` when ``value`` converts (e.g. the string "2"), else an example."""
    try:
        if want == "int" and float(str(value).strip()).is_integer():
            return f"{name}={int(float(str(value).strip()))}"
        if want == "number":
            return f"{name}={float(str(value).strip()):g}"
    except ValueError:
        pass
    return {"int": f"{name}=2", "number": f"{name}=30", "str": f'{name}="127.0.0.1:12345"'}.get(want, name)


def _check_types(**args: Any) -> None:
    """TypeError / ValueError naming the argument, what was given and the fix, for each argument of
    :func:`initialize` of the wrong type (before anything reaches JAX, which raises from C++ or a
    ``TypeError`` deep inside)."""
    fn = "vj.distributed.initialize"

    def bad(name: str, value: Any, want: str, example: str) -> TypeError:
        return TypeError(f"{fn}: {name} must be {want}, got {type(value).__name__} {value!r}; pass e.g. {example}.")

    address = args["coordinator_address"]
    if address is not None:
        if not isinstance(address, str):
            raise bad(
                "coordinator_address", address, 'a "host:port" string', _fix("coordinator_address", address, "str")
            )
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"{fn}: coordinator_address={address!r} is not host:port with a port in 1..65535; pass e.g. "
                '"127.0.0.1:12345" (every process passes the same address: process 0\'s host and a free port).'
            )
    for name in ("num_processes", "process_id", "local_device_count"):
        value = args[name]
        if value is not None and not _is_int(value):
            raise bad(name, value, "an int (or None)", _fix(name, value, "int"))
    ids = args["local_device_ids"]
    if ids is not None and (
        isinstance(ids, str | bytes) or not hasattr(ids, "__iter__") or not all(_is_int(i) for i in ids)
    ):
        raise bad("local_device_ids", ids, "a sequence of ints (or None)", "local_device_ids=[0] (this process's GPUs)")
    collectives = args["cpu_collectives"]
    if collectives is not None and collectives not in ("gloo", "mpi"):
        raise ValueError(
            f"{fn}: cpu_collectives={collectives!r}; pass 'gloo' (default), 'mpi', or None to leave JAX's setting."
        )
    for name, optional in (("timeout_s", False), ("heartbeat_timeout_s", True), ("shutdown_timeout_s", True)):
        value = args[name]
        if value is None and optional:
            continue
        if not isinstance(value, int | float | np.integer | np.floating) or isinstance(value, bool | np.bool_):
            raise bad(
                name, value, "a number of seconds" + (" (or None)" if optional else ""), _fix(name, value, "number")
            )
        if not value > 0:
            raise ValueError(f"{fn}: {name}={value!r} must be > 0 seconds; pass e.g. {name}=30.")


def _configure_cpu(local_device_count: int | None, cpu_collectives: str | None, *, multiprocess: bool) -> None:
    if local_device_count is not None:
        if backends_are_initialized():
            if jax.local_device_count() != local_device_count:
                raise RuntimeError(
                    f"vj.distributed.initialize: local_device_count={local_device_count} but JAX backends are "
                    f"already initialised with {jax.local_device_count()} local devices; call initialize first."
                )
            return
        if _XLA_DEVICE_FLAG in os.environ.get("XLA_FLAGS", ""):
            warnings.warn(
                f"vj.distributed.initialize: XLA_FLAGS contains {_XLA_DEVICE_FLAG} and local_device_count="
                f"{local_device_count} sets jax_num_cpu_devices; do not combine them (remove the XLA flag).",
                stacklevel=3,
            )
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    if multiprocess and cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)


def _check_repeat(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None, local_device_count: int | None
) -> bool:
    global _SETUP
    if _SETUP is None:  # jax.distributed.initialize was called directly
        _SETUP = _job()
    if coordinator_address is not None:
        single = num_processes == 1 and _SETUP.num_processes == 1
        if not single and (coordinator_address, num_processes, process_id) != (
            _SETUP.coordinator_address,
            _SETUP.num_processes,
            _SETUP.process_id,
        ):
            have = (
                f"process {_SETUP.process_id} of {_SETUP.num_processes} (coordinator {_SETUP.coordinator_address})"
                if _SETUP.num_processes > 1
                else "a single process"
            )
            raise ValueError(
                f"vj.distributed.initialize was already called and set this process up as {have}; cannot "
                f"re-initialise it as process {process_id} of {num_processes} (coordinator {coordinator_address})."
            )
    if local_device_count is not None:
        if _SETUP.local_device_count not in (None, local_device_count):
            raise ValueError(
                f"vj.distributed.initialize was already called with local_device_count="
                f"{_SETUP.local_device_count}; cannot change it to {local_device_count}."
            )
        _configure_cpu(local_device_count, None, multiprocess=False)
        _SETUP = dataclasses.replace(_SETUP, local_device_count=local_device_count)
    return _SETUP.num_processes > 1


def is_initialized() -> bool:
    """Whether this process has joined a multi-process job (``jax.distributed`` is initialised)."""
    return jax.distributed.is_initialized()


def is_multiprocess() -> bool:
    """Whether the job has more than one process. Starts no backend before :func:`initialize` was called.

    Returns:
      True when ``jax.distributed`` is initialised with more than one process.
    """
    if not jax.distributed.is_initialized():
        return False
    return _job().num_processes > 1


def local_batch_slice(global_batch_size: int, sharding: jax.sharding.Sharding | None = None) -> slice:
    """The rows of the global batch this process feeds (to :func:`vj.place_batch` or a ``vj.fsdp`` step).

    Without ``sharding``, process ``p`` of ``n`` gets rows ``[p*B/n, (p+1)*B/n)`` — what
    ``jax.make_array_from_process_local_data`` expects when the mesh lists each process's devices together
    (``jax.make_mesh`` does). With ``sharding`` (e.g. ``vj.data_sharding(plan)``), the rows are read off the
    sharding: those of the batch shards on this process's devices.

    Args:
      global_batch_size: the global batch size ``B`` (all processes together).
      sharding: optional; the batch's sharding over the global mesh.

    Returns:
      A ``slice`` of rows; ``global_batch[local_batch_slice(B)]`` is this process's part.

    Raises:
      ValueError: ``B`` is not divisible by the process count (or by the sharding's data-parallel size), or this
        process's rows under ``sharding`` are not one contiguous range.
    """
    b = int(global_batch_size)
    if sharding is not None:
        return _rows_of(sharding, b)
    n, p = jax.process_count(), jax.process_index()
    if b % n:
        raise ValueError(
            f"vj.distributed.local_batch_slice: global batch size {b} is not divisible by the process count {n}; "
            f"use a global batch that is a multiple of {n} (and of the data-parallel device count)."
        )
    return slice(p * b // n, (p + 1) * b // n)


def _rows_of(sharding: jax.sharding.Sharding, b: int) -> slice:
    try:
        index_map = sharding.addressable_devices_indices_map((b,))
    except ValueError as e:
        raise ValueError(
            f"vj.distributed.local_batch_slice: global batch size {b} does not split over the batch sharding "
            f"{sharding}: {e}"
        ) from e
    ranges = sorted({idx[0].indices(b)[:2] for idx in index_map.values()})
    start, stop = ranges[0][0], ranges[0][1]
    for lo, hi in ranges[1:]:
        if lo > stop:
            raise ValueError(
                f"vj.distributed.local_batch_slice: process {jax.process_index()}'s batch rows {ranges} under "
                f"{sharding} are not contiguous; order the mesh devices so each process's devices are adjacent "
                "along the data axes (jax.make_mesh does this)."
            )
        stop = max(stop, hi)
    return slice(start, stop)


def assert_same_plan(plan: Any) -> None:
    """Checks that every process of the job planned the same layout (equal :meth:`Plan.fingerprint`).

    A no-op in a single-process job. In a multi-process job, every process must call it (it is a collective).

    Args:
      plan: the :class:`vj.Plan`.

    Raises:
      AssertionError: some process planned differently (a different tree, config, mesh shape or library
        version); the message shows this process's fingerprint.
    """
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    fp = plan.fingerprint()
    multihost_utils.assert_equal(
        np.frombuffer(bytes.fromhex(fp), np.uint8),
        f"vj.distributed.assert_same_plan: the plan differs between processes (process {jax.process_index()} "
        f"has fingerprint {fp[:16]}…); every process must plan the same tree, config and mesh shape.",
    )
