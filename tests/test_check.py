"""`flame check`: per-kernel comparison with the float64 reference, and its repro.

CPU tier: the comparison and the repro writer, fed values from the reference interpreter in
the kernel's own dtype (standing in for the GPU) with planted errors. GPU tier: a script whose
kernel is planted wrong is caught by `flame check`, and the repro reproduces it.
"""

from __future__ import annotations

import json
import os
import py_compile
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.ir import dtypes
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.ir.printer import node_names
from flame.runtime.reference import evaluate
from flame.tools.check import CheckRecorder, Failure, check_group, compare

REPO_ROOT = Path(__file__).resolve().parents[1]


def processed(*tensors):
    return run_pipeline(Graph(tuple(t.node for t in tensors)))


def kernel_values(graph):
    """What a correct GPU would give for every group's outputs: the reference in the
    outputs' own dtypes."""
    outputs = [node for group in graph.groups for node in group.outputs]
    return dict(zip(map(id, outputs), evaluate(outputs)))


def test_compare_passes_rounding_and_fails_a_planted_error(rng):
    reference = rng.standard_normal((32, 16))
    rounded = reference.astype(np.float32)
    assert compare("%3", dtypes.float32, rounded, reference, scale=1.0).ok
    planted = rounded.copy()
    planted[5, 7] += 0.01
    result = compare("%3", dtypes.float32, planted, reference, scale=1.0)
    assert not result.ok and result.worst == (5, 7)
    assert result.max_abs == pytest.approx(0.01, rel=1e-3)
    half = reference.astype(np.float16)
    assert compare("%3", dtypes.float16, half, reference, scale=1.0).ok
    assert not compare("%3", dtypes.float32, half, reference, scale=1.0).ok


def test_compare_nan_inf_and_integers():
    reference = np.array([np.nan, np.inf, 1.0])
    assert compare("x", dtypes.float32, reference.astype(np.float32), reference, 1.0).ok
    wrong_nan = np.array([np.nan, np.inf, np.nan], np.float32)
    assert not compare("x", dtypes.float32, wrong_nan, reference, 1.0).ok
    integers = np.array([1, 2, 3])
    assert compare("i", dtypes.int32, integers, integers, 1.0).ok
    result = compare("i", dtypes.int32, np.array([1, 5, 3]), integers, 1.0)
    assert not result.ok and result.worst == (1,)


@pytest.mark.parametrize("planted", [False, True], ids=["correct", "planted"])
def test_check_group_charges_the_kernel_that_made_the_error(reference_backend, rng, planted):
    x = fl.from_numpy(rng.standard_normal((64, 128)).astype(np.float32))
    weight = fl.from_numpy(rng.standard_normal((128, 32)).astype(np.float32))
    hidden = F.layer_norm(x, (128,))
    out = fl.gelu(fl.matmul(hidden, weight)).sum(-1)
    graph = processed(out)
    known = kernel_values(graph)
    names = node_names(graph)
    kinds = [group.kind for group in graph.groups]
    first = kinds.index("reduce")
    if planted:  # the layer norm kernel gets one element wrong
        wrong = known[id(graph.groups[first].outputs[0])].copy()
        wrong[3, 4] *= 1.01
        known[id(graph.groups[first].outputs[0])] = wrong
    verdicts = []
    for group in graph.groups:
        if group.kind == "library":
            continue
        outputs = [known[id(node)] for node in group.outputs]
        verdicts.append(all(result.ok for result in check_group(group, known, outputs, names)))
    # downstream kernels read the (wrong) value the "GPU" gave them, so only the first fails
    assert verdicts == (
        [False] + [True] * (len(verdicts) - 1) if planted else [True] * len(verdicts)
    )


def test_reductions_get_room_for_rounding(reference_backend, rng):
    rows = 512
    x = fl.from_numpy((rng.standard_normal((rows, 8192)) + 3).astype(np.float32))
    graph = processed(x.sum(-1))
    (group,) = graph.groups
    summed = np.cumsum(x.numpy(), axis=-1, dtype=np.float32)[:, -1]  # serial float32 sums
    results = check_group(group, {}, [summed.reshape(rows)], node_names(graph))
    assert all(result.ok for result in results), results
    far_off = summed * (1 + 1e-3)
    assert not check_group(group, {}, [far_off.reshape(rows)], node_names(graph))[0].ok


