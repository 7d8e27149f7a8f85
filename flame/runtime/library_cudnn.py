"""cuDNN through its graph API (the ``nvidia-cudnn-frontend`` package, imported as ``cudnn``):
the session (handle, stream binding, version) and execution plans cached per configuration.

Plans: a configuration (operation, dtypes, every tensor's dims and strides, the op's
attributes) is built once per process (``validate``, ``build_operation_graph``, heuristics A
then FALLBACK, ``check_support``, ``build_plans``: 50-70 ms, up to ~1 s where cuDNN compiles a
fused engine at run time) and kept in memory; the built graph is also serialized into
FLAME's disk cache (keyed by the configuration, the cuDNN version and the GPU), so a fresh
process deserializes it in about a millisecond instead of building it. Tensors carry fixed
uids, so a plan restored from disk executes with the same variant pack as a fresh one.

Execution: the handle is bound to FLAME's current stream (re-bound only when the stream
changes), the workspace comes from CuPy's pool (FLAME's), and ``execute`` takes raw device
pointers, so cuDNN calls sit in CUDA graphs like cuBLAS's. A failure names the FLAME op, the
configuration and cuDNN's message.

Whether cuDNN is used: ``flame.backends.cudnn.enabled`` (PyTorch's switch) and whether the
package and library load; ``status()`` says which, for ``flame info``.
"""

from __future__ import annotations

import ast
import contextlib
import threading
import time
from dataclasses import dataclass

from flame.records import Record

_LOCK = threading.RLock()
_SESSION: dict = {}  # filled once: module, handle, version, or the reason cuDNN is unusable
_PLANS: dict[tuple, Plan] = {}
_LOADING: threading.Thread | None = None  # start_loading's thread
_NOTED = threading.local()  # .entries: the plans a capture on this thread asks for
ENTRIES_FORMAT = 1  # of the stored lists of a captured program's plans

# cuDNN data types by FLAME dtype name (bfloat16 arrays are uint16 bits in CuPy)
_TYPE_NAMES = {"float16": "HALF", "bfloat16": "BFLOAT16", "float32": "FLOAT", "float64": "DOUBLE",
               "int64": "INT64"}  # fmt: skip


class CudnnError(RuntimeError):
    """cuDNN refused or failed a configuration; the message names the op and the shapes."""


class CudnnStatus(Record, frozen=True):
    available: bool
    version: str  # cuDNN's backend version ("9.10.2"), "" when unavailable
    frontend: str  # the frontend package's version, "" when not importable
    reason: str  # why cuDNN is not used ("" when it is)


@dataclass
class Plan:
    graph: object
    workspace: int
    key: tuple
    origin: str  # "built" | "disk"
    ms: float  # what building (or deserializing) it cost


LIBRARY_NAME = "libcudnn.so.9"
# where the nvidia-cudnn-cu12/-cu13 wheels put the library, under a site-packages directory
WHEEL_DIRS = ("nvidia/cudnn/lib", "nvidia/cu13/lib", "nvidia/cu12/lib")


def _preload_library() -> None:
    """Load cuDNN from the ``nvidia-cudnn-cu*`` wheel when the frontend would not find it
    (it looks in ``LD_LIBRARY_PATH``, beside itself and in the system): a library loaded by
    its soname is the one the frontend's ``dlopen`` then gets."""
    import ctypes
    import sys
    from pathlib import Path

    for entry in sys.path:
        for folder in WHEEL_DIRS:
            candidate = Path(entry or ".") / folder / LIBRARY_NAME
            if candidate.is_file():
                try:
                    ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
                return


