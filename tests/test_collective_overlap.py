"""Collectives on a second stream, overlapping the backward (flame/runtime/plans.py
``overlap_collectives``, flame/runtime/library_nccl.py ``start_collective``).

CPU tier: data-parallel-like graphs planned as on the GPU (``CpuExecutor``: passes, lowering,
slots; no kernel loaded) over collectives of a stand-in group of one; the order of the
plan's steps, where the joins go, when the inputs are released, what the switch restores,
the plan store's round trip and the dump's note; then a plan run by the executor's own loop
with the streams, events and routines stood in, which shows what is queued where, in which
order, and that the collective's input lives until its join.

GPU tier: a world of one through NCCL in this process: several all-reduced values with and
without overlap, step by step and captured as a CUDA graph, and the diffusion example's
data-parallel step against the plain one. Each skips with the reason where there is no GPU
or no NCCL.
"""

from __future__ import annotations

import datetime
import importlib
import os
import socket
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import flame as fl
from flame.distributed import functional
from flame.runtime import launch, library, library_nccl, plans
from flame.runtime.cache import DiskCache
from flame.runtime.compiler import KernelCache
from flame.runtime.device import DeviceInfo
from flame.runtime.executor import CollectiveJoin, Executor, LibraryCall
from flame.runtime.walks import linearize

ROOT = Path(__file__).resolve().parents[1]
FAKE_DEVICE = DeviceInfo("CPU stand-in for an H100", "sm_90", 132, 50 * 2**20)
GROUP = {"world_size": 1, "group_name": "nccl-stand-in"}  # never reached on the CPU
SIZES = (24, 20, 16, 12)  # layer widths: each bucket has a shape of its own


class CpuExecutor(Executor):
    """Plans as the GPU does; loads no kernel (each launch gets a stand-in function)."""

    def _load(self, sources):
        return [("function of", key) for _, _, key, _ in sources]


@pytest.fixture
def cpu_planning(monkeypatch, tmp_path):
    """Planning on the CUDA backend without a GPU; a fresh executor with a plan store of
    its own in ``tmp_path``."""
    monkeypatch.setenv("FLAME_SIBLING_CLASSES", "0")
    monkeypatch.setattr(launch, "device_info", lambda: FAKE_DEVICE)
    with fl.backend("cuda"):
        yield lambda: _executor(tmp_path)


def _executor(directory) -> CpuExecutor:
    executor = CpuExecutor(KernelCache(DiskCache(directory), arch="sm_90"))
    executor.plan_store.min_seconds = 0.0
    executor.plan_store.min_nodes = 0
    executor._warm_up_pending = False  # no cuBLAS warm-up thread: nothing runs on a GPU
    return executor


def _plan(executor, outputs):
    pending = [tensor.node for tensor in outputs]
    _, inputs, key = linearize(pending)
    return executor.plan_for(pending, inputs, key)


def _ddp_like_step(rng):
    """A small MLP's loss and backward (built, not run), each layer's weight gradient
    averaged as a bucket (the last layer's first, as a reducer's buckets), and an SGD
    update that reads the averages: ``[loss, *new weights]``."""
    x = fl.tensor(rng.standard_normal((8, SIZES[0])).astype(np.float32))
    weights = [
        fl.tensor(rng.standard_normal((n_in, n_out)).astype(np.float32), requires_grad=True)
        for n_in, n_out in zip(SIZES, SIZES[1:])
    ]  # fmt: skip
    hidden = x
    for weight in weights:
        hidden = (hidden @ weight).tanh()
    loss = (hidden * hidden).mean()
    loss.backward(create_graph=True)
    averaged = [
        functional.all_reduce(weight.grad.reshape(-1), "avg", **GROUP)
        for weight in reversed(weights)
    ]  # fmt: skip
    updated = [
        weight.detach() - 0.1 * flat.reshape(weight.shape)
        for weight, flat in zip(reversed(weights), averaged)
    ]  # fmt: skip
    return [loss, *updated]


