"""Derived figures (floors, % of copy bandwidth, ratios, verdicts), bench.json and bench.md.

Everything here reads the plain dictionaries the harness produced, so a saved bench.json can be
rendered again: ``python -m bench.report OUT/bench.json``.
"""

import json
import sys
from pathlib import Path

from bench import markdown
from bench.markdown import PEERS
from bench.workloads import DEVICE, HOST

# A fused kernel cannot beat a plain copy of the same bytes by much; past this, suspect skipped
# work (a cached result, an unwritten output) before celebrating.
SUSPICIOUS_PERCENT = 105.0


def annotate(row: dict, copy: dict | None):
    """Adds verdicts, bandwidth figures and ratios to one workload's row, in place."""
    results = row["results"]
    for entry in results.values():
        check = entry.get("check", {})
        if entry["status"] == "ok" and check.get("passed") is False:
            entry["status"] = "FAILED"
    row["status"] = results["flame"]["status"]
    row["warnings"] = []
    if row["kind"] == DEVICE and "flops" in row:
        annotate_compute(row)
    elif row["kind"] == DEVICE:
        annotate_bandwidth(row, copy)
    if row["kind"] in (DEVICE, HOST):
        annotate_ratios(row)
    annotate_memory(row)


def annotate_memory(row: dict):
    """FLAME's peak memory over PyTorch eager's; issue 4's target is FLAME <= eager."""
    peaks = {
        key: entry["peak_memory"]["peak_mb"]
        for key, entry in row["results"].items()
        if entry.get("status") in ("ok", "FAILED") and "peak_mb" in entry.get("peak_memory", {})
    }
    if "flame" in peaks and peaks.get("torch_eager"):
        row["peak_memory_flame_over_eager"] = peaks["flame"] / peaks["torch_eager"]
        row["peak_memory_target_met"] = peaks["flame"] <= peaks["torch_eager"]


def annotate_bandwidth(row: dict, copy: dict | None):
    if copy is None:
        return
    floor_ms = row["floor_bytes"] / (copy["gb_per_s"] * 1e9) * 1e3
    row["floor_ms"] = floor_ms
    for key, entry in row["results"].items():
        for metric in ("steady", "device"):
            if metric not in entry:
                continue
            stats = entry[metric]
            stats["gb_per_s"] = row["floor_bytes"] / (stats["median_ms"] * 1e-3) / 1e9
            stats["pct_of_copy_bandwidth"] = floor_ms / stats["median_ms"] * 100
            if key == "flame" and stats["pct_of_copy_bandwidth"] > SUSPICIOUS_PERCENT:
                row["warnings"].append(
                    f"flame {metric} time is {stats['pct_of_copy_bandwidth']:.0f} % of the copy "
                    "bandwidth: faster than a copy, check that the work was really done"
                )


def annotate_compute(row: dict):
    """TFLOP/s of every timing; the floor is the FLOPs at PyTorch eager's measured rate (its
    device time: cuBLAS, the best library rate this run has). No % of copy bandwidth."""
    results = row["results"]
    for entry in results.values():
        for metric in ("steady", "device"):
            if metric in entry:
                stats = entry[metric]
                stats["tflop_per_s"] = row["flops"] / (stats["median_ms"] * 1e-3) / 1e12
    torch = results.get("torch_eager", {})
    rate = torch.get("device", {}).get("tflop_per_s") if torch.get("status") == "ok" else None
    if rate:
        row["floor_ms"] = row["flops"] / (rate * 1e12) * 1e3
        row["floor_basis"] = f"FLOPs / torch eager's measured {rate:.1f} TFLOP/s"


def headline(row: dict, entry: dict) -> tuple[str, dict] | None:
    """(unit, stats) of the number a row is judged by, or None where there is none."""
    if row["kind"] == DEVICE and "steady" in entry:
        return "ms", entry["steady"]
    if row["kind"] == HOST and "host" in entry:
        return "us", entry["host"]
    return None


def annotate_ratios(row: dict):
    """Speedup of FLAME over each peer (> 1: FLAME is faster), on the headline and device time."""
    results = row["results"]
    flame = headline(row, results["flame"])
    for key in PEERS:
        entry = results.get(key, {})
        peer = headline(row, entry)
        if flame is None or peer is None:
            continue
        unit = flame[0]
        entry["flame_speedup"] = peer[1][f"median_{unit}"] / flame[1][f"median_{unit}"]
        if "device" in entry and "device" in results["flame"]:
            flame_device = results["flame"]["device"]["median_ms"]
            entry["device_flame_speedup"] = entry["device"]["median_ms"] / flame_device


def build_report(session, rows: list, versions: dict, started: str, seconds: float) -> dict:
    for row in rows:
        annotate(row, session.copy)
    options = session.options
    return {
        "schema": 1,
        "started": started,
        "seconds": seconds,
        "device": session.gpu or {"name": "none", "reason": session.gpu_reason},
        "backend": options.backend,
        "options": {
            "quick": options.quick,
            "repeats": options.repeats,
            "warmup": options.warmup,
            "host_calls": options.host_calls,
            "host_repeats": options.host_repeats,
        },
        "versions": versions,
        "systems": {
            system.key: {
                "available": system.available,
                "reason": system.skip_reason,
                "clock": getattr(system.clock, "name", None),
                "notes": system.notes,
            }
            for system in session.systems
        },
        "copy_bandwidth": session.copy or {"error": session.copy_error},
        "measures": MEASURES_EXPLAINED,
        "workloads": rows,
    }


MEASURES_EXPLAINED = {
    "steady": "CUDA events around each call, calls issued back to back after warm-up; FLAME "
    "builds the lazy graph from realized inputs and realizes it inside every call",
    "device": "CUDA events around the launch only, queued behind a spin kernel so host work is "
    "hidden; FLAME: realize() of a graph built before the events",
    "latency": "synchronize, events around one call, synchronize: host and device time added",
    "host": "wall time over host_calls calls, then one synchronize, per call",
    "first_call_ms": "wall time of the first call in this process, compile included",
    "floor_ms": "bytes that must move (inputs read once, output written once) / copy bandwidth; "
    "for rows with flops (matrix products): FLOPs / torch eager's measured rate (device time); "
    "forward + backward rows: their declared passes (see the row's description)",
    "tflop_per_s": "flops / median time (rows with flops only)",
    "peak_memory": "forward + backward rows: MB (10^6 B) allocated at the peak of one call after "
    "warm-up, above what was allocated before it (inputs not counted, outputs counted); FLAME: "
    "CuPy MemoryHook on the default pool (pool_growth_mb: total_bytes() growth after "
    "free_all_blocks(), a cross-check only: split blocks that stay cached are reused); torch: "
    "max_memory_allocated() after reset_peak_memory_stats()",
    "flame_speedup": "peer median / FLAME median on the headline measure (> 1: FLAME faster)",
}


def write(report: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = out / "bench.json", out / "bench.md"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    markdown_path.write_text(markdown.render(report))
    return json_path, markdown_path


def main(argv=None):
    """Renders bench.md again from a saved bench.json."""
    arguments = sys.argv[1:] if argv is None else argv
    if len(arguments) != 1:
        print("usage: python -m bench.report OUT/bench.json", file=sys.stderr)
        return 2
    print(markdown.render(json.loads(Path(arguments[0]).read_text())), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
