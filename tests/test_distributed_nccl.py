"""flame.distributed's nccl backend.

CPU tier: the collective ops (flame/ir/ops/collective.py): shape rules, the references of a
world of one, their place in dumps and compiled programs, the errors; the in-place wiring of
``dist.all_reduce`` & co. over a stand-in group on the reference backend; the rendezvous over
a real TCP store with NCCL itself stood in; the GPU choice; the errors without a GPU or NCCL.

The GPU tier is tests/test_distributed_nccl_gpu.py.
"""

from __future__ import annotations

import io
import os
import socket
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import flame as fl
import flame.distributed as dist
from flame.distributed import functional
from flame.distributed.nccl import NcclGroup
from flame.ir.shapes import ShapeError
from flame.runtime import library_nccl

ONE = {"world_size": 1, "group_name": ""}  # a world of one, which the reference computes
REDUCE_OPS = ["sum", "avg", "product", "max", "min"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- the ops: shapes, references, errors -----------------------------------------------------
@pytest.mark.parametrize("world", [1, 3])
def test_shape_rules(world, reference_backend):
    x = fl.zeros((world, 2, 5), dtype=fl.bfloat16)
    group = {"world_size": world, "group_name": "g"}
    cases = {
        "all_reduce": (functional.all_reduce(x, "avg", **group), (world, 2, 5)),
        "broadcast": (functional.broadcast(x, world - 1, **group), (world, 2, 5)),
        "all_gather": (functional.all_gather(x, **group), (world, world, 2, 5)),
        "reduce_scatter": (functional.reduce_scatter(x, "max", **group), (2, 5)),
    }
    for name, (result, shape) in cases.items():
        assert result.node.op == name and result.shape == shape, name
        assert result.dtype == fl.bfloat16 and dict(result.node.attrs)["world"] == world


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "int64", "bfloat16", "float16"])
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_references_of_a_world_of_one(op, dtype, reference_backend, rng):
    values = (rng.standard_normal((3, 4)) * 10).astype(np.float32)
    x = fl.tensor(values).to(getattr(fl, dtype)) * 1  # lazy: the collective reads a kernel's
    expected = x.numpy()
    got = {
        "all_reduce": functional.all_reduce(x, op, **ONE),
        "reduce_scatter": functional.reduce_scatter(x.reshape(1, 3, 4), op, **ONE),
        "broadcast": functional.broadcast(x, 0, **ONE),
        "all_gather": functional.all_gather(x, **ONE)[0],
    }
    for name, result in got.items():
        assert result.dtype == x.dtype, name
        np.testing.assert_array_equal(result.numpy(), expected, err_msg=name)


def test_bool_is_carried_except_avg(reference_backend):
    flags = fl.tensor(np.array([True, False, True]))
    assert functional.all_reduce(flags, "sum", **ONE).tolist() == [True, False, True]
    with pytest.raises(TypeError, match=r"all_reduce: op avg is not defined for bool"):
        functional.all_reduce(flags, "avg", **ONE)


def test_reference_of_a_larger_world_is_refused(reference_backend):
    result = functional.all_reduce(fl.ones(4), "sum", world_size=2, group_name="g")
    assert result.shape == (4,)  # building is fine; only computing needs the other ranks
    with pytest.raises(RuntimeError, match=r"all_reduce over a world of 2 ranks has no refer"):
        result.numpy()


def test_bad_input_is_named_at_the_users_line(reference_backend):
    here = Path(__file__).name
    with pytest.raises(TypeError, match=rf"all_reduce: NCCL has no int16 type.*int16\[3\].*{here}"):
        functional.all_reduce(fl.zeros(3, dtype=fl.int16), **ONE)
    with pytest.raises(ShapeError, match=rf"world = 2.*got float32\[3, 4\].*{here}"):
        functional.reduce_scatter(fl.zeros((3, 4)), world_size=2, group_name="g")
    with pytest.raises(ShapeError, match=r"reduce_scatter: the input must be \[world, \.\.\.\]"):
        functional.reduce_scatter(fl.zeros(()), **ONE)
    with pytest.raises(ValueError, match=r"broadcast: src 2 is outside the world of 2 ranks"):
        functional.broadcast(fl.zeros(3), 2, world_size=2, group_name="g")
    with pytest.raises(ValueError, match=r"expected a ReduceOp .*got 'mean'"):
        functional.all_reduce(fl.zeros(3), "mean", **ONE)
    with pytest.raises(ValueError, match=r"give both world_size and group_name"):
        functional.all_gather(fl.zeros(3), world_size=1)
    with pytest.raises(TypeError, match=r"all_gather: expected a flame Tensor, got ndarray"):
        functional.all_gather(np.zeros(3), **ONE)