def _collectives(plan) -> list[int]:
    return [
        index for index, step in enumerate(plan.launches)
        if isinstance(step, LibraryCall) and step.node.op == "all_reduce"
    ]  # fmt: skip


def _writer(plan, slot) -> int | None:
    for index, step in enumerate(plan.launches):
        if slot in plans._writes(step):
            return index
    return None


def _is_backward_kernel(step) -> bool:
    """A matmul of the backward (not a collective, not a join)."""
    return isinstance(step, LibraryCall) and step.node.op == "matmul"


# --- the plan ---------------------------------------------------------------------------------
def test_collectives_start_after_their_inputs_and_join_before_their_readers(cpu_planning, rng):
    plan = _plan(cpu_planning(), _ddp_like_step(rng))
    steps = plan.launches
    collectives = _collectives(plan)
    assert len(collectives) == 3
    joins = [index for index, step in enumerate(steps) if isinstance(step, CollectiveJoin)]
    assert len(joins) == 3
    pendings = [steps[index].pending for index in collectives]
    assert len(set(pendings)) == 3 and min(pendings) >= plan.slot_count - 3
    for number, index in enumerate(collectives):
        call = steps[index]
        (source,) = call.inputs
        # right after the step that computes its bucket (or the collective before it)
        assert _writer(plan, source) == index - 1 or index - 1 in collectives, index
        # joined once, before the first step that reads its result, after every unrelated
        # backward kernel that followed it in the fusion pass's order
        (join,) = [at for at in joins if steps[at].pending == call.pending]
        readers = [at for at, step in enumerate(steps) if call.output in plans._reads(step)]
        assert readers and join < min(readers)
        assert steps[join].inputs == call.inputs and steps[join].node is call.node
        # the input is released at the join, not before (NCCL reads it until then)
        releases = [at for at, slots in enumerate(plan.releases) if source in slots]
        assert releases == [join], (releases, join)
        if number < 2:  # the rest of the backward runs while it is reduced
            assert any(_is_backward_kernel(step) for step in steps[index + 1 : join]), number
    assert max(collectives) < min(joins)
    # the groups are in the steps' order (the dump and the check read them side by side)
    assert len(plan.graph.groups) == len(plans.group_steps(plan))
    for group, step in zip(plan.graph.groups, plans.group_steps(plan)):
        if isinstance(step, LibraryCall):
            assert group.nodes[0] is step.node


def test_the_switch_restores_the_plan_of_one_stream(cpu_planning, rng, monkeypatch):
    outputs = _ddp_like_step(rng)
    overlapped = _plan(cpu_planning(), outputs)
    monkeypatch.setattr(plans, "OVERLAP_COLLECTIVES", False)
    serial = _plan(cpu_planning(), outputs)
    assert not any(isinstance(step, CollectiveJoin) for step in serial.launches)
    assert all(step.pending == -1 for step in serial.launches if isinstance(step, LibraryCall))
    assert serial.slot_count == overlapped.slot_count - 3
    # the fusion pass's order: each step comes after the steps that write what it reads
    written = set(range(len(serial.inputs)))
    for step in serial.launches:
        assert set(plans._reads(step)) <= written
        written |= set(plans._writes(step))
    # the same steps, and the collectives in the same order (NCCL matches them by order)
    assert len(serial.launches) == len(plans.group_steps(overlapped))
    assert [step.node.shape for step in serial.launches if isinstance(step, LibraryCall)
            and step.node.op == "all_reduce"] == [
        overlapped.launches[index].node.shape for index in _collectives(overlapped)
    ]  # fmt: skip
    assert [serial.launches[index].node.shape for index in _collectives(serial)] == [
        ((n_in * n_out),) for n_in, n_out in reversed(list(zip(SIZES, SIZES[1:])))
    ]  # fmt: skip
    # the reordering only delays the optimizer: the planned peak stays close
    assert overlapped.planned_peak_bytes <= serial.planned_peak_bytes * 1.5


