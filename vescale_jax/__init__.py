"""vescale_jax: RaggedShard FSDP for JAX."""

from vescale_jax.layout import RaggedShard
from vescale_jax.planner import BucketLayout, plan_bucket

__all__ = ["BucketLayout", "RaggedShard", "plan_bucket"]
__version__ = "0.1.0"
