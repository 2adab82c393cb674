"""Moving ragged ranges between two placements, with one engine.

The engine plans, then executes: :mod:`._moves` describes each side as a ``Placement`` (per device, which element
range of which tensor or layer it holds, at which local offset) and ``plan_moves`` turns two of them into one
``Moves`` (runs of source device, destination device, offsets, length; pure NumPy); :mod:`._runs` compresses the
runs into per-device arithmetic tables, looked up by one select per run for a few runs and by the block index of
:mod:`._run_lookup` for many; :mod:`._execute` runs them inside ``shard_map`` as one padded all-to-all or as
collective-permute rounds. Its callers: the one-tensor moves of ``vj.redistribute``, flat buckets to and from
evenly sharded logical leaves (checkpoints), many tensors between two per-device layouts (optimizer state re-placed
under another plan), and Muon's owner routing (its strided run tables, chunked gathers and all-to-all).
"""

from vescale_jax.relayout._redistribute import from_dim0, from_ragged, reshard, to_dim0, to_ragged

__all__ = ["from_dim0", "from_ragged", "reshard", "to_dim0", "to_ragged"]
