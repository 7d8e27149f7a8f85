"""Convolution and attention: FLAME against cuDNN (PyTorch eager), torch.compile and PyTorch's
fused attention, forward and backward, bfloat16, in one run.

    python -m bench.conv_attention --out DIR [--quick] [--only SECTION ...]
                                   [--backend cuda|reference]

Sections (``--only`` repeatable; all four by default, run in the order conv, attention,
compile, resblock):

- ``conv``: conv2d forward and both gradients (``y = conv2d(x, w); y.backward(gy)`` on both
  sides), NCHW, UNet shapes (3x3 stride 1, one 3x3 stride-2 downsample, one 1x1). Peer: PyTorch
  eager (cuDNN), ``cudnn.benchmark`` off (its default) and on. Target: FLAME >= 0.97x eager.
- ``attention``: ``scaled_dot_product_attention`` forward alone and forward + backward, [B, H, L,
  D], D 64 and 128, L 256 to 16384 with B*H*L = 65536, causal and not. Peer: PyTorch's SDPA.
  TFLOP/s: 4*B*H*L*L*D forward, 2.5x that backward, halved when causal. Targets: >= 0.95x SDPA;
  FLAME fallback >= 0.5x.
- ``resblock``: a UNet ResBlock (GroupNorm(32), SiLU, conv3x3, + Linear(SiLU(time embedding))
  broadcast over H, W, GroupNorm(32), SiLU, conv3x3, + residual), forward and backward with
  bfloat16 parameters and inputs; one class instantiated with ``torch.nn`` and with
  ``flame.nn``, FLAME's weights loaded from PyTorch's. Peers: eager and torch.compile (default
  mode; last, as its compile workers keep the host's CPUs busy for seconds afterwards).
  Target: >= 1.2x torch.compile.
- ``compile``: the first call of a new compiled function holding one new conv and one new
  attention configuration (forward and backward) in a fresh process: cold (empty
  ``FLAME_CACHE_DIR`` and ``CUPY_CACHE_DIR``), then warm from disk (a second fresh process, same
  directories). Targets: <= 150 ms cold, <= 5 ms from disk for the library part; the whole
  first call is reported, with FLAME's compile events (traces, plans, kernels by origin).
  Each child starts once the host's CPUs are quiet (bench/timing.py ``wait_for_quiet_host``).

"FLAME fallback" (conv and attention) is FLAME with ``flame.backends.cudnn.enabled = False``,
set while that system is built and timed: FLAME's own kernels; skipped, with the reason, where
the setting does not exist. Times are the device's: a spin kernel holds the stream while the
host queues ``calls`` calls, events around them, per call; the median over ``repeats`` samples
(``ms``). The host's time to issue one call is beside it (``host_issue_ms_per_call``). Ratios
are peer ms / FLAME ms: above 1, FLAME is faster. Outputs and gradients are compared once with
PyTorch's (largest difference over the largest magnitude). ``--backend reference`` is a CPU
smoke run: tiny shapes, FLAME's NumPy backend, PyTorch on the CPU, no torch.compile, no
fallback, no ratios; its ``compile`` section tries the child processes' plumbing only.
Writes ``conv_attention.json`` and ``conv_attention.md`` under ``--out``.

The code: bench/side_by_side.py (systems, device timing, checks, ratios),
bench/conv_attention_cases.py (the conv, attention and resblock sections),
bench/conv_attention_first_call.py (the compile section); here the report and the command line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# every name this file had before it was split stays importable from here
from bench.conv_attention_cases import (  # noqa: F401
    ATTENTION_QUICK,
    ATTENTION_TINY,
    CONV,
    CONV_QUICK,
    CONV_TINY,
    RESBLOCK,
    RESBLOCK_QUICK,
    RESBLOCK_TINY,
    TARGETS,
    attention_cases,
    attention_section,
    attention_systems,
    conv_section,
    conv_systems,
    cudnn_benchmark,
    fallback_setting,
    flame_systems,
    resblock_class,
    resblock_section,
    resblock_systems,
)
from bench.conv_attention_first_call import (  # noqa: F401
    CHILD_MARKER,
    FIRST_CALL,
    GRAD_INPUTS,
    ROOT,
    EventTotals,
    compile_section,
    first_call_child,
    first_call_inputs,
    recording,
    run_child,
)
from bench.harness import guarded
from bench.side_by_side import (  # noqa: F401
    BF16_TOLERANCE,
    MAX_SPIN_S,
    MIN_SPIN_S,
    System,
    Timing,
    clear_grads,
    device_ms,
    environment_info,
    flame_clock,
    flame_scope,
    make_row,
    max_rel,
    measure,
    progress,
    quotient,
    ratios,
    release_memory,
    run_systems,
    to_flame,
    to_numpy,
    torch_clock,
    torch_compile_skip,
    torch_device,
    torch_inputs,
)

# torch.compile (resblock) last: its compile workers keep the host busy for seconds after
SECTIONS = ("conv", "attention", "compile", "resblock")


# --- report ------------------------------------------------------------------------------------


NAMES = {"torch_eager": "eager", "torch_eager_cudnn_benchmark": "eager, cudnn.benchmark",
         "torch_sdpa": "torch SDPA", "torch_compile": "torch.compile", "flame": "FLAME",
         "flame_fallback": "FLAME fallback"}  # fmt: skip


def time_cell(entry: dict) -> str:
    """ms, with TFLOP/s in brackets where the row counts flops; or why there is no time."""
    if entry.get("status") != "ok":
        return entry.get("status", "-")
    rate = entry.get("tflop_s")
    return f"{entry['ms']:.3f}" + (f" ({rate:.0f})" if rate is not None else "")


def ratio_cell(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def check_cell(entry: dict) -> str:
    check = entry.get("check")
    return "-" if not check else f"{check['worst']:.1e}{'' if check['agrees'] else ' (!)'}"


def ratio_name(key: str) -> str:
    if key.endswith("_over_fallback"):
        return f"{NAMES[key.removesuffix('_over_fallback')]} / fallback"
    return f"{NAMES[key]} / FLAME"


def section_table(section: dict, systems: list, ratio_keys: list) -> list[str]:
    unit = " ms (TFLOP/s)" if section["rows"] and section["rows"][0]["flops"] else " ms"
    header = ["case", *(NAMES[key] + unit for key in systems)]
    header += [*(ratio_name(key) for key in ratio_keys), "FLAME max rel diff"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for row in section["rows"]:
        results = row["results"]
        cells = [row["label"], *(time_cell(results.get(key, {})) for key in systems)]
        cells += [ratio_cell(row["ratios"].get(key)) for key in ratio_keys]
        cells.append(check_cell(results.get("flame", {})))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def compile_lines(section: dict) -> list[str]:
    lines = [
        "| run | import flame ms | first call ms | second call ms | kernels compiled / from disk |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in ("cold", "warm_disk"):
        entry = section.get(name, {})
        if entry.get("status") != "ok":
            lines.append(f"| {name} | {entry.get('error', '-')} | | | |")
            continue
        events = entry.get("events", {})
        kernels = [events.get(f"kernel_{o}", {}).get("count", 0) for o in ("compiled", "disk")]
        lines.append(
            f"| {name} | {entry['import_flame_ms']:.0f} | {entry['first_call_ms']:.1f} "
            f"| {entry['second_call_ms']:.2f} | {kernels[0]} / {kernels[1]} |"
        )
    return lines


TABLES = {  # section -> (systems, ratio keys)
    "conv": (["torch_eager", "torch_eager_cudnn_benchmark", "flame", "flame_fallback"],
             ["torch_eager", "torch_eager_cudnn_benchmark", "torch_eager_over_fallback"]),
    "attention": (["torch_sdpa", "flame", "flame_fallback"],
                  ["torch_sdpa", "torch_sdpa_over_fallback"]),
    "resblock": (["torch_eager", "torch_compile", "flame"], ["torch_eager", "torch_compile"]),
}  # fmt: skip


def markdown(report: dict) -> str:
    lines = [
        f"# Convolution and attention, bfloat16 ({report['device']})",
        "",
        "Device ms per call (median); ratios peer ms / FLAME ms: above 1, FLAME is faster.",
        "",
    ]
    for name in SECTIONS:
        section = report.get(name)
        if section is None:
            continue
        lines += [f"## {name}", "", f"Target: {TARGETS[name]}", ""]
        if section.get("status") == "error":
            lines.append(f"error: {section['error']}")
        elif name == "compile":
            lines += compile_lines(section)
        else:
            lines += section_table(section, *TABLES[name])
        if "fallback_setting" in section:
            lines += ["", f"FLAME fallback: {section['fallback_setting']}"]
        lines.append("")
    return "\n".join(lines)


def run(backend: str, quick: bool, only=None, timing: Timing | None = None) -> dict:
    tiny = backend != "cuda"
    if timing is None:
        timing = Timing(1, 1, 2) if tiny else Timing(1, 3, 3) if quick else Timing(3, 10, 9)
    report = {**environment_info(backend), "quick": quick, "timing": timing.__dict__}
    shapes = {
        "conv": CONV_TINY if tiny else CONV_QUICK if quick else CONV,
        "attention": ATTENTION_TINY if tiny else ATTENTION_QUICK if quick else attention_cases(),
        "resblock": RESBLOCK_TINY if tiny else RESBLOCK_QUICK if quick else RESBLOCK,
    }
    actions = {
        "conv": lambda: conv_section(backend, shapes["conv"], timing),
        "attention": lambda: attention_section(backend, shapes["attention"], timing),
        "resblock": lambda: resblock_section(backend, shapes["resblock"], timing),
        "compile": lambda: compile_section(backend),
    }
    for name in SECTIONS:
        if name in (only or SECTIONS):
            outcome = guarded(actions[name])
            report[name] = outcome if outcome["status"] == "error" else actions_result(outcome)
    return report


def actions_result(outcome: dict) -> dict:
    """A section that ran: its own dict, without ``guarded``'s "ok" (a skip keeps its status)."""
    outcome = dict(outcome)
    if outcome["status"] == "ok":
        outcome.pop("status")
    return outcome


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.conv_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/conv_attention"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", action="append", choices=SECTIONS)
    parser.add_argument("--backend", choices=("cuda", "reference"), default="cuda")
    parser.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.first_call_child:
        first_call_child(arguments.backend)
        return 0
    report = run(arguments.backend, arguments.quick, arguments.only)
    arguments.out.mkdir(parents=True, exist_ok=True)
    (arguments.out / "conv_attention.json").write_text(json.dumps(report, indent=2))
    text = markdown(report)
    (arguments.out / "conv_attention.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
