"""Backend selection: ``cuda`` (the GPU) or ``reference`` (NumPy on the CPU).

The choice is a context variable, so two threads (or two asyncio tasks) choosing different
backends never see each other's choice. ``FLAME_BACKEND`` sets the starting value.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

BACKENDS = ("cuda", "reference")

_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("flame_backend", default=None)


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


def get_backend() -> str:
    chosen = _current.get()
    if chosen is not None:
        return chosen
    return _check(os.environ.get("FLAME_BACKEND", "cuda") or "cuda")


@contextlib.contextmanager
def backend(name: str):
    """``with flame.backend("reference"): ...`` creates tensors on that backend."""
    token = _current.set(_check(name))
    try:
        yield name
    finally:
        _current.reset(token)


from flame.ir import overwritten  # noqa: E402


def realize_nodes(backend_name: str, nodes) -> None:
    """Compute and memoize ``nodes`` on ``backend_name``."""
    if overwritten._overwritten:  # an in-place write changed memory some value may read
        found = overwritten.find(nodes)
        if found is not None:
            raise RuntimeError(
                overwritten.describe(found, "this value")
                + ": realize it before the write (PyTorch computes it at once)"
            )
    if backend_name == "reference":
        from flame.runtime import events, reference
        from flame.runtime.storage import Storage

        if events.active():
            events.emit("reference", outputs=list(nodes))
        reference.realize(nodes, lambda dtype, array: Storage("reference", dtype, array=array))
        return
    _realize_on_gpu(nodes)


def _realize_on_gpu(nodes) -> None:
    """The first call checks for a GPU and binds the executor's module; later calls (lazy
    mode pays one per realize) go straight to it."""
    global _realize_on_gpu
    from flame.runtime.device import device_info
    from flame.runtime.executor import default_executor

    device_info()  # a clear error, naming the way out, when there is no GPU
    # A GPU is there: it stays for the life of the process, and so does the default
    # executor (made once, never replaced), so its method is bound here once.
    _realize_on_gpu = default_executor().realize
    _realize_on_gpu(nodes)


def synchronize() -> None:
    """Wait until the GPU has finished all work FLAME queued (no-op without a GPU)."""
    from flame.runtime.device import gpu_available

    if gpu_available():
        import cupy

        from flame.runtime.device_errors import raise_pending

        cupy.cuda.get_current_stream().synchronize()
        raise_pending()
