"""Row kernels that also reduce columns.

Layer norm's backward reduces the same rows two ways: per row (the statistics, ``dx``) and per
column over the rows (``dw = (dy * x_hat).sum(0)``, ``db = dy.sum(0)``). The split pass cuts
such a column reduction into strips of whole rows (``split.py``: ``reduce(reshape(v, (P, S,
*rest)), axes=(1,))``, then a small sum over the P partial results). Here a reduce group made
only of such strip reductions joins the row kernel that reads the same rows: the row kernel
then runs one block per strip, each thread keeps the partial results of its own columns in
registers while it walks the strip's rows, and writes one partial row per strip at the end.
The rows are read once instead of once per kernel.

The join happens when (all checked, else the groups stay apart):

* the column group only reduces axis 1 of ``(P, S, *rest)`` with ``P * S`` rows of the row
  kernel and ``rest`` its row length, and computes nothing after its reductions;
* every value it reads maps onto the row space (a buffer through a reshapable view, or a
  value of the row kernel seen as itself or as a per-row value broadcast over its row);
* the row kernel reads nothing the column group writes, and no kernel between them makes
  the merge a cycle;
* row length x column reductions stays within ``ROW_COLUMN_VALUES`` (registers).

Per-row values the row kernel wrote only for the column kernel (the row statistics) are no
longer written once nothing else reads them.

Then, unless deterministic algorithms are asked for (``flame/determinism.py``), the small
kernel that sums the P partial rows joins too: a float32 sum over axis 0 of the strip sums
(and views of it) that nothing else reads becomes an output of the row kernel, which adds each
strip's partial results into it with ``atomicAdd`` (the output is zeroed before the launch;
``flame/codegen/reduce_strips.py``). The P x row buffer is then never allocated: layer norm's
backward over [16384, 4096] float32 saves 2 x 256 x 4096 x 4 B = 8.4 MB and a launch. Sums of
other dtypes keep the partial rows (their result would need a float32 accumulator of its own).
"""

from __future__ import annotations

from flame.determinism import are_deterministic_algorithms_enabled
from flame.ir import dtypes
from flame.ir.graph import Group, is_input
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.library_views import materialized_reads
from flame.ir.passes.row_keys import row_key, row_view_fits, scalar_shapes
from flame.ir.passes.split import ROW_COLUMN_VALUES
from flame.ir.shapes import prod
from flame.ir.views import MOVEMENT_OPS, View, reshape_view, resolve, storage_view


def attach_columns(graph, groups: list[Group], materialized) -> list[Group]:
    position = {id(node): index for index, node in enumerate(graph.nodes)}
    graph_outputs = {id(node) for node in graph.outputs}
    groups = list(groups)
    # each scan starts again from the first column after a merge; a pair of groups that
    # did not merge gives the same answer again (``_merge`` depends on the two groups
    # only), so the answers are kept for this call, by the ids of groups kept alive here
    # (every group the list ever holds, ``made``, in the order they were first held; the
    # merges, by ``merges``). A scan then asks each column only about the groups made
    # since it last asked, and tries the rows it merges with in the list's order.
    made = list(groups)
    alive = made
    strips: dict[int, list[Node] | None] = {}
    merges: dict[tuple[int, int], Group | None] = {}
    asked: dict[int, int] = {}  # per column: how many of ``made`` it has been asked about
    fits: dict[int, list[Group]] = {}  # per column: the rows ``_merge`` joins it to
    reads: dict[int, frozenset[int]] = {}
    known: dict[tuple, object] = {}  # _merge's answers about one group, by its id
    # no value written by two groups (merges keep it so): a merge's cycle check may then
    # walk from the merged group only (``_acyclic``)
    writes = [id(out) for group in groups for out in group.outputs]
    walk = len(set(writes)) == len(writes)
    merged_any = True
    while merged_any:
        merged_any = False
        place = {id(group): index for index, group in enumerate(groups)}
        for column in groups:
            if id(column) not in strips:
                strips[id(column)] = _strip_reductions(column, row_key)
            reduces = strips[id(column)]
            if reduces is None:
                continue
            found = fits.setdefault(id(column), [])
            for row in made[asked.get(id(column), 0) :]:
                if row is column or row.kind != "reduce" or id(row) not in place:
                    continue
                merged = _merge(row, column, reduces, materialized, position, row_key, known)
                merges[(id(row), id(column))] = merged
                if merged is not None:
                    found.append(row)
            asked[id(column)] = len(made)
            found[:] = [row for row in found if id(row) in place]
            found.sort(key=lambda row: place[id(row)])
            for row in found:
                merged = merges[(id(row), id(column))]
                candidate = [merged if g is row else g for g in groups if g is not column]
                if not _acyclic(candidate, materialized, reads, merged if walk else None):
                    continue
                index = candidate.index(merged)
                candidate[index] = _prune(merged, candidate, graph_outputs, row_key, known)
                made.append(candidate[index])
                groups, merged_any = candidate, True
                break
            if merged_any:
                break
    if not are_deterministic_algorithms_enabled():
        groups = _absorb_totals(
            graph, groups, materialized, position, lambda group: _strip_sums(group, row_key),
            known, reads, alive, walk,
        )  # fmt: skip
        if PARTIAL_TOTALS:  # column kernels of split.py's first stage: the same rule
            groups = _absorb_totals(
                graph, groups, materialized, position, _partials, known, reads, alive, walk
            )
    return groups


