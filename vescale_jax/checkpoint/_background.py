"""Saves written in the background: one save at a time in a worker thread, errors surfaced at the next join.

:class:`vescale_jax.checkpoint.Manager` (``async_save=True``) converts the state to its logical layout on the
calling thread (the conversion is device programs with collectives, dispatched in program order from that one
thread), each bucket's converted leaves moved to pinned host memory (:func:`host_memory`) before the next bucket
converts, then hands those host arrays to :class:`Background`, whose thread writes them through Orbax while the
training loop runs its next steps. The thread touches only arrays no training step will donate: the
conversion's outputs (their host copies) and the copies :func:`detach` makes of any leaf stored as it is.

One save is in flight at a time, in order: a new save joins the previous one first, so every process runs its
Orbax saves one after another in the same order, and the host holds at most one save's converted arrays.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax

__all__ = ["Background", "BackgroundSaveError", "detach", "host_memory"]

HOST_MEMORY = "pinned_host"
"""Where a background save keeps what it writes: page-locked host memory (device -> host copies run at full
bandwidth; JAX's memory kind for host offload)."""


def host_memory(mesh: jax.sharding.Mesh) -> str | None:
    """:data:`HOST_MEMORY` where every device of ``mesh`` has it, else ``None`` (keep the arrays on the device)."""
    for d in mesh.devices.flat:
        try:
            kinds = {m.kind for m in d.addressable_memories()}
        except Exception:  # a backend without memory kinds
            return None
        if HOST_MEMORY not in kinds:
            return None
    return HOST_MEMORY


class BackgroundSaveError(RuntimeError):
    """A save that ran in the background failed; raised at the next ``wait()`` / ``save()`` / ``close()``."""

    def __init__(self, step: int, directory: str, error: BaseException):
        self.step = step
        super().__init__(
            f"vj.checkpoint: the background save of step {step} into {directory} failed: "
            f"{type(error).__name__}: {str(error).rstrip('.')}. Step {step} was not written "
            "(Manager.all_steps() lists the finished steps); fix the cause (disk space, permissions, the "
            "directory) and save again, or pass async_save=False to see the error where save() is called."
        )


class Background:
    """Runs one save at a time in a worker thread.

    Args:
      directory: the checkpoint directory (named in errors).
    """

    def __init__(self, directory: str):
        self._directory = directory
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._error: BaseException | None = None

    @property
    def step(self) -> int | None:
        """The step in flight (or finished and not yet joined), else ``None``."""
        return self._step

    def start(self, step: int, write: Callable[[], Any]) -> None:
        """Joins the previous save (raising its error), then runs ``write()`` in a new worker thread.

        Args:
          step: the step ``write`` saves (named in its error).
          write: the save; it must touch only arrays nothing will donate or delete while it runs.

        Raises:
          BackgroundSaveError: the previous save failed.
        """
        self.join()
        self._step = int(step)
        # Not a daemon: an interpreter that exits without Manager.wait() still finishes the write first.
        self._thread = threading.Thread(
            target=self._run, args=(write,), name=f"vj-checkpoint-save-{step}", daemon=False
        )
        self._thread.start()

    def _run(self, write: Callable[[], Any]) -> None:
        try:
            write()
        except BaseException as e:  # re-raised in the caller's thread at the next join
            self._error = e

    def join(self) -> None:
        """Waits for the save in flight; raises its error once.

        Raises:
          BackgroundSaveError: the save failed (its ``__cause__`` is the original error).
        """
        thread, step = self._thread, self._step
        if thread is None:
            return
        thread.join()
        self._thread, self._step = None, None
        error, self._error = self._error, None
        if error is not None:
            raise BackgroundSaveError(step, self._directory, error) from error


def _buffers(x: Any) -> set[tuple[int, int]]:
    """``(device id, buffer address)`` of each of ``x``'s addressable shards (empty where unavailable)."""
    try:
        return {(s.device.id, s.data.unsafe_buffer_pointer()) for s in x.addressable_shards}
    except Exception:  # a backend or memory kind without raw buffer pointers: compare by identity only
        return set()


def detach(tree: Any, keep: Iterable[Any]) -> Any:
    """``tree`` with every array that is, or shares a buffer with, an array of ``keep`` replaced by a copy.

    A leaf stored as it is (an optimizer's step count, a ``PerDevice`` value without a layout) is the training
    state's own array, which the next step may donate; its copy is enqueued before that step, so it holds the
    value at the save. A conversion whose program forwards its input unchanged returns an array sharing the
    state's buffer: copied too. Copies stay in the array's sharding and memory kind and are dispatched now;
    nothing waits for them.

    Args:
      tree: the tree a save hands to the background.
      keep: the arrays of the training state (``params.buffers`` and the optimizer state's leaves).

    Returns:
      ``tree`` with those leaves copied; every other leaf as it is.
    """
    state = [x for x in keep if isinstance(x, jax.Array)]
    ids = {id(x) for x in state}
    buffers = set().union(*(_buffers(x) for x in state)) if state else set()

    def copy(x: Any) -> Any:
        if isinstance(x, jax.Array) and (id(x) in ids or not buffers.isdisjoint(_buffers(x))):
            return jax.device_put(x, x.sharding, may_alias=False)
        return x

    return jax.tree.map(copy, tree)
