"""bench.md from the report dictionary: context first, details, then the summary table last."""

from bench.workloads import DEVICE, HOST

SYSTEM_LABELS = {
    "flame": "flame",
    "torch_eager": "torch eager",
    "torch_compile": "torch.compile",
    "cupy_fuse": "cupy.fuse",
}
PEER_SHORT_NAMES = {"torch_eager": "eager", "torch_compile": "compile", "cupy_fuse": "fuse"}
PEERS = tuple(PEER_SHORT_NAMES)
SYSTEMS = tuple(SYSTEM_LABELS)
DASH = "—"
COMPARISON_HEADER = (
    "workload",
    "floor ms",
    *SYSTEM_LABELS.values(),
    "flame speedup vs each peer",
    "flame % of copy bw",
)


def number(value: float | None) -> str:
    """Three significant figures or so, without scientific notation for timings."""
    if value is None:
        return DASH
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def table(header, rows) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def status_cell(entry: dict) -> str | None:
    """The cell of an entry that has no timing to show, else None."""
    status = entry.get("status")
    if status == "skipped":
        return "skipped"
    if status == "error":
        return "error"
    if status is None:
        return DASH
    return None


def timing_cell(entry: dict, metric: str, unit: str) -> str:
    cell = status_cell(entry)
    if cell is not None:
        return cell
    if metric not in entry:
        return DASH
    symbol = "µs" if unit == "us" else "ms"
    text = f"{number(entry[metric][f'median_{unit}'])} {symbol}"
    if metric == "host" and "min_us" in entry[metric]:
        # host time swings with the shared host's load within one process (measured on the
        # H100 host: 38-106 us for the same call on one pinned core): the best run as well
        text += f" (best {number(entry[metric]['min_us'])})"
    if "tflop_per_s" in entry[metric]:
        text += f" ({number(entry[metric]['tflop_per_s'])} TFLOP/s)"
    if entry["status"] == "FAILED":
        return f"FAILED {text}"
    return text


def speedup_cell(results: dict, ratio_key: str) -> str:
    parts = [
        f"{results[key][ratio_key]:.2f}× {PEER_SHORT_NAMES[key]}"
        for key in PEERS
        if ratio_key in results.get(key, {})
    ]
    return " · ".join(parts) or DASH


def workload_cell(row: dict) -> str:
    if row["status"] in ("ok", "skipped"):
        return row["name"]
    return f"{row['name']} **{row['status']}**"


def comparison_row(row: dict, device_only: bool) -> list[str]:
    results = row["results"]
    if row["kind"] == DEVICE:
        metric, unit = ("device", "ms") if device_only else ("steady", "ms")
    elif row["kind"] == HOST:
        metric, unit = "host", "us"
    else:
        return flame_only_row(row)
    cells = [timing_cell(results.get(key, {}), metric, unit) for key in SYSTEMS]
    ratio_key = "device_flame_speedup" if device_only else "flame_speedup"
    percent = results["flame"].get(metric, {}).get("pct_of_copy_bandwidth")
    percent_cell = f"{percent:.1f} %" if percent is not None else DASH
    floor = number(row.get("floor_ms")) if row["kind"] == DEVICE else DASH
    return [workload_cell(row), floor, *cells, speedup_cell(results, ratio_key), percent_cell]


def flame_only_row(row: dict) -> list[str]:
    flame = row["results"]["flame"]
    cell = status_cell(flame)
    if cell is None and "build" in flame:
        cell = f"{number(flame['build']['median_us_per_op'])} µs/op"
    elif cell is None:
        cold = flame["cold"]["process_start_to_first_result_ms"]
        warm = flame["warm"]["process_start_to_first_result_ms"]
        cell = f"cold {number(cold)} ms · warm {number(warm)} ms"
    return [workload_cell(row), DASH, cell, *(DASH for _ in PEERS), DASH, DASH]


def header_lines(report: dict) -> list[str]:
    device = report["device"]
    versions = report["versions"]
    options = report["options"]
    lines = [f"# FLAME benchmarks: {device.get('name')}", ""]
    facts = ", ".join(f"{key} {value}" for key, value in device.items() if key != "name")
    lines.append(f"- device: {device.get('name')} ({facts})")
    lines.append(f"- backend: {report['backend']}; quick sizes: {options['quick']}")
    shown = ("flame", "torch", "cupy", "triton", "numpy", "python")
    lines.append("- versions: " + ", ".join(f"{name} {versions.get(name)}" for name in shown))
    copy = report["copy_bandwidth"]
    if "gb_per_s" in copy:
        lines.append(
            f"- copy bandwidth: {copy['gb_per_s']:.0f} GB/s ({copy['method']}, "
            f"{copy['buffer_bytes'] / 2**30:.2f} GiB buffer, read + write counted, "
            f"median of {copy['runs']}; best {copy['best_gb_per_s']:.0f} GB/s)"
        )
    else:
        lines.append(f"- copy bandwidth: not measured ({copy.get('error')})")
    lines.append(
        f"- timing: median of {options['repeats']} after {options['warmup']} warm-up calls "
        f"(minimum in bench.json); host overhead: median of {options.get('host_repeats', 5)} "
        f"interleaved rounds, each running every system's {options['host_calls']} calls once "
        "(order rotated each round), so that the shared host's changes of speed fall on all "
        "alike; host-bound rows first, torch.compile prepared last in each row; compile "
        "caches empty at the start of the run, "
        "Python bytecode written first as an installed package has it; "
        "started "
        f"{report['started']}, {report['seconds']:.0f} s"
    )
    return lines + [""]


