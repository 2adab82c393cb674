"""What the examples share: a command line that answers before JAX is imported, JAX's persistent compilation
cache, and honest progress output.

Importing this module imports nothing heavy (no JAX, NumPy or rich), so an example can build its parser, answer
``--help`` and set ``XLA_FLAGS`` before JAX starts.

* :class:`HelpFormatter` shows every option's default in ``--help``.
* :func:`simulate_cpu_devices` asks for simulated CPU devices when there is no GPU (before JAX is imported).
* :func:`add_compile_cache_options` and :func:`compile_cache`: ``--compile-cache DIR`` / ``--no-compile-cache``
  and JAX's persistent compilation cache in ``DIR`` for the duration of a run (every executable is written, however
  fast its compile: ``jax_persistent_cache_min_compile_time_secs=0``, ``jax_persistent_cache_min_entry_size_bytes=0``),
  with counts of the executables read from it and written to it.
* :class:`Progress`: a "compiling…" line before the first step and the compile's duration after it, the loss of
  the steps, and tokens/s and s/step measured from the end of the first step with checkpoint saves (or whatever
  the caller marks) left out and reported apart. On a terminal it draws a live ``rich`` progress bar and ends with
  a ``rich`` table; otherwise (a pipe, a log file, pytest) it prints plain lines, one per ``every`` steps.
* :func:`plot_losses`: the loss-curve PNG (matplotlib, optional).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TextIO

STARTED = time.perf_counter()  # about when the example started (it imports this module first)

CACHE_ENV = "VESCALE_JAX_COMPILE_CACHE"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except where its help already says in words what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.help and "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def has_gpu_plugin() -> bool:
    """Whether JAX's CUDA plugin is installed (looked up without importing anything)."""
    return importlib.util.find_spec("jax_cuda12_plugin") is not None


def simulate_cpu_devices(count: int | None = 8) -> None:
    """Without a GPU plugin and without ``XLA_FLAGS`` of the user's, asks XLA for ``count`` simulated CPU devices
    (``None``: leaves the count to JAX, e.g. a multi-process job's ``--local-devices``).

    Call it after parsing the command line and before importing JAX (later it has no effect). Simulated devices are
    threads of one process, so it also limits OpenBLAS to one thread per LAPACK call (Shampoo's
    eigendecompositions), instead of every call starting threads on the same few cores.
    """
    if has_gpu_plugin():
        return
    if count is not None and "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# --- The persistent compilation cache ---------------------------------------------------------------------------


def default_compile_cache() -> str:
    """``$VESCALE_JAX_COMPILE_CACHE``, else JAX's own ``$JAX_COMPILATION_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/vescale_jax/jax`` (``~/.cache/vescale_jax/jax``)."""
    for name in (CACHE_ENV, "JAX_COMPILATION_CACHE_DIR"):
        if os.environ.get(name):
            return os.environ[name]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return os.path.join(base, "vescale_jax", "jax")


