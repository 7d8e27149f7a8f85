"""Diffusion-shaped kernels (issue 21): GroupNorm + SiLU on UNet activations, long-row softmax
and cross-entropy, and what a compiled step costs at new resolutions and batch sizes.

    python -m bench.diffusion_kernels --out DIR [--quick] [--only SECTION ...]
                                      [--backend cuda|reference] [--dtype DTYPE ...]

Sections (``--only`` repeatable; all three by default, run in the order resolutions,
groupnorm, rows: the fresh-process section first, before torch.compile's compile workers
keep the host's CPUs busy; ``--dtype`` float32 or bfloat16, repeatable, narrows groupnorm and
rows to those dtypes, to split a long run):

- ``groupnorm``: ``y = silu(group_norm(x, 32, w, b))`` on UNet activations [N, C, H, W],
  float32 and bfloat16 (x, w, b all of it), NCHW and channels-last (PyTorch:
  ``torch.channels_last``; FLAME: the NHWC array seen through ``permute(0, 3, 1, 2)``; the
  output gradient in the same layout), forward alone and forward + backward (``y.backward(gy)``:
  gradients of sum(y * gy) for x, w, b, a fixed random gy).
- ``rows``: ``softmax(x, -1)`` and ``cross_entropy(logits, target)`` (mean), forward + backward,
  rows of 32768 to 262144 elements, 2^28 elements in all (2^24 with ``--quick``), float32 and
  bfloat16 (float32 softmax holds about 6 GiB on the device: torch's x and gy, FLAME's x, gy,
  y and dx; torch's gradient is dropped while FLAME runs).
- ``resolutions``: a compiled training-style step, ``h = silu(group_norm(x, 32, w, b)) * scale
  + shift; loss = (h.float() ** 2).mean(); loss.backward()``, called in a fresh process (empty
  ``FLAME_CACHE_DIR`` and ``CUPY_CACHE_DIR``) at a first shape, then at new resolutions
  (squares and aspect-ratio buckets) and new batch sizes, bfloat16 then float32 (first shape
  8x320x32x32; squares 8 to 96 and 32x48, 48x32; batches 1, 2, 4, 16). Per call: the
  host's wall time to the result (synchronized), a second call at that shape, NVRTC compiles
  and traces with their reasons (and ``cache_info().kernels``' explanations where it has
  them); ``cache_info()`` at the end. A second cold child repeats the calls with FLAME's
  compile events recorded (conv_attention's mechanism; every extra field an event carries is
  kept); its host times run higher, as a listener makes the planner record its passes
  (bench/diffusion_kernels_resolutions.py). Targets: no NVRTC compile after the first call of
  each size class, <= 20 ms per new shape.

Peers: PyTorch eager and torch.compile (default mode; each row compiles afresh after
``torch._dynamo.reset()``, so that no row meets dynamo's recompile limit or automatic dynamic
shapes; last in each row). FLAME runs its functions under ``fl.compile``, as
bench/conv_attention.py does. Times are the device's, measured by conv_attention's loop: a spin
kernel holds the stream while the host queues the calls, events around them; the median over
the repeats. Ratios are peer ms / FLAME ms: above 1, FLAME is faster. Outputs and gradients are
compared once with PyTorch eager's (largest difference over the largest magnitude; tolerance
0.05 for bfloat16, 1e-3 for float32).

Byte floors (E = elements of x, s = bytes per element, C = channels):
groupnorm forward = 2*E*s + 2*C*s (read x, write y; w, b); forward + backward = 5*E*s + 5*C*s
(also read x and gy, write dx; read w, write dw, db). softmax = 5*E*s (read x, write y, read y,
read gy, write dx). cross-entropy = 3*E*s + 8*rows (read logits twice, write dlogits; targets),
and the 2-pass figure 2*E*s + 8*rows (an online formulation). "% of floor" = floor bytes / FLAME
seconds / the copy bandwidth measured in this run (bench/timing.py ``copy_bandwidth``: a 1 GiB
device-to-device copy, read + write counted), in the JSON as ``copy_bandwidth``.
``--backend reference`` is a CPU smoke run: tiny shapes, FLAME's NumPy backend, PyTorch on
the CPU, no torch.compile, no ratios or floor percentages; the resolutions child runs its
plumbing only. Writes ``diffusion_kernels.json`` and ``diffusion_kernels.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from bench.conv_attention import (
    System,
    Timing,
    actions_result,
    check_cell,
    clear_grads,
    environment_info,
    flame_clock,
    flame_scope,
    make_row,
    ratio_cell,
    run_systems,
    time_cell,
    to_flame,
    torch_clock,
    torch_compile_skip,
    torch_device,
)
from bench.diffusion_kernels_resolutions import (
    resolutions_child,
    resolutions_lines,
    resolutions_section,
)
from bench.harness import guarded
from bench.timing import copy_bandwidth

SECTIONS = ("resolutions", "groupnorm", "rows")
FLOAT32_TOLERANCE = 1e-3
TARGETS = {
    "groupnorm": "none fixed; FLAME against eager and torch.compile, and its % of the byte floor",
    "rows": "none fixed; FLAME against eager and torch.compile, and its % of the byte floor",
    "resolutions": "no NVRTC compile after the first call of each size class; "
    "<= 20 ms host time per new shape",
}

# (batch, channels, height, width)
GROUPNORM = [
    (64, 128, 32, 32), (64, 256, 16, 16), (64, 512, 8, 8), (16, 128, 64, 64), (8, 256, 64, 64),
    (4, 128, 128, 128), (1, 1280, 32, 32), (32, 64, 64, 64), (16, 640, 16, 16),
]  # fmt: skip
GROUPNORM_QUICK = [(8, 128, 32, 32), (2, 320, 16, 16)]
GROUPNORM_TINY = [(2, 32, 4, 4), (1, 64, 2, 3)]
ROW_LENGTHS = {"full": (32768, 65536, 131072, 262144), "quick": (32768, 262144), "tiny": (64, 256)}
ROW_TOTAL = {"full": 1 << 28, "quick": 1 << 24, "tiny": 1 << 10}
DTYPES = ("float32", "bfloat16")
NAMES = {"torch_eager": "eager", "torch_compile": "torch.compile", "flame": "FLAME"}


def progress(message: str) -> None:
    print(f"[diffusion_kernels] {message}", file=sys.stderr, flush=True)


# --- systems: eager, FLAME, torch.compile on one function --------------------------------------


def make_systems(torch_fn, flame_fn, inputs, grads, gout, backend: str, adopt=None) -> dict:
    """PyTorch eager, FLAME (``fl.compile``) and torch.compile running ``fn(*inputs)``; with
    any ``grads``, ``out.backward(gout)`` too (``gout`` None: a scalar output), and each call
    returns the output, then the gradients of the inputs marked in ``grads``. ``adopt(tensor,
    requires_grad)`` makes FLAME's copy of a torch tensor (default: ``to_flame``)."""
    import torch

    import flame as fl

    backward = any(grads)
    leaves = [tensor for tensor, grad in zip(inputs, grads) if grad]
    adopt = adopt or (lambda tensor, grad: to_flame(tensor, backend, grad))

    def torch_build(compiled: bool):
        def build():
            fn = torch_fn
            if compiled:
                torch._dynamo.reset()  # a fresh, static compile for this row
                fn = torch.compile(torch_fn)

            def call():
                clear_grads(leaves)
                with torch.set_grad_enabled(backward):
                    out = fn(*inputs)
                    if backward:
                        out.backward(gout)
                return (out, *(tensor.grad for tensor in leaves))

            return call, torch_clock(torch_device(backend))

        return build

    def flame_build():
        clear_grads(leaves)  # torch's gradients go while FLAME runs: device memory
        flame_inputs = [adopt(tensor, grad) for tensor, grad in zip(inputs, grads)]
        flame_gout = adopt(gout, False) if backward and gout is not None else None
        flame_leaves = [tensor for tensor, grad in zip(flame_inputs, grads) if grad]

        @fl.compile
        def step(*args):
            out = flame_fn(*args[:-1])
            if backward:
                out.backward(args[-1])
            return out

        def call():
            clear_grads(flame_leaves)
            out = step(*flame_inputs, flame_gout)
            return (out, *(tensor.grad for tensor in flame_leaves))

        return call, flame_clock(backend)

    return {
        "torch_eager": System(torch_build(False)),
        "flame": System(flame_build, flame_scope(backend)),
        "torch_compile": System(torch_build(True), skip=torch_compile_skip(backend)),
    }


