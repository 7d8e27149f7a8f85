"""examples/train_module.py: a module trained with autocast, EMA and checkpoints, and a run
resumed from a checkpoint ends with the same weights as the run that wrote it (reference
backend, a few steps; FLAME_BACKEND=reference keeps it off the GPU on every machine)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*arguments: str) -> str:
    environment = dict(os.environ, FLAME_BACKEND="reference")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_module.py"), *arguments],
        capture_output=True, text=True, env=environment, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_resumed_run_ends_with_the_same_weights(tmp_path):
    straight = _run("--steps", "6", "--save-every", "3", "--dir", str(tmp_path / "a"))
    checkpoint = tmp_path / "a" / "step_3.safetensors"
    assert checkpoint.exists() and (tmp_path / "a" / "step_6.safetensors").exists()
    resumed = _run(
        "--steps", "6", "--save-every", "3", "--dir", str(tmp_path / "b"),
        "--resume", str(checkpoint),
    )  # fmt: skip
    assert "resumed from" in resumed
    checksums = [re.search(r"weights checksum (\S+)", out).group(1) for out in (straight, resumed)]
    assert checksums[0] == checksums[1]
    losses = [re.findall(r"step +5 +loss (\S+)", out) for out in (straight, resumed)]
    assert losses[0] == losses[1] and losses[0]
