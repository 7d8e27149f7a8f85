"""What a call of a compiled function is keyed by (flame/compile.py says why).

Per argument, an *exact* entry (a tensor's backend, dtype, shape and layout; another value's
type and value) keys the fast path, and a *generic* entry (rank, broadcast pattern and
layout in place of sizes) keys the signature, whose change is a miss and a new trace. A miss
says which part changed.
"""

from __future__ import annotations

from flame.ir.shapes import contiguous_strides
from flame.runtime.storage import storage_of
from flame.tensor import Tensor


def exact_entry(value):
    """An argument's exact description (a tensor's backend, dtype, shape and layout; another
    value's type and value): the fast path's key."""
    if isinstance(value, Tensor):
        return (value.backend, value.dtype, value.node.shape, storage_of(value.node).layout())
    if isinstance(value, list):
        return (list, tuple(value))
    return (type(value), value)


def generic_entry(value):
    """What changes the code: see the module's docstring (flame.compile's)."""
    if isinstance(value, Tensor):
        shape = value.node.shape
        strides, aligned = storage_of(value.node).layout()
        contiguous = tuple(strides) == tuple(contiguous_strides(shape)) and aligned
        layout = "contiguous" if contiguous else (tuple(strides), aligned)
        ones = tuple(size == 1 for size in shape)
        return ("tensor", value.backend, value.dtype.name, len(shape), ones, layout)
    if isinstance(value, (int, float, bool, str, type(None))):
        return ("static", type(value).__name__, value)
    if isinstance(value, (tuple, list)) and all(
        isinstance(item, (int, float, bool, str, type(None))) for item in value
    ):
        return ("static", type(value).__name__, tuple(value))
    raise TypeError(
        f"flame.compile: arguments must be tensors or Python numbers, strings or tuples of "
        f"them, got {type(value).__name__}"
    )


def shown(entry) -> str:
    """A generic entry as the cache's reasons spell it."""
    if entry[0] == "tensor":
        _, backend, dtype, rank, ones, layout = entry
        pattern = "".join("1" if one else "n" for one in ones)
        where = "" if layout == "contiguous" else f", strides {layout[0]}"
        return f"{dtype} rank {rank} [{pattern}] on {backend}{where}"
    return f"{entry[1]} {entry[2]!r}"


def _autocast(dtype) -> str:
    return "off" if dtype is None else dtype.name


def miss_reason(signatures: dict, generic: tuple) -> str:
    """Why ``generic`` missed: what differs from the newest of ``signatures``."""
    if not signatures:
        return "first call"
    previous = next(reversed(signatures))
    if previous[0][1] != generic[0][1]:
        return f"deterministic algorithms {'on' if generic[0][1] else 'off'} (a new plan)"
    if previous[0][2] != generic[0][2]:  # the autocast dtype (flame/amp/autocast_mode.py)
        old, new = _autocast(previous[0][2]), _autocast(generic[0][2])
        return f"autocast changed: {old} -> {new} (a new trace)"
    if previous[0] != generic[0]:
        return f"arguments passed as {generic[0][0]} instead of {previous[0][0]}"
    names = generic[0][0]
    for position, (old, new) in enumerate(zip(previous[1:], generic[1:])):
        if old != new:
            name = names[position] if position < len(names) else f"#{position}"
            return f"argument {name!r}: {shown(old)} -> {shown(new)}"
    return f"{len(generic) - 1} arguments instead of {len(previous) - 1}"
