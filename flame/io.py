"""Weights on disk: ``save_file``/``load_file`` in the safetensors format, and training-state
checkpoints (``save_checkpoint``/``load_checkpoint``) in one safetensors file.

The format and the header's validation are the ``safetensors`` library's; FLAME adds its
dtypes (bfloat16 bit for bit, as ``ml_dtypes.bfloat16`` on the host), file names and keys in
every error, and the way the bytes reach a backend:

* reference: each tensor is read (``pread``) straight into its own NumPy array;
* cuda: the data is read in large chunks into a ring of page-locked buffers, several threads
  at a time, and each chunk is copied asynchronously (one ``cudaMemcpyAsync`` per tensor piece)
  into the tensors' GPU memory while the next chunk is read. The bytes pass through host
  memory once (page cache -> page-locked buffer -> GPU) and nothing stays on the host. Reading
  with ``pread`` costs the same copy as reading a memory mapping without a page fault per
  4 KiB page; ``HOST_READ = "mmap"`` copies from a mapping instead (the benchmark compares).

Saving follows ``safetensors.torch.save_file``: entries that share memory (the same tensor
under two names, or overlapping views of one) are refused, naming the keys, since loading
would silently untie them. Lazy and non-contiguous tensors are computed and packed.
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading

import numpy as np

from flame.ir import dtypes
from flame.runtime.file_uploads import WeightsFileError, read_exactly, read_to_gpu
from flame.tensor import Tensor

__all__ = ["WeightsFileError", "load_checkpoint", "load_file", "save_checkpoint", "save_file"]

# safetensors' dtype code -> FLAME dtype; the TensorSpec name is the host dtype's name
_DTYPES = {
    "F64": dtypes.float64, "F32": dtypes.float32, "F16": dtypes.float16,
    "BF16": dtypes.bfloat16, "I64": dtypes.int64, "I32": dtypes.int32, "I16": dtypes.int16,
    "I8": dtypes.int8, "U8": dtypes.uint8, "BOOL": dtypes.bool_,
}  # fmt: skip
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
# bits per element of the dtypes safetensors knows and FLAME lacks (for the size check)
_OTHER_BITS = {
    "U16": 16, "U32": 32, "U64": 64, "C64": 64, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
}  # fmt: skip


def save_file(tensors: dict, filename, metadata: dict | None = None) -> None:
    """Write ``tensors`` (name -> flame.Tensor) to ``filename`` in the safetensors format,
    with ``metadata`` (str -> str) in the header, as ``safetensors.torch.save_file``. The
    file is written beside its final name and renamed over it, so a crash never leaves half
    a file there (and tensors still reading the old file keep reading it)."""
    from safetensors import SafetensorError, TensorSpec, serialize_file

    path = os.fspath(filename)
    _check_save_arguments(tensors, metadata, path)
    _check_no_shared_memory(tensors, path)
    from flame.tensor import realize

    if tensors:
        realize(*tensors.values())  # one schedule: work the tensors share runs once
    arrays, specs = [], {}
    for name, tensor in tensors.items():
        array = np.asarray(tensor.numpy(), dtype=tensor.dtype.numpy).reshape(tensor.shape)
        if not array.flags.c_contiguous:  # (ascontiguousarray would make a 0-d array 1-d)
            array = array.copy(order="C")
        arrays.append(array)  # alive until the file is written: the spec holds its address
        spec_dtype = np.dtype(tensor.dtype.numpy).name
        specs[name] = TensorSpec(
            dtype=spec_dtype, shape=list(array.shape), data_ptr=array.ctypes.data,
            data_len=array.nbytes,
        )  # fmt: skip
    partial = f"{path}.partial-{os.getpid()}-{threading.get_ident()}"
    try:
        serialize_file(specs, partial, metadata=metadata)
        os.replace(partial, path)
    except SafetensorError as error:
        raise WeightsFileError(f"save_file: {path}: {error}") from error
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def _check_save_arguments(tensors, metadata, path: str) -> None:
    if not isinstance(tensors, dict):
        raise TypeError(f"save_file: {path}: expected a dict of name -> flame.Tensor, got "
                        f"{type(tensors).__name__}")  # fmt: skip
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"save_file: {path}: key {name!r} is a {type(name).__name__}; "
                            "tensor names must be strings")  # fmt: skip
        if not isinstance(value, Tensor):
            raise TypeError(f"save_file: {path}: {name!r} is a {type(value).__name__}, not a "
                            "flame.Tensor")  # fmt: skip
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise TypeError(f"save_file: {path}: metadata must be a dict of str -> str, got "
                        f"{type(metadata).__name__}")  # fmt: skip
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"save_file: {path}: metadata entry {key!r}: {value!r}: keys and "
                            "values must be strings")  # fmt: skip


def _check_no_shared_memory(tensors: dict, path: str) -> None:
    """safetensors.torch's rule: entries whose memory overlaps are refused (a file cannot
    say that two names are one tensor). Only memory the user holds counts -- a realized
    tensor or a view of one -- never where FLAME happens to place lazy results."""
    from flame.inplace import memory_of

    regions: dict[int, list] = {}
    for name, tensor in tensors.items():
        found = memory_of(tensor.node)
        if found is None or tensor.numel() == 0:
            continue
        storage, view = found
        low = view.offset + sum(min(0, (n - 1) * s) for n, s in zip(view.shape, view.strides))
        high = view.offset + sum(max(0, (n - 1) * s) for n, s in zip(view.shape, view.strides))
        regions.setdefault(id(storage), []).append((low, high + 1, name))
    groups = []
    for areas in regions.values():
        areas.sort()
        group, stop = [areas[0][2]], areas[0][1]
        for start, end, name in areas[1:]:
            if start < stop:
                group.append(name)
            else:
                if len(group) > 1:
                    groups.append(group)
                group = [name]
            stop = max(stop, end)
        if len(group) > 1:
            groups.append(group)
    if groups:
        described = "; ".join(", ".join(repr(name) for name in group) for group in groups)
        raise ValueError(
            f"save_file: {path}: these entries share memory: {described}. A safetensors file "
            "cannot tie them: save one of each group (and tie them again after loading), or "
            "save a copy (x.clone())"
        )


# --- reading the header --------------------------------------------------------------------


class _Entry:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name, dtype, shape, begin, end):
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def _read_header(path: str) -> tuple[list[_Entry], dict, int]:
    """(entries in file order, metadata, file size), the header validated by safetensors
    and every tensor's dtype checked against FLAME's."""
    from safetensors import SafetensorError, safe_open

    size = os.path.getsize(path)
    with open(path, "rb") as file:
        prefix = file.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
        raw = file.read(length) if length is not None and length <= size - 8 else b""
    try:
        with safe_open(path, framework="numpy"):
            pass
    except SafetensorError as error:
        problem = _diagnose(prefix, length, raw, size)
        detail = f"{problem} (safetensors: {error})" if problem else str(error)
        raise WeightsFileError(f"load_file: {path}: {detail}") from error
    header = json.loads(raw)
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + length
    entries = []
    for name, info in header.items():
        dtype = _DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightsFileError(
                f"load_file: {path}: tensor {name!r} has dtype {info['dtype']}, which FLAME "
                f"does not have (FLAME reads {', '.join(_DTYPES)})"
            )
        begin, end = info["data_offsets"]
        entries.append(_Entry(name, dtype, tuple(info["shape"]), data_start + begin,
                              data_start + end))  # fmt: skip
    entries.sort(key=lambda entry: entry.begin)
    return entries, metadata, size


def _diagnose(prefix: bytes, length, raw: bytes, size: int) -> str | None:
    """What is wrong with a header safetensors refused, naming the tensor where there is one
    (its own messages do not always say which)."""
    if length is None:
        return f"the file is {size} bytes, too short for the 8-byte header length"
    if length > size - 8:
        return f"the header claims {length} bytes but only {size - 8} follow: truncated file"
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"the header is not JSON ({error})"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    header.pop("__metadata__", None)
    data_bytes, spans = size - 8 - length, []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            return f"tensor {name!r}: its entry lacks dtype, shape or data_offsets"
        bits = _DTYPES[dtype].itemsize * 8 if dtype in _DTYPES else _OTHER_BITS.get(dtype)
        if bits is None:
            return f"tensor {name!r}: unknown dtype {dtype!r}"
        if not all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end)):
            return f"tensor {name!r}: shape {shape} or offsets {[begin, end]} are not sizes"
        expected = math.ceil(math.prod(shape) * bits / 8)
        if end - begin != expected:
            return (f"tensor {name!r}: shape {shape} of {dtype} needs {expected} bytes, its "
                    f"offsets [{begin}, {end}] give {end - begin}")  # fmt: skip
        if end > data_bytes:
            return (f"tensor {name!r} ends at byte {end} of the data, which has {data_bytes}: "
                    "truncated file, or the header lies")  # fmt: skip
        spans.append((begin, end, name))
    spans.sort()
    position, previous = 0, None
    for begin, end, name in spans:
        if begin < position:
            return f"tensor {name!r} (bytes {begin}..{end}) overlaps tensor {previous!r}"
        if begin > position:
            return f"a gap of {begin - position} bytes before tensor {name!r}"
        position, previous = end, name
    if position != data_bytes:
        return f"the tensors cover {position} bytes of data, the file holds {data_bytes}"
    return None


# --- loading -------------------------------------------------------------------------------


def load_file(filename, device=None) -> dict[str, Tensor]:
    """The tensors of a safetensors file, on ``device``'s backend ("cpu": the reference
    backend, "cuda"/"cuda:0"; default: the current backend), as
    ``safetensors.torch.load_file``. The tensors own their memory: the file can be changed
    or removed afterwards."""
    path = os.fspath(filename)
    return _load(path, _backend_of(device), _read_header(path)[0])


def _backend_of(device) -> str:
    from flame.backend import get_backend
    from flame.devices import device as as_device

    if device is None:
        return get_backend()
    if device in ("reference", "cuda"):
        return device
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    return as_device(device).backend


def _load(path: str, backend: str, entries: list[_Entry]) -> dict[str, Tensor]:
    if not entries:
        return {}
    if backend == "cuda":
        arrays = read_to_gpu(path, entries)
    else:
        arrays = _read_to_host(path, entries)
    return {entry.name: _wrap(arrays[entry.name], entry, backend) for entry in entries}


def _wrap(array, entry: _Entry, backend: str) -> Tensor:
    from flame.ir.node import Node, user_site
    from flame.runtime.storage import Storage

    storage = Storage(backend, entry.dtype, array=array)
    node = Node("buffer", (), (("storage", storage),), entry.dtype, entry.shape, user_site())
    return Tensor(node, backend)


def _read_to_host(path: str, entries: list[_Entry]) -> dict[str, np.ndarray]:
    arrays = {}
    descriptor = os.open(path, os.O_RDONLY)
    try:
        for entry in entries:
            raw = np.empty(entry.end - entry.begin, dtype=np.uint8)
            read_exactly(descriptor, memoryview(raw), entry.begin, path)
            arrays[entry.name] = raw.view(entry.dtype.numpy).reshape(entry.shape)
    finally:
        os.close(descriptor)
    return arrays


# --- training-state checkpoints ------------------------------------------------------------
#
# One safetensors file. Tensors: ``model.<name>``, ``ema.<name>``,
# ``optimizer.state.<index>.<name>`` (PyTorch's optimizer layout), ``extra.<key>``. The rest is
# JSON in the header's metadata: ``flame.optimizer`` (param_groups and the state's numbers),
# ``flame.scheduler``, ``flame.step``, ``flame.rng`` ([seed, offset] of the default
# generator), ``flame.extra``. Tuples stay tuples ({"__tuple__": [...]}).

_FORMAT = "flame.checkpoint/1"


def save_checkpoint(
    path, *, model=None, ema=None, optimizer=None, scheduler=None, step=None, rng=True,
    extra=None,
) -> None:  # fmt: skip
    """Everything a run needs to resume, in one safetensors file. ``model``/``ema``: anything
    with ``state_dict()`` (name -> flame.Tensor); ``extra``: a dict of JSON values or tensors."""
    tensors: dict[str, Tensor] = {}
    metadata = {"format": _FORMAT}
    aliases: dict[str, str] = {}
    for prefix, owner in (("model.", model), ("ema.", ema)):
        if owner is not None:
            kept, tied = _untie({prefix + name: v for name, v in owner.state_dict().items()})
            tensors.update(kept)
            aliases.update(tied)
    if aliases:  # tied weights (an embedding shared with the output layer) stored once
        metadata["flame.aliases"] = json.dumps(aliases)
    if optimizer is not None:
        state = optimizer.state_dict()
        numbers: dict[str, dict] = {}
        for index, entry in state["state"].items():
            for name, value in entry.items():
                if isinstance(value, Tensor):
                    tensors[f"optimizer.state.{index}.{name}"] = value
                else:
                    numbers.setdefault(str(index), {})[name] = value
        document = {"param_groups": state["param_groups"], "state": numbers}
        metadata["flame.optimizer"] = _dumps(document, "optimizer")
    if scheduler is not None:
        metadata["flame.scheduler"] = _dumps(_scheduler_state(scheduler), "scheduler")
    if step is not None:
        metadata["flame.step"] = _dumps(step, "step")
    if rng:
        from flame.random import get_rng_state

        metadata["flame.rng"] = json.dumps([int(v) for v in get_rng_state().numpy()])
    if extra is not None:
        values = {}
        for key, value in dict(extra).items():
            if isinstance(value, Tensor):
                tensors[f"extra.{key}"] = value
            else:
                values[key] = value
        metadata["flame.extra"] = _dumps(values, "extra")
    save_file(tensors, path, metadata)


def load_checkpoint(
    path, *, model=None, ema=None, optimizer=None, scheduler=None, rng=True, device=None
) -> dict:
    """Restore what ``save_checkpoint`` wrote into the objects given (tensors go to
    ``device``'s backend, default the current one; optimizer state follows its parameters)
    and the default generator (``rng``); returns ``{"step": ..., "extra": {...}}``."""
    path = os.fspath(path)
    entries, metadata, _ = _read_header(path)
    if metadata.get("format") != _FORMAT:
        raise WeightsFileError(f"load_checkpoint: {path}: not a FLAME checkpoint (its metadata "
                               f"format is {metadata.get('format')!r})")  # fmt: skip
    backend = _backend_of(device)

    def section(prefix: str, on: str) -> dict[str, Tensor]:
        chosen = [entry for entry in entries if entry.name.startswith(prefix)]
        loaded = _load(path, on, chosen)
        return {name[len(prefix) :]: value for name, value in loaded.items()}

    aliases = json.loads(metadata.get("flame.aliases", "{}"))
    # every section is read and checked before anything is written: a checkpoint that does
    # not fit (another model, another optimizer) leaves the objects as they were
    loads = []
    for prefix, owner in (("model.", model), ("ema.", ema)):
        if owner is not None:
            if not any(entry.name.startswith(prefix) for entry in entries):
                raise WeightsFileError(f"load_checkpoint: {path}: no {prefix[:-1]} tensors "
                                       "in this checkpoint")  # fmt: skip
            values = section(prefix, backend)
            for alias, kept in aliases.items():
                if alias.startswith(prefix) and kept.startswith(prefix):
                    values[alias[len(prefix) :]] = values[kept[len(prefix) :]]
            plan = owner._load_plan(values, True) if hasattr(owner, "_load_plan") else None
            loads.append((owner, values, plan))
    if optimizer is not None:
        document = _loads(metadata, "flame.optimizer", path)
        state: dict[int, dict] = {int(i): dict(v) for i, v in document["state"].items()}
        # read on the host: the optimizer copies each value to its parameter's backend
        for name, value in section("optimizer.state.", "reference").items():
            index, _, key = name.partition(".")
            state.setdefault(int(index), {})[key] = value
        optimizer.load_state_dict({"state": state, "param_groups": document["param_groups"]})
    if scheduler is not None:
        _load_scheduler(scheduler, _loads(metadata, "flame.scheduler", path))
    for owner, values, plan in loads:
        if plan is not None:
            owner._apply_load(plan, False)
        else:
            owner.load_state_dict(values)
    if rng and "flame.rng" in metadata:
        from flame.random import set_rng_state

        set_rng_state(np.array(json.loads(metadata["flame.rng"]), dtype=np.int64))
    extra = _loads(metadata, "flame.extra", path) if "flame.extra" in metadata else {}
    extra.update(section("extra.", backend))
    step = _loads(metadata, "flame.step", path) if "flame.step" in metadata else None
    return {"step": step, "extra": extra}


def _untie(tensors: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``tensors`` with every entry that reads the same memory as an earlier one (the same
    storage and view) left out, and ``{left-out key: kept key}``."""
    from flame.inplace import memory_of

    kept: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, value in tensors.items():
        found = memory_of(value.node) if isinstance(value, Tensor) else None
        if found is not None:
            storage, view = found
            where = (id(storage), view.offset, tuple(view.shape), tuple(view.strides))
            if where in seen:
                aliases[key] = seen[where]
                continue
            seen[where] = key
        kept[key] = value
    return kept, aliases


def _scheduler_state(scheduler) -> dict:
    """A schedule's state without its callables (a lambda is code: the live one is kept, as
    PyTorch does); nested schedules (SequentialLR's) by their own state."""
    state = {}
    for key, value in scheduler.state_dict().items():
        if isinstance(value, (list, tuple)) and value and all(_is_schedule(v) for v in value):
            state[key] = [{"__schedule__": _scheduler_state(v)} for v in value]
        elif _is_schedule(value):
            state[key] = {"__schedule__": _scheduler_state(value)}
        elif not callable(value):
            state[key] = value
    return state


def _is_schedule(value) -> bool:
    return hasattr(value, "state_dict") and hasattr(value, "load_state_dict")


def _load_scheduler(scheduler, state: dict) -> None:
    plain = {}
    for key, value in state.items():
        live = getattr(scheduler, key, None)
        if isinstance(value, list) and value and all(_is_nested(v) for v in value):
            for nested, saved in zip(live, value):
                _load_scheduler(nested, saved["__schedule__"])
        elif _is_nested(value):
            _load_scheduler(live, value["__schedule__"])
        else:
            plain[key] = value
    scheduler.load_state_dict(plain)


def _is_nested(value) -> bool:
    return isinstance(value, dict) and set(value) == {"__schedule__"}


def _dumps(value, what: str) -> str:
    return json.dumps(_encode(value, what))


def _encode(value, where: str):
    if isinstance(value, (str, bool, int, float)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"save_checkpoint: {where}: key {key!r} is not a string")
        return {key: _encode(v, f"{where}[{key!r}]") for key, v in value.items()}
    raise TypeError(
        f"save_checkpoint: {where} is a {type(value).__name__}; a checkpoint holds "
        "tensors and JSON values (str, numbers, bool, None, lists, tuples, dicts)"
    )


def _loads(metadata: dict, key: str, path: str):
    if key not in metadata:
        raise WeightsFileError(f"load_checkpoint: {path}: no {key!r} in this checkpoint")
    return json.loads(metadata[key], object_hook=_decode)


def _decode(value: dict):
    return tuple(value["__tuple__"]) if set(value) == {"__tuple__"} else value
