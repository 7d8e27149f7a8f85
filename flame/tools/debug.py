"""The dump tool's entry points that ``import flame`` sees. They cost nothing until used:
the dump machinery is imported on the first call, or at import when ``FLAME_DUMP`` is set."""

from __future__ import annotations

import os


def dump(fn, *args, **kwargs):
    """``flame.dump(fn, *args)``: run ``fn(*args)``, realize what it returns, and print the
    processed IR and the kernels of every graph realized meanwhile. Keywords: ``out=DIR``
    (also write the dump folder), ``profile=True`` (GPU time per kernel), ``file=`` (where
    to print). Other keywords go to ``fn``. Returns ``fn``'s result."""
    from flame.tools.dump import dump as run_dump

    return run_dump(fn, *args, **kwargs)


def activate_from_environment() -> None:
    """``FLAME_DUMP=DIR``: record this program and write the dump to DIR when it exits."""
    if os.environ.get("FLAME_DUMP"):
        from flame.tools.dump import install_from_environment

        install_from_environment()
