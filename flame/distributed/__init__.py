"""``flame.distributed``: processes that train together, with PyTorch's names.

    import flame.distributed as dist
    dist.init_process_group("nccl")          # RANK WORLD_SIZE [LOCAL_RANK] MASTER_ADDR MASTER_PORT
    dist.all_reduce(grad, op=dist.ReduceOp.AVG)   # in place, as PyTorch

The rendezvous is a TCP store served by rank 0 (``store.py``). Two backends:

* ``nccl`` (``nccl.py``): CUDA tensors; every collective is an IR node (a library op, like a
  cuBLAS product) whose launch calls NCCL on FLAME's stream, ordered with the kernels around
  it without a host wait; it sits in plans and ``flame.compile`` programs (CUDA graphs: see
  flame/runtime/library_nccl.py). ``functional.py`` has the same collectives as lazy values;
* ``gloo`` (``gloo.py``): the CPU backend: sockets between ranks, collectives on the tensors'
  values (realized, exchanged as bytes, written back with an in-place ``copy_``), on any FLAME
  backend. It runs the same API on machines without a GPU, for tests.

``async_op=True`` returns a ``Work`` whose ``wait()`` has nothing to wait for: gloo's
collectives are done when the call returns, NCCL's are ordered on FLAME's stream.

Like PyTorch, the one piece of process-wide state is the default process group, set by
``init_process_group`` and cleared by ``destroy_process_group``.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import os
from urllib.parse import urlparse

import numpy as np

from flame.distributed.gloo import GlooGroup
from flame.distributed.nccl import NcclGroup, prepare_device
from flame.distributed.store import DistributedError, DistributedTimeout, TCPStore
from flame.tensor import Tensor

__all__ = [
    "DistributedError",
    "DistributedTimeout",
    "ReduceOp",
    "TCPStore",
    "Work",
    "abort",
    "abort_on_error",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "destroy_process_group",
    "get_backend",
    "get_rank",
    "get_world_size",
    "init_process_group",
    "is_available",
    "is_gloo_available",
    "is_initialized",
    "is_nccl_available",
    "reduce_scatter",
]

# PyTorch's default for the gloo backend
default_pg_timeout = datetime.timedelta(minutes=30)


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MAX = "max"
    MIN = "min"


class Work:
    """What a collective called with ``async_op=True`` returns (PyTorch's ``Work``)."""

    def wait(self, timeout=None) -> bool:
        return True  # gloo: done at the call; nccl: later kernels are queued after it

    def is_success(self) -> bool:
        return True


class _ProcessGroup:
    def __init__(self, backend: str, store: TCPStore, group: GlooGroup | NcclGroup):
        self.backend, self.store, self.group = backend, store, group


_default_group: _ProcessGroup | None = None


def _environment(name: str) -> str:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(
            f"init_process_group: environment variable {name} is not set (set RANK, WORLD_SIZE, "
            "MASTER_ADDR and MASTER_PORT, or pass rank, world_size and init_method)"
        )
    return value


def _master_address(init_method: str | None) -> tuple[str, int]:
    if init_method is None or init_method == "env://":
        return _environment("MASTER_ADDR"), int(_environment("MASTER_PORT"))
    parsed = urlparse(init_method)
    if parsed.scheme != "tcp" or parsed.hostname is None or parsed.port is None:
        raise ValueError(
            f"init_process_group: init_method {init_method!r} is not supported; use 'env://' "
            "or 'tcp://host:port'"
        )
    return parsed.hostname, parsed.port


def init_process_group(
    backend: str = "gloo",
    init_method: str | None = None,
    timeout: datetime.timedelta = default_pg_timeout,
    world_size: int | None = None,
    rank: int | None = None,
) -> None:
    """Join the default process group: meet the other ranks at rank 0's store and connect."""
    global _default_group
    if _default_group is not None:
        raise RuntimeError("trying to initialize the default process group twice")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"init_process_group: unknown backend {backend!r}; use 'nccl' or 'gloo'")
    rank = int(_environment("RANK")) if rank is None else int(rank)
    world_size = int(_environment("WORLD_SIZE")) if world_size is None else int(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"init_process_group: rank {rank} is outside world_size {world_size}")
    seconds = timeout.total_seconds()
    host, port = _master_address(init_method)
    if backend == "nccl":
        prepare_device(rank)  # a missing GPU or NCCL fails here, before any socket
    store = TCPStore(host, port, is_master=rank == 0, timeout=seconds)
    try:
        make_group = NcclGroup if backend == "nccl" else GlooGroup
        group = make_group(store, rank, world_size, seconds)
    except BaseException:
        store.close()
        raise
    _default_group = _ProcessGroup(backend, store, group)


def is_initialized() -> bool:
    return _default_group is not None


def is_available() -> bool:
    return True


def is_gloo_available() -> bool:
    return True


def is_nccl_available() -> bool:
    """Whether the NCCL library loads (the nvidia-nccl wheel); a GPU is checked at init."""
    from flame.runtime import library_nccl

    try:
        library_nccl.load()
    except library_nccl.NcclUnavailable:
        return False
    return True


