"""The dump folder: text files for every recorded graph, written so that no file is ever seen
half-written, and a summary that says whether the run it describes finished.

    OUT/summary.txt              graphs, kernels, compile time, cache hits; per-kernel table
    OUT/manifest.json            everything below, as data (complete: true|false)
    OUT/index.html               the picture: graphs, fusion clusters, IR and kernel sources
    OUT/graph-NNN/passes/PP-NAME.ir   the IR after each pass (first line: pass and time)
    OUT/graph-NNN/fusion.txt     kernels, what they write and why each boundary exists
    OUT/graph-NNN/kernels.txt    launch, registers, spills, shared memory, bytes, floor, cache
    OUT/graph-NNN/kNN-NAME.cu    each kernel's CUDA source, headed by the dump's notes
    OUT/graph-NNN/graph.dot      the graph with fusion groups as clusters (graph.svg with dot)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
from pathlib import Path

from flame.tools.recorder import DumpRecorder, GraphRecord, KernelRecord, kernel_floor_ms

MARKER = ".flame-dump"
_OWNED = ("summary.txt", "manifest.json", "index.html")


class DumpError(RuntimeError):
    """The dump folder cannot be used or written; the message says which and why."""


def prepare_folder(out: Path) -> Path:
    """Create ``out`` (or reuse an earlier dump there), proving it is writable before anything
    runs. A folder that holds other files is refused rather than mixed with a dump."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DumpError(f"cannot dump to {out}: it is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        entries = [entry.name for entry in out.iterdir()]
        if entries and MARKER not in entries:
            raise DumpError(
                f"cannot dump to {out}: the folder holds other files and no earlier FLAME dump; "
                "choose an empty or new folder with --out"
            )
        for name in entries:  # an earlier dump: remove it, so no stale kernel survives
            path = out / name
            if path.is_dir() and name.startswith("graph-"):
                shutil.rmtree(path)
            elif name in _OWNED:
                path.unlink()
        write_atomic(out / MARKER, "a FLAME dump folder (flame dump / FLAME_DUMP)\n")
    except OSError as error:
        raise DumpError(f"cannot write to {out}: {error.strerror or error}") from None
    return out


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except OSError as error:
        temporary.unlink(missing_ok=True)
        raise DumpError(f"cannot write {path}: {error.strerror or error}") from None


# -- text of one graph --------------------------------------------------------------------


def passes_text(record: GraphRecord, timings: bool = True) -> list[tuple[str, str]]:
    """(file name, text) of the IR after each pass."""
    files = []
    for position, (name, seconds, text) in enumerate(record.passes):
        when = f" ({seconds * 1e3:.3f} ms)" if timings else ""
        files.append((f"{position:02d}-{name}.ir", f"// after {name}{when}\n{text}\n"))
    return files


def fusion_text(record: GraphRecord) -> str:
    lines = [f"{record.title}: {len(record.kernels)} kernels", *record.remat, ""]
    for kernel in record.kernels:
        lines.append(f"k{kernel.index} {kernel.kind} over {kernel.label}: {kernel.name}")
        size_class = getattr(kernel.spec, "size_class", "")
        if size_class:  # the sizes this code serves; another class is other code
            lines.append(f"  size class: {size_class}")
        lines += [f"  why: {reason}" for reason in kernel.reasons]
        if kernel.sites:
            lines.append(f"  user lines: {', '.join(kernel.sites)}")
        lines += ["  " + line for line in kernel.ir.splitlines()]
        lines.append("")
    return "\n".join(lines)


def golden_text(record: GraphRecord) -> str:
    """Everything deterministic about a graph: passes, fusion and kernel sources (no times,
    no NVRTC numbers, no paths), for golden files that show what a change did to kernels."""
    parts, previous = [], None
    for name, _, text in record.passes:  # an unchanged graph is said, not repeated
        parts.append(f"// after {name}: unchanged\n" if text == previous else
                     f"// after {name}\n{text}\n")  # fmt: skip
        previous = text
    parts.append(fusion_text(record))
    for kernel in record.kernels:
        if kernel.source is not None:
            parts.append(f"// ===== k{kernel.index}\n{kernel.source}")
    return "\n".join(parts)


def kernel_file_name(kernel: KernelRecord) -> str:
    return f"k{kernel.index:02d}-{kernel.name}.cu"


