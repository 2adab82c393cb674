"""Where every element lives: pure index math over shapes, no device memory, no Flax.

- :class:`RaggedShard`: one tensor's contiguous, block-aligned, possibly uneven range per device.
- Granularity (:func:`element`, :func:`rows`, :func:`tiles`, :func:`whole`): how big a tensor's atomic block is;
  tile-major storage for ``tiles``.
- :func:`plan_bucket` / :class:`BucketLayout`: the integer planner, one flat buffer of ``m·S`` elements.
- :func:`plan` / :class:`Plan`: a pytree's leaves grouped into units (by default :func:`default_units`: one per repeated
  layer) and buckets, each laid out by the planner; tensor / expert parallel specs split leaves first.
"""

from vescale_jax.layout._bucket_layout import BucketLayout
from vescale_jax.layout._granularity import Granularity, element, rows, tiles, whole
from vescale_jax.layout._paths import default_unit, default_units
from vescale_jax.layout._plan import Bucket, LeafSpec, Plan
from vescale_jax.layout._planner import plan_bucket
from vescale_jax.layout._ragged import RaggedShard
from vescale_jax.layout._tree_planner import plan

__all__ = [
    "Bucket",
    "BucketLayout",
    "Granularity",
    "LeafSpec",
    "Plan",
    "RaggedShard",
    "default_unit",
    "default_units",
    "element",
    "plan",
    "plan_bucket",
    "rows",
    "tiles",
    "whole",
]