# column kernels of split.py's first stage add their partial sums atomically into the total
# (a bias gradient's 64 partial rows, then one block summing them: 41 % and 5 % of their
# byte floors in the DiT step)
PARTIAL_TOTALS = True


def _partials(group: Group) -> set[int]:
    """The float32 partial sums of a column kernel of split.py's first stage: sums over axis
    1 of ``(P, S, C)`` (the group's only reduction shape)."""
    reduces = [node for node in group.nodes if get_op(node.op).kind == "reduce"]
    if group.kind != "reduce" or not reduces:
        return set()
    if len({(node.inputs[0].shape, node.attr("axes")) for node in reduces}) != 1:
        return set()
    return {
        id(node) for node in reduces
        if node.op == "reduce_sum" and node.attr("axes") == (1,) and len(node.shape) == 3
        and node.shape[2] > 1 and node.dtype is dtypes.float32
    }  # fmt: skip


def _absorb_totals(
    graph, groups: list[Group], materialized, position, sums_of, known=None, reads=None,
    alive=None, walk=False,
) -> list[Group]:  # fmt: skip
    """Kernels that make partial sums (``sums_of(group)``: their ids) take over the kernels
    that only add them up (float32 sums over axis 0, and views of them): see module doc.
    ``known``, ``reads``: answers about groups kept by the caller for this call (by ``id``;
    ``alive``, a list the caller keeps, holds every group they are kept for); ``walk``:
    ``groups`` is acyclic and no value has two writers (see ``_acyclic``)."""
    known = {} if known is None else known
    alive = [] if alive is None else alive
    graph_outputs = {id(node) for node in graph.outputs}
    for first in list(groups):
        summed = sums_of(first)
        if not summed:
            continue
        # partial sums -> the groups (of this list, other than ``first``) reading them:
        # found when a kernel summing them turns up (most partial-sum kernels have none)
        readers: dict[int, set[int]] | None = None
        listed, reader = groups, first
        for index, total in enumerate(listed):
            taken = _totals_of(total, summed, known)
            if taken is None:
                continue
            if readers is None:
                readers = {}
                for place, group in enumerate(listed):
                    if group is not reader:
                        for child in _inputs(group, known) & summed:
                            readers.setdefault(child, set()).add(place)
            if any(id(s) in graph_outputs or readers.get(id(s)) != {index} for s in taken):
                continue  # a partial row someone else reads: it stays written
            taken_ids = {id(s) for s in taken}
            nodes = {id(node): node for node in first.nodes + total.nodes}
            ordered = sorted(nodes.values(), key=lambda node: position[id(node)])
            kept = [(o, r) for o, r in zip(first.outputs, first.reasons) if id(o) not in taken_ids]
            outputs = tuple(o for o, _ in kept) + total.outputs
            reasons = tuple(r for _, r in kept) + total.reasons
            merged = Group("reduce", tuple(ordered), outputs, reasons)
            alive.append(merged)
            candidate = [merged if g is first else g for g in groups if g is not total]
            if _acyclic(candidate, materialized, reads, merged if walk else None):
                groups, first = candidate, merged
    return groups


def _strip_sums(group: Group, key_of) -> set[int]:
    """The strip reductions of a row kernel that has some."""
    mixed = column_reductions(group, key_of) if group.kind == "reduce" else None
    return {id(node) for node in mixed[2]} if mixed is not None else set()


def _totals_of(group: Group, strips: set[int], known=None) -> list[Node] | None:
    """The strip outputs a group only sums over axis 0 in float32 (plus views of the sums,
    nothing else, every output a sum or a view of one); None for any other group.
    ``known``: as ``_merge``'s."""
    if known is None:
        taken = _summed_sources(group)
    else:
        taken = known.get(("summed", id(group)), known)
        if taken is known:
            taken = known[("summed", id(group))] = _summed_sources(group)
    if taken is None or any(id(source) not in strips for source in taken):
        return None
    return taken or None


