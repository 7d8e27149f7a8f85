"""Diffusion training and sampling: FLAME against the same work in PyTorch (eager and
torch.compile, default mode), bfloat16 autocast on every system.

    python -m bench.diffusion --out DIR [--quick] [--backend cuda|reference]
                              [--only step|memory|first-step|sampling]

- ``step``: one training step (random timesteps, noise and 10% label dropout, MSE loss,
  backward, grad-norm clip 1.0, AdamW, EMA) of the DDPM UNet at b64 32x32x3 and b16 64x64x3 and
  DiT-S/2 at b64 32x32x3. FLAME: ``examples.diffusion.train.Trainer``'s compiled step. PyTorch:
  the same step with ``AdamW(fused=True)`` and ``torch._foreach_lerp_``; torch.compile wraps the
  draws, forward and loss (backward by AOTAutograd; clip, AdamW and EMA are multi-tensor
  kernels on both sides). Same initial weights. Device ms (median), images/s, peer / FLAME.
- ``memory``: peak memory of one step above the resident state (FLAME: a CuPy hook on the pool
  it allocates from, bench/memory.py; PyTorch: ``max_memory_allocated``), and FLAME with
  ``checkpoint=True`` blocks (MB saved, step-time cost).
- ``first-step``: FLAME's first UNet step in a fresh process with empty caches, then in a
  second fresh process with the warm disk cache, which then steps at a new resolution;
  torch.compile the same way (fresh ``TORCHINDUCTOR_CACHE_DIR``).
- ``sampling``: DDIM, 50 steps, 256 images, guidance w = 2, no gradients; same weights, noise
  and labels everywhere.

``--backend reference``: a CPU smoke run (tiny models, PyTorch on the CPU, no torch.compile, no
ratios). Writes ``diffusion.json`` and ``diffusion.md`` under ``--out``.

The cases, targets and the systems' pieces are in bench/diffusion_cases.py, the sampling
section in bench/diffusion_sampling.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench import conv_attention as ca
from bench.diffusion_cases import (  # noqa: F401  (the names bench/diffusion.py had)
    CFG_DROPOUT,
    CHANNELS,
    CLASSES,
    EMA_DECAY,
    FIRST_STEP,
    GUIDANCE,
    LR,
    SAMPLING_CASES,
    STEP_CASES,
    TARGETS,
    TorchStep,
    flame_batch,
    flame_trainer,
    progress,
    targets_met,
    torch_batch,
    torch_model,
)
from bench.diffusion_sampling import sampling_section, sampling_systems  # noqa: F401
from bench.harness import guarded
from bench.timing import wait_for_quiet_host

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("step", "memory", "first-step", "sampling")
MARKER = "FLAME_DIFFUSION_FIRSTSTEP "
NAMES = {"flame": "FLAME", "flame_checkpoint": "FLAME checkpoint=True",
         "torch_eager": "eager", "torch_compile": "torch.compile"}  # fmt: skip


def step_systems(case, backend: str, with_checkpoint: bool) -> dict:
    """``build() -> (call, clock)`` per system, all from PyTorch's initial weights."""
    reference = torch_model(case, backend)
    state = {k: v.detach().float().cpu().numpy() for k, v in reference.state_dict().items()}

    def flame_build(checkpoint: bool):
        def build():
            trainer = flame_trainer(case, state, checkpoint)
            images, labels = flame_batch(case[2], case[3])
            return (lambda: trainer.compiled(images, labels)), ca.flame_clock(backend)

        return ca.System(build, ca.flame_scope(backend))

    def torch_build(compiled: bool):
        def build():
            model = torch_model(case, backend)
            model.load_state_dict(reference.state_dict())
            step = TorchStep(model, backend, compiled)
            images, labels = torch_batch(case[2], case[3], backend)
            return (lambda: step(images, labels)), ca.torch_clock(ca.torch_device(backend))

        return build

    systems = {"flame": flame_build(False)}
    if with_checkpoint:
        systems["flame_checkpoint"] = flame_build(True)
    systems["torch_eager"] = ca.System(torch_build(False))
    systems["torch_compile"] = ca.System(torch_build(True), skip=ca.torch_compile_skip(backend))
    return systems


