"""flame.distributed's nccl backend on the GPU (the CPU tier is test_distributed_nccl.py).

A world of one through NCCL in this process: every collective on CUDA tensors against the
values it must give, queued in order with the kernels around it, in place, inside
``flame.compile`` (with and without ``cuda_graph``), and the error of a program that outlives
its group. A world of two (one process per GPU, each this file run as
``python tests/test_distributed_nccl_gpu.py two_ranks``) where two GPUs are visible. Every
test skips with the reason where there is no GPU or no NCCL.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import flame as fl
import flame.distributed as dist
from flame.distributed import functional
from flame.runtime import library_nccl


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _require_nccl():
    try:
        library_nccl.load()
    except library_nccl.NcclUnavailable as error:
        pytest.skip(f"NCCL is not available: {error}")


def _count_calls(monkeypatch, op: str) -> list:
    from flame.runtime import library

    calls = []
    original = library.IMPLEMENTATIONS[op]

    def counted(node, arrays):
        calls.append(node.attr("group"))
        return original(node, arrays)

    monkeypatch.setitem(library.IMPLEMENTATIONS, op, counted)
    return calls


@pytest.mark.gpu
def test_world_of_one_through_nccl(monkeypatch, rng):
    _require_nccl()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    calls = _count_calls(monkeypatch, "all_reduce")
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    try:
        with fl.backend("cuda"):
            _world_of_one_checks(rng, calls)
            _compiled_checks(rng, calls)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _world_of_one_checks(rng, calls):
    values = rng.standard_normal((8, 16)).astype(np.float32)
    for dtype in (fl.float32, fl.bfloat16, fl.int32, fl.float64):
        for op in dist.ReduceOp:
            x = fl.tensor(values * 10).to(dtype)
            expected = (x * 2 + 1).numpy()  # the same kernels without the collective
            lazy = x * 2  # its kernel runs before the collective, in one queue
            dist.all_reduce(lazy, op=op)
            assert lazy.node.op == "all_reduce" and lazy.is_realized
            after = (lazy + 1).numpy()  # and the next kernel after it
            np.testing.assert_array_equal(after, expected, err_msg=f"{dtype} {op}")
    held = fl.tensor(values).realize()
    before = len(calls)
    dist.all_reduce(held.T[2:5], op=dist.ReduceOp.SUM)  # a strided view, written in place
    np.testing.assert_array_equal(held.numpy(), values)
    assert len(calls) == before + 1  # one collective per call
    shared = fl.tensor(values)
    dist.broadcast(shared, src=0)
    gathered = [fl.zeros((8, 16))]
    dist.all_gather(gathered, shared.exp())
    np.testing.assert_allclose(gathered[0].numpy(), np.exp(values), rtol=1e-6)
    output = fl.zeros((8, 16))
    dist.reduce_scatter(output, [shared * 3.0], op=dist.ReduceOp.AVG)
    np.testing.assert_allclose(output.numpy(), values * 3, rtol=1e-6)


def _compiled_checks(rng, calls):
    weights = fl.tensor(rng.standard_normal(32).astype(np.float32)).realize()
    start = weights.numpy().copy()

    def step(a):
        dist.all_reduce(weights, op=dist.ReduceOp.AVG)
        hidden = a.exp()
        dist.all_reduce(hidden)
        return hidden * weights

    for cuda_graph in (False, True):
        compiled = fl.compile(step, cuda_graph=cuda_graph)
        before = len(calls)
        for index in range(3):
            a = fl.tensor(np.full(32, 0.1 * index, np.float32))
            got = compiled(a).numpy()
            np.testing.assert_allclose(got, np.exp(0.1 * index) * start, rtol=1e-5)
        np.testing.assert_array_equal(weights.numpy(), start)
        info = compiled.cache_info()
        assert info.traces == 1
        if info.graph_replays == 0:  # step by step: two collectives per call
            assert len(calls) - before == 6, calls
        print(f"cuda_graph={cuda_graph}: {info}")


@pytest.mark.gpu
def test_a_destroyed_group_is_named_by_its_program(monkeypatch):
    _require_nccl()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
    )  # fmt: skip
    with fl.backend("cuda"):
        total = functional.all_reduce(fl.ones(4) * 2.0)  # lazy, past the group's end
        dist.destroy_process_group()
        with pytest.raises(RuntimeError, match=r"its NCCL process group 'nccl-\w+' does not"):
            total.numpy()


WORLD_DEADLINE_S = 120.0


def _gpu_count() -> int:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        return 0


@pytest.mark.gpu
@pytest.mark.slow
def test_two_ranks_on_two_gpus(tmp_path):
    _require_nccl()
    if _gpu_count() < 2:
        pytest.skip(f"needs 2 GPUs (one per rank), {_gpu_count()} visible")
    port, processes = free_port(), {}
    for rank in range(2):
        environment = dict(os.environ, FLAME_BACKEND="cuda", RANK=str(rank), WORLD_SIZE="2")
        environment.update(LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        environment.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
        environment["FLAME_CACHE_DIR"] = str(tmp_path / f"cache{rank}")
        processes[rank] = subprocess.Popen(
            [sys.executable, __file__, "two_ranks"], env=environment,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    deadline, outputs = time.monotonic() + WORLD_DEADLINE_S, {}
    try:
        for rank, process in processes.items():
            outputs[rank] = process.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
    except subprocess.TimeoutExpired:
        for process in processes.values():
            process.kill()
        outputs = {rank: process.communicate()[0] for rank, process in processes.items()}
        pytest.fail(f"the world hung past {WORLD_DEADLINE_S}s; outputs: {outputs}")
    for rank, process in processes.items():
        assert process.returncode == 0, f"rank {rank}: {outputs[rank]}"
        print(outputs[rank])  # the devices and the compiled programs' cache_info, with -s


def _averaging_step(rank: int):
    weights = fl.tensor(np.full(16, float(rank), np.float32)).realize()

    def step(a):
        dist.all_reduce(weights, op=dist.ReduceOp.AVG)  # in place, every call
        return a * weights

    return step


def scenario_two_ranks():
    """Run by each rank of test_two_ranks_on_two_gpus."""
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    import cupy

    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(f"rank {rank}: device {cupy.cuda.runtime.getDevice()}, visible {devices}")
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    scales = np.arange(1, world + 1, dtype=np.float32)
    for op, expected in [
        (dist.ReduceOp.SUM, base * scales.sum()), (dist.ReduceOp.AVG, base * scales.mean()),
        (dist.ReduceOp.MAX, base * world), (dist.ReduceOp.MIN, base),
        (dist.ReduceOp.PRODUCT, base**world * np.prod(scales)),
    ]:  # fmt: skip
        tensor = fl.tensor(base) * float(rank + 1)
        dist.all_reduce(tensor, op=op)
        np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-6, err_msg=str(op))
    halves = fl.tensor(np.full(8, 0.5, np.float32)).to(fl.bfloat16)
    dist.all_reduce(halves)
    assert halves.to(fl.float32).tolist() == [0.5 * world] * 8
    shared = fl.tensor(np.full(3, 100.0 + rank, np.float32))
    dist.broadcast(shared, src=1)
    assert shared.tolist() == [101.0] * 3
    gathered = [fl.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, fl.tensor(np.array([rank, -rank], np.float32)))
    assert [item.tolist() for item in gathered] == [[peer, -peer] for peer in range(world)]
    inputs = [fl.tensor(np.full(2, 10.0 * rank + index, np.float32)) for index in range(world)]
    output = fl.zeros(2)
    dist.reduce_scatter(output, inputs)
    assert output.tolist() == [sum(10.0 * peer + rank for peer in range(world))] * 2
    for cuda_graph in (False, True):  # True: captured where the executor lists collectives
        compiled = fl.compile(_averaging_step(rank), cuda_graph=cuda_graph)
        for _ in range(3):
            result = compiled(fl.ones(16))
            assert result.tolist() == [(world - 1) / 2] * 16, result.tolist()
        print(f"rank {rank}, cuda_graph={cuda_graph}: {compiled.cache_info()}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"]()
