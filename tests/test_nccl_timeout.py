"""The nccl backend's bounded host waits (flame/distributed/nccl.py): ``barrier``, the wait
before ``destroy_process_group`` and ``nccl.wait`` poll an event on FLAME's stream with the
group's timeout; past it, or on an error NCCL reports, the communicator is aborted and the
wait raises, naming the wait, the rank and the timeout.

CPU tier: the polling on a fake clock, and an ``NcclGroup`` whose stream and communicator
are stood in (a fake event that never completes, a fake ``NcclCommunicator`` registered
under the group's name). GPU tier: a world of one through NCCL whose stream is held by a
kernel that spins longer than the group's timeout.
"""

from __future__ import annotations

import datetime
import socket
import time
from types import SimpleNamespace

import pytest

import flame as fl
import flame.distributed as dist
from flame.distributed import nccl
from flame.distributed.nccl import NcclGroup, wait_until
from flame.runtime import library_nccl


# --- the polling ---------------------------------------------------------------------------------
class FakeClock:
    def __init__(self):
        self.now, self.pauses = 100.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def test_wait_until_returns_when_done_and_backs_off():
    clock = FakeClock()
    polls = []

    def done():
        polls.append(clock.now)
        return len(polls) == 6

    checks = []
    assert wait_until(done, 5.0, lambda: checks.append(1), clock=clock, sleep=clock.sleep)
    assert len(checks) == len(polls) == 6  # the error check comes before every poll
    assert clock.pauses == [50e-6 * 2**k for k in range(5)]


def test_wait_until_gives_up_at_the_deadline():
    clock = FakeClock()
    assert not wait_until(lambda: False, 0.5, clock=clock, sleep=clock.sleep)
    assert clock.now == pytest.approx(100.5)  # no pause runs past the deadline
    assert max(clock.pauses) == 10e-3  # the longest pause
    assert wait_until(lambda: True, 0.0, clock=clock, sleep=clock.sleep)  # done is done


# --- a group whose stream and communicator are stood in -----------------------------------------
class FakeCommunicator:
    def __init__(self, error: str | None = None):
        self.error, self.aborted, self.checks = error, False, 0

    def check_async_error(self):
        self.checks += 1
        if self.error is not None and self.checks >= 3:
            raise RuntimeError(self.error)  # CuPy raises its NcclError

    def abort(self):
        self.aborted = True


@pytest.fixture
def stuck(monkeypatch):
    """An NcclGroup (rank 3 of 4, timeout 0.2 s) whose stream never finishes: the events
    recorded on it never complete until ``state.finish`` is set."""
    state = SimpleNamespace(finish=False, events=0, barriers=0)

    def recorded():
        state.events += 1
        return lambda: state.finish

    def issue(group):
        state.barriers += 1

    group = NcclGroup.__new__(NcclGroup)
    group.rank, group.world_size, group.timeout, group.aborted = 3, 4, 0.2, None
    group.name = "nccl-fake-stuck"
    state.communicator = FakeCommunicator()
    monkeypatch.setattr(nccl, "queued_work_done", recorded)
    monkeypatch.setattr(nccl, "_issue_barrier", issue)
    monkeypatch.setitem(library_nccl._COMMUNICATORS, group.name, state.communicator)
    state.group = group
    return state


def test_a_barrier_that_never_finishes_times_out_and_aborts(stuck):
    group = stuck.group
    started = time.monotonic()
    with pytest.raises(dist.DistributedTimeout) as raised:
        group.barrier()
    elapsed = time.monotonic() - started
    assert 0.2 <= elapsed < 5.0
    message = str(raised.value)
    assert message.startswith("barrier: rank 3 waited 0.2s (the timeout of init_process_group)")
    assert "NCCL communicator was aborted" in message
    assert stuck.barriers == 1 and stuck.communicator.aborted
    assert group.aborted == message and group.name not in library_nccl._COMMUNICATORS
    # the group is dead: the next collective says why, without waiting
    with pytest.raises(dist.DistributedError, match="all_reduce: the process group was aborted"):
        group.check_alive("all_reduce")
    group.close()  # nothing to wait for or free any more
    assert stuck.events == 1