def measure_step(system, key, case, backend, timing, want_time, want_memory) -> dict:
    from bench import memory

    with system.scope():
        call, clock = system.build()
        clock.synchronize()
        start = time.perf_counter()
        loss = float(call()[0].item())
        result = {"first_step_ms": (time.perf_counter() - start) * 1e3, "first_loss": loss}
        if want_time:
            result.update(ca.device_ms(clock, call, timing))
            result["images_per_s"] = case[3] * 1e3 / result["ms"]
        if want_memory and key.startswith("torch") and backend != "cuda":
            result["memory"] = {"skipped": "reference backend: no PyTorch device allocator"}
        elif want_memory:
            import torch

            flame = key.startswith("flame")
            resident = None
            if backend == "cuda" and flame:
                import cupy

                resident = cupy.get_default_memory_pool().used_bytes() / memory.MB
            elif backend == "cuda":
                resident = torch.cuda.memory_allocated() / memory.MB
            call()
            probe = SimpleNamespace(key="flame" if flame else key, backend=backend, torch=torch,
                                    synchronize=clock.synchronize)  # fmt: skip
            result["memory"] = {"resident_mb": resident, **memory.measure(probe, call)}
        result["last_loss"] = float(call()[0].item())
        return result


def training_sections(backend: str, cases, timing, want_step: bool, want_memory: bool) -> dict:
    rows = []
    for case in cases:
        label, results = f"{case[0]} {case[1]} {case[2]}x{case[2]} b{case[3]}", {}
        for key, system in step_systems(case, backend, want_memory).items():
            if system.skip is not None:
                results[key] = {"status": "skipped", "reason": system.skip}
                continue
            quiet = wait_for_quiet_host(limit=20.0) if backend == "cuda" else None
            progress(f"{label}: {key}")
            timed = want_step or key == "flame_checkpoint"
            entry = guarded(measure_step, system, key, case, backend, timing, timed, want_memory)
            results[key] = {**entry, "quiet_host": quiet}
            ca.release_memory(backend)
        found = ca.ratios(
            {k: v for k, v in results.items() if k != "flame_checkpoint"}, backend, ""
        )
        rows.append({"label": label, "results": results, "ratios": found,
                     "targets": targets_met(TARGETS[case[0]], found)})  # fmt: skip
    report = {}
    if want_step:
        report["step"] = {"rows": rows}
    if want_memory:
        report["memory"] = {"rows": [memory_row(row, backend) for row in rows]}
    return report


def memory_row(row: dict, backend: str) -> dict:
    results = row["results"]
    peaks = {k: r.get("memory", {}).get("peak_mb") for k, r in results.items()}
    plain, saving = peaks.get("flame"), peaks.get("flame_checkpoint")
    times = [results.get(k, {}).get("ms") for k in ("flame", "flame_checkpoint")]
    return {"label": row["label"], "peak_mb": peaks,
            "memory": {k: r.get("memory") for k, r in results.items()},
            "checkpoint_saves_mb": None if None in (plain, saving) else plain - saving,
            "checkpoint_time_cost": ca.quotient(times[1], times[0], backend)}  # fmt: skip


def first_step_child(backend: str, system: str, new_resolution: bool) -> None:
    """Import, build, then time the first, second and (optionally) new resolution's first
    step; prints one line of JSON."""
    started = time.perf_counter()
    case, (size2, batch2) = FIRST_STEP[backend]
    if system == "flame":
        import flame as fl

        stamps = {"import_ms": (time.perf_counter() - started) * 1e3}
        if backend == "cuda":
            import cupy

            cupy.cuda.runtime.free(0)  # the CUDA context, before the clock starts
        scope = fl.backend(backend)  # held until the child ends
        scope.__enter__()
        step, sync = flame_trainer(case).compiled, fl.synchronize
        batches = [flame_batch(case[2], case[3]), flame_batch(size2, batch2)]
    else:
        import torch

        stamps = {"import_ms": (time.perf_counter() - started) * 1e3}
        torch.zeros(1, device=ca.torch_device(backend))
        step = TorchStep(torch_model(case, backend), backend, compiled=True)
        batches = [torch_batch(case[2], case[3], backend), torch_batch(size2, batch2, backend)]
        sync = torch.cuda.synchronize if backend == "cuda" else (lambda: None)
    sync()
    events = ca.EventTotals()
    plan = [("first_step_ms", 0), ("second_step_ms", 0)]
    for name, index in plan + ([("new_resolution_ms", 1)] if new_resolution else []):
        with ca.recording(events) if system == "flame" else contextlib.nullcontext():
            start = time.perf_counter()
            step(*batches[index])
            sync()
            stamps[name] = (time.perf_counter() - start) * 1e3
    print(MARKER + json.dumps({**stamps, "events": events.totals}), flush=True)


