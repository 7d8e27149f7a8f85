"""The ``nccl`` backend: one NCCL communicator per process group, collectives as IR nodes.

Joining (``init_process_group("nccl")``):

1. the rank's GPU: LOCAL_RANK (else ``rank % device count``). Where CUDA has not started yet in
   this process, CUDA_VISIBLE_DEVICES is narrowed to that GPU, so it is device 0 for every
   thread (FLAME's background threads too); otherwise the calling thread's device is set;
2. rank 0 makes NCCL's unique id and publishes it in the store with its world size; every
   rank publishes that it joined, and waits (with the group's timeout) for every other rank
   before ``ncclCommInitRank``, which would otherwise wait for a missing rank forever: a
   rank that never joins is named, as are mismatched world sizes;
3. the communicator is registered (flame/runtime/library_nccl.py) under the group's name,
   derived from the id, the same on every rank.

Collectives build one node each (flame/distributed/functional.py) whose launch calls NCCL on
FLAME's stream. Outside ``flame.compile`` the call queues the collective at once, after the
kernels that compute its input (no host wait), so every rank issues its collectives in the
order of its calls, as NCCL needs; the result is written into the tensor with ``copy_``. Inside
``flame.compile`` the collective and the write are part of the program.

NCCL has no timeout of its own: a rank that stops calling collectives leaves the others'
collectives spinning on their GPUs, and a host wait for them (``cudaStreamSynchronize``)
never returns. The host waits this backend makes itself (``barrier``, the wait before
``destroy_process_group``, and ``wait`` below, for a script about to read a collective's
result) poll an event recorded on FLAME's stream instead, with the group's timeout
(``init_process_group(timeout=...)``) as their deadline, and ask NCCL for asynchronous errors
(a peer's connection lost) at every poll. Past the deadline, or on such an error, the
communicator is aborted (``ncclCommAbort`` ends the collectives stuck on the GPU) and the
wait raises ``DistributedTimeout`` (``DistributedError``) naming the wait, the rank and the
timeout. The collectives themselves are only queued, never waited for, and a host read of a
result (``.numpy()``) outside these waits still blocks without a bound. ``flame run`` stops
every rank when one fails.
"""

from __future__ import annotations

import os
import time

from flame.distributed import functional
from flame.distributed.store import DistributedError, DistributedTimeout, TCPStore
from flame.ir.views import MOVEMENT_OPS
from flame.runtime import library_nccl  # registers the collectives' launches
from flame.tensor import Tensor

_ID_KEY = "nccl/id"
_VIEW_OPS = (*MOVEMENT_OPS, "detach")
# a bounded wait polls its event after 50 us, then twice as long each time, at most every
# 10 ms: short collectives are seen at once, and a long wait costs the host little
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 50e-6, 10e-3


def wait_until(done, timeout: float, check=None, clock=time.monotonic, sleep=time.sleep) -> bool:
    """Poll ``done()`` until it is true (returns True) or ``timeout`` seconds have passed
    (returns False), calling ``check()`` (which may raise) before every poll."""
    deadline = clock() + timeout
    pause = _FIRST_PAUSE_S
    while True:
        if check is not None:
            check()
        if done():
            return True
        left = deadline - clock()
        if left <= 0:
            return False
        sleep(min(pause, left))
        pause = min(2 * pause, _LONGEST_PAUSE_S)


def queued_work_done():
    """A function telling whether the work queued on FLAME's stream until now is done (an
    event recorded on the stream; its query never blocks)."""
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record(cupy.cuda.get_current_stream())
    return lambda: event.done