def add_compile_cache_options(parser: argparse.ArgumentParser) -> None:
    """``--compile-cache DIR`` and ``--no-compile-cache`` (read back with :func:`compile_cache_dir`)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--compile-cache",
        metavar="DIR",
        default=default_compile_cache(),
        help=f"JAX's persistent compilation cache: executables compiled once are read back by later runs with "
        f"the same programs (the environment variable {CACHE_ENV} sets this)",
    )
    group.add_argument(
        "--no-compile-cache", action="store_true", help="compile every executable afresh, read and write no cache"
    )


def compile_cache_dir(args: argparse.Namespace) -> str | None:
    """The cache directory the parsed options ask for, ``~`` expanded; ``None`` for ``--no-compile-cache``."""
    if args.no_compile_cache or not args.compile_cache:
        return None
    return os.path.abspath(os.path.expanduser(args.compile_cache))


@dataclasses.dataclass
class CacheStats:
    """What JAX's persistent compilation cache did while :func:`compile_cache` was active (from
    ``jax.monitoring`` events): executables read back (``hits``, and the compile seconds they saved as recorded
    when they were written) and executables compiled and written (``writes``)."""

    directory: str | None
    hits: int = 0
    writes: int = 0
    saved_s: float = 0.0

    def entries(self) -> int:
        """Executables in the directory now (files named ``*-cache``)."""
        if self.directory is None or not os.path.isdir(self.directory):
            return 0
        return sum(name.endswith("-cache") for name in os.listdir(self.directory))

    def snapshot(self) -> tuple[int, int, float]:
        return self.hits, self.writes, self.saved_s

    def since(self, before: tuple[int, int, float]) -> str:
        """How the compiles since ``before`` (a :meth:`snapshot`) met the cache, in words."""
        if self.directory is None:
            return "persistent cache off"
        hits, writes, saved = (a - b for a, b in zip(self.snapshot(), before, strict=True))
        parts = []
        if hits:
            parts.append(f"{hits} read from the persistent cache, saving {saved:.1f} s")
        if writes:
            parts.append(f"{writes} compiled and written to the persistent cache")
        return "; ".join(parts) or "persistent cache not used"


@contextlib.contextmanager
def compile_cache(directory: str | None) -> Iterator[CacheStats]:
    """JAX's persistent compilation cache in ``directory`` while the block runs (``None``: no cache at all).

    Every executable is written, however small or fast to compile (JAX's defaults skip compiles under a second,
    which on CPU is most of them). The JAX settings in force before are put back afterwards, so a test that calls
    an example's ``main`` in-process keeps its own. The cache is trusted: do not point it at a directory others
    can write to (JAX's warning: whoever writes the cache can run code in the processes that read it).
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    stats = CacheStats(directory)
    if directory is not None:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            print(f"compile cache {directory} is not usable ({e}): compiling without it", file=sys.stderr)
            stats.directory = directory = None
    settings = {
        "jax_enable_compilation_cache": directory is not None,
        "jax_compilation_cache_dir": directory,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
        "jax_persistent_cache_min_entry_size_bytes": 0,
    }
    before = {name: getattr(jax.config, name) for name in settings}

    def on_event(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            stats.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":  # recorded when a compiled executable is written
            stats.writes += 1

    def on_duration(event: str, duration: float, **_: Any) -> None:
        if event == "/jax/compilation_cache/compile_time_saved_sec":
            stats.saved_s += duration

    changed = any(before[name] != value for name, value in settings.items())
    if changed:
        cc.reset_cache()  # a cache opened before (another directory) is not reused
        for name, value in settings.items():
            jax.config.update(name, value)
    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        yield stats
    finally:
        jax.monitoring.unregister_event_listener(on_event)
        jax.monitoring.unregister_event_duration_listener(on_duration)
        if changed:
            for name, value in before.items():
                jax.config.update(name, value)
            cc.reset_cache()


# --- Progress output --------------------------------------------------------------------------------------------


def live_output(stream: TextIO) -> bool:
    """Whether to draw a live display: ``stream`` is a terminal (not a pipe, file or pytest's capture), the
    terminal is not ``dumb``, and ``rich`` is installed."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return (
        tty
        and "PYTEST_CURRENT_TEST" not in os.environ
        and os.environ.get("TERM") != "dumb"
        and importlib.util.find_spec("rich") is not None
    )


def add_output_options(parser: argparse.ArgumentParser, *, every: int = 10) -> None:
    """``--log-every N``: a plain line every ``N`` steps (a terminal's live display shows every step)."""
    parser.add_argument(
        "--log-every",
        type=int,
        default=every,
        metavar="N",
        help="print the loss and speed every N steps (and at the first and last step; on a terminal the live "
        "display shows every step)",
    )


class Progress:
    """Progress of a training loop: compiles, the first step, per-step loss and speed, time left out.

    Usage::

        progress = Progress(steps, items_per_step=batch * seq, cache=stats)
        progress.compile(train_step, params, opt_state, batch)    # "compiling the train step…", then its time
        for step in range(1, steps + 1):
            params, opt_state, loss = train_step(params, opt_state, batch)
            progress.step(step, float(loss))                      # the first call ends the first step
            with progress.excluded("checkpoint saves"):           # left out of s/step and tokens/s
                save(...)
        summary = progress.close()

    The first step's time is the compiles since the object was made (traced and lowered, then compiled: read
    back from the persistent cache or compiled afresh) plus the first step's run. s/step and tokens/s count the
    steps after the first, from the end of the first step, without the time spent in :meth:`excluded` blocks.

    Args:
      total: the last step number (for the bar and the lines' ``step i/total``).
      items_per_step: tokens (or samples) of one step, for the rate.
      first: the number of the first step this run makes (``> 1`` after a resume).
      unit: what ``items_per_step`` counts ("tokens", "samples").
      every: a plain line every this many steps (and at the first and last).
      show: print anything at all (``False`` on every process but the first of a multi-process job).
      cache: the :func:`compile_cache` statistics, to say what the compiles read from the cache.
      stream: where to print (standard output).
      live: force the live display on or off (default: :func:`live_output` of ``stream``).
    """

    def __init__(
        self,
        total: int,
        *,
        items_per_step: int,
        first: int = 1,
        unit: str = "tokens",
        every: int = 10,
        show: bool = True,
        cache: CacheStats | None = None,
        stream: TextIO | None = None,
        live: bool | None = None,
    ) -> None:
        self.total, self.first, self.items_per_step, self.unit = total, first, items_per_step, unit
        self.every, self.show, self.cache = max(1, every), show, cache
        self.stream = sys.stdout if stream is None else stream
        self.live = show and (live_output(self.stream) if live is None else live)
        self.made = time.perf_counter()
        self.lower_s = 0.0  # tracing and lowering of every compiled step
        self.compile_s = 0.0  # compiling (or reading back) their executables
        self.compiles: list[str] = []  # one description per compiled step
        self.run_s: float | None = None  # the first step's run, after its compile
        self.compiled_at: float | None = None
        self.t0: float | None = None  # the end of the first step
        self.excluded_s: dict[str, list[float]] = {}  # seconds of each excluded block, by kind, after t0
        self.last_step: int | None = None
        self.losses: dict[int, float] = {}
        self._console: Any = None
        self._bar: Any = None
        self._task: Any = None

    # -- printing

    def print(self, text: str) -> None:
        """A line of output (above the live bar on a terminal)."""
        if not self.show:
            return
        if self.live:
            self._rich_console().print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def _rich_console(self) -> Any:
        if self._console is None:
            from rich.console import Console

            self._console = Console(file=self.stream, force_terminal=True)
        return self._console

    # -- compiles and the first step

    def compile(self, step: Any, *args: Any, what: str = "the train step") -> Any:
        """Traces, lowers and compiles ``step`` (a ``jax.jit`` or ``vj.fsdp`` function) for ``args``, timing each
        part, and returns the compiled executable. JAX keeps it, so the first call of ``step`` with arguments of
        the same shapes runs it without compiling again."""
        before = self.cache.snapshot() if self.cache else None
        status = None
        if self.live:
            status = self._rich_console().status(f"compiling {what}…")
            status.start()
        else:
            since = time.perf_counter() - STARTED
            setup = "" if self.compiles else f" ({since:.1f} s since launch: imports, data, init)"
            self.print(f"compiling {what}…{setup}")
        try:
            t = time.perf_counter()
            lowered = step.lower(*args)
            t_lowered = time.perf_counter()
            compiled = lowered.compile()
            t_compiled = time.perf_counter()
        finally:
            if status is not None:
                status.stop()
        lower_s, compile_s = t_lowered - t, t_compiled - t_lowered
        self.lower_s += lower_s
        self.compile_s += compile_s
        note = self.cache.since(before) if self.cache and before else "persistent cache off"
        self.compiles.append(f"{what}: trace and lower {lower_s:.2f} s, compile {compile_s:.2f} s ({note})")
        self.print(f"compiled {what} in {lower_s + compile_s:.2f} s: {self.compiles[-1].split(': ', 1)[1]}")
        self.compiled_at = time.perf_counter()
        return compiled

    @property
    def first_step_s(self) -> float | None:
        """Compiles plus the first step's run (``None`` before the first step ends)."""
        return None if self.run_s is None else self.lower_s + self.compile_s + self.run_s

    # -- steps

    def step(self, step: int, loss: float | None, *, note: str = "") -> None:
        """Step ``step`` has finished with this loss (``None``: not read); ``note`` ends its line, if printed."""
        now = time.perf_counter()
        self.last_step = step
        if loss is not None:
            self.losses[step] = loss
        if self.t0 is None:  # the first step: compiles (if not already timed) and the run
            start = self.compiled_at if self.compiled_at is not None else self.made
            self.run_s = now - start
            self.t0 = now
            first = self.first_step_s
            parts = f"trace and lower {self.lower_s:.2f} s, compile {self.compile_s:.2f} s, run {self.run_s:.2f} s"
            if not self.compiles:
                parts = "compile and run"
            note = f"  {note}" if note else ""
            self.print(f"step {step:4d}/{self.total}  loss {_loss(loss)}  first step {first:.2f} s ({parts}){note}")
            self._start_bar(step, loss)
            return
        seconds, steps = self.timed()
        rate = f"{self.items_per_step * steps / seconds:9,.0f} {self.unit}/s  {seconds / steps:.3f} s/step"
        if self.live:
            self._bar.update(self._task, completed=step, loss=_loss(loss), rate=rate)
        if step % self.every == 0 or step == self.total:
            self.print(f"step {step:4d}/{self.total}  loss {_loss(loss)}  {rate}" + (f"  {note}" if note else ""))

    @contextlib.contextmanager
    def excluded(self, kind: str) -> Iterator[None]:
        """Time in this block is left out of s/step and tokens/s (after the first step) and reported apart."""
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.t0 is not None:
                self.excluded_s.setdefault(kind, []).append(time.perf_counter() - t)

    def timed(self) -> tuple[float, int]:
        """Seconds since the end of the first step without the excluded blocks, and the steps they cover."""
        if self.t0 is None or self.last_step is None:
            return 0.0, 0
        left_out = sum(sum(v) for v in self.excluded_s.values())
        return max(time.perf_counter() - self.t0 - left_out, 1e-9), max(self.last_step - self.first, 0)

    # -- the end

    def close(self) -> dict[str, Any]:
        """Stops the live display and prints the timings; returns them (``s_per_step`` and the rate are ``None``
        when no step followed the first)."""
        seconds, steps = self.timed()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        summary = {
            "first_step_s": self.first_step_s,
            "lower_s": self.lower_s,
            "compile_s": self.compile_s,
            "first_run_s": self.run_s,
            "steps_timed": steps,
            "s_per_step": seconds / steps if steps else None,
            f"{self.unit}_per_s": self.items_per_step * steps / seconds if steps else None,
            "excluded_s": {kind: sum(v) for kind, v in self.excluded_s.items()},
        }
        if not self.show or self.first_step_s is None:
            return summary
        left_out = ", ".join(f"{kind} {sum(v):.2f} s ({len(v)})" for kind, v in self.excluded_s.items())
        if self.live:
            self._print_table(summary, left_out)
            return summary
        line = (
            f"timing: first step {self.first_step_s:.2f} s (trace and lower {self.lower_s:.2f} s, compile "
            f"{self.compile_s:.2f} s, run {self.run_s:.2f} s)"
        )
        if steps:
            line += (
                f"; {steps} later steps {summary['s_per_step']:.3f} s/step, "
                f"{summary[f'{self.unit}_per_s']:,.0f} {self.unit}/s"
            )
        if left_out:
            line += f"; left out of s/step: {left_out}"
        self.print(line)
        return summary

    def _start_bar(self, step: int, loss: float | None) -> None:
        if not self.live:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            TextColumn("left"),
            TimeRemainingColumn(),
            console=self._rich_console(),
        )
        self._task = self._bar.add_task("train", total=self.total, completed=step, loss=_loss(loss), rate="")
        self._bar.start()

    def _print_table(self, summary: dict[str, Any], left_out: str) -> None:
        from rich.table import Table

        table = Table(title="timing", show_header=False)
        table.add_column(style="bold")
        table.add_column(justify="right")
        table.add_row("first step (compile + run)", f"{summary['first_step_s']:.2f} s")
        table.add_row("  trace and lower", f"{summary['lower_s']:.2f} s")
        table.add_row("  compile", f"{summary['compile_s']:.2f} s")
        table.add_row("  run", f"{summary['first_run_s']:.2f} s")
        for line in self.compiles:
            table.add_row(f"  {line.split(': ', 1)[0]}", line.split(": ", 1)[1])
        if summary["steps_timed"]:
            table.add_row(f"{summary['steps_timed']} later steps", f"{summary['s_per_step']:.3f} s/step")
            table.add_row("", f"{summary[f'{self.unit}_per_s']:,.0f} {self.unit}/s")
        if left_out:
            table.add_row("left out of s/step", left_out)
        self._rich_console().print(table)


def _loss(loss: float | None) -> str:
    return "   -  " if loss is None or math.isnan(loss) else f"{loss:6.3f}"


# --- The loss plot ----------------------------------------------------------------------------------------------


def plot_losses(
    path: str,
    steps: Sequence[int],
    losses: Sequence[float],
    *,
    val_loss: float | None = None,
    title: str = "",
    say: Callable[[str], None] = print,
) -> bool:
    """Writes the training-loss curve (and the validation loss as a line) to the PNG ``path``. matplotlib is
    optional (the ``examples`` extra): without it, says so and returns ``False``."""
    try:
        import matplotlib
    except ImportError:
        say(f"no loss curve written to {path}: matplotlib is not installed (pip install -e '.[examples]')")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, label="train")
    if val_loss is not None:
        ax.axhline(val_loss, color="gray", ls="--", label=f"validation {val_loss:.2f}")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    say(f"loss curve: {path}")
    return True
