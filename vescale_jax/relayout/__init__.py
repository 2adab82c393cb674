"""One relayout engine: plan the moves of ragged ranges between two placements, then run them.

* :mod:`._moves` (pure NumPy): a :class:`~._moves.Placement` per side (per device, which element ranges of which
  tensor or layer it holds, at which local offsets); :func:`~._moves.plan_moves` intersects them into one
  :class:`~._moves.Moves` (per device pair, runs contiguous on both sides; replicas resolved by preference).
* :mod:`._runs`: the per-device periodic run tables the executors bake in (a pair's strided rows are one run).
* :mod:`._execute` (inside ``shard_map``): one padded all-to-all (:func:`~._execute.all_to_all`) or
  collective-permute rounds (:func:`~._execute.permute_rounds`).

Callers build their placements and call the engine: :mod:`._redistribute` (``vj.redistribute``, one tensor),
:mod:`._exchange` (many ragged tensors between two flat buffers: optimizer-state relayout) and
:mod:`._logical_leaves` (buckets <-> evenly sharded logical leaves: the checkpoint). Muon's owner routing packs its
messages from its own element run tables and moves them with :func:`~._execute.exchange_messages`.
"""