def test_a_lone_collective_stays_on_flames_stream(cpu_planning, rng):
    x = fl.tensor(rng.standard_normal((4, 8)).astype(np.float32))
    total = functional.all_reduce(x * 2.0, "sum", **GROUP) + 1.0  # nothing to overlap
    plan = _plan(cpu_planning(), [total])
    assert not any(isinstance(step, CollectiveJoin) for step in plan.launches)
    assert all(step.pending == -1 for step in plan.launches if isinstance(step, LibraryCall))


def test_chained_collectives_keep_their_order(cpu_planning, rng):
    a = fl.tensor(rng.standard_normal((6, 6)).astype(np.float32))
    b = fl.tensor(rng.standard_normal((6, 6)).astype(np.float32))
    first = functional.all_reduce(a @ a, "sum", **GROUP)
    second = functional.all_reduce(first.exp() @ b, "max", **GROUP)  # waits for the first
    third = functional.all_reduce((b @ b).tanh() @ b, "min", **GROUP)  # independent
    plan = _plan(cpu_planning(), [second, third])
    ops = [plan.launches[index].node.attr("op") for index in _collectives(plan)]
    assert ops == ["sum", "max", "min"]
    # the first is joined before its reader; the others at the end; all joined
    joined = [step.node.attr("op") for step in plan.launches if isinstance(step, CollectiveJoin)]
    assert sorted(joined) == ["max", "min", "sum"] and isinstance(plan.launches[-1], CollectiveJoin)


def test_plans_with_joins_round_trip_through_the_store(cpu_planning, rng):
    outputs = _ddp_like_step(rng)
    first = cpu_planning()
    stored = _plan(first, outputs)
    assert first.plan_store.writes == 1
    second = cpu_planning()  # the same directory: loads what the first stored
    loaded = _plan(second, outputs)
    assert second.plan_disk_hits == 1

    def shape(plan):
        return [
            (type(step).__name__, getattr(step, "pending", None), plans._reads(step),
             plans._writes(step))
            for step in plan.launches
        ]  # fmt: skip

    assert shape(loaded) == shape(stored)
    assert (loaded.slot_count, loaded.releases) == (stored.slot_count, stored.releases)
    assert plans.overlapped_collectives(loaded) == plans.overlapped_collectives(stored)


def test_the_dump_says_which_collectives_overlap(cpu_planning, rng):
    from flame.runtime import events
    from flame.tools.recorder import DumpRecorder

    a, b, c = (fl.tensor(rng.standard_normal((8, 8)).astype(np.float32)) for _ in range(3))
    first = a @ b
    reduced = functional.all_reduce(first, "avg", **GROUP)  # library calls only: nothing
    later = b @ c  # is compiled with NVRTC
    recorder = DumpRecorder()
    with events.recording(recorder):
        plan = _plan(cpu_planning(), [reduced @ later])
    assert plans.overlapped_collectives(plan) == {1: 3}
    (record,) = recorder.graphs
    notes = {kernel.index: kernel.launch_note for kernel in record.kernels}
    assert "on the communication stream" in notes[1] and "joined before k3" in notes[1], notes
    assert "communication stream" not in notes[2]


# --- running a plan, with the streams stood in -------------------------------------------------
class _Stream:
    def __init__(self, name: str, log: list, state: dict):
        self.name, self.log, self.state = name, log, state

    def record(self, event):
        self.log.append(f"{self.name} records {event.name}")
        return event

    def wait_event(self, event):
        self.log.append(f"{self.name} waits for {event.name}")

    def __enter__(self):
        self.state["previous"] = self.state["current"]
        self.state["current"] = self
        return self

    def __exit__(self, *exc):
        self.state["current"] = self.state.pop("previous")


class _Event:
    def __init__(self, name: str):
        self.name = name


