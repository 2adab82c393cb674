"""Training curves of the GPT example with quantized state and gathers, against their unquantized twins.

    python benchmarks/quant_training.py --out benchmarks/results/quant_training.md

Runs ``examples/train_gpt.py`` (250 steps, 8 simulated CPU devices, its default data and seed) four times:
AdamW vs ``--optimizer adamw8bit`` (fp32 compute), and ``--bf16`` vs ``--fp8-gather`` (bf16 compute). Each
pair is compared on the final training loss, the mean over the last 25 steps and the validation loss; the
gate is the final loss within 2 % (exit status 1 otherwise). ``--reuse DIR`` reads the ``--log-json``
files of earlier runs from ``DIR`` instead of training again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from importlib.metadata import version

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "train_gpt.py")
RUNS = {
    "adamw": [],
    "adamw8bit": ["--optimizer", "adamw8bit"],
    "bf16": ["--bf16"],
    "fp8": ["--fp8-gather"],
}
PAIRS = (("adamw", "adamw8bit"), ("bf16", "fp8"))
LIMIT = 0.02


def run(name: str, args: list[str], directory: str, steps: int) -> dict:
    path = os.path.join(directory, f"{name}.json")
    if not os.path.exists(path):
        cmd = [sys.executable, EXAMPLE, "--steps", str(steps), "--plot", "", "--log-json", path, *args]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reuse", default="/tmp/vj_quant_training", help="directory of the runs' JSON logs")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--out", help="write the tables (markdown) here")
    args = p.parse_args(argv)
    os.makedirs(args.reuse, exist_ok=True)
    logs = {name: run(name, extra, args.reuse, args.steps) for name, extra in RUNS.items()}
    curve = {name: {int(k): v for k, v in log["train"].items()} for name, log in logs.items()}
    last = max(curve["adamw"])
    lines = [
        "# Quantized training of the GPT example",
        "",
        f"`python benchmarks/quant_training.py`: `examples/train_gpt.py`, {last} steps, 8 simulated CPU devices.",
        "",
        f"JAX {version('jax')}, Flax {version('flax')}, Optax {version('optax')}, Python "
        f"{platform.python_version()}, {platform.machine()} CPU. The runs' arguments: "
        + "; ".join(f"{n}: `{' '.join(logs[n].get('argv', []))}`" for n in RUNS)
        + ".",
        "",
    ]
    failures = []
    lines += ["| pair | final loss | mean of last 25 | validation | final-loss difference |", "|---|---|---|---|---|"]
    for a, b in PAIRS:
        fa, fb = curve[a][last], curve[b][last]
        ma = sum(curve[a][s] for s in range(last - 24, last + 1)) / 25
        mb = sum(curve[b][s] for s in range(last - 24, last + 1)) / 25
        diff = (fb - fa) / fa
        lines.append(
            f"| {a} → {b} | {fa:.4f} → {fb:.4f} | {ma:.4f} → {mb:.4f} | "
            f"{logs[a]['val_loss']:.4f} → {logs[b]['val_loss']:.4f} | {diff:+.2%} |"
        )
        if abs(diff) > LIMIT:
            failures.append(f"{b}'s final loss differs from {a}'s by {diff:+.2%}")
    lines += ["", "Training loss every 25 steps (each a single batch of 32 × 128 bytes):", ""]
    lines += ["| step | " + " | ".join(RUNS) + " |", "|---|" + "---|" * len(RUNS)]
    for s in [1, *range(25, last + 1, 25)]:
        lines.append(f"| {s} | " + " | ".join(f"{curve[n][s]:.4f}" for n in RUNS) + " |")
    lines += ["", "All gates pass." if not failures else "\n".join(f"- FAILED: {f}" for f in failures)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
