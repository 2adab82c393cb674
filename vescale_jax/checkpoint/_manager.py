"""Checkpoints through Orbax in the logical layout: save under one plan, restore into any other.

``Manager`` wraps ``orbax.checkpoint.CheckpointManager`` (step directories, ``max_to_keep``, atomic
finalisation, optional async save) with four items per step:

* ``params``: the logical parameter tree, each leaf at its own shape and dtype under its key path, exactly the
  tree ``vj.unshard(params)`` returns (a Flax NNX ``State``, a Linen params dict, ...), so plain
  ``ocp.StandardCheckpointer().restore(step_dir / "params", abstract_state)`` reads it without this library;
* ``opt_state``: the optimizer state as nested dicts keyed by its key path; every :class:`ShardedParams` in it
  (AdamW moments, Muon momentum) stored logically like ``params``; a :class:`PerDevice` leaf with a ``layout``
  stored as ``layout.to_logical(value)`` (plan-independent keys), one without a layout by device index;
  counts and scalars as they are; an offloaded node (:class:`vj.Offloaded`, state in host memory) stored as the
  node it holds, so the checkpoint is the one saved from the same state on the device;
* ``vescale_jax``: JSON describing the plan (:meth:`Plan.to_dict`), each optimizer-state leaf and the format;
* ``metadata``: the user's JSON.

With ``local_dir`` each process also keeps its own shards of the newest steps as they are on its devices
(:mod:`vescale_jax.checkpoint._local`), and :meth:`Manager.restore` reads them when every process holds the same
matching step, else the global checkpoint.

Restore builds the target from a plan (or ``ShardedParams``) and an optimizer-state template, checks every key
path, shape and dtype against the checkpoint's metadata first (raising with the path, both shapes and the fix),
lets Orbax read each leaf straight into its storage sharding, and packs bucket by bucket
(:mod:`vescale_jax.relayout._logical_leaves`). Nothing is pickled.

Plans whose leaves are split over tensor / expert axes (``vj.plan(..., tp=...)``) store the same logical tree:
each leaf at its full shape, whatever the split, so a checkpoint restores across TP and FSDP-only plans and
meshes. A ``PerDevice`` state whose layout covers such leaves (and does not declare ``supports_groups``) is
refused with an error naming it, never stored as one group's shards.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

from vescale_jax.checkpoint import _background as _background
from vescale_jax.checkpoint import _integrity as _integrity
from vescale_jax.checkpoint import _local as _local
from vescale_jax.checkpoint import _read_errors as _read_errors
from vescale_jax.checkpoint import _storable as _stored
from vescale_jax.checkpoint._preemption import Preemption
from vescale_jax.checkpoint._storable import abstract_logical, logical_tree
from vescale_jax.layout._plan import Plan
from vescale_jax.state._sharded import ShardedParams

__all__ = [
    "FORMAT",
    "Manager",
    "Restored",
    "abstract_logical",
    "logical_tree",
    "restore_params",
    "save_params",
]

FORMAT = "vescale_jax.checkpoint/1"
_VJ, _PARAMS, _OPT, _META = "vescale_jax", "params", "opt_state", "metadata"
_log = logging.getLogger("vescale_jax.checkpoint")


def _target_plan(params: ShardedParams | Plan) -> Plan:
    if isinstance(params, Plan):
        return params
    if isinstance(params, ShardedParams):
        return params.plan
    raise TypeError(
        f"vj.checkpoint: params= must be a vj.Plan or vj.ShardedParams (the target), got {type(params).__name__}."
    )


# ------------------------------------------------------------------------------------------ plain Orbax dirs
def save_params(path: str | os.PathLike, params: ShardedParams, *, force: bool = False) -> None:
    """Writes ``params`` in the logical layout with ``ocp.StandardCheckpointer`` (a plain Orbax PyTree dir).

    Args:
      path: the checkpoint directory (must not exist unless ``force``).
      params: the sharded parameters.
      force: overwrite an existing directory.
    """
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(os.fspath(path), _stored.storable(logical_tree(params)), force=force)
    ckptr.wait_until_finished()


def restore_params(path: str | os.PathLike, params: ShardedParams | Plan) -> ShardedParams:
    """Reads a plain Orbax PyTree checkpoint of a logical parameter tree straight into shards.

    The directory may come from ``ocp.StandardCheckpointer().save(path, nnx.state(model))`` on an unsharded
    model (a warm start), from :func:`save_params`, or be a :class:`Manager` step's ``params`` item.

    Args:
      path: the checkpoint directory.
      params: the target plan (or ``ShardedParams`` whose plan to use).

    Returns:
      ``ShardedParams`` under the target plan, bit-equal to the stored leaves.

    Sharding:
      Each process reads only the storage blocks of its devices, then packs bucket by bucket.
    """
    plan = _target_plan(params)
    ckptr = ocp.StandardCheckpointer()
    target = _stored.storable(abstract_logical(plan))
    path = os.fspath(path)
    trees = {os.path.basename(os.path.normpath(path)): target}
    try:
        stored = _integrity.stored_shapes(ckptr.metadata(path).item_metadata)
    except Exception as e:  # TensorStore's errors are plain Exceptions
        raise _read_errors.read_error(e, where=path, trees=trees) from e
    if not stored and jax.tree.leaves(target):
        raise _read_errors.missing_item(path, "params")
    _integrity.check_against(stored, target, item="params")
    try:
        tree = ckptr.restore(path, target)
    except Exception as e:
        raise _read_errors.read_error(e, where=path, trees=trees) from e
    return _stored.pack(tree, plan, donate=True)  # freshly read: a one-leaf bucket takes the leaf's memory


# ---------------------------------------------------------------------------------------------------- manager
class Restored(NamedTuple):
    """What :meth:`Manager.restore` returns."""

    step: int
    params: ShardedParams | None
    opt_state: Any
    metadata: dict[str, Any]
    source: str = "global"  # "global": the checkpoint directory; "local": every process's local copy


class Manager:
    """Saves and restores training state through ``orbax.checkpoint.CheckpointManager``.

    Usage::

        mngr = vj.checkpoint.Manager(directory, max_to_keep=3, async_save=True)
        mngr.save(step, params=params, opt_state=opt_state, metadata={"data": loader_state})
        ...
        r = mngr.restore(params=plan, opt_state=jax.eval_shape(lambda: vj.init_opt_state(tx, sp)))
        params, opt_state, step, meta = r.params, r.opt_state, r.step, r.metadata

    Args:
      directory: root directory; each step is a sub-directory ``<step>/`` with items ``params``,
        ``opt_state``, ``vescale_jax`` (JSON) and ``metadata`` (JSON).
      max_to_keep: keep at most this many finished steps (``None``: all).
      async_save: return from :meth:`save` once the state is converted to its logical layout; a worker thread
        then copies the converted arrays to the host and writes them while the next training steps run (see
        "Saves that do not stall" below). One save is in flight at a time: the next global save, :meth:`wait`,
        :meth:`restore`, :meth:`close` and the step queries wait for it, and raise a ``RuntimeError`` naming its
        step (its ``__cause__`` the original error) if it failed. In a multi-process job Orbax's own async save is
        used instead (it returns once the arrays are on the host).
      save_interval_steps: the interval of :meth:`should_save` (``force=True`` overrides it).
      overwrite: let the first save delete what the directory holds that is not this run's: steps another run
        (or an earlier launch of this one) wrote, other than the step :meth:`restore` resumed from and those
        before it, and any step at or after the one being saved. Without it such a save raises (the
        directory is another run's, or saving step 40 beside an old step 60 would leave the old one "latest").
      catch_sigterm: in a single-process job, catch ``SIGTERM`` from the Manager's creation (in the main thread)
        until :meth:`close`, for :meth:`reached_preemption` (a multi-process job's notice comes through JAX's
        coordination service either way).
      local_dir: also keep local copies here for fast restarts: each process writes its own shards of the state's
        arrays as they are (its device layout, no conversion) under ``local_dir/process_<i>_of_<n>/<step>/``
        (``.npy`` files and a JSON manifest), every ``local_every`` steps and at every global save. :meth:`restore`
        reads them when every process holds the same step locally (agreed through JAX's coordination service),
        saved under the same plan, process layout and state structure, and no older than the newest global step;
        otherwise every process reads the global checkpoint (``Restored.source`` says which).
      local_every: the interval of local copies (default ``save_interval_steps``); :meth:`should_save` is true at
        these steps too, and :meth:`save` writes only the local copy there unless the global one is due (its
        interval, the preemption step, or ``force``).
      local_keep: how many of the newest local steps each process keeps.

    A training loop asks :meth:`should_save` and :meth:`reached_preemption` after every step::

        mngr.prepare(params=params, opt_state=opt_state)    # compile the save and restore before timing
        for step in range(first, last + 1):
            params, opt_state, metrics = train_step(params, opt_state, batch)
            preempted = mngr.reached_preemption(step)        # same step on every process after a SIGTERM
            if preempted or mngr.should_save(step) or step == last:
                mngr.save(step, params=params, opt_state=opt_state, force=True)
            if preempted:
                mngr.wait()                                  # the save is complete: exit 0 within the grace
                break

    Saves that do not stall (``async_save=True``, single-process job):
      :meth:`save` runs the conversion (the compiled bucket -> logical programs and the checksums, on the calling
      thread, which dispatches every device program), moving each bucket's converted leaves to pinned host memory
      before the next bucket converts, and returns; the write runs in a worker thread, overlapping the next
      steps. The worker touches only those host copies (and copies of the leaves stored as they are, a step
      count), made before the next step can donate the state, so the checkpoint holds the values at the save.
      Device memory: during ``save()`` the state plus one bucket's logical copy; during the overlap the step's
      own peak and nothing more (the save's arrays are in host memory, about the size of the sharded state it
      stores, ``(P + O) / m`` per device, freed as the worker finishes). A backend without pinned host memory
      keeps them on the device instead.

    Sharding:
      Save and restore are collective: every process calls them with the same arguments. Each writes and reads
      only its devices' storage blocks (see :func:`logical_tree`).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        async_save: bool = False,
        save_interval_steps: int = 1,
        overwrite: bool = False,
        catch_sigterm: bool = True,
        local_dir: str | os.PathLike | None = None,
        local_every: int | None = None,
        local_keep: int = 2,
    ):
        self.directory = os.path.abspath(os.fspath(directory))
        self.overwrite = bool(overwrite)
        self._interval = int(save_interval_steps)
        if self._interval < 1:
            raise ValueError(f"Manager: save_interval_steps must be >= 1, got {save_interval_steps!r}.")
        self._local_every = self._interval if local_every is None else int(local_every)
        if self._local_every < 1:
            raise ValueError(f"Manager: local_every must be >= 1, got {local_every!r}.")
        self._local = None if local_dir is None else _local.LocalCopies(local_dir, keep=local_keep)
        self._preemption = Preemption(catch_sigterm=catch_sigterm)
        self._resumed_from: int | None = None  # the step restore() read: it and earlier steps are this run's
        self._saved: set[int] = set()  # steps this Manager saved
        # Single-process: our worker thread runs Orbax's (blocking) save. Multi-process: Orbax's save holds
        # barriers that run device collectives, which must stay on the thread that dispatches the steps.
        background = async_save and jax.process_count() == 1
        self._background = _background.Background(self.directory) if background else None
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save and not background,
            save_interval_steps=save_interval_steps,
            create=True,
        )
        handlers = {
            _PARAMS: ocp.StandardCheckpointHandler(),
            _OPT: ocp.StandardCheckpointHandler(),
            _VJ: ocp.JsonCheckpointHandler(),
            _META: ocp.JsonCheckpointHandler(),
        }
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # -- lifecycle
    def latest_step(self) -> int | None:
        """The newest finished step (unfinished, e.g. killed, saves are ignored), or ``None``; waits for a
        background save in flight."""
        self._join()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """The finished steps, oldest first; waits for a background save in flight."""
        self._join()
        return list(self._mngr.all_steps())

    def _join(self) -> None:
        """Waits for the background save in flight (``async_save``), re-raising its error naming the step."""
        if self._background is None:
            return
        step = self._background.step
        try:
            self._background.join()
        except _background.BackgroundSaveError:
            self._saved.discard(step)
            raise

    def wait(self) -> None:
        """Blocks until an async save has finished and been finalised.

        Raises:
          RuntimeError: the background save failed; the message names its step and the cause.
        """
        self._join()
        self._mngr.wait_until_finished()

    def close(self) -> None:
        """Finishes the save in flight and closes; raises a background save's error after closing."""
        try:
            self._join()
        finally:
            self._mngr.close()
            self._preemption.close()

    # -- when to save
    def reached_preemption(self, step: int) -> bool:
        """True at the step every process saves before a preemption; ask after every step, on every process.

        After ``SIGTERM`` (or JAX's preemption notice) reaches any process, the job's processes agree through
        JAX's coordination service on one step that all of them finish: this returns True there, on each of
        them. Save that step, :meth:`wait`, and end the run (exit status 0) within the scheduler's grace period.
        A single-process job catches ``SIGTERM`` itself from the Manager's creation on (unless
        ``catch_sigterm=False``) and answers True at the first step boundary after it.

        Args:
          step: the step just finished; the same number on every process (a resumed job starts every process
            at the same step).
        """
        return self._preemption.reached(step)

    def should_save(self, step: int) -> bool:
        """Whether to save ``step``: every ``save_interval_steps`` steps, at the preemption step, and (with
        ``local_dir``) every ``local_every`` steps.

        Args:
          step: the step just finished.
        """
        return self._global_due(step) or self._local_due(step)

    def _global_due(self, step: int) -> bool:
        return step % self._interval == 0 or self._preemption.reached(step)

    def _local_due(self, step: int) -> bool:
        return self._local is not None and step % self._local_every == 0

    def local_steps(self) -> list[int]:
        """This process's complete local steps (``local_dir``), oldest first."""
        return self._local.steps() if self._local is not None else []

    def __enter__(self) -> Manager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- save
    def save(
        self,
        step: int,
        *,
        params: ShardedParams,
        opt_state: Any = None,
        metadata: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves one step.

        Args:
          step: the step number (the sub-directory's name).
          params: the sharded parameters.
          opt_state: the optimizer state over them (any Optax state), or ``None``. Offloaded nodes
            (``vj.init_opt_state(..., offload=vj.Offload())``) are written as the device state they hold, brought
            to the device one node at a time.
          metadata: JSON-serialisable user data (data-loader position, RNG state, config).
          force: save the global checkpoint even if ``save_interval_steps`` says not to.

        Returns:
          Whether a save (global or local) was started.

        Raises:
          RuntimeError: (``async_save``) the previous global save, running in the background, failed; the message
            names its step.
        """
        if not isinstance(params, ShardedParams):
            raise TypeError(
                f"Manager.save: params must be vj.ShardedParams, got {type(params).__name__}; "
                "use ocp.StandardCheckpointer for a plain tree."
            )
        to_global = force or self._global_due(step)
        if self._local is not None and (to_global or self._local_due(step)):
            state = {_PARAMS: list(params.buffers), _OPT: opt_state}
            self._local.save(step, state, _local.key_of(params.plan, opt_state), dict(metadata or {}))
            if not to_global:
                return True
        if not to_global:
            return False
        self._join()  # one global save in flight: the previous one is written (or its error raised) first
        self._claim(step)
        # A background save holds what it writes in host memory, each bucket's conversion writing it there; it
        # only enqueues the conversions where the device runs them in launch order (a GPU), and its worker
        # fetches the checksums (on XLA:CPU each conversion still finishes before the next launches).
        background = self._background is not None
        host = self._save_memory(params.plan)
        logical, param_sums = _stored.logical_and_sums(params, memory_kind=host, defer=background)
        items: dict[str, Any] = {_PARAMS: ocp.args.StandardSave(_stored.storable(logical))}
        sums = {_PARAMS: param_sums}
        info: list[dict[str, Any]] = []
        if opt_state is not None:
            tree, info, sums[_OPT] = _stored.opt_state_items(opt_state, memory_kind=host, defer=background)
            items[_OPT] = ocp.args.StandardSave(tree)
        description = {
            "format": FORMAT,
            "plan": params.plan.to_dict(),
            "opt_state": info,
            "has_opt_state": opt_state is not None,
            # what each item stores: a restore checks its target against these without reading Orbax's metadata
            "shapes": {item: _integrity.flat_shapes(items[item].item) for item in (_PARAMS, _OPT) if item in items},
        }
        items[_META] = ocp.args.JsonSave(dict(metadata or {}))
        if background:
            # Leaves sharing a buffer with the state would be donated by the next step: the worker gets copies.
            state = [*params.buffers, *jax.tree.leaves(opt_state)]
            for item in (_PARAMS, _OPT) if opt_state is not None else (_PARAMS,):
                items[item] = ocp.args.StandardSave(_background.detach(items[item].item, state))
            self._saved.add(int(step))
            self._background.start(step, lambda: self._write(step, items, description, sums))
            return True
        items[_VJ] = ocp.args.JsonSave({**description, "checksums": sums})
        started = self._mngr.save(step, args=ocp.args.Composite(**items), force=True)
        if started:
            self._saved.add(int(step))
        return started

    def _save_memory(self, plan: Plan) -> str | None:
        """The memory a save's conversions write to (what :meth:`prepare` compiles them for): host memory for a
        background save where the devices have it, else ``None`` (device memory)."""
        return _background.host_memory(plan.mesh) if self._background is not None else None

    def _write(self, step: int, items: dict[str, Any], description: dict[str, Any], sums: dict[str, Any]) -> None:
        """The worker's part of a background save: the checksums fetched (they wait for the conversions), then
        Orbax's save (write, finalise)."""
        checksums = {item: fetch() for item, fetch in sums.items()}
        args = ocp.args.Composite(**items, **{_VJ: ocp.args.JsonSave({**description, "checksums": checksums})})
        if not self._mngr.save(step, args=args, force=True):
            raise RuntimeError(f"Orbax's CheckpointManager declined to save step {step} (force=True).")

    def _foreign(self, step: int) -> list[int]:
        """Finished steps of the directory that are not this run's before ``step``: another run's, or any at or
        after ``step``."""

        def ours(s: int) -> bool:
            return s < step and (s in self._saved or (self._resumed_from is not None and s <= self._resumed_from))

        return sorted(s for s in self._mngr.all_steps() if not ours(s))

    def check_directory(self, step: int) -> None:
        """Raises now what :meth:`save` of ``step`` would raise about the directory's steps (see ``overwrite``).

        Call it before training so a run that would be refused at its first save stops at once.

        Args:
          step: the first step this run will save.

        Raises:
          ValueError: the directory holds another run's steps, or steps at or after ``step``, and ``overwrite``
            is off; the message lists them and the fixes.
        """
        self._join()
        self._refuse(step, self._foreign(step))

    def _refuse(self, step: int, foreign: list[int]) -> None:
        if foreign and not self.overwrite:
            later = [s for s in foreign if s >= step]
            why = f"steps {foreign}" + (f" ({later} at or after step {step})" if later else "")
            raise ValueError(
                f"vj.checkpoint.Manager: not saving step {step} into {self.directory}: it holds {why}, which this "
                "Manager did not restore from or save; a save here would mix two runs (and a later old step would "
                "stay the latest). Resume from it (Manager.restore, then save the next steps), save into another "
                "directory, or pass overwrite=True to delete those steps first."
            )

    def _claim(self, step: int) -> None:
        """Before saving ``step``: refuses, or with ``overwrite`` deletes, the steps :meth:`_foreign` names."""
        foreign = self._foreign(step)
        self._refuse(step, foreign)
        if foreign:
            self._mngr.wait_until_finished()
            for s in foreign:
                self._mngr.delete(s)

    def prepare(self, *, params: ShardedParams, opt_state: Any = None) -> None:
        """Compiles every executable a :meth:`save` of this state and a :meth:`restore` into it run, writing nothing.

        The buckets' conversions both ways, each ``PerDevice`` layout's (Shampoo's blocks, compact moments, 8-bit
        AdamW's scales), the checksums, Orbax's slicing of replicated storage blocks, and an offloaded node's joins
        and cuts of its pieces: the first save and the first restore after it compile nothing (see
        ``vescale_jax.checkpoint._storable.prepare``). Call it before a timed loop so the first save costs what
        later ones do. Collective, like :meth:`save`: every process calls it with the same arguments.

        Args:
          params: the sharded parameters (or their ``jax.eval_shape``).
          opt_state: the optimizer state over them, or ``None``.
        """
        _stored.prepare(params, opt_state, memory_kind=self._save_memory(params.plan))

    # -- restore
    def _restore_local(self, step: int | None, plan: Plan | None, opt_state: Any) -> Restored | None:
        """Every process's local copy (``local_dir``), or ``None`` on every process: then the global one is read."""
        got, why = _local.agree_and_read(
            self._local, _local.key_of(plan, opt_state), newest_global=self._mngr.latest_step(), step=step
        )
        if got is None:
            _log.info("vj.checkpoint: restoring from the global checkpoint %s: %s", self.directory, why)
            return None
        sp, state = got.state(plan, opt_state)
        _log.info("vj.checkpoint: restored %s from %s", why, self._local.dir)
        self._resumed_from = got.step
        return Restored(got.step, sp, state, dict(got.manifest["metadata"]), "local")

    def _description(self, step: int) -> dict[str, Any]:
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(**{_VJ: ocp.args.JsonRestore()}))[_VJ]
        except Exception as e:  # a missing item is a KeyError, an unreadable file a TensorStore error
            file = os.path.join(self.directory, str(step), _VJ)
            raise ValueError(
                f"vj.checkpoint: step {step} in {self.directory} has no readable description {file} ({e}); it "
                "holds the plan and checksums the restore needs. Restore another step (Manager.all_steps()), or "
                "re-copy the checkpoint directory from where it was written."
            ) from e
        if not isinstance(out, dict) or out.get("format") != FORMAT:
            raise ValueError(
                f"vj.checkpoint: step {step} in {self.directory} was not written by "
                f"vj.checkpoint.Manager (format {getattr(out, 'get', lambda _: None)('format')!r})."
            )
        return out

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The user metadata saved with ``step`` (default: the latest)."""
        step = self._step(step)
        return dict(self._mngr.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META])

    def saved_plan(self, step: int | None = None) -> dict[str, Any]:
        """The JSON description (:meth:`Plan.to_dict`) of the plan ``step`` was saved under."""
        return self._description(self._step(step))["plan"]

    def _step(self, step: int | None) -> int:
        self._join()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"vj.checkpoint: no finished checkpoint in {self.directory}.")
        if step not in self._mngr.all_steps():
            raise FileNotFoundError(
                f"vj.checkpoint: no finished step {step} in {self.directory}; steps: {self.all_steps()}."
            )
        return step

    def restore(
        self, step: int | None = None, *, params: ShardedParams | Plan | None, opt_state: Any = None
    ) -> Restored:
        """Restores one step into the target plan (any device count, granularity, mesh or process count).

        Args:
          step: the step (default: the latest finished one).
          params: the target :class:`Plan` (or ``ShardedParams``, real or abstract, whose plan to use);
            ``None`` skips the parameters.
          opt_state: a template of the target optimizer state (e.g. ``vj.init_opt_state(tx, sp)`` or its
            ``jax.eval_shape``) whose ``ShardedParams`` carry the target plan; ``None`` skips it. Where the
            template holds an offloaded node (``vj.Offloaded``, concrete or abstract) the restored node is offloaded
            too, in the template's memory kind and pieces; a device-resident node is restored on the device,
            whichever form the state was saved from.

        Returns:
          :class:`Restored` ``(step, params, opt_state, metadata, source)``; values are bit-equal to the saved
          ones; ``source`` is ``"local"`` where every process read its local copy (``local_dir``), else
          ``"global"``.

        Raises:
          ValueError: a key path is missing or extra, or a shape or dtype differs (the message names the path,
            both shapes and the fix); also for a ``PerDevice`` state without a layout and a changed plan.
        """
        self._join()
        if self._local is not None:  # collective: every process takes the same path
            plan0 = _target_plan(params) if params is not None else None
            local = self._restore_local(step, plan0, opt_state)
            if local is not None:
                return local
        step = self._step(step)
        desc = self._description(step)
        where = os.path.join(self.directory, str(step))
        # the params' restore target names a leaf whose metadata cannot be read (Orbax calls it 'w.k', we 'w/k')
        named = {_PARAMS: _stored.storable(abstract_logical(_target_plan(params)))} if params is not None else {}
        recorded = desc.get("shapes") or {}  # saved with the step (absent from checkpoints of earlier releases)
        metadata: list[Any] = []

        def stored_shapes(item: str, target: Any) -> dict[str, Any]:
            item_dir = os.path.join(where, item)
            if item in recorded and not _read_errors.unreadable_item(item_dir):
                return {k: (tuple(shape), dtype) for k, (shape, dtype) in recorded[item].items()}
            if not metadata:
                try:
                    metadata.append(self._mngr.item_metadata(step))
                except Exception as e:  # TensorStore's errors are plain Exceptions
                    raise _read_errors.read_error(e, where=f"step {step} at {where}", trees=named) from e
            shapes = _integrity.stored_shapes(metadata[0][item]) if item in metadata[0].keys() else {}
            if not shapes and jax.tree.leaves(target):
                raise _read_errors.missing_item(item_dir, item)
            return shapes

        args: dict[str, Any] = {_META: ocp.args.JsonRestore()}
        trees: dict[str, Any] = {}  # the restore targets, to name a leaf whose file cannot be read
        plan = None
        if params is not None:
            plan = _target_plan(params)
            target = _stored.storable(abstract_logical(plan))
            _integrity.check_against(stored_shapes(_PARAMS, target), target, item="params")
            args[_PARAMS], trees[_PARAMS] = ocp.args.StandardRestore(target), target
        rebuild = None
        if opt_state is not None:
            if not desc.get("has_opt_state"):
                raise ValueError(
                    f"vj.checkpoint: step {step} has no optimizer state; pass opt_state=None and "
                    "initialise the optimizer."
                )
            saved = {d["path"]: d for d in desc["opt_state"]}
            default = plan or _stored.first_plan(opt_state)
            target_opt, rebuild = _stored.opt_state_target(opt_state, saved, default)
            _integrity.check_against(stored_shapes(_OPT, target_opt), target_opt, item="opt_state")
            args[_OPT], trees[_OPT] = ocp.args.StandardRestore(target_opt), target_opt
        try:
            out = self._mngr.restore(step, args=ocp.args.Composite(**args))
        except Exception as e:  # TensorStore's errors are plain Exceptions
            raise _read_errors.read_error(e, where=f"step {step} at {where}", trees=trees) from e
        sums = desc["checksums"]
        # the read leaves are used by nothing else: a bucket that is one leaf split over its devices takes its memory
        sp = _stored.pack(out[_PARAMS], plan, sums[_PARAMS], where=where, donate=True) if plan is not None else None
        state = _stored.rebuild_state(opt_state, out[_OPT], rebuild, sums[_OPT], where) if rebuild is not None else None
        self._resumed_from = step  # read and checked: it and earlier steps are this run's
        return Restored(step, sp, state, dict(out[_META] or {}))
