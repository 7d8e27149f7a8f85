"""`flame dump`, FLAME_DUMP and fl.dump (CPU tier: without a GPU the script runs on the reference
backend and every kernel is still rendered and compiled with NVRTC)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import flame as fl
from flame.runtime import events
from flame.runtime.device import gpu_available
from flame.tools.analysis import miss_reason, plan_signature, spec_difference
from flame.tools.recorder import DumpRecorder

REPO_ROOT = Path(__file__).resolve().parents[1]
cpu_only = pytest.mark.skipif(gpu_available(), reason="checks the no-GPU path of flame dump")

SCRIPT = """
import sys
import numpy as np
import flame as fl
import flame.nn.functional as F

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 32
x = fl.from_numpy(np.random.default_rng(0).standard_normal((rows, 64)).astype(np.float32))
w = fl.from_numpy(np.ones((64, 16), np.float32))
y = F.layer_norm(x, (64,))
z = fl.gelu(fl.matmul(y, w)) * 2.0
print("total", float(z.sum().item()))
"""


def run(arguments, cwd: Path, environment=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["FLAME_CACHE_DIR"] = str(cwd / "cache")  # never the user's cache
    env.pop("FLAME_DUMP", None)
    env.update(environment or {})
    return subprocess.run(
        [sys.executable, *arguments], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def write_script(folder: Path, text: str, name: str = "user_script.py") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def dumped(tmp_path, nvrtc):
    """A script dumped with `flame dump` in a child process."""
    script = write_script(tmp_path, SCRIPT)
    result = run(["-m", "flame", "dump", str(script), "48", "--out", "out"], tmp_path)
    assert result.returncode == 0, result.stderr
    return tmp_path / "out", result


@pytest.mark.slow
def test_dump_writes_passes_fusion_kernels_and_summary(dumped):
    out, result = dumped
    assert "total" in result.stdout  # the script ran, with its argument
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True
    assert manifest["summary"]["graphs"] >= 1 and manifest["summary"]["kernels"] >= 2
    graph = manifest["graphs"][0]
    passes = [step["name"] for step in graph["passes"]]
    assert passes[0] == "input" and "fuse" in passes
    folder = out / graph["folder"]
    fuse_file = sorted((folder / "passes").glob("*-fuse.ir"))[0]
    assert fuse_file.read_text().startswith("// after fuse (")
    assert "f32[48,64]" in fuse_file.read_text()  # the script's argument set the rows
    fusion = (folder / "fusion.txt").read_text()
    assert "matmul runs as a library call" in fusion
    assert "input of matmul, which reads memory" in fusion
    kernels = [k for k in graph["kernels"] if k["kind"] != "library"]
    for kernel in kernels:
        source = (folder / kernel["file"]).read_text()
        assert source.startswith("// dump: graph 1, kernel")
        assert "user_script.py:" in source  # the user's lines head the kernel
        assert kernel["bytes"] > 0 and kernel["floor_ms"] > 0
        assert kernel["grid"] >= 1 and kernel["block"] >= 32
    summary = result.stdout
    assert "kernels:" in summary and "graphs:" in summary and "compile" in summary


@pytest.mark.slow
@cpu_only
def test_without_gpu_every_kernel_is_compiled_and_resources_reported(dumped):
    out, result = dumped
    assert "reference backend" in result.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    for graph in manifest["graphs"]:
        for kernel in graph["kernels"]:
            if kernel["kind"] == "library":
                continue
            assert kernel["resources"]["registers"] > 0, kernel["resources_note"]
            assert kernel["resources"]["spill_stores"] >= 0
            assert kernel["cache"] == "not cached"


@pytest.mark.slow
def test_every_dumped_kernel_compiles_with_nvrtc(dumped):
    from flame.runtime.compiler import nvrtc_compile

    out, _ = dumped
    sources = sorted(out.glob("graph-*/k*.cu"))
    assert len(sources) >= 2
    for path in sources:
        name = path.stem.split("-", 1)[1]
        assert nvrtc_compile(path.read_text(), name, "sm_90")[:4] == b"\x7fELF", path


@pytest.mark.slow
def test_dump_draws_dot_and_html_with_links(dumped):
    from html.parser import HTMLParser

    out, _ = dumped
    dot = (out / "graph-001" / "graph.dot").read_text()
    assert dot.startswith('digraph "graph 1"') and "subgraph cluster_k0" in dot

    class Links(HTMLParser):
        def __init__(self):
            super().__init__()
            self.ids, self.links, self.nodes = set(), [], 0

        def handle_starttag(self, tag, attributes):
            attributes = dict(attributes)
            if "id" in attributes:
                self.ids.add(attributes["id"])
            if tag == "a" and attributes.get("href", "").startswith("#"):
                self.links.append(attributes["href"][1:])
            if "node" in attributes.get("class", "").split():
                self.nodes += 1

    page = Links()
    text = (out / "index.html").read_text()
    page.feed(text)
    assert page.nodes >= 10
    assert page.links and set(page.links) <= page.ids  # every link lands somewhere
    assert "g1-k0" in page.ids
    assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")  # no network


@pytest.mark.slow
def test_script_that_raises_shows_its_traceback_and_keeps_the_dump(tmp_path, nvrtc):
    script = write_script(
        tmp_path,
        """
        import numpy as np
        import flame as fl
        x = fl.from_numpy(np.ones((8, 8), np.float32))
        print((x.exp() * 2).sum().item())
        def broken():
            raise ValueError("the user's own bug")
        broken()
        """,
    )
    result = run(["-m", "flame", "dump", str(script), "--out", "out"], tmp_path)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "the user's own bug" in result.stderr
    assert 'user_script.py", line 8' in result.stderr  # its own frame, shown
    assert "runpy" not in result.stderr  # not the tool's frames
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert summary.startswith("INCOMPLETE: the script raised ValueError")
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["complete"] is False and manifest["summary"]["graphs"] == 1
    assert list((tmp_path / "out" / "graph-001").glob("k*.cu"))


def test_missing_script_is_a_clear_error(tmp_path):
    result = run(["-m", "flame", "dump", "no_such_script.py", "--out", "out"], tmp_path)
    assert result.returncode == 2
    assert "flame dump: no such script: no_such_script.py" in result.stderr
    assert not (tmp_path / "out").exists()  # nothing that looks like a dump


def test_unwritable_or_foreign_output_folder_is_refused(tmp_path):
    script = write_script(tmp_path, "print('ran')\n")
    (tmp_path / "a_file").write_text("not a folder")
    result = run(["-m", "flame", "dump", str(script), "--out", "a_file/sub"], tmp_path)
    assert result.returncode == 2 and "cannot write to a_file/sub" in result.stderr
    assert "ran" not in result.stdout  # refused before running anything
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8")
    result = run(["-m", "flame", "dump", str(script), "--out", "photos"], tmp_path)
    assert result.returncode == 2 and "holds other files" in result.stderr
    assert (foreign / "holiday.jpg").exists()


@pytest.mark.slow
def test_flame_dump_environment_variable(tmp_path, nvrtc):
    script = write_script(tmp_path, SCRIPT)
    result = run([str(script)], tmp_path, {"FLAME_DUMP": str(tmp_path / "envdump")})
    assert result.returncode == 0, result.stderr
    assert "kernels:" in result.stderr and "dump written to" in result.stderr
    manifest = json.loads((tmp_path / "envdump" / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["summary"]["kernels"] >= 2
    # a second run reuses the folder: the earlier dump is replaced, not mixed
    (tmp_path / "envdump" / "graph-009").mkdir()
    result = run([str(script)], tmp_path, {"FLAME_DUMP": str(tmp_path / "envdump")})
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "envdump" / "graph-009").exists()


def test_fl_dump_prints_the_processed_ir(reference_backend, nvrtc):
    x = fl.from_numpy(np.arange(32, dtype=np.float32).reshape(4, 8))
    printed = io.StringIO()
    result = fl.dump(lambda a: (a.exp() * 2.0).sum(-1), x, file=printed)
    text = printed.getvalue()
    assert "graph f(%0: f32[4,8])" in text
    assert "reduce_sum" in text and "# k0" in text and "writes %4: graph output" in text
    np.testing.assert_allclose(result.numpy(), (np.exp(x.numpy()) * 2).sum(-1), rtol=1e-6)


def test_fl_dump_writes_a_folder(reference_backend, nvrtc, tmp_path):
    x = fl.from_numpy(np.ones((4, 8), np.float32))
    fl.dump(lambda a: a.sigmoid() + 1.0, x, out=tmp_path / "d", file=io.StringIO())
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["graphs"][0]["kernels"][0]["name"].startswith("flame_ew_sigmoid_add")


def test_repeated_graph_on_reference_counts_as_a_hit(reference_backend, nvrtc):
    recorder = DumpRecorder()
    x = fl.from_numpy(np.ones((4, 8), np.float32))
    with events.recording(recorder):
        for _ in range(3):
            (x * 3.0).exp().realize()
    assert len(recorder.graphs) == 1
    assert recorder.graphs[0].hits == 2 and recorder.graphs[0].runs == 3


def test_boundary_reasons_name_dependencies_and_materialized_values(reference_backend, nvrtc):
    recorder = DumpRecorder()
    x = fl.from_numpy(np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32))
    with events.recording(recorder):
        row_max = x.amax(-1, keepdim=True)
        column = (x - row_max).sum(0)  # a reduction over another axis reads the row max
        fl.realize(column, row_max)
    kernels = recorder.graphs[0].kernels
    reasons = [" | ".join(kernel.reasons) for kernel in kernels]
    assert any("graph output" in reason for reason in reasons)
    assert len(kernels) == 2
    assert all(kernel.kind == "reduce" for kernel in kernels)


def test_plan_miss_reason_names_the_changed_input(cuda_backend):
    from flame.ir.graph import Graph
    from flame.ir.passes import run_pipeline

    def signature(rows):
        x = fl.from_numpy(np.ones((rows, 128), np.float32))
        graph = run_pipeline(Graph(((x.exp() + 1.0).node,)))
        return plan_signature(graph)

    first, second = signature(64), signature(256)
    assert miss_reason(first, []) == "first graph of this structure in this process"
    reason = miss_reason(second, [(1, first)])
    assert reason == "new input types or sizes since graph 1: %0: f32[64,128] -> f32[256,128]"
    assert miss_reason(first, [(1, first)]).startswith("same graph and input types as graph 1")


def test_kernel_miss_reason_names_what_changed_in_the_code(cuda_backend):
    from flame.codegen.elementwise import lower_elementwise
    from flame.ir.graph import Graph
    from flame.ir.passes import run_pipeline
    from flame.runtime.executor import _layout_of

    def spec(tensor):
        graph = run_pipeline(Graph((tensor.node,)))
        return lower_elementwise(graph.groups[0], _layout_of).spec

    def data(shape, dtype=np.float32):
        return fl.from_numpy(np.ones(shape, dtype))

    wide = spec(data((64, 128)) + data(128))
    half = spec(data((64, 128), np.float16) + data(128, np.float16))
    ragged = spec(data((7, 13)) + data(13))  # rows of 13: no 16-byte vectors
    earlier = [(wide.name, wide, 1)]
    assert spec_difference(wide, []).startswith("no cubin for this code")
    half_reason = spec_difference(half, earlier)
    assert half_reason.startswith(f"new code: same operations as {wide.name} (graph 1), but")
    assert "parameters unsigned short* out0" in half_reason  # f16 data, as 16-bit words
    assert "vec 4 -> 1" in spec_difference(ragged, earlier)


def test_profile_table_sorts_slowest_first_with_percent_of_floor(reference_backend, nvrtc):
    from flame.tools.dumpfiles import profile_lines

    recorder = DumpRecorder(bandwidth=1e12)  # 1 TB/s: 4 MB moves in 4 us
    x = fl.from_numpy(np.ones((1024, 512), np.float32))
    with events.recording(recorder):
        fl.realize(x.exp(), x.sum(-1))
    fast, slow = recorder.graphs[0].kernels  # measured times, as a GPU run would add them
    fast.times_ms, slow.times_ms = [0.010, 0.004], [0.100, 0.050, 0.060]
    rows = profile_lines(recorder, limit=None)[2:]
    assert [slow.name in rows[0], fast.name in rows[1]] == [True, True]
    floor_us = fast.bytes_moved / 1e12 * 1e6
    assert fast.bytes_moved == 2 * 1024 * 512 * 4 and f"{floor_us:.2f}" in rows[1]
    assert f"{100 * floor_us / 7.0:.0f}%" in rows[1]  # against the median, 7 us
