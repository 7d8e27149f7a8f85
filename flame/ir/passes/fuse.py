"""Fusion: group the graph into kernels.

Afterwards: ``graph.groups`` lists kernels in an order that respects their dependencies, and
every computed node is in at least one group. A group writes its ``outputs``; everything
else it computes stays in registers. Kinds:

* ``elementwise``: one shape; every member is evaluated per output element;
* ``reduce``: one or more reductions that share an input shape and axes (a *row key*), with
  their elementwise prologue (input-shaped values) and epilogue (values of the reduced
  shape), and values that combine a reduction broadcast back over the input with the input
  itself: softmax, layer norm and RMS norm are one ``reduce`` group that reads each row once
  and writes it once;
* ``library``: one library call (matmul, gathers, ...).

Rules, each with the reason recorded for the dump:

1. A value is *materialized* (written to memory) when it is a graph output; the result or a
   computed input of a library call; a computation broadcast to a larger shape that would
   cost more than ``RECOMPUTE_LIMIT`` ops per element to recompute; the input of a reshape
   that cannot be a strided view; or a reduction a kernel of another kind or key needs;
   or a value the save-or-recompute pass (remat.py) saves for later kernels.
2. Materialized values of one shape (elementwise) or one row key (reduce) share a kernel.
3. Kernels read materialized values of other kernels, never recompute them.
"""

from __future__ import annotations

import graphlib

from flame.ir.graph import Graph, Group, is_input
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes import reuse
from flame.ir.passes.cycles import split_cycles
from flame.ir.passes.library_views import (
    materialized_reads,
    output_view,
    own_view,
)
from flame.ir.passes.materialize import materialized_values
from flame.ir.passes.row_columns import attach_columns
from flame.ir.passes.row_keys import (
    is_row_alias,
    row_key,
    row_shapes,
    row_view_fits,
    scalar_shapes,
    written_in_row_order,
)
from flame.ir.views import MOVEMENT_OPS, View, resolve

MAX_REDUCE_OUTPUTS = 32  # values one reduce kernel writes (its shared-memory scratch, 1 KiB each)
MAX_ELEMENTWISE_OUTPUTS = 64  # values one elementwise kernel writes (its compile time)


def handed_out(graph: Graph) -> dict[int, tuple[Node, Node]]:
    """Graph outputs handed out as views (``output_view``: of a library call's result or of a
    row kernel's value), as ``id -> (output, the value it views)``: only those no other value
    of the graph reads, since the plan's kernels take every value they read from an earlier
    kernel to be laid out contiguously."""
    read = {id(child) for node in graph.nodes for child in node.inputs}
    rows = row_shapes(graph)
    candidates = [node for node in graph.outputs if not is_input(node) and id(node) not in read]
    bases = [(node, output_view(node, rows)) for node in candidates]
    return {id(node): (node, base) for node, base in bases if base is not None}