def import_frontend():
    """``import cudnn`` without PyTorch: the frontend imports ``torch`` at import time when
    it is importable (cudnn/wrapper.py, for its PyTorch-facing ``Graph`` class), which cost a
    first training step ~30 s on the H100 host (the import, then its custom-op
    registration), on a background thread holding the GIL. FLAME hands the frontend integer
    pointers and its own data types only, never torch tensors, so ``import torch`` fails for
    this thread during this import (other threads import it as usual); a process that
    already imported PyTorch keeps it."""
    import sys

    if "torch" in sys.modules:
        import cudnn

        return cudnn
    refusal = _NoTorchForThisThread()
    sys.meta_path.insert(0, refusal)
    try:
        import cudnn
    finally:
        sys.meta_path.remove(refusal)
    return cudnn


class _NoTorchForThisThread:
    """A meta-path finder that refuses ``torch`` to the thread that made it."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        refused = name == "torch" or name.startswith("torch.")
        if refused and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"no {name} for the cuDNN frontend (FLAME)", name=name)
        return None


def _load() -> dict:
    with _LOCK:
        if _SESSION:
            return _SESSION
        _preload_library()
        try:
            cudnn = import_frontend()
        except ImportError as error:
            _SESSION.update(reason=f"the cuDNN frontend is not installed ({error})", frontend="")
            return _SESSION
        except Exception as error:  # noqa: BLE001 (a broken install: reported, not raised later)
            _SESSION.update(reason=f"the cuDNN frontend did not import: {error}", frontend="")
            return _SESSION
        _SESSION["frontend"] = getattr(cudnn, "__version__", "?")
        try:
            version = cudnn.backend_version()
            handle = cudnn.create_handle()
        except Exception as error:  # noqa: BLE001 (any failure to load the library)
            _SESSION.update(reason=f"cuDNN could not start: {error}")
            return _SESSION
        major, minor, patch = version // 10000, version // 100 % 100, version % 100
        _SESSION.update(
            module=cudnn, handle=handle, version=f"{major}.{minor}.{patch}", reason="",
            stream=None,
        )  # fmt: skip
        return _SESSION


def start_loading() -> None:
    """Begin loading cuDNN on a background thread (its handle costs ~5 s the first time in a
    process: the library maps its kernels), so that it overlaps tracing, planning and NVRTC.
    Called when a convolution or attention op is built for the GPU; ``_load`` waits for it."""
    global _LOADING
    if _SESSION or _LOADING is not None:
        return
    with _LOCK:
        if _SESSION or _LOADING is not None:
            return
        import cupy

        try:
            device = cupy.cuda.runtime.getDevice()  # the handle belongs to the caller's device
        except Exception:  # noqa: BLE001 (no GPU here: building graphs only, nothing to load)
            return

        def load_on_device():
            with cupy.cuda.Device(device):
                _load()

        _LOADING = threading.Thread(target=load_on_device, name="flame-cudnn-load", daemon=True)
        _LOADING.start()


def status() -> CudnnStatus:
    """Whether FLAME's convolutions and attention run through cuDNN, and if not, why."""
    from flame.backends import cudnn as switch

    session = _load()
    reason = session.get("reason", "")
    if not reason and not switch.enabled:
        reason = "disabled by flame.backends.cudnn.enabled = False"
    return CudnnStatus(
        available=not reason, version=session.get("version", ""),
        frontend=session.get("frontend", ""), reason=reason,
    )  # fmt: skip


def usable() -> bool:
    from flame.backends import cudnn as switch

    return switch.enabled and "module" in _load()


def data_type(dtype_name: str):
    return getattr(_load()["module"].data_type, _TYPE_NAMES[dtype_name])


def _bind_stream(session: dict) -> None:
    import cupy

    stream = cupy.cuda.get_current_stream().ptr
    if session["stream"] != stream:
        session["module"].set_stream(handle=session["handle"], stream=stream)
        session["stream"] = stream


def _disk_key(key: tuple) -> str:
    from flame.runtime.cache import DiskCache
    from flame.runtime.device import target_arch

    session = _load()
    return DiskCache.key(
        "cudnn-plan", session["version"], session["frontend"], target_arch(), repr(key)
    )


def _disk():
    from flame.runtime.compiler import default_kernel_cache

    return default_kernel_cache().disk


