"""vescale_jax: RaggedShard FSDP for JAX.

The public surface is what this module exports (``__all__``) and the namespaces ``vj.optim`` (Optax
transformations), ``vj.flax`` (NNX / Linen adapters), ``vj.checkpoint`` (Orbax checkpoints), ``vj.kernels``
(Pallas pack / unpack), ``vj.distributed`` (multi-process start-up), ``vj.redistribute`` (moving one tensor
between placements), ``vj.quant`` (block-wise quantization) and ``vj.testing`` (HLO census and memory
estimates). Every other module is private.
"""

from vescale_jax import checkpoint, distributed, flax, kernels, optim, quant, redistribute, testing
from vescale_jax.layout._granularity import Granularity, element, rows, tiles, whole
from vescale_jax.layout._plan import Bucket, LeafSpec, Plan, plan
from vescale_jax.layout._plan import path_str as plan_path
from vescale_jax.layout._planner import BucketLayout, plan_bucket
from vescale_jax.layout._ragged import RaggedShard
from vescale_jax.state._guards import PerLeafOnBucketsError
from vescale_jax.state._padding import apply_updates, global_norm, tree_map, zero_padding
from vescale_jax.state._placement import init_opt_state
from vescale_jax.state._sharded import PerDevice, ShardedParams, init_sharded, shard, unshard
from vescale_jax.step._accumulate import accumulate
from vescale_jax.step._batch import data_sharding, place_batch
from vescale_jax.step._fsdp import apply, fsdp
from vescale_jax.step._precision import MixedPrecision
from vescale_jax.step._scan_layers import LayerShard, scan_layers

__all__ = [
    "Bucket",
    "BucketLayout",
    "Granularity",
    "LayerShard",
    "LeafSpec",
    "MixedPrecision",
    "PerDevice",
    "PerLeafOnBucketsError",
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
    "place_batch",
    "plan",
    "plan_bucket",
    "plan_path",
    "quant",
    "redistribute",
    "rows",
    "scan_layers",
    "shard",
    "testing",
    "tiles",
    "tree_map",
    "unshard",
    "whole",
    "zero_padding",
]
__version__ = "0.1.0"