def test_a_barrier_that_finishes_returns(stuck):
    stuck.finish = True
    stuck.group.barrier()
    assert stuck.barriers == 1 and stuck.events == 1
    assert not stuck.communicator.aborted and stuck.group.aborted is None


def test_an_error_nccl_reports_aborts_before_the_timeout(stuck):
    stuck.communicator.error = "NCCL error: remote process exited or there was a network error"
    stuck.group.timeout = 60.0
    started = time.monotonic()
    with pytest.raises(dist.DistributedError) as raised:
        stuck.group.wait("the all_reduce of the losses")
    assert time.monotonic() - started < 5.0
    assert not isinstance(raised.value, dist.DistributedTimeout)
    assert str(raised.value).startswith(
        "the all_reduce of the losses: rank 3: NCCL reported an error (NCCL error: remote "
        "process exited"
    )
    assert stuck.communicator.aborted and stuck.communicator.checks == 3


def test_destroy_waits_with_the_timeout_too(stuck):
    with pytest.raises(dist.DistributedTimeout, match=r"^destroy_process_group: rank 3 waited"):
        stuck.group.close()
    assert stuck.communicator.aborted


def test_the_public_calls_use_the_bounded_wait(stuck, monkeypatch):
    monkeypatch.setattr(dist, "_default_group", dist._ProcessGroup("nccl", None, stuck.group))
    with pytest.raises(dist.DistributedTimeout, match=r"^before reading: rank 3 waited 0.2s"):
        nccl.wait("before reading")
    with pytest.raises(dist.DistributedError, match="barrier: the process group was aborted"):
        dist.barrier()


def test_wait_on_another_backend_returns_at_once(monkeypatch):
    other = SimpleNamespace(rank=0, world_size=2)
    monkeypatch.setattr(dist, "_default_group", dist._ProcessGroup("gloo", None, other))
    nccl.wait("anything")


def test_the_group_timeout_comes_from_init_process_group(monkeypatch):
    made = {}

    class Recorded:
        def __init__(self, store, rank, world_size, timeout):
            made.update(rank=rank, world_size=world_size, timeout=timeout)

        def close(self):
            pass

    monkeypatch.setattr(dist, "NcclGroup", Recorded)
    monkeypatch.setattr(dist, "prepare_device", lambda rank: 0)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=7.5),
    )  # fmt: skip
    try:
        assert made == {"rank": 0, "world_size": 1, "timeout": 7.5}
    finally:
        dist.destroy_process_group()


# --- on the GPU: a world of one whose stream is held by a spinning kernel ------------------------
SPIN = r"""
extern "C" __global__ void spin(unsigned long long nanoseconds) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < nanoseconds);
}
"""


@pytest.mark.gpu
def test_a_world_of_one_times_out_behind_a_stuck_stream(monkeypatch):
    try:
        library_nccl.load()
    except library_nccl.NcclUnavailable as error:
        pytest.skip(f"NCCL is not available: {error}")
    import cupy

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=1),
    )  # fmt: skip
    try:
        dist.barrier()  # nothing holds the stream: done at once
        kernel = cupy.RawKernel(SPIN, "spin")
        kernel((1,), (1,), (cupy.uint64(4_000_000_000),))  # 4 s on FLAME's stream
        started = time.monotonic()
        with pytest.raises(dist.DistributedTimeout, match=r"^barrier: rank 0 waited 1s"):
            dist.barrier()
        # the deadline; ncclCommAbort may then wait for the device (its cudaFree), so the
        # raise can come as late as the spinning kernel's end, never later
        elapsed = time.monotonic() - started
        print(f"the barrier raised after {elapsed:.2f} s")
        assert 1.0 <= elapsed < 8.0
    finally:
        dist.destroy_process_group()
        cupy.cuda.get_current_stream().synchronize()
    with fl.backend("cuda"):  # the aborted communicator left the device usable
        assert (fl.ones(4) * 2.0).tolist() == [2.0] * 4
