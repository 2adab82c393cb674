"""Fine-tune a Hugging Face Llama-format checkpoint (safetensors) with vj.fsdp, and save it back in the same format.

    python examples/finetune_llama.py                                  # a small random checkpoint, written first
    python examples/finetune_llama.py --safetensors DIR --save OUT    # a Llama / Mistral / Qwen2 directory

``DIR`` holds ``config.json`` and ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` with
``model.safetensors.index.json``, as ``transformers`` writes them. Each device reads only its own ranges of the
tensors (``vj.checkpoint.load_safetensors``) straight into the planner's flat shards; the whole model is never
materialised on one device. The model is ``examples/llama.py`` (Flax NNX, parameters named like transformers'
``FlaxLlamaForCausalLM``), trained with AdamW on the bytes of Python standard-library source (token id = byte
value, so any vocabulary of at least 256 entries works; nothing is downloaded). ``--save OUT`` writes the
fine-tuned weights in Hugging Face's names and layout plus a copy of ``config.json``: ``transformers`` (or this
script, with ``--safetensors OUT``) loads them back.

Without ``--safetensors`` the script first writes a random checkpoint of a small Llama (several files, an index
json and ``config.json``; PyTorch names and ``(out, in)`` shapes) with the ``safetensors`` package alone, into
``--random-dir`` or a temporary directory, and fine-tunes that. Runs on ``--devices`` devices (simulated CPU
devices when there is no GPU). Progress and the compilation cache as in the other examples (``examples/progress.py``:
the compile timed apart, tokens/s and s/step after the first step, ``--compile-cache DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from progress import (  # imports nothing heavy: --help stays instant
    CacheStats,
    HelpFormatter,
    Progress,
    add_compile_cache_options,
    add_output_options,
    compile_cache,
    compile_cache_dir,
    simulate_cpu_devices,
)

# The random checkpoint's model: a small Llama with grouped-query attention (4 query heads, 2 key/value heads).
RANDOM_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "initializer_range": 0.02,
    "torch_dtype": "float32",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (parsed before JAX is imported, so ``--help`` is instant)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument(
        "--safetensors",
        metavar="DIR",
        help="Hugging Face checkpoint directory (config.json + *.safetensors); default: write a random one and use it",
    )
    p.add_argument("--steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (a multiple of the device count)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (at most max_position_embeddings)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's peak learning rate (linear warm-up, cosine decay)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's decoupled weight decay")
    p.add_argument(
        "--bf16", action="store_true", help="gather and compute in bfloat16, reduce gradients in float32 (fp32 masters)"
    )
    p.add_argument(
        "--devices",
        type=int,
        help="devices to shard over; without a GPU, the number of simulated CPU devices (default: 8; with a GPU, "
        "default: all of them)",
    )
    p.add_argument(
        "--save",
        metavar="OUT",
        help="write the fine-tuned weights here: safetensors in the checkpoint's torch_dtype, and config.json",
    )
    p.add_argument(
        "--max-shard-size", default="5GB", help="with --save: the largest safetensors file (e.g. 500MB, 5GB)"
    )
    p.add_argument("--log-json", metavar="PATH", help="write {'train': {step: loss}, 'load_s', 'compile_s', ...} here")
    p.add_argument("--seed", type=int, default=0, help="data order (and the random checkpoint's values)")
    p.add_argument(
        "--random-dir",
        metavar="DIR",
        help="without --safetensors: write the random checkpoint here (default: a temp dir)",
    )
    p.add_argument("--random-layers", type=int, default=4, help="without --safetensors: the random model's layers")
    p.add_argument("--random-files", type=int, default=3, help="without --safetensors: safetensors files to split into")
    p.add_argument(
        "--random-tied", action="store_true", help="without --safetensors: tie the random model's head to its embedding"
    )
    p.add_argument(
        "--random-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="without --safetensors: the dtype the random checkpoint is stored in",
    )
    add_output_options(p, every=1)
    add_compile_cache_options(p)
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1 or args.seq_len < 2:
        p.error("--steps and --batch-size must be positive and --seq-len at least 2")
    return args


def hf_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Llama checkpoint as PyTorch ``transformers`` writes it: ``nn.Linear`` weights
    are ``(out, in)``; ``lm_head.weight`` is absent when the head is tied to the embedding."""
    v, d, f = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    n, layers = config["num_attention_heads"], config["num_hidden_layers"]
    g = config.get("num_key_value_heads") or n
    k = config.get("head_dim") or d // n
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(layers):
        pre = f"model.layers.{i}"
        shapes[f"{pre}.input_layernorm.weight"] = (d,)
        for name, out_dim in (("q_proj", n * k), ("k_proj", g * k), ("v_proj", g * k)):
            shapes[f"{pre}.self_attn.{name}.weight"] = (out_dim, d)
            if config.get("attention_bias"):
                shapes[f"{pre}.self_attn.{name}.bias"] = (out_dim,)
        shapes[f"{pre}.self_attn.o_proj.weight"] = (d, n * k)
        if config.get("attention_bias") and config.get("model_type") != "qwen2":
            shapes[f"{pre}.self_attn.o_proj.bias"] = (d,)
        shapes[f"{pre}.post_attention_layernorm.weight"] = (d,)
        shapes[f"{pre}.mlp.gate_proj.weight"] = (f, d)
        shapes[f"{pre}.mlp.up_proj.weight"] = (f, d)
        shapes[f"{pre}.mlp.down_proj.weight"] = (d, f)
    shapes["model.norm.weight"] = (d,)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (v, d)
    return shapes