def test_lazy_collectives_need_an_nccl_group(reference_backend):
    with pytest.raises(RuntimeError, match="has not been initialized"):
        functional.all_reduce(fl.zeros(3))


def test_collectives_are_library_ops_without_gradient():
    from flame.ir.ops import get_op

    for name in ("all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        op = get_op(name)
        assert op.kind == "library" and not op.differentiable and op.vjp is None, name


# --- plans, dumps and compiled programs --------------------------------------------------------
def test_dump_shows_the_collective_as_a_library_call(reference_backend, nvrtc):
    x = fl.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    printed = io.StringIO()

    def step(a):
        return functional.all_reduce(a.exp() * 2.0, "avg", **ONE).sum(-1) + 1.0

    result = fl.dump(step, x, file=printed)
    text = printed.getvalue()
    assert 'all_reduce(%2, group="", op="avg", world=1)' in text, text
    assert "library over all_reduce -> f32[3,4]" in text, text
    assert "input of all_reduce, which reads memory" in text, text
    np.testing.assert_allclose(result.numpy(), (np.exp(x.numpy()) * 2).sum(-1) + 1, rtol=1e-6)


def test_compiled_function_with_collectives(reference_backend):
    def step(a, b):
        gathered = functional.all_gather(a * 2.0, **ONE)
        return functional.all_reduce(gathered[0] + b, "sum", **ONE).exp()

    compiled = fl.compile(step)
    for scale in (1.0, 2.0, 3.0):
        a = fl.tensor(np.full((2, 3), scale, np.float32))
        b = fl.tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
        np.testing.assert_allclose(compiled(a, b).numpy(), step(a, b).numpy(), rtol=1e-6)
    info = compiled.cache_info()
    assert info.traces == 1 and info.hits == 2


# --- dist.all_reduce & co. on an nccl group: the in-place wiring -------------------------------
@pytest.fixture
def stand_in_group(monkeypatch):
    """The default group is an NcclGroup of a world of one whose communicator is never
    reached, and which lets reference tensors through, so the in-place semantics of the
    nccl path run on the CPU (the GPU tests run the same calls through NCCL)."""
    group = NcclGroup.__new__(NcclGroup)
    group.rank, group.world_size, group.timeout, group.aborted = 0, 1, 5.0, None
    group.name = "nccl-stand-in"
    monkeypatch.setattr(group, "_check", lambda name, tensor: group.check_alive(name))
    monkeypatch.setattr(dist, "_default_group", dist._ProcessGroup("nccl", None, group))
    with fl.backend("reference"):
        yield group


def test_in_place_writes_on_an_nccl_group(stand_in_group):
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    held = fl.tensor(np.arange(4, dtype=np.float32))  # memory: written in place
    view = held[1:3]
    dist.all_reduce(held, op=dist.ReduceOp.AVG)
    assert held.tolist() == [0.0, 1.0, 2.0, 3.0] and view.tolist() == [1.0, 2.0]
    assert held.node.op == "buffer"

    lazy = held * 3.0  # no memory: the tensor comes to stand for the collective's result
    dist.all_reduce(lazy)
    assert lazy.node.op == "all_reduce" and lazy.is_realized
    assert lazy.tolist() == [0.0, 3.0, 6.0, 9.0]

    targets = [fl.zeros(4)]
    dist.all_gather(targets, held + 1.0)
    assert targets[0].tolist() == [1.0, 2.0, 3.0, 4.0]
    output = fl.zeros(4)
    work = dist.reduce_scatter(output, [held * 2.0], op=dist.ReduceOp.MAX, async_op=True)
    assert work.wait() and output.tolist() == [0.0, 2.0, 4.0, 6.0]
    dist.broadcast(held, src=0)
    assert held.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match=r"all_gather: tensor_list\[0\] is int32\[4\]"):
        dist.all_gather([fl.zeros(4, dtype=fl.int32)], held)


