"""Moving one tensor between placements inside ``shard_map``: ``vj.redistribute``.

The functions live in :mod:`vescale_jax.relayout`, the engine that moves ragged ranges between placements; this
module is their public namespace.
"""

from vescale_jax.relayout._redistribute import from_dim0, from_ragged, reshard, to_dim0, to_ragged

__all__ = ["from_dim0", "from_ragged", "reshard", "to_dim0", "to_ragged"]
