"""The benchmark runs end to end without a GPU, and its bookkeeping is right.

The end-to-end run uses FLAME's reference backend with the peers skipped; the GPU numbers need
the device machine. The bookkeeping tests (error rows, verdicts, ratios, the table) need neither
FLAME nor a GPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import harness, markdown, report
from bench.systems import FLAME_API, System
from bench.workloads import DEVICE, WORKLOAD_NAMES, find_workload

ROOT = Path(__file__).resolve().parent.parent


def flame_missing_reason() -> str | None:
    try:
        import flame
    except Exception as error:
        return f"import flame failed ({type(error).__name__}: {error}); the core lands in parallel"
    missing = [name for name in FLAME_API if not hasattr(flame, name)]
    if missing:
        return f"flame lacks {', '.join(missing)}: the core has not landed yet"
    return None


def run_bench(*arguments, timeout=600):
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "bench", *arguments],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_every_workload():
    completed = run_bench("--help")
    assert completed.returncode == 0, completed.stderr
    for name in WORKLOAD_NAMES:
        assert name in completed.stdout


def test_repeats_below_twenty_are_refused():
    completed = run_bench("--repeats", "5")
    assert completed.returncode == 2
    assert "at least 20" in completed.stderr


@pytest.mark.slow
def test_reference_backend_quick_run(tmp_path):
    reason = flame_missing_reason()
    if reason:
        pytest.skip(reason)
    completed = run_bench(
        "--backend", "reference", "--quick", "--repeats", "20", "--warmup", "1",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["backend"] == "reference"
    assert [row["name"] for row in data["workloads"]] == list(WORKLOAD_NAMES)
    for row in data["workloads"]:
        flame = row["results"]["flame"]
        assert flame["status"] == "ok", (row["name"], flame)
        if "check" in flame:
            assert flame["check"]["rel_l2_error"] < 1e-4
        for peer in markdown.PEERS:
            if peer in row["results"]:
                assert row["results"][peer]["status"] == "skipped"
                assert row["results"][peer]["reason"]
    assert data["copy_bandwidth"]["gb_per_s"] > 0
    compile_row = next(row for row in data["workloads"] if row["name"] == "compile_time")
    cold = compile_row["results"]["flame"]["cold"]
    assert cold["process_start_to_first_result_ms"] >= cold["import_flame_ms"] > 0
    table = (tmp_path / "bench.md").read_text()
    assert completed.stdout.endswith(table)
    assert table.rstrip().splitlines()[-1].startswith("| compile_time |")


class BrokenFlame(System):
    """A FLAME whose every call raises, as an unfinished core might."""

    key = "flame"
    label = "flame"

    def compile(self, expression):
        raise RuntimeError("planted failure in the FLAME part")


class SkippedPeer(System):
    key = "torch_eager"
    label = "torch eager"

    def __init__(self):
        super().__init__()
        self.skip_reason = "no GPU"


def test_flame_failure_is_an_error_row_not_a_crash(tmp_path):
    options = harness.Options(out=tmp_path, quick=True, backend="reference")
    session = harness.Session(options, tmp_path, None, "no GPU", [BrokenFlame(), SkippedPeer()])
    row = harness.run_workload(session, find_workload("tiny20"))
    report.annotate(row, copy=None)
    assert row["status"] == "error"
    assert "planted failure in the FLAME part" in row["results"]["flame"]["error"]
    assert row["results"]["torch_eager"] == {"status": "skipped", "reason": "no GPU"}


def timed_entry(steady_ms, device_ms, error=1e-7):
    check = {"rel_l2_error": error, "passed": error < harness.FLOAT32_TOLERANCE}
    return {
        "status": "ok",
        "check": check,
        "steady": {"median_ms": steady_ms, "min_ms": steady_ms, "runs": 20},
        "device": {"median_ms": device_ms, "min_ms": device_ms, "runs": 20},
    }


def gpu_like_row(flame_error=1e-7):
    """What a GPU run produces for one device workload, with round numbers."""
    return {
        "name": "ew_chain",
        "kind": DEVICE,
        "floor_bytes": 3_000_000_000,  # 1 ms at 3 TB/s
        "results": {
            "flame": timed_entry(2.0, 1.25, flame_error),
            "torch_eager": {**timed_entry(8.0, 5.0), "check": {"is_reference": True}},
            "torch_compile": timed_entry(2.5, 2.5),
            "cupy_fuse": {"status": "error", "error": "RuntimeError: boom"},
        },
    }


def test_ratios_and_percent_of_copy_bandwidth():
    row = gpu_like_row()
    report.annotate(row, copy={"gb_per_s": 3000.0})
    results = row["results"]
    assert row["status"] == "ok"
    assert row["floor_ms"] == pytest.approx(1.0)
    assert results["flame"]["steady"]["pct_of_copy_bandwidth"] == pytest.approx(50.0)
    assert results["flame"]["device"]["pct_of_copy_bandwidth"] == pytest.approx(80.0)
    assert results["torch_eager"]["flame_speedup"] == pytest.approx(4.0)
    assert results["torch_compile"]["device_flame_speedup"] == pytest.approx(2.0)
    assert "flame_speedup" not in results["cupy_fuse"]
    summary_line = markdown.render_rows([row], device_only=False)[-1]
    assert "4.00× eager" in summary_line and "1.25× compile" in summary_line
    assert "50.0 %" in summary_line


def test_wrong_flame_result_marks_the_row_failed():
    row = gpu_like_row(flame_error=3e-3)
    report.annotate(row, copy={"gb_per_s": 3000.0})
    assert row["status"] == "FAILED"
    assert "FAILED" in markdown.render_rows([row], device_only=False)[-1]


def test_faster_than_a_copy_is_flagged():
    row = gpu_like_row()
    row["results"]["flame"]["device"]["median_ms"] = 0.5  # 200 % of the copy bandwidth
    report.annotate(row, copy={"gb_per_s": 3000.0})
    assert any("faster than a copy" in warning for warning in row["warnings"])
