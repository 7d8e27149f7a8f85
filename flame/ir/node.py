"""The IR's one node type.

A ``Node`` is immutable and hashed by structure: op name, attributes, result type and inputs.
Two nodes built the same way from the same leaves compare equal, which is what
common-subexpression elimination and the kernel caches rely on. Leaves that hold data
(``buffer``) carry their ``Storage``, which is hashed by identity: two different arrays are
two different leaves.

There is no graph object to register nodes in and no global counter: a graph is whatever is
reachable from the nodes a tensor holds.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
from typing import Any

from flame.ir.dtypes import DType

FLAME_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


Site = tuple  # (filename, line): where a node was built, the first frame outside FLAME


class Token:
    """A unique attribute value: two nodes that differ only by their token are different
    values (a recomputation must not be merged with the forward it repeats)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "token"


def format_site(site) -> str:
    return f"{os.path.basename(site[0])}:{site[1]}"


class SiteMark(dict):
    """The sites of one code object's ops: bytecode offset -> (filename, line), filled as
    ops are built (``frame.f_lineno`` scans the code's line table from its start, which
    costs more than building a node in a long user function).

    ``frame_site`` also leaves it in each user frame's ``f_trace``, so that the frame's next
    ops read their sites from the frame without reading ``frame.f_code``. That read is an
    audited event: every audit hook in the process runs on it (filelock, which PyTorch
    imports, adds two; with them each op of lazy mode paid ~0.7 us for its two audited reads
    on the H100 host). The graph builders in flame/fast_paths.py read a site straight from the
    mark and call ``frame_site`` only for a frame or offset not seen before. A mark names one
    code object, so frames of other code never read it.

    It is set only where no tracer is active and the frame has no trace function. A tracer
    started later that finds it calls it: it returns None (no line events for this frame),
    which is what a frame that started untraced gets anyway."""

    __slots__ = ("code", "in_flame", "holds", "held")

    def __init__(self, code):
        super().__init__()
        self.code = code
        self.held: dict[int, HeldSite] = {}  # offset -> the site as FLAME frames hold it
        self.in_flame = code.co_filename.startswith(FLAME_DIR)
        # a FLAME frame that can hold its user's site (``HeldSite``): not a generator's or
        # coroutine's, whose caller changes from one resumption to the next
        self.holds = self.in_flame and not code.co_flags & _RESUMABLE

    def __call__(self, frame, event, arg):
        return None


_RESUMABLE = (
    inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
    | inspect.CO_ITERABLE_COROUTINE
)  # fmt: skip


class HeldSite:
    """The user's site of a running FLAME frame, left in the frame's ``f_trace`` by
    ``frame_site``: the user frame above a running frame waits at one call until the frame
    returns, so the site stays right for the frame's whole run, and the frames an op walks
    out through (an optimizer's rule, its loop, ``step()``) are walked once per call, not
    once per op. The frame's next ops stop at it. Kept by the frame itself: it ends with the
    run, and a new call of the same code starts without one. Set, like ``SiteMark``, only
    where no tracer is active and the frame has no trace function; a tracer started later
    that calls it gets None."""

    __slots__ = ("site",)

    def __init__(self, site):
        self.site = site

    def __call__(self, frame, event, arg):
        return None


# id(code) -> SiteMark, memoized: the mark holds its code object, so the id is not reused
# while cached. A pure memo (equal inputs, equal answers): threads and tests can share it.
# Cleared when it grows past _SITE_CODES code objects (exec'd code).
_sites: dict[int, SiteMark] = {}
_SITE_CODES = 4096


def _code_sites(code) -> SiteMark:
    sites = _sites.get(id(code))
    if sites is None or sites.code is not code:
        if len(_sites) >= _SITE_CODES:
            _sites.clear()
        sites = _sites[id(code)] = SiteMark(code)
    return sites