def test_non_contiguous_tensors_are_read_and_written_through_their_view(stand_in_group):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    held = fl.tensor(values)
    column = held.T[1]  # strided: every fourth element
    dist.all_reduce(column, op=dist.ReduceOp.MAX)
    assert column.tolist() == [1.0, 5.0, 9.0]
    np.testing.assert_array_equal(held.numpy(), values)

    @fl.compile
    def step():
        dist.all_reduce(held.T[1])

    with pytest.raises(fl.TraceError, match="writing through a view of memory"):
        step()


def test_collectives_write_inside_compile(stand_in_group):
    weights = fl.tensor(np.ones(4, np.float32))

    @fl.compile
    def step(a):
        dist.all_reduce(weights, op=dist.ReduceOp.SUM)  # a write into captured memory
        hidden = a * 2.0
        dist.all_reduce(hidden)  # a value of the trace
        return hidden + weights

    x = fl.tensor(np.arange(4, dtype=np.float32))
    for _ in range(3):
        assert step(x).tolist() == [1.0, 3.0, 5.0, 7.0]
        assert weights.tolist() == [1.0] * 4
    assert step.cache_info().traces == 1


def test_nccl_group_refuses_cpu_tensors_and_aborted_groups(stand_in_group, monkeypatch):
    monkeypatch.undo()  # the real checks, on a group with no communicator behind it
    group = stand_in_group
    with fl.backend("reference"):
        cpu = fl.zeros(3)
    with pytest.raises(ValueError, match=r"all_reduce: the nccl backend runs collectives on CUDA"):
        group.all_reduce(cpu, "sum")
    group.aborted = "rank 1 failed: ValueError: boom"
    with pytest.raises(dist.DistributedError, match=r"broadcast: the process group was aborted"):
        group.broadcast(cpu, 0)


# --- the rendezvous, with NCCL stood in ----------------------------------------------------------
@pytest.fixture
def fake_nccl(monkeypatch):
    """NCCL's id and communicators stood in: records what each rank asked for."""
    calls = []

    def create(name, world_size, uid, rank):
        calls.append((name, world_size, uid, rank))

    monkeypatch.setattr(library_nccl, "unique_id", lambda: bytes(range(100, 228)))
    monkeypatch.setattr(library_nccl, "create_communicator", create)
    return calls


def _join_in_threads(port, worlds, timeout=5.0):
    """Rank r joins with world size worlds[r] (None: never joins); returns {rank: group or
    error}."""
    from flame.distributed.store import TCPStore

    results, threads = {}, []

    def join(rank, world):
        store = None
        try:
            store = TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timeout)
            results[rank] = NcclGroup(store, rank, world, timeout)
        except Exception as error:  # noqa: BLE001  reported to the test
            results[rank] = error
        finally:
            time.sleep(0.2)  # rank 0's store serves the others a little longer
            if store is not None:
                store.close()

    for rank, world in enumerate(worlds):
        if world is not None:
            threads.append(threading.Thread(target=join, args=(rank, world)))
            threads[-1].start()
    for thread in threads:
        thread.join(30)
    return results


def test_rendezvous_shares_the_id(fake_nccl):
    results = _join_in_threads(free_port(), [3, 3, 3])
    assert all(isinstance(group, NcclGroup) for group in results.values()), results
    names = {group.name for group in results.values()}
    assert len(names) == 1 and names.pop().startswith("nccl-")
    assert sorted(rank for *_, rank in fake_nccl) == [0, 1, 2]
    assert {uid for _, _, uid, _ in fake_nccl} == {bytes(range(100, 228))}


def test_rendezvous_names_a_mismatched_world_size(fake_nccl):
    results = _join_in_threads(free_port(), [2, 3])
    assert isinstance(results[1], dist.DistributedError)
    assert "rank 0 has world_size 2, this rank (rank 1) has 3" in str(results[1])


def test_rendezvous_names_a_rank_that_never_joins(fake_nccl):
    started = time.monotonic()
    results = _join_in_threads(free_port(), [3, 3, None], timeout=1.0)
    for rank in (0, 1):
        assert isinstance(results[rank], dist.DistributedTimeout), results
        assert "ranks [2] never joined the nccl group within 1s" in str(results[rank])
    assert time.monotonic() - started < 15 and not fake_nccl