def resources_text(kernel: KernelRecord) -> str:
    found = kernel.resources
    if not found:
        return f"unavailable ({kernel.resources_note})"
    parts = [f"{found['registers']} registers"]
    if "spill_stores" in found:
        parts.append(f"spills {found['spill_stores']} B stored / {found['spill_loads']} B loaded")
    if "stack" in found:
        parts.append(f"{found['stack']} B stack")
    parts.append(f"{found.get('shared', 0)} B shared")
    if "local_bytes" in found:
        parts.append(f"{found['local_bytes']} B local")
    return ", ".join(parts) + f" ({kernel.resources_note})"


def kernel_notes(kernel: KernelRecord, record: GraphRecord, bandwidth: float) -> list[str]:
    floor = kernel_floor_ms(kernel, bandwidth)
    lines = [
        f"{record.title}, kernel k{kernel.index}: {kernel.kind} over {kernel.label}",
        f"writes {', '.join(kernel.writes)}",
        *[f"why: {reason}" for reason in kernel.reasons],
        f"launch: grid {kernel.grid}, block {kernel.block} ({kernel.launch_note})"
        if kernel.grid is not None else f"launch: {kernel.launch_note}",
        f"resources: {resources_text(kernel)}" if kernel.kind != "library" else "resources: -",
        *[f"size class: {name}" for name in [getattr(kernel.spec, "size_class", "")] if name],
        f"bytes moved: {kernel.bytes_moved:,} (floor {floor * 1e3:.3f} us at "
        f"{bandwidth / 1e9:.0f} GB/s)",
        f"cache: {kernel.cache} ({kernel.cache_reason})",
    ]  # fmt: skip
    if kernel.times_ms:
        median = statistics.median(kernel.times_ms)
        lines.append(
            f"gpu time: median {median * 1e3:.3f} us, best {min(kernel.times_ms) * 1e3:.3f} us "
            f"over {len(kernel.times_ms)} runs; the median is {100 * floor / median:.0f}% of "
            "the floor"
        )
    return lines


def kernels_table(record: GraphRecord, bandwidth: float) -> str:
    blocks = []
    for kernel in record.kernels:
        blocks.append("\n".join([f"k{kernel.index} {kernel.name}"] + [
            "  " + line for line in kernel_notes(kernel, record, bandwidth)[1:]
        ]))  # fmt: skip
    return "\n\n".join(blocks) + "\n"


# -- the whole folder ---------------------------------------------------------------------


