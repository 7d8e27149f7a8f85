"""What the compiler did, for whoever asks: the dump tool, `flame check`, tests.

A *recorder* is a callable ``recorder(kind, data)``. ``with recording(recorder):`` installs it
for the current context (a context variable: other threads and other tests never see it), and
every ``emit`` inside calls it. With no recorder installed, ``emit`` costs one context-variable
read, so the hot paths can always call it.

Events (``kind``: keys of ``data``):

- ``"plan"``: ``plan`` (executor Plan), ``passes`` (list of PassRecord), ``seconds``, ``cached``
  (False: just built; True: found in the plan cache, ``passes`` empty).
- ``"run"``: ``plan``, ``times`` (per launch: GPU milliseconds, or None) -- only timed when a
  recorder has ``profile = True``.
- ``"kernel"``: ``name``, ``origin`` ("memory" | "disk" | "compiled"), ``seconds``, ``key``,
  ``source`` (a function that renders the CUDA source), ``reason`` (for a disk load or a
  compile: what changed since the last kernel of these operations, ``flame.codegen.explain``).
- ``"reference"``: ``outputs`` (the nodes the reference interpreter realized).
- ``"trace"``: ``function`` (qualified name), ``reason`` (why the signature missed), ``seconds``.
"""

from __future__ import annotations

import contextlib
import contextvars

_recorders: contextvars.ContextVar[tuple] = contextvars.ContextVar("flame_recorders", default=())


# ``active() -> tuple``: the recorders installed in this context (empty: nobody is
# listening). The context variable's own getter, with no Python frame around it: every lazy
# realize and compiled call asks.
active = _recorders.get


def emit(kind: str, **data) -> None:
    for recorder in _recorders.get():
        recorder(kind, data)


def profiling() -> bool:
    """Whether a recorder asked for per-launch GPU times."""
    return any(getattr(recorder, "profile", False) for recorder in _recorders.get())


@contextlib.contextmanager
def recording(recorder):
    token = _recorders.set(_recorders.get() + (recorder,))
    try:
        yield recorder
    finally:
        _recorders.reset(token)