def test_the_id_survives_the_trip_as_signed_chars(monkeypatch):
    created = []

    class Communicator:  # as CuPy before 14: the id as a tuple of C chars
        def __init__(self, world_size, uid, rank):
            if isinstance(uid, bytes):
                raise TypeError("Argument 'commId' has incorrect type (expected tuple)")
            created.append((world_size, uid, rank))

        def abort(self):
            created.append("aborted")

    fake = types.SimpleNamespace(
        available=True, get_unique_id=lambda: tuple(range(-128, 0)), NcclCommunicator=Communicator
    )
    monkeypatch.setattr(library_nccl, "_import_nccl", lambda: fake)
    uid = library_nccl.unique_id()
    assert uid == bytes(range(128, 256))
    library_nccl.create_communicator("nccl-test-trip", 2, uid, 1)
    assert created == [(2, tuple(range(-128, 0)), 1)]
    assert library_nccl.communicator("nccl-test-trip") is not None
    library_nccl.abort("nccl-test-trip")
    assert created[-1] == "aborted"
    with pytest.raises(RuntimeError, match=r"all_reduce: its NCCL process group 'nccl-test-trip'"):
        library_nccl.communicator("nccl-test-trip", "all_reduce")


def test_cupy_14_takes_the_id_as_bytes(monkeypatch):
    created = []

    class Communicator:  # CuPy 14: bytes only
        def __init__(self, world_size, uid, rank):
            if not isinstance(uid, bytes):
                raise TypeError("Argument 'commId' has incorrect type (expected bytes)")
            created.append((world_size, uid, rank))

    fake = types.SimpleNamespace(available=True, NcclCommunicator=Communicator)
    monkeypatch.setattr(library_nccl, "_import_nccl", lambda: fake)
    library_nccl.create_communicator("nccl-test-bytes", 2, bytes(range(128, 256)), 0)
    assert created == [(2, bytes(range(128, 256)), 0)]


# --- the GPU of a rank, and what is missing ------------------------------------------------------
@pytest.mark.parametrize(
    "visible, local_rank, expected",
    [(None, 2, "2"), ("4,5,6", 1, "5"), ("GPU-abc,GPU-def", 1, "GPU-def"), ("7", 3, "7")],
)
def test_narrow_visible_devices(visible, local_rank, expected, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test, even if unset
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    library_nccl.narrow_visible_devices(local_rank)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == expected


def test_local_rank_without_a_gpu_is_named(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK 2 has no GPU: CUDA_VISIBLE_DEVICES='0,1'"):
        library_nccl.narrow_visible_devices(2)
    monkeypatch.setenv("LOCAL_RANK", "first")
    with pytest.raises(ValueError, match=r"LOCAL_RANK must be a rank number, got 'first'"):
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:1", rank=0, world_size=1)
    assert not dist.is_initialized()


def test_missing_nccl_names_the_wheel(monkeypatch):
    monkeypatch.setattr(
        library_nccl, "_import_nccl", lambda: types.SimpleNamespace(available=False)
    )
    with pytest.raises(library_nccl.NcclUnavailable, match=r"install the nvidia-nccl-cu1\d"):
        library_nccl.load()
    assert library_nccl.status().startswith("not available (") and "nvidia-nccl" in (
        library_nccl.status()
    )

    def no_cupy():
        raise ImportError("No module named 'cupy'")

    monkeypatch.setattr(library_nccl, "_import_nccl", no_cupy)
    with pytest.raises(library_nccl.NcclUnavailable, match=r"CuPy.*flame\[cuda12\]"):
        library_nccl.load()


def test_is_nccl_available_follows_the_library(monkeypatch):
    assert dist.is_available() and dist.is_gloo_available()
    monkeypatch.setattr(
        library_nccl, "_import_nccl", lambda: types.SimpleNamespace(available=False)
    )
    assert not dist.is_nccl_available()
    monkeypatch.setattr(library_nccl, "_import_nccl", lambda: types.SimpleNamespace(available=True))
    assert dist.is_nccl_available()


def test_flame_info_reports_nccl():
    from flame.tools.cli import _library_rows

    rows = dict(_library_rows())
    assert rows["nccl"] == library_nccl.status() and rows["nccl"]


def test_nccl_without_a_gpu_is_a_clear_error(monkeypatch):
    from flame.runtime.device import gpu_available

    if gpu_available():
        pytest.skip("checks the no-GPU path; this machine has a GPU")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    port = free_port()
    with pytest.raises(RuntimeError, match=r"backend='nccl'.*no usable GPU.*use backend='gloo'"):
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    assert not dist.is_initialized()
    with socket.socket() as again:  # no store was left listening on the port
        again.bind(("127.0.0.1", port))
