"""flame.distributed on the CPU: worlds of 2 and 3 processes on the gloo backend.

Each rank is this file run as a script (``python test_distributed_cpu.py SCENARIO``) with
RANK WORLD_SIZE MASTER_ADDR MASTER_PORT and FLAME_BACKEND=reference in its environment; the
scenario asserts its own results and exits 0. MASTER_PORT comes from binding port 0, so tests
run in parallel; every wait has a timeout (the group's, and the harness kills a world after
30 s), so a hang fails the test instead of CI.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

WORLD_DEADLINE_S = 30.0


# --- the harness ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_world(scenario: str, world_size: int, tmp_path: Path, ranks=None, group_timeout=10.0):
    """Run ``scenario`` on ``ranks`` (all of them by default) of a world of ``world_size``;
    returns {rank: (returncode, output)}. A new port and a second try where another process
    took the port between our probe and rank 0's bind."""
    for _ in range(3):
        results = _run_world_once(scenario, world_size, tmp_path, ranks, group_timeout)
        if not any("is the port in use" in output for _, output in results.values()):
            return results
    return results


def _run_world_once(scenario, world_size, tmp_path, ranks, group_timeout):
    port = free_port()
    processes = {}
    for rank in range(world_size) if ranks is None else ranks:
        environment = dict(os.environ, FLAME_BACKEND="reference", RANK=str(rank))
        environment.update(WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
        environment.update(MASTER_PORT=str(port), FLAME_TEST_TIMEOUT=str(group_timeout))
        environment.update(FLAME_TEST_DIR=str(tmp_path))
        processes[rank] = subprocess.Popen(
            [sys.executable, __file__, scenario],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + WORLD_DEADLINE_S
    results = {}
    try:
        for rank, process in processes.items():
            output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results[rank] = (process.returncode, output)
    except subprocess.TimeoutExpired:
        for process in processes.values():
            process.kill()
        outputs = {rank: process.communicate()[0] for rank, process in processes.items()}
        pytest.fail(f"{scenario}: the world hung past {WORLD_DEADLINE_S}s; outputs: {outputs}")
    return results


def assert_all_passed(results) -> None:
    failed = {rank: output for rank, (code, output) in results.items() if code != 0}
    assert not failed, f"ranks failed: {failed}"


# --- scenarios (run inside each rank) ---------------------------------------------------------
def join():
    import flame.distributed as dist

    timeout = datetime.timedelta(seconds=float(os.environ["FLAME_TEST_TIMEOUT"]))
    dist.init_process_group("gloo", timeout=timeout)
    return dist


def scenario_collectives():
    import flame as fl

    dist = join()
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.is_initialized() and rank == int(os.environ["RANK"])
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    scales = np.arange(1, world + 1, dtype=np.float32)

    for op, expected in [
        (dist.ReduceOp.SUM, base * scales.sum()),
        (dist.ReduceOp.AVG, base * scales.mean()),
        (dist.ReduceOp.MAX, base * world),
        (dist.ReduceOp.MIN, base * 1),
    ]:
        tensor = fl.tensor(base) * float(rank + 1)  # lazy: the collective realizes it
        dist.all_reduce(tensor, op=op)
        np.testing.assert_allclose(tensor.numpy(), expected, rtol=1e-6, err_msg=str(op))

    counts = fl.tensor(np.full(4, rank + 1, dtype=np.int32))
    dist.all_reduce(counts)
    assert counts.dtype == fl.int32 and counts.tolist() == [world * (world + 1) // 2] * 4

    # a large array (several socket buffers' worth) and bfloat16
    large = fl.tensor(np.full(1 << 20, rank, dtype=np.float32))
    dist.all_reduce(large)
    assert float(large.numpy().min()) == float(large.numpy().max()) == world * (world - 1) / 2
    halves = fl.tensor(np.full(8, 0.5, dtype=np.float32)).to(fl.bfloat16)
    dist.all_reduce(halves)
    assert halves.dtype == fl.bfloat16 and halves.to(fl.float32).tolist() == [0.5 * world] * 8

    shared = fl.tensor(np.full((3,), 100.0 + rank, dtype=np.float32))
    dist.broadcast(shared, src=1)
    assert shared.tolist() == [101.0] * 3

    gathered = [fl.tensor(np.zeros((2,), np.float32)) for _ in range(world)]
    dist.all_gather(gathered, fl.tensor(np.array([rank, -rank], np.float32)))
    assert [item.tolist() for item in gathered] == [[peer, -peer] for peer in range(world)]

    inputs = [fl.tensor(np.full((2,), 10.0 * rank + index, np.float32)) for index in range(world)]
    output = fl.tensor(np.zeros((2,), np.float32))
    dist.reduce_scatter(output, inputs, op=dist.ReduceOp.SUM)
    assert output.tolist() == [sum(10.0 * peer + rank for peer in range(world))] * 2

    # barrier: after it, every rank's file before it exists
    marks = Path(os.environ["FLAME_TEST_DIR"])
    (marks / f"before-barrier-{rank}").write_text("here")
    dist.barrier()
    assert all((marks / f"before-barrier-{peer}").exists() for peer in range(world))

    dist.destroy_process_group()
    assert not dist.is_initialized()


def scenario_one_raises():
    import flame as fl

    dist = join()
    with dist.abort_on_error():
        if dist.get_rank() == 1:
            raise ValueError("boom from rank 1")
        dist.all_reduce(fl.tensor(np.ones(3, np.float32)))


def scenario_one_exits():
    import flame as fl

    dist = join()
    if dist.get_rank() == 2:
        os._exit(3)  # no error sent: the others see its connection close
    dist.all_reduce(fl.tensor(np.ones(3, np.float32)))


def scenario_shapes_differ():
    import flame as fl

    dist = join()
    dist.all_reduce(fl.tensor(np.ones(3 + dist.get_rank(), np.float32)))


# --- the tests ------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives(world_size, tmp_path):
    assert_all_passed(run_world("collectives", world_size, tmp_path))


def test_a_rank_that_raises_stops_the_others_with_its_message(tmp_path):
    results = run_world("one_raises", 3, tmp_path)
    for rank, (code, output) in results.items():
        assert code != 0, f"rank {rank} passed: {output}"
        message = "ValueError: boom from rank 1" if rank == 1 else "rank 1 failed: ValueError"
        assert message in output, output


def test_a_rank_that_exits_is_named(tmp_path):
    results = run_world("one_exits", 3, tmp_path)
    assert results[2][0] == 3
    for rank in (0, 1):
        code, output = results[rank]
        assert code != 0 and "rank 2 closed its connection" in output, output


def test_a_rank_that_never_joins_is_named(tmp_path):
    results = run_world("collectives", 3, tmp_path, ranks=[0, 1], group_timeout=2.0)
    for rank, (code, output) in results.items():
        assert code != 0, f"rank {rank} passed: {output}"
        assert "ranks [2] did not connect within 2s" in output, output


def test_different_shapes_fail_naming_both(tmp_path):
    results = run_world("shapes_differ", 2, tmp_path)
    for rank, (code, output) in results.items():
        assert code != 0, f"rank {rank} passed: {output}"
        assert "ranks disagree" in output and "float32[3]" in output, output
        assert "float32[4]" in output, output


# --- the store and bad input, in this process --------------------------------------------------
def test_store_set_get_add():
    from flame.distributed import TCPStore

    store = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=5.0)
    try:
        store.set("name", "value")
        assert store.get("name") == b"value"
        assert store.add("count", 2) == 2 and store.add("count", 3) == 5
        store.wait(["name", "count"], timeout=1.0)
    finally:
        store.close()


def test_store_key_never_set_times_out_naming_key_and_address():
    from flame.distributed import DistributedTimeout, TCPStore

    store = TCPStore("127.0.0.1", free_port(), is_master=True, timeout=5.0)
    try:
        started = time.monotonic()
        with pytest.raises(DistributedTimeout, match=r"127\.0\.0\.1:\d+: key 'missing' was not"):
            store.get("missing", timeout=0.3)
        assert time.monotonic() - started < 5
    finally:
        store.close()


def test_store_that_never_answers_times_out_naming_the_address():
    import flame.distributed as dist

    with socket.socket() as silent:  # accepts connections (backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(dist.DistributedTimeout, match=rf"127\.0\.0\.1:{port} did not answer"):
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=1,
                world_size=2,
                timeout=datetime.timedelta(seconds=0.5),
            )
        assert time.monotonic() - started < 10
    assert not dist.is_initialized()


def test_no_store_at_the_address_times_out_naming_it():
    from flame.distributed import DistributedTimeout, TCPStore

    port = free_port()  # closed again: nothing listens there
    with pytest.raises(
        DistributedTimeout, match=rf"could not reach the store at 127\.0\.0\.1:{port}"
    ):
        TCPStore("127.0.0.1", port, is_master=False, timeout=0.5)


def test_port_in_use_is_a_clear_error():
    from flame.distributed import DistributedError, TCPStore

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(DistributedError, match="is the port in use"):
            TCPStore("127.0.0.1", port, is_master=True, timeout=0.5)


def test_bad_calls_before_and_at_init(monkeypatch):
    import flame.distributed as dist

    with pytest.raises(ValueError, match="unknown backend 'mpi'"):
        dist.init_process_group("mpi", rank=0, world_size=1)
    with pytest.raises(RuntimeError, match="has not been initialized"):
        dist.get_rank()
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="environment variable RANK is not set"):
        dist.init_process_group("gloo")
    assert not dist.is_initialized()


def test_world_of_one_in_process():
    import flame as fl
    import flame.distributed as dist

    with fl.backend("reference"):
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=5),
        )
        try:
            tensor = fl.tensor(np.array([1.0, 2.0], np.float32))
            dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
            dist.barrier()
            assert tensor.tolist() == [1.0, 2.0] and dist.get_world_size() == 1
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"]()
