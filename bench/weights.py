"""Loading a checkpoint to the GPU: ``flame.load_file`` against ``safetensors.torch.load_file``.

    python -m bench.weights --out DIR [--size-mb 1024] [--repeats 5] [--backend cuda|reference]

Writes a safetensors file of about ``--size-mb`` MB shaped like a transformer's weights (~300
tensors: bfloat16 matrices, float32 norms and biases), reads it once so the page cache is warm,
runs every loader once more to warm it (and the allocators) again, then times each loader,
in turns, ``--repeats`` times: wall time from the call to the last byte on the GPU (the
device synchronised). Reported: the median, GB/s, and the ratio to the peer, beside the
floor of a host-to-device copy from page-locked memory. FLAME loads twice: reading with
``pread`` (its default) and copying from a memory mapping
(``flame.runtime.file_uploads.HOST_READ = "mmap"``).
``--backend reference`` is a CPU smoke mode (the peer is ``safetensors.numpy.load_file``).
Writes ``weights.json`` and ``weights.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

LAYERS = 24
PER_LAYER = [  # (name, shape in units of the width d, dtype)
    ("attn.q.weight", (1, 1), "bf16"), ("attn.k.weight", (1, 1), "bf16"),
    ("attn.v.weight", (1, 1), "bf16"), ("attn.o.weight", (1, 1), "bf16"),
    ("attn.o.bias", (1,), "f32"), ("mlp.up.weight", (4, 1), "bf16"),
    ("mlp.up.bias", (4,), "f32"), ("mlp.down.weight", (1, 4), "bf16"),
    ("mlp.down.bias", (1,), "f32"), ("norm1.weight", (1,), "f32"), ("norm1.bias", (1,), "f32"),
    ("norm2.weight", (1,), "f32"),
]  # fmt: skip
VOCAB_PER_WIDTH = 25  # embedding rows per unit of width (d = 1304: a 32 k vocabulary)


def model_shapes(size_mb: float) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names -> (shape, dtype) of a transformer of about ``size_mb`` MB (1e6 bytes)."""
    bytes_per_d2 = LAYERS * 2 * 12 + 2 * VOCAB_PER_WIDTH * 2  # bf16 matrices dominate
    width = max(8, int(math.sqrt(size_mb * 1e6 / bytes_per_d2)) // 8 * 8)
    shapes = {"embed.weight": ((VOCAB_PER_WIDTH * width, width), "bf16")}
    for layer in range(LAYERS):
        for name, units, dtype in PER_LAYER:
            shapes[f"layers.{layer}.{name}"] = (tuple(u * width for u in units), dtype)
    shapes["norm.weight"] = ((width,), "f32")
    shapes["head.weight"] = ((VOCAB_PER_WIDTH * width, width), "bf16")
    return shapes


def write_checkpoint(path: Path, size_mb: float) -> dict:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for name, (shape, dtype) in model_shapes(size_mb).items():
        values = rng.standard_normal(shape, dtype=np.float32) * 0.02
        tensors[name] = values.astype(ml_dtypes.bfloat16) if dtype == "bf16" else values
    save_file(tensors, str(path), metadata={"format": "pt"})
    total = sum(array.nbytes for array in tensors.values())
    return {"tensors": len(tensors), "bytes": total, "file_bytes": path.stat().st_size}


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as file:
        while file.read(64 << 20):
            pass


def loaders(backend: str, path: Path) -> dict:
    """name -> a function that loads the file and waits for the last byte."""
    import flame as fl
    from flame.runtime import file_uploads

    def flame_load(host_read):
        def load():
            file_uploads.HOST_READ = host_read
            try:
                tensors = fl.load_file(path, device="cuda" if backend == "cuda" else "cpu")
                if backend == "cuda":
                    fl.synchronize()
            finally:
                file_uploads.HOST_READ = "pread"
            return tensors

        return load

    chosen = {"flame": flame_load("pread")}
    if backend == "cuda":  # the reference path always reads with pread
        chosen["flame_mmap"] = flame_load("mmap")
    if backend == "cuda":
        import torch
        from safetensors.torch import load_file as torch_load

        def peer():
            tensors = torch_load(path, device="cuda:0")
            torch.cuda.synchronize()
            return tensors

        chosen["safetensors_torch"] = peer
    else:
        from safetensors.numpy import load_file as numpy_load

        chosen["safetensors_numpy"] = lambda: numpy_load(path)
    return chosen


def host_bits(value) -> np.ndarray:
    """A loaded tensor's bytes on the host, whoever loaded it."""
    if hasattr(value, "node"):  # flame
        array = np.asarray(value.numpy())
    elif hasattr(value, "detach"):  # torch
        import torch

        tensor = value.detach()
        tensor = tensor.view(torch.int16) if tensor.dtype is torch.bfloat16 else tensor
        array = tensor.cpu().numpy()
    else:
        array = np.asarray(value)
    return np.ascontiguousarray(array).view(np.uint8)


def check_same(results: dict) -> list[str]:
    """Names of the tensors on which the loaders disagree (bit for bit)."""
    first, *others = results.values()
    return sorted(
        name
        for other in others
        for name in first
        if not np.array_equal(host_bits(first[name]), host_bits(other[name]))
    )


def h2d_floor(nbytes: int) -> float | None:
    """GB/s of one host-to-device copy from page-locked memory (the transfer's floor)."""
    import cupy

    size = min(nbytes, 512 << 20)
    pinned = cupy.cuda.alloc_pinned_memory(size)
    host = np.frombuffer(pinned, dtype=np.uint8, count=size)
    device = cupy.empty(size, dtype=np.uint8)
    samples = []
    for _ in range(5):
        start = time.perf_counter()
        device.set(host)
        cupy.cuda.Device().synchronize()
        samples.append(time.perf_counter() - start)
    return size / statistics.median(samples) / 1e9


def measure(backend: str, path: Path, repeats: int) -> dict:
    chosen = loaders(backend, path)
    warm_page_cache(path)
    mismatched = check_same({name: load() for name, load in chosen.items()})  # also warms up
    samples: dict[str, list[float]] = {name: [] for name in chosen}
    for _ in range(repeats):
        for name, load in chosen.items():  # in turns: drift hits every loader alike
            start = time.perf_counter()
            tensors = load()
            samples[name].append((time.perf_counter() - start) * 1e3)
            del tensors
    return {
        "ms": {name: statistics.median(values) for name, values in samples.items()},
        "samples_ms": samples,
        "mismatched_tensors": mismatched,
    }


def markdown(report: dict) -> str:
    checkpoint, timings = report["checkpoint"], report["timings"]
    gigabytes = checkpoint["bytes"] / 1e9
    lines = [
        f"# Loading weights to {report['device']}",
        "",
        f"{checkpoint['tensors']} tensors, {gigabytes:.3f} GB (bfloat16 and float32), page "
        f"cache warm; median of {report['repeats']} loads, wall time to the last byte.",
        "",
        "| loader | ms | GB/s | vs peer |",
        "| --- | --- | --- | --- |",
    ]
    peer = timings["ms"][report["peer"]]
    for name, ms in timings["ms"].items():
        lines.append(f"| {name} | {ms:.1f} | {gigabytes / (ms / 1e3):.2f} | {peer / ms:.2f}x |")
    lines.append("")
    if report.get("h2d_floor_gb_s"):
        floor_ms = gigabytes / report["h2d_floor_gb_s"] * 1e3
        lines.append(
            f"Floor: a page-locked host-to-device copy moves {report['h2d_floor_gb_s']:.1f} "
            f"GB/s ({floor_ms:.1f} ms for this file)."
        )
    flame_ms = timings["ms"]["flame"]
    lines.append(
        f"flame.load_file {flame_ms:.1f} ms vs {report['peer']} {peer:.1f} ms: FLAME "
        f"{peer / flame_ms:.2f}x the peer's speed. Loaders disagree on: "
        f"{', '.join(timings['mismatched_tensors']) or 'no tensor'}."
    )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.weights", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("out/weights"))
    parser.add_argument("--size-mb", type=float, default=1024.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backend", choices=("cuda", "reference"), default="cuda")
    parser.add_argument("--scratch", type=Path, help="where the checkpoint goes (default: tmp)")
    arguments = parser.parse_args(argv)
    arguments.out.mkdir(parents=True, exist_ok=True)
    scratch = arguments.scratch or Path(tempfile.mkdtemp(prefix="flame-weights-"))
    path = scratch / "checkpoint.safetensors"
    checkpoint = write_checkpoint(path, arguments.size_mb)
    report = {"device": "CPU (reference backend)", "backend": arguments.backend,
              "repeats": arguments.repeats, "checkpoint": checkpoint}  # fmt: skip
    if arguments.backend == "cuda":
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
        report["device"] = name.decode() if isinstance(name, bytes) else name
        report["h2d_floor_gb_s"] = h2d_floor(checkpoint["bytes"])
        report["peer"] = "safetensors_torch"
    else:
        report["peer"] = "safetensors_numpy"
    try:
        report["timings"] = measure(arguments.backend, path, arguments.repeats)
    finally:
        if arguments.scratch is None:
            path.unlink(missing_ok=True)
    (arguments.out / "weights.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (arguments.out / "weights.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
