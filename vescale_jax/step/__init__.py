"""The train step: ``vj.fsdp`` compiles it over sharded state, ``vj.apply`` calls the model inside it.

The step's options form one frozen policy; the wire gathers each bucket at its point of use and
reduce-scatters its gradient; stacked layer groups are gathered one layer per scan iteration; micro-batches
accumulate; batches are placed over the data axes; batch statistics reduce over the global batch.
"""

from vescale_jax.step._accumulate import accumulate
from vescale_jax.step._attention import attention
from vescale_jax.step._batch import data_sharding, place_batch
from vescale_jax.step._fsdp import apply, fsdp
from vescale_jax.step._positions import positions
from vescale_jax.step._precision import MixedPrecision
from vescale_jax.step._scan_layers import LayerShard, scan_layers
from vescale_jax.step._statistics import batch_mean, batch_sum

__all__ = [
    "LayerShard",
    "MixedPrecision",
    "accumulate",
    "apply",
    "attention",
    "batch_mean",
    "batch_sum",
    "data_sharding",
    "fsdp",
    "place_batch",
    "positions",
    "scan_layers",
]
