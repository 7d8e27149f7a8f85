"""The ``resolutions`` section of bench/diffusion_kernels.py: one compiled training-style step
called at new resolutions and batch sizes in a fresh process, with what each call compiled.

The child (``python -m bench.diffusion_kernels --resolutions-child``) starts with empty
``FLAME_CACHE_DIR`` and ``CUPY_CACHE_DIR``. Per dtype (bfloat16, then float32) it compiles

    h = silu(group_norm(x, 32, weight, bias)) * scale + shift
    loss = (h.float() ** 2).mean(); loss.backward()

(the four parameters closed over, gradients into their ``.grad``) and calls it at a first shape,
at new resolutions, at new batch sizes, and at the first shape again. Each call is timed on the
host to its result (synchronized), and called a second time at that shape.

Two children, each cold (its own empty cache directories), run the same calls:

- ``timed``: nothing listens. NVRTC compiles per call are the process kernel cache's count
  (``default_kernel_cache().stats.compiles``), traces are ``cache_info().reasons``' new entries,
  and kernels compiled with their explanation are ``cache_info().kernels``' new entries where
  that field exists. Its host times are the ones the targets are read against.
- ``observed``: FLAME's compile events are recorded during each first call
  (flame/runtime/events.py; conv_attention's ``EventTotals`` mechanism): NVRTC compiles with
  every field the event carries beyond name, origin, seconds, key and source (an explanation
  of why the code changed, a size class, where FLAME gives one), traces with theirs, plans
  built. A listener makes the planner record its passes, so these host times run higher.

``cache_info()`` is kept at the end, all of its fields. A batch of 1 changes the signature (a
size-1 axis broadcasts), so it is a miss, not a re-plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.conv_attention import EventTotals, clear_grads, recording
from bench.harness import guarded
from bench.timing import wait_for_quiet_host

ROOT = Path(__file__).resolve().parent.parent
CHILD_MARKER = "FLAME_DIFFUSION_RESOLUTIONS "
NEW_SHAPE_MS = 20.0
# channels, first (batch, height, width), new (height, width), new batch sizes
PLANS = {
    "full": (
        320,
        (8, 32, 32),
        [(s, s) for s in (8, 12, 16, 20, 24, 40, 48, 56, 64, 96)] + [(32, 48), (48, 32)],
        (1, 2, 4, 16),
    ),
    "quick": (128, (4, 16, 16), [(8, 8), (12, 12), (24, 24), (16, 24)], (1, 2)),
    "tiny": (32, (2, 4, 4), [(2, 2), (6, 6), (4, 6)], (1, 3)),
}
LISTED = ("reasons", "kernels")  # cache_info lists the table shows per call: counted
KERNEL_FIELDS = {"name", "origin", "seconds", "key", "source"}
TRACE_FIELDS = {"function", "reason", "seconds"}


def plan_of(backend: str, quick: bool) -> tuple:
    return PLANS["tiny" if backend != "cuda" else "quick" if quick else "full"]


def call_shapes(backend: str, quick: bool) -> list[tuple[str, tuple]]:
    channels, (batch, height, width), sizes, batches = plan_of(backend, quick)
    first = (batch, channels, height, width)
    shapes = [("first", first)]
    shapes += [("resolution", (batch, channels, h, w)) for h, w in sizes]
    shapes += [("batch", (b, channels, height, width)) for b in batches]
    return [*shapes, ("again", first)]


def plain(value):
    """A JSON-safe copy: numbers, strings, lists and dicts as they are, the rest as text."""
    if isinstance(value, str | int | float | bool | type(None)):
        return value
    if isinstance(value, dict):
        return {str(key): plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set):
        return [plain(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    return str(value)


def extra_fields(data: dict, known: set) -> dict:
    """The event's fields beyond ``known``: an explanation where FLAME gives one."""
    return {k: plain(v) for k, v in data.items() if k not in known and not callable(v)}


class CallEvents(EventTotals):
    """conv_attention's totals by kind (kernels by origin), plus each NVRTC compile's name,
    time and extra fields, each trace's reason, and how many plans were built (not cached)."""

    def __init__(self):
        super().__init__()
        self.compiles, self.traces, self.plans_built = [], [], 0

    def __call__(self, kind: str, data: dict) -> None:
        super().__call__(kind, data)
        if kind == "kernel" and data.get("origin") == "compiled":
            self.compiles.append({"name": data.get("name"), "seconds": data.get("seconds"),
                                  **extra_fields(data, KERNEL_FIELDS)})  # fmt: skip
        elif kind == "trace":
            self.traces.append({"reason": data.get("reason"), **extra_fields(data, TRACE_FIELDS)})
        elif kind == "plan" and not data.get("cached"):
            self.plans_built += 1

    def count(self, kind: str) -> int:
        return self.totals.get(kind, {}).get("count", 0)


# --- the child ---------------------------------------------------------------------------------


def nvrtc_compiles():
    """The process's NVRTC compiles so far (None where FLAME's kernel cache cannot say)."""
    try:
        from flame.runtime.compiler import default_kernel_cache

        return default_kernel_cache().stats.compiles
    except Exception:
        return None


