"""Nodes whose memory an in-place write changed after they were built.

An in-place write (flame/inplace.py) gives the written tensor a new node; the old node still
names the memory, which now holds other values. A value built from the old node before the
write and not yet computed, or a backward that reads it, would silently use the new values:
PyTorch computes the first at once and refuses the second (its version counter). FLAME
refuses both, naming the line that built the value and the line that wrote over it.

Only old nodes that something still holds are kept (weakly): a loop of in-place updates
whose old nodes are dropped at once keeps this empty, and the check costs one test.
"""

from __future__ import annotations

import weakref

from flame.ir.graph import is_input
from flame.ir.node import Node, format_site, toposort
from flame.ir.views import MOVEMENT_OPS

_VIEW_OPS = (*MOVEMENT_OPS, "detach")
# id(node) -> (weak reference to the node, op that wrote, user line of the write)
_overwritten: dict[int, tuple] = {}


def note(node: Node, op: str, site) -> None:
    key = id(node)

    def forget(_reference, key=key):
        _overwritten.pop(key, None)

    _overwritten[key] = (weakref.ref(node, forget), op, site)


def find(roots) -> tuple[Node, str, object] | None:
    """The first overwritten node the graph of ``roots`` reads, with the write's op and line."""
    if not _overwritten:
        return None
    # a computed value is read from its memory: what it was computed from is not read again.
    # A view of the memory (movement ops, detach) is an alias, as in PyTorch: it reads the
    # new values, rightly; only an op computing from it (through views) read the old ones.
    for node in toposort(list(roots), stop=is_input):
        if node.op in _VIEW_OPS or is_input(node):
            continue
        for child in node.inputs:
            while child.op in _VIEW_OPS and not is_input(child):
                if _entry(child) is not None:
                    break
                child = child.inputs[0]
            entry = _entry(child)
            if entry is not None:
                return child, entry[1], entry[2]
    return None


def _entry(node: Node):
    entry = _overwritten.get(id(node))
    return entry if entry is not None and entry[0]() is node else None


def describe(found, what: str) -> str:
    node, op, site = found
    built = format_site(node.site) if node.site is not None else "an unknown line"
    return (
        f"{what} reads a {node.dtype.name}{list(node.shape)} tensor (from {built}) that an "
        f"in-place {op} at {format_site(site) if site else 'an unknown line'} overwrote "
        "afterwards"
    )
