"""The examples' command lines and output: ``--help`` answers without importing JAX and shows a help text and the
default of every option; JAX's persistent compilation cache (``--compile-cache DIR``) is written by a first run
and read back by a second, whose first step is reported; the progress helper (examples/progress.py) prints plain
lines off a terminal, leaves excluded time out of s/step and puts JAX's settings back after a run."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT, child_pythonpath, load_script

EXAMPLES = ("train_gpt.py", "train_gpt_tp.py", "shard_model.py", "train_dropout_batchnorm.py", "finetune_llama.py")
# Never imported to answer --help: JAX and what imports it.
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "vescale_jax", "matplotlib", "rich")
OURS = {"train_gpt.py", "train_gpt_tp.py", "shard_model.py", "train_dropout_batchnorm.py"}  # no NumPy either

TINY_GPT = ["--plot=", "--data-mb", "0.2", "--layers", "1", "--d-model", "16", "--heads", "2", "--batch", "8"]
TINY_GPT += ["--seq", "16", "--steps", "3"]


def help_entries(text: str) -> dict[str, str]:
    """``{option: its help text}`` of an argparse help message (``--help`` itself left out)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        start = re.match(r"^  (-\S+(?:,? -?\S+)*?)(?: {2,}(\S.*))?$", line)
        if start:
            names = [n.split()[0] for n in start.group(1).split(", ")]
            current = names[-1]
            entries[current] = start.group(2) or ""
        elif current is not None and line.startswith("    ") and line.strip():
            entries[current] = (entries[current] + " " + line.strip()).strip()
        elif not line.strip() or not line.startswith(" "):
            current = None
    entries.pop("--help", None)
    return entries


@pytest.mark.parametrize("script", EXAMPLES)
def test_help_answers_without_importing_jax(script):
    env = {**child_pythonpath(), "COLUMNS": "100"}
    t = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-X", "importtime", os.path.join(ROOT, "examples", script), "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    seconds = time.monotonic() - t
    assert out.returncode == 0, out.stderr[-3000:]
    assert seconds < 20, f"{script} --help took {seconds:.1f} s"  # a hang guard: ~0.2 s on a quiet machine
    imported = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert len(imported) > 10, out.stderr[-2000:]  # the import log is there
    heavy = HEAVY + (("numpy",) if script in OURS else ())
    loaded = sorted(m for m in imported if m.split(".")[0] in heavy)
    assert not loaded, f"{script} --help imported {loaded[:10]}"

    entries = help_entries(out.stdout)
    assert len(entries) >= 3, out.stdout
    no_help = [name for name, text in entries.items() if not text]
    assert not no_help, f"{script}: options without help text: {no_help}\n{out.stdout}"
    no_default = [name for name, text in entries.items() if "default" not in text]
    assert not no_default, f"{script}: options whose help shows no default: {no_default}\n{out.stdout}"
    if script in OURS:
        assert "--compile-cache" in entries and "--no-compile-cache" in entries


def test_help_entries_parser():
    text = (
        "options:\n  -h, --help            show this help message and exit\n"
        "  --steps STEPS         training steps (default: 250)\n"
        "  --resume-if-exists    like --resume, but start afresh when --checkpoint-dir\n"
        "                        holds no finished step (default: False)\n"
        "  --compile-cache DIR   JAX's cache\n  --no-help\n"
        "  --optimizer {adamw,muon}\n                        adamw8bit: 8-bit (default: adamw)\n"
    )
    assert help_entries(text) == {
        "--steps": "training steps (default: 250)",
        "--resume-if-exists": "like --resume, but start afresh when --checkpoint-dir holds no finished step "
        "(default: False)",
        "--compile-cache": "JAX's cache",
        "--no-help": "",
        "--optimizer": "adamw8bit: 8-bit (default: adamw)",
    }


def run_example(argv: list[str], log: str) -> tuple[str, dict]:
    env = {**child_pythonpath(), "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py"), *argv, "--log-json", log],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard: ~15 s a run on a quiet machine
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    with open(log) as f:
        return out.stdout, json.load(f)


def cache_entries(directory) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith("-cache")}


