"""`flame dump` on the GPU: kernels as launched, loaded-function resources, --profile times,
plan-cache hits and kernel-cache misses with their reasons (also across processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SCRIPT = """
import sys
import numpy as np
import flame as fl
import flame.nn.functional as F

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
x = fl.from_numpy(np.random.default_rng(0).standard_normal((512, 1024)).astype(dtype))
for step in range(3):  # the same graph three times: one plan, two plan-cache hits
    y = F.layer_norm(x, (1024,))
    z = (fl.gelu(y) * 2.0).realize()
wide = fl.from_numpy(np.ones((1024, 1024), dtype))
(fl.gelu(F.layer_norm(wide, (1024,))) * 2.0).realize()  # new sizes: new plan, same kernels
print(float(z.numpy().astype("float64").sum()))
"""


def flame_dump(tmp_path: Path, *arguments: str, cache: Path) -> dict:
    script = tmp_path / "model.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["FLAME_CACHE_DIR"] = str(cache)
    env.pop("FLAME_DUMP", None)
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}"
    result = subprocess.run(
        [sys.executable, "-m", "flame", "dump", "--out", str(out), str(script), *arguments],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["stdout"] = result.stdout
    return manifest


def kernels(manifest, graph=0):
    return [k for k in manifest["graphs"][graph]["kernels"] if k["kind"] != "library"]


def test_profile_times_every_kernel_and_reports_the_floor(tmp_path):
    manifest = flame_dump(tmp_path, "--profile", cache=tmp_path / "cache")
    first = manifest["graphs"][0]
    assert first["backend"] == "cuda" and first["plan_hits"] == 2 and first["runs"] == 3
    for kernel in kernels(manifest):
        assert len(kernel["times_ms"]) == 3 and min(kernel["times_ms"]) > 0
        assert kernel["resources"]["registers"] > 0  # the loaded function's own count
        assert "spill_stores" in kernel["resources"], (kernel["name"], kernel["resources_note"])
        assert kernel["launch_note"] == "as launched"
    assert "% floor" in manifest["stdout"] and "model.py:" in manifest["stdout"]
    second = manifest["graphs"][1]
    assert second["plan_reason"].startswith("new input types or sizes since graph 1")
    assert all(k["cache"] == "memory" for k in kernels(manifest, 1))


def test_cache_misses_and_hits_carry_their_reasons(tmp_path):
    cache = tmp_path / "cache"
    cold = flame_dump(tmp_path, cache=cache)
    assert {k["cache"] for k in kernels(cold)} == {"compiled"}
    assert all(k["cache_reason"].startswith("miss: no cubin") for k in kernels(cold))
    warm = flame_dump(tmp_path, cache=cache)  # a fresh process: the disk cache answers
    assert {k["cache"] for k in kernels(warm)} == {"disk"}
    assert all("stored by an earlier run" in k["cache_reason"] for k in kernels(warm))
    half = flame_dump(tmp_path, "float16", cache=cache)  # new dtype: new code, compiled
    assert {k["cache"] for k in kernels(half)} == {"compiled"}


def test_unwritable_cache_is_reported_in_the_dump(tmp_path):
    blocker = tmp_path / "cache_is_a_file"
    blocker.write_text("")
    manifest = flame_dump(tmp_path, cache=blocker / "sub")
    assert any(note.startswith("disk cache:") for note in manifest["notes"])
    assert "disk cache:" in manifest["stdout"]