class _Grouping:
    """One attempt at grouping; ``extra`` collects values found to need materializing."""

    def __init__(self, graph: Graph, materialized: dict[int, Node]):
        self.graph = graph
        self.materialized = materialized
        self.extra: dict[int, tuple[Node, str]] = {}
        self._keys: dict[int, object] = {}  # reduction_key per root (materialized is fixed)
        self._members: dict[int, list[Node]] = {}  # root_members per root
        self._joined: dict[int, tuple | None] = {}  # _joined_key's resolution per child

    def members(self, roots: list[Node], key) -> list[Node]:
        found: dict[int, Node] = {}
        stack = list(roots)
        root_ids = {id(root) for root in roots}
        while stack:
            node = stack.pop()
            if id(node) in found or is_input(node):
                continue
            if id(node) in self.materialized and id(node) not in root_ids:
                continue
            if not self._admit(node, key):
                continue
            found[id(node)] = node
            stack.extend(node.inputs)
        return list(found.values())

    def root_members(self, root: Node) -> list[Node]:
        """What a kernel computing ``root`` alone computes (kept: asked again and again
        while cycles are split)."""
        found = self._members.get(id(root))
        if found is None:
            found = self._members[id(root)] = self.members([root], self.reduction_key(root))
        return found

    def _admit(self, node: Node, key) -> bool:
        kind = get_op(node.op).kind
        if kind == "reduce" and row_key(node) != key:
            self.extra[id(node)] = (node, "reduction read by a kernel of another shape")
            return False
        if kind == "movement" and key is None:
            source = node.inputs[0]
            if not is_input(source) and get_op(source.op).kind not in ("leaf", "movement"):
                if id(source) not in self.materialized:
                    self.extra[id(source)] = (source, "view of a computed value")
                    return False
        if key is None or kind in ("leaf", "movement", "reduce"):
            return True
        if node.shape != key[0] and node.shape not in scalar_shapes(key):
            self.extra[id(node)] = (node, "value of another shape inside a reduction kernel")
            return False
        return True

    def reduction_key(self, root: Node):
        """The row key of the first reduction a root's kernel would compute, if any; else
        the key of a materialized reduction over the root's own shape that it reads (then
        the root is one more pass of that reduction's kernel: layer norm's dx after the
        row statistics)."""
        if id(root) in self._keys:
            return self._keys[id(root)]
        key = self._keys[id(root)] = self._reduction_key(root)
        return key

    def _reduction_key(self, root: Node):
        seen: set[int] = set()
        stack = [root]
        joinable, refused = [], set()
        while stack:
            node = stack.pop()
            if id(node) in seen or is_input(node):
                continue
            seen.add(id(node))
            kind = get_op(node.op).kind
            if node is not root and id(node) in self.materialized:
                continue
            if kind == "reduce":
                return row_key(node)
            for child in node.inputs:
                key = self._joined_key(child, root)
                if key is not None:
                    (joinable.append(key[0]) if key[1] else refused.add(key[0]))
            stack.extend(node.inputs)
        keys = [key for key in joinable if key not in refused]
        return keys[0] if keys else None

    def _joined_key(self, child: Node, root: Node):
        """(row key, fits) when ``child`` reads a materialized reduction over ``root``'s
        shape: it may join that kernel only if it reads it as a per-row broadcast."""
        found = self._joined.get(id(child), self)
        if found is self:  # what ``child`` reads, resolved once per child (not per root)
            found = None
            resolved = resolve(
                child,
                lambda base: View.contiguous(base.shape),
                lambda m: id(m) not in self.materialized,
            )
            if resolved is not None:
                base, view = resolved
                if id(base) in self.materialized and get_op(base.op).kind == "reduce":
                    key = row_key(base)
                    found = (key, row_view_fits(view, key))
            self._joined[id(child)] = found
        if found is None or found[0][0] != root.shape:
            return None
        return found

    def check_internal_views(self, group_nodes: list[Node], key) -> None:
        """A movement chain over a reduction inside its own kernel must be the plain
        broadcast of the per-row value; anything else reads it from memory."""
        member_ids = {id(node) for node in group_nodes}
        for node in group_nodes:
            for child in node.inputs:
                if child.op not in MOVEMENT_OPS or id(child) not in member_ids:
                    continue
                resolved = resolve(child, own_view, lambda m: id(m) in member_ids)
                if resolved is None:
                    continue
                base, view = resolved
                if get_op(base.op).kind in ("leaf",) or id(base) not in member_ids:
                    continue
                # an internal value seen through a view: only a per-row value broadcast
                # back over its row (or kept as is) is free; anything else is written first
                fits = base.shape in scalar_shapes(key) and row_view_fits(view, key)
                if not fits:
                    self.extra[id(base)] = (base, "value read through a reshaping view")


def _form_groups(graph: Graph, materialized, reasons, homes, views):
    grouping = _Grouping(graph, materialized)
    position = {id(node): index for index, node in enumerate(graph.nodes)}
    buckets: dict[tuple, list[Node]] = {}
    bucket_of: dict[int, tuple] = {}
    depths: dict[int, int] = {}
    dependencies: dict[int, list[Node]] = {}
    order: list[Node] = []
    library = []
    for node in graph.nodes:
        if id(node) not in materialized:
            continue
        if get_op(node.op).kind == "library" or id(node) in views:  # views: calls of no work
            bucket_of[id(node)] = ("library", id(node))
            _depth(node, materialized, bucket_of, depths, dependencies)
            library.append(Group("library", (node,), (node,), (reasons[id(node)],)))
            continue
        bucket = _bucket(grouping, node)
        anchor = homes.get(id(node))  # a saved value joins the kernel that computes it
        if anchor is not None and id(anchor) in materialized:
            home = _bucket(grouping, anchor)
            key = home[1] if home[0] == "reduce" else (node.shape, ())
            fits = node.shape == key[0] or node.shape in scalar_shapes(key)
            # a reduction joins only a reduce kernel: an elementwise one cannot compute it
            if fits and (home[0] == "reduce" or get_op(node.op).kind != "reduce"):
                bucket = home
        bucket_of[id(node)] = bucket
        _depth(node, materialized, bucket_of, depths, dependencies)
        order.append(node)
    latest = _latest_depths(order, bucket_of, dependencies, depths)
    for key, anchor in homes.items():
        if key in bucket_of and bucket_of[key] == bucket_of.get(id(anchor)):
            latest[key] = max(latest[key], latest[id(anchor)])
    for node in order:
        buckets.setdefault(bucket_of[id(node)] + (latest[id(node)],), []).append(node)
    groups = []
    pending = list(_split_views_of_roots(grouping, buckets))
    while pending:
        (kind, key, _depth_), roots = pending.pop(0)
        most = MAX_REDUCE_OUTPUTS if kind == "reduce" else MAX_ELEMENTWISE_OUTPUTS
        if len(roots) > most:
            # a reduction kernel keeps a block-sized scratch row per reduction in shared
            # memory (48 KiB at most): 200 bias gradients of one shape are several kernels;
            # an optimizer's update of 200 same-shaped parameters is several elementwise
            # kernels (NVRTC's time grows faster than a kernel's size: one kernel of 600
            # outputs took minutes to compile, its pieces compile in parallel)
            roots = sorted(roots, key=lambda node: position[id(node)])
            pending[0:0] = [
                ((kind, key, _depth_), roots[start : start + most])
                for start in range(0, len(roots), most)
            ]
            continue
        group_key = key if kind == "reduce" else None
        members = grouping.members(roots, group_key)
        if kind == "reduce" and not any(get_op(n.op).kind == "reduce" for n in members):
            # its reductions all went to other kernels: what is left is elementwise work
            by_shape: dict[tuple, list[Node]] = {}
            for root in roots:
                by_shape.setdefault(root.shape, []).append(root)
            pending.extend((("elementwise", shape, 0), rs) for shape, rs in by_shape.items())
            continue
        if kind == "reduce":
            grouping.check_internal_views(members, key)
        members.sort(key=lambda node: position[id(node)])
        roots = sorted(roots, key=lambda node: position[id(node)])
        why = tuple(reasons[id(root)] for root in roots)
        groups.append(Group(kind, tuple(members), tuple(roots), why))
    return groups + library, grouping