def resolutions_child(backend: str, quick: bool, observe: bool) -> None:
    started = time.perf_counter()
    import flame as fl

    result = {"import_flame_ms": (time.perf_counter() - started) * 1e3, "dtypes": {}}
    if backend == "cuda":
        import cupy

        cupy.cuda.runtime.free(0)  # the CUDA context, before the clock starts
    for dtype in ("bfloat16", "float32"):
        result["dtypes"][dtype] = guarded(sequence, fl, backend, quick, dtype, observe)
    print(CHILD_MARKER + json.dumps(result, default=str), flush=True)


def sequence(fl, backend: str, quick: bool, dtype: str, observe: bool) -> dict:
    import flame.nn.functional as F

    kind = getattr(fl, dtype)
    channels = plan_of(backend, quick)[0]
    with fl.backend(backend):
        params = [
            fl.ones(channels, dtype=kind), fl.zeros(channels, dtype=kind),
            fl.ones(channels, 1, 1, dtype=kind), fl.zeros(channels, 1, 1, dtype=kind),
        ]  # fmt: skip
        params = [param.realize().requires_grad_() for param in params]
    weight, bias, scale, shift = params

    @fl.compile
    def step(x):
        h = F.silu(F.group_norm(x, 32, weight, bias))
        h = h * scale + shift
        loss = (h.float() ** 2).mean()
        loss.backward()
        return loss

    calls = []
    for name, shape in call_shapes(backend, quick):
        with fl.backend(backend):
            x = fl.randn(*shape, dtype=kind).realize()
        fl.synchronize()
        events, times = CallEvents(), []
        info = step.cache_info()
        reasons, loads = len(getattr(info, "reasons", [])), len(getattr(info, "kernels", []))
        compiled = nvrtc_compiles()
        for first in (True, False):  # the first call at this shape, then a second one
            clear_grads(params)
            with recording(events) if first and observe else contextlib.nullcontext():
                start = time.perf_counter()
                step(x)
                fl.synchronize()
                times.append((time.perf_counter() - start) * 1e3)
            if first and compiled is not None:
                compiled = nvrtc_compiles() - compiled
        call = {
            "kind": name,
            "shape": list(shape),
            "host_ms": times[0],
            "again_ms": times[1],
            "nvrtc_compiles": compiled,
            "traces": getattr(info, "reasons", [])[reasons:],
            "kernel_loads": plain(getattr(info, "kernels", [])[loads:]),
        }
        if observe:
            call["observed"] = {
                "nvrtc_compiles": events.count("kernel_compiled"),
                "compile_seconds": sum(c["seconds"] or 0.0 for c in events.compiles),
                "kernels_from": {
                    origin: events.count(f"kernel_{origin}")
                    for origin in ("memory", "disk", "compiled")
                },
                "plans_built": events.plans_built,
                "traces": events.traces,
                "compiles": events.compiles,
                "events": events.totals,
            }
        calls.append(call)
    return {"calls": calls, "cache_info": plain(step.cache_info())}


# --- the parent --------------------------------------------------------------------------------


def run_child(backend: str, quick: bool, observe: bool) -> dict:
    """One cold child: fresh, empty FLAME and CuPy cache directories."""
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    environment["FLAME_CACHE_DIR"] = tempfile.mkdtemp(prefix="flame-diffusion-cache-")
    environment["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy-diffusion-cache-")
    command = [sys.executable, "-m", "bench.diffusion_kernels", "--resolutions-child",
               "--backend", backend, *(["--quick"] if quick else []),
               *(["--observe"] if observe else [])]  # fmt: skip
    quiet = wait_for_quiet_host(limit=20.0) if backend == "cuda" else None
    start = time.perf_counter()
    completed = subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600
    )
    wall_ms = (time.perf_counter() - start) * 1e3
    for line in completed.stdout.splitlines():
        if line.startswith(CHILD_MARKER):
            found = json.loads(line[len(CHILD_MARKER) :])
            return {"process_wall_ms": wall_ms, "quiet_host": quiet,
                    "cache_dir": environment["FLAME_CACHE_DIR"], **found}  # fmt: skip
    raise RuntimeError(f"child exited {completed.returncode}: {completed.stderr[-2000:]}")


def summary(calls: list, observed: list) -> dict:
    """New shapes (resolutions and batch sizes): those that compiled, those over 20 ms, the
    host times' median and maximum (the timed child's), and the size classes its compiles
    served, where FLAME names them (``cache_info().kernels``, or the compile events)."""
    new = [call for call in calls if call["kind"] in ("resolution", "batch")]
    times = [call["host_ms"] for call in new]
    compiles = [
        c for call in calls for c in call.get("kernel_loads", []) if c.get("origin") == "compiled"
    ]
    compiles += [c for call in observed for c in call["observed"]["compiles"]]
    classes = sorted({str(c["size_class"]) for c in compiles if c.get("size_class")})  # fmt: skip
    return {
        "new_shapes": len(new),
        "compiled": [call["shape"] for call in new if call["nvrtc_compiles"]],
        "over_target_ms": [call["shape"] for call in new if call["host_ms"] > NEW_SHAPE_MS],
        "median_host_ms": statistics.median(times) if times else None,
        "max_host_ms": max(times) if times else None,
        "size_classes_compiled": classes,
    }