def measured_row(label, case: dict, systems, names, floors, context, **extra) -> dict:
    """The systems timed and checked (float32 against a tighter tolerance), the row made with
    its ratios, and each system's share of every byte floor. ``context``: (backend, dtype,
    timing, copy bandwidth)."""
    backend, dtype, timing, bandwidth = context
    results = run_systems(systems, timing, names, backend)
    for entry in results.values():
        check = entry.get("check")
        if check and dtype == "float32":
            check.update(tolerance=FLOAT32_TOLERANCE, agrees=check["worst"] <= FLOAT32_TOLERANCE)
        if "ms" in entry:
            entry["pct_of_floor"] = {
                name: percent_of_floor(nbytes, entry["ms"], bandwidth, backend)
                for name, nbytes in floors.items()
            }
    return make_row(label, list(case), list(case.values()), results, backend, "torch_eager",
                    dtype=dtype, floor_bytes=floors, **extra)  # fmt: skip


def percent_of_floor(nbytes: int, ms, bandwidth: dict | None, backend: str):
    """Floor bytes over the time, as a percentage of the measured copy bandwidth; None on the
    reference backend (CPU times say nothing) or where a time or the bandwidth is missing."""
    if backend != "cuda" or not ms or not bandwidth or bandwidth.get("status") != "ok":
        return None
    return 100.0 * nbytes / (ms * 1e-3) / (bandwidth["gb_per_s"] * 1e9)


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


