"""Static measurements of a compiled step: collective census, memory and cost (DESIGN.md §5).

All of them read what XLA reports for a ``jax.jit(...).lower(...).compile()`` object, so they are deterministic and
can be asserted in tests:

- :func:`census` parses the optimised HLO text (``compiled.as_text()``) and lists every all-gather, reduce-scatter,
  all-reduce, all-to-all and collective-permute with its result bytes, replica-group size, ring wire bytes per device
  and how many times it runs (the product of the known trip counts of the ``while`` loops around it); each op's
  ``replica_groups`` are parsed, and :func:`group_axes` names the mesh axes they span.
- :func:`memory` reads ``compiled.memory_analysis()`` and derives the per-device peak
  ``argument + output − alias + temp`` (on CPU ``peak_memory_in_bytes`` leaves temp out).
- :func:`peak_account` compiles with an XLA dump and lists the buffers live at the peak, summed by category
  (parameters, optimizer state, gathered parameters, gradients, loop state, ...) to exactly the peak of
  :func:`memory`, with the allocator's packing of temps as its own line.
- :func:`cost` reads ``compiled.cost_analysis()`` (flops, bytes accessed). XLA's cost analysis counts a ``while``
  body once, not trip-count times.

Ring wire bytes per device, with ``b`` the result bytes of one launch and ``g`` the replica-group size:
all-gather ``b(g−1)/g``, reduce-scatter ``b(g−1)``, all-reduce ``2b(g−1)/g``, all-to-all ``b(g−1)/g``,
collective-permute ``b``.
"""

from vescale_jax.testing._census import Census, CollectiveOp, census
from vescale_jax.testing._collectives import KINDS, parse_replica_group_size, parse_replica_groups, wire_bytes
from vescale_jax.testing._cost import cost
from vescale_jax.testing._groups import group_axes
from vescale_jax.testing._memory import Memory, memory
from vescale_jax.testing._peak import LiveBuffer, PeakAccount, default_category, peak_account
from vescale_jax.testing._shapes import shape_bytes

__all__ = [
    "KINDS",
    "Census",
    "CollectiveOp",
    "LiveBuffer",
    "Memory",
    "PeakAccount",
    "census",
    "cost",
    "default_category",
    "group_axes",
    "memory",
    "parse_replica_group_size",
    "parse_replica_groups",
    "peak_account",
    "shape_bytes",
    "wire_bytes",
]