def _summed_sources(group: Group) -> list[Node] | None:
    """What a group sums over axis 0 in float32, when that and views of the sums is all it
    computes and every output is a sum or a view of one; else None."""
    if group.kind != "reduce":
        return None
    members = {id(node) for node in group.nodes}
    sums = set()
    taken = []
    for node in group.nodes:
        if node.op == "reduce_sum" and node.attr("axes") == (0,):
            source = node.inputs[0]
            if not (source.dtype is node.dtype is dtypes.float32):
                return None
            sums.add(id(node))
            taken.append(source)
        elif node.op in MOVEMENT_OPS and id(node.inputs[0]) in members:
            continue
        else:
            return None
    for output in group.outputs:
        while id(output) not in sums and output.op in MOVEMENT_OPS:
            output = output.inputs[0]
        if id(output) not in sums:
            return None
    return taken


def column_reductions(group: Group, key_of) -> tuple[tuple, list[Node], list[Node]] | None:
    """``(row key, row reductions, strip reductions)`` of a reduce group that mixes both
    kinds; None for a group of one key."""
    reduces = [node for node in group.nodes if get_op(node.op).kind == "reduce"]
    keys = {key_of(node) for node in reduces}
    if len(keys) < 2:
        return None
    rows = [key for key in keys if _is_row_key(key)]
    if len(rows) != 1:
        return None
    key = rows[0]
    return (
        key,
        [node for node in reduces if key_of(node) == key],
        [node for node in reduces if key_of(node) != key],
    )


def _is_row_key(key) -> bool:
    shape, axes = key
    return bool(axes) and 0 < axes[0] and axes == tuple(range(axes[0], len(shape)))


def _strip_reductions(group: Group, key_of) -> list[Node] | None:
    """The reductions of a group that only reduces axis 1 of ``(P, S, *rest)`` and computes
    nothing after them; None for any other group."""
    if group.kind != "reduce":
        return None
    reduces = [node for node in group.nodes if get_op(node.op).kind == "reduce"]
    keys = {key_of(node) for node in reduces}
    if len(keys) != 1:
        return None
    shape, axes = next(iter(keys))
    if axes != (1,) or len(shape) < 3 or shape[0] < 2:
        return None
    for node in group.nodes:
        kind = get_op(node.op).kind
        if kind == "elementwise" and node.shape != shape:
            return None  # an epilogue after the strip sums
        if kind not in ("elementwise", "reduce", "movement") and node.op != "const":
            return None  # generated leaves (random numbers) follow the column space's index
    if any(get_op(node.op).kind != "reduce" for node in group.outputs):
        return None
    return reduces


def _base_view(node: Node) -> View:
    return storage_view(node) if is_input(node) else View.contiguous(node.shape)


def _merge(row: Group, column: Group, reduces, materialized, position, key_of, known=None):
    """The row kernel with the column group joined, or None (module doc). ``known``: a dict
    that keeps what is asked of one group (its row key, its reads) by the group's ``id``,
    for a caller that asks about many pairs of the same groups (and keeps them alive)."""
    known = {} if known is None else known
    found = _cached(known, "row", row, lambda: _row_reductions(row, key_of))
    if found is None:
        return None
    key, existing = found
    shape, axes = key
    strip_shape = key_of(reduces[0])[0]
    if existing and key_of(existing[0])[0] != strip_shape:
        return None  # one strip layout per kernel
    length = prod(shape[axes[0] :])
    if prod(strip_shape[:2]) != prod(shape[: axes[0]]) or prod(strip_shape[2:]) != length:
        return None
    if length * (len(existing) + len(reduces)) > ROW_COLUMN_VALUES:
        return None
    row_ids = _cached(known, "ids", row, lambda: {id(node) for node in row.nodes})
    written = {id(node) for node in column.outputs}
    if not written.isdisjoint(_inputs(row, known)):
        return None
    row_bases = _cached(known, "bases", row, lambda: _read_bases(row, row_ids))
    column_reads = _cached(known, "column", column, lambda: _column_reads(column))
    if column_reads is None:
        return None
    shares = False
    for base, view in column_reads:
        flat = reshape_view(view, shape) if view.shape != shape else view
        if flat is None:
            return None
        if id(base) in row_ids:  # becomes a value of the kernel itself
            per_row = base.shape in scalar_shapes(key) and row_view_fits(flat, key)
            whole = base.shape == shape and flat == View.contiguous(shape)
            if not (per_row or whole):
                return None
            shares = True
        elif id(base) in row_bases:
            shares = True
    if not shares:
        return None  # nothing read twice: joining would save nothing
    nodes = {id(node): node for node in row.nodes + column.nodes}
    ordered = sorted(nodes.values(), key=lambda node: position[id(node)])
    return Group(
        "reduce", tuple(ordered), row.outputs + column.outputs, row.reasons + column.reasons
    )


