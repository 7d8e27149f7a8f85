"""Errors a GPU kernel finds (an out-of-range index), raised on the host at the next read.

PyTorch's CPU ops refuse an out-of-range index at the call; its CUDA kernels stop on a
device-side assertion that leaves the process unusable. FLAME's checked kernels (the gathers
and scatters of ``library_indexing.py``, ``check_index``) go on with a safe value (a gather
reads 0, a scatter drops the contribution) and record the first bad index they meet in one
64-bit word of page-locked host memory mapped into the GPU's address space: the site's code
in the top 16 bits, the offending value in the low 48. No atomics and no copy: a plain 64-bit
store from the kernel, read by the host after it has waited for the stream anyway.

The host looks at the word wherever it waits for the GPU (``Storage.numpy()``, so every
``.numpy()``/``.item()``, and ``flame.backend.synchronize()``): a recorded error is cleared
and raised there as ``IndexOutOfBounds`` (an ``IndexError`` and a ``RuntimeError``), naming
the op, the size it indexed, the value and the user's line where the op was built. As with
any asynchronous GPU error, that read may be of another value than the one indexed; the
message names the op's own line. Several bad indices: one of them is reported.

A site is (op, message, user's line); its code is a small integer handed to the kernel as an
argument, so CUDA-graph replays of a checked kernel report through the same word.
"""

from __future__ import annotations

import threading

import numpy as np

from flame.ir.node import format_site
from flame.ir.ops.indexing import IndexOutOfBounds

VALUE_BITS = 48
MAX_SITES = (1 << 15) - 1  # codes 1..MAX_SITES fit the top 16 bits as a positive int64

# The C side, included by every checked kernel (indexing_kernels.py): ``value`` is the index
# as the user wrote it, kept in the low 48 bits (two's complement).
REPORT_SOURCE = r"""
__device__ __forceinline__ void flame_report(unsigned long long* errors, unsigned long long site,
                                             long long value) {
    const unsigned long long low = (unsigned long long)value & 0xffffffffffffull;
    *(volatile unsigned long long*)errors = (site << 48) | low;
}
"""

_lock = threading.Lock()
_sites: list[tuple] = []  # code - 1 -> (op, message with {value}, the user's site)
_codes: dict[tuple, int] = {}
_word = None  # (pinned memory, host view, device pointer), made on first use


def _mapped_word():
    global _word
    if _word is None:
        with _lock:
            if _word is None:
                import cupy

                # portable (every device) and mapped into the device's address space
                flags = cupy.cuda.runtime.hostAllocPortable | cupy.cuda.runtime.hostAllocMapped
                memory = cupy.cuda.PinnedMemory(8, flags)
                view = cupy.cuda.pinned_memory.PinnedMemoryPointer(memory, 0)  # a buffer
                host = np.frombuffer(view, dtype=np.int64, count=1)
                host[0] = 0
                # unified addressing: the device sees the page at the address it has on the host
                pointer = cupy.cuda.runtime.pointerGetAttributes(memory.ptr).devicePointer
                _word = (memory, host, pointer)
    return _word


def word_pointer() -> int:
    """The device address checked kernels write to (the same for the life of the process)."""
    return _mapped_word()[2]


def site_code(op: str, message: str, site) -> int:
    """The code of a check site; ``message`` (the op's name first) holds ``{value}`` where
    the index goes."""
    key = (op, message, site)  # the line is formatted only when an error is raised
    code = _codes.get(key)
    if code is None:
        with _lock:
            code = _codes.get(key)
            if code is None:
                if len(_sites) >= MAX_SITES:  # a program with that many checked ops: reuse
                    return MAX_SITES
                _sites.append(key)
                code = _codes[key] = len(_sites)
    return code


def _value(bits: int) -> int:
    value = bits & ((1 << VALUE_BITS) - 1)
    return value - (1 << VALUE_BITS) if value >> (VALUE_BITS - 1) else value


def raise_pending() -> None:
    """Raise (and clear) the error a kernel recorded, if any. Call after waiting for the GPU."""
    if _word is None:
        return
    host = _word[1]
    recorded = int(host[0])
    if not recorded:
        return
    host[0] = 0
    code, value = recorded >> VALUE_BITS, _value(recorded)
    _, message, site = _sites[code - 1] if 0 < code <= len(_sites) else ("?", "{value}", None)
    where = format_site(site) if site is not None else "an unknown line"
    text = message.format(value=value)
    raise IndexOutOfBounds(f"{text} (found on the GPU; the op was built at {where})")
