"""Moving ragged ranges between two placements: the one-tensor moves of ``vj.redistribute``, flat buckets to and
from evenly sharded logical leaves (checkpoints), and many tensors between two per-device layouts (optimizer
state re-placed under another plan)."""

from vescale_jax.relayout._redistribute import from_dim0, from_ragged, reshard, to_dim0, to_ragged

__all__ = ["from_dim0", "from_ragged", "reshard", "to_dim0", "to_ragged"]
