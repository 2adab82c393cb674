"""The step's options as one frozen object, :class:`StepPolicy`, and the one context variable that carries it.

``vj.fsdp`` builds one policy per compiled step (per plan) and ``vj.apply`` one per call (the enclosing step's,
refined by its own arguments); both pass it down explicitly: to the point-of-use gathers, into every
:class:`vescale_jax.LayerShard` (a reference, which ``vj.scan_layers`` reads), and to the wire through
:meth:`StepPolicy.wire`, the one place the wire's options (:class:`vescale_jax.step._wire.Gather`) are derived.

The context variable is only for functions the user calls *inside* a step, which must find the enclosing step's
policy without an argument: ``vj.apply`` and ``vj.accumulate`` (:func:`enclosing_policy`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

from vescale_jax.kernels import KernelPolicy
from vescale_jax.kernels._dispatch import DEFAULT_KERNELS
from vescale_jax.layout._plan import Plan
from vescale_jax.step._batch import _axes, data_sharding
from vescale_jax.step._context import Context
from vescale_jax.step._precision import MixedPrecision
from vescale_jax.step._wire import Gather

__all__ = ["StepPolicy", "enclosing_policy", "running"]


@dataclasses.dataclass(frozen=True)
class StepPolicy:
    """Everything a step is compiled for besides its plan (static: hashable, part of the compiled step).

    Attributes:
      data_axes: mesh axes the batch's dim 0 is split over.
      replica_axes: the data axes that are not the plan's axis (HSDP), and the context axis: shards are
        replicated over them and gradients summed over them after the reduce-scatter.
      context: the context axis the batch's sequence dim (dim 1) is split over (context parallelism), or ``None``.
      reshard_after_forward: drop gathered parameters after the forward and gather them again in backward.
      prefetch: in ``vj.scan_layers``, gather layer ``j + 1`` while layer ``j`` computes.
      precision: the :class:`vescale_jax.MixedPrecision` policy (gather / compute dtype, reduce dtype, FP8
        gather); ``None`` keeps each bucket's dtype.
      microbatches: the micro-batch count ``vj.accumulate`` expects (``None``: the step does not accumulate).
      kernels: the :class:`vescale_jax.kernels.KernelPolicy` for unpacking gathered buckets and packing gradients.
      wide_grads: low-precision buckets come as exact upcasts to their reduce dtype and get their gradient back
        in it, unrounded (set by ``vj.accumulate`` around each micro-batch; see
        :attr:`vescale_jax.step._wire.Gather.wide_grads`).
    """

    data_axes: tuple[str, ...]
    replica_axes: tuple[str, ...] = ()
    context: Context | None = None
    reshard_after_forward: bool = True
    prefetch: bool = False
    precision: MixedPrecision | None = None
    microbatches: int | None = None
    kernels: KernelPolicy = DEFAULT_KERNELS
    wide_grads: bool = False

    @classmethod
    def for_plan(
        cls,
        plan: Plan,
        *,
        data_axes: str | Sequence[str] | None = None,
        reshard_after_forward: bool = True,
        prefetch: bool = False,
        precision: MixedPrecision | None = None,
        microbatches: int | None = None,
        kernels: KernelPolicy = DEFAULT_KERNELS,
        wide_grads: bool = False,
        context: Context | None = None,
    ) -> StepPolicy:
        """The policy of a step over ``plan``: ``data_axes`` checked against its mesh (default: the plan's axis)
        and the replica axes derived from them (the context axis among them).

        Returns:
          The policy.
        """
        axes = _axes(plan.axis if data_axes is None else data_axes)
        data_sharding(plan, axes)  # checks the axes
        if context is not None and context.axis in axes:
            raise ValueError(
                f"vj.fsdp: context_axis={context.axis!r} is also a data axis {axes}: the batch's dim 0 is split "
                "over the data axes and its sequence dim over the context axis; name another mesh axis for each."
            )
        replicas = tuple(a for a in axes if a not in _axes(plan.axis))
        return cls(
            data_axes=axes,
            replica_axes=replicas + (() if context is None else (context.axis,)),
            context=context,
            reshard_after_forward=reshard_after_forward,
            prefetch=prefetch,
            precision=precision,
            microbatches=microbatches,
            kernels=kernels,
            wide_grads=wide_grads,
        )

    def refined(
        self,
        plan: Plan,
        *,
        data_axes: str | Sequence[str] | None = None,
        reshard_after_forward: bool | None = None,
        prefetch: bool | None = None,
        precision: MixedPrecision | None = None,
        kernels: KernelPolicy | None = None,
    ) -> StepPolicy:
        """This policy with the options that are not ``None`` replaced (``vj.apply``'s own arguments over the
        enclosing step's), its replica axes derived again for ``plan``.

        Returns:
          The refined policy (this one when nothing changes).
        """
        reshard = self.reshard_after_forward if reshard_after_forward is None else reshard_after_forward
        refined = StepPolicy.for_plan(
            plan,
            data_axes=self.data_axes if data_axes is None else data_axes,
            reshard_after_forward=reshard,
            prefetch=self.prefetch if prefetch is None else prefetch,
            precision=self.precision if precision is None else precision,
            microbatches=self.microbatches,
            kernels=self.kernels if kernels is None else kernels,
            wide_grads=self.wide_grads,
            context=self.context,
        )
        return self if refined == self else refined  # unchanged: the enclosing step's own policy object

    def wire(self) -> Gather:
        """What the wire needs: the gather / reduce dtypes (FP8 included), the replica axes and the kernels, with
        low-precision buckets gathered wide (see :meth:`vescale_jax.step._wire.Gather.widens`).

        Returns:
          The wire's options.
        """
        return Gather(self.precision, self.replica_axes, self.kernels, widen=True, wide_grads=self.wide_grads)


_ENCLOSING: contextvars.ContextVar[StepPolicy | None] = contextvars.ContextVar("vescale_jax_step", default=None)


def enclosing_policy() -> StepPolicy | None:
    """The policy of the ``vj.fsdp`` step being traced, or ``None`` outside one."""
    return _ENCLOSING.get()


@contextlib.contextmanager
def running(policy: StepPolicy) -> Iterator[None]:
    """Makes ``policy`` the enclosing step's policy while the step's function is traced."""
    token = _ENCLOSING.set(policy)
    try:
        yield
    finally:
        _ENCLOSING.reset(token)
