"""NCCL on the GPU: the communicators of ``flame.distributed``'s ``nccl`` process groups, and
the launches of the collective ops (flame/ir/ops/collective.py).

NCCL comes through CuPy (``cupy.cuda.nccl``), which loads ``libnccl.so.2`` from the
``nvidia-nccl-cu12`` / ``nvidia-nccl-cu13`` wheel (the ``cuda12`` / ``cuda13`` extras) or the
system. It is imported on first use, never by ``import flame``.

A collective node names its communicator by the group's name (``node.attr("group")``); the
communicator is registered here when the group is made and removed when it is destroyed, so a
compiled program replayed after ``destroy_process_group`` fails with the group named instead of
calling a dead communicator.

Streams. A collective of a plan that has other work to overlap it with (a data-parallel step:
the rest of the backward; ``flame.runtime.plans.overlap_collectives``) runs on a
communication stream (``communication_stream``: one per device and thread, non-blocking):
``start_collective`` makes that stream wait for what FLAME's stream (CuPy's current stream)
queued so far, queues NCCL there (its result and any contiguous copy allocated there) and
records a "done" event; the plan's ``CollectiveJoin`` makes FLAME's stream wait for that event
before the first kernel that reads the result (``join_collective``). Every other call runs on
FLAME's stream, after the kernels that made its input and before those that read its result.
Neither waits on the host: they are queued like any kernel. The event record/wait pair is
also how a CUDA-graph capture forks to the second stream and joins back, so step graphs
(flame/runtime/step_graphs.py) capture both forms (NCCL 2.9 and later: no host sync, memory
from the capture's allocator). Results are new C-contiguous arrays (send and receive buffers
differ, as NCCL allows); a strided input is copied to contiguous memory first.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import warnings

from flame.runtime.library import implements

# ncclDataType_t and ncclRedOp_t, from nccl.h (stable since NCCL 2.0; bfloat16 and avg since
# 2.10). bool travels as uint8, and its sum/product are max/min (as PyTorch does).
NCCL_DTYPE = {
    "bool": 1, "int8": 0, "uint8": 1, "int32": 2, "int64": 4,
    "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9,
}  # fmt: skip
NCCL_OP = {"sum": 0, "product": 1, "max": 2, "min": 3, "avg": 4}
_BOOL_OP = {"sum": "max", "product": "min", "max": "max", "min": "min"}
_CUDA_ERROR_NOT_INITIALIZED = 3

_COMMUNICATORS: dict[str, object] = {}  # group name -> NcclCommunicator
_LOCK = threading.Lock()
_STREAMS = threading.local()  # per thread: device index -> its communication stream


class NcclUnavailable(RuntimeError):
    """NCCL cannot be loaded: the message names the wheel to install."""


def _import_nccl():
    with warnings.catch_warnings():  # CuPy warns when libnccl is missing; we raise instead
        warnings.simplefilter("ignore")
        from cupy.cuda import nccl
    return nccl


def _wheel_name() -> str:
    try:
        import cupy

        major = cupy.cuda.runtime.runtimeGetVersion() // 1000
    except Exception:  # noqa: BLE001  no CuPy or no runtime: name both wheels
        return "nvidia-nccl-cu12 (CUDA 12) or nvidia-nccl-cu13 (CUDA 13)"
    return f"nvidia-nccl-cu{major}"


def load():
    """CuPy's NCCL module, or ``NcclUnavailable`` naming the wheel that provides NCCL."""
    try:
        nccl = _import_nccl()
    except ImportError as error:
        raise NcclUnavailable(
            f"NCCL is reached through CuPy, which is not importable ({error}); install "
            "flame[cuda12] or flame[cuda13]"
        ) from None
    if not getattr(nccl, "available", False):
        wheel = _wheel_name()
        raise NcclUnavailable(
            f"the NCCL library (libnccl.so.2) could not be loaded: install the {wheel} wheel "
            f"(pip install {wheel.split(' ')[0]}; the flame[cuda12]/flame[cuda13] extras "
            "include it)"
        )
    return nccl


def version() -> str:
    """NCCL's version as ``major.minor.patch`` (raises ``NcclUnavailable``)."""
    code = load().get_version()
    if code >= 10000:  # NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def status() -> str:
    """One line for ``flame info``: NCCL's version, or why it is not available."""
    try:
        return f"{version()}: collectives of flame.distributed's nccl backend"
    except NcclUnavailable as error:
        return f"not available ({error})"
    except Exception as error:  # noqa: BLE001  a broken install is reported, not raised
        return f"unavailable ({type(error).__name__}: {error})"


