"""Sharded state at rest: the pytrees that hold parameters and optimizer state as flat per-bucket shards.

- :class:`ShardedParams`: one flat buffer per bucket, evenly sharded over the plan's axis, the plan as static
  aux data; :class:`PerDevice`: optimizer state whose rows mean something only per device, with a layout.
- :func:`shard` / :func:`unshard` / :func:`init_sharded`: logical tree <-> shards, bit-exact; initialise straight
  into shards.
- The padding invariant (:func:`zero_padding`, :func:`global_norm`, :func:`tree_map`, :func:`apply_updates`).
- :func:`init_opt_state`: optimizer state placed by type, never by shape.
- :class:`Offload`, :class:`Offloaded`, :func:`offload` / :func:`onload`: optimizer state in host memory.
"""

from vescale_jax.state._containers import GatheredParams, PerDevice, ShardedParams
from vescale_jax.state._guards import PerLeafOnBucketsError
from vescale_jax.state._offloaded import Offload, Offloaded, offload, onload
from vescale_jax.state._padding import apply_updates, global_norm, tree_map, zero_padding
from vescale_jax.state._placement import init_opt_state
from vescale_jax.state._sharded import init_sharded, shard, unshard

__all__ = [
    "GatheredParams",
    "Offload",
    "Offloaded",
    "PerDevice",
    "PerLeafOnBucketsError",
    "ShardedParams",
    "apply_updates",
    "global_norm",
    "init_opt_state",
    "init_sharded",
    "offload",
    "onload",
    "shard",
    "tree_map",
    "unshard",
    "zero_padding",
]