def run_child(environment, backend: str, system: str, new_resolution: bool) -> dict:
    command = [sys.executable, "-m", "bench.diffusion", "--first-step-child", system]
    command += ["--backend", backend] + (["--new-resolution"] if new_resolution else [])
    start = time.perf_counter()
    done = subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=900
    )
    for line in done.stdout.splitlines():
        if line.startswith(MARKER):
            wall_ms = (time.perf_counter() - start) * 1e3
            return {"process_wall_ms": wall_ms, **json.loads(line[len(MARKER) :])}
    raise RuntimeError(f"child exited {done.returncode}: {done.stderr[-2000:]}")


def first_step_section(backend: str) -> dict:
    case, new = FIRST_STEP[backend]
    result = {"case": f"{case[0]} {case[1]} {case[2]}x{case[2]} b{case[3]}",
              "new_resolution": f"{new[0]}x{new[0]} b{new[1]}"}  # fmt: skip
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    for variable in ("FLAME_CACHE_DIR", "CUPY_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        environment[variable] = tempfile.mkdtemp(prefix=f"diffusion-{variable.lower()}-")
    for system, child in (("flame", "flame"), ("torch_compile", "torch")):
        if ca.torch_compile_skip(backend) and system == "torch_compile":
            result[system] = {"skipped": ca.torch_compile_skip(backend)}
            continue
        result[system] = {}
        for run_name, new_resolution in (("cold", False), ("warm_disk", True)):
            quiet = wait_for_quiet_host(limit=20.0) if backend == "cuda" else None
            progress(f"first-step: {system} {run_name}")
            entry = guarded(run_child, environment, backend, child, new_resolution)
            result[system][run_name] = {**entry, "quiet_host": quiet}
    runs = result["flame"]
    measured = {"cold": runs["cold"].get("first_step_ms"),
                "warm_disk": runs["warm_disk"].get("first_step_ms"),
                "new_resolution": runs["warm_disk"].get("new_resolution_ms")}  # fmt: skip
    result["targets"] = {k: None if backend != "cuda" or measured[k] is None else measured[k] <= v
                         for k, v in TARGETS["first-step"].items()}  # fmt: skip
    return result


def fmt(value, form: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else format(value, form) + suffix


def table(header: list, rows: list) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def met(flags: dict) -> str:
    return ", ".join(f"{k} {'-' if v is None else 'yes' if v else 'NO'}" for k, v in flags.items())


def timed_rows(section: dict) -> list[str]:
    keys = ("flame", "torch_eager", "torch_compile")
    header = [*(NAMES[k] + " ms" for k in keys), "FLAME img/s", "eager / FLAME"]
    header = ["case", *header, "compile / FLAME", "targets met", "FLAME vs eager max rel diff"]
    rows = []
    for row in section["rows"]:
        results, found = row["results"], row["ratios"]
        times = [fmt(results[k].get("ms")) if results[k].get("status") == "ok"
                 else results[k].get("status") for k in keys]  # fmt: skip
        check = results["flame"].get("check", {}).get("worst")
        rows.append([row["label"], *times, fmt(results["flame"].get("images_per_s"), ".0f"),
                     *(fmt(found.get(k), ".2f", "x") for k in keys[1:]), met(row["targets"]),
                     fmt(check, ".1e")])  # fmt: skip
    return table(header, rows)


def first_step_rows(section: dict) -> list[str]:
    fields = ("import_ms", "first_step_ms", "second_step_ms", "new_resolution_ms")
    rows = []
    for system in ("flame", "torch_compile"):
        for run_name, entry in section[system].items():
            if run_name == "skipped":
                rows.append([NAMES[system], f"skipped: {entry}", *[""] * len(fields)])
                continue
            values = [fmt(entry.get(f), ".0f") for f in fields]
            rows.append([NAMES[system], run_name, *values, entry.get("error", "")])
    header = ["system", "run", *(f.removesuffix("_ms").replace("_", " ") + " ms" for f in fields)]
    return table(header + ["error"], rows) + ["", f"Targets met: {met(section['targets'])}"]


INTRO = {
    "step": "Device ms per training step (median). Targets: UNet >= 1.25x torch.compile and "
    ">= 1.7x eager; DiT >= 1.2x torch.compile. Losses differ (own random draws): no check.",
    "memory": "Peak MB of one step above the resident weights, optimizer state and EMA.",
    "first-step": "Wall ms in fresh processes. Targets: cold <= 10 s, warm disk <= 1 s, new "
    "resolution (in the warm process) <= 1 s.",
    "sampling": "Device ms for the whole DDIM chain. Target: >= 1.2x torch.compile. Untrained "
    "weights saturate many pixels at +-1, so the sample check is coarse.",
}


def markdown(report: dict) -> str:
    lines = [f"# Diffusion training and sampling, bfloat16 autocast ({report['device']})", ""]
    if report["backend"] == "cuda":
        lines += ["All numbers measured by this run; ratios peer ms / FLAME ms (above 1: FLAME "
                  "faster).", ""]  # fmt: skip
    else:
        lines += ["Reference backend: a CPU smoke run, tiny models. Numbers are measured but say "
                  "nothing about GPU speed; torch.compile, ratios and targets skipped. Memory: "
                  "FLAME's is host memory (tracemalloc); PyTorch's skipped.", ""]  # fmt: skip
    for name in SECTIONS:
        section = report.get(name)
        lines += [f"## {name}", ""]
        if section is None or section.get("status") == "error":
            lines += [f"error: {section['error']}" if section else "skipped: not in --only", ""]
            continue
        lines += [INTRO[name], ""]
        if name == "memory":
            keys = ("flame", "flame_checkpoint", "torch_eager", "torch_compile")
            header = ["case", *(NAMES[k] + " MB" for k in keys), "checkpoint saves MB"]
            rows = [[row["label"], *(fmt(row["peak_mb"].get(k), ".0f") for k in keys),
                     fmt(row["checkpoint_saves_mb"], ".0f"), fmt(row["checkpoint_time_cost"],
                     ".2f", "x")] for row in section["rows"]]  # fmt: skip
            lines += table(header + ["checkpoint step time / plain"], rows)
        elif name == "first-step":
            lines += [f"{section['case']}; new resolution {section['new_resolution']}.", ""]
            lines += first_step_rows(section)
        else:
            lines += timed_rows(section)
        for row in section.get("rows", []):
            for key, entry in row.get("results", {}).items():
                if entry.get("status") == "error":
                    lines.append(f"\n- {row['label']} {key}: {entry['error']}")
        lines.append("")
    return "\n".join(lines)


def run(backend: str, quick: bool, only=None) -> dict:
    scale = "tiny" if backend != "cuda" else "quick" if quick else "full"
    timing = ca.Timing(*{"tiny": (1, 1, 2), "quick": (2, 4, 3), "full": (3, 10, 7)}[scale])
    sampling_timing = ca.Timing(1, 1, 2 if scale == "tiny" else 3 if quick else 5)
    report = {**ca.environment_info(backend), "quick": quick, "timing": timing.__dict__,
              "sampling_timing": sampling_timing.__dict__}  # fmt: skip
    wanted = only or SECTIONS
    if "step" in wanted or "memory" in wanted:
        cases = STEP_CASES[scale]
        outcome = guarded(training_sections, backend, cases, timing, "step" in wanted,
                          "memory" in wanted)  # fmt: skip
        report.update({k: outcome.get(k, outcome) for k in ("step", "memory") if k in wanted})
    if "first-step" in wanted:
        report["first-step"] = guarded(first_step_section, backend)
    if "sampling" in wanted:
        cases = SAMPLING_CASES[scale]
        report["sampling"] = guarded(sampling_section, backend, cases, sampling_timing)
    return report


def main(argv=None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--out", type=Path, default=Path("out/diffusion"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", action="append", choices=SECTIONS)
    parser.add_argument("--backend", choices=("cuda", "reference"), default="cuda")
    parser.add_argument("--first-step-child", choices=("flame", "torch"), help=argparse.SUPPRESS)
    parser.add_argument("--new-resolution", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.first_step_child:
        first_step_child(arguments.backend, arguments.first_step_child, arguments.new_resolution)
        return 0
    report = run(arguments.backend, arguments.quick, arguments.only)
    arguments.out.mkdir(parents=True, exist_ok=True)
    (arguments.out / "diffusion.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (arguments.out / "diffusion.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
