"""examples/train_gpt.py's checkpoint flags, as a new user tries them: ``--resume`` with nothing to resume is an
error, a directory holding another run's steps is refused before training, the save compiles before the timed
loop and its times are reported apart, and ``SIGTERM`` saves a step and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import jax
import pytest
from helpers import ROOT, load_script

import vescale_jax as vj

SMALL = [
    "--plot=",
    "--data-mb",
    "0.2",
    "--layers",
    "1",
    "--d-model",
    "16",
    "--heads",
    "2",
    "--batch",
    "8",
    "--seq",
    "16",
    "--save-every",
    "2",
]


@pytest.fixture(scope="module")
def example():
    return load_script("examples/train_gpt.py")


def run(example, *argv: str) -> dict:
    with jax.numpy_dtype_promotion("standard"):  # the example runs as a user's script would
        return example.main([*SMALL, *argv])


def usage_error(example, capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        run(example, *argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_resume_needs_a_directory_with_a_finished_step(example, capsys, tmp_path):
    err = usage_error(example, capsys, "--steps", "2", "--resume")
    assert "--resume needs --checkpoint-dir" in err
    missing = tmp_path / "missing"
    err = usage_error(example, capsys, "--steps", "2", "--resume", "--checkpoint-dir", str(missing))
    assert f"{missing} does not exist" in err and "--resume-if-exists" in err
    assert not missing.exists()  # not created by the failed resume
    empty = tmp_path / "empty"
    empty.mkdir()
    err = usage_error(example, capsys, "--steps", "2", "--resume", "--checkpoint-dir", str(empty))
    assert "holds no finished checkpoint" in err


@pytest.mark.slow
def test_checkpointed_runs_refuse_another_runs_directory(example, capsys, tmp_path):
    ck = str(tmp_path / "ck")
    fresh = run(example, "--steps", "4", "--resume-if-exists", "--checkpoint-dir", ck)  # nothing there: afresh
    out = capsys.readouterr().out
    assert "resumed from" not in out
    assert "checkpoint conversion compiled in" in out  # before the timed loop
    assert "checkpoints: first save" in out and "later saves median" in out and "saves excluded" in out
    assert vj.checkpoint.Manager(ck).all_steps() == [2, 4]

    # A shorter re-run into the same directory: refused before its first step, naming the steps and the flag.
    err = usage_error(example, capsys, "--steps", "2", "--checkpoint-dir", ck)
    assert "holds steps [2, 4]" in err and "--overwrite" in err
    assert vj.checkpoint.Manager(ck).all_steps() == [2, 4]
    run(example, "--steps", "2", "--checkpoint-dir", ck, "--overwrite")
    assert vj.checkpoint.Manager(ck).all_steps() == [2]  # the old step 4 is gone, not left as "latest"

    # --resume-if-exists with a checkpoint resumes from it.
    resumed = run(example, "--steps", "4", "--resume-if-exists", "--checkpoint-dir", ck)
    assert "resumed from step 2" in capsys.readouterr().out
    assert resumed["last_loss"] == fresh["last_loss"]  # same data, same programs: the same step 4


@pytest.mark.slow
def test_sigterm_saves_a_step_and_exits_zero(tmp_path):
    ck = tmp_path / "ck"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    argv = [*SMALL, "--save-every", "1000", "--steps", "100000", "--checkpoint-dir", str(ck)]
    proc = subprocess.Popen(
        [sys.executable, "-u", os.path.join(ROOT, "examples", "train_gpt.py"), *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        for line in proc.stdout:  # event-driven: the conversion is compiled, the loop is about to start
            if "checkpoint conversion compiled in" in line:
                break
        os.kill(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=900)  # a hang guard: seconds on a quiet machine
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "preempted: saved step" in out, out[-3000:]
    step = int(out.split("preempted: saved step ")[1].split()[0])
    assert vj.checkpoint.Manager(ck).all_steps() == [step]
