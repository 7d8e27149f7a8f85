"""What the first compiled training step's speed work changed in behaviour (issue 22, first
step in seconds; notes/first-step.md): each change must leave results as they were."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import flame as fl
from flame.runtime import writes as writes_module
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


def test_readers_among_the_inputs_answer_as_a_walk_does():
    """``Readers(order, among)`` indexes the readers of ``among`` only; a value outside it
    (here: computed nodes and a value nothing reads) is answered by a walk."""
    order, inputs = _step_graph()
    shape = (4, 6)
    readers = Readers(order, inputs)
    with fl.backend("cuda"):
        unread = fl.from_numpy(np.zeros((4, 6), np.float32)).node
    subsets = [[node] for node in inputs] + [list(inputs), [order[-1]], [unread]]
    for aliased in subsets:
        assert reads_elementwise(readers, aliased, shape) is _brute_force(order, aliased, shape)


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


def _launch(writes, reads, zeroed=()):
    from flame.runtime.launch import Launch

    args = tuple(("out", slot) for slot in writes) + tuple(("in", slot) for slot in reads)
    shapes = tuple(((4,), np.float32) for _ in writes)
    written = tuple((slot, position) for position, slot in enumerate(writes))
    zeroed = tuple((slot, 16) for slot in zeroed)
    return Launch(None, None, 1, 1, args, written, shapes, zeroed)


def _writable_by_walking(plan, out_slot, aliased_slots) -> bool:
    """The rule as first written: a walk of the launches per question."""
    from flame.runtime.executor import _reads
    from flame.runtime.launch import Launch

    writer = next(
        (index for index, step in enumerate(plan.launches)
         if isinstance(step, Launch) and any(slot == out_slot for slot, _ in step.writes)),
        None,
    )  # fmt: skip
    if writer is None or any(slot == out_slot for slot, _ in plan.launches[writer].zeroed):
        return False
    later = (slot for step in plan.launches[writer + 1 :] for slot in _reads(step))
    return not any(slot in aliased_slots for slot in later)


def test_writable_answers_as_a_walk_of_the_launches_does(rng):
    from flame.runtime.executor import LibraryCall, Plan

    with fl.backend("cuda"):
        matmul = (fl.from_numpy(np.zeros((2, 2), np.float32)) @ fl.ones(2, 2)).node
    # slots 0-2 are inputs; 3.. written: read, rewritten later, zeroed, by a library call
    launches = (
        _launch([3], [0, 1]),
        _launch([4], [3, 2]),
        LibraryCall(matmul, (4, 1), 5),
        _launch([6, 7], [5, 0], zeroed=[7]),
        _launch([8], [2]),
        _launch([3], [8]),  # 3 written again: the first writer counts
    )
    plan = Plan(launches, 9, (6, 8), None, 0.0)
    answers = set()
    for out_slot in range(10):
        for size in range(3):
            for _ in range(4):
                aliased = tuple(int(slot) for slot in rng.choice(9, size, replace=False))
                expected = _writable_by_walking(plan, out_slot, aliased)
                assert writes_module.writable(plan, out_slot, aliased) is expected
                answers.add(expected)
    assert answers == {True, False}
    assert plan.slot_steps is not None  # kept for the next question


def test_the_broadcast_push_bound_counts_as_computed_size_does():
    from flame.ir.passes.cost import computed_size
    from flame.ir.passes.simplify import _computes_more_than

    with fl.backend("cuda"):
        x = fl.from_numpy(np.zeros((3, 5), np.float32))
        deep = x
        for step in range(12):
            deep = (
                (deep * 1.5 + x.sum(0)).reshape(5, 3).permute(1, 0)
                if step % 3 == 0
                else deep.exp() - x
            )
        nodes = [deep.node, (x * 2).node, x.node, (deep + deep).node]
    for node in nodes:
        size = computed_size(node)
        for limit in range(0, size + 3):
            assert _computes_more_than(node, limit) is (size > limit)


def test_background_size_classes_wait_while_plans_are_built(cuda_backend, tmp_path):
    """The sibling thread's lowering holds the GIL: it starts only once no plan has begun
    for ``quiet`` seconds (a plan calls ``busy``)."""
    pytest.importorskip("cupy", reason="NVRTC comes with CuPy")
    import time

    import flame.nn.functional as F
    from flame.codegen.lower import lower_group
    from flame.ir.graph import Graph
    from flame.ir.passes import run_pipeline
    from flame.runtime.cache import DiskCache
    from flame.runtime.compiler import KernelCache
    from flame.runtime.executor import _layout_of
    from flame.runtime.siblings import SiblingCompiler

    x = fl.tensor(np.ones((2, 64, 8, 8), np.float32))
    graph = run_pipeline(Graph((F.silu(F.group_norm(x, 32)).node,)))
    (group,) = [g for g in graph.groups if g.kind == "reduce"]
    lowered = lower_group(group, _layout_of)
    cache = KernelCache(DiskCache(tmp_path), arch="sm_90")
    waiting = SiblingCompiler(cache, quiet=3600.0)
    waiting.submit([(group, lowered)])
    time.sleep(0.5)
    assert cache.stats.background == 0  # still quiet-waiting
    waiting.stop()
    waiting.drain()  # stopped: the queued work is dropped, drain returns
    assert cache.stats.background == 0
    eager = SiblingCompiler(cache, quiet=0.0)
    eager.submit([(group, lowered)])
    eager.drain()
    assert cache.stats.background > 0
    eager.stop()


def test_only_the_importing_thread_is_refused_pytorch():
    """The refusal is for the thread importing the frontend: a user's thread importing torch
    meanwhile gets it."""
    import threading

    from flame.runtime.library_cudnn import _NoTorchForThisThread

    made = []
    refused = []

    def in_loading_thread():
        made.append(_NoTorchForThisThread())
        for name in ("torch", "torch.nn", "torchvision"):
            try:
                made[0].find_spec(name)
                refused.append((name, False))
            except ModuleNotFoundError:
                refused.append((name, True))

    thread = threading.Thread(target=in_loading_thread)
    thread.start()
    thread.join()
    assert refused == [("torch", True), ("torch.nn", True), ("torchvision", False)]
    assert made[0].find_spec("torch") is None  # this thread: left to the other finders