def _bucket(grouping: _Grouping, node: Node) -> tuple:
    key = grouping.reduction_key(node)
    if key is not None and node.op in MOVEMENT_OPS and not written_in_row_order(node, key):
        return ("elementwise", node.shape)  # reads the value it views from memory
    bucket = ("reduce", key) if key is not None else ("elementwise", node.shape)
    if key is not None and node.shape != key[0] and node.shape not in scalar_shapes(key):
        if not is_row_alias(node, key):
            bucket = ("elementwise", node.shape)
    return bucket


def _depth(node: Node, materialized, bucket_of, depths, dependencies) -> int:
    """How many kernels of other buckets must run before ``node``'s: values of one bucket
    and one depth can share a kernel without ever waiting for each other (no cycles)."""
    best = 0
    found: list[Node] = []
    dependencies[id(node)] = found
    seen: set[int] = set()
    stack = list(node.inputs)
    while stack:
        child = stack.pop()
        if id(child) in seen or is_input(child):
            continue
        seen.add(id(child))
        if id(child) in materialized:
            if id(child) in depths:
                same = bucket_of.get(id(child)) == bucket_of[id(node)]
                best = max(best, depths[id(child)] + (0 if same else 1))
                found.append(child)
            continue
        stack.extend(child.inputs)
    depths[id(node)] = best
    return best


def _latest_depths(order, bucket_of, dependencies, depths) -> dict[int, int]:
    """The latest depth each value can take (as late as its readers allow): values nobody
    waits for (``db = dy.sum(0)``) then share a kernel with the last values of their kind
    (``dw``) instead of running alone; edges only ever go to equal or later depths."""
    deepest: dict[tuple, int] = {}
    for node in order:
        bucket = bucket_of[id(node)]
        deepest[bucket] = max(deepest.get(bucket, 0), depths[id(node)])
    readers: dict[int, list[Node]] = {}
    for node in order:
        for dependency in dependencies[id(node)]:
            readers.setdefault(id(dependency), []).append(node)
    latest: dict[int, int] = {}
    for node in reversed(order):
        bucket = bucket_of[id(node)]
        bound = deepest[bucket]
        for reader in readers.get(id(node), ()):
            step = 0 if bucket_of[id(reader)] == bucket else 1
            bound = min(bound, latest[id(reader)] - step)
        latest[id(node)] = max(bound, depths[id(node)])
    return latest


def _split_views_of_roots(grouping, buckets):
    """Buckets as (bucket, roots) pairs; a bucket in which one root reads another through a
    view (``y = abs(x); z = y.T``, same shape) becomes one kernel per root: a kernel cannot
    read through a view what its own threads write."""
    for bucket, roots in buckets.items():
        key = bucket[1] if bucket[0] == "reduce" else None
        root_ids = {id(root) for root in roots}
        members = grouping.members(roots, key)
        member_ids = {id(node) for node in members}
        # per-row values of a reduce kernel are read through broadcasting views for free
        free = {id(r) for r in roots if key is not None and r.shape in scalar_shapes(key)}
        viewed = any(
            node.op in MOVEMENT_OPS and _view_base(node, member_ids) in root_ids - free
            for node in members
        )
        if viewed and len(roots) > 1:
            yield from ((bucket, [root]) for root in roots)
        else:
            yield bucket, roots


