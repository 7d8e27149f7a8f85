"""FLAME's fused attention kernels vs torch.nn.functional.scaled_dot_product_attention on the
GPU: forward, and forward + backward, bfloat16, head dims 64 and 128, L = 256 .. 16384, causal
and not, B * H * L = 2^16 rows. CUDA events around each call, warm-up first, the median of
REPEATS. Checks the largest difference from torch once per configuration.

    python3 notes/probes/flash_attention_bench.py OUT.json

Prints a table (milliseconds, TFLOP/s, FLAME's speed as a fraction of torch's) and writes every
row to OUT.json.
"""

from __future__ import annotations

import json
import statistics
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's flame

import cupy  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flame.runtime import flash_attention as fa  # noqa: E402

ROWS = 2**16  # B * H * L
WARMUP = 5
REPEATS = 25


def to_cupy(tensor):
    return cupy.from_dlpack(tensor.detach().contiguous().view(torch.int16)).view(cupy.uint16)


def to_torch(array):
    return torch.from_dlpack(array.view(cupy.int16)).view(torch.bfloat16)


def median_ms(function) -> float:
    for _ in range(WARMUP):
        function()
    times = []
    for _ in range(REPEATS):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_config(head_dim: int, length: int, causal: bool) -> dict:
    heads_total = max(1, ROWS // length)
    heads = min(16, heads_total)
    batch = heads_total // heads
    shape = (batch, heads, length, head_dim)
    scale = head_dim**-0.5
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)
        for _ in range(4)
    )
    qc, kc, vc, doc = (to_cupy(t) for t in (q, k, v, do))
    row = {"head_dim": head_dim, "L": length, "causal": causal, "B": batch, "H": heads}

    def flame_forward():
        return fa.forward(qc, kc, vc, scale=scale, causal=causal, dtype="bfloat16")

    def flame_both():
        o, lse = flame_forward()
        return o, lse, fa.backward(qc, kc, vc, o, doc, lse, scale=scale, causal=causal,
                                   dtype="bfloat16")  # fmt: skip

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def torch_forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def torch_both():
        o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, scale=scale)
        o.backward(do)
        return o

    # correctness once: largest absolute difference from torch
    o, _, (dq, dk, dv) = flame_both()
    qg.grad = kg.grad = vg.grad = None
    reference = torch_both()
    errors = {}
    for name, mine, theirs in (("o", o, reference), ("dq", dq, qg.grad), ("dk", dk, kg.grad),
                               ("dv", dv, vg.grad)):  # fmt: skip
        difference = (to_torch(mine).float() - theirs.float()).abs().max().item()
        errors[name] = difference / max(theirs.float().abs().max().item(), 1e-6)
    row["max_rel_error"] = errors

    flops = 4 * batch * heads * length * length * head_dim * (0.5 if causal else 1.0)
    timings = {
        "flame_fwd_ms": median_ms(flame_forward),
        "torch_fwd_ms": median_ms(torch_forward),
        "flame_fwdbwd_ms": median_ms(flame_both),
        "torch_fwdbwd_ms": median_ms(torch_both),
    }
    row.update(timings)
    row["flame_fwd_tflops"] = flops / timings["flame_fwd_ms"] / 1e9
    row["torch_fwd_tflops"] = flops / timings["torch_fwd_ms"] / 1e9
    row["flame_fwdbwd_tflops"] = 3.5 * flops / timings["flame_fwdbwd_ms"] / 1e9
    row["torch_fwdbwd_tflops"] = 3.5 * flops / timings["torch_fwdbwd_ms"] / 1e9
    row["fwd_ratio"] = timings["torch_fwd_ms"] / timings["flame_fwd_ms"]
    row["fwdbwd_ratio"] = timings["torch_fwdbwd_ms"] / timings["flame_fwdbwd_ms"]
    return row


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else "flash_attention_bench.json"
    rows = []
    header = f"{'D':>4} {'L':>6} {'causal':>6} {'BxH':>7}  {'fwd ms':>15} {'TF/s':>11} "
    header += f"{'ratio':>5}  {'fwd+bwd ms':>15} {'TF/s':>11} {'ratio':>5}  max rel err"
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("ms and TF/s: FLAME/torch; ratio: torch time / FLAME time (>= 0.5 is the goal)")
    print(header)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        for head_dim in (64, 128):
            for length in (256, 1024, 4096, 16384):
                for causal in (False, True):
                    try:
                        row = run_config(head_dim, length, causal)
                    except Exception as error:  # report and go on with the next configuration
                        traceback.print_exc()
                        rows.append({"head_dim": head_dim, "L": length, "causal": causal,
                                     "error": f"{type(error).__name__}: {error}"})  # fmt: skip
                        continue
                    rows.append(row)
                    errors = " ".join(f"{k}={v:.1e}" for k, v in row["max_rel_error"].items())
                    print(
                        f"{head_dim:>4} {length:>6} {causal!s:>6} {row['B'] * row['H']:>7}  "
                        f"{row['flame_fwd_ms']:>7.3f}/{row['torch_fwd_ms']:<7.3f} "
                        f"{row['flame_fwd_tflops']:>5.0f}/{row['torch_fwd_tflops']:<5.0f} "
                        f"{row['fwd_ratio']:>5.2f}  "
                        f"{row['flame_fwdbwd_ms']:>7.3f}/{row['torch_fwdbwd_ms']:<7.3f} "
                        f"{row['flame_fwdbwd_tflops']:>5.0f}/{row['torch_fwdbwd_tflops']:<5.0f} "
                        f"{row['fwdbwd_ratio']:>5.2f}  {errors}",
                        flush=True,
                    )
    with open(out_path, "w") as file:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, file, indent=1)
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
