"""vescale_jax: RaggedShard FSDP for JAX.

Public names (DESIGN.md §3): ``plan_bucket``, ``plan``, ``element``/``rows``/``whole``, ``RaggedShard``,
``shard``/``unshard``, ``ShardedParams``; the runtime ``fsdp``, ``apply``, ``scan_layers``, ``init_opt_state``,
the Flax adapters in ``vj.flax`` and Orbax checkpoints in ``vj.checkpoint``.
"""

from vescale_jax import checkpoint, distributed, flax, kernels, optim, padding, redistribute, unpacking
from vescale_jax.accumulate import accumulate
from vescale_jax.buffer import GatheredParams, ShardedParams, init_sharded, pack, shard, unpack, unshard
from vescale_jax.fsdp import apply, data_sharding, fsdp, init_opt_state, place_batch
from vescale_jax.granularity import Granularity, element, rows, whole
from vescale_jax.layers import LayerShard, scan_layers
from vescale_jax.layout import RaggedShard
from vescale_jax.padding import apply_updates, global_norm, tree_map, zero_padding
from vescale_jax.plan import Bucket, LeafSpec, Plan, plan
from vescale_jax.plan import path_str as plan_path
from vescale_jax.planner import BucketLayout, plan_bucket
from vescale_jax.precision import MixedPrecision

__all__ = [
    "Bucket",
    "BucketLayout",
    "GatheredParams",
    "Granularity",
    "LayerShard",
    "LeafSpec",
    "MixedPrecision",
    "Plan",
    "RaggedShard",
    "ShardedParams",
    "accumulate",
    "apply",
    "apply_updates",
    "checkpoint",
    "data_sharding",
    "distributed",
    "element",
    "flax",
    "fsdp",
    "global_norm",
    "init_opt_state",
    "init_sharded",
    "kernels",
    "optim",
    "pack",
    "padding",
    "place_batch",
    "plan",
    "plan_bucket",
    "plan_path",
    "redistribute",
    "rows",
    "scan_layers",
    "shard",
    "tree_map",
    "unpack",
    "unpacking",
    "unshard",
    "whole",
    "zero_padding",
]
__version__ = "0.1.0"
