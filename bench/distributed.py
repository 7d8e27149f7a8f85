"""Data-parallel figures (issue 23): all-reduce bus bandwidth against NCCL's own, the diffusion
UNet step's images/s on N GPUs against one, and the loss curve of N ranks against one
process at the same global batch.

    python -m bench.distributed [--nproc 2] [--out DIR] [--only allreduce,step,curve]
    python -m bench.distributed --reference --nproc 2     # the same runs on the CPU (gloo)

Every measurement runs in fresh processes of bench/distributed_worker.py: alone (one GPU,
no process group) for the single-GPU figures, under ``flame run --nproc-per-node N`` for the
data-parallel ones. Reported (``distributed.json``, ``distributed.md``):

* per size: the time of one all-reduce (float32, AVG) and its bus bandwidth, ``bytes / time
  * 2 (N - 1) / N`` (nccl-tests' measure), for NCCL called from CuPy on the same
  communicator and stream, FLAME's collective as a value (what DistributedDataParallel runs)
  and ``dist.all_reduce`` in place (plus a copy into the tensor). Target: FLAME's collective
  within 10 % of NCCL's bandwidth.
* the step: images/s of one process at ``--batch`` against N ranks at ``--batch`` each
  (twice the global batch for N = 2). Target: at least 0.925 N times (1.85x on 2 GPUs).
* the curve: the mean of the ranks' losses per step against the single process's, both
  fed the same global batches (bench/diffusion_parity_report.py's ``agreement``: smoothed
  gap against the curves' noise, and the paired per-step differences), and the gradient
  norms (of the averaged gradients) against the single process's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from bench.diffusion_parity_report import agreement

ROOT = Path(__file__).resolve().parent.parent
ALLREDUCE_TARGET = 0.9  # FLAME's bus bandwidth / NCCL's, at least
SCALING_TARGET = 0.925  # images/s on N GPUs / (N x one GPU's), at least (1.85x for N = 2)
GPU = {"sizes": "1,4,16,64,256,1024", "model": "unet", "size": "full", "image": 32,
       "batch": 64, "steps": 50, "global_batch": 128, "curve_steps": 200, "lr": 2e-4}  # fmt: skip
REFERENCE = {"sizes": "0.01,0.1", "model": "unet", "size": "tiny", "image": 8, "batch": 2,
             "steps": 2, "global_batch": 4, "curve_steps": 4, "lr": 2e-3}  # fmt: skip


def progress(message: str) -> None:
    print(f"[distributed] {message}", file=sys.stderr, flush=True)


TIMEOUT_S = 900  # one worker run, at most


def run_worker(part: str, nproc: int | None, out: Path, settings: dict, reference: bool,
           extra: list[str], timeout: float = TIMEOUT_S) -> None:  # fmt: skip
    """Run one part, alone (``nproc`` None) or under ``flame run``; raise with its output."""
    command = [sys.executable, "-u"]
    if nproc is not None:
        command += ["-m", "flame.distributed.launch", "--nproc-per-node", str(nproc)]
    command += ["-m", "bench.distributed_worker", part, "--out", str(out),
                "--model", settings["model"], "--size", settings["size"],
                "--image", str(settings["image"]), "--lr", str(settings["lr"])]  # fmt: skip
    command += (["--reference"] if reference else []) + extra
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.getenv("PYTHONPATH")]))
    environment.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
    progress(" ".join(command[2:]))
    done = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
        raise RuntimeError(f"{part} ({nproc or 1} process) failed ({done.returncode}):\n{tail}")


def read(out: Path, part: str, world: int) -> list[dict]:
    return [json.loads((out / f"{part}-world{world}-rank{rank}.json").read_text())
            for rank in range(world)]  # fmt: skip


# --- the three comparisons --------------------------------------------------------------------


def bus_bandwidth(nbytes: int, ms: float | None, world: int) -> float | None:
    """GB/s on the wire per GPU for a ring all-reduce (nccl-tests' busbw)."""
    if not ms:
        return None
    return nbytes / (ms * 1e-3) * 2 * (world - 1) / world / 1e9 if world > 1 else None


def allreduce_rows(ranks: list[dict], world: int) -> list[dict]:
    rows = []
    for index, row in enumerate(ranks[0]["rows"]):
        # a collective ends when the slowest rank's ends: the largest time of the ranks
        times = {key: max(rank["rows"][index][key] for rank in ranks)
                 for key in row if key.endswith("_ms")}  # fmt: skip
        entry = {"bytes": row["bytes"], "dtype": row["dtype"], **times}
        for key, ms in times.items():
            entry[key.replace("_ms", "_busbw_gbs")] = bus_bandwidth(row["bytes"], ms, world)
        if entry.get("nccl_busbw_gbs") and entry.get("flame_busbw_gbs"):
            entry["flame_over_nccl"] = entry["flame_busbw_gbs"] / entry["nccl_busbw_gbs"]
            entry["target_met"] = entry["flame_over_nccl"] >= ALLREDUCE_TARGET
        rows.append(entry)
    return rows


def scaling(one: dict, many: list[dict], world: int) -> dict:
    slowest = max(rank["ms_per_step"] for rank in many)
    images = world * many[0]["batch_per_rank"] / (slowest / 1e3)
    speedup = images / one["images_per_s"]
    return {"one_gpu": {"ms_per_step": one["ms_per_step"], "images_per_s": one["images_per_s"],
                        "batch": one["batch_per_rank"]},
            "world": {"ranks": world, "ms_per_step": slowest, "images_per_s": images,
                      "global_batch": world * many[0]["batch_per_rank"]},
            "speedup": speedup, "target": SCALING_TARGET * world,
            "target_met": speedup >= SCALING_TARGET * world}  # fmt: skip


def curves(one: dict, many: list[dict]) -> dict:
    mean = np.mean([rank["losses"] for rank in many], axis=0)
    single = np.asarray(one["losses"])
    norms = np.asarray(many[0]["grad_norms"]), np.asarray(one["grad_norms"])
    ranks_norms_agree = all(rank["grad_norms"] == many[0]["grad_norms"] for rank in many)
    return {"steps": len(single), "global_batch": one["global_batch"],
            "agreement": agreement(mean.tolist(), single.tolist()),
            "grad_norm_rel_diff_max": float(np.max(np.abs(norms[0] - norms[1]) / norms[1])),
            "grad_norm_rel_diff_median": float(np.median(np.abs(norms[0] - norms[1]) / norms[1])),
            "ranks_see_one_grad_norm": ranks_norms_agree,
            "final_loss": {"ranks_mean": float(mean[-10:].mean()),
                           "one_process": float(single[-10:].mean())},
            "losses": {"ranks_mean": mean.tolist(), "one_process": single.tolist()}}  # fmt: skip


# --- report -----------------------------------------------------------------------------------


def fmt(value, form: str = ".1f") -> str:
    return "-" if value is None else format(value, form)


def markdown(report: dict) -> str:
    world = report["nproc"]
    lines = [f"# Data-parallel figures ({report['device']}, {world} ranks)", ""]
    if "allreduce" in report:
        lines += [f"## All-reduce (float32, avg; bus bandwidth GB/s, {world} ranks)", "",
                  "| size | NCCL ms | FLAME ms | in place ms | NCCL busbw | FLAME busbw | "
                  "in place busbw | FLAME / NCCL | target 0.9 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for row in report["allreduce"]:
            lines.append(
                f"| {row['bytes'] / (1 << 20):g} MiB | {fmt(row.get('nccl_ms'), '.3f')} | "
                f"{fmt(row.get('flame_ms'), '.3f')} | {fmt(row.get('flame_in_place_ms'), '.3f')} "
                f"| {fmt(row.get('nccl_busbw_gbs'))} | {fmt(row.get('flame_busbw_gbs'))} | "
                f"{fmt(row.get('flame_in_place_busbw_gbs'))} | "
                f"{fmt(row.get('flame_over_nccl'), '.3f')} | {row.get('target_met', '-')} |"
            )
        lines.append("")
    if "step" in report:
        step = report["step"]
        lines += ["## Training step (the example's Trainer, bf16, AdamW, EMA)", "",
                  "| run | global batch | ms/step | images/s |", "| --- | --- | --- | --- |",
                  f"| 1 GPU | {step['one_gpu']['batch']} | {step['one_gpu']['ms_per_step']:.2f} "
                  f"| {step['one_gpu']['images_per_s']:.0f} |",
                  f"| {world} GPUs | {step['world']['global_batch']} | "
                  f"{step['world']['ms_per_step']:.2f} | {step['world']['images_per_s']:.0f} |",
                  "", f"Speedup {step['speedup']:.3f}x (target {step['target']:.2f}x: "
                  f"{'met' if step['target_met'] else 'NOT met'}).", ""]  # fmt: skip
    if "curve" in report:
        curve, agree = report["curve"], report["curve"]["agreement"]
        lines += ["## Loss curve at the same global batch", "",
                  f"{curve['steps']} steps, global batch {curve['global_batch']}: smoothed gap "
                  f"{agree['gap']:.5f} against noise {min(agree['noise'].values()):.5f} "
                  f"(within noise: {agree['within_noise']}); paired per-step difference "
                  f"{agree['paired_mean']:.2e} +- {agree['paired_std']:.2e}; per-step relative "
                  f"difference median {agree['per_step_rel_diff_median']:.2e}, max "
                  f"{agree['per_step_rel_diff_max']:.2e}. Gradient norms (averaged gradients "
                  f"vs one process): median relative difference "
                  f"{curve['grad_norm_rel_diff_median']:.2e}, max "
                  f"{curve['grad_norm_rel_diff_max']:.2e}; every rank sees the same norm: "
                  f"{curve['ranks_see_one_grad_norm']}.", ""]  # fmt: skip
    return "\n".join(lines)


def device_name(reference: bool) -> str:
    if reference:
        return "CPU (reference backend, gloo)"
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        return f"{count}x {name}"
    except Exception as error:  # noqa: BLE001
        return f"unknown GPU ({type(error).__name__})"


def run(nproc: int, out: Path, only: set, reference: bool, timeout: float = TIMEOUT_S) -> dict:
    settings = REFERENCE if reference else GPU

    def worker(*arguments):
        run_worker(*arguments, timeout=timeout)

    parts = out / "parts"
    report = {"nproc": nproc, "device": device_name(reference), "settings": settings}
    if "allreduce" in only:
        worker("allreduce", nproc, parts, settings, reference,
               ["--sizes-mib", settings["sizes"]])  # fmt: skip
        report["allreduce"] = allreduce_rows(read(parts, "allreduce", nproc), nproc)
    if "step" in only:
        extra = ["--batch", str(settings["batch"]), "--steps", str(settings["steps"])]
        worker("step", None, parts, settings, reference, extra)
        worker("step", nproc, parts, settings, reference, extra)
        report["step"] = scaling(read(parts, "step", 1)[0], read(parts, "step", nproc), nproc)
    if "curve" in only:
        extra = ["--global-batch", str(settings["global_batch"]),
                 "--steps", str(settings["curve_steps"])]  # fmt: skip
        worker("curve", None, parts, settings, reference, extra)
        worker("curve", nproc, parts, settings, reference, extra)
        report["curve"] = curves(read(parts, "curve", 1)[0], read(parts, "curve", nproc))
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (one GPU each)")
    parser.add_argument("--out", type=Path, default=Path("bench-distributed"))
    parser.add_argument("--only", default="allreduce,step,curve")
    parser.add_argument("--reference", action="store_true", help="CPU: reference backend, gloo")
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="s per worker run")
    options = parser.parse_args(argv)
    only = set(options.only.split(","))
    report = run(options.nproc, options.out, only, options.reference, options.timeout)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "distributed.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (options.out / "distributed.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
