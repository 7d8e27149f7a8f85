"""Long-row softmax and cross-entropy, forward + backward, on the GPU (issue 21 item 3).

    PYTHONPATH=. python3 notes/probes/long_rows_bench.py [--quick] [--op softmax] [--dtype bfloat16]
    FLAME_PLAN_CACHE=0 PYTHONPATH=. python3 notes/probes/long_rows_bench.py --flame-only --two-pass
    FLAME_PLAN_CACHE=0 PYTHONPATH=. python3 notes/probes/long_rows_bench.py --flame-only --wide-half

For softmax(x, -1) (backward with a random gy) and cross_entropy(x, target) (mean), rows
8192x32768, 4096x65536, 2048x131072, 1024x262144, float32 and bfloat16: FLAME (fl.compile),
PyTorch eager and torch.compile, built by ``bench.diffusion_kernels.row_systems`` (the rows
bench's systems and inputs) and timed by ``bench.conv_attention.device_ms`` (CUDA events
around calls queued behind a spin kernel: median of 20 samples after warm-up). Each system's
output and gradient are compared on the device with PyTorch float64 on the same inputs (max
|a - ref| / max |ref|). One JSON line per case on stdout (progress on stderr): ms per system,
ratios, % of each byte floor (floor bytes / time / measured copy bandwidth), errors.

Floors (E elements of s bytes): softmax fwd+bwd 5*E*s (read x, write y, read y, read gy,
write dx); cross-entropy fwd+bwd 3*E*s + 8*rows (read logits twice, write dlogits; targets)
and 2*E*s + 8*rows (a one-read online formulation). About 3 minutes (torch.compile's
compile, ~6 s a case, is most of it); ``--quick`` takes 2 shapes.

A/B switches of the row-kernel code (each line says which were set; run them in their own
process with ``FLAME_PLAN_CACHE=0``, so that no stored plan of the other code is loaded):
``--two-pass`` turns the online max + sum off (``reduce_online.ENABLED``), ``--wide-half``
loads 2-byte rows in 16-byte vectors (``reduce.WIDE_HALF_VECTORS``), ``--shared-rows``
turns the shared-memory row cache on (``reduce_shared.ENABLED``: only once
flame/runtime/launch.py passes ``Lowered.shared_bytes``), ``--flame-only`` skips the peers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.conv_attention import Timing, device_ms, release_memory
from bench.diffusion_kernels import row_systems
from bench.timing import copy_bandwidth

SHAPES = ((8192, 32768), (4096, 65536), (2048, 131072), (1024, 262144))
QUICK = ((8192, 32768), (1024, 262144))
TIMING = Timing(warmup=3, calls=5, repeats=20)
SYSTEMS = ("flame", "torch_eager", "torch_compile")


def log(message: str) -> None:
    print(f"[long_rows] {message}", file=sys.stderr, flush=True)


def float64_reference(op: str, rows: int, length: int, dtype: str):
    """PyTorch float64 on the inputs ``row_systems`` makes (same seed, same draw order)."""
    import torch

    torch.manual_seed(0)
    kind = getattr(torch, dtype)
    x = torch.randn(rows, length, device="cuda", dtype=kind)
    if op == "softmax":
        gy = torch.randn(rows, length, device="cuda", dtype=kind)
        x64 = x.double().requires_grad_()
        y = torch.softmax(x64, -1)
        y.backward(gy.double())
    else:
        target = torch.randint(0, length, (rows,), device="cuda")
        x64 = x.double().requires_grad_()
        y = torch.nn.functional.cross_entropy(x64, target)
        y.backward()
    return [y.detach(), x64.grad]


def as_torch(tensor):
    import torch

    if isinstance(tensor, torch.Tensor):
        return tensor.detach()
    return torch.from_dlpack(tensor)  # a FLAME tensor: shared memory, no copy


def max_rel(value, reference) -> float:
    scale = reference.abs().max().item() or 1e-30
    return (value.double() - reference).abs().max().item() / scale


def floors(op: str, rows: int, length: int, size: int) -> dict:
    elements = rows * length
    if op == "softmax":
        return {"5 passes": 5 * elements * size}
    return {"3 passes": 3 * elements * size + 8 * rows, "2 passes": 2 * elements * size + 8 * rows}


def run_case(op: str, rows: int, length: int, dtype: str, bandwidth: float, systems_run) -> dict:
    reference = float64_reference(op, rows, length, dtype)
    systems = row_systems(op, rows, length, dtype, "cuda")
    size = 4 if dtype == "float32" else 2
    case = {"op": op, "rows": rows, "length": length, "dtype": dtype, "mode": "fwd+bwd"}
    case["floor_bytes"] = floors(op, rows, length, size)
    results = {}
    for key in systems_run:
        system = systems[key]
        if system.skip is not None:
            results[key] = {"status": "skipped", "reason": system.skip}
            continue
        log(f"{op} {rows}x{length} {dtype}: {key}")
        try:
            with system.scope():
                call, clock = system.build()
                start = time.perf_counter()
                produced = call()
                clock.synchronize()
                first_ms = (time.perf_counter() - start) * 1e3
                errors = [max_rel(as_torch(t), r) for t, r in zip(produced, reference)]
                del produced
                timed = device_ms(clock, call, TIMING)
            entry = {"status": "ok", "first_call_ms": round(first_ms, 1), "ms": timed["ms"],
                     "min_ms": timed["min_ms"], "max_rel_err": {"out": errors[0], "grad": errors[1]}}  # fmt: skip  # noqa: E501
            entry["pct_of_floor"] = {
                name: 100.0 * nbytes / (timed["ms"] * 1e-3) / bandwidth
                for name, nbytes in case["floor_bytes"].items()
            }
            results[key] = entry
        except Exception as error:  # one failing system must not lose the others' figures
            results[key] = {"status": "error", "error": f"{type(error).__name__}: {error}"}
        release_memory("cuda")
    flame_ms = results.get("flame", {}).get("ms")
    for peer in ("torch_eager", "torch_compile"):
        peer_ms = results.get(peer, {}).get("ms")
        if flame_ms and peer_ms:
            case[f"{peer}_over_flame"] = peer_ms / flame_ms  # above 1: FLAME is faster
    case["results"] = results
    del systems, reference
    release_memory("cuda")
    return case


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 shapes instead of 4")
    parser.add_argument("--op", choices=("softmax", "cross_entropy"), action="append")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), action="append")
    parser.add_argument("--flame-only", action="store_true", help="skip eager, torch.compile")
    parser.add_argument("--two-pass", action="store_true", help="online max + sum off")
    parser.add_argument("--wide-half", action="store_true", help="16-byte vectors of 2-byte rows")
    parser.add_argument("--shared-rows", action="store_true", help="shared-memory row cache on")
    args = parser.parse_args(argv)
    from flame.codegen import reduce, reduce_online, reduce_shared

    reduce_online.ENABLED = not args.two_pass
    reduce.WIDE_HALF_VECTORS = args.wide_half
    reduce_shared.ENABLED = args.shared_rows
    switches = {"online": not args.two_pass, "wide_half": args.wide_half,
                "shared_rows": args.shared_rows}  # fmt: skip
    systems_run = ("flame",) if args.flame_only else SYSTEMS
    copy = copy_bandwidth(True, False, 20)
    bandwidth = copy["gb_per_s"] * 1e9
    print(json.dumps({"copy_bandwidth_gb_per_s": copy["gb_per_s"], "timing": vars(TIMING)}))
    started = time.perf_counter()
    for op in args.op or ("softmax", "cross_entropy"):
        for rows, length in QUICK if args.quick else SHAPES:
            for dtype in args.dtype or ("bfloat16", "float32"):
                case = run_case(op, rows, length, dtype, bandwidth, systems_run)
                print(json.dumps({**case, "switches": switches}), flush=True)
    log(f"done in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