def first_call_lines(report: dict) -> list[str]:
    rows = []
    for row in report["workloads"]:
        if row["kind"] not in (DEVICE, HOST):
            continue
        cells = []
        for key in SYSTEMS:
            entry = row["results"].get(key, {})
            cell = status_cell(entry)
            cells.append(cell or f"{number(entry.get('first_call_ms'))} ms")
        rows.append([row["name"], *cells])
    if not rows:
        return []
    title = "## First call in this process (compile included; CUDA context already up)"
    return [title, "", *table(["workload", *SYSTEM_LABELS.values()], rows), ""]


def compile_lines(report: dict) -> list[str]:
    row = next((row for row in report["workloads"] if row["name"] == "compile_time"), None)
    if row is None or row["results"]["flame"].get("status") not in ("ok", "FAILED"):
        return []
    flame = row["results"]["flame"]
    header = [
        "FLAME cache",
        "python start",
        "import flame",
        "import cupy",
        "CUDA context",
        "inputs",
        "first result",
        "start → first result",
        "second call",
    ]
    keys = (
        "python_start_ms",
        "import_flame_ms",
        "import_cupy_ms",
        "cuda_context_ms",
        "inputs_ms",
        "first_result_ms",
        "process_start_to_first_result_ms",
        "second_call_ms",
    )
    header.append("NVRTC compiles · disk hits")
    rows = [
        [name, *(number(flame[name].get(key)) for key in keys), cache_cell(flame[name])]
        for name in ("cold", "warm")
    ]
    title = (
        f"## compile_time: ew_chain's first call in a new process, ms "
        f"({flame['elements']} elements; cold: empty FLAME and CuPy caches, "
        f"{flame['cache_files_after_cold']} files cached after it; Python bytecode warm)"
    )
    return [title, "", *table(header, rows), ""]


def cache_cell(phases: dict) -> str:
    counts = phases.get("kernel_cache")
    if not counts:
        return DASH
    return f"{counts['compiles']} ({number(counts['compile_ms'])} ms) · {counts['disk_hits']}"


def correctness_lines(report: dict) -> list[str]:
    rows = []
    for row in report["workloads"]:
        if row["kind"] not in (DEVICE, HOST):
            continue
        checks = {key: row["results"].get(key, {}).get("check", {}) for key in SYSTEMS}
        reference = next((c["reference"] for c in checks.values() if "reference" in c), DASH)
        tolerance = next((c["tolerance"] for c in checks.values() if "tolerance" in c), None)
        cells = []
        for key in SYSTEMS:
            check = checks[key]
            if check.get("is_reference"):
                cells.append("reference")
            elif "rel_l2_error" in check:
                verdict = "" if check["passed"] else " FAILED"
                cells.append(f"{check['rel_l2_error']:.1e}{worst_output(check)}{verdict}")
            else:
                cells.append(status_cell(row["results"].get(key, {})) or DASH)
        shown_tolerance = f"{tolerance:.0e}" if tolerance is not None else DASH
        rows.append([row["name"], reference, shown_tolerance, *cells])
    if not rows:
        return []
    title = "## Correctness: relative L2 error (flame must be under the tolerance)"
    header = ["workload", "reference", "tolerance", *SYSTEM_LABELS.values()]
    return [title, "", *table(header, rows), ""]


def worst_output(check: dict) -> str:
    """For several outputs (forward + backward): which one the error shown is."""
    errors = check.get("per_output")
    if not errors:
        return ""
    return f" ({max(errors, key=lambda name: errors[name])})"


def memory_cell(entry: dict) -> str:
    cell = status_cell(entry)
    if cell is not None:
        return cell
    peak = entry.get("peak_memory", {})
    if "peak_mb" not in peak:
        return f"error: {peak['error']}" if "error" in peak else DASH
    return f"{number(peak['peak_mb'])} MB (outputs {number(peak['outputs_mb'])})"


def memory_verdict_cells(row: dict) -> list[str]:
    """FLAME over eager, FLAME minus eager in MB (a ratio of 1.00 can still miss), verdict."""
    ratio = row.get("peak_memory_flame_over_eager")
    if ratio is None:
        return [DASH, DASH, DASH]
    flame = row["results"]["flame"]["peak_memory"]["peak_mb"]
    eager = row["results"]["torch_eager"]["peak_memory"]["peak_mb"]
    verdict = "yes" if row["peak_memory_target_met"] else "**no**"
    return [f"{ratio:.2f}", f"{flame - eager:+.3f} MB", verdict]


