"""The context (sequence) axis of a ``vj.fsdp`` step: which tokens each device holds, and in what order.

Under context parallelism each sequence of the batch is cut over a ``context`` mesh axis of ``cp`` devices. With
causal load balancing (``balance="causal"``, the default) the sequence is cut into ``2 * cp`` equal chunks and
device ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``, so that under a causal mask every device attends to the
same number of (query, key) pairs; with ``balance=None`` device ``i`` holds the ``i``-th contiguous chunk.

``vj.fsdp`` announces the context of the step while it traces the model (:func:`over_context`); the model-facing
functions (``vj.attention``, ``vj.positions``, ``vj.batch_mean``) read it with :func:`enclosing_context` and fall
back to their unsharded meaning outside a step.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BALANCES", "Context", "enclosing_context", "local_positions", "over_context", "sequence_order"]

BALANCES = ("causal", None)
"""The load balancers: ``"causal"`` (head-tail chunks, the default) or ``None`` (contiguous chunks)."""


@dataclasses.dataclass(frozen=True)
class Context:
    """The context axis of the step being traced.

    Attributes:
      axis: the mesh axis the sequence dim is split over.
      size: its number of devices ``cp``.
      balance: ``"causal"`` or ``None`` (see the module docstring).
      kv: ``"keep"`` (each scanned layer's gathered keys and values kept from its forward for its backward) or
        ``"regather"`` (gathered again when the backward recomputes the layer); see
        :mod:`vescale_jax.step._context_kv`.
    """

    axis: str
    size: int
    balance: str | None = "causal"
    kv: str = "keep"

    def __post_init__(self) -> None:
        if self.balance not in BALANCES:
            raise ValueError(f"balance={self.balance!r}: use 'causal' (the default) or None (contiguous chunks).")
        if self.kv not in ("keep", "regather"):
            raise ValueError(
                f"context_kv={self.kv!r}: use 'keep' (the default: each layer's gathered K and V kept for its "
                "backward) or 'regather' (gathered again in backward: less memory, 1.5x the K/V traffic)."
            )
        if self.size < 1:
            raise ValueError(f"context axis {self.axis!r} of size {self.size}: needs at least one device.")

    @property
    def chunks(self) -> int:
        """Number of equal chunks the global sequence is cut into (``2 * cp`` balanced, ``cp`` not)."""
        return 2 * self.size if self.balance == "causal" else self.size

    def check_length(self, seq_len: int, what: str = "sequence") -> None:
        """Raises unless a global ``seq_len`` splits into :attr:`chunks` equal chunks."""
        if seq_len % self.chunks:
            how = f"2 x {self.size} (balance='causal')" if self.balance == "causal" else f"{self.size}"
            raise ValueError(
                f"vj.fsdp: {what} length {seq_len} does not split over context axis {self.axis!r} of size "
                f"{self.size}: it must be a multiple of {how}. Pad the sequences to a multiple of {self.chunks}"
                + (", or pass balance=None." if self.balance == "causal" else ".")
            )


def sequence_order(seq_len: int, ctx: Context) -> np.ndarray:
    """Global positions of the tokens in the order the devices hold them.

    Args:
      seq_len: the global sequence length (a multiple of ``ctx.chunks``).
      ctx: the context axis.

    Returns:
      An int array of shape ``(seq_len,)``: entries ``[i * L, (i + 1) * L)`` (``L = seq_len // ctx.size``) are the
      global positions device ``i`` of the context axis holds, in its local order. ``x[:, order]`` puts a batch in
      that order; ``y[:, np.argsort(order)]`` undoes it.

    Sharding:
      Splitting the reordered sequence dim evenly over ``ctx.axis`` gives each device its balanced chunks.
    """
    ctx.check_length(seq_len)
    c = seq_len // ctx.chunks
    if ctx.balance is None:
        return np.arange(seq_len)
    parts = []
    for i in range(ctx.size):
        j = 2 * ctx.size - 1 - i
        parts += [np.arange(i * c, (i + 1) * c), np.arange(j * c, (j + 1) * c)]
    return np.concatenate(parts)


def local_positions(local_len: int, ctx: Context) -> jax.Array:
    """Inside the step's ``shard_map``: the global positions of this device's ``local_len`` tokens (int32)."""
    i = jax.lax.axis_index(ctx.axis)
    if ctx.balance is None:
        return i * local_len + jnp.arange(local_len, dtype=jnp.int32)
    if local_len % 2:
        raise ValueError(f"local sequence length {local_len} is odd: balanced chunks need an even local length.")
    c = local_len // 2
    head = i * c + jnp.arange(c, dtype=jnp.int32)
    tail = (2 * ctx.size - 1 - i) * c + jnp.arange(c, dtype=jnp.int32)
    return jnp.concatenate([head, tail]).astype(jnp.int32)


_ENCLOSING: contextvars.ContextVar[Context | None] = contextvars.ContextVar("vescale_jax_context", default=None)


@contextlib.contextmanager
def over_context(ctx: Context | None) -> Iterator[None]:
    """Makes ``ctx`` the context axis the model-facing functions see while the model is traced."""
    token = _ENCLOSING.set(ctx)
    try:
        yield
    finally:
        _ENCLOSING.reset(token)


def enclosing_context() -> Context | None:
    """The context axis of the ``vj.fsdp`` step being traced, or ``None`` (outside one, or no context axis)."""
    return _ENCLOSING.get()
