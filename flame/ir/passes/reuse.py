"""The fusion pass's decisions, made once and applied again at other sizes.

A compiled training step called at a new image size or batch size is traced and planned
again; the fusion pass is the largest part of that plan (notes/new-resolution.md,
notes/plan-reuse.md). Its decisions -- which values are written, which nodes each kernel
computes, the kernels' order -- are made from the graph's structure and hold at any size
as long as the values each kernel groups still share their shapes. So a ``Decisions``
object keeps, per ``structure_key`` of a graph fusion was asked about (and the values the
save-or-recompute pass asked it to save, by position), the groups it made, by node
position; a later graph with the same key gets those groups over its own nodes instead of
being fused again.

A recorded grouping is applied only where it is still one fusion could have made:

* each group's shapes relate as they did: the same members, values it reads and row keys
  (a reduction's input shape and its per-row shapes) have equal shapes (``_signature``);
  shapes that were equal by coincidence at one size (a batch of 64 and 64 channels, a
  square image's transpose) and differ at another refuse the grouping;
* the graph outputs handed out as views (``handed_out``) are the same ones;

otherwise the graph is fused in full (and that grouping recorded too). Decisions that
follow sizes by design are made again at every size: the passes before fusion run in full
(split reductions, the late-read copies: their different graphs have other keys), and the
save-or-recompute cut (remat.py) is computed again; only the fusion it asks for is reused.
What lowering decides from sizes (size classes, vector widths) is decided there as before.

The cache is owned by its executor (``Executor.decisions``) and made current for one
pipeline run (``run_pipeline(..., decisions=)``); ``FLAME_PLAN_REUSE=0`` turns reuse off.
Its ``store`` (flame/runtime/fusion_store.py: beside the plans on disk) keeps the groupings
of big graphs for later processes: a process whose first step loaded its plan from disk
never ran the fusion pass, and would otherwise fuse a new resolution's graph in full. A
grouping read back is applied under the same checks as one made in this process.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import os
import threading
from collections import OrderedDict

from flame.ir.graph import Graph, Group, is_input
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.row_keys import kept_shape, row_key, scalar_shapes
from flame.ir.structure import is_inline, structure

MAX_GRAPHS = 64  # structure keys kept (least recently used dropped first)
MAX_PER_KEY = 2  # groupings kept per key (one refused at a size is kept with the new one)

_current: contextvars.ContextVar[_Run | None] = contextvars.ContextVar(
    "flame_fusion_decisions", default=None
)


def enabled() -> bool:
    return os.environ.get("FLAME_PLAN_REUSE", "1") not in ("0", "")


def current() -> _Run | None:
    """The decisions of the pipeline running in this thread, if it reuses them."""
    return _current.get()


@contextlib.contextmanager
def using(decisions: Decisions | None):
    """``decisions`` answer the fusions of the passes run inside (none with reuse off)."""
    run = _Run(decisions) if decisions is not None and enabled() else None
    token = _current.set(run)
    try:
        yield
    finally:
        _current.reset(token)


class _Run:
    """One pipeline run's use of a ``Decisions``: remembers the last graph it keyed (the
    save-or-recompute pass fuses a graph of the same outputs again)."""

    __slots__ = ("decisions", "outputs", "digest", "nodes")

    def __init__(self, decisions: Decisions):
        self.decisions = decisions
        self.outputs: tuple[Node, ...] = ()
        self.digest = b""
        self.nodes: list[Node] = []

    def fuse(self, graph: Graph, saved, run) -> Graph:
        return self.decisions.fuse(graph, saved, run, self)

    def key(self, graph: Graph) -> tuple[bytes, list[Node]]:
        """The structure key's digest and its node order (``structure``)."""
        same = len(self.outputs) == len(graph.outputs) and all(
            a is b for a, b in zip(self.outputs, graph.outputs)
        )  # fmt: skip
        if not same:
            key, self.nodes = structure(graph)
            self.digest = hashlib.blake2b(repr(key).encode(), digest_size=20).digest()
            self.outputs = graph.outputs
        return self.digest, self.nodes