def write_dump(out: Path, recorder: DumpRecorder, status: dict) -> dict:
    """Write every record, then the manifest and summary (last: they say it is complete)."""
    from flame.tools.picture import render_dot, render_html, render_svg

    manifest = {"complete": status.get("complete", True), "status": status, "graphs": []}
    for record in list(recorder.graphs):
        folder = out / f"graph-{record.index:03d}"
        for name, text in passes_text(record):
            write_atomic(folder / "passes" / name, text)
        write_atomic(folder / "fusion.txt", fusion_text(record) + "\n")
        write_atomic(folder / "kernels.txt", kernels_table(record, recorder.bandwidth))
        for kernel in record.kernels:
            if kernel.source is not None:
                notes = kernel_notes(kernel, record, recorder.bandwidth)
                header = "".join(f"// dump: {line}\n" for line in notes)
                write_atomic(folder / kernel_file_name(kernel), header + kernel.source)
        dot = render_dot(record)
        write_atomic(folder / "graph.dot", dot)
        svg = render_svg(dot)
        if svg is not None:
            write_atomic(folder / "graph.svg", svg)
        manifest["graphs"].append(graph_manifest(record, folder.name, recorder.bandwidth))
    manifest["traces"] = recorder.traces
    manifest["notes"] = recorder.notes
    manifest["summary"] = summary_numbers(recorder)
    write_atomic(out / "index.html", render_html(recorder, status))
    write_atomic(out / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    write_atomic(out / "summary.txt", summary_text(recorder, status, out, detail=True))
    return manifest


def graph_manifest(record: GraphRecord, folder: str, bandwidth: float) -> dict:
    return {
        "index": record.index, "folder": folder, "backend": record.backend,
        "plan_seconds": record.plan_seconds, "plan_reason": record.plan_reason,
        "plan_hits": record.hits, "runs": record.runs,
        "passes": [{"name": name, "seconds": seconds} for name, seconds, _ in record.passes],
        "save_recompute": record.remat,
        "kernels": [kernel_manifest(kernel, bandwidth) for kernel in record.kernels],
    }  # fmt: skip


def kernel_manifest(kernel: KernelRecord, bandwidth: float) -> dict:
    return {
        "index": kernel.index, "name": kernel.name, "kind": kernel.kind, "label": kernel.label,
        "writes": kernel.writes, "reasons": kernel.reasons, "sites": kernel.sites,
        "file": kernel_file_name(kernel) if kernel.source is not None else None,
        "grid": kernel.grid, "block": kernel.block, "launch_note": kernel.launch_note,
        "size_class": getattr(kernel.spec, "size_class", ""),
        "resources": kernel.resources, "resources_note": kernel.resources_note,
        "bytes": kernel.bytes_moved, "floor_ms": kernel_floor_ms(kernel, bandwidth),
        "cache": kernel.cache, "cache_reason": kernel.cache_reason,
        "compile_seconds": kernel.compile_seconds, "times_ms": kernel.times_ms,
    }  # fmt: skip


def summary_numbers(recorder: DumpRecorder) -> dict:
    kernels = [k for record in recorder.graphs for k in record.kernels]
    generated = [k for k in kernels if k.kind != "library"]
    origins = {}
    for kernel in generated:
        origins[kernel.cache] = origins.get(kernel.cache, 0) + 1
    compile_seconds = sum(k.compile_seconds or 0.0 for k in generated if k.cache != "disk")
    return {
        "graphs": len(recorder.graphs),
        "plan_hits": sum(record.hits for record in recorder.graphs),
        "kernels": len(generated),
        "library_calls": len(kernels) - len(generated),
        "cache": origins,
        "compile_seconds": compile_seconds,
        "plan_seconds": sum(record.plan_seconds for record in recorder.graphs),
        "traces": len(recorder.traces),
    }


def summary_text(recorder: DumpRecorder, status: dict, out: Path | None, detail: bool) -> str:
    numbers = summary_numbers(recorder)
    cache = ", ".join(f"{count} {origin}" for origin, count in sorted(numbers["cache"].items()))
    lines = []
    if not status.get("complete", True):
        lines.append(f"INCOMPLETE: {status.get('reason', 'the run did not finish')}")
    lines += [
        f"graphs: {numbers['graphs']} planned, {numbers['plan_hits']} plan-cache hits"
        f" (planning {numbers['plan_seconds'] * 1e3:.1f} ms)",
        f"kernels: {numbers['kernels']} generated, {numbers['library_calls']} library calls;"
        f" compile {numbers['compile_seconds']:.3f} s" + (f"; cache: {cache}" if cache else ""),
    ]
    for trace in recorder.traces:
        lines.append(
            f"flame.compile traced {trace['function']} ({trace['reason']}, "
            f"{trace['seconds'] * 1e3:.1f} ms)"
        )
    lines += [f"note: {note}" for note in recorder.notes]
    others = recorder.other_kernels()
    if others:
        listed = ", ".join(f"{name} [{origin}]" for name, origin in others[:8])
        more = f" and {len(others) - 8} more" if len(others) > 8 else ""
        lines.append(f"kernels outside planned graphs (foreach, indexing): {listed}{more}")
    lines += profile_lines(recorder, limit=None if detail else 10)
    if detail:
        for record in recorder.graphs:
            lines.append("")
            lines.append(f"{record.title} ({record.backend}): {record.plan_reason}")
            lines.append(f"  plan-cache hits: {record.hits}, runs: {record.runs}")
            lines += [f"  {line}" for line in record.remat]
            for kernel in record.kernels:
                sites = ", ".join(kernel.sites[:3])
                lines.append(f"  k{kernel.index} {kernel.name}  [{kernel.cache}]  {sites}")
    if out is not None:
        lines.append(f"dump written to {out}")
    return "\n".join(lines) + "\n"


def profile_lines(recorder: DumpRecorder, limit: int | None) -> list[str]:
    """Measured GPU time per kernel, slowest first, with the floor and the user's line."""
    rows = []
    for record in recorder.graphs:
        for kernel in record.kernels:
            if kernel.times_ms:
                total = sum(kernel.times_ms)
                rows.append((total, kernel, record))
    if not rows:
        return []
    rows.sort(key=lambda row: -row[0])
    lines = [
        "",
        "   total ms   calls median us  floor us  % floor  kernel  (graph, user line)",
    ]
    for total, kernel, record in rows[:limit]:
        median = statistics.median(kernel.times_ms)  # the first, cold launches skew a mean
        floor = kernel_floor_ms(kernel, recorder.bandwidth)
        where = f"g{record.index} k{kernel.index}, {kernel.sites[-1] if kernel.sites else '-'}"
        lines.append(
            f"{total:11.3f} {len(kernel.times_ms):7d} {median * 1e3:9.2f} {floor * 1e3:9.2f} "
            f"{100 * floor / median:7.0f}%  {kernel.name}  ({where})"
        )
    return lines
