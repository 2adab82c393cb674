"""Optax transformations over :class:`~vescale_jax.ShardedParams`: ``vj.optim.muon``, ``vj.optim.shampoo`` and
their primitives."""

from vescale_jax.optim.blocks import BlockTables, build_blocks
from vescale_jax.optim.muon import (
    MuonDimensionNumbers,
    MuonState,
    muon,
    muon_routing,
    resolve_dimension_numbers,
    scale_by_muon,
    scale_by_shape,
)
from vescale_jax.optim.owners import Routing, build_routing
from vescale_jax.optim.relayout import BlockLayout, CompactLayout, logical_view, restore_logical
from vescale_jax.optim.shampoo import ShampooState, inverse_root, scale_by_shampoo, shampoo, shampoo_blocks

__all__ = [
    "BlockLayout",
    "BlockTables",
    "CompactLayout",
    "MuonDimensionNumbers",
    "MuonState",
    "Routing",
    "ShampooState",
    "build_blocks",
    "build_routing",
    "inverse_root",
    "logical_view",
    "muon",
    "muon_routing",
    "resolve_dimension_numbers",
    "restore_logical",
    "scale_by_muon",
    "scale_by_shampoo",
    "scale_by_shape",
    "shampoo",
    "shampoo_blocks",
]
