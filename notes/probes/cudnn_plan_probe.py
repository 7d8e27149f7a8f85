"""Where a first step's cuDNN plan building goes, and what other build choices would cost.

Runs bench.diffusion's FLAME UNet step once (fresh caches: every convolution plan is built),
recording each convolution configuration FLAME asked cuDNN for. Then, for each configuration
and each build variant, builds the plan again in a new graph, timing every phase (validate,
build_operation_graph, create_execution_plans, check_support, build_plans), and times the
plan's execution (CUDA events) on arrays of the configuration's dims and strides.

Variants: ``AF`` FLAME's (heuristics A then FALLBACK), ``A`` (heuristics A only), ``A-rt`` (A,
runtime-compiled engines deselected).

    FLAME_CACHE_DIR=$(mktemp -d) python3 notes/probes/cudnn_plan_probe.py OUT.json [SIZE BATCH]
"""

import faulthandler
import json
import sys
import time

import cupy

import flame as fl
from bench.diffusion_cases import flame_batch, flame_trainer
from flame.runtime import library_cudnn as dnn
from flame.runtime.library_conv import W, X, Y

UIDS = {"fprop": (X, W, Y), "dgrad": (Y, W, X), "wgrad": (X, Y, W)}


def main(out: str, size: int = 32, batch: int = 64) -> None:
    faulthandler.enable()
    seen = {}
    original = dnn.plan

    def recording(key, io_type, define, describe):
        started = time.perf_counter()
        made = original(key, io_type, define, describe)
        if key not in seen:
            seen[key] = (io_type, define, (time.perf_counter() - started) * 1e3, made.origin)
        return made

    dnn.plan = recording
    with fl.backend("cuda"):
        cupy.cuda.runtime.free(0)
        trainer = flame_trainer(("unet", "full", size, batch))
        started = time.perf_counter()
        trainer.compiled(*flame_batch(size, batch))
        fl.synchronize()
        first_ms = (time.perf_counter() - started) * 1e3
    dnn.plan = original
    session = dnn._load()
    cudnn = session["module"]
    variants = {
        "AF": ([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK], False),
        "A": ([cudnn.heur_mode.A], False),
        "A-rt": ([cudnn.heur_mode.A], True),
    }
    rows, others = [], []
    for key, (io_type, define, in_step_ms, origin) in seen.items():
        if key[0] not in UIDS:  # attention and other fused graphs: their in-step cost only
            others.append({"op": str(key[0]), "key": repr(key)[:300], "in_step_ms": in_step_ms})
            print(json.dumps(others[-1]), flush=True)
            continue
        kind, dtype, layouts, options = key
        arrays = []
        for dims, strides in layouts:
            extent = 1 + sum((d - 1) * s for d, s in zip(dims, strides))
            arrays.append(
                cupy.zeros(extent, dtype=cupy.uint16 if dtype != "float32" else cupy.float32)
            )
        pointers = {uid: a.data.ptr for uid, a in zip(UIDS[kind], arrays)}
        row = {"kind": kind, "dtype": dtype, "dims": [list(d) for d, _ in layouts],
               "strides": [list(s) for _, s in layouts], "options": options,
               "in_step_ms": in_step_ms, "origin": origin, "variants": {}}  # fmt: skip
        for name, (modes, no_runtime) in variants.items():
            print(kind, name, flush=True)
            with dnn._LOCK:
                _variant(row, name, session, io_type, define, modes, no_runtime, pointers)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("kind", "dims", "in_step_ms")}), flush=True)
    summary = {"first_step_ms": first_ms, "configurations": len(rows),
               "in_step_ms": sum(r["in_step_ms"] for r in rows),
               "other_in_step_ms": sum(r["in_step_ms"] for r in others)}  # fmt: skip
    for name in variants:
        done = [r["variants"][name] for r in rows if "kernel_us" in r["variants"][name]]
        summary[name] = {
            "built": len(done),
            "build_ms": sum(sum(v["phases"].values()) for v in done),
            "kernel_us": sum(v["kernel_us"] for v in done),
            "by_phase": {p: sum(v["phases"].get(p, 0) for v in done)
                         for p in ("validate", "operation_graph", "heuristics", "check_support",
                                   "build_plans")},
        }  # fmt: skip
    print(json.dumps(summary, indent=1))
    with open(out, "w") as handle:
        json.dump({"summary": summary, "rows": rows, "others": others}, handle, indent=1)


def _variant(row, name, session, io_type, define, modes, no_runtime, pointers):
    cudnn = session["module"]
    dnn._bind_stream(session)
    graph = dnn._new_graph(session, io_type)
    phases = {}

    def timed(phase, *steps):
        started = time.perf_counter()
        for step in steps:
            step()
        phases[phase] = (time.perf_counter() - started) * 1e3

    try:
        timed("validate", lambda: define(graph), graph.validate)
        timed("operation_graph", graph.build_operation_graph)
        timed("heuristics", lambda: graph.create_execution_plans(modes))
        if no_runtime:
            graph.deselect_behavior_notes([cudnn.behavior_note.RUNTIME_COMPILATION])
        timed("check_support", graph.check_support)
        timed("build_plans", graph.build_plans)
        candidates = graph.get_execution_plan_count()
        workspace = cupy.empty(max(graph.get_workspace_size(), 1), dtype=cupy.uint8)

        def call():
            graph.execute(pointers, workspace.data.ptr, handle=session["handle"])

        for _ in range(3):
            call()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(20):
            call()
        stop.record()
        stop.synchronize()
        kernel_us = cupy.cuda.get_elapsed_time(start, stop) * 1e3 / 20
        row["variants"][name] = {"phases": phases, "candidates": candidates,
                                         "kernel_us": kernel_us}  # fmt: skip
    except Exception as error:  # noqa: BLE001
        row["variants"][name] = {"phases": phases, "error": str(error)[:300]}


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