# --- the device of a rank -----------------------------------------------------------------------
def cuda_initialized() -> bool:
    """Whether CUDA's driver is initialized in this process (after which CUDA_VISIBLE_DEVICES
    no longer changes what it sees). Any driver call but cuInit answers NOT_INITIALIZED
    before it; without a loadable driver, True (nothing to narrow)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    count = ctypes.c_int(0)
    return driver.cuDeviceGetCount(ctypes.byref(count)) != _CUDA_ERROR_NOT_INITIALIZED


def visible_entries(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES's devices, None where it is unset (CUDA stops at the first entry
    that is not an index or a UUID)."""
    if value is None:
        return None
    entries = []
    for entry in value.split(","):
        entry = entry.strip()
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def narrow_visible_devices(local_rank: int) -> None:
    """Before CUDA starts: let this process see only its GPU, the ``local_rank``-th visible
    one, which becomes device 0 for every thread (FLAME's background threads included). A
    process that already sees one GPU (``flame run --bind-gpus``) keeps it."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = visible_entries(text)
    if visible is None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    elif len(visible) == 1:
        return
    elif local_rank < len(visible):
        os.environ["CUDA_VISIBLE_DEVICES"] = visible[local_rank]
    else:
        raise ValueError(
            f"init_process_group: LOCAL_RANK {local_rank} has no GPU: CUDA_VISIBLE_DEVICES="
            f"{text!r} lists {len(visible)}"
        )


def use_device(rank: int, local_rank: int | None) -> int:
    """Make this thread's current device the rank's GPU (CUDA already started): LOCAL_RANK,
    else ``rank % device count``; a process that sees one GPU uses it. Returns its index."""
    import cupy

    count = cupy.cuda.runtime.getDeviceCount()
    if local_rank is None:
        index = rank % count
    elif local_rank < count:
        index = local_rank
    elif count == 1:
        index = 0
    else:
        raise ValueError(
            f"init_process_group: LOCAL_RANK {local_rank} has no GPU: {count} are visible"
        )
    cupy.cuda.runtime.setDevice(index)
    return index


# --- communicators ------------------------------------------------------------------------------
def unique_id() -> bytes:
    """NCCL's unique id (128 bytes), made by rank 0 and shared through the store."""
    return bytes(value & 0xFF for value in load().get_unique_id())


def group_name(uid: bytes) -> str:
    """The name collective nodes carry: the same on every rank of a group, new per group."""
    return "nccl-" + hashlib.sha1(uid).hexdigest()[:10]


def create_communicator(name: str, world_size: int, uid: bytes, rank: int) -> None:
    """Join the NCCL communicator ``uid`` as ``rank`` (blocks until every rank joins) on the
    current device, and register it as ``name``."""
    nccl = load()
    try:  # CuPy 14 takes the id as bytes
        communicator = nccl.NcclCommunicator(world_size, bytes(uid), rank)
    except TypeError:  # earlier CuPy: a tuple of C chars
        signed = tuple(value - 256 if value > 127 else value for value in uid)
        communicator = nccl.NcclCommunicator(world_size, signed, rank)
    with _LOCK:
        _COMMUNICATORS[name] = communicator


def communicator(name: str, op: str = "collective"):
    with _LOCK:
        found = _COMMUNICATORS.get(name)
    if found is None:
        raise RuntimeError(
            f"{op}: its NCCL process group {name!r} does not exist in this process (destroyed, "
            "aborted, or never initialized here); a value or a flame.compile'd function built "
            "on a group runs only while that group lives: build it again after "
            "init_process_group(backend='nccl')"
        )
    return found


def _stream_pointer() -> int:
    import cupy

    return cupy.cuda.get_current_stream().ptr


def destroy(name: str) -> None:
    """Wait for the group's queued collectives, then free its communicator."""
    import cupy

    with _LOCK:
        found = _COMMUNICATORS.pop(name, None)
    if found is not None:
        cupy.cuda.get_current_stream().synchronize()
        _release_graphs(name)
        found.destroy()


def abort(name: str) -> None:
    """Free the communicator without waiting (ncclCommAbort): collectives queued on it fail."""
    with _LOCK:
        found = _COMMUNICATORS.pop(name, None)
    if found is not None:
        _release_graphs(name)
        found.abort()


def _release_graphs(name: str) -> None:
    """NCCL's destroy and abort wait until every CUDA graph that captured one of the
    communicator's collectives is gone (with two or more ranks they hang while one lives):
    drop FLAME's captures of the group first."""
    from flame.replay import release_graphs_of

    release_graphs_of(name)


