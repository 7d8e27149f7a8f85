"""`flame check SCRIPT`: run a script on the GPU and compare every fused kernel with the float64
reference interpreter, kernel by kernel.

Each kernel is checked in isolation: its reference is computed in float64 from the values the
GPU actually gave it (the graph's inputs and earlier kernels' results), so an error is charged
to the kernel that made it, not to everything downstream. Every plan is checked on its first
run. The first kernel whose error exceeds its tolerance is reported, with a standalone repro:
the kernel's inputs (``inputs.npz``), the exact source that ran (``kernel.cu``), the launch
(``launch.json``), the reference outputs (``expected.npz``) and ``repro.py``, which reruns just
that kernel with CuPy and compares.

Tolerance of an output (``|gpu - ref| <= atol + rtol * |ref|`` everywhere): ``rtol`` by dtype
(``RTOL``); ``atol = rtol * scale``, where ``scale`` is the larger of the output's RMS and the
RMS of the kernel's float inputs (times ``sqrt(n)`` for a reduction over ``n`` elements, whose
rounding grows with it). Integer and boolean outputs must match exactly.
"""

from __future__ import annotations

import json
import math
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flame.ir.graph import Group, is_input
from flame.ir.node import format_site
from flame.ir.ops import get_op

RTOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


@dataclass
class Comparison:
    name: str  # the output's graph name or position
    error: float  # max |gpu - ref| / (atol + rtol |ref|): > 1 fails
    max_abs: float
    rtol: float
    atol: float
    worst: tuple  # index of the worst element

    @property
    def ok(self) -> bool:
        return self.error <= 1.0