class Decisions:
    """Fusion groupings by graph structure (see the module docstring). Thread-safe."""

    def __init__(self, max_graphs: int = MAX_GRAPHS):
        self.max_graphs = max_graphs
        self._entries: OrderedDict[bytes, list[_Recorded]] = OrderedDict()
        self._lock = threading.Lock()
        self.reused = 0  # fusions answered by a recorded grouping
        self.fused = 0  # fusions run in full (no grouping of that structure yet)
        self.refused = 0  # fusions run in full: a recorded grouping did not fit the sizes
        self.unrecorded = 0  # fusions whose groups could not be named by position
        self.read = 0  # groupings read from ``store`` (made by an earlier process)
        # groupings on disk (``get(key) -> list of plain data | None``, ``put(key, list)``),
        # for graphs of at least ``store.min_nodes`` nodes; None: this process only
        self.store = None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.reused = self.fused = self.refused = self.unrecorded = self.read = 0

    def fuse(self, graph: Graph, saved, run, state: _Run) -> Graph:
        """``run(graph, saved)`` (the fusion pass), or its recorded answer for a graph of
        the same structure and saves, applied to ``graph``'s nodes."""
        digest, nodes = state.key(graph)
        position = {id(node): index for index, node in enumerate(nodes)}
        key = digest + _saved_key(saved, position) + _mode()
        with self._lock:
            found = list(self._entries.get(key, ()))
            if found:
                self._entries.move_to_end(key)
        store = self.store
        if store is not None and len(nodes) < store.min_nodes:
            store = None  # a small graph fuses in milliseconds: no file
        if not found and store is not None:
            found = _read(store, key, len(nodes))
            if found:
                with self._lock:
                    self.read += 1
                    self._entries[key] = found
                    while len(self._entries) > self.max_graphs:
                        self._entries.popitem(last=False)
        for recorded in found:
            try:
                groups = recorded.apply(graph, nodes, saved)
            except IndexError:  # a stored grouping naming an input or output not there
                groups = None
            if groups is not None:
                with self._lock:
                    self.reused += 1
                return Graph(graph.outputs, graph.name, groups)
        result = run(graph, saved)
        recorded = _Recorded.of(graph, nodes, position, result)
        with self._lock:
            if found:
                self.refused += 1
            else:
                self.fused += 1
            if recorded is None:
                self.unrecorded += 1
            else:
                kept = [recorded, *self._entries.get(key, ())][:MAX_PER_KEY]
                self._entries[key] = kept
                self._entries.move_to_end(key)
                while len(self._entries) > self.max_graphs:
                    self._entries.popitem(last=False)
        if recorded is not None and store is not None:
            store.put(key, [entry.data() for entry in kept])
        return result


def _read(store, key: bytes, count: int) -> list[_Recorded]:
    """The groupings ``store`` holds for ``key`` (a graph of ``count`` nodes); none where
    its data does not parse or names a node the graph does not have."""
    data = store.get(key)
    if not isinstance(data, list):
        return []
    try:
        found = [_Recorded.from_data(entry) for entry in data][:MAX_PER_KEY]
    except (TypeError, ValueError, KeyError, IndexError):
        return []
    for recorded in found:
        for _, members, outputs, _ in recorded.groups:
            for where in (*members, *outputs):
                at = where if type(where) is int else where[0]
                if at >= count or (at < 0 and type(where) is int):
                    return []  # (-1, i): the graph's output i; any other negative: none
                if type(where) is not int and (where[1] < 0 or at < -1):
                    return []
        if any(not 0 <= at < count for at in recorded.handed_out):
            return []
    return found


# Settings the fusion pass reads besides the graph (module, name): a test or a probe that
# patches one gets groupings of its own, in memory and on disk
FUSION_SETTINGS = (
    ("flame.ir.passes.fuse", "MAX_REDUCE_OUTPUTS"),
    ("flame.ir.passes.fuse", "MAX_ELEMENTWISE_OUTPUTS"),
    ("flame.ir.passes.row_columns", "PARTIAL_TOTALS"),
    ("flame.ir.passes.row_columns", "ROW_COLUMN_VALUES"),
    ("flame.ir.passes.materialize", "BROADCAST_COST_OF_REDUCTIONS"),
    ("flame.ir.passes.materialize", "WIDE_SOURCES"),
    ("flame.ir.passes.materialize", "FUSED_WIDE_SOURCES"),
    ("flame.ir.passes.cost", "RECOMPUTE_LIMIT"),
)