def _local_rank() -> int | None:
    text = os.environ.get("LOCAL_RANK", "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise ValueError(f"init_process_group: LOCAL_RANK must be a rank number, got {text!r}")
    return int(text)


def select_local_device() -> None:
    """Where CUDA has not started in this process and LOCAL_RANK is set, narrow
    CUDA_VISIBLE_DEVICES to that GPU (device 0 for every thread). A script that must ask
    whether there is a GPU before ``init_process_group("nccl")`` (which starts CUDA) calls
    this first, so that the question does not fix the device set."""
    local_rank = _local_rank()
    if local_rank is not None and not library_nccl.cuda_initialized():
        library_nccl.narrow_visible_devices(local_rank)


def prepare_device(rank: int) -> int:
    """Choose and select the rank's GPU, before any store or socket is made; the errors say
    what is missing (a GPU, the NCCL wheel). Returns the device's index in this process."""
    from flame.runtime.device import gpu_available, gpu_unavailable_reason

    select_local_device()
    local_rank = _local_rank()
    if not gpu_available():
        raise RuntimeError(
            f"init_process_group(backend='nccl'): rank {rank} finds no usable GPU "
            f"({gpu_unavailable_reason()}); NCCL runs collectives on CUDA tensors, use "
            "backend='gloo' to run on the CPU"
        )
    try:
        library_nccl.load()
    except library_nccl.NcclUnavailable as error:
        raise RuntimeError(f"init_process_group(backend='nccl'): {error}") from None
    return library_nccl.use_device(rank, local_rank)


class NcclGroup:
    """One rank's membership of an NCCL communicator."""

    def __init__(self, store: TCPStore, rank: int, world_size: int, timeout: float):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.aborted: str | None = None
        uid = self._rendezvous(store)
        self.name = library_nccl.group_name(uid)
        library_nccl.create_communicator(self.name, world_size, uid, rank)

    def _rendezvous(self, store: TCPStore) -> bytes:
        deadline = time.monotonic() + self.timeout
        if self.rank == 0:
            store.set(_ID_KEY, f"{self.world_size}:".encode() + library_nccl.unique_id())
        store.set(f"nccl/joined/{self.rank}", str(self.world_size))
        try:
            published = store.get(_ID_KEY, timeout=max(deadline - time.monotonic(), 0.0))
        except DistributedTimeout as error:
            raise DistributedTimeout(f"rank 0 never published NCCL's id: {error}") from None
        world_text, _, uid = published.partition(b":")
        self._check_world("rank 0", int(world_text))
        missing = []
        for peer in range(self.world_size):
            left = max(deadline - time.monotonic(), 0.0) if not missing else 0.0
            try:
                joined = store.get(f"nccl/joined/{peer}", timeout=left)
            except DistributedTimeout:
                missing.append(peer)
                continue
            self._check_world(f"rank {peer}", int(joined))
        if missing:
            raise DistributedTimeout(
                f"rank {self.rank}: ranks {missing} never joined the nccl group within "
                f"{self.timeout:g}s"
            )
        return uid

    def _check_world(self, who: str, world_size: int) -> None:
        if world_size != self.world_size:
            raise DistributedError(
                f"{who} has world_size {world_size}, this rank (rank {self.rank}) has "
                f"{self.world_size}: every rank must be given the same WORLD_SIZE"
            )

    # --- life ----------------------------------------------------------------------------------
    def check_alive(self, name: str) -> None:
        if self.aborted is not None:
            raise DistributedError(f"{name}: the process group was aborted: {self.aborted}")

    def close(self) -> None:
        """Wait (bounded) for the queued collectives, then free the communicator."""
        if self.aborted is None:
            self.wait("destroy_process_group")
        library_nccl.destroy(self.name)

    def abort(self, message: str) -> None:
        """Free the communicator at once (ncclCommAbort); this rank's later collectives fail
        with ``message``. The other ranks are stopped by the launcher, not through NCCL."""
        if self.aborted is None:
            self.aborted = message
            library_nccl.abort(self.name)

    def barrier(self) -> None:
        """An all-reduce of one number queued on FLAME's stream, then a bounded wait for it
        (as PyTorch's NCCL barrier: every rank's earlier work is queued, this rank's done)."""
        self.check_alive("barrier")
        _issue_barrier(self)
        self.wait("barrier")

    def wait(self, what: str) -> None:
        """Block the host until the work queued on FLAME's stream so far (this group's
        collectives included) is done, for at most the group's timeout. Past it, or when NCCL
        reports an asynchronous error, abort the communicator and raise (naming ``what``)."""
        self.check_alive(what)
        communicator = library_nccl.communicator(self.name, what)
        check_error = getattr(communicator, "check_async_error", None)  # NCCL >= 2.4

        def check() -> None:
            try:
                check_error()
            except Exception as error:  # noqa: BLE001  CuPy's NcclError, whatever its module
                message = (
                    f"{what}: rank {self.rank}: NCCL reported an error ({error}); a peer may "
                    "have failed or left. The communicator was aborted"
                )
                self.abort(message)
                raise DistributedError(message) from None

        done = queued_work_done()
        if wait_until(done, self.timeout, check if check_error is not None else None):
            return
        message = (
            f"{what}: rank {self.rank} waited {self.timeout:g}s (the timeout of "
            "init_process_group) for the collectives queued on its GPU: a peer did not reach "
            "the same collective (it stopped, failed, or calls collectives in another order). "
            "The NCCL communicator was aborted"
        )
        self.abort(message)
        raise DistributedTimeout(message)

    # --- collectives on tensors (in place, as PyTorch's) --------------------------------------
    def _check(self, name: str, tensor: Tensor) -> None:
        self.check_alive(name)
        if tensor.backend != "cuda":
            raise ValueError(
                f"{name}: the nccl backend runs collectives on CUDA tensors, got "
                f"{tensor.dtype.name}{list(tensor.shape)} on the {tensor.backend} backend; move "
                "it with .cuda(), or use backend='gloo' for CPU tensors"
            )

    def _group(self) -> dict:
        return {"world_size": self.world_size, "group_name": self.name}

    def all_reduce(self, tensor: Tensor, op: str) -> None:
        self._check("all_reduce", tensor)
        _write(tensor, functional.all_reduce(tensor, op, **self._group()))

    def broadcast(self, tensor: Tensor, src: int) -> None:
        self._check("broadcast", tensor)
        _write(tensor, functional.broadcast(tensor, src, **self._group()))

    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> None:
        for item in (tensor, *tensor_list):
            self._check("all_gather", item)
        gathered = _issued(functional.all_gather(tensor, **self._group()))
        for index, target in enumerate(tensor_list):
            target.copy_(gathered[index])

    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: str) -> None:
        self._check("reduce_scatter", output)
        for item in input_list:
            self._check("reduce_scatter", item)
        from flame.joining import stack

        stacked = stack(list(input_list), dim=0)
        _write(output, functional.reduce_scatter(stacked, op, **self._group()))