def memory_lines(report: dict) -> list[str]:
    rows = []
    for row in report["workloads"]:
        results = row.get("results", {})
        if not any("peak_memory" in entry for entry in results.values()):
            continue
        cells = [memory_cell(results.get(key, {})) for key in SYSTEMS if key != "cupy_fuse"]
        rows.append([row["name"], *cells, *memory_verdict_cells(row)])
    if not rows:
        return []
    title = "## Peak memory of one forward + backward call (MB above the inputs, outputs included)"
    header = ["workload", "flame", "torch eager", "torch.compile", "flame / eager"]
    header += ["flame − eager", "flame ≤ eager"]
    method = (
        "flame: CuPy MemoryHook on the default pool (largest bytes in use during the call); "
        "torch: max_memory_allocated() after reset_peak_memory_stats(); reference backend: "
        "tracemalloc. Details in bench.json (measures.peak_memory)."
    )
    return [title, "", *table(header, rows), "", method, ""]


def one_line(text: str) -> str:
    """First and last line of a long message (a child's traceback); bench.json has it all."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} … {lines[-1]}"


def problem_lines(report: dict) -> list[str]:
    lines = []
    for key, system in report["systems"].items():
        if not system["available"]:
            lines.append(f"- {SYSTEM_LABELS[key]} not run: {system['reason']}")
        lines += [f"- {SYSTEM_LABELS[key]}: {note}" for note in system.get("notes", [])]
    for row in report["workloads"]:
        lines += row_problem_lines(report, row)
        lines += [f"- {row['name']}: {warning}" for warning in row.get("warnings", [])]
    if not lines:
        return []
    return ["## Skipped, errors, warnings", "", *lines, ""]


def row_problem_lines(report: dict, row: dict) -> list[str]:
    """Errors and skips of one row; systems that never ran are listed once, above."""
    if row["status"] == "skipped":
        return [f"- {row['name']}: skipped ({row['results']['flame'].get('reason')})"]
    lines = []
    for key, entry in row["results"].items():
        if not report["systems"][key]["available"]:
            continue
        if entry.get("status") == "error":
            lines.append(f"- {row['name']} / {SYSTEM_LABELS[key]}: {one_line(entry['error'])}")
        elif entry.get("status") == "skipped":
            lines.append(f"- {row['name']} / {SYSTEM_LABELS[key]}: skipped ({entry['reason']})")
    return lines


def floor_notes(rows: list) -> list[str]:
    """Rows whose floor is not the copy floor say so (before the summary, which comes last)."""
    notes = [
        f"- {row['name']}: floor = {row['floor_basis']}; % of copy bandwidth does not apply"
        for row in rows
        if row.get("floor_basis")
    ]
    return ["## Compute-bound floors", "", *notes, ""] if notes else []


def render_rows(rows: list, device_only: bool) -> list[str]:
    """The comparison table: device time only, or the summary (every workload)."""
    if device_only:
        rows = [row for row in rows if row["kind"] == DEVICE]
    return table(COMPARISON_HEADER, [comparison_row(row, device_only) for row in rows])


def probe_lines(rows: list) -> list[str]:
    """The host's speed during each host row: a fixed pure-Python workload timed in the same
    rounds (a slower probe means a slower host, for every system in that row)."""
    parts = [
        f"{row['name']} {number(probe['median_us'])} µs (best {number(probe['min_us'])})"
        + (
            f", audit hooks {number(probe['audit_hook_ns_per_event'])} ns per audited event"
            if probe.get("audit_hook_ns_per_event") is not None
            else ""
        )
        for row in rows
        if row["kind"] == HOST
        for probe in [row["results"].get("flame", {}).get("python_probe")]
        if probe
    ]
    if not parts:
        return []
    return [
        "- host speed, a pure-Python probe in the host rows' rounds: "
        + "; ".join(parts)
        + " (lazy mode records each op's user line without audited calls in a frame it has seen)",
        "",
    ]


def render(report: dict) -> str:
    rows = report["workloads"]
    lines = header_lines(report)
    lines += first_call_lines(report) + compile_lines(report) + correctness_lines(report)
    lines += memory_lines(report)
    if any(row["kind"] == DEVICE for row in rows):
        lines += ["## Device time only (host work hidden behind a spin kernel)", ""]
        lines += render_rows(rows, device_only=True) + [""]
    lines += problem_lines(report) + floor_notes(rows) + probe_lines(rows)
    lines += [
        "## Summary: per call, CUDA events back to back (FLAME builds and realizes every call);"
        " tiny20: host time per call",
        "",
        *render_rows(rows, device_only=False),
    ]
    return "\n".join(lines) + "\n"
