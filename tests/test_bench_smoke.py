"""The benchmark runs end to end without a GPU, and its bookkeeping is right.

The end-to-end run uses FLAME's reference backend with the peers skipped; the GPU numbers need
the device machine. The bookkeeping tests (error rows, verdicts, ratios, the table) need neither
FLAME nor a GPU.
"""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest

from bench import checks, expressions, harness, markdown, report
from bench.systems import FLAME_API, FlameSystem, System, TorchEagerSystem
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
        if flame["status"] == "skipped":  # matmul rows, until flame.matmul lands
            assert find_workload(row["name"]).requires, (row["name"], flame)
            continue
        assert flame["status"] == "ok", (row["name"], flame)
        if "check" in flame:
            assert flame["check"]["rel_l2_error"] < flame["check"]["tolerance"] <= 1e-2
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


@pytest.mark.slow
def test_reduction_workloads_on_the_reference_backend(tmp_path):
    """Integer inputs, a scalar output and a reduced axis, checked against NumPy float64."""
    reason = flame_missing_reason()
    if reason:
        pytest.skip(reason)
    completed = run_bench(
        "--backend", "reference", "--quick", "--repeats", "20", "--warmup", "1",
        "--only", "cross_entropy_fwd", "--only", "sum_middle", "--out", str(tmp_path),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = {row["name"]: row for row in data["workloads"]}
    assert list(rows) == ["cross_entropy_fwd", "sum_middle"]
    loss = rows["cross_entropy_fwd"]
    assert loss["dtypes"] == ["float32", "int64"] and loss["output_shape"] == []
    assert loss["floor_bytes"] == 256 * 512 * 4 + 256 * 8 + 4
    assert rows["sum_middle"]["output_shape"] == [8, 16]
    for row in rows.values():
        flame = row["results"]["flame"]
        assert flame["status"] == "ok", (row["name"], flame)
        assert flame["check"]["reference"] == "numpy float64"
        assert flame["check"]["rel_l2_error"] < 1e-4
        assert flame["device"]["pct_of_copy_bandwidth"] > 0


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


class FlameWithoutMatmul(System):
    """A FLAME that has every op but the matrix product."""

    key = "flame"
    label = "flame"

    def __init__(self):
        super().__init__()
        self.module = SimpleNamespace()


def test_reduction_rows_skip_cupy_fuse_and_matmul_rows_need_flame_matmul(tmp_path):
    options = harness.Options(out=tmp_path, quick=True, backend="reference")
    session = harness.Session(options, tmp_path, None, "no GPU", [FlameWithoutMatmul()])
    skipped = {"status": "skipped", "reason": "flame.matmul not available"}
    for name in ("matmul_f32", "matmul_bf16", "bmm_bf16"):
        row = harness.run_workload(session, find_workload(name))
        report.annotate(row, copy={"gb_per_s": 3000.0})
        assert row["status"] == "skipped" and row["results"]["flame"] == skipped
    reason = find_workload("softmax").skip["cupy_fuse"]
    assert reason == "no reductions in cupy.fuse"


def test_workload_declarations_floors():
    assert find_workload("softmax").floor_bytes(quick=False) == 2 * 16384 * 4096 * 4
    assert find_workload("layer_norm").floor_bytes(quick=False) == (2 * 16384 + 2) * 4096 * 4
    assert find_workload("sum_middle").output_shape(quick=False) == (256, 256)
    bmm = find_workload("bmm_bf16")
    assert bmm.output_shape(quick=False) == (32, 2048, 2048)
    assert bmm.floor_flops(quick=False) == 2 * 32 * 2048**3
    assert find_workload("matmul_bf16").tolerance == 1e-2
    assert find_workload("matmul_f32").matmul_precision == "highest"


def test_round_to_bfloat16_ties_to_even():
    values = numpy.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, -2.5], dtype=numpy.float32)
    expected = [1.0, 1.0, 1 + 2**-6, 1.0, -2.5]
    assert checks.round_to_bfloat16(values).tolist() == expected


