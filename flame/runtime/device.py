"""The CUDA device: is there one, what is it. Only this package imports CuPy."""

from __future__ import annotations

import functools
import os

from flame.records import Record


class NoGPUError(RuntimeError):
    """Realizing on the CUDA backend with no usable GPU."""


class DeviceInfo(Record, frozen=True):
    """The GPU FLAME runs on, as the runtime reports it."""

    name: str
    arch: str  # e.g. "sm_90"
    multiprocessors: int
    l2_bytes: int


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[DeviceInfo | None, str]:
    try:
        import cupy
    except ImportError as error:
        return None, f"CuPy is not installed ({error}); install flame[cuda12] or flame[cuda13]"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, no device: CuPy raises its own runtime errors
        return None, f"no CUDA driver or device ({type(error).__name__}: {error})"
    if count == 0:
        return None, "no CUDA device is visible"
    properties = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = properties["name"]
    name = name.decode() if isinstance(name, bytes) else name
    arch = f"sm_{properties['major']}{properties['minor']}"
    info = DeviceInfo(name, arch, properties["multiProcessorCount"], properties["l2CacheSize"])
    return info, ""


def device_info() -> DeviceInfo:
    info, reason = _probe()
    if info is None:
        raise NoGPUError(
            f"FLAME cannot run on the CUDA backend: {reason}. To run on the CPU with the NumPy "
            "reference interpreter, set FLAME_BACKEND=reference or use "
            "`with flame.backend('reference'):`."
        )
    return info


def gpu_available() -> bool:
    return _probe()[0] is not None


def gpu_unavailable_reason() -> str:
    return _probe()[1]


def target_arch() -> str:
    """The arch kernels are compiled for: the device's, else ``FLAME_ARCH``, else sm_90."""
    override = os.environ.get("FLAME_ARCH")
    if override:
        return override
    info, _ = _probe()
    return info.arch if info is not None else "sm_90"