def _new_graph(session: dict, io_type: str):
    cudnn = session["module"]
    return cudnn.pygraph(
        io_data_type=data_type(io_type), intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT, handle=session["handle"],
    )  # fmt: skip


def configuration(node) -> tuple:
    """What identifies a node's library call apart from where its values live: op, dtype,
    shapes and attributes (the key of a configuration cuDNN refused)."""
    return (node.op, node.dtype, tuple(child.shape for child in node.inputs), node.attrs)


def plan(key: tuple, io_type: str, define, describe) -> Plan:
    """The plan for ``key``: from memory, else deserialized from disk, else built by
    ``define(graph)`` (which adds the tensors, with uids, and the operations). ``describe()``
    names the op and its configuration in errors."""
    noted = getattr(_NOTED, "entries", None)
    if noted is not None:
        noted.setdefault(key, io_type)
    found = _PLANS.get(key)
    if found is not None:
        return found
    with _LOCK:
        found = _PLANS.get(key)
        if found is not None:
            return found
        session = _load()
        cudnn = session["module"]
        started = time.perf_counter()
        disk_key = _disk_key(key)
        # not under a stream capture: deserializing a stored plan there crashed the process
        # (a segfault inside the frontend's deserialize, in 3 of 12 warm processes that
        # captured a UNet step; building under a capture never did). A captured program's
        # plans are read before its capture instead (``plans_for_capture``).
        capturing = _capturing()
        if not capturing:  # the stream it was bound to last may be gone (a capture's)
            _bind_stream(session)
        graph = None if capturing else _read(session, key, io_type)
        origin = "disk"
        if graph is None:
            graph = _new_graph(session, io_type)
            try:
                define(graph)
                graph.validate()
                graph.build_operation_graph()
                graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
                graph.check_support()
                graph.build_plans()
            except (AttributeError, NameError) as error:  # FLAME's use of the frontend: a bug
                message = f"{describe()}: building the cuDNN graph failed: {error}"
                raise CudnnError(message) from error
            except Exception as error:  # noqa: BLE001 (cuDNN raises several types)
                message = f"{describe()}: cuDNN refused the configuration: {error}"
                raise CudnnError(message) from None
            origin = "built"
            try:
                _disk().put(disk_key, bytes(graph.serialize()))
            except Exception:  # noqa: BLE001 (a plan that does not serialize is rebuilt next time)
                pass
        elapsed = (time.perf_counter() - started) * 1e3
        made = Plan(graph, int(graph.get_workspace_size()), key, origin, elapsed)
        _PLANS[key] = made
        return made


def _read(session: dict, key: tuple, io_type: str):
    """The plan of ``key`` deserialized from FLAME's disk cache into a new graph, or None
    (not stored, or a stale or foreign blob: built instead)."""
    blob = _disk().get(_disk_key(key))
    if blob is None:
        return None
    try:
        graph = _new_graph(session, io_type)
        _deserialize(graph, session["handle"], blob)
    except Exception:  # noqa: BLE001 (the frontend raises several types)
        return None
    return graph


def _capturing() -> bool:
    import cupy

    return bool(cupy.cuda.get_current_stream().is_capturing())


def preload(entries) -> int:
    """Read the stored plans of ``entries`` ((key, io type) pairs) that this process does not
    hold yet, outside any capture; keys not stored are left to ``plan``. How many were read."""
    if _capturing() or not usable():
        return 0
    read = 0
    with _LOCK:
        session = _load()
        _bind_stream(session)
        for key, io_type in entries:
            if key in _PLANS:
                continue
            started = time.perf_counter()
            graph = _read(session, key, io_type)
            if graph is None:
                continue
            elapsed = (time.perf_counter() - started) * 1e3
            _PLANS[key] = Plan(graph, int(graph.get_workspace_size()), key, "disk", elapsed)
            read += 1
    return read