def test_matmul_row_reports_tflops_and_the_torch_rate_floor():
    row = gpu_like_row()
    row["name"], row["flops"] = "matmul_bf16", 2 * 8192**3  # 1.1e12 FLOPs
    report.annotate(row, copy={"gb_per_s": 3000.0})
    results = row["results"]
    assert results["flame"]["device"]["tflop_per_s"] == pytest.approx(2 * 8192**3 / 1.25e9)
    assert row["floor_ms"] == pytest.approx(5.0)  # torch eager's device time: its own rate
    assert "pct_of_copy_bandwidth" not in results["flame"]["steady"]
    line = markdown.render_rows([row], device_only=False)[-1]
    assert "TFLOP/s" in line and line.endswith("| — |")
    report_text = markdown.floor_notes([row])
    assert "torch eager's measured" in report_text[2]


def test_torch_tf32_is_off_only_inside_a_float32_matmul_workload():
    torch = pytest.importorskip("torch")
    system = TorchEagerSystem.__new__(TorchEagerSystem)
    system.torch = torch
    flags = torch.backends.cuda.matmul
    saved = flags.allow_tf32
    try:
        flags.allow_tf32 = True
        with system.scope(find_workload("matmul_f32")):
            assert flags.allow_tf32 is False
            assert system.settings(find_workload("matmul_f32")) == {"allow_tf32": False}
        assert flags.allow_tf32 is True
        with system.scope(find_workload("matmul_bf16")):
            assert flags.allow_tf32 is True
    finally:
        flags.allow_tf32 = saved


# --- forward + backward workloads (issue 4) ------------------------------------------------------

FWD_BWD = ("layer_norm_fwd_bwd", "cross_entropy_fwd_bwd")


def test_forward_backward_floors_and_outputs():
    layer_norm = find_workload("layer_norm_fwd_bwd")
    assert layer_norm.floor_bytes(quick=False) == 5 * 16384 * 4096 * 4 + 4 * 4096 * 4
    assert layer_norm.output_shapes(quick=False) == ((16384, 4096),) * 2 + ((4096,),) * 2
    loss = find_workload("cross_entropy_fwd_bwd")
    assert loss.floor_bytes(quick=False) == 3 * 8192 * 32000 * 4 + 8192 * 8 + 4
    assert loss.output_shapes(quick=True) == ((), (256, 512))
    for name in FWD_BWD:
        workload = find_workload(name)
        assert "no autograd" in workload.skip["cupy_fuse"] and workload.peak_memory


def oracle_case(name, seed=1):
    """Small float64 inputs for one forward + backward workload, and its oracle's outputs."""
    rng = numpy.random.default_rng(seed)
    if name == "layer_norm_fwd_bwd":
        inputs = [rng.standard_normal(shape) for shape in ((6, 32), (32,), (32,), (6, 32))]
    else:
        inputs = [rng.standard_normal((6, 32)), rng.integers(0, 32, 6)]
    return inputs, find_workload(name).oracle(*inputs)


