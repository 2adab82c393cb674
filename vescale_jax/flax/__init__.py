"""Adapters for Flax NNX and Linen models under ``vj.fsdp``.

NNX: split the model into its trained parameters and the rest (``graphdef, params, state = nnx.split(model,
nnx.Param, ...)``), plan and shard ``params``, and call the model through :func:`nnx_apply` (``state=`` carried
in and out); a model with a stacked layer group loops over it with :func:`nnx_scan_layers`, which is an ordinary
scan outside FSDP. Linen: plan the ``{"params": ...}`` dict and call :func:`linen_apply` (other collections as
``state=``, updated ones with ``mutable=``). Both run BatchNorm over the global batch. :func:`partition_specs`
reads Flax's partitioning annotations as the ``tp=`` argument of ``vj.plan``.
"""

from vescale_jax.flax._linen import linen_apply
from vescale_jax.flax._nnx import nnx_apply, nnx_scan_layers
from vescale_jax.flax._partition import partition_specs

__all__ = ["linen_apply", "nnx_apply", "nnx_scan_layers", "partition_specs"]
