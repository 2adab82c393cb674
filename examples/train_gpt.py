"""Train a small character-level GPT with vj.fsdp on the Python standard library's own source code.

    pip install -e ".[examples]" && python examples/train_gpt.py

Runs on every device JAX sees (8 simulated CPU devices when no GPU plugin is installed). Parameters, gradients
and AdamW state live sharded in the planner's flat buffers; each layer of the scanned block stack is gathered
inside the loop, one at a time.

Output: the plan; "compiling the train step…" and then how long tracing and lowering and compiling took; the
first step's time (compile + run); the loss every ``--log-every`` steps with tokens/s and s/step, counted from the
end of the first step with checkpoint saves left out (on a terminal a live ``rich`` progress bar shows every
step and a table sums up the timings; piped or logged, plain lines); the validation loss; a loss-curve PNG
(``--plot``, needs matplotlib). ``--help`` answers at once: the command line is parsed before JAX is imported.

Compiled executables go to JAX's persistent compilation cache (``--compile-cache DIR``, default
``$VESCALE_JAX_COMPILE_CACHE`` or ``~/.cache/vescale_jax/jax``; ``--no-compile-cache`` compiles afresh). A
second run with the same options reads them back instead of compiling: its "compiled the train step" line says
"read from the persistent cache", and its first step takes a fraction of the first run's. Tracing and lowering
are not cached; options that change the program (sizes, ``--steps``: the schedule's length) compile anew.

With ``--checkpoint-dir DIR`` the run saves params, optimizer state and the data loader's RNG state every
``--save-every`` steps (and at the last step) through ``vj.checkpoint.Manager``; ``--resume`` continues from the
latest finished step (on any device count), ``--stop-after N`` ends the run after step N as if it were killed:

    python examples/train_gpt.py --checkpoint-dir /tmp/gpt --stop-after 100
    python examples/train_gpt.py --checkpoint-dir /tmp/gpt --resume      # steps 101..250, same losses

``--resume`` without a directory holding a finished step is an error (``--resume-if-exists`` starts afresh
instead); a directory holding another run's steps is refused before training unless ``--overwrite``. On
``SIGTERM`` (a scheduler's preemption notice, sent to any process) every process saves the same step and the run
exits 0; the next launch with ``--resume`` goes on from it. ``--local-checkpoint-dir LOCAL`` also keeps each
process's own shards of the newest 2 steps in LOCAL every ``--local-save-every`` steps (and at every global save),
as they are on its devices; a resume with the same options and process layout reads them when every process has
the same step there, else the global checkpoint. The save's conversion is compiled before the timed
loop, and the first save's time and the later saves' are printed apart from s/step. A step that does not finish
within the watchdog's timeout (``--watchdog-s``, default: a multiple of the median step time) prints every
thread's stack and which processes are behind, and ends the process with a non-zero status.

As a multi-process job (a cluster's launcher, or processes on one machine) add the coordinator flags; each
process feeds only its rows of every batch:

    for i in 0 1; do python examples/train_gpt.py --coordinator 127.0.0.1:12345 --num-processes 2 \
        --process-id $i --local-devices 4 --plot "" & done; wait
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import (
    CacheStats,
    HelpFormatter,
    Progress,
    add_compile_cache_options,
    add_output_options,
    compile_cache,
    compile_cache_dir,
    plot_losses,
    simulate_cpu_devices,
)

if TYPE_CHECKING:  # imported where they are used, after the command line is parsed
    from collections.abc import Iterator

    import numpy as np

    import vescale_jax as vj


def stdlib_text(max_bytes: int, root: str | None = None) -> np.ndarray:
    """Bytes of the ``.py`` files under ``root`` (default: this Python's standard library), sorted, so every run
    and process reads the same."""
    import sysconfig

    import numpy as np

    root = root or sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("test", "tests", "site-packages", "idlelib"))
        for name in sorted(filenames):
            if name.endswith(".py") and total < max_bytes:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
                chunks.append(data)
                total += len(data)
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def shampoo_plan(shapes: Any, mesh: Any, block: int, stacked: str = "blocks") -> vj.Plan:
    """Plan for ``vj.optim.shampoo``: matrix leaves get ``vj.rows(block)``, so every block lies on one device.

    Units: the stacked matrices, the stacked vectors (biases, norm scales: rows(1)), and all the unstacked
    leaves (embeddings, head, final norm) in one bucket. Keeping the vectors apart and pooling the small
    unstacked matrices cuts the padding that whole ``block``-row bands force (33% -> 26% at block 64).
    """
    import vescale_jax as vj

    def is_matrix(path, leaf):
        return len(leaf.shape) - (vj.default_unit(path, leaf) == stacked) >= 2

    def units(path, leaf):
        u = vj.default_unit(path, leaf)
        if u != stacked:
            return "top"
        return u if is_matrix(path, leaf) else u + "_vectors"

    return vj.plan(
        shapes,
        mesh,
        stacked=(stacked, stacked + "_vectors"),
        units=units,
        granularity=lambda path, leaf: vj.rows(block if is_matrix(path, leaf) else 1),
    )


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator) -> Iterator[dict[str, np.ndarray]]:
    """Random windows of ``data``; the position is ``rng``'s state (saved with checkpoints, JSON)."""
    import numpy as np

    while True:
        start = rng.integers(0, len(data) - seq - 1, batch)
        window = np.stack([data[s : s + seq + 1] for s in start]).astype(np.int32)
        yield {"x": window[:, :-1], "y": window[:, 1:]}


def build_parser() -> argparse.ArgumentParser:
    """The command line (no JAX needed: ``--help`` answers at once)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=250, help="training steps (the learning-rate schedule's length)")
    p.add_argument("--batch", type=int, default=32, help="global batch (a multiple of the device count)")
    p.add_argument(
        "--seq", "--seq-len", type=int, default=128, help="bytes per training sequence (the model's context)"
    )
    p.add_argument(
        "--context",
        type=int,
        metavar="N",
        help="context parallelism: a (devices/N, N) ('fsdp', 'context') mesh, each sequence split over N devices "
        "(causal load balancing), the model attending with vj.attention; --context 1 is the same model without "
        "the split (default: off, an 'fsdp' mesh and the einsum attention)",
    )
    p.add_argument(
        "--positions",
        choices=("vj", "arange"),
        default="vj",
        help="how the model indexes its position table: 'vj' (vj.positions under --context) or 'arange' "
        "(jnp.arange(T), written for one device: under --context vj.fsdp gives it the tokens' global positions)",
    )
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (stacked, scanned one at a time)")
    p.add_argument("--d-model", type=int, default=128, help="model width (the MLP is 4x wider)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (dividing --d-model)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (warm-up, cosine decay)")
    p.add_argument("--data-mb", type=float, default=8.0, help="megabytes of stdlib source to train on")
    p.add_argument(
        "--data-dir",
        default=None,
        help="train on the .py files under this directory instead of this Python's standard library (the same "
        "corpus for two Pythons, e.g. to compare JAX versions)",
    )
    p.add_argument("--keep", action="store_true", help="keep gathered params for backward (no re-gather)")
    p.add_argument(
        "--remat",
        action="store_true",
        help="call each block under nnx.remat (the layer scan already keeps only each layer's input and recomputes "
        "the rest, so the peak stays the same: this shows a lifted NNX transform trains as without it)",
    )
    p.add_argument("--plot", default="train_gpt_loss.png", help="loss-curve PNG ('' to skip; needs matplotlib)")
    p.add_argument("--seed", type=int, default=0, help="initial parameters and data order")
    p.add_argument(
        "--optimizer",
        choices=("adamw", "adamw8bit", "muon", "shampoo"),
        default="adamw",
        help="adamw8bit: vj.optim.adamw_8bit, moments as 8-bit codes with one fp32 scale per 32x32 tile",
    )
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon's learning rate (AdamW's is --lr)")
    p.add_argument(
        "--shampoo-block",
        type=int,
        default=128,
        help="Shampoo's block edge; plans the matrices with rows(block) (at d_model 128: 64 pads the "
        "buffers 26%%, 128 pads 63%% but converges faster)",
    )
    p.add_argument("--shampoo-lr", type=float, default=6e-3, help="Shampoo's learning rate (AdamW's is --lr)")
    p.add_argument(
        "--log-json",
        metavar="PATH",
        help="write {'train': {step: loss}, 'val_loss', 's_per_step', 'first_step_s', ...} here (default: none)",
    )
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps per batch")
    p.add_argument("--bf16", action="store_true", help="gather and compute in bfloat16, reduce in float32")
    p.add_argument(
        "--offload",
        action="store_true",
        help="keep the optimizer state in pinned host memory between steps, streamed through the update (vj.Offload)",
    )
    p.add_argument(
        "--fp8-gather",
        action="store_true",
        help="with --bf16's dtypes, gather the matrices as FP8 codes with one fp32 scale per 128x128 tile "
        "(planned tile-major with vj.tiles(128, 128))",
    )
    p.add_argument(
        "--watchdog-s",
        type=float,
        help="end the run (stacks printed, non-zero status) when a step takes longer than this; default: "
        "vj.distributed.Watchdog's (a multiple of the median step time, with a floor)",
    )
    p.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address, for a multi-process job (default: one process)"
    )
    p.add_argument(
        "--num-processes", type=int, help="processes in a multi-process job (default: the launcher's, or one)"
    )
    p.add_argument("--process-id", type=int, help="this process's index in the job (default: the launcher's, or 0)")
    p.add_argument("--local-devices", type=int, help="CPU devices per process (CPU multi-process runs; default: JAX's)")
    p.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save checkpoints here (vj.checkpoint.Manager; default: none)"
    )
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (and the last step)")
    p.add_argument(
        "--local-checkpoint-dir",
        metavar="LOCAL",
        help="also keep each process's own shards of the newest 2 steps here, for fast restarts (default: none)",
    )
    p.add_argument(
        "--local-save-every",
        type=int,
        help="steps between local copies (with --local-checkpoint-dir; default: --save-every)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument(
        "--resume-if-exists",
        action="store_true",
        help="like --resume, but start afresh when --checkpoint-dir holds no finished step",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="let the first save delete another run's steps in --checkpoint-dir"
    )
    p.add_argument(
        "--stop-after",
        type=int,
        help="end the run after this step (a simulated kill; --steps still sets the schedule; default: run to --steps)",
    )
    add_output_options(p)
    add_compile_cache_options(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parses the command line (before JAX is imported), sets up the devices and the compilation cache, trains."""
    p = build_parser()
    args = p.parse_args(argv)
    if (args.resume or args.resume_if_exists) and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir (the directory a previous run saved into)")
    if (args.local_checkpoint_dir or args.local_save_every) and not args.checkpoint_dir:
        p.error("--local-checkpoint-dir and --local-save-every need --checkpoint-dir (the global checkpoint)")
    if args.local_save_every and not args.local_checkpoint_dir:
        p.error("--local-save-every needs --local-checkpoint-dir")
    multi_process = args.coordinator is not None or args.num_processes is not None
    simulate_cpu_devices(None if multi_process else 8)  # a multi-process CPU job: --local-devices per process
    with compile_cache(compile_cache_dir(args)) as cache:
        return train(args, p, cache, argv)


def train(
    args: argparse.Namespace, p: argparse.ArgumentParser, cache: CacheStats, argv: list[str] | None
) -> dict[str, float]:
    """The run: plan, initialise (or resume), compile, train, validate, plot."""
    import jax
    import numpy as np
    import optax
    from gpt import GPTConfig, abstract_model, init_params, loss_fn, muon_dimension_numbers

    import vescale_jax as vj

    vj.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        local_device_count=args.local_devices,
    )
    mngr, first = None, 1
    if args.checkpoint_dir:  # checked before any work: a wrong directory ends the run at once
        hint = "; check the path, or pass --resume-if-exists to start afresh when there is nothing to resume"
        if args.resume and not os.path.isdir(args.checkpoint_dir):  # before the Manager creates it
            p.error(f"--resume: {args.checkpoint_dir} does not exist{hint}")
        mngr = vj.checkpoint.Manager(
            args.checkpoint_dir,
            max_to_keep=2,
            async_save=True,
            overwrite=args.overwrite,
            save_interval_steps=args.save_every,
            local_dir=args.local_checkpoint_dir,
            local_every=args.local_save_every,
        )
        if args.resume and mngr.latest_step() is None:
            mngr.close()
            p.error(f"--resume: {args.checkpoint_dir} holds no finished checkpoint{hint}")
        if not ((args.resume or args.resume_if_exists) and mngr.latest_step() is not None):
            try:  # a fresh run: a directory holding another run's steps is refused now, not at the first save
                mngr.check_directory(1)
            except ValueError as e:
                mngr.close()
                p.error(f"{e} (the flag: --overwrite)")
    lead = jax.process_index() == 0
    devices = jax.devices()
    cp = args.context
    if cp is not None and (cp < 1 or len(devices) % cp or args.seq % (2 * cp)):
        p.error(
            f"--context {cp}: needs a divisor of the {len(devices)} devices, and --seq-len {args.seq} a multiple "
            f"of 2 x {cp} (causal load balancing cuts each sequence into 2 x {cp} chunks)"
        )
    if cp is not None and args.microbatches > 1:
        p.error("--context with --microbatches is not supported: leave one of them out")
    if cp is None:
        mesh = jax.make_mesh((len(devices),), ("fsdp",))
    else:  # parameters sharded over fsdp only, replicated over context
        mesh = jax.make_mesh((len(devices) // cp, cp), ("fsdp", "context"))
    cfg = GPTConfig(
        attention="einsum" if cp is None else "context",
        attention_implementation=None if cp is None else "all_gather",  # K and V gathered over the context axis
        vocab=256,
        max_len=args.seq,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        d_ff=4 * args.d_model,
        remat=args.remat,
        positions=args.positions,
    )
    graphdef, shapes = abstract_model(cfg)
    if args.optimizer == "shampoo":  # every b x b block on one device: rows(b) for the matrices
        plan = shampoo_plan(shapes, mesh, args.shampoo_block)
    elif args.optimizer == "adamw8bit" and not args.fp8_gather:  # every 32 x 32 state block on one device
        plan = vj.plan(
            shapes,
            mesh,
            stacked=("blocks",),
            granularity=lambda path, leaf: vj.tiles(32, 32) if leaf.ndim >= 2 else vj.rows(1),
        )
    elif args.fp8_gather:  # every 128 x 128 tile whole on one device, stored contiguously
        plan = vj.plan(
            shapes,
            mesh,
            stacked=("blocks",),
            granularity=lambda path, leaf: vj.tiles(128, 128) if leaf.ndim >= 2 else vj.rows(1),
        )
    else:
        plan = vj.plan(shapes, mesh, stacked=("blocks",), granularity=vj.rows(1))
    n_params = sum(s.size for s in plan.leaves)
    if lead:
        print(
            f"{n_params / 1e6:.2f} M parameters on {len(devices)} {devices[0].platform} devices in "
            f"{jax.process_count()} process(es)\n{plan.summary()}\n"
        )
        if args.optimizer == "shampoo":
            print(f"{vj.optim.shampoo_blocks(plan, args.shampoo_block).summary()}\n")

    data = stdlib_text(int(args.data_mb * 2**20), args.data_dir)
    split = int(0.95 * len(data))
    train_rng = np.random.default_rng(args.seed)
    train = batches(data[:split], args.batch, args.seq, train_rng)
    val = batches(data[split:], args.batch, args.seq, np.random.default_rng(args.seed + 1))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 10 + 1), args.steps)
    if args.optimizer == "muon":  # Newton-Schulz once per matrix, on a load-balanced owner device
        muon_lr = optax.warmup_cosine_decay_schedule(0.0, args.muon_lr, min(100, args.steps // 10 + 1), args.steps)
        tx = optax.chain(
            optax.clip_by_global_norm(1.0),
            vj.optim.muon(
                muon_lr,
                plan=plan,
                adam_learning_rate=schedule,
                weight_decay=0.1,
                muon_weight_dimension_numbers=muon_dimension_numbers(shapes),
            ),
        )
    elif args.optimizer == "shampoo":  # blocked Shampoo (Adam-grafted) on matrices, AdamW on the rest
        shampoo_lr = optax.warmup_cosine_decay_schedule(
            0.0, args.shampoo_lr, min(100, args.steps // 10 + 1), args.steps
        )
        tx = optax.chain(
            optax.clip_by_global_norm(1.0),
            vj.optim.shampoo(shampoo_lr, plan=plan, block_size=args.shampoo_block, beta2=0.99, weight_decay=0.1),
        )
    elif args.optimizer == "adamw8bit":  # 8-bit moments on each device's own 32 x 32 tiles, no collective
        tx = optax.chain(
            optax.clip_by_global_norm(1.0), vj.optim.adamw_8bit(schedule, plan=plan, b2=0.99, weight_decay=0.1)
        )
    else:
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=0.1))

    params = vj.init_sharded(lambda key: init_params(cfg, key), plan, jax.random.key(args.seed))
    offload = vj.Offload() if args.offload else None
    opt_state = vj.init_opt_state(tx, params, offload=offload)
    if mngr is not None and mngr.latest_step() is not None and (args.resume or args.resume_if_exists):
        # into this run's plan, whatever the device count
        target = jax.eval_shape(tx.init, params)  # the state's form: offloaded with --offload, whatever was saved
        restored = mngr.restore(params=plan, opt_state=jax.eval_shape(vj.offload, target) if offload else target)
        params, opt_state, first = restored.params, restored.opt_state, restored.step + 1
        train_rng.bit_generator.state = restored.metadata["train_rng"]
        if lead:
            where = f" (local copies in {args.local_checkpoint_dir})" if restored.source == "local" else ""
            print(f"resumed from step {restored.step} of {args.checkpoint_dir}{where}")

    precision = None
    if args.bf16 or args.fp8_gather:
        fp8 = (128, 128) if args.fp8_gather else None
        precision = vj.MixedPrecision(compute_dtype="bfloat16", reduce_dtype="float32", fp8_gather=fp8)
    rows = vj.distributed.local_batch_slice(args.batch)  # this process's rows of every batch

    @vj.fsdp(
        plan=plan,
        reshard_after_forward=not args.keep,
        precision=precision,
        microbatches=args.microbatches if args.microbatches > 1 else None,
        offload=offload,
        context_axis=None if cp is None else "context",
    )
    def train_step(params, opt_state, batch):
        def loss_of(p, b):
            return loss_fn(vj.flax.nnx_apply(graphdef, p, b["x"]), b["y"])

        if args.microbatches > 1:
            loss, grads = vj.accumulate(loss_of, params, batch)
        else:
            loss, grads = jax.value_and_grad(loss_of)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    @vj.fsdp(plan=plan, donate=False, context_axis=None if cp is None else "context")
    def eval_step(params, _, batch):
        return loss_fn(vj.flax.nnx_apply(graphdef, params, batch["x"]), batch["y"])

    def local(batch):
        return {k: v[rows] for k, v in batch.items()}

    if mngr is not None:
        t = time.perf_counter()
        mngr.prepare(params=params, opt_state=opt_state)  # compile the save's conversion before the timed loop
        if lead:
            print(f"checkpoint conversion compiled in {time.perf_counter() - t:.2f} s", flush=True)

    last = min(args.steps, args.stop_after or args.steps)
    progress = Progress(
        args.steps, items_per_step=args.batch * args.seq, first=first, every=args.log_every, show=lead, cache=cache
    )
    batch = local(next(train))  # the first step's batch (drawn in order: the data RNG's state is checkpointed)
    compiled = progress.compile(train_step, params, opt_state, batch)  # timed apart; JAX keeps the executable
    try:
        peak_bytes = vj.testing.memory(compiled).peak
    except ValueError:  # a backend that reports no memory analysis
        peak_bytes = None
    if lead and peak_bytes is not None:
        remat = "each block under nnx.remat" if args.remat else "no remat"
        print(f"compiled train step: {peak_bytes / 2**20:.2f} MiB peak per device ({remat})", flush=True)
    preempted = None
    save_s: list[float] = []  # wall time of each save call (async: the conversion; the write runs behind)
    watchdog = vj.distributed.Watchdog(args.watchdog_s)
    with watchdog:
        for step in range(first, last + 1):
            if step > first:
                batch = local(next(train))
            with watchdog.step(step):
                params, opt_state, metrics = train_step(params, opt_state, batch)
                jax.block_until_ready(metrics["loss"])  # the step has finished (what the watchdog times)
            progress.step(step, float(metrics["loss"]))
            if mngr is not None:
                if mngr.reached_preemption(step):  # SIGTERM reached some process: all save this step
                    preempted = step
                to_global = preempted or step % args.save_every == 0 or step == last
                if to_global or mngr.should_save(step):  # should_save: also a --local-save-every step
                    t = time.perf_counter()
                    with progress.excluded("checkpoint saves"):
                        mngr.save(
                            step,
                            params=params,
                            opt_state=opt_state,
                            force=to_global,  # else only the local copy
                            metadata={"train_rng": train_rng.bit_generator.state, "argv": sys.argv[1:]},
                        )
                    save_s.append(time.perf_counter() - t)
            if preempted:
                break
    jax.block_until_ready(params)
    timing = progress.close()
    losses = progress.losses  # {step: loss}
    if mngr is not None:
        t = time.perf_counter()
        mngr.wait()
        mngr.close()
        wait_s = time.perf_counter() - t

    def write_log(**extra: Any) -> None:
        """The ``--log-json`` file (process 0): the losses so far, and what else the run measured."""
        if args.log_json and lead:
            log = {"optimizer": args.optimizer, "argv": sys.argv[1:] if argv is None else argv, "train": losses}
            timings = {k: timing[k] for k in ("first_step_s", "lower_s", "compile_s", "first_run_s")}
            timings["peak_bytes"] = peak_bytes
            with open(args.log_json, "w") as f:
                json.dump({**log, **timings, **extra}, f, indent=0)

    if preempted:
        write_log()
        if lead:
            print(
                f"preempted: saved step {preempted} to {args.checkpoint_dir} and stopped; resume with --resume "
                "(exit status 0)"
            )
        return {"preempted_at": preempted}
    t = time.perf_counter()
    val_loss = float(np.mean([float(eval_step(params, None, local(next(val)))) for _ in range(4)]))
    val_s = time.perf_counter() - t
    seconds_per_step = timing["s_per_step"] or float("nan")
    write_log(val_loss=val_loss, s_per_step=seconds_per_step)
    first_loss, last_loss = losses[first], losses[last]
    if not lead:
        return {"first_loss": first_loss, "last_loss": last_loss, "val_loss": val_loss}
    print(
        f"first loss {first_loss:.3f}, last loss {last_loss:.3f}, validation loss {val_loss:.3f} "
        f"(uniform over 256 bytes: {np.log(256):.3f}); {seconds_per_step:.3f} s/step after the compile"
        + (", saves excluded" if timing["excluded_s"] else "")
        + f"; validation {val_s:.2f} s (its step's compile included)"
    )
    if mngr is not None:
        later = save_s[1:]
        print(
            f"checkpoints: first save {save_s[0]:.2f} s"
            + (f", later saves median {np.median(later):.2f} s ({len(later)})" if later else "")
            + f", final wait for the writes {wait_s:.2f} s"
            if save_s
            else "checkpoints: none saved"
        )
    if args.plot:
        title = f"vj.fsdp char-level GPT, {n_params / 1e6:.1f} M params, {len(devices)} devices"
        plot_losses(args.plot, list(losses), list(losses.values()), val_loss=val_loss, title=title)
    return {"first_loss": first_loss, "last_loss": last_loss, "val_loss": val_loss}


if __name__ == "__main__":
    main()
