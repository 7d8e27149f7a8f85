"""Start cuBLAS in the background while the first plans are built.

The first cuBLAS matrix product of a process costs about 0.1 s on the H100 here (the library
loads its kernels and heuristics; measured in notes/performance.md), whatever its size: a
training step's first call pays it after tracing and planning, on its critical path. When the
CUDA executor starts, a daemon thread runs one tiny product per common dtype on a stream and
handle of its own, through ctypes so that the GIL is released while cuBLAS initializes (CuPy's
wrappers keep it). The caller's first real product then finds the library warm.

``FLAME_CUBLAS_WARMUP=0`` turns it off. Any failure here is silent by design: the real call
will initialize cuBLAS itself and report its own errors.
"""

from __future__ import annotations

import ctypes
import os
import threading

# cudaDataType and cublasComputeType_t values from the cuBLAS headers
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_SIZE = 64

_started = threading.Event()  # once per process: cuBLAS state is per process too


def start() -> threading.Thread | None:
    """Start the warm-up thread once per process; returns it (None when off or done)."""
    if os.environ.get("FLAME_CUBLAS_WARMUP", "1") == "0" or _started.is_set():
        return None
    _started.set()
    thread = threading.Thread(target=warm_now, name="flame-cublas-warmup", daemon=True)
    thread.start()
    return thread


def _library_path(fragment: str) -> str | None:
    """The path of a shared library already mapped into this process."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().split(" ")[-1]
                if fragment in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


def warm_now() -> bool:
    """One tiny product per dtype through a handle of its own; True when all ran."""
    try:
        import cupy
        from cupy.cuda import cublas  # noqa: F401  (CuPy maps libcublas: we use that one)

        path = _library_path("libcublas.so")
        if path is None:
            return False
        lib = ctypes.CDLL(path)
        handle = ctypes.c_void_p()
        if lib.cublasCreate_v2(ctypes.byref(handle)) != 0:
            return False
        statuses = []
        stream = cupy.cuda.Stream(non_blocking=True)
        try:
            lib.cublasSetStream_v2(handle, ctypes.c_void_p(stream.ptr))
            with stream:
                buffer = cupy.zeros(3 * _SIZE * _SIZE, dtype=cupy.float32)
                alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
                step = 4 * _SIZE * _SIZE  # bytes of one float32 matrix
                pointers = [ctypes.c_void_p(buffer.data.ptr + i * step) for i in range(3)]
                for data_type in (_CUDA_R_16BF, _CUDA_R_16F, _CUDA_R_32F):
                    status = lib.cublasGemmEx(
                        handle, 0, 0, _SIZE, _SIZE, _SIZE, ctypes.byref(alpha),
                        pointers[0], data_type, _SIZE, pointers[1], data_type, _SIZE,
                        ctypes.byref(beta), pointers[2], data_type, _SIZE,
                        _CUBLAS_COMPUTE_32F, _CUBLAS_GEMM_DEFAULT,
                    )  # fmt: skip
                    statuses.append(status)
                stream.synchronize()
                del buffer
        finally:
            lib.cublasDestroy_v2(handle)
        return statuses == [0, 0, 0]
    except Exception:  # noqa: BLE001  best effort: the real call reports real errors
        return False