class _Slot:
    """A host array standing in for a CuPy one (``get`` is all the repro writer uses)."""

    def __init__(self, array):
        self.array = array

    def get(self):
        return self.array


def test_repro_folder_is_complete_and_compiles(reference_backend, rng, tmp_path, nvrtc):
    from flame.codegen.lower import lower_group
    from flame.runtime.compiler import nvrtc_compile
    from flame.runtime.executor import _layout_of
    from flame.runtime.launch import Launch

    x = fl.from_numpy(rng.standard_normal((16, 64)).astype(np.float32))
    graph = processed(F.softmax(x, -1))
    (group,) = graph.groups
    lowered = lower_group(group, _layout_of)
    slot_of = {id(x.node): 0, id(group.outputs[0]): 1}
    launch = Launch.plan(lowered, None, slot_of)
    value = evaluate(list(group.outputs))[0]
    slots = [_Slot(x.numpy()), _Slot(value)]
    recorder = CheckRecorder(tmp_path / "repro")
    names = node_names(graph)
    known = {id(group.outputs[0]): value}
    results = check_group(group, known, [value * 1.5], names)
    recorder.failure = Failure("graph", 0, lowered.spec.name, "", [], results)
    folder = recorder._write_repro(group, launch, slots, known, names)
    assert sorted(p.name for p in folder.iterdir()) == [
        "expected.npz", "inputs.npz", "kernel.cu", "launch.json", "report.txt", "repro.py",
    ]  # fmt: skip
    launch_data = json.loads((folder / "launch.json").read_text())
    assert launch_data["name"] == lowered.spec.name
    assert [p["kind"] for p in launch_data["params"]][:2] == ["out", "in"]
    np.testing.assert_array_equal(np.load(folder / "inputs.npz")["in0"], x.numpy())
    source = (folder / "kernel.cu").read_text()
    assert nvrtc_compile(source, lowered.spec.name, "sm_90")[:4] == b"\x7fELF"
    py_compile.compile(str(folder / "repro.py"), doraise=True)
    assert "FAIL" in (folder / "report.txt").read_text()


def test_flame_check_without_gpu_says_what_to_do(tmp_path):
    from flame.runtime.device import gpu_available

    if gpu_available():
        pytest.skip("checks the message shown on machines without a GPU")
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    result = _flame("check", str(script), cwd=tmp_path)
    assert result.returncode == 2 and "no GPU" in result.stderr and "flame dump" in result.stderr
    result = _flame("check", "missing.py", cwd=tmp_path)
    assert result.returncode == 2 and "no such script: missing.py" in result.stderr


def _flame(*arguments, cwd: Path, environment=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["FLAME_CACHE_DIR"] = str(cwd / "cache")
    env.update(environment or {})
    return subprocess.run(
        [sys.executable, "-m", "flame", *arguments],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


PLANTED = """
import numpy as np
import flame as fl
import flame.nn.functional as F
import flame.runtime.executor as executor

real_render = executor.render
def planted_render(spec):  # a codegen bug: the softmax kernel uses exp2 instead of exp
    source = real_render(spec)
    return source.replace("expf(", "exp2f(") if "reduce_max" in spec.name else source
executor.render = planted_render

x = fl.from_numpy(np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32))
y = (x * 2.0 + 1.0).realize()                      # a correct kernel first
probabilities = F.softmax(y, -1)                   # the planted one
print(float((probabilities * y).sum().item()))
"""


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("planted", [False, True], ids=["correct", "planted"])
def test_flame_check_finds_a_planted_wrong_kernel(tmp_path, planted):
    text = PLANTED if planted else PLANTED.replace("executor.render = planted_render", "")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(text))
    result = _flame("check", str(script), "--out", "repro", cwd=tmp_path)
    if not planted:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "every kernel is within its tolerance" in result.stdout
        return
    assert result.returncode == 1, result.stdout + result.stderr
    assert "reduce_max" in result.stdout and "differs from the float64 reference" in result.stdout
    assert "train.py:" in result.stdout  # the user's line
    assert "exp2f(" in (tmp_path / "repro" / "kernel.cu").read_text()  # the code that ran
    rerun = subprocess.run(
        [sys.executable, str(tmp_path / "repro" / "repro.py")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    # the repro reruns just that kernel and fails the same way (one of its outputs is wrong)
    assert rerun.returncode == 1 and "FAIL output" in rerun.stdout, rerun.stdout + rerun.stderr
