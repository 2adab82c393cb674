"""Checkpoints in the logical layout: save under one plan, restore into any other; Hugging Face files in and out.

``Manager`` (Orbax step directories with params, optimizer state and metadata) and the one-shot
``save_params`` / ``restore_params``; every leaf is stored at its logical shape with a checksum, so a checkpoint
restores into any plan, device count, mesh or process count, and into plain Flax.

``load_safetensors`` / ``save_safetensors`` read and write Hugging Face safetensors checkpoints (one file or
several beside an index json), each process only the byte ranges of its own shards, through a ``Mapping`` of
leaf key paths to tensor names and ops (``llama_mapping``, ``gpt2_mapping`` ready).
"""

from vescale_jax.checkpoint._hf_mapping import (
    Entry,
    Mapping,
    MergeDims,
    Split,
    SplitDim,
    Transpose,
    gpt2_mapping,
    llama_mapping,
)
from vescale_jax.checkpoint._manager import (
    FORMAT,
    Manager,
    Restored,
    abstract_logical,
    logical_tree,
    restore_params,
    save_params,
)
from vescale_jax.checkpoint._safetensors import load_safetensors, save_safetensors

__all__ = [
    "FORMAT",
    "Entry",
    "Manager",
    "Mapping",
    "MergeDims",
    "Restored",
    "Split",
    "SplitDim",
    "Transpose",
    "abstract_logical",
    "gpt2_mapping",
    "llama_mapping",
    "load_safetensors",
    "logical_tree",
    "restore_params",
    "save_params",
    "save_safetensors",
]