# --- groupnorm ---------------------------------------------------------------------------------


def groupnorm_systems(case, dtype: str, channels_last: bool, backward: bool, backend: str):
    import torch

    import flame.nn.functional as F
    from flame.runtime.storage import storage_of

    batch, channels, height, width = case
    torch.manual_seed(0)
    device, kind = torch_device(backend), torch_dtype(dtype)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    x, gy = (
        torch.randn(case, device=device, dtype=kind).contiguous(memory_format=layout)
        for _ in range(2)
    )
    weight = (1 + 0.1 * torch.randn(channels, device=device)).to(kind)
    bias = (0.1 * torch.randn(channels, device=device)).to(kind)
    inputs = [x.requires_grad_(backward), weight.requires_grad_(backward),
              bias.requires_grad_(backward)]  # fmt: skip

    seen = {"activation_strides": []}  # x's and gy's strides as FLAME holds them (elements)

    def adopt(tensor, grad):
        """FLAME's copy; a channels-last activation as its NHWC array seen as NCHW."""
        if tensor.ndim != 4 or not channels_last:
            copy = to_flame(tensor, backend, grad)
        else:
            view = None
            if backend == "cuda":  # DLPack keeps the strides: NCHW indices over NHWC memory
                import flame as fl

                with contextlib.suppress(Exception):
                    memory = tensor.detach().clone(memory_format=torch.channels_last)
                    view = fl.from_dlpack(memory)
            if view is None:
                view = to_flame(tensor.permute(0, 2, 3, 1), backend).permute(0, 3, 1, 2)
                view = view.realize()
            copy = view.requires_grad_() if grad else view
        if tensor.ndim == 4:
            try:
                strides = list(storage_of(copy.node).strides())
            except Exception as error:  # an internal API: its absence costs this record only
                strides = f"{type(error).__name__}: {error}"
            seen["activation_strides"].append(strides)
        return copy

    def torch_fn(x, w, b):
        return torch.nn.functional.silu(torch.nn.functional.group_norm(x, 32, w, b))

    def flame_fn(x, w, b):
        return F.silu(F.group_norm(x, 32, w, b))

    systems = make_systems(torch_fn, flame_fn, inputs, [backward] * 3, gy, backend, adopt)
    return systems, seen


def groupnorm_section(backend: str, cases: list, dtypes, timing: Timing, bandwidth) -> dict:
    rows = []
    fields = ("batch", "channels", "height", "width")
    for case in cases:
        elements, channels = case[0] * case[1] * case[2] * case[3], case[1]
        for dtype in dtypes:
            size = 4 if dtype == "float32" else 2
            for channels_last in (False, True):
                for backward in (False, True):
                    layout = "NHWC" if channels_last else "NCHW"
                    mode = "fwd+bwd" if backward else "fwd"
                    label = f"{'x'.join(map(str, case))} {dtype} {layout} {mode}"
                    progress(f"groupnorm {label}")
                    passes = 5 if backward else 2
                    floors = {"floor": passes * (elements + channels) * size}
                    names = ("y", "grad_x", "grad_w", "grad_b") if backward else ("y",)
                    systems, seen = groupnorm_systems(case, dtype, channels_last, backward,
                                                      backend)  # fmt: skip
                    context = (backend, dtype, timing, bandwidth)
                    rows.append(measured_row(label, dict(zip(fields, case)), systems, names,
                                             floors, context, layout=layout, mode=mode,
                                             flame_layout=seen))  # fmt: skip
    return {"target": TARGETS["groupnorm"], "rows": rows}