@contextlib.contextmanager
def plans_for_capture(digest: str | None):
    """Around the capture of the program stored under ``digest`` (the plan store's key):
    first the cuDNN plans an earlier capture of it asked for are read from disk (a plan is
    not deserialized under a capture, see ``plan``), then the capture's own requests are
    noted, and stored under ``digest`` when they are new. Without a digest (no plan store)
    the capture builds what is not in memory, as before."""
    if not digest:
        yield
        return
    from flame.runtime import plan_store

    disk = _disk() if plan_store.enabled() else None
    list_key = _list_key(digest)
    stored = decode_entries(disk.get(list_key)) if disk is not None else []
    if stored:
        preload(stored)
    previous = getattr(_NOTED, "entries", None)
    noted: dict = {}
    _NOTED.entries = noted
    try:
        yield
    finally:
        _NOTED.entries = previous
        if "module" in _SESSION:  # off the capture's stream, which its owner may now drop
            with _LOCK:
                _bind_stream(_SESSION)
    if disk is not None and noted and not set(noted) <= {key for key, _ in stored}:
        merged = dict(stored)
        merged.update(noted)
        try:
            disk.put(list_key, encode_entries(merged.items()))
        except OSError:  # a read-only or full cache: built under the capture next time
            pass


def _list_key(digest: str) -> str:
    from flame.runtime.cache import DiskCache

    return DiskCache.key("cudnn-plans-of", digest, str(ENTRIES_FORMAT))


def encode_entries(entries) -> bytes:
    """(key, io type) pairs as text: keys are tuples of str, int, float, bool and None."""
    return repr([[key, io_type] for key, io_type in entries]).encode()


def decode_entries(data: bytes | None) -> list[tuple[tuple, str]]:
    """``encode_entries``' pairs back; [] for nothing stored or anything malformed."""
    if not data:
        return []
    try:
        value = ast.literal_eval(data.decode())
        entries = [(key, io_type) for key, io_type in value]
    except (ValueError, SyntaxError, TypeError, UnicodeDecodeError, MemoryError):
        return []
    if not all(isinstance(key, tuple) and isinstance(io, str) for key, io in entries):
        return []
    return entries


def _deserialize(graph, handle, blob: bytes) -> None:
    """A serialized plan back into ``graph`` (frontend 1.22 takes the list of byte values
    that ``serialize`` gives; bytes are refused)."""
    graph.deserialize(handle, list(blob))


def execute(made: Plan, pointers: dict[int, int], describe) -> None:
    """Run a plan on FLAME's stream: ``pointers`` maps tensor uids to device addresses."""
    import cupy

    session = _load()
    workspace = cupy.empty(max(made.workspace, 1), dtype=cupy.uint8)
    with _LOCK:  # one handle: bound to the caller's stream and used by one thread at a time
        _bind_stream(session)
        try:
            made.graph.execute(pointers, workspace.data.ptr, handle=session["handle"])
        except Exception as error:  # noqa: BLE001
            raise CudnnError(f"{describe()}: cuDNN failed at run time: {error}") from None


def plan_times() -> list[tuple[str, str, float]]:
    """(operation, origin, ms) of every plan this process holds, in the order made."""
    return [(str(made.key[0]), made.origin, made.ms) for made in list(_PLANS.values())]


def plan_counts() -> dict[str, int]:
    """How many plans this process holds, by origin (built here, read from disk)."""
    counts: dict[str, int] = {}
    for made in list(_PLANS.values()):
        counts[made.origin] = counts.get(made.origin, 0) + 1
    return counts


def tensor(graph, uid: int, name: str, array, dtype_name: str, dims=None, strides=None):
    """A graph tensor over a CuPy array's dims and element strides (or the given ones)."""
    dims = list(array.shape) if dims is None else list(dims)
    if strides is None:
        strides = [stride // array.itemsize for stride in array.strides]
    made = graph.tensor(name=name, dim=dims, stride=list(strides), data_type=data_type(dtype_name))
    made.set_uid(uid)
    return made