def frame_site(
    frame, builder=False, _get=_sites.get, _id=id, _mark=SiteMark, _held=HeldSite,
    _tracer=sys.gettrace,
):  # fmt: skip
    """The site of ``frame`` if it is the user's (outside FLAME), else of the first user frame
    below it: ``user_site`` from a known frame, for the graph-building fast paths. (Names are
    bound as defaults: a hot path.) None without a Python frame (a builder run by C code
    alone).

    A walk through two or more FLAME frames leaves the site in the outermost (``HeldSite``),
    the longest-lived: after a few ops a deep caller (an optimizer's loop, the backward
    sweep) is walked out of in a step or two. ``builder``: ``frame`` is a builder's (``apply``
    builds one node and returns), not counted."""
    if frame is None:
        return None
    outer = None  # the outermost FLAME frame passed that can hold the site
    passed = 0
    skip = frame if builder else None
    while True:
        trace = frame.f_trace
        if type(trace) is _mark:
            sites = trace  # a user frame seen before: its code's sites, without f_code
            break
        if type(trace) is _held:  # a FLAME frame that an earlier op walked out of
            if passed > 1 and _tracer() is None:
                outer.f_trace = trace
            return trace.site
        code = frame.f_code
        sites = _get(_id(code))
        if sites is None or sites.code is not code:
            sites = _code_sites(code)
        if not sites.in_flame:
            if trace is None and _tracer() is None:
                frame.f_trace = sites
            break
        if trace is None and sites.holds and frame is not skip:
            outer = frame
            passed += 1
        frame = frame.f_back  # FLAME's own code: walk out to the user's
        if frame is None:
            return None
    offset = frame.f_lasti
    site = sites.get(offset)
    if site is None:
        site = sites[offset] = (sites.code.co_filename, frame.f_lineno)
    if passed > 1 and _tracer() is None:
        held = sites.held.get(offset)
        if held is None:
            held = sites.held[offset] = _held(site)
        outer.f_trace = held
    return site


def _callers_of_callers():
    """A generator that yields, each time it is resumed, the frame of whoever called the
    function that resumed it: a graph builder calling ``caller_frame(None)`` gets its own
    caller's frame. ``sys._getframe`` gives the same frame but is an audited call, and every
    audit hook in the process runs on it (filelock, imported by PyTorch, adds two: ~0.2 us
    per op on the H100 host); ``f_back`` is not audited. The generator reads its own frame
    once, when it starts."""
    me = yield
    yield None
    while True:
        yield me.f_back.f_back  # this frame <- the builder (resumed us) <- the builder's caller


def _start_callers():
    frames = _callers_of_callers()
    next(frames)
    frames.send(frames.gi_frame)
    return frames.send


# ``caller_frame(None)``, called straight from a builder: the builder's caller's frame (None if
# there is none). Raises ValueError while another thread is inside it (a generator runs in one
# thread at a time), StopIteration once closed (interpreter shutdown): the builder then asks
# ``sys._getframe``.
caller_frame = _start_callers()


def user_site() -> Site | None:
    """(filename, line) of the first frame outside FLAME: the user's line."""
    return frame_site(sys._getframe(1), True)


def builder_site() -> Site | None:
    """``user_site()`` for the node a FLAME builder (``apply``, ``apply_op``, ...) makes: the
    walk starts at the builder's caller, the builder's own frame (FLAME's) never read."""
    try:
        frame = sys._getframe(2)
    except ValueError:  # a builder called from C alone
        return None
    return frame_site(frame)