def _cached(known: dict, what: str, group: Group, make):
    found = known.get((what, id(group)), known)
    if found is known:
        found = known[(what, id(group))] = make()
    return found


def _inputs(group: Group, known: dict) -> set[int]:
    """The ids of the values a group's nodes read (its own included)."""
    return _cached(
        known, "inputs", group,
        lambda: {id(child) for node in group.nodes for child in node.inputs},
    )  # fmt: skip


def _row_reductions(row: Group, key_of):
    """(row key, strip reductions) of a row kernel a column group may join, else None."""
    mixed = column_reductions(row, key_of)
    if mixed is not None:
        key, _, existing = mixed
        return key, existing
    keys = {key_of(node) for node in row.nodes if get_op(node.op).kind == "reduce"}
    if len(keys) != 1 or not _is_row_key(next(iter(keys))):
        return None
    return next(iter(keys)), []


def _column_reads(column: Group):
    """(base, view) of every value the column group reads from outside (through views);
    None when one of them cannot join a row kernel whatever it is (no strided view, or a
    value of the group itself seen through a view)."""
    column_ids = {id(node) for node in column.nodes}
    found = []
    for node in column.nodes:
        if node.op in MOVEMENT_OPS:
            continue
        for child in node.inputs:
            if id(child) in column_ids and child.op not in MOVEMENT_OPS:
                continue  # computed by the column group itself
            resolved = resolve(child, _base_view, lambda m: id(m) in column_ids)
            if resolved is None:
                return None
            base, view = resolved
            if id(base) in column_ids:
                if base.op == "const":
                    continue
                return None  # a value of the column group seen through a view
            found.append((base, view))
    return found


def _read_bases(group: Group, member_ids) -> set[int]:
    bases = set()
    for node in group.nodes:
        if node.op in MOVEMENT_OPS:
            continue
        for child in node.inputs:
            if id(child) in member_ids and child.op not in MOVEMENT_OPS:
                continue
            resolved = resolve(child, _base_view, lambda m: id(m) in member_ids)
            if resolved is not None:
                bases.add(id(resolved[0]))
    return bases


def _prune(group: Group, groups, graph_outputs, key_of, known=None) -> Group:
    """Drop the per-row values the kernel wrote only for kernels it has now absorbed.
    ``known``: as ``_merge``'s."""
    known = {} if known is None else known
    key = column_reductions(group, key_of)[0]
    outputs = {id(output) for output in group.outputs}
    read_elsewhere = set()
    for other in groups:
        if other is not group:
            read_elsewhere |= _inputs(other, known) & outputs
    kept, reasons = [], []
    for output, reason in zip(group.outputs, group.reasons):
        unused = id(output) not in graph_outputs and id(output) not in read_elsewhere
        if unused and output.shape in scalar_shapes(key):
            continue
        kept.append(output)
        reasons.append(reason)
    return Group(group.kind, group.nodes, tuple(kept), tuple(reasons))


def _acyclic(
    groups: list[Group], materialized, reads: dict | None = None, merged: Group | None = None
) -> bool:
    """Whether no group waits for itself through others (Kahn's algorithm sorts them all).
    ``reads``: each group's materialized reads by ``id`` of the group (the caller keeps
    the groups alive while it keeps the cache). ``merged``: ``groups`` is an acyclic list
    with two of its groups replaced by ``merged`` (which writes what they wrote, or less),
    and no value had two writers there: a cycle then goes through ``merged``, so a walk
    from it answers (the whole sort does when ``merged`` is not in the list)."""
    if reads is None:
        reads = {}

    def read(group: Group) -> frozenset[int]:
        found = reads.get(id(group))
        if found is None:
            found = reads[id(group)] = materialized_reads(group, materialized)
        return found

    producer = {id(out): index for index, group in enumerate(groups) for out in group.outputs}
    start = next((index for index, group in enumerate(groups) if group is merged), None)
    if start is not None and len(producer) == sum(len(group.outputs) for group in groups):
        seen, stack = {start}, [start]
        while stack:
            index = stack.pop()
            for key in read(groups[index]):
                source = producer.get(key)
                if source is None or source == index:
                    continue
                if source == start:
                    return False
                if source not in seen:
                    seen.add(source)
                    stack.append(source)
        return True
    waiting = [0] * len(groups)
    readers: list[list[int]] = [[] for _ in groups]
    for index, group in enumerate(groups):
        sources = {producer.get(key) for key in read(group)}
        sources.discard(None)
        sources.discard(index)
        waiting[index] = len(sources)
        for source in sources:
            readers[source].append(index)
    ready = [index for index, count in enumerate(waiting) if count == 0]
    done = 0
    while ready:
        index = ready.pop()
        done += 1
        for reader in readers[index]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                ready.append(reader)
    return done == len(groups)
