"""The few cuBLAS entry points FLAME calls, bound with ctypes to the libcublas CuPy loaded.

Why not CuPy's wrappers: they refuse to run while a stream is being captured into a CUDA
graph ("calling cuBLAS API during stream capture is currently unsupported"), although cuBLAS
itself supports capture; and they hold the GIL for the whole call, which ctypes releases.
The library is the one CuPy mapped into the process (found in ``/proc/self/maps``), so
handles from ``cupy.cuda.device.get_cublas_handle()`` are valid here.
"""

from __future__ import annotations

import ctypes
import functools
import os
from types import SimpleNamespace

_void, _int, _int64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong


class CublasError(RuntimeError):
    pass


def mapped_library(fragment: str) -> str | None:
    """The path of a shared library already mapped into this process, or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip().split(" ")[-1]
                if fragment in os.path.basename(path):
                    return path
    except OSError:
        return None
    return None


_SIGNATURES = {
    "cublasCreate_v2": (ctypes.POINTER(_void),),
    "cublasDestroy_v2": (_void,),
    "cublasSetStream_v2": (_void, _void),
    "cublasGetMathMode": (_void, ctypes.POINTER(_int)),
    "cublasSetMathMode": (_void, _int),
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype,
    # ldc, computeType, algo
    "cublasGemmEx": (_void, _int, _int, _int, _int, _int, _void, _void, _int, _int, _void,
                     _int, _int, _void, _void, _int, _int, _int, _int),
    # as above with a 64-bit stride after each leading dimension, and the batch count
    "cublasGemmStridedBatchedEx": (_void, _int, _int, _int, _int, _int, _void, _void, _int,
                                   _int, _int64, _void, _int, _int, _int64, _void, _void,
                                   _int, _int, _int64, _int, _int, _int),
}  # fmt: skip


@functools.lru_cache(maxsize=1)
def library() -> SimpleNamespace:
    """The bound functions; each raises ``CublasError`` on a non-zero status."""
    import cupy

    cupy.cuda.device.get_cublas_handle()  # makes CuPy load libcublas (and its handle)
    path = mapped_library("libcublas.so")
    if path is None:
        raise CublasError("libcublas is not mapped into this process after CuPy loaded it")
    lib = ctypes.CDLL(path)
    bound = {}
    for name, argtypes in _SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = _int
        bound[name.removeprefix("cublas").removesuffix("_v2")] = _checked(name, function)
    return SimpleNamespace(**bound)


def _checked(name, function):
    def call(*arguments):
        status = function(*arguments)
        if status != 0:
            raise CublasError(f"{name} failed with cuBLAS status {status}")

    call.__name__ = name
    return call


def math_mode(handle: int) -> int:
    mode = _int()
    library().GetMathMode(handle, ctypes.byref(mode))
    return mode.value
