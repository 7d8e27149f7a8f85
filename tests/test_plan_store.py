"""The plan store (flame/runtime/plan_store.py): plans kept on disk, loaded by a new
executor or a new process instead of planned again.

These run without a GPU: the CUDA executor plans as on the GPU (passes, lowering, slots),
with a made-up device for the launch grids and no kernel loaded (``CpuExecutor``); realized
values come from the reference interpreter, held as host data of the CUDA backend.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.ir.node import Node, Token, toposort
from flame.runtime import launch, plan_payload, plan_store, reference
from flame.runtime.cache import DiskCache
from flame.runtime.compiler import KernelCache
from flame.runtime.device import DeviceInfo
from flame.runtime.executor import Executor, LibraryCall
from flame.runtime.storage import PlannedInput, Storage
from flame.runtime.walks import linearize
from flame.runtime.writes import writable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_DEVICE = DeviceInfo("CPU stand-in for an H100", "sm_90", 132, 50 * 2**20)


class CpuExecutor(Executor):
    """Plans as the GPU does; loads no kernel (records the keys it was asked for, and gives
    each launch a stand-in function naming its kernel's key)."""

    def _load(self, sources):
        self.loaded = getattr(self, "loaded", []) + [key for _, _, key, _ in sources]
        return [("function of", key) for _, _, key, _ in sources]


def _realize_on_reference(nodes):
    reference.realize(nodes, lambda dtype, array: Storage("cuda", dtype, host=array))


@pytest.fixture
def cpu_planning(monkeypatch):
    """Planning on the CUDA backend without a GPU, for this test only."""
    monkeypatch.setenv("FLAME_SIBLING_CLASSES", "0")
    monkeypatch.delenv("FLAME_PLAN_CACHE", raising=False)
    monkeypatch.setattr(launch, "device_info", lambda: FAKE_DEVICE)
    monkeypatch.setattr(importlib.import_module("flame.backend"), "_realize_on_gpu",
                        _realize_on_reference)  # fmt: skip
    with fl.backend("cuda"):
        yield


def new_executor(directory) -> CpuExecutor:
    executor = CpuExecutor(KernelCache(DiskCache(directory), arch="sm_90"))
    executor.plan_store.min_seconds = 0.0  # the small test graphs are stored too
    executor.plan_store.min_nodes = 0
    return executor


def plan_of(executor, outputs):
    pending = [tensor.node for tensor in outputs]
    _, inputs, key = linearize(pending)
    return executor.plan_for(pending, inputs, key), inputs, key


def facts(plan) -> dict:
    """Everything a plan is, with nodes by position (stand-ins by type and layout)."""
    graph = plan.graph
    roots = [*graph.outputs, *plan.inputs]
    for group in graph.groups:
        roots += [*group.nodes, *group.outputs]
    nodes = toposort(roots)
    index = {id(node): position for position, node in enumerate(nodes)}

    tokens: dict[int, int] = {}

    def value_of(value):
        if isinstance(value, PlannedInput):
            return ("stand-in", value.backend, value.dtype, value.layout())
        if isinstance(value, Token):  # by first appearance: which nodes share one
            return ("token", tokens.setdefault(id(value), len(tokens)))
        if type(value).__name__ in ("Recompute", "StoredRecompute"):
            return ("recompute", repr(value))
        return value

    def attrs(node):
        return tuple((name, value_of(value)) for name, value in node.attrs)

    def refs(values):
        return tuple(index[id(node)] for node in values)

    steps = []
    for step in plan.launches:
        if isinstance(step, LibraryCall):
            steps.append(("library", index[id(step.node)], step.inputs, step.output, step.views))
        else:
            steps.append(("kernel", step.spec, step.function, step.grid, step.block, step.args,
                          step.writes, step.shapes, step.zeroed))  # fmt: skip
    remat = graph.remat
    if remat is not None:
        remat = (
            tuple((index[id(node)], *rest) for node, *rest in remat.saved),
            tuple((index[id(node)], *rest) for node, *rest in remat.recomputed),
            remat.without, remat.with_saves, remat.kept,
        )  # fmt: skip
    return {
        "nodes": [
            (node.op, refs(node.inputs), attrs(node), node.dtype, node.shape, node.site)
            for node in nodes
        ],
        "groups": [(g.kind, refs(g.nodes), refs(g.outputs), g.reasons) for g in graph.groups],
        "outputs": refs(graph.outputs),
        "inputs": refs(plan.inputs),
        "remat": remat,
        "steps": steps,
        "slots": (plan.slot_count, plan.output_slots, plan.releases, plan.planned_peak_bytes),
        "text": str(graph),
    }


def reference_values(plan, inputs) -> list:
    """The plan's post-pass graph run by the reference interpreter over the inputs' data."""
    bound = {
        id(stand_in): reference.input_value(node) for stand_in, node in zip(plan.inputs, inputs)
    }  # fmt: skip
    return reference.evaluate(list(plan.graph.outputs), inputs=bound)


def _data(rng, *shape):
    return fl.tensor(rng.standard_normal(shape).astype(np.float32))


def elementwise(rng):
    x, y = _data(rng, 6, 10), _data(rng, 10)
    return [fl.exp(x * 0.5 + y) - fl.tanh(y), (x * float("nan")).abs()]


def reductions(rng):
    x = _data(rng, 12, 40)
    return [x.sum(1), (x * x).mean(0), x.amax(1, keepdim=True)]


def rows(rng):
    x, w, b = _data(rng, 8, 64), _data(rng, 64), _data(rng, 64)
    return [F.softmax(x, -1), F.layer_norm(x, (64,), w, b)]


def matmul(rng):
    x, w, b = _data(rng, 16, 32), _data(rng, 32, 24), _data(rng, 24)
    hidden = F.relu(x @ w + b)
    return [hidden, (hidden @ w.T).sum()]


def views(rng):
    x = _data(rng, 6, 8)
    z = x * 2.0 + 1.0
    return [z, z.T, z[1:4], z.reshape(48), fl.exp(z).permute(1, 0)]


def bfloat16(rng):
    x = _data(rng, 8, 16).to(fl.bfloat16)
    return [(x * 3.0).to(fl.float32).sum(1), F.silu(x)]


GRAPHS = [elementwise, reductions, rows, matmul, views, bfloat16]


@pytest.mark.parametrize("build", GRAPHS, ids=lambda build: build.__name__)
def test_loaded_plan_equals_the_fresh_one(cpu_planning, tmp_path, rng, build):
    state = rng.bit_generator.state
    first = new_executor(tmp_path)
    fresh, _, _ = plan_of(first, build(rng))
    assert first.plan_store.writes == 1 and first.plan_disk_hits == 0
    rng.bit_generator.state = state  # the same graph built again, over new tensors
    second = new_executor(tmp_path)
    outputs = build(rng)
    loaded, inputs, _ = plan_of(second, outputs)
    assert second.plan_disk_hits == 1 and second.plan_store.writes == 0
    assert loaded is not fresh
    assert facts(loaded) == facts(fresh)
    # the same kernels, asked for by the same keys, each once (a plan launches one kernel
    # in several groups); each launch has its own kernel's function (``facts``)
    assert sorted(second.loaded) == sorted(set(first.loaded))
    expected = reference.evaluate([tensor.node for tensor in outputs])
    for got, want in zip(reference_values(loaded, inputs), expected):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the memory cache answers from then on
    again, _, _ = plan_of(second, build(rng))
    assert again is loaded and second.plan_disk_hits == 1


def test_a_graph_deeper_than_the_recursion_limit_round_trips(cpu_planning, tmp_path, rng):
    def build():
        h = fl.tensor(np.linspace(0, 1, 16, dtype=np.float32))
        for step in range(sys.getrecursionlimit() + 200):
            h = h * 1.0001 + (step % 7) * 0.001
        return [h]

    fresh, _, _ = plan_of(new_executor(tmp_path), build())
    second = new_executor(tmp_path)
    loaded, inputs, _ = plan_of(second, build())
    assert second.plan_disk_hits == 1
    assert facts(loaded) == facts(fresh)


def test_a_kernel_launched_in_several_groups_is_loaded_once(cpu_planning, tmp_path, rng):
    """Three layers of one shape launch one elementwise kernel three times: a loaded plan
    asks for it once, and each of its launches gets that kernel's function."""

    def build():
        h = _data(rng, 16, 32)
        weights = [_data(rng, 32, 32) for _ in range(3)]
        for weight in weights:
            h = F.gelu(h @ weight) * 0.5
        return [h]

    state = rng.bit_generator.state
    first = new_executor(tmp_path)
    fresh, _, _ = plan_of(first, build())
    assert len(first.loaded) > len(set(first.loaded))  # a kernel in several groups
    rng.bit_generator.state = state
    second = new_executor(tmp_path)
    loaded, _, _ = plan_of(second, build())
    assert second.plan_disk_hits == 1
    assert sorted(second.loaded) == sorted(set(first.loaded))
    assert facts(loaded) == facts(fresh)  # per launch, its own kernel's function


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpoint"])
def test_compiled_optimizer_step_with_in_place_writes(
    cpu_planning, tmp_path, monkeypatch, checkpointed
):
    """``fl.compile`` of a training step (AdamW writes the weights and its state in place):
    a new executor loads the step's plan, equal to the one built, with the same answers to
    the in-place write checks. Checkpointed: the region's recomputation (barriers with
    tokens, a checkpoint node holding the region's function) is stored too."""
    from flame.runtime import executor as executor_module

    def step_plan(executor):
        monkeypatch.setattr(executor_module, "_executor", executor)
        generator = np.random.default_rng(7)
        w = fl.tensor(generator.standard_normal((8, 4)).astype(np.float32), requires_grad=True)
        b = fl.tensor(np.zeros(4, np.float32), requires_grad=True)
        opt = fl.optim.AdamW([w, b], lr=1e-2)

        def block(h):
            return F.gelu(h @ w + b)

        @fl.compile
        def step(x):
            hidden = fl.checkpoint(block, x) if checkpointed else block(x)
            loss = (hidden**2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        try:
            step(fl.tensor(generator.standard_normal((16, 8)).astype(np.float32)))
        except Exception:  # planned; running it needs a GPU
            pass
        (plan,) = executor._plans.values()
        return plan

    first = new_executor(tmp_path)
    fresh = step_plan(first)
    assert first.plan_store.writes == 1
    second = new_executor(tmp_path)
    loaded = step_plan(second)
    assert second.plan_disk_hits == 1
    assert facts(loaded) == facts(fresh)
    assert checkpointed == any(n.op == "barrier" for g in loaded.graph.groups for n in g.nodes)
    inputs = range(len(fresh.inputs))
    for slot in fresh.output_slots:
        for aliased in inputs:
            assert writable(loaded, slot, (aliased,)) == writable(fresh, slot, (aliased,))


SECOND_PROCESS = """
import hashlib, importlib, json, sys
import numpy as np
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import flame as fl
import flame.nn.functional as F
from flame.runtime import launch, reference
from test_plan_store import FAKE_DEVICE, facts, new_executor, plan_of, reference_values
from test_plan_store import _realize_on_reference

launch.device_info = lambda: FAKE_DEVICE
importlib.import_module("flame.backend")._realize_on_gpu = _realize_on_reference
with fl.backend("cuda"):
    rng = np.random.default_rng(3)
    x = fl.tensor(rng.standard_normal((16, 32)).astype(np.float32))
    w = fl.tensor(rng.standard_normal((32, 24)).astype(np.float32))
    outputs = [F.softmax(F.relu(x @ w) * 0.5, -1), (x * 2.0).sum(1)]
    executor = new_executor({cache!r})
    plan, inputs, _ = plan_of(executor, outputs)
    values = reference_values(plan, inputs)
print(json.dumps({{
    "disk_hits": executor.plan_disk_hits,
    "writes": executor.plan_store.writes,
    "facts": hashlib.sha256(repr(facts(plan)).encode()).hexdigest(),
    "values": [np.asarray(value).tolist() for value in values],
}}))
"""


def _second_process(cache, environment=None) -> dict:
    code = SECOND_PROCESS.format(
        root=ROOT, tests=os.path.join(ROOT, "tests"), cache=str(cache)
    )  # fmt: skip
    env = {**os.environ, "FLAME_SIBLING_CLASSES": "0", "FLAME_CACHE_DIR": str(cache)}
    env.pop("FLAME_PLAN_CACHE", None)
    env.update(environment or {})
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_new_process_loads_the_plan_from_disk(tmp_path):
    cache = tmp_path / "cache"
    first = _second_process(cache)
    assert first["disk_hits"] == 0 and first["writes"] == 1
    second = _second_process(cache)
    assert second["disk_hits"] == 1 and second["writes"] == 0
    assert second["facts"] == first["facts"]
    assert second["values"] == first["values"]
    off = _second_process(cache, {"FLAME_PLAN_CACHE": "0"})
    assert off["disk_hits"] == 0 and off["facts"] == first["facts"]


def test_plan_cache_off_neither_reads_nor_writes(cpu_planning, tmp_path, rng, monkeypatch):
    monkeypatch.setenv("FLAME_PLAN_CACHE", "0")
    state = rng.bit_generator.state
    executor = new_executor(tmp_path)
    plan_of(executor, matmul(rng))
    assert executor.plan_store.writes == 0 and DiskCache(tmp_path).entries() == []
    monkeypatch.delenv("FLAME_PLAN_CACHE")
    rng.bit_generator.state = state
    plan_of(new_executor(tmp_path), matmul(rng))  # stored now
    monkeypatch.setenv("FLAME_PLAN_CACHE", "0")
    rng.bit_generator.state = state
    third = new_executor(tmp_path)
    plan_of(third, matmul(rng))
    assert third.plan_disk_hits == 0 and third.plan_store.hits == 0


def _stored(tmp_path, rng, build=rows):
    """One graph planned and stored; (the entry's path, a function building it again)."""
    state = rng.bit_generator.state
    executor = new_executor(tmp_path)
    _, _, key = plan_of(executor, build(rng))
    digest = executor.plan_store.digest(key, "sm_90")
    path = executor.plan_store.disk.path(digest)
    assert path.is_file()

    def again():
        rng.bit_generator.state = state
        return build(rng)

    return path, digest, again


def test_a_corrupt_entry_is_a_miss_and_is_rewritten(cpu_planning, tmp_path, rng):
    path, _, again = _stored(tmp_path, rng)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    executor = new_executor(tmp_path)
    plan_of(executor, again())
    assert executor.plan_disk_hits == 0 and executor.plan_store.writes == 1
    later = new_executor(tmp_path)
    plan_of(later, again())
    assert later.plan_disk_hits == 1


@pytest.mark.parametrize("payload", ["not a pickle", "wrong signature", "foreign code"])
def test_a_well_framed_but_bad_payload_is_a_miss(cpu_planning, tmp_path, rng, payload):
    path, digest, again = _stored(tmp_path, rng)
    disk = DiskCache(tmp_path)
    stored = pickle.loads(disk.get(digest))
    if payload == "not a pickle":
        data = b"\x80\x05garbage"
    elif payload == "wrong signature":
        stored["signature"] = stored["signature"][:-1]
        data = pickle.dumps(stored)
    else:  # a file naming other code than FLAME's plan classes is refused, not run
        data = pickle.dumps({**stored, "nodes": os.getcwd}, protocol=5)
    disk.put(digest, data)
    executor = new_executor(tmp_path)
    fresh, _, _ = plan_of(executor, again())
    assert executor.plan_disk_hits == 0 and executor.plan_store.rejected == 1
    assert executor.plan_store.writes == 1  # rewritten
    assert pickle.loads(disk.get(digest))["signature"] == plan_payload._signature(fresh.inputs)


def test_other_sources_or_arch_are_other_keys(cpu_planning, tmp_path, rng):
    state = rng.bit_generator.state
    executor = new_executor(tmp_path)
    _, _, key = plan_of(executor, rows(rng))
    store = executor.plan_store
    same = plan_store.PlanStore(DiskCache(tmp_path))
    changed = plan_store.PlanStore(DiskCache(tmp_path), source_digest="0" * 64)
    same.min_nodes = changed.min_nodes = 0
    assert same.digest(key, "sm_90") == store.digest(key, "sm_90")
    assert changed.digest(key, "sm_90") != store.digest(key, "sm_90")
    assert store.digest(key, "sm_80") != store.digest(key, "sm_90")
    later = new_executor(tmp_path)
    later.plan_store = changed
    changed.min_seconds = 0.0
    rng.bit_generator.state = state
    plan_of(later, rows(rng))
    assert later.plan_disk_hits == 0 and later.plan_store.writes == 1


def test_deterministic_mode_plans_apart(cpu_planning, tmp_path, rng):
    state = rng.bit_generator.state
    plan_of(new_executor(tmp_path), reductions(rng))
    executor = new_executor(tmp_path)
    rng.bit_generator.state = state
    with fl.use_deterministic_algorithms(True):
        plan_of(executor, reductions(rng))
    assert executor.plan_disk_hits == 0 and executor.plan_store.writes == 1


def test_the_key_has_stable_bytes_and_keeps_token_sharing():
    """Keys by value, not by object: equal graphs built apart give one digest; a graph
    whose two nodes share a token differs from one where each has its own."""
    store = plan_store.PlanStore(DiskCache("/nonexistent"), source_digest="s")
    store.min_nodes = 0

    def key(shared: bool):
        leaf = Node("buffer", (), (("storage", PlannedInput("cuda", fl.float32, ((1,), True))),),
                    fl.float32, (4,))  # fmt: skip
        first, second = Token(), Token()
        a = Node("neg", (leaf,), (("token", first),), fl.float32, (4,))
        b = Node("neg", (leaf,), (("token", first if shared else second),), fl.float32, (4,))
        return linearize([Node("add", (a, b), (), fl.float32, (4,))])[2]

    assert store.digest(key(True), "sm_90") == store.digest(key(True), "sm_90")
    assert store.digest(key(False), "sm_90") == store.digest(key(False), "sm_90")
    assert store.digest(key(True), "sm_90") != store.digest(key(False), "sm_90")


def test_a_disk_hit_emits_the_plan_event(cpu_planning, tmp_path, rng):
    from flame.runtime import events

    state = rng.bit_generator.state
    plan_of(new_executor(tmp_path), elementwise(rng))
    rng.bit_generator.state = state
    seen = []
    executor = new_executor(tmp_path)
    with events.recording(lambda kind, data: seen.append((kind, data))):
        plan, _, _ = plan_of(executor, elementwise(rng))
    plans = [data for kind, data in seen if kind == "plan"]
    assert executor.plan_disk_hits == 1
    assert len(plans) == 1 and plans[0]["plan"] is plan and plans[0]["cached"] is True


def test_quick_plans_and_small_graphs_are_not_stored(cpu_planning, tmp_path, rng):
    executor = new_executor(tmp_path)
    executor.plan_store.min_seconds = 3600.0
    plan_of(executor, elementwise(rng))
    assert executor.plan_store.writes == 0 and DiskCache(tmp_path).entries() == []
    small = Executor(KernelCache(DiskCache(tmp_path), arch="sm_90"))  # the default limits
    _, _, key = plan_of(new_executor(tmp_path), elementwise(rng))
    assert len(key) - 1 < plan_store.MIN_NODES  # a lazy result's few nodes: never looked up
    assert small.plan_store.digest(key, "sm_90") is None


def test_the_default_store_follows_the_kernel_cache_directory(tmp_path):
    executor = Executor(KernelCache(DiskCache(tmp_path)))
    assert executor.plan_store.disk.root == tmp_path


GPU_STEP = """
import json
import numpy as np
import flame as fl
import flame.nn as nn
import flame.nn.functional as F
from flame.runtime.executor import default_executor

default_executor().plan_store.min_seconds = 0.0  # stored however quickly the GPU host plans
fl.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))
opt = fl.optim.AdamW(model.parameters(), lr=1e-2)


@fl.compile
def step(x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


rng = np.random.default_rng(0)
x = fl.tensor(rng.standard_normal((16, 32)).astype(np.float32))
y = fl.tensor(rng.standard_normal((16, 8)).astype(np.float32))
losses = [float(step(x, y).item()) for _ in range(3)]
print(json.dumps({
    "disk_hits": default_executor().plan_disk_hits,
    "losses": losses,
    "weight": model[0].weight.numpy().tolist(),
}))
"""


@pytest.mark.gpu
def test_a_new_process_trains_from_the_stored_plan_on_the_gpu(tmp_path):
    """A compiled training step in two processes over one cache directory: the second
    loads the step's plan from disk and trains to the same losses and weights."""
    env = {**os.environ, "FLAME_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": ROOT}
    env.pop("FLAME_PLAN_CACHE", None)
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", GPU_STEP], env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["disk_hits"] == 0 and second["disk_hits"] >= 1
    np.testing.assert_allclose(second["losses"], first["losses"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(second["weight"], first["weight"], rtol=1e-5, atol=1e-6)


def test_flame_cache_lists_and_clears_plans_with_the_kernels(cpu_planning, tmp_path, rng):
    """Plans are entries of the kernel cache's directory: ``flame cache list|clear`` (which
    read ``DiskCache``) see and remove them."""
    _, digest, again = _stored(tmp_path, rng)
    assert digest in [key for key, _, _ in DiskCache(tmp_path).entries()]
    assert DiskCache(tmp_path).clear() >= 1
    executor = new_executor(tmp_path)
    plan_of(executor, again())
    assert executor.plan_disk_hits == 0 and executor.plan_store.writes == 1


def test_kernels_missing_from_disk_compile_from_the_stored_specs(
    cpu_planning, tmp_path, rng, nvrtc
):
    """Only the plan survives (its kernels were removed): the loaded specs render and
    compile with NVRTC into the kernels the first plan was compiled to."""
    import shutil

    class NvrtcExecutor(CpuExecutor):
        def _load(self, sources):
            self.cubins = self.kernels.cubins(sources)
            return [None] * len(sources)

    def build(directory):
        executor = NvrtcExecutor(KernelCache(DiskCache(directory), arch="sm_90"))
        executor.plan_store.min_seconds, executor.plan_store.min_nodes = 0.0, 0
        rng.bit_generator.state = state
        plan_of(executor, elementwise(rng))
        return executor

    state = rng.bit_generator.state
    first = build(tmp_path / "first")
    stored = {key for key, _, _ in DiskCache(tmp_path / "first").entries()}
    (entry,) = stored - {key for key, _ in first.cubins}  # the plan: all but the kernels
    only_plan = DiskCache(tmp_path / "second").path(entry)
    only_plan.parent.mkdir(parents=True)
    shutil.copy(first.plan_store.disk.path(entry), only_plan)
    second = build(tmp_path / "second")
    assert second.plan_disk_hits == 1 and second.kernels.stats.compiles >= 1
    assert second.cubins == first.cubins  # the same keys and the same cubins