def _stand_in_streams(monkeypatch, log: list, seen: dict):
    state: dict = {}
    main = _Stream("main", log, state)
    side = _Stream("side", log, state)
    state["current"] = main
    count = iter(range(100))
    monkeypatch.setattr(library_nccl, "communication_stream", lambda: side)
    monkeypatch.setattr(library_nccl, "_current_stream", lambda: state["current"])
    monkeypatch.setattr(library_nccl, "_new_event", lambda: _Event(f"e{next(count)}"))
    original_join = library_nccl.join_collective

    def join(pending):
        log.append(f"join: the input is alive: {seen['input']() is not None}")
        original_join(pending)

    monkeypatch.setattr(library_nccl, "join_collective", join)

    def all_reduce(node, arrays):
        seen["input"] = weakref.ref(arrays[0])
        log.append(f"all_reduce on {state['current'].name}")
        return np.array(arrays[0], copy=True)

    def matmul(node, arrays):
        log.append(f"matmul on {state['current'].name}")
        return arrays[0] @ arrays[1]

    monkeypatch.setitem(library.IMPLEMENTATIONS, "all_reduce", all_reduce)
    monkeypatch.setitem(library.IMPLEMENTATIONS, "matmul", matmul)


def test_a_collective_runs_on_the_side_stream_until_its_join(cpu_planning, rng, monkeypatch):
    values = [rng.standard_normal((8, 8)).astype(np.float32) for _ in range(3)]
    a, b, c = (fl.tensor(value) for value in values)
    result = functional.all_reduce(a @ b, "avg", **GROUP) @ (b @ c)
    executor = cpu_planning()
    plan = _plan(executor, [result])
    kinds = [type(step).__name__ for step in plan.launches]
    assert kinds == ["LibraryCall", "LibraryCall", "LibraryCall", "CollectiveJoin", "LibraryCall"]
    log: list[str] = []
    seen: dict = {}
    _stand_in_streams(monkeypatch, log, seen)
    slots = list(values) + [None] * (plan.slot_count - len(values))
    slots = executor._run_steps(plan, slots)  # the executor's own loop, releases included
    assert log == [
        "matmul on main",  # a @ b
        "main records e0",  # what the main stream queued so far ...
        "side waits for e0",  # ... comes first on the side stream
        "all_reduce on side",  # NCCL there, its result allocated there
        "side records e1",
        "matmul on main",  # b @ c, meanwhile
        "join: the input is alive: True",
        "main waits for e1",  # then the main stream waits, on the device
        "matmul on main",  # the reader of the average
    ]
    assert seen["input"]() is None  # released after the join
    assert all(slot is None for slot in slots[len(values) : plan.output_slots[0]])
    assert all(slot is None for slot in slots[plan.output_slots[0] + 1 :])  # joined: cleared
    expected = (values[0] @ values[1]) @ (values[1] @ values[2])
    np.testing.assert_allclose(slots[plan.output_slots[0]], expected, rtol=1e-5)


# --- the GPU tier ------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def nccl_world_of_one(monkeypatch):
    """A one-rank NCCL group in this process (as tests/test_distributed_nccl_gpu.py's)."""
    import flame.distributed as dist

    try:
        library_nccl.load()
    except library_nccl.NcclUnavailable as error:
        pytest.skip(f"NCCL is not available: {error}")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        with fl.backend("cuda"), fl.use_deterministic_algorithms(True):
            yield dist
    finally:
        dist.destroy_process_group()


def _count_starts(monkeypatch) -> list:
    started = []
    original = library_nccl.start_collective

    def counted(node, arrays):
        started.append(node.shape)
        return original(node, arrays)

    monkeypatch.setattr(library_nccl, "start_collective", counted)
    return started