def _issue_barrier(group: NcclGroup) -> None:
    """Queue the barrier's all-reduce of one int32 on FLAME's stream (no host wait)."""
    from flame.backend import backend
    from flame.creation import zeros
    from flame.ir.dtypes import int32

    with backend("cuda"):
        flag = zeros(1, dtype=int32)
    _issued(functional.all_reduce(flag, "sum", **group._group()))


def wait(what: str = "wait") -> None:
    """A bounded wait (``NcclGroup.wait``) for the collectives queued on the default group,
    an nccl one; call it before reading a collective's result on the host, so that a peer
    that never joins the collective ends in ``DistributedTimeout`` instead of a hang. Other
    backends have nothing queued: it returns at once."""
    from flame.distributed import _default

    group = _default().group
    if isinstance(group, NcclGroup):
        group.wait(what)


def _issued(result: Tensor) -> Tensor:
    """Outside ``flame.compile``, queue the collective now (its inputs' kernels first, no host
    wait), so every rank issues collectives in the order of its calls."""
    from flame.compile import current_trace

    if current_trace() is None:
        result.realize()
    return result


def _write(target: Tensor, result: Tensor) -> None:
    """``target.copy_(result)``, with the collective queued at the call outside
    ``flame.compile``. A lazy target (a value with no memory, not a leaf) comes to stand for
    the collective's result itself, as ``copy_`` would make it, without copy_'s extra node."""
    from flame.compile import current_trace

    node = target.node
    if current_trace() is not None:
        target.copy_(result)
        return
    lazy = node.buffer is None and node.op not in ("buffer", *_VIEW_OPS)
    if lazy and node.grad_info is None:
        target.node = _issued(result).node
        return
    target.copy_(_issued(result))
