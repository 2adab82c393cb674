"""Checkpoints in the logical layout: save under one plan, restore into any other.

``Manager`` (Orbax step directories with params, optimizer state and metadata) and the one-shot
``save_params`` / ``restore_params``; every leaf is stored at its logical shape with a checksum, so a checkpoint
restores into any plan, device count, mesh or process count, and into plain Flax.
"""

from vescale_jax.checkpoint._manager import (
    FORMAT,
    Manager,
    Restored,
    abstract_logical,
    logical_tree,
    restore_params,
    save_params,
)

__all__ = ["FORMAT", "Manager", "Restored", "abstract_logical", "logical_tree", "restore_params", "save_params"]