@pytest.mark.parametrize("name", FWD_BWD)
@pytest.mark.parametrize("compiled", [False, True])
def test_torch_autograd_matches_the_float64_oracle(name, compiled):
    """The peers' vjp path (eager, and a compiled forward as torch.compile runs it) on the CPU."""
    torch = pytest.importorskip("torch")
    compiler = (lambda fn: torch.compile(fn, backend="aot_eager")) if compiled else None
    ops = expressions.torch_ops(torch, compiler=compiler)
    inputs, expected = oracle_case(name)
    outputs = find_workload(name).expression(ops, *(torch.from_numpy(a) for a in inputs))
    assert len(outputs) == len(expected)
    for result, reference in zip(outputs, expected, strict=True):
        assert not result.requires_grad
        numpy.testing.assert_allclose(result.numpy(), reference, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", FWD_BWD)
def test_flame_value_and_grad_matches_the_float64_oracle(name):
    reason = flame_missing_reason()
    if reason:
        pytest.skip(reason)
    import flame

    inputs, expected = oracle_case(name)
    system = FlameSystem("reference")
    with system.scope():
        narrow = [a.astype(numpy.float32) if a.dtype.kind == "f" else a for a in inputs]
        tensors = [flame.tensor(a) for a in narrow]
        outputs = system.compile(find_workload(name).expression)(*tensors)
        assert all(output.is_realized for output in outputs)
        for result, reference in zip(outputs, expected, strict=True):
            error = numpy.linalg.norm(result.numpy() - reference) / numpy.linalg.norm(reference)
            assert error < 1e-5


def test_several_outputs_are_checked_one_by_one():
    workload = find_workload("layer_norm_fwd_bwd")
    inputs, expected = oracle_case("layer_norm_fwd_bwd")
    specs = [SimpleNamespace(shape=a.shape, dtype="float32" if a.ndim else "int64") for a in inputs]
    inputs32 = [a.astype(numpy.float32) for a in inputs]
    workload = replace(workload, output=lambda shapes: (shapes[0], shapes[0], shapes[1], shapes[1]))
    reference = checks.Reference(workload, inputs32, specs, numpy)
    good = reference.check(SimpleNamespace(key="flame"), expected)
    assert good["passed"] and set(good["per_output"]) == {"y", "dx", "dw", "db"}
    wrong = list(expected)
    wrong[2] = wrong[2] * 1.01  # dw off by 1 %
    bad = reference.check(SimpleNamespace(key="flame"), wrong)
    assert not bad["passed"] and bad["rel_l2_error"] == pytest.approx(0.01, rel=1e-3)
    assert markdown.worst_output(bad) == " (dw)"


def test_peak_memory_ratio_and_table():
    row = gpu_like_row()
    row["name"] = "layer_norm_fwd_bwd"
    for key, peak in (("flame", 600.0), ("torch_eager", 800.0), ("torch_compile", 700.0)):
        row["results"][key]["peak_memory"] = {"peak_mb": peak, "outputs_mb": 537.0}
    report.annotate(row, copy={"gb_per_s": 3000.0})
    assert row["peak_memory_flame_over_eager"] == pytest.approx(0.75)
    assert row["peak_memory_target_met"] is True
    lines = markdown.memory_lines({"workloads": [row]})
    assert lines[-4].startswith("| layer_norm_fwd_bwd | 600 MB (outputs 537) | 800 MB")
    assert lines[-4].endswith("| 0.75 | -200.000 MB | yes |")


@pytest.mark.slow
def test_forward_backward_workloads_on_the_reference_backend(tmp_path):
    reason = flame_missing_reason()
    if reason:
        pytest.skip(reason)
    completed = run_bench(
        "--backend", "reference", "--quick", "--repeats", "20", "--warmup", "1",
        "--only", "layer_norm_fwd_bwd", "--only", "cross_entropy_fwd_bwd", "--out", str(tmp_path),
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = {row["name"]: row for row in data["workloads"]}
    assert list(rows) == list(FWD_BWD)
    assert list(rows["layer_norm_fwd_bwd"]["output_shapes"]) == ["y", "dx", "dw", "db"]
    for row in rows.values():
        flame = row["results"]["flame"]
        assert flame["status"] == "ok", (row["name"], flame)
        assert flame["check"]["reference"] == "numpy float64"
        assert max(flame["check"]["per_output"].values()) < 1e-4
        assert flame["peak_memory"]["peak_mb"] >= flame["peak_memory"]["outputs_mb"] > 0
        assert row["results"]["cupy_fuse"]["reason"] == "no autograd in cupy.fuse"
    assert "## Peak memory of one forward + backward call" in completed.stdout


def test_training_report_renders_ratios_from_its_fields():
    from bench.training import markdown

    def entry(device, per_call):
        return {"ms": per_call, "device_ms": device, "first_call_s": 0.1, "losses": [1.0]}

    adamw = {
        "params": 200, "elements": 160e6, "floor_ms": 1.5, "copy_bandwidth_tb_s": 2.9,
        "flame": {**entry(1.6, 2.0), "host_us_per_step": 400.0},
        "torch_fused": entry(2.4, 2.5), "torch_foreach": entry(4.8, 5.0),
        "max_relative_difference_vs_torch_fused": 1e-6,
    }  # fmt: skip
    mlp = {
        name: {**entry(d, d), "tflop_s": 700.0}
        for name, d in (("flame", 9.0), ("torch_eager", 9.9), ("torch_compile", 9.45))
    }
    mlp["first_step_cold"] = {"first_step_s": 0.6, "import_s": 0.5}
    mlp["first_step_warm"] = {"first_step_s": 0.2, "import_s": 0.5}
    text = markdown({"device": "test", "adamw": adamw, "mlp": mlp})
    assert "| torch_fused | 2.400 | 1.60x | 1.50x | 2.500 | 1.25x |" in text
    assert "| torch_compile | 9.450 | 700 | 1.05x |" in text
    assert "warm disk cache 0.200 s" in text


def test_host_bound_rows_run_before_torch_compile_threads_exist():
    from types import SimpleNamespace

    from bench import harness
    from bench.workloads import DEVICE, WORKLOADS

    order = harness.host_bound_first(list(WORKLOADS))
    kinds = [workload.kind == DEVICE for workload in order]
    assert kinds == sorted(kinds) and any(kinds) and not all(kinds)  # host rows, then device
    assert sorted(w.name for w in order) == sorted(w.name for w in WORKLOADS)
    systems = [
        SimpleNamespace(key=key) for key in ("torch_compile", "flame", "cupy_fuse", "torch_eager")
    ]
    keys = [system.key for system in harness.peers_first(systems)]
    assert keys[0] == "torch_eager" and keys[-1] == "torch_compile"


class LoggingSystem(System):
    """A system whose every call appends its key to a shared log (a NumPy result, right)."""

    def __init__(self, key: str, log: list, broken: bool = False):
        super().__init__()
        self.key = self.label = key
        self.log = log
        self.broken = broken
        self.clock = SimpleNamespace(synchronize=lambda: None)

    def compile(self, expression):
        if self.broken:
            raise RuntimeError("planted failure")
        ops = expressions.array_ops(numpy)

        def call(*inputs):
            self.log.append(self.key)
            return expression(ops, *inputs)

        return call


def test_host_rows_time_every_system_in_the_same_rotated_rounds(tmp_path):
    """Each round runs every working system's calls once, in an order rotated each round, so
    that a change of the host's speed falls on every system alike; a broken system gets no
    timing and the others still do."""
    log = []
    names = ("flame", "torch_eager", "cupy_fuse")
    systems = [LoggingSystem(key, log) for key in names]
    systems.append(LoggingSystem("torch_compile", log, broken=True))
    options = harness.Options(
        out=tmp_path, quick=True, backend="reference", warmup=1, host_calls=3, host_repeats=4
    )
    session = harness.Session(options, tmp_path, None, "no GPU", systems)
    results = harness.run_host_compared(session, find_workload("tiny20"))
    assert results["torch_compile"]["status"] == "error"
    assert "host" not in results["torch_compile"]
    for key in names:
        assert results[key]["status"] == "ok"
        assert results[key]["host"]["runs"] == 4 and results[key]["host"]["interleaved"]
        assert "call" not in results[key]
    assert results["flame"]["python_probe"]["runs"] == 4
    assert results["flame"]["python_probe"]["audit_hook_ns_per_event"] >= 0
    # after each system's first call and warm-up call: 4 rounds of 3 bursts of 3 calls
    timed = log[2 * len(names) :]
    bursts = [timed[index] for index in range(0, len(timed), options.host_calls)]
    assert len(timed) == 4 * len(names) * options.host_calls
    rounds = [bursts[index : index + len(names)] for index in range(0, len(bursts), len(names))]
    for round_order in rounds:
        assert sorted(round_order) == sorted(names)  # every system once per round
    assert len({tuple(order) for order in rounds}) == len(names)  # the order rotates
    assert [order[0] for order in rounds[: len(names)]] == [rounds[0][i] for i in range(3)]