def resolutions_section(backend: str, quick: bool) -> dict:
    channels, first, sizes, batches = plan_of(backend, quick)
    result = {"plan": {"channels": channels, "first": first, "sizes": sizes, "batches": batches}}
    for name, observe in (("timed", False), ("observed", True)):
        print(f"[diffusion_kernels] resolutions: {name} child", file=sys.stderr, flush=True)
        result[name] = guarded(run_child, backend, quick, observe)
    timed, observed = result["timed"], result["observed"]
    for dtype, entry in timed.get("dtypes", {}).items():
        other = observed.get("dtypes", {}).get(dtype, {})
        if entry.get("status") == "ok":
            entry["summary"] = summary(entry["calls"], other.get("calls", []))
    return result


# --- report ------------------------------------------------------------------------------------


def compiles_cell(compiles: list, shown: int = 3) -> str:
    """Each compile's kernel name and its other fields (an explanation, where FLAME gives
    one): compile events, or ``cache_info().kernels`` entries."""
    compiles = [entry for entry in compiles if entry.get("origin", "compiled") == "compiled"]
    if not compiles:
        return "-"
    parts = []
    for entry in compiles[:shown]:
        name = entry.get("name", entry.get("kernel"))
        hidden = ("name", "kernel", "seconds", "origin", "trace")
        extra = ", ".join(f"{k}={v}" for k, v in entry.items() if k not in hidden and v != "")
        parts.append(f"{name}" + (f" ({extra})" if extra else ""))
    more = f"; +{len(compiles) - shown} more" if len(compiles) > shown else ""
    return "; ".join(parts) + more


def shape_text(shape: list) -> str:
    return "x".join(map(str, shape))


def cell(text) -> str:
    return str(text).replace("|", "/")


def observed_cells(call: dict | None) -> list[str]:
    if not call or "observed" not in call:
        return ["-"] * 4
    seen = call["observed"]
    return [f"{call['host_ms']:.1f}", f"{seen['nvrtc_compiles']} ({seen['compile_seconds']:.2f})",
            str(seen["plans_built"]), cell(compiles_cell(seen["compiles"]))]  # fmt: skip


def dtype_lines(entry: dict, observed: dict) -> list[str]:
    if entry.get("status") != "ok":
        return [f"error: {entry.get('error')}"]
    others = observed.get("calls", []) if observed.get("status") == "ok" else []
    header = ["call", "shape", "host ms", "again ms", "NVRTC compiles", "traces", "compiled",
              "observed: host ms", "NVRTC compiles (s)", "plans built", "compiled"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for index, call in enumerate(entry["calls"]):
        other = others[index] if index < len(others) else None
        traces = cell("; ".join(map(str, call["traces"])) or "-")
        compiled = cell(compiles_cell(call.get("kernel_loads", [])))
        cells = [call["kind"], shape_text(call["shape"]), f"{call['host_ms']:.1f}",
                 f"{call['again_ms']:.2f}", str(call["nvrtc_compiles"]), traces, compiled,
                 *observed_cells(other)]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    found, info = entry["summary"], entry["cache_info"]
    compiled = ", ".join(map(shape_text, found["compiled"])) or "none"
    slow = ", ".join(map(shape_text, found["over_target_ms"])) or "none"
    shown = (", ".join(f"{k}={len(v) if k in LISTED else v}" for k, v in info.items())
             if isinstance(info, dict) else str(info))  # fmt: skip
    return lines + [
        "",
        f"- New shapes: {found['new_shapes']}; with NVRTC compiles: {compiled}; "
        f"over {NEW_SHAPE_MS:.0f} ms: {slow}.",
        f"- Host ms per new shape: median {found['median_host_ms']:.1f}, "
        f"max {found['max_host_ms']:.1f}.",
        "- Size classes named by compile events: "
        f"{', '.join(found['size_classes_compiled']) or 'none named'}.",
        f"- cache_info: {shown}",
    ]


def resolutions_lines(section: dict) -> list[str]:
    timed, observed = section.get("timed", {}), section.get("observed", {})
    if timed.get("status") != "ok":
        return [f"timed child: {timed.get('error')}"]
    lines = [
        f"Fresh processes, empty caches; import flame {timed['import_flame_ms']:.0f} ms. Host "
        "ms: the first call at that shape, synchronized, nothing listening; again: a second "
        "call; NVRTC compiles: the kernel cache's count. Observed: a second cold child with "
        "FLAME's compile events recorded (slower: the planner records its passes)."
    ]
    if observed.get("status") != "ok":
        lines.append(f"observed child: {observed.get('error')}")
    for dtype, entry in timed["dtypes"].items():
        lines += ["", f"### {dtype}", ""]
        lines += dtype_lines(entry, observed.get("dtypes", {}).get(dtype, {}))
    return lines
