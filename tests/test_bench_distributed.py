"""bench/distributed.py (issue 23's figures) end to end on the CPU: two gloo ranks and one
process, the reference backend; and its arithmetic (bus bandwidth, scaling, the curves)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import distributed

ROOT = Path(__file__).resolve().parent.parent


def test_bus_bandwidth_is_nccl_tests_measure():
    # 1 GB in 10 ms over 2 ranks: algbw 100 GB/s, busbw 100 * 2 * 1 / 2
    assert distributed.bus_bandwidth(10**9, 10.0, 2) == pytest.approx(100.0)
    assert distributed.bus_bandwidth(10**9, 10.0, 4) == pytest.approx(150.0)
    assert distributed.bus_bandwidth(10**9, 10.0, 1) is None
    assert distributed.bus_bandwidth(10**9, None, 2) is None


def test_allreduce_rows_take_the_slowest_rank_and_judge_the_target():
    ranks = [
        {"rows": [{"bytes": 10**9, "dtype": "float32", "nccl_ms": 10.0, "flame_ms": 10.5}]},
        {"rows": [{"bytes": 10**9, "dtype": "float32", "nccl_ms": 9.0, "flame_ms": 12.0}]},
    ]
    (row,) = distributed.allreduce_rows(ranks, 2)
    assert row["flame_ms"] == 12.0 and row["nccl_ms"] == 10.0
    assert row["flame_over_nccl"] == pytest.approx(10.0 / 12.0)
    assert row["target_met"] is False  # 0.83 < 0.9


def test_scaling_uses_the_slowest_rank():
    one = {"ms_per_step": 20.0, "images_per_s": 3200.0, "batch_per_rank": 64}
    many = [
        {"ms_per_step": 21.0, "batch_per_rank": 64},
        {"ms_per_step": 22.0, "batch_per_rank": 64},
    ]
    found = distributed.scaling(one, many, 2)
    assert found["world"]["images_per_s"] == pytest.approx(128 / 0.022)
    assert found["speedup"] == pytest.approx(128 / 0.022 / 3200.0)
    assert found["target_met"] is (found["speedup"] >= 1.85)


@pytest.mark.slow
def test_the_bench_runs_two_gloo_ranks_against_one_process(tmp_path):
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    environment["FLAME_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run(
        [sys.executable, "-m", "bench.distributed", "--reference", "--nproc", "2",
         "--out", str(tmp_path / "out"), "--timeout", "300"],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "out" / "distributed.json").read_text())
    assert [row["bytes"] for row in report["allreduce"]] == [10484, 104856]
    assert all(row["flame_in_place_ms"] > 0 for row in report["allreduce"])
    assert report["step"]["world"]["global_batch"] == 4
    assert report["step"]["one_gpu"]["batch"] == 2
    curve = report["curve"]
    assert curve["steps"] == 4 and curve["ranks_see_one_grad_norm"]
    # the same global batches: two ranks' mean loss is the single process's, to rounding
    assert curve["agreement"]["per_step_rel_diff_max"] < 1e-3
    assert curve["grad_norm_rel_diff_max"] < 1e-2
    assert "## Loss curve" in (tmp_path / "out" / "distributed.md").read_text()
