"""bench/conv_attention.py's ``compile`` section: the first call of a compiled conv + attention
training step with new configurations, in a fresh process: cold (empty ``FLAME_CACHE_DIR`` and
``CUPY_CACHE_DIR``), then warm from disk (a second process, the same directories). The child is
``python -m bench.conv_attention --first-call-child``; it prints one line of JSON."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.conv_attention_cases import TARGETS
from bench.harness import guarded
from bench.side_by_side import clear_grads, progress
from bench.timing import wait_for_quiet_host

ROOT = Path(__file__).resolve().parent.parent
CHILD_MARKER = "FLAME_CONV_ATTENTION_FIRSTCALL "
# (batch, channels, size) of a 3x3 conv, padding 1; (batch, heads, length, head dim)
FIRST_CALL = {"cuda": ((2, 320, 32), (2, 5, 1024, 64)), "reference": ((1, 4, 8), (1, 2, 16, 8))}
GRAD_INPUTS = (0, 1, 3, 4, 5)  # x, w, q, k, v


def first_call_child(backend: str) -> None:
    """In the child: import, context, inputs on the device, then the timed first call (and a
    second one) of a compiled conv + attention training step; one line of JSON."""
    started = time.perf_counter()
    import flame as fl
    import flame.nn.functional as F

    stamps = {"import_flame_ms": (time.perf_counter() - started) * 1e3}
    if backend == "cuda":
        import cupy

        cupy.cuda.runtime.free(0)  # the CUDA context, before the clock starts
    with fl.backend(backend):
        tensors = first_call_inputs(fl, *FIRST_CALL[backend])
    fl.synchronize()

    @fl.compile
    def step(x, w, gy, q, k, v, go):
        loss = (F.conv2d(x, w, padding=1) * gy).sum()
        loss = loss + (F.scaled_dot_product_attention(q, k, v) * go).sum()
        loss.backward()
        return loss

    events = EventTotals()
    for name in ("first_call_ms", "second_call_ms"):
        clear_grads(tensors[index] for index in GRAD_INPUTS)
        with recording(events) if name == "first_call_ms" else contextlib.nullcontext():
            start = time.perf_counter()
            step(*tensors)
            fl.synchronize()
            stamps[name] = (time.perf_counter() - start) * 1e3
    stamps["events"] = events.totals
    stamps["cache_info"] = str(step.cache_info())
    print(CHILD_MARKER + json.dumps(stamps), flush=True)


def first_call_inputs(fl, conv: tuple, attention: tuple) -> list:
    """x, w, gy of the conv and q, k, v, go of the attention, realized; x, w, q, k, v need grads."""
    batch, channels, size = conv
    shapes = [(batch, channels, size, size), (channels, channels, 3, 3)]
    shapes += [(batch, channels, size, size)] + [attention] * 4
    tensors = [fl.randn(*shape, dtype=fl.bfloat16).realize() for shape in shapes]
    for index in GRAD_INPUTS:
        tensors[index].requires_grad_()
    return tensors


class EventTotals:
    """FLAME's compile events (flame/runtime/events.py), counted and timed by kind (kernels
    also by origin: memory, disk, compiled)."""

    def __init__(self):
        self.totals = {}

    def __call__(self, kind: str, data: dict) -> None:
        if kind == "kernel":
            kind = f"kernel_{data.get('origin')}"
        entry = self.totals.setdefault(kind, {"count": 0, "seconds": 0.0})
        entry["count"] += 1
        entry["seconds"] += float(data.get("seconds") or 0.0)


def recording(recorder):
    try:
        from flame.runtime.events import recording as flame_recording
    except ImportError:  # an internal module: its absence costs the breakdown only
        return contextlib.nullcontext()
    return flame_recording(recorder)


def run_child(environment: dict, backend: str) -> dict:
    start = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, "-m", "bench.conv_attention", "--first-call-child", "--backend", backend],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall_ms = (time.perf_counter() - start) * 1e3
    for line in completed.stdout.splitlines():
        if line.startswith(CHILD_MARKER):
            return {"process_wall_ms": wall_ms, **json.loads(line[len(CHILD_MARKER) :])}
    raise RuntimeError(f"child exited {completed.returncode}: {completed.stderr[-2000:]}")


def compile_section(backend: str) -> dict:
    conv, attention = FIRST_CALL[backend]
    result = {"target": TARGETS["compile"], "conv": conv, "attention": attention}
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    environment["FLAME_CACHE_DIR"] = tempfile.mkdtemp(prefix="flame-conv-attention-cache-")
    environment["CUPY_CACHE_DIR"] = tempfile.mkdtemp(prefix="cupy-conv-attention-cache-")
    result["cache_dir"] = environment["FLAME_CACHE_DIR"]
    for name in ("cold", "warm_disk"):
        quiet = wait_for_quiet_host(limit=20.0) if backend == "cuda" else None
        progress(f"compile: {name}")
        result[name] = {**guarded(run_child, environment, backend), "quiet_host": quiet}
    return result