def _mode() -> bytes:
    """What decides fusion besides the graph: deterministic algorithms keep a row kernel's
    column sums out of atomics (row_columns.py), another grouping of the same graph; and the
    fusion settings (``FUSION_SETTINGS``)."""
    import importlib

    from flame.determinism import are_deterministic_algorithms_enabled

    values = [are_deterministic_algorithms_enabled()]
    for module, name in FUSION_SETTINGS:
        values.append(getattr(importlib.import_module(module), name))
    return repr(values).encode()


def _saved_key(saved, position: dict[int, int]) -> bytes:
    """The save-or-recompute pass's saves by position (their reasons are for the dump)."""
    if not saved:
        return b""
    parts = [
        (position.get(id(node), -1), -1 if anchor is None else position.get(id(anchor), -1))
        for node, _, anchor in saved
    ]  # fmt: skip
    return hashlib.blake2b(repr(parts).encode(), digest_size=12).digest()


class _Recorded:
    """One fusion's answer by node position, with what must hold to apply it again."""

    __slots__ = ("groups", "signatures", "handed_out")

    def __init__(self, groups, signatures, handed_out):
        self.groups = groups  # per group: (kind, member positions, output positions, reasons)
        self.signatures = signatures  # per group: ``_signature``
        self.handed_out = handed_out  # positions of the outputs handed out as views

    @classmethod
    def of(cls, graph: Graph, nodes: list[Node], position: dict, result: Graph):
        """None when a group holds a node it cannot name by position (nothing to replay)."""
        from flame.ir.passes.fuse import handed_out

        readers = _first_readers(graph, nodes)
        groups = []
        for group in result.groups:
            members = _positions(group.nodes, group.nodes, position, readers)
            outputs = _positions(group.outputs, group.nodes, position, readers)
            if members is None or outputs is None:
                return None
            groups.append((group.kind, members, outputs, group.reasons))
        signatures = tuple(
            () if group.kind == "library" else _signature(group.nodes) for group in result.groups
        )  # fmt: skip
        views = [position.get(key, -1) for key in handed_out(graph)]
        if -1 in views:
            return None
        return cls(tuple(groups), signatures, tuple(sorted(views)))

    def data(self) -> dict:
        """Plain data (lists, ints, strings): what ``store`` writes."""
        return {"groups": [[kind, _plain(members), _plain(outputs), list(why)]
                           for kind, members, outputs, why in self.groups],
                "signatures": [list(signature) for signature in self.signatures],
                "handed_out": list(self.handed_out)}  # fmt: skip

    @classmethod
    def from_data(cls, data: dict) -> _Recorded:
        """``data()`` read back; raises on anything that is not its shape."""
        groups = []
        for kind, members, outputs, why in data["groups"]:
            if not isinstance(kind, str) or not all(isinstance(text, str) for text in why):
                raise ValueError("a group's kind and reasons are strings")
            groups.append((kind, _positions_of(members), _positions_of(outputs), tuple(why)))
        signatures = tuple(tuple(int(n) for n in signature) for signature in data["signatures"])
        if len(signatures) != len(groups):
            raise ValueError("one signature a group")
        return cls(tuple(groups), signatures, tuple(int(n) for n in data["handed_out"]))

    def apply(self, graph: Graph, nodes: list[Node], saved) -> tuple[Group, ...] | None:
        """The recorded groups over ``nodes``, or None where they do not fit its sizes."""
        from flame.ir.passes.fuse import handed_out

        position = {id(node): index for index, node in enumerate(nodes)}
        views = sorted(position.get(key, -1) for key in handed_out(graph))
        if tuple(views) != self.handed_out:
            return None
        # the reasons of values saved for later kernels name this size's bytes
        reasons = {id(node): reason for node, reason, _ in saved}
        outputs_of = [_nodes_at(outputs, nodes, graph) for _, _, outputs, _ in self.groups]
        leaves = {id(node) for written in outputs_of for node in written if is_inline(node)}
        groups = []
        for (kind, members, _, why), written, signature in zip(
            self.groups, outputs_of, self.signatures
        ):
            group_nodes = _members_at(members, nodes, graph, leaves)
            if kind != "library" and _signature(group_nodes) != signature:
                return None
            if len({id(node) for node in written}) != len(written):
                return None  # two written leaves are one node at this size
            if reasons:
                why = tuple(reasons.get(id(node), old) for node, old in zip(written, why))
            groups.append(Group(kind, group_nodes, tuple(written), why))
        return tuple(groups)


def _plain(positions: tuple) -> list:
    return [where if type(where) is int else list(where) for where in positions]


