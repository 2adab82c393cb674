"""Optax transformations over :class:`~vescale_jax.ShardedParams`: ``vj.optim.muon`` and its primitives."""

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

__all__ = [
    "MuonDimensionNumbers",
    "MuonState",
    "Routing",
    "build_routing",
    "muon",
    "muon_routing",
    "resolve_dimension_numbers",
    "scale_by_muon",
    "scale_by_shape",
]
