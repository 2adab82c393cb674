"""examples/train_gpt.py --local-checkpoint-dir: local copies beside the global checkpoint, a resume reads them."""

from __future__ import annotations

import os

import pytest
from test_train_gpt_checkpoints import example, run, usage_error  # noqa: F401  (example: the module's fixture)

import vescale_jax as vj


def test_local_flags_need_a_checkpoint_dir(example, capsys, tmp_path):  # noqa: F811
    err = usage_error(example, capsys, "--steps", "2", "--local-checkpoint-dir", str(tmp_path / "l"))
    assert "--local-checkpoint-dir and --local-save-every need --checkpoint-dir" in err
    err = usage_error(example, capsys, "--steps", "2", "--checkpoint-dir", str(tmp_path), "--local-save-every", "1")
    assert "--local-save-every needs --local-checkpoint-dir" in err


@pytest.mark.slow
def test_train_gpt_resumes_from_its_local_copies(example, capsys, tmp_path):  # noqa: F811
    ck, lc = str(tmp_path / "ck"), str(tmp_path / "local")
    full = run(example, "--steps", "6")
    flags = ["--steps", "6", "--save-every", "4", "--checkpoint-dir", ck, "--local-checkpoint-dir", lc]
    run(example, *flags, "--local-save-every", "1", "--stop-after", "5")
    assert vj.checkpoint.Manager(ck).all_steps() == [4, 5]  # every 4 steps and the last
    assert sorted(os.listdir(os.path.join(lc, "process_0_of_1"))) == ["4", "5"]  # the newest 2 of steps 1..5
    capsys.readouterr()
    resumed = run(example, *flags, "--resume")
    assert f"resumed from step 5 of {ck} (local copies in {lc})" in capsys.readouterr().out
    assert resumed["last_loss"] == full["last_loss"]  # bit for bit