class Node:
    """One single-assignment value of the IR.

    ``buffer`` is a memo, not structure: once a node has been computed its result is kept
    there, so later graphs that reach this node read it instead of computing it again.
    ``grad_info`` is not structure either: it says which user tensor wants this value's
    gradient and which hooks rewrite it (flame/autograd.py).
    """

    __slots__ = (
        "op", "inputs", "attrs", "dtype", "shape", "site", "buffer", "grad_info", "_hash",
        "__weakref__",
    )  # fmt: skip

    def __init__(
        self,
        op: str,
        inputs: tuple[Node, ...],
        attrs: tuple[tuple[str, Any], ...],
        dtype: DType,
        shape: tuple[int, ...],
        site: Site | None = None,
    ):
        self.op = op
        self.inputs = inputs
        self.attrs = attrs
        self.dtype = dtype
        self.shape = shape
        self.site = site
        self.buffer = None
        self.grad_info = None  # autograd: the leaf tensor that asked for a gradient, hooks
        self._hash = None  # computed on first use: building a graph should not pay for it

    def __hash__(self) -> int:
        if self._hash is None:
            for node in toposort((self,), stop=lambda n: n._hash is not None):
                if node._hash is None:
                    children = [child._hash for child in node.inputs]
                    node._hash = hash((node.op, node.attrs, node.dtype.name, node.shape, *children))
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, Node) or hash(self) != hash(other):
            return False
        # Iterative, so that two long identical chains do not exhaust the recursion limit.
        stack = [(self, other)]
        while stack:
            left, right = stack.pop()
            if left is right:
                continue
            if not left._same_local(right):
                return False
            stack.extend(zip(left.inputs, right.inputs))
        return True

    def _same_local(self, other: Node) -> bool:
        return (
            hash(self) == hash(other)
            and self.op == other.op
            and self.dtype is other.dtype
            and self.shape == other.shape
            and self.attrs == other.attrs
            and attrs_key(self.attrs) == attrs_key(other.attrs)
            and len(self.inputs) == len(other.inputs)
        )

    def attr(self, name: str, default=None):
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def __repr__(self) -> str:
        shape = ",".join(str(size) for size in self.shape)
        return f"Node({self.op}: {self.dtype.short}[{shape}])"


def exact(value):
    """``value`` with its numbers told apart as generated code tells them: -0.0 from 0.0
    (equal, and hashing alike, in Python; ``-0.0f`` and ``0.0f`` in a kernel, and 1/x tells
    them apart), True, 1 and 1.0 from each other. Nodes whose attributes differ so are other
    nodes (CSE must not merge ``x * 0.0`` with ``x * -0.0``)."""
    if isinstance(value, tuple):
        return tuple(exact(item) for item in value)
    if isinstance(value, (bool, int, float)):
        text = value.hex() if isinstance(value, float) else repr(value)
        return (type(value).__name__, text)
    return value


def attrs_key(attrs):
    """``attrs`` as a key part that keeps -0.0 apart from 0.0 (equal and hashing alike in
    Python): ``attrs`` itself where no value is a negative zero (the common case, no copy),
    else ``exact(attrs)``. Plan keys and CSE use it: ``1 / (x * -0.0)`` is -inf."""
    return exact(attrs) if _negative_zero(attrs) else attrs


def _negative_zero(value) -> bool:
    """Whether a -0.0 is anywhere in ``value`` (attributes: pairs of name and value, values
    nested in tuples). Ints, strings and shapes cost a type check each. A loop, not
    recursion: ``linearize``'s walk calls it near the recursion limit."""
    stack = [value]
    while stack:
        for item in stack.pop():
            kind = type(item)
            if kind is int or kind is str:
                continue
            if kind is tuple:
                stack.append(item)
            elif isinstance(item, float) and item == 0.0 and math.copysign(1.0, item) < 0:
                return True
    return False


def toposort(outputs, stop=None, children=None) -> list[Node]:
    """Nodes reachable from ``outputs``, inputs before users, in a deterministic order.

    ``stop(node)`` true means: treat the node as a leaf (do not visit its inputs);
    ``children(node)`` replaces ``node.inputs`` as the edges to follow (autograd adds a
    checkpoint's arguments).
    """
    order: list[Node] = []
    seen: set[int] = set()
    for root in outputs:
        if id(root) in seen:
            continue
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            if stop is not None and stop(node):
                continue
            for child in reversed(node.inputs if children is None else children(node)):
                if id(child) not in seen:
                    stack.append((child, False))
    return order
