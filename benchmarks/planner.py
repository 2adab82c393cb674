"""Padding and planning CPU time of ``plan_bucket`` on three public LLMs, next to even dim-0 sharding.

What it measures, for each of llama3-70b, deepseek-v3 and gpt-oss-120b (``benchmarks/model_configs.py``; one
bucket per transformer layer, embed / final_norm / lm_head separate), each device count ``m`` in
{8, 64, 256, 1024} and each granularity ``element()``, ``rows(1)``, ``rows(16)``, ``rows(128)``, with bf16
parameters (offsets and ``S`` aligned to 16 bytes = 8 elements):

* **padding**: ``sum(m*S - numel) / sum(m*S)`` over every bucket of the model, with ``S`` from
  :func:`vescale_jax.plan_bucket`. Every layout is also verified with ``BucketLayout.check()``.
* **forced**: the same fraction for a lower bound ``S_lb`` on the optimal ``S`` of each bucket: the smallest
  ``S >= max(ceil(numel/m), largest block)`` that is a multiple of the alignment and of the block of every
  tensor longer than ``2S`` (such a tensor crosses two shard boundaries, so both lie on its block grid;
  :func:`forced_shard_size`). No planner can pad less than this.
* **FSDP2 dim-0**: padding of even dim-0 sharding (each tensor's dim 0, or its only dim, padded up to a
  multiple of ``m``; no alignment), over the whole model.
* **max load / mean**: the largest, over buckets, of ``max(device load) / (numel/m)``, where a device's load
  is the real (non-padding) elements it owns (1.000 is perfect balance).
* **CPU time**: the CPU time of this process (``time.process_time``, so that other jobs on a shared machine
  do not count) to plan every bucket of the model with a cold planner cache
  (``vj.plan_bucket.cache_clear()`` first), best of 3. Identical layers hit the planner's LRU cache inside
  one run; that deduplication is part of the measured time. Verifying the layouts is not timed.

Run from the repository root::

    python benchmarks/planner.py                                  # print the table
    python benchmarks/planner.py --out benchmarks/results/planner.md
    python benchmarks/planner.py --quick                          # m in {8, 256}; element(), rows(1), rows(16)

Exits non-zero if any whole-model plan takes more than 0.1 s of CPU time (``--time-limit``), if a
configuration with ``m <= 256`` and ``element()``, ``rows(1)`` or ``rows(16)`` pads more than
``max(3%, forced + 0.1 percentage point)``, or if a layout breaks an invariant.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import platform
import shlex
import sys
import time
from pathlib import Path

import jax
import numpy as np
from model_configs import Shape, buckets

import vescale_jax as vj

MODELS = ("llama3-70b", "deepseek-v3", "gpt-oss-120b")
DEVICE_COUNTS = (8, 64, 256, 1024)
QUICK_DEVICE_COUNTS = (8, 256)
GRANULARITIES = (vj.element(), vj.rows(1), vj.rows(16), vj.rows(128))
QUICK_GRANULARITIES = GRANULARITIES[:3]
ALIGN = 16 // 2  # 16-byte alignment of bf16 (2-byte) elements
REPEATS = 3
PAD_LIMIT = 0.03  # padding allowed above the forced bound ...
BOUND_SLACK = 0.001  # ... or 0.1 percentage point above it, whichever is larger
GATED_MAX_M = 256
GATED_GRANULARITIES = ("element()", "rows(1)", "rows(16)")
TIME_LIMIT_S = 0.1  # CPU seconds to plan a whole model


@dataclasses.dataclass(frozen=True)
class BucketInput:
    """One bucket as the planner sees it."""

    name: str
    sizes: tuple[int, ...]
    blocks: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Result:
    """Whole-model figures for one (model, m, granularity)."""

    model: str
    m: int
    granularity: str  # repr of the vj.Granularity, e.g. "rows(16)"
    num_buckets: int
    numel: int
    padding: float  # planner, over the whole model
    forced: float  # lower bound, over the whole model
    fsdp2: float  # even dim-0 sharding, over the whole model
    imbalance: float  # max over buckets of max(device load) / mean load
    seconds: float  # CPU time, best of REPEATS cold runs
    worst_bucket: str  # bucket whose planner S exceeds its S_lb by the largest fraction of m*S_lb
    worst_s: int
    worst_s_lb: int
    worst_excess: int  # m * (S - S_lb) elements

    @property
    def gated(self) -> bool:
        return self.m <= GATED_MAX_M and self.granularity in GATED_GRANULARITIES

    @property
    def allowed(self) -> float:
        return max(PAD_LIMIT, self.forced + BOUND_SLACK)

    @property
    def padding_failed(self) -> bool:
        return self.gated and self.padding > self.allowed

    def time_failed(self, limit: float = TIME_LIMIT_S) -> bool:
        return self.seconds > limit


def bucket_inputs(model: str, gran: vj.Granularity) -> list[BucketInput]:
    """Sizes and blocks (of granularity ``gran``) of every bucket of ``model``."""
    return [
        BucketInput(
            name,
            tuple(math.prod(shape) for _, shape in params),
            tuple(gran.block(shape) for _, shape in params),
        )
        for name, params in buckets(model)
    ]


def forced_shard_size(b: BucketInput, m: int) -> int:
    """``S_lb``: a lower bound on the optimal shard size of bucket ``b`` on ``m`` devices.

    The smallest ``S >= max(ceil(numel/m), largest block)`` that is a multiple of ``ALIGN`` and of the block of
    every tensor longer than ``2S``. Raising ``S`` only drops tensors from that set, so the search walks up: the
    tensors constraining ``S`` stay the same until ``2S`` reaches the shortest of them.
    """
    clamped = [min(blk, max(n, 1)) for n, blk in zip(b.sizes, b.blocks, strict=True)]
    s = max(-(-sum(b.sizes) // m), max(clamped))
    while True:
        longer = [(n, blk) for n, blk in zip(b.sizes, clamped, strict=True) if n > 2 * s]
        step = math.lcm(ALIGN, *(blk for _, blk in longer))
        candidate = -(-s // step) * step
        release = min((n // 2 + (n % 2) for n, _ in longer), default=math.inf)  # the least S with 2S >= n
        if candidate < release:
            return candidate
        s = release


def fsdp2_padded(shape: Shape, m: int) -> int:
    """Elements of a tensor after padding its dim 0 up to a multiple of ``m`` (even dim-0 sharding)."""
    if not shape:
        return m  # a scalar becomes one element per device
    d0 = -(-shape[0] // m) * m
    return d0 * math.prod(shape[1:])


def plan_model(inputs: list[BucketInput], m: int) -> tuple[list[vj.BucketLayout], float]:
    """Plans every bucket with a cold cache, ``REPEATS`` times; returns the layouts and the least CPU time."""
    best = math.inf
    layouts: list[vj.BucketLayout] = []
    for _ in range(REPEATS):
        vj.plan_bucket.cache_clear()
        t0 = time.process_time()
        layouts = [vj.plan_bucket(b.sizes, b.blocks, m, align=ALIGN) for b in inputs]
        best = min(best, time.process_time() - t0)
    vj.plan_bucket.cache_clear()
    return layouts, best


def measure(model: str, m: int, granularity: str, inputs: list[BucketInput], fsdp2: float) -> Result:
    layouts, seconds = plan_model(inputs, m)
    numel = planned = bound = 0
    imbalance = 1.0
    worst = ("-", 0, 0, 0)
    for b, layout in zip(inputs, layouts, strict=True):
        layout.check()
        total = sum(b.sizes)
        s_lb = forced_shard_size(b, m)
        assert layout.shard_size >= s_lb, f"{model} {b.name}: S={layout.shard_size} below bound {s_lb}"
        numel += total
        planned += layout.total_size
        bound += m * s_lb
        imbalance = max(imbalance, max(layout.device_loads()) * m / total)
        excess = m * (layout.shard_size - s_lb)
        if excess * max(worst[2], 1) > worst[3] * s_lb:  # compare excess / (m*S_lb) across buckets
            worst = (b.name, layout.shard_size, s_lb, excess)
    return Result(
        model=model,
        m=m,
        granularity=granularity,
        num_buckets=len(inputs),
        numel=numel,
        padding=(planned - numel) / planned,
        forced=(bound - numel) / bound,
        fsdp2=fsdp2,
        imbalance=imbalance,
        seconds=seconds,
        worst_bucket=worst[0],
        worst_s=worst[1],
        worst_s_lb=worst[2],
        worst_excess=worst[3],
    )


def fsdp2_padding(model: str, m: int) -> float:
    shapes = [shape for _, params in buckets(model) for _, shape in params]
    numel = sum(math.prod(s) for s in shapes)
    padded = sum(fsdp2_padded(s, m) for s in shapes)
    return (padded - numel) / padded


def run(
    device_counts: tuple[int, ...], granularities: tuple[vj.Granularity, ...], models: tuple[str, ...] = MODELS
) -> list[Result]:
    results = []
    for model in models:
        per_gran = {repr(g): bucket_inputs(model, g) for g in granularities}
        for m in device_counts:
            fsdp2 = fsdp2_padding(model, m)
            for name, inputs in per_gran.items():
                results.append(measure(model, m, name, inputs, fsdp2))
    return results


def pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def table(results: list[Result], time_limit: float = TIME_LIMIT_S) -> str:
    head = (
        "| model | m | granularity | buckets | padding | forced bound | FSDP2 dim-0 | max load / mean "
        "| plan CPU time (ms) | check |"
    )
    lines = [head, "|---|--:|---|--:|--:|--:|--:|--:|--:|---|"]
    for r in results:
        status = []
        if r.padding_failed:
            status.append(f"FAIL padding > {pct(r.allowed)}")
        if r.time_failed(time_limit):
            status.append(f"FAIL CPU time > {time_limit:g} s")
        if not status:
            status.append("ok" if r.gated else "ok (time only)")
        lines.append(
            f"| {r.model} | {r.m} | {r.granularity} | {r.num_buckets} | {pct(r.padding)} | {pct(r.forced)} "
            f"| {pct(r.fsdp2)} | {r.imbalance:.3f} | {1e3 * r.seconds:.1f} | {'; '.join(status)} |"
        )
    return "\n".join(lines)


def _are(count: int) -> str:
    return "is" if count == 1 else "are"


def _cfg(r: Result) -> str:
    return f"{r.model} m={r.m} {r.granularity}"


def reading(results: list[Result], time_limit: float = TIME_LIMIT_S) -> str:
    """A paragraph about the results, computed from them."""
    out: list[str] = []
    n = len(results)

    over = [r for r in results if r.padding > PAD_LIMIT]
    if not over:
        out.append(f"No configuration pads more than {pct(PAD_LIMIT)} of its buffers.")
    else:
        at_bound = [r for r in over if r.padding - r.forced <= BOUND_SLACK]
        far = [r for r in over if r.padding - r.forced > BOUND_SLACK]
        out.append(
            f"{len(over)} of {n} configurations pad more than {pct(PAD_LIMIT)}: "
            + ", ".join(f"{_cfg(r)} ({pct(r.padding)}, forced {pct(r.forced)})" for r in over)
            + "."
        )
        gated = [r for r in over if r.gated]
        out.append(
            f"{len(at_bound)} of these {len(over)} {_are(len(at_bound))} within 0.1 percentage point of "
            "the forced bound"
            + (f" ({', '.join(_cfg(r) for r in far)} {_are(len(far))} not)" if far else "")
            + (
                "; at the bound the padding is imposed by the blocks and the alignment (a block larger "
                "than numel/m, or S forced to a multiple of the blocks of tensors longer than 2S), not by "
                "the planner. "
                if at_bound
                else ". "
            )
            + (
                f"{len(gated)} of them {_are(len(gated))} gated (m <= {GATED_MAX_M}, {'/'.join(GATED_GRANULARITIES)}): "
                + ", ".join(_cfg(r) for r in gated)
                + "."
                if gated
                else f"None of them is gated (m <= {GATED_MAX_M}, {'/'.join(GATED_GRANULARITIES)})."
            )
        )

    gaps = [r for r in results if r.padding > r.forced]
    if not gaps:
        out.append("In every configuration the planner's padding equals the forced lower bound exactly.")
    else:
        out.append(
            f"The planner reaches the forced lower bound exactly in {n - len(gaps)} of {n} configurations. "
            "Above it: "
            + "; ".join(
                f"{_cfg(r)} by {100 * (r.padding - r.forced):.3f} pp, worst bucket {r.worst_bucket!r} with "
                f"S={r.worst_s} vs S_lb={r.worst_s_lb} (+{100 * (r.worst_s / r.worst_s_lb - 1):.3f}%)"
                for r in sorted(gaps, key=lambda r: r.forced - r.padding)
            )
            + ". The bound is only a necessary condition, so a gap means that either the planner missed a "
            "smaller S or S_lb is not achievable; this benchmark does not tell which."
        )

    less = [r for r in results if r.padding < r.fsdp2]
    more = [r for r in results if r.padding > r.fsdp2]
    parts = [f"Against even dim-0 sharding (FSDP2), the planner pads less in {len(less)} of {n} configurations"]
    if less:
        best = max(less, key=lambda r: r.fsdp2 - r.padding)
        parts.append(f" (most: {_cfg(best)}, {pct(best.padding)} vs {pct(best.fsdp2)})")
    parts.append(f" and more in {len(more)}")
    if more:
        worst = max(more, key=lambda r: r.padding - r.fsdp2)
        parts.append(f" (most: {_cfg(worst)}, {pct(worst.padding)} vs {pct(worst.fsdp2)})")
    parts.append(".")
    out.append("".join(parts))

    slow = max(results, key=lambda r: r.seconds)
    out.append(
        f"The slowest whole-model plan takes {1e3 * slow.seconds:.1f} ms of CPU time ({_cfg(slow)}), against a "
        f"limit of {1e3 * time_limit:g} ms; the fastest takes {1e3 * min(r.seconds for r in results):.1f} ms."
    )
    imb = max(results, key=lambda r: r.imbalance)
    out.append(f"The most loaded device of any bucket holds {imb.imbalance:.3f} times the mean load ({_cfg(imb)}).")
    return " ".join(out)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def report(results: list[Result], command: str, time_limit: float = TIME_LIMIT_S) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join(
        [
            "# Planner benchmark: padding and planning time",
            "",
            f"- date: {now}",
            f"- python {platform.python_version()}, jax {jax.__version__}, numpy {np.__version__}",
            f"- CPU: {cpu_name()}",
            f"- command: `{command}`",
            f"- bf16 parameters, align = {ALIGN} elements; time = CPU time (`time.process_time`), best of "
            f"{REPEATS} cold-cache runs",
            "",
            table(results, time_limit),
            "",
            "## Reading the table",
            "",
            reading(results, time_limit),
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write a markdown report to this path")
    parser.add_argument("--quick", action="store_true", help="only m in {8, 256} and element(), rows(1), rows(16)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=MODELS, help="models to plan (default: all)")
    parser.add_argument(
        "--time-limit", type=float, default=TIME_LIMIT_S, help="CPU seconds allowed per whole-model plan (0.1)"
    )
    parser.add_argument(
        "--no-time-gate", action="store_true", help="report planning time but do not fail on it (used by tests)"
    )
    args = parser.parse_args(argv)
    device_counts, grans = (QUICK_DEVICE_COUNTS, QUICK_GRANULARITIES) if args.quick else (DEVICE_COUNTS, GRANULARITIES)

    results = run(device_counts, grans, tuple(args.models))
    print(table(results, args.time_limit))
    print()
    print(reading(results, args.time_limit))
    if args.out is not None:
        command = shlex.join(["python", *sys.argv])
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report(results, command, args.time_limit))
        print(f"\nwrote {args.out}")

    failures = [
        f"{_cfg(r)}: padding {pct(r.padding)} > allowed {pct(r.allowed)} (forced bound {pct(r.forced)})"
        for r in results
        if r.padding_failed
    ] + [
        f"{_cfg(r)}: plan CPU time {1e3 * r.seconds:.1f} ms > {1e3 * args.time_limit:g} ms"
        for r in results
        if r.time_failed(args.time_limit) and not args.no_time_gate
    ]
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