def barrier(name: str) -> None:
    """An all-reduce of one int on FLAME's stream, then the host waits for it (as PyTorch's
    NCCL barrier: every rank's earlier work is queued and this rank's is done)."""
    import cupy

    flag = cupy.zeros(1, dtype=cupy.int32)
    stream = _stream_pointer()
    communicator(name, "barrier").allReduce(
        flag.data.ptr, flag.data.ptr, 1, NCCL_DTYPE["int32"], NCCL_OP["sum"], stream
    )
    cupy.cuda.get_current_stream().synchronize()


# --- the communication stream ---------------------------------------------------------------------
def communication_stream():
    """This thread's stream for collectives on the current device, made on first use.
    Non-blocking: it never waits for the legacy default stream FLAME's kernels may run on,
    only for the events ``start_collective`` gives it."""
    import cupy

    streams = getattr(_STREAMS, "by_device", None)
    if streams is None:
        streams = _STREAMS.by_device = {}
    device = cupy.cuda.runtime.getDevice()
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = cupy.cuda.Stream(non_blocking=True)
    return stream


def _current_stream():
    import cupy

    return cupy.cuda.get_current_stream()


def _new_event():
    import cupy

    return cupy.cuda.Event(disable_timing=True)


def start_collective(node, arrays: list) -> tuple:
    """Queue collective ``node`` over ``arrays`` on the communication stream, after what the
    current stream queued so far. Returns ``(result, pending)``: the result, and what
    ``join_collective`` takes: the "done" event and ``arrays``, kept alive until the join
    (the plan releases the input slots there too), so the current stream does not reuse
    their memory while NCCL reads it. The result and any contiguous copy of the input are
    allocated while the communication stream is current: CuPy's pool hands such a block
    back only to work queued later on that stream, so the copy, freed on the host as soon
    as NCCL is queued, is not overwritten before NCCL has read it."""
    from flame.runtime.library import run_library

    side = communication_stream()
    side.wait_event(_current_stream().record(_new_event()))
    with side:
        result = run_library(node, arrays)
        done = side.record(_new_event())
    return result, (done, arrays)


def join_collective(pending: tuple) -> None:
    """The current stream waits (on the device, not the host) for a collective that
    ``start_collective`` queued."""
    _current_stream().wait_event(pending[0])


# --- the collective ops ---------------------------------------------------------------------------
def _reduce_op(node) -> int:
    op = node.attr("op", "sum")
    if node.dtype.name == "bool":
        op = _BOOL_OP[op]
    return NCCL_OP[op]


def _contiguous(array):
    import cupy

    return cupy.ascontiguousarray(array)


@implements("all_reduce")
def all_reduce(node, arrays):
    import cupy

    source = _contiguous(arrays[0])
    out = cupy.empty(node.shape, dtype=source.dtype)
    if out.size:
        communicator(node.attr("group"), "all_reduce").allReduce(
            source.data.ptr, out.data.ptr, out.size, NCCL_DTYPE[node.dtype.name],
            _reduce_op(node), _stream_pointer(),
        )  # fmt: skip
    return out


@implements("broadcast")
def broadcast(node, arrays):
    import cupy

    source = _contiguous(arrays[0])
    out = cupy.empty(node.shape, dtype=source.dtype)
    if out.size:
        communicator(node.attr("group"), "broadcast").broadcast(
            source.data.ptr, out.data.ptr, out.size, NCCL_DTYPE[node.dtype.name],
            node.attr("src", 0), _stream_pointer(),
        )  # fmt: skip
    return out


@implements("all_gather")
def all_gather(node, arrays):
    import cupy

    source = _contiguous(arrays[0])
    out = cupy.empty(node.shape, dtype=source.dtype)
    if out.size:
        communicator(node.attr("group"), "all_gather").allGather(
            source.data.ptr, out.data.ptr, source.size, NCCL_DTYPE[node.dtype.name],
            _stream_pointer(),
        )  # fmt: skip
    return out


@implements("reduce_scatter")
def reduce_scatter(node, arrays):
    import cupy

    source = _contiguous(arrays[0])
    out = cupy.empty(node.shape, dtype=source.dtype)
    if out.size:
        communicator(node.attr("group"), "reduce_scatter").reduceScatter(
            source.data.ptr, out.data.ptr, out.size, NCCL_DTYPE[node.dtype.name],
            _reduce_op(node), _stream_pointer(),
        )  # fmt: skip
    return out