def _view_base(node: Node, member_ids) -> int:
    while node.op in MOVEMENT_OPS and id(node) in member_ids:
        node = node.inputs[0]
    return id(node)


class _Cycle(Exception):
    """Merging roots into kernels made kernels depend on each other both ways."""

    def __init__(self, members: set[int]):
        super().__init__(members)
        self.members = members


def _order_groups(groups: list[Group], materialized, reads: dict | None = None) -> list[Group]:
    """Kernels in dependency order; raises _Cycle (with the groups on it) when merging made
    two kernels need each other. ``reads``: as ``_needs``'s."""
    # graphlib (stdlib) rather than networkx: this runs on every new plan, and importing
    # networkx costs about a second in a fresh process.
    dependencies = graphlib.TopologicalSorter({index: set() for index in range(len(groups))})
    for index, sources in enumerate(_needs(groups, materialized, reads)):
        dependencies.add(index, *sources)
    try:
        dependencies.prepare()
    except graphlib.CycleError as cycle:
        raise _Cycle(set(cycle.args[1])) from None
    order = []
    while dependencies.is_active():
        ready = sorted(dependencies.get_ready())  # deterministic: lowest group first
        order.extend(ready)
        dependencies.done(*ready)
    return [groups[index] for index in order]


def _needs(groups: list[Group], materialized, reads: dict | None = None) -> list[set[int]]:
    """Per kernel, the other kernels whose written values it reads. ``reads``: a cache of
    each group's materialized reads (by ``id`` of the group, which must stay alive while
    the cache does), for passes that ask again after changing a few groups."""
    producer = {id(out): index for index, group in enumerate(groups) for out in group.outputs}
    needs: list[set[int]] = []
    for index, group in enumerate(groups):
        found = reads.get(id(group)) if reads is not None else None
        if found is None:
            found = materialized_reads(group, materialized)
            if reads is not None:
                reads[id(group)] = found
        sources = {producer.get(key) for key in found}
        sources.discard(None)
        sources.discard(index)
        needs.append(sources)
    return needs


def _write_extra(grouping, materialized, reasons) -> None:
    for key, (node, reason) in grouping.extra.items():
        materialized[key] = node
        reasons[key] = reason


def fuse(graph: Graph, saved=()) -> Graph:
    """``saved``: ``(node, reason, anchor)`` triples the save-or-recompute pass chose to
    write (remat.py); ``anchor``, a value the kernel that computes it anyway writes: the
    saved value joins that kernel when it fits its shape or rows (None: no anchor).

    Inside a pipeline run with decisions to reuse (reuse.py), a graph of a structure fused
    before at other sizes gets that fusion's groups."""
    run = reuse.current()
    if run is not None:
        return run.fuse(graph, saved, fuse_anew)
    return fuse_anew(graph, saved)


def fuse_anew(graph: Graph, saved=()) -> Graph:
    """``fuse``, deciding every group."""
    views = handed_out(graph)
    materialized, reasons = materialized_values(graph, views)
    homes = {}
    for node, reason, anchor in saved:
        if id(node) not in materialized:
            materialized[id(node)], reasons[id(node)] = node, reason
            if anchor is not None:
                homes[id(node)] = anchor
    for _ in range(len(graph.nodes) + 1):
        for _ in range(len(graph.nodes) + 1):
            groups, grouping = _form_groups(graph, materialized, reasons, homes, views)
            if not grouping.extra:
                break
            _write_extra(grouping, materialized, reasons)
        if grouping.extra:  # the last round added values: its answers are out of date
            grouping = _Grouping(graph, materialized)
        # ``materialized`` is fixed for the cycle splitting: the grouping's answers are kept
        # (those of the round that added nothing, made over the same values)
        position = {id(node): index for index, node in enumerate(graph.nodes)}
        reads: dict[int, frozenset[int]] = {}
        alive = list(groups)  # the groups the cache is keyed by, kept alive with it
        groups = split_cycles(groups, grouping, position, reasons, materialized, reads, alive)
        if not grouping.extra:
            break
        # a split kernel's part refused a value it cannot compute (a part left without the
        # reduction its kernel had reads a view of a value computed from it: cross-entropy's
        # backward): that value is written, and the kernels are formed again
        _write_extra(grouping, materialized, reasons)
    ordered = _order_groups(groups, materialized, reads)
    # row kernels take over the column reductions of the rows they read (row_columns.py)
    attached = attach_columns(graph, ordered, materialized)
    alive += attached
    ordered = _order_groups(attached, materialized, reads)
    return Graph(graph.outputs, graph.name, tuple(ordered))
