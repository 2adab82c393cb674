"""Optax transformations over :class:`~vescale_jax.ShardedParams`: ``vj.optim.muon``, ``vj.optim.shampoo``,
``vj.optim.adamw_8bit`` and their primitives, the inspection tools ``muon_routing`` and ``shampoo_blocks``, and
the optimizer-state relayout (``logical_view``, ``restore_logical``)."""

from vescale_jax.optim._adam8bit._transform import (
    ScaleByAdam8bitState,
    ScaleLayout,
    adam_8bit_moments,
    adamw_8bit,
    scale_by_adam_8bit,
)
from vescale_jax.optim._leaf_reductions import (
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
from vescale_jax.optim._logical_view import logical_view, restore_logical
from vescale_jax.optim._masks import adamw, add_decayed_weights, masked, multi_transform, partition
from vescale_jax.optim._muon._transform import (
    MuonDimensionNumbers,
    MuonState,
    muon,
    muon_routing,
    scale_by_muon,
    scale_by_shape,
)
from vescale_jax.optim._shampoo._transform import ShampooState, scale_by_shampoo, shampoo, shampoo_blocks
from vescale_jax.optim._state_layouts import BlockLayout, CompactLayout

__all__ = [
    "BlockLayout",
    "CompactLayout",
    "MuonDimensionNumbers",
    "MuonState",
    "ScaleByAdam8bitState",
    "ScaleLayout",
    "ShampooState",
    "adam_8bit_moments",
    "adamw",
    "adamw_8bit",
    "add_decayed_weights",
    "clip_by_block_rms",
    "clip_by_global_norm",
    "lamb",
    "lars",
    "leaf_norms",
    "leaf_sums",
    "logical_view",
    "masked",
    "multi_transform",
    "muon",
    "muon_routing",
    "partition",
    "restore_logical",
    "scale_by_adam_8bit",
    "scale_by_muon",
    "scale_by_param_block_norm",
    "scale_by_param_block_rms",
    "scale_by_shampoo",
    "scale_by_shape",
    "scale_by_trust_ratio",
    "scale_leaves",
    "shampoo",
    "shampoo_blocks",
]
