"""vescale_jax: RaggedShard FSDP for JAX.

The public surface is what this module exports (``__all__``) and the namespaces ``vj.optim`` (Optax
transformations), ``vj.flax`` (NNX / Linen adapters), ``vj.checkpoint`` (Orbax checkpoints), ``vj.kernels``
(Pallas pack / unpack), ``vj.distributed`` (multi-process start-up), ``vj.redistribute`` (moving one tensor
between placements), ``vj.quant`` (block-wise quantization) and ``vj.testing`` (HLO census and memory
estimates). Every other module is private.
"""

from vescale_jax import checkpoint, distributed, flax, kernels, optim, quant, redistribute, testing
from vescale_jax.layout import (
    Bucket,
    BucketLayout,
    Granularity,
    LeafSpec,
    Plan,
    RaggedShard,
    default_unit,
    default_units,
    element,
    plan,
    plan_bucket,
    rows,
    tiles,
    whole,
)
from vescale_jax.layout._paths import path_str as plan_path
from vescale_jax.state import (
    Offload,
    Offloaded,
    PerDevice,
    PerLeafOnBucketsError,
    ShardedParams,
    apply_updates,
    global_norm,
    init_opt_state,
    init_sharded,
    offload,
    onload,
    shard,
    tree_map,
    unshard,
    zero_padding,
)
from vescale_jax.step import (
    LayerShard,
    MixedPrecision,
    accumulate,
    apply,
    batch_mean,
    batch_sum,
    data_sharding,
    fsdp,
    place_batch,
    scan_layers,
)

__all__ = [
    "Bucket",
    "BucketLayout",
    "Granularity",
    "LayerShard",
    "LeafSpec",
    "MixedPrecision",
    "Offload",
    "Offloaded",
    "PerDevice",
    "PerLeafOnBucketsError",
    "Plan",
    "RaggedShard",
    "ShardedParams",
    "accumulate",
    "apply",
    "apply_updates",
    "batch_mean",
    "batch_sum",
    "checkpoint",
    "data_sharding",
    "default_unit",
    "default_units",
    "distributed",
    "element",
    "flax",
    "fsdp",
    "global_norm",
    "init_opt_state",
    "init_sharded",
    "kernels",
    "offload",
    "onload",
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
