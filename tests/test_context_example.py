"""examples/train_gpt.py under a context axis with the model's positions written for one device
(``--positions arange``: the table indexed by ``jnp.arange(T)``): every step's loss equals the run without the split
(``--context 1``) within 1e-5, as it does with ``vj.positions``."""

from __future__ import annotations

import json

import jax
import pytest
from helpers import load_script

SMALL = ["--plot=", "--data-mb", "0.2", "--layers", "2", "--d-model", "32", "--heads", "2", "--batch", "8"]
SMALL += ["--seq", "32", "--steps", "4", "--no-compile-cache"]


def losses(tmp_path, *argv: str) -> list[float]:
    example = load_script("examples/train_gpt.py")
    log = tmp_path / f"log{len(list(tmp_path.iterdir()))}.json"
    with jax.numpy_dtype_promotion("standard"):  # the example runs as a user's script would
        example.main([*SMALL, "--log-json", str(log), *argv])
    train = json.loads(log.read_text())["train"]
    return [train[k] for k in sorted(train, key=int)]


@pytest.mark.slow  # two runs of the example (about a minute each on 2 cores): tests/test_context.py's cases stay
def test_arange_positions_under_a_context_axis_give_the_unsplit_losses(tmp_path):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices")
    split = losses(tmp_path, "--positions", "arange", "--context", "4")
    whole = losses(tmp_path, "--positions", "arange", "--context", "1")
    assert len(split) == len(whole) == 4
    err = max(abs(a - b) / abs(b) for a, b in zip(split, whole, strict=True))
    print(f"losses --context 4: {split}, --context 1: {whole}, max relative difference {err:.2e}")
    assert err <= 1e-5, (split, whole)
