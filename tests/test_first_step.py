"""What the first compiled training step's speed work changed in behaviour (issue 22, first
step in seconds; notes/first-step.md): each change must leave results as they were."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import flame as fl
from flame.runtime.walks import linearize
from flame.runtime.writes import Readers, reads_elementwise


def _brute_force(order, aliased, shape) -> bool:
    """The rule as first written: every reader of an aliased input is elementwise over
    ``shape`` (one walk of the whole order per question)."""
    from flame.ir.ops import get_op

    ids = {id(node) for node in aliased}
    for member in order:
        if any(id(child) in ids for child in member.inputs):
            if get_op(member.op).kind != "elementwise" or member.shape != shape:
                return False
    return True


def _step_graph():
    """A small update over four inputs, read elementwise, through a view and by a sum."""
    with fl.backend("cuda"):  # only built: nothing runs
        w, m, v, g = (fl.from_numpy(np.zeros((4, 6), np.float32)) for _ in range(4))
        m_new = m * 0.9 + g * 0.1
        v_new = v * 0.99 + g * g * 0.01
        w_new = w - m_new / (v_new.sqrt() + 1e-8) * (w.sum() * 0 + 1)  # w read by a sum too
        g_view = g.reshape(6, 4).permute(1, 0)  # g read through a view
        out = [w_new, m_new, v_new, g_view]
    order, inputs, _ = linearize([tensor.node for tensor in out])
    return order, inputs


def test_readers_answer_as_a_walk_of_the_order_does():
    order, inputs = _step_graph()
    shape = (4, 6)
    readers = Readers(order)
    subsets = [[]] + [[node] for node in inputs] + [list(inputs), [inputs[0], inputs[0]]]
    answers = []
    for aliased in subsets:
        expected = _brute_force(order, aliased, shape)
        assert reads_elementwise(order, aliased, shape) is expected
        assert reads_elementwise(readers, aliased, shape) is expected
        answers.append(expected)
    assert True in answers and False in answers  # the graph asks both ways


def test_readers_walk_the_order_once_for_many_questions():
    order, inputs = _step_graph()

    class Counted(list):
        walks = 0

        def __iter__(self):
            Counted.walks += 1
            return super().__iter__()

    counted = Counted(order)
    readers = Readers(counted)
    for _ in range(50):
        for node in inputs:
            reads_elementwise(readers, [node], (4, 6))
    assert Counted.walks == 1


def test_a_value_no_node_reads_is_safe_to_write():
    order, _ = _step_graph()
    with fl.backend("cuda"):
        unread = fl.from_numpy(np.zeros((4, 6), np.float32)).node
    assert reads_elementwise(Readers(order), [unread], (4, 6))
    assert reads_elementwise(order, [unread], (4, 6))


@pytest.mark.skipif(
    importlib.util.find_spec("cudnn") is None or importlib.util.find_spec("torch") is None,
    reason="needs the cuDNN frontend and PyTorch installed (the frontend imports PyTorch)",
)
def test_the_cudnn_frontend_loads_without_importing_pytorch():
    """``import cudnn`` imports torch when it can (17 s plus 12 s of op registration on the
    H100 host, inside the first step): FLAME's import keeps it out, and PyTorch still
    imports afterwards for whoever wants it."""
    code = (
        "import sys\n"
        "from flame.runtime.library_cudnn import import_frontend\n"
        "cudnn = import_frontend()\n"
        "assert hasattr(cudnn, 'pygraph'), cudnn\n"
        "assert 'torch' not in sys.modules, 'the cuDNN frontend imported torch'\n"
        "import torch\n"
        "assert torch.ones(2).sum().item() == 2\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


_KERNEL = """extern "C" __global__ void {name}(float* out) {{ out[threadIdx.x] = {value}f; }}"""


def test_a_batch_compiles_each_distinct_kernel_once(tmp_path):
    """Kernels repeated in one plan compile once (threads used to compile one key side by
    side); every item still gets its cubin, in order, the repeats as memory hits."""
    pytest.importorskip("cupy", reason="NVRTC comes with CuPy")
    from flame.runtime.cache import DiskCache
    from flame.runtime.compiler import KernelCache

    cache = KernelCache(DiskCache(tmp_path), arch="sm_80")
    sources = {name: _KERNEL.format(name=name, value=value) for name, value in
               (("k_one", 1.0), ("k_two", 2.0), ("k_three", 3.0))}  # fmt: skip
    names = ["k_one", "k_two", "k_one", "k_three", "k_two", "k_one"]
    rendered = []

    def renderer(name):
        def render():
            rendered.append(name)
            return sources[name]

        return render

    items = [(renderer(name), name, f"identity of {name}") for name in names]
    results = cache.cubins(items)
    assert cache.stats.compiles == 3
    assert cache.stats.memory_hits == 3
    assert sorted(rendered) == ["k_one", "k_three", "k_two"]  # rendered once each
    keys = [key for key, _ in results]
    assert keys[0] == keys[2] == keys[5] and keys[1] == keys[4]
    assert len({keys[0], keys[1], keys[3]}) == 3
    for (_key, cubin), name in zip(results, names):
        assert cubin == cache.cubin(sources[name], name, f"identity of {name}")[1]
        assert cubin  # a cubin, not an empty placeholder


def test_compile_threads_follow_the_environment(monkeypatch):
    from flame.runtime.compiler import compile_threads

    monkeypatch.setenv("FLAME_COMPILE_THREADS", "3")
    assert compile_threads() == 3
    monkeypatch.setenv("FLAME_COMPILE_THREADS", "not a number")
    assert 2 <= compile_threads() <= 32
