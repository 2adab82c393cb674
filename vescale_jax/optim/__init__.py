"""Optax transformations over :class:`~vescale_jax.ShardedParams`: ``vj.optim.muon``, ``vj.optim.shampoo`` and
their primitives."""

from vescale_jax.optim._blocks import BlockTables, build_blocks
from vescale_jax.optim._logical import (
    adamw,
    add_decayed_weights,
    leaf_labels,
    leaf_table,
    masked,
    multi_transform,
    partition,
    select_leaves,
)
from vescale_jax.optim._muon import (
    MuonDimensionNumbers,
    MuonState,
    muon,
    muon_routing,
    resolve_dimension_numbers,
    scale_by_muon,
    scale_by_shape,
)
from vescale_jax.optim._owners import Routing, build_routing
from vescale_jax.optim._relayout import BlockLayout, CompactLayout, logical_view, restore_logical
from vescale_jax.optim._segments import (
    clip_by_block_rms,
    clip_by_global_norm,
    lamb,
    lars,
    leaf_norms,
    leaf_sums,
    scale_by_param_block_norm,
    scale_by_param_block_rms,
    scale_by_trust_ratio,
    scale_leaves,
)
from vescale_jax.optim._shampoo import ShampooState, inverse_root, scale_by_shampoo, shampoo, shampoo_blocks

__all__ = [
    "BlockLayout",
    "BlockTables",
    "CompactLayout",
    "MuonDimensionNumbers",
    "MuonState",
    "Routing",
    "ShampooState",
    "adamw",
    "add_decayed_weights",
    "build_blocks",
    "build_routing",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "inverse_root",
    "lamb",
    "lars",
    "leaf_labels",
    "leaf_norms",
    "leaf_sums",
    "leaf_table",
    "logical_view",
    "masked",
    "multi_transform",
    "muon",
    "muon_routing",
    "partition",
    "resolve_dimension_numbers",
    "restore_logical",
    "scale_by_muon",
    "scale_by_param_block_norm",
    "scale_by_param_block_rms",
    "scale_by_shampoo",
    "scale_by_shape",
    "scale_by_trust_ratio",
    "scale_leaves",
    "select_leaves",
    "shampoo",
    "shampoo_blocks",
]
