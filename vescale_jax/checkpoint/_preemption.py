"""Preemption notices turned into one step at which every process of a job saves.

Schedulers announce a preemption with ``SIGTERM`` and a grace period. In a multi-process job JAX's runtime catches
the signal (``jax.distributed.initialize`` starts its preemption notifier) and its coordination service agrees on
a step every process reaches after the notice: the largest step any process has started, plus one.
:func:`jax.experimental.multihost_utils.reached_preemption_sync_point` is true at that step on every process, so
they all save the same step. A single-process job has no coordination service; :class:`Preemption` catches
``SIGTERM`` itself (a Python handler, installed when it is created in the main thread) and answers true at the
first step boundary after it.

Either way the loop asks at every step, on every process, with the same step numbers, and starts every process
from the same step (a resumed job does).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils

__all__ = ["Preemption"]


class Preemption:
    """Answers, at each step boundary, whether this is the step to save before a preemption.

    Args:
      catch_sigterm: in a single-process job, catch ``SIGTERM`` from now on (when created in the main thread;
        :meth:`close` puts the previous handler back); False leaves the signal's handler as it is, so only a
        multi-process job's notice (JAX's) is seen.
    """

    def __init__(self, *, catch_sigterm: bool = True):
        self._notice = threading.Event()
        self._at: int | None = None
        self._previous: Any = None
        self._installed = False
        if (
            catch_sigterm
            and not jax.distributed.is_initialized()
            and threading.current_thread() is threading.main_thread()
        ):
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._notice.set()

    def reached(self, step: int) -> bool:
        """True at the step every process saves before it is preempted; call it at every step, on every process.

        Args:
          step: the step just finished (the same number on every process).

        Returns:
          Whether ``step`` is the preemption step: save it, wait for the save, and end the run.
        """
        if jax.distributed.is_initialized():
            return bool(multihost_utils.reached_preemption_sync_point(int(step)))
        if self._at is None and self._notice.is_set():
            self._at = int(step)
        return self._at == int(step)

    def close(self) -> None:
        """Puts back the ``SIGTERM`` handler this object replaced."""
        if self._installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False