# --- rows: softmax and cross-entropy -----------------------------------------------------------


def row_systems(op: str, rows: int, length: int, dtype: str, backend: str) -> dict:
    import torch

    import flame.nn.functional as F

    torch.manual_seed(0)
    device, kind = torch_device(backend), torch_dtype(dtype)
    x = torch.randn(rows, length, device=device, dtype=kind).requires_grad_()
    if op == "softmax":
        gy = torch.randn(rows, length, device=device, dtype=kind)
        return make_systems(lambda x: torch.softmax(x, -1), lambda x: F.softmax(x, -1), [x],
                            [True], gy, backend)  # fmt: skip
    target = torch.randint(0, length, (rows,), device=device)
    return make_systems(torch.nn.functional.cross_entropy, F.cross_entropy, [x, target],
                        [True, False], None, backend)  # fmt: skip


def rows_section(backend: str, lengths, total: int, dtypes, timing: Timing, bandwidth) -> dict:
    found = []
    for op in ("softmax", "cross_entropy"):
        for length in lengths:
            rows = max(1, total // length)
            for dtype in dtypes:
                size = 4 if dtype == "float32" else 2
                label = f"{op} {rows}x{length} {dtype} fwd+bwd"
                progress(f"rows {label}")
                elements = rows * length
                if op == "softmax":
                    floors = {"5 passes": 5 * elements * size}
                else:
                    floors = {"3 passes": 3 * elements * size + 8 * rows,
                              "2 passes": 2 * elements * size + 8 * rows}  # fmt: skip
                names = ("y", "grad_x") if op == "softmax" else ("loss", "grad_logits")
                systems = row_systems(op, rows, length, dtype, backend)
                case = {"op": op, "rows": rows, "length": length}
                context = (backend, dtype, timing, bandwidth)
                found.append(measured_row(label, case, systems, names, floors, context,
                                          mode="fwd+bwd"))  # fmt: skip
    return {"target": TARGETS["rows"], "elements": total, "rows": found}


# --- report ------------------------------------------------------------------------------------


def percent_cell(value) -> str:
    return "-" if value is None else f"{value:.0f}%"


def measured_table(rows: list) -> list[str]:
    """One table of rows that share their floors' names."""
    systems = ["torch_eager", "torch_compile", "flame"]
    floor_names = list(rows[0]["floor_bytes"]) if rows else []
    header = ["case", *(f"{NAMES[key]} ms" for key in systems), "eager / FLAME",
              "torch.compile / FLAME", *(f"{name} MB" for name in floor_names),
              *(f"FLAME % of {name}" for name in floor_names), "FLAME max rel diff"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in rows:
        results = row["results"]
        flame = results.get("flame", {})
        cells = [row["label"], *(time_cell(results.get(key, {})) for key in systems)]
        cells += [ratio_cell(row["ratios"].get(key)) for key in ("torch_eager", "torch_compile")]
        cells += [f"{row['floor_bytes'][name] / 1e6:.1f}" for name in floor_names]
        pct = flame.get("pct_of_floor", {})
        cells += [percent_cell(pct.get(name)) for name in floor_names]
        cells.append(check_cell(flame))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


FLOOR_TEXT = {
    "groupnorm": "Floor (E elements, s bytes each, C channels): fwd 2*E*s + 2*C*s (read x, "
    "write y; w, b); fwd+bwd 5*E*s + 5*C*s (also read x, read gy, write dx; w, dw, db). "
    "NHWC: PyTorch's torch.channels_last; FLAME's x and gy are NHWC memory seen through "
    "permute(0, 3, 1, 2) (the strides FLAME held: flame_layout in the JSON).",
    "rows": "Floors (E elements, s bytes each): softmax fwd+bwd 5*E*s (read x, write y, read y, "
    "read gy, write dx); cross-entropy fwd+bwd 3*E*s + 8*rows (read logits twice, write "
    "dlogits; int64 targets), and 2*E*s + 8*rows for an online (one-read) formulation.",
}


def layout_line(rows: list) -> str:
    """Whether FLAME's NHWC rows held channels-last memory (not a contiguous NCHW copy)."""
    nhwc = [row for row in rows if row.get("layout") == "NHWC"]
    copied = []
    for row in nhwc:
        _, channels, height, width = row["case"].values()
        dense = [channels * height * width, height * width, width, 1]
        if any(strides == dense for strides in row["flame_layout"]["activation_strides"]):
            copied.append(row["label"])
    return (f"FLAME NHWC rows whose activations FLAME held as contiguous NCHW (a copy, not a "
            f"channels-last view): {len(copied)} of {len(nhwc)}.")  # fmt: skip


def markdown(report: dict) -> str:
    bandwidth = report.get("copy_bandwidth", {})
    copy = (
        f"{bandwidth['gb_per_s']:.0f} GB/s ({bandwidth['method']})"
        if bandwidth.get("status") == "ok"
        else bandwidth.get("error", "not measured")
    )
    lines = [
        f"# Diffusion-shaped kernels ({report['device']})",
        "",
        "Device ms per call (median); ratios peer ms / FLAME ms: above 1, FLAME is faster. "
        "FLAME runs under fl.compile; torch.compile in its default mode. "
        f"% of floor: floor bytes / FLAME time / copy bandwidth ({copy}).",
        "",
    ]
    for name in SECTIONS:
        section = report.get(name)
        if section is None:
            continue
        lines += [f"## {name}", "", f"Target: {TARGETS[name]}", ""]
        if section.get("status") == "error":
            lines.append(f"error: {section['error']}")
        elif name == "resolutions":
            lines += resolutions_lines(section)
        else:
            lines += [FLOOR_TEXT[name]]
            groups = {}  # rows by floors (softmax and cross-entropy count theirs differently)
            for row in section["rows"]:
                groups.setdefault(tuple(row["floor_bytes"]), []).append(row)
            for rows in groups.values():
                lines += ["", *measured_table(rows)]
            if name == "groupnorm":
                lines += ["", layout_line(section["rows"])]
        lines.append("")
    return "\n".join(lines)


def run(backend: str, quick: bool, only=None, timing: Timing | None = None, dtypes=None) -> dict:
    tiny = backend != "cuda"
    scale = "tiny" if tiny else "quick" if quick else "full"
    if timing is None:
        timing = Timing(1, 1, 2) if tiny else Timing(1, 3, 3) if quick else Timing(3, 10, 9)
    dtypes = [dtype for dtype in DTYPES if dtype in (dtypes or DTYPES)]
    report = {**environment_info(backend), "quick": quick, "timing": timing.__dict__,
              "dtypes": dtypes}  # fmt: skip
    selected = [name for name in SECTIONS if name in (only or SECTIONS)]
    bandwidth = None
    if {"groupnorm", "rows"} & set(selected):
        progress("copy bandwidth")
        bandwidth = guarded(copy_bandwidth, backend == "cuda", quick, 3 if tiny else 20)
        report["copy_bandwidth"] = bandwidth
    groupnorm = GROUPNORM_TINY if tiny else GROUPNORM_QUICK if quick else GROUPNORM
    actions = {
        "resolutions": lambda: {
            "target": TARGETS["resolutions"],
            **resolutions_section(backend, quick),
        },
        "groupnorm": lambda: groupnorm_section(backend, groupnorm, dtypes, timing, bandwidth),
        "rows": lambda: rows_section(
            backend, ROW_LENGTHS[scale], ROW_TOTAL[scale], dtypes, timing, bandwidth
        ),
    }
    for name in selected:
        outcome = guarded(actions[name])
        report[name] = outcome if outcome["status"] == "error" else actions_result(outcome)
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.diffusion_kernels",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/diffusion_kernels"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", action="append", choices=SECTIONS)
    parser.add_argument("--backend", choices=("cuda", "reference"), default="cuda")
    parser.add_argument("--dtype", action="append", choices=DTYPES)
    parser.add_argument("--resolutions-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--observe", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.resolutions_child:
        resolutions_child(arguments.backend, arguments.quick, arguments.observe)
        return 0
    report = run(arguments.backend, arguments.quick, arguments.only, dtypes=arguments.dtype)
    arguments.out.mkdir(parents=True, exist_ok=True)
    (arguments.out / "diffusion_kernels.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (arguments.out / "diffusion_kernels.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
