"""Start cuBLAS in the background while the first plans are built.

The first cuBLAS matrix product of a process costs about 0.1 s on the H100 here (the library
loads its kernels and heuristics; measured in notes/performance.md), whatever its size: a
training step's first call pays it after tracing and planning, on its critical path. When the
CUDA executor starts, a daemon thread runs one tiny product per common dtype on a stream and
handle of its own, through ctypes so that the GIL is released while cuBLAS initializes (CuPy's
wrappers keep it). The caller's first real product then finds the library warm.

``FLAME_CUBLAS_WARMUP=0`` turns it off. A CUDA-graph capture waits for the thread first
(``finish``): cuBLAS starting beside a capture invalidates it. Any failure here is silent by
design: the real call will initialize cuBLAS itself and report its own errors.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading

# cudaDataType and cublasComputeType_t values from the cuBLAS headers
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_SIZE = 64

_started = threading.Event()  # once per process: cuBLAS state is per process too
_thread: threading.Thread | None = None


def start() -> threading.Thread | None:
    """Start the warm-up thread once per process; returns it (None when off or done)."""
    global _thread
    if os.environ.get("FLAME_CUBLAS_WARMUP", "1") == "0" or _started.is_set():
        return None
    _started.set()
    thread = threading.Thread(target=warm_now, name="flame-cublas-warmup", daemon=True)
    _thread = thread
    thread.start()
    # a process that ends while cuBLAS is starting would tear CUDA down under the thread
    atexit.register(thread.join, 30.0)
    return thread


def warm_now() -> bool:
    """One tiny product per dtype through a handle of its own; True when all ran."""
    try:
        import cupy

        from flame.runtime.cublas import library

        lib = library()  # CuPy loads libcublas; its entry points bound with ctypes
        handle = ctypes.c_void_p()
        lib.Create(ctypes.byref(handle))
        stream = cupy.cuda.Stream(non_blocking=True)
        try:
            lib.SetStream(handle, stream.ptr)
            with stream:
                buffer = cupy.zeros(3 * _SIZE * _SIZE, dtype=cupy.float32)
                alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
                step = 4 * _SIZE * _SIZE  # bytes of one float32 matrix
                a, b, c = (buffer.data.ptr + i * step for i in range(3))
                for data_type in (_CUDA_R_16BF, _CUDA_R_16F, _CUDA_R_32F):
                    lib.GemmEx(
                        handle, 0, 0, _SIZE, _SIZE, _SIZE, ctypes.addressof(alpha),
                        a, data_type, _SIZE, b, data_type, _SIZE,
                        ctypes.addressof(beta), c, data_type, _SIZE,
                        _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
                    )  # fmt: skip
                stream.synchronize()
                del buffer
        finally:
            lib.Destroy(handle)
        return True
    except Exception:  # noqa: BLE001  best effort: the real call reports real errors
        return False


def finish(timeout: float = 30.0) -> None:
    """Wait for the warm-up thread, if one runs: called before a CUDA-graph capture begins.
    cuBLAS starting on that thread invalidated a capture under way on another thread (a
    small compiled step captured within ~0.1 s of its first launches failed its capture
    every time, and was then run launch by launch for good)."""
    thread = _thread
    if thread is not None and thread.is_alive() and thread is not threading.current_thread():
        thread.join(timeout)
