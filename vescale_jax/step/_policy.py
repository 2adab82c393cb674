"""The step's options as one frozen object, and the one context variable that carries it through a step.

``vj.fsdp`` builds one policy per compiled step; ``vj.apply`` and ``vj.accumulate`` called inside it read it with
:func:`current`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

from vescale_jax.kernels import KernelPolicy
from vescale_jax.kernels._dispatch import DEFAULT_KERNELS
from vescale_jax.step._precision import MixedPrecision

__all__: list[str] = []


@dataclasses.dataclass(frozen=True)
class _Options:
    data_axes: tuple[str, ...]
    reshard_after_forward: bool
    prefetch: bool
    precision: MixedPrecision | None = None
    replica_axes: tuple[str, ...] = ()
    microbatches: int | None = None
    kernels: KernelPolicy = DEFAULT_KERNELS


_OPTIONS: contextvars.ContextVar[_Options | None] = contextvars.ContextVar("vescale_jax_fsdp", default=None)


@contextlib.contextmanager
def _options(opts: _Options):
    token = _OPTIONS.set(opts)
    try:
        yield
    finally:
        _OPTIONS.reset(token)