def _default() -> _ProcessGroup:
    if _default_group is None:
        raise RuntimeError(
            "Default process group has not been initialized, please make sure to call "
            "init_process_group."
        )
    return _default_group


def get_rank() -> int:
    return _default().group.rank


def get_world_size() -> int:
    return _default().group.world_size


def get_backend() -> str:
    return _default().backend


def destroy_process_group() -> None:
    """Close the sockets or the NCCL communicator (after its queued collectives) and, on
    rank 0, the store; forget the group."""
    global _default_group
    process_group = _default()
    _default_group = None
    process_group.group.close()
    process_group.store.close()


def abort(message: str) -> None:
    """Fail every other rank's current or next collective with ``message``; this rank's own
    later collectives fail too (``destroy_process_group`` still closes the group)."""
    if _default_group is not None:
        _default_group.group.abort(message)


@contextlib.contextmanager
def abort_on_error():
    """Run a rank's work; if it raises, the other ranks fail with this rank's error too
    (instead of waiting for the timeout). The launcher runs scripts inside this."""
    try:
        yield
    except BaseException as error:
        if _default_group is not None and not isinstance(error, DistributedError):
            rank = _default_group.group.rank
            abort(f"rank {rank} failed: {type(error).__name__}: {error}")
        raise


# --- collectives ------------------------------------------------------------------------------
def _check(tensor, name: str) -> None:
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name}: expected a flame Tensor, got {type(tensor).__name__}")


def _check_call(name: str, group, async_op: bool) -> GlooGroup | NcclGroup:
    if group is not None:
        raise NotImplementedError(f"{name}: only the default group exists (group=None)")
    return _default().group


def _done(async_op: bool) -> Work | None:
    return Work() if async_op else None


def _op_name(op) -> str:
    if not isinstance(op, ReduceOp):
        raise TypeError(f"expected a ReduceOp, got {op!r}")
    return op.value


def all_reduce(tensor: Tensor, op: ReduceOp = ReduceOp.SUM, group=None, async_op=False):
    """Combine ``tensor`` over every rank with ``op``; the result replaces it on every rank."""
    process_group = _check_call("all_reduce", group, async_op)
    _check(tensor, "all_reduce")
    if isinstance(process_group, NcclGroup):
        process_group.all_reduce(tensor, _op_name(op))
    else:
        tensor.copy_(process_group.all_reduce(tensor.numpy(), _op_name(op)))
    return _done(async_op)


def broadcast(tensor: Tensor, src: int, group=None, async_op=False):
    """Rank ``src``'s ``tensor`` replaces ``tensor`` on every rank."""
    process_group = _check_call("broadcast", group, async_op)
    _check(tensor, "broadcast")
    if not 0 <= src < process_group.world_size:
        raise ValueError(f"broadcast: src {src} is outside world_size {process_group.world_size}")
    if isinstance(process_group, NcclGroup):
        process_group.broadcast(tensor, src)
        return _done(async_op)
    result = process_group.broadcast(tensor.numpy(), src)
    if process_group.rank != src:
        tensor.copy_(result)
    return _done(async_op)


def all_gather(tensor_list: list[Tensor], tensor: Tensor, group=None, async_op=False):
    """``tensor_list[i]`` receives rank i's ``tensor``."""
    process_group = _check_call("all_gather", group, async_op)
    _check(tensor, "all_gather")
    _check_list(tensor_list, tensor, process_group.world_size, "all_gather", "tensor_list")
    if isinstance(process_group, NcclGroup):
        process_group.all_gather(tensor_list, tensor)
        return _done(async_op)
    for target, value in zip(tensor_list, process_group.all_gather(tensor.numpy())):
        target.copy_(value)
    return _done(async_op)


def reduce_scatter(
    output: Tensor,
    input_list: list[Tensor],
    op: ReduceOp = ReduceOp.SUM,
    group=None,
    async_op=False,
):
    """``output`` on rank r receives ``input_list[r]`` combined over every rank with ``op``."""
    process_group = _check_call("reduce_scatter", group, async_op)
    _check(output, "reduce_scatter")
    _check_list(input_list, output, process_group.world_size, "reduce_scatter", "input_list")
    if isinstance(process_group, NcclGroup):
        process_group.reduce_scatter(output, input_list, _op_name(op))
        return _done(async_op)
    arrays = [np.asarray(item.numpy(), output.dtype.numpy) for item in input_list]
    output.copy_(process_group.reduce_scatter(arrays, _op_name(op)))
    return _done(async_op)


def _check_list(tensors, like: Tensor, world_size: int, name: str, what: str) -> None:
    if len(tensors) != world_size:
        raise ValueError(f"{name}: {what} has {len(tensors)} tensors, world_size is {world_size}")
    for index, item in enumerate(tensors):
        _check(item, name)
        if item.shape != like.shape or item.dtype != like.dtype:
            raise ValueError(
                f"{name}: {what}[{index}] is {item.dtype.name}{list(item.shape)}, expected "
                f"{like.dtype.name}{list(like.shape)}"
            )


def barrier(group=None, async_op=False):
    """Return once every rank has called ``barrier`` (nccl: and this rank's queued GPU work,
    the barrier's all-reduce included, is done)."""
    _check_call("barrier", group, async_op).barrier()
    return _done(async_op)