@pytest.mark.slow  # two runs of the example: 70 s on 2 loaded cores (imports, compiles)
def test_compile_cache_is_written_then_read_back(tmp_path):
    """Two runs of train_gpt.py with one --compile-cache: the first compiles and writes every executable, the
    second reads the train step back (no new entry) and reports its first step (compile + run) again."""
    cache = tmp_path / "cache"
    argv = [*TINY_GPT, "--compile-cache", str(cache), "--log-every", "1"]
    out1, log1 = run_example(argv, str(tmp_path / "first.json"))
    written = cache_entries(cache)
    assert any(name.startswith("jit_traced-") for name in written), written  # vj.fsdp's step
    assert "compiling the train step…" in out1
    assert re.search(r"compiled the train step in [\d.]+ s: .*1 compiled and written to the persistent cache", out1)
    assert re.search(r"step +1/3 +loss +[\d.]+ +first step [\d.]+ s", out1), out1
    assert re.search(r"step +3/3 +loss +[\d.]+ +[\d,]+ tokens/s +[\d.]+ s/step", out1), out1
    assert "timing: first step" in out1

    out2, log2 = run_example(argv, str(tmp_path / "second.json"))
    assert cache_entries(cache) == written  # every executable of the second run came from the cache
    assert re.search(r"compiled the train step in [\d.]+ s: .*\(1 read from the persistent cache, saving", out2), out2
    assert "written to the persistent cache" not in out2
    assert log2["train"] == log1["train"]  # the same programs: the same losses
    for log in (log1, log2):
        assert log["first_step_s"] == pytest.approx(log["lower_s"] + log["compile_s"] + log["first_run_s"])
    assert log2["compile_s"] < log1["compile_s"], (log1, log2)  # read back, not compiled


def test_compile_cache_options():
    progress = load_script("examples/progress.py")
    parser = argparse.ArgumentParser()
    progress.add_compile_cache_options(parser)
    assert progress.compile_cache_dir(parser.parse_args(["--no-compile-cache"])) is None
    assert progress.compile_cache_dir(parser.parse_args(["--compile-cache", "~/x"])) == os.path.expanduser("~/x")
    with pytest.raises(SystemExit):
        parser.parse_args(["--no-compile-cache", "--compile-cache", "x"])  # one or the other


def test_compile_cache_in_process_puts_jax_settings_back(tmp_path):
    """An example's main() run in a test process uses the cache only while it runs."""
    progress = load_script("examples/progress.py")
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs", "jax_enable_compilation_cache")
    before = {name: getattr(jax.config, name) for name in names}
    with progress.compile_cache(str(tmp_path / "c")) as stats:
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
        jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.125)(jnp.arange(7.0)).block_until_ready()  # fast, but cached
        assert stats.writes >= 1 and stats.entries() >= 1
    assert {name: getattr(jax.config, name) for name in names} == before


def test_progress_prints_plain_lines_and_leaves_excluded_time_out():
    progress = load_script("examples/progress.py")
    stream = io.StringIO()
    p = progress.Progress(5, items_per_step=100, every=2, stream=stream)
    assert not p.live  # not a terminal
    p.step(1, 5.0)
    for step in range(2, 6):
        time.sleep(0.01)
        with p.excluded("checkpoint saves"):
            time.sleep(0.2)
        p.step(step, 5.0 - step / 2)
    summary = p.close()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text  # no redraws, no escape codes
    lines = text.splitlines()
    assert [line.split()[1] for line in lines if line.startswith("step")] == ["1/5", "2/5", "4/5", "5/5"]
    assert summary["steps_timed"] == 4
    assert summary["s_per_step"] < 0.1  # the 0.2 s saves left out
    assert summary["excluded_s"]["checkpoint saves"] >= 0.8
    assert "left out of s/step: checkpoint saves" in lines[-1]


@pytest.mark.slow  # two runs of the example (imports, compiles)
def test_remat_trains_like_the_run_without_it_and_prints_both_peaks(tmp_path):
    """--remat (each block called under nnx.remat) on 8 devices: the same losses as without it (to 1e-6), and
    each run prints its compiled step's peak memory per device."""
    out0, log0 = run_example([*TINY_GPT, "--no-compile-cache"], str(tmp_path / "plain.json"))
    out1, log1 = run_example([*TINY_GPT, "--no-compile-cache", "--remat"], str(tmp_path / "remat.json"))
    assert list(log0["train"]) == list(log1["train"])
    np.testing.assert_allclose(list(log1["train"].values()), list(log0["train"].values()), rtol=0, atol=1e-6)
    assert re.search(r"compiled train step: [\d.]+ MiB peak per device \(no remat\)", out0), out0
    assert re.search(r"compiled train step: [\d.]+ MiB peak per device \(each block under nnx.remat\)", out1), out1
    assert log0["peak_bytes"] > 0 and log1["peak_bytes"] > 0