def write_random_checkpoint(directory: str, config: dict[str, Any], *, seed: int = 0, num_files: int = 3) -> int:
    """Writes a randomly initialised Llama in Hugging Face's layout with the ``safetensors`` package alone.

    ``config.json``; ``model-0000i-of-0000n.safetensors`` (tensors in checkpoint order, split into ``num_files``
    files of about equal size) and ``model.safetensors.index.json`` mapping every name to its file; or one
    ``model.safetensors`` when ``num_files`` is 1. Norm weights are ones, everything else normal(0,
    ``initializer_range``); stored in ``config["torch_dtype"]`` (float32 or bfloat16).

    Returns:
      The bytes of tensor data written.
    """
    from safetensors.numpy import save_file

    if config.get("torch_dtype") == "bfloat16":
        import ml_dtypes  # NumPy's bfloat16 (a JAX dependency, installed with it)

        dtype = np.dtype(ml_dtypes.bfloat16)
    else:
        dtype = np.dtype(config.get("torch_dtype", "float32"))
    rng = np.random.default_rng(seed)
    std = config.get("initializer_range", 0.02)
    tensors = {
        name: (np.ones(shape) if name.endswith("norm.weight") else rng.normal(0.0, std, shape)).astype(dtype)
        for name, shape in hf_shapes(config).items()
    }
    os.makedirs(directory, exist_ok=True)
    total = sum(t.nbytes for t in tensors.values())
    if num_files <= 1:
        save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    else:
        files: list[dict[str, np.ndarray]] = [{} for _ in range(num_files)]
        written = 0
        for name, t in tensors.items():  # in order: file j holds the tensors starting in its share of the bytes
            files[min(num_files - 1, written * num_files // total)][name] = t
            written += t.nbytes
        weight_map = {}
        for j, part in enumerate(files):
            fname = f"model-{j + 1:05d}-of-{num_files:05d}.safetensors"
            save_file(part, os.path.join(directory, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return total


def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """Bytes of the standard library's top-level ``.py`` files, sorted by name (the same on every run)."""
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        if name.endswith(".py") and total < max_bytes:
            with open(os.path.join(root, name), "rb") as f:
                chunks.append(f.read())
            total += len(chunks[-1])
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8)


def save_dtype(directory: str) -> str | None:
    """The dtype a checkpoint's ``config.json`` says its tensors are in (``torch_dtype``, or ``dtype`` in newer
    transformers), if it names a float dtype; None (keep the params' float32) otherwise."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    dtype = config.get("torch_dtype") or config.get("dtype")
    return dtype if dtype in ("float32", "bfloat16", "float16") else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    simulate_cpu_devices(args.devices or 8)  # no GPU: simulated CPU devices (before JAX is imported)

    tmp = None
    if args.safetensors is None:  # write a random checkpoint first, exactly as transformers would lay it out
        if args.random_dir is None:
            tmp = tempfile.TemporaryDirectory(prefix="random_llama_")
        directory = args.random_dir or tmp.name
        config = {
            **RANDOM_CONFIG,
            "num_hidden_layers": args.random_layers,
            "tie_word_embeddings": args.random_tied,
            "torch_dtype": args.random_dtype,
        }
        written = write_random_checkpoint(directory, config, seed=args.seed, num_files=args.random_files)
        print(
            f"wrote a random Llama checkpoint ({written / 2**20:.1f} MiB, {args.random_files} file(s)) to {directory}"
        )
    else:
        directory = args.safetensors
    try:
        with compile_cache(compile_cache_dir(args)) as cache:
            return train(args, directory, cache)
    finally:
        if tmp is not None:
            tmp.cleanup()


def train(args: argparse.Namespace, directory: str, cache: CacheStats | None = None) -> dict[str, Any]:
    """Load ``directory`` into a plan over the devices, fine-tune, report, and save with ``--save``."""
    import jax
    import optax
    from llama import LlamaConfig, abstract_model, loss_fn

    import vescale_jax as vj

    cfg = LlamaConfig.from_json_file(directory)
    if cfg.vocab_size < 256:
        raise SystemExit(f"finetune_llama.py: the data are bytes; vocab_size={cfg.vocab_size} is below 256")
    if args.seq_len > cfg.max_position_embeddings:
        raise SystemExit(f"finetune_llama.py: --seq-len {args.seq_len} > max_position_embeddings")
    if args.devices and args.devices > len(jax.devices()):
        raise SystemExit(f"finetune_llama.py: --devices {args.devices}, but JAX sees {len(jax.devices())}")
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    if args.batch_size % len(devices):
        raise SystemExit(
            f"finetune_llama.py: --batch-size {args.batch_size} is not a multiple of {len(devices)} devices"
        )
    mesh = jax.make_mesh((len(devices),), ("fsdp",), devices=devices)

    graphdef, shapes = abstract_model(cfg)  # shapes only: nothing allocated
    plan = vj.plan(shapes, mesh)  # one unit per top-level module and per layer (model/layers/i)
    n_params = sum(s.size for s in plan.leaves)
    print(f"{n_params / 1e6:.2f} M parameters on {len(devices)} {devices[0].platform} devices\n{plan.summary()}\n")

    # Each device reads its own ranges of the files, straight into its shard of the flat buffers.
    mapping = vj.checkpoint.llama_mapping(tied=cfg.tie_word_embeddings)
    t, stats = time.perf_counter(), {}
    # The plan is float32 (master weights): bf16 or f16 files widen into it.
    params = vj.checkpoint.load_safetensors(directory, plan, mapping=mapping, stats=stats)
    jax.block_until_ready(params)
    load_s = time.perf_counter() - t
    read = stats["bytes_read"]
    print(
        f"loaded {directory} in {load_s:.2f} s: read {read / 2**20:.2f} MiB in {stats['reads']} reads "
        f"({stats['data_bytes'] / 2**20:.2f} MiB of tensor data in the files)"
    )

    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, max(1, args.steps // 10), args.steps)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=args.weight_decay))
    opt_state = vj.init_opt_state(tx, params)
    precision = vj.MixedPrecision(compute_dtype="bfloat16", reduce_dtype="float32") if args.bf16 else None

    @vj.fsdp(precision=precision)
    def train_step(params, opt_state, batch):
        def loss_of(p):
            return loss_fn(vj.flax.nnx_apply(graphdef, p, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # Data: random windows of standard-library source, one token per byte.
    data = stdlib_bytes(2**20)
    rng = np.random.default_rng(args.seed)

    def batch() -> dict[str, np.ndarray]:
        start = rng.integers(0, len(data) - args.seq_len - 1, args.batch_size)
        window = np.stack([data[s : s + args.seq_len + 1] for s in start]).astype(np.int32)
        return {"x": window[:, :-1], "y": window[:, 1:]}

    # The step is compiled first, timed apart; tokens/s and s/step count the steps after the first.
    progress = Progress(args.steps, items_per_step=args.batch_size * args.seq_len, every=args.log_every, cache=cache)
    first = batch()
    progress.compile(train_step, params, opt_state, first)
    for step in range(1, args.steps + 1):
        params, opt_state, loss = train_step(params, opt_state, first if step == 1 else batch())
        progress.step(step, float(loss))  # float(): waits for the step
    timing = progress.close()
    losses = progress.losses
    print(f"loss {losses[1]:.3f} -> {losses[args.steps]:.3f} in {args.steps} steps")

    save_s = None
    if args.save:
        t = time.perf_counter()
        # In the checkpoint's own dtype (config.json's torch_dtype, e.g. bfloat16: cast="any" allows narrowing).
        vj.checkpoint.save_safetensors(
            params,
            args.save,
            mapping=mapping,
            max_shard_size=args.max_shard_size,
            dtype=save_dtype(directory),
            cast="any",
        )
        shutil.copyfile(os.path.join(directory, "config.json"), os.path.join(args.save, "config.json"))
        save_s = time.perf_counter() - t
        print(f"saved the fine-tuned weights to {args.save} in {save_s:.2f} s")

    result = {
        "train": losses,
        "load_s": load_s,
        "bytes_read": read,
        "save_s": save_s,
        **timing,
        "devices": len(devices),
        "args": vars(args),
    }
    if args.log_json:
        with open(args.log_json, "w") as f:
            json.dump(result, f, indent=0)
    return result


if __name__ == "__main__":
    main()
