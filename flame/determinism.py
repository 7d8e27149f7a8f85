"""Deterministic algorithms: the same inputs give the same bits on every run.

By default FLAME may use floating-point atomics where they save memory: a row kernel that
also sums columns (layer norm's ``dw``, ``db``: ``flame/ir/passes/row_columns.py``) adds each
strip's partial sums straight into the zeroed float32 result with ``atomicAdd`` instead of
writing a ``strips x columns`` buffer that a second kernel sums. The order of those additions
varies from run to run, so the last bits of such sums may too.

``use_deterministic_algorithms(True)`` (or ``FLAME_DETERMINISTIC=1`` in the process's
environment, the starting value) keeps every reduction in a fixed order: the strips write
their partial rows and a second kernel sums them, always the same way. The choice is a
context variable, as the backend is: two threads choosing differently never see each other's
choice. It is read when a graph is planned, and the executor's plan cache keeps the two
kinds of plan apart; for ``flame.compile`` the mode is part of the signature (a change
re-traces, and ``cache_info`` says why).

    fl.use_deterministic_algorithms(True)            # for the rest of this context
    with fl.use_deterministic_algorithms(True): ...  # for this block only
"""

from __future__ import annotations

import contextvars
import os

# the starting value comes from the environment, read once: the mode is asked for on every
# plan lookup and compiled call, where an os.environ lookup would cost more than the rest
_current: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "flame_deterministic",
    default=os.environ.get("FLAME_DETERMINISTIC", "") not in ("", "0"),
)


# ``are_deterministic_algorithms_enabled() -> bool``: the context variable's own getter, with
# no Python frame around it (lazy realizes and compiled calls ask for it on every call).
are_deterministic_algorithms_enabled = _current.get


class use_deterministic_algorithms:  # noqa: N801 (PyTorch's spelling; used as a function)
    """Set the mode for the current context; as a context manager, only for the block."""

    def __init__(self, mode: bool = True):
        self.mode = bool(mode)
        self._token = _current.set(self.mode)

    def __enter__(self) -> use_deterministic_algorithms:
        return self

    def __exit__(self, *exc) -> None:
        _current.reset(self._token)