def _trained(overlap: bool, cuda_graph: bool, batches, monkeypatch):
    """Losses, final weights and cache info of a small MLP trained by a compiled step that
    averages every gradient (a bucket each, as soon as it is made) before SGD reads it."""
    monkeypatch.setattr(plans, "OVERLAP_COLLECTIVES", overlap)
    fl.manual_seed(7)
    widths = (256, 512, 512, 512, 16)
    layers = []
    for n_in, n_out in zip(widths, widths[1:]):
        layers += [fl.nn.Linear(n_in, n_out), fl.nn.Tanh()]
    model = fl.nn.Sequential(*layers[:-1])
    optimizer = fl.optim.SGD(model.parameters(), lr=0.05)

    def step(x, y):
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        for param in model.parameters():
            param.grad = functional.all_reduce(param.grad, "avg")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    compiled = fl.compile(step, cuda_graph=cuda_graph)
    losses = [compiled(fl.tensor(x), fl.tensor(y)).item() for x, y in batches]
    return losses, [param.numpy() for param in model.parameters()], compiled.cache_info()


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_overlapped_all_reduces_equal_the_serial_ones(nccl_world_of_one, cuda_graph, monkeypatch):
    rng = np.random.default_rng(23)
    batches = [
        (rng.standard_normal((2048, 256)).astype(np.float32),
         rng.standard_normal((2048, 16)).astype(np.float32))
        for _ in range(5)
    ]  # fmt: skip
    started = _count_starts(monkeypatch)
    losses, weights, info = _trained(True, cuda_graph, batches, monkeypatch)
    assert started, "no collective ran on the communication stream"
    assert info.traces == 1
    if cuda_graph:  # the step graph holds both streams
        assert info.graph_captures >= 1 and info.graph_replays >= 3, info
    started.clear()
    serial_losses, serial_weights, serial_info = _trained(False, cuda_graph, batches, monkeypatch)
    assert not started, "OVERLAP_COLLECTIVES=False still used the communication stream"
    assert serial_info.traces == 1
    # deterministic algorithms, the same kernels in another order: the same bits
    np.testing.assert_array_equal(losses, serial_losses)
    for mine, theirs in zip(weights, serial_weights):
        np.testing.assert_array_equal(mine, theirs)
    assert losses[-1] < losses[0]  # and it trains


@pytest.mark.gpu
def test_the_example_ddp_step_is_the_same_with_and_without_overlap(nccl_world_of_one, monkeypatch):
    """The diffusion example's compiled DDP step, overlap on against off, under deterministic
    algorithms: the same kernels in another order on two streams give the same bits. (Against
    the plain, unwrapped step the plans differ in their fusion, and AdamW's first steps turn
    rounding differences of near-zero gradients into +-lr: see test_diffusion_ddp.py for that
    comparison at a tolerance.)"""
    missing = [name for name in ("sklearn", "PIL", "matplotlib", "tqdm")
               if importlib.util.find_spec(name) is None]  # fmt: skip
    if missing:
        pytest.skip(f"the diffusion example needs {', '.join(missing)}")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.diffusion import parallel, train
    from flame.nn.parallel import DistributedDataParallel

    options = train.parse_args(
        ["--preset", "quick", "--size", "tiny", "--image-size", "8", "--batch-size", "8",
         "--warmup", "2", "--out", os.devnull], gpu=False,
    )  # fmt: skip
    config = {"model": "unet", "size": "tiny", "image_size": 8, "channels": 1,
              "num_classes": 10, "schedule": "linear", "prediction": "eps"}  # fmt: skip
    rng = np.random.default_rng(5)
    images = fl.tensor(rng.uniform(-1, 1, (8, 1, 8, 8)).astype(np.float32)).realize()
    labels = fl.tensor(np.array([0, 3, 7, 9, 1, 2, 4, 5], dtype=np.int64)).realize()
    dropout = fl.get_rng_state()
    runs = []
    for overlap in (True, False):
        monkeypatch.setattr(plans, "OVERLAP_COLLECTIVES", overlap)
        fl.set_rng_state(dropout)
        trainer = train.Trainer(options, config, world=parallel.World(0, 1, "nccl"))
        trainer.prepare()
        assert isinstance(trainer.forward_model, DistributedDataParallel)
        losses = [trainer.run_step(images, labels)[0].item() for _ in range(4)]
        assert trainer.compiled.cache_info().traces == 1
        runs.append((losses, [param.numpy() for param in trainer.model.parameters()]))
    (losses, weights), (serial_losses, serial_weights) = runs
    np.testing.assert_array_equal(losses, serial_losses)
    for mine, theirs in zip(weights, serial_weights):
        np.testing.assert_array_equal(mine, theirs)