def _positions_of(items: list) -> tuple:
    """``_plain`` read back: ints, or ``[position, input index]`` pairs."""
    found = []
    for item in items:
        if type(item) is int:
            found.append(item)
        elif isinstance(item, list) and len(item) == 2 and all(type(n) is int for n in item):
            found.append(tuple(item))
        else:
            raise ValueError(f"not a node position: {item!r}")
    return tuple(found)


def _first_readers(graph: Graph, nodes: list[Node]) -> dict[int, tuple[int, int]]:
    """Per leaf spelled inline (``is_inline``): where it is read first, ``(position, input
    index)``, or ``(-1, index)`` for a graph output."""
    readers: dict[int, tuple[int, int]] = {}
    for index, node in enumerate(graph.outputs):
        if is_inline(node):
            readers.setdefault(id(node), (-1, index))
    for where, node in enumerate(nodes):
        for index, child in enumerate(node.inputs):
            if is_inline(child):
                readers.setdefault(id(child), (where, index))
    return readers


def _positions(values, members, position: dict, readers: dict) -> tuple | None:
    """``values`` by position; a leaf spelled inline (``is_inline``) by a member that reads
    it, ``(position, input index)``, else by where the graph reads it first. None where one
    cannot be named so."""
    inside = {}
    for member in members:
        where = position.get(id(member))
        if where is not None:
            for index, child in enumerate(member.inputs):
                if is_inline(child):
                    inside.setdefault(id(child), (where, index))
    found = []
    for node in values:
        where = position.get(id(node))
        if where is None:
            where = inside.get(id(node), readers.get(id(node)))
            if where is None:
                return None
        found.append(where)
    return tuple(found)


def _nodes_at(positions: tuple, nodes: list[Node], graph: Graph) -> list[Node]:
    found = []
    for where in positions:
        if type(where) is int:
            found.append(nodes[where])
        elif where[0] < 0:
            found.append(graph.outputs[where[1]])
        else:
            found.append(nodes[where[0]].inputs[where[1]])
    return found


def _members_at(positions: tuple, nodes: list[Node], graph: Graph, written) -> tuple[Node, ...]:
    """The members ``_positions`` named, in their order, each once. Leaves may be merged or
    apart at another size (two constants of equal value are one node): a leaf a member
    reads that was not named, and no kernel writes (``written``), is computed in the
    kernel as fusion would have it: put right before that member."""
    found: dict[int, Node] = {}
    for node in _nodes_at(positions, nodes, graph):
        if id(node) in found:
            continue
        for child in node.inputs:
            if is_inline(child) and id(child) not in found and id(child) not in written:
                found[id(child)] = child
        found[id(node)] = node
    return tuple(found.values())


def _signature(members) -> tuple:
    """Which shapes of a group are equal: its members', the computed values it reads', and
    the row keys' (input shape and per-row shapes) of the reductions among both, each
    numbered by its first appearance. Fusion groups values by equal shapes and row keys; a
    grouping made where two of these were equal is another kernel where they are not. (The
    graph's inputs are read through views of any shape: not counted. Nor is what a kernel
    of elementwise ops loads through a permute, a slice, a reshape or an expand: that load
    is an index map of any shape, and the value stays in memory whatever its shape: a
    transposing copy of a square matrix at one size is the same kernel at another.)"""
    numbers: dict[tuple, int] = {}
    member_ids = {id(node) for node in members}
    loads_through_views = all(
        get_op(node.op).kind in ("elementwise", "movement") for node in members
        if not is_inline(node)
    )  # fmt: skip
    found = []
    for node in members:
        if is_inline(node):
            continue  # a constant or an arange: any shape is computed where it is read
        found.append(numbers.setdefault(node.shape, len(numbers)))
        if loads_through_views and get_op(node.op).kind == "movement":
            continue
        for child in node.inputs:
            if id(child) not in member_ids and not is_inline(child) and not is_input(child):
                found.append(numbers.setdefault(child.shape, len(numbers)))
                if not is_input(child) and get_op(child.op).kind == "reduce":
                    found.extend(_row_numbers(child, numbers))
        if get_op(node.op).kind == "reduce":
            found.extend(_row_numbers(node, numbers))
    return tuple(found)


def _row_numbers(node: Node, numbers: dict) -> list[int]:
    key = row_key(node)
    shapes = (key[0], kept_shape(key), *scalar_shapes(key))
    return [numbers.setdefault(shape, len(numbers)) for shape in shapes]