def as_float64(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    return array.astype(np.float64) if array.dtype.kind in "fV" or _is_low_float(array) else array


def _is_low_float(array) -> bool:
    return array.dtype.name in ("bfloat16", "float16")


def reduced_count(group: Group) -> int:
    """Elements folded into each value of the group's largest reduction (1: none)."""
    count = 1
    for node in group.nodes:
        if get_op(node.op).kind == "reduce":
            shape = node.inputs[0].shape
            count = max(count, math.prod(shape[axis] for axis in node.attr("axes")))
    return count


def reference_outputs(group: Group, known: dict[int, np.ndarray]) -> tuple[list, dict]:
    """The group's outputs in float64, from ``known`` values of what it reads (earlier
    kernels' results; graph inputs are read from their storage when missing), and every
    value computed or read on the way."""
    from flame.runtime.reference import _evaluate_node, input_value

    members = {id(node) for node in group.nodes}
    values: dict[int, np.ndarray] = {}
    for node in group.nodes:
        for child in node.inputs:
            if id(child) in members or id(child) in values:
                continue
            if id(child) in known:
                values[id(child)] = as_float64(known[id(child)])
            elif is_input(child):
                values[id(child)] = as_float64(input_value(child)).reshape(child.shape)
            else:
                raise ValueError(f"kernel reads {child.op} whose value is unknown")
        values[id(node)] = _evaluate_node(node, values, np.float64)
    return [np.asarray(values[id(node)]) for node in group.outputs], values


def compare(name: str, dtype, gpu: np.ndarray, ref: np.ndarray, scale: float) -> Comparison:
    gpu, ref = as_float64(gpu).reshape(ref.shape), as_float64(ref)
    if not dtype.is_float:
        wrong = gpu != ref
        worst = (
            tuple(int(i) for i in np.unravel_index(np.argmax(wrong), ref.shape)) if ref.size else ()
        )
        error = float("inf") if wrong.any() else 0.0  # integers and booleans match exactly
        return Comparison(name, error, float(np.abs(gpu - ref).max(initial=0)), 0.0, 0.0, worst)
    rtol = RTOL.get(dtype.name, 1e-4)
    atol = rtol * max(scale, 1e-30)
    with np.errstate(invalid="ignore"):
        difference = np.abs(gpu - ref)
        same_nan = np.isnan(gpu) & np.isnan(ref)
        same_inf = np.isinf(ref) & (gpu == ref)
        difference = np.where(same_nan | same_inf, 0.0, difference)
        difference = np.where(np.isnan(difference), np.inf, difference)
        ratio = difference / (atol + rtol * np.abs(np.where(np.isfinite(ref), ref, 0.0)))
    if ref.size == 0:
        return Comparison(name, 0.0, 0.0, rtol, atol, ())
    flat = int(np.argmax(ratio))
    worst = tuple(int(i) for i in np.unravel_index(flat, ref.shape))
    return Comparison(name, float(ratio.max()), float(difference.max()), rtol, atol, worst)


def _rms(array: np.ndarray) -> float:
    finite = array[np.isfinite(array)] if array.dtype.kind == "f" else array
    return float(np.sqrt(np.mean(np.square(finite)))) if finite.size else 0.0


def check_group(group: Group, known: dict[int, np.ndarray], gpu_outputs, names) -> list:
    """Compare the GPU's outputs of ``group`` with its float64 reference."""
    refs, values = reference_outputs(group, known)
    members = {id(node) for node in group.nodes}
    float_inputs = [
        value for key, value in values.items()
        if key not in members and value.dtype.kind == "f"
    ]  # fmt: skip
    input_scale = max((_rms(value) for value in float_inputs), default=0.0)
    growth = math.sqrt(reduced_count(group))
    results = []
    for node, gpu, ref in zip(group.outputs, gpu_outputs, refs):
        scale = max(_rms(ref), input_scale * growth)
        results.append(compare(names.get(id(node), "?"), node.dtype, gpu, ref, scale))
    return results


# -- listening to a run ---------------------------------------------------------------------


@dataclass
class Failure:
    graph_text: str
    kernel: int
    name: str
    group_text: str
    sites: list[str]
    comparisons: list[Comparison]
    repro: Path | None = None
    notes: list[str] = field(default_factory=list)


class CheckRecorder:
    """An events recorder: on the first run of each plan, check each of its fused kernels."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.failure: Failure | None = None
        self.kernels_checked = 0
        self.plans_checked = 0
        self.problems: list[str] = []  # kernels that could not be checked, and why
        self._sources: dict[str, object] = {}
        self._seen: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()

    def __call__(self, kind: str, data: dict) -> None:
        if kind == "kernel":
            with self._lock:
                self._sources[data["name"]] = data["source"]
        elif kind == "run" and self.failure is None:
            with self._lock:
                known = self._seen.get(id(data["plan"]))
                if known is not None and known() is data["plan"]:
                    return
                self._seen[id(data["plan"])] = weakref.ref(data["plan"])
                self._check_plan(data["plan"], data["slots"])

    def _check_plan(self, plan, slots) -> None:
        from flame.ir.printer import format_graph, node_names
        from flame.runtime.executor import LibraryCall
        from flame.runtime.plans import group_steps

        self.plans_checked += 1
        graph = plan.graph
        names = node_names(graph)
        # the plan's inputs are stand-ins without memory: their values are the bound slots
        known = {id(node): _host(slots[slot], node) for slot, node in enumerate(plan.inputs)}
        for index, (group, launch) in enumerate(zip(graph.groups, group_steps(plan))):
            if isinstance(launch, LibraryCall):
                known[id(launch.node)] = _host(slots[launch.output], launch.node)
                continue
            outputs = [None] * len(group.outputs)
            for slot, position in launch.writes:
                outputs[position] = _host(slots[slot], group.outputs[position])
            try:
                results = check_group(group, known, outputs, names)
            except Exception as error:  # an op the reference cannot run: say so, go on
                self.problems.append(f"{launch.spec.name}: not checked ({error})")
                results = []
            self.kernels_checked += 1
            for node, value in zip(group.outputs, outputs):
                known[id(node)] = value
            if any(not result.ok for result in results):
                sites = [format_site(n.site) for n in group.nodes if n.site is not None]
                self.failure = Failure(
                    graph_text=format_graph(graph), kernel=index, name=launch.spec.name,
                    group_text="\n".join(launch.spec.header), sites=list(dict.fromkeys(sites)),
                    comparisons=results,
                )  # fmt: skip
                self.failure.repro = self._write_repro(group, launch, slots, known, names)
                return

    def _write_repro(self, group, launch, slots, known, names) -> Path:
        from flame.codegen.render import render

        source = self._sources.get(launch.spec.name)
        text = source() if callable(source) else render(launch.spec)
        refs, _ = reference_outputs(group, known)
        folder = self.out
        folder.mkdir(parents=True, exist_ok=True)
        inputs, params = {}, []
        for kind, value in launch.args:
            if kind == "in":
                key = f"in{len(inputs)}"
                inputs[key] = slots[value].get()
                params.append({"kind": "in", "name": key})
            elif kind == "out":
                output = [p for s, p in launch.writes if s == value][0]
                shape, dtype = launch.shapes[output]
                params.append({"kind": "out", "index": output, "shape": list(shape),
                               "dtype": np.dtype(dtype).name})  # fmt: skip
            else:
                params.append({"kind": "scalar", "dtype": value.dtype.name, "value": value.item()})
        tolerance = [
            {"name": c.name, "rtol": c.rtol, "atol": c.atol, "exact": not node.dtype.is_float}
            for c, node in zip(self.failure.comparisons, group.outputs)
        ]
        launch_data = {"name": launch.spec.name, "grid": launch.grid, "block": launch.block,
                       "params": params, "tolerance": tolerance}  # fmt: skip
        _save(folder / "kernel.cu", text)
        _save(folder / "launch.json", json.dumps(launch_data, indent=1) + "\n")
        np.savez(folder / "inputs.npz", **inputs)
        expected = {f"out{i}": ref for i, ref in enumerate(refs)}
        expected.update(
            {f"flame_out{i}": as_float64(known[id(n)]) for i, n in enumerate(group.outputs)}
        )
        np.savez(folder / "expected.npz", **expected)
        _save(folder / "repro.py", REPRO_SCRIPT)
        _save(folder / "report.txt", report_text(self.failure) + "\n")
        return folder


def _host(array, node) -> np.ndarray:
    """A slot's CuPy array as NumPy, in the node's dtype (bfloat16 bits reinterpreted)."""
    data = array.get()
    if node.dtype.name == "bfloat16":
        data = data.view(node.dtype.numpy)
    return data.reshape(node.shape)


def _save(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


def report_text(failure: Failure) -> str:
    lines = [f"kernel k{failure.kernel} {failure.name} differs from the float64 reference"]
    if failure.sites:
        lines.append(f"user lines: {', '.join(failure.sites)}")
    for result in failure.comparisons:
        verdict = "FAIL" if not result.ok else "ok"
        lines.append(
            f"  {verdict} {result.name}: error {result.error:.3g}x tolerance, max |diff| "
            f"{result.max_abs:.3g} at {list(result.worst)} (rtol {result.rtol:g}, "
            f"atol {result.atol:.3g})"
        )
    lines += ["", "the kernel's group:", failure.group_text, "", "the graph:", failure.graph_text]
    if failure.repro is not None:
        lines.append(f"\nrepro: python {failure.repro / 'repro.py'}")
    return "\n".join(lines)


REPRO_SCRIPT = '''"""Rerun one FLAME kernel on its saved inputs; compare with the float64 reference.

Needs only NumPy and CuPy (with ml_dtypes for bfloat16): python repro.py
"""

import json
import sys
from pathlib import Path

import cupy
import numpy as np

here = Path(__file__).resolve().parent
launch = json.loads((here / "launch.json").read_text())
inputs = np.load(here / "inputs.npz")
expected = np.load(here / "expected.npz")
module = cupy.RawModule(code=(here / "kernel.cu").read_text(), options=("-std=c++17",))
kernel = module.get_function(launch["name"])
arguments, outputs = [], {}
for param in launch["params"]:
    if param["kind"] == "in":
        arguments.append(cupy.asarray(inputs[param["name"]]))
    elif param["kind"] == "out":
        array = cupy.empty(param["shape"], dtype=param["dtype"])
        outputs[param["index"]] = array
        arguments.append(array)
    else:
        arguments.append(np.dtype(param["dtype"]).type(param["value"]))
kernel((launch["grid"],), (launch["block"],), arguments)
cupy.cuda.get_current_stream().synchronize()
failed = False
for index, tolerance in enumerate(launch["tolerance"]):
    got = outputs[index].get()
    if got.dtype == np.uint16 and expected[f"out{index}"].dtype != np.uint16:
        import ml_dtypes  # bfloat16 is stored as its bits
        got = got.view(ml_dtypes.bfloat16)
    got = got.astype(np.float64).reshape(expected[f"out{index}"].shape)
    ref = expected[f"out{index}"].astype(np.float64)
    bound = tolerance["atol"] + tolerance["rtol"] * np.abs(ref)
    error = float(np.nanmax(np.abs(got - ref) / np.maximum(bound, 1e-300))) if ref.size else 0.0
    if tolerance["exact"]:
        error = float((got != ref).sum())
    verdict = "FAIL" if error > 1 else "ok"
    failed |= error > 1
    print(f"{verdict} output {index} ({tolerance['name']}): error {error:.3g}x tolerance")
sys.exit(1 if failed else 0)
'''


def check_script(script: Path, arguments: list[str], out: Path) -> tuple[dict, CheckRecorder]:
    """Run ``script`` on the GPU under a ``CheckRecorder``: (script status, recorder)."""
    from flame.runtime import events
    from flame.tools.script import run_script

    recorder = CheckRecorder(out)
    with events.recording(recorder):
        status = run_script(script, arguments)
    return status, recorder
