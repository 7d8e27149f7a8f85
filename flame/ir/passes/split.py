"""Splitting big reductions into two stages.

A reduction with few outputs and many inputs per output (``x.sum()`` over 64 Mi elements,
``loss = (y * dy).sum()``) would run one block per output: one block for the whole tensor.
Afterwards: every reduction over trailing axes with fewer than ``FEW_OUTPUTS`` outputs and at
least ``MANY_INPUTS`` elements per output reduces ``PARTS`` chunks of each row first, then
the partial results: two kernels, the first one with ``PARTS`` times more parallelism. The
same holds for reductions over leading axes (column sums) with few outputs.
Sums, products, maxima and minima are associative, so only float rounding changes.

A column reduction over rows that a row reduction of the same graph also reads (layer norm's
``dw = (dy * x_hat).sum(0)`` next to its row statistics) is cut into about ``ROW_STRIPS``
strips of whole rows instead: the fusion pass can then let the row kernel accumulate each
strip's column sums in registers while it has the rows (see ``row_columns.py``).
"""

from __future__ import annotations

from flame.ir import dtypes
from flame.ir.graph import Graph
from flame.ir.infer import make_node
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.rewrite import rewrite
from flame.ir.passes.row_keys import row_shapes
from flame.ir.shapes import prod

FEW_OUTPUTS = 256
MANY_INPUTS = 1 << 16
PARTS = 1024
# A reduction broadcast back over its rows (a norm's statistics, softmax's max and sum) runs
# in the row kernel that reads each row once and writes it once; split, the rows are read
# again by each stage. Kept whole from this many rows on (about half the H100's SMs busy
# with 1024-thread blocks; issue 21, measured in notes/performance.md).
ROW_KERNEL_ROWS = 64


def _parts(count: int) -> int:
    parts = PARTS
    while parts > 1 and (count % parts or count // parts < 256):
        parts //= 2
    return parts


def _split(node: Node, rows=None, normalizing=frozenset()) -> Node | None:
    if get_op(node.op).kind != "reduce":
        return None
    source = node.inputs[0]
    axes = node.attr("axes")
    rank = len(source.shape)
    if UNPERMUTE_TOTALS and rank > 1 and axes == tuple(range(rank)):
        unpermuted = _unpermuted(source)
        if unpermuted is not None:  # a total does not depend on the order of its values
            total = make_node(node.op, (unpermuted,), {"axes": axes}, node.site)
            return _split(total, rows, normalizing) or total
    if axes and axes == tuple(range(len(axes))) and len(axes) < rank:
        return _split_leading(node, source, axes, (rows or {}).get((source.shape, len(axes)), 0))
    if axes and axes == tuple(range(axes[0], axes[-1] + 1)) and axes[-1] < rank - 1:
        return _split_middle(node, source, axes, (rows or {}).get((source.shape, axes[-1] + 1)))
    if not axes or axes != tuple(range(rank - len(axes), rank)):
        return None  # trailing or leading axes only: contiguous work to cut in pieces
    kept = source.shape[: rank - len(axes)]
    row = prod(source.shape[rank - len(axes) :])
    if prod(kept) >= FEW_OUTPUTS or row < MANY_INPUTS:
        return None
    if (source.shape, axes) in normalizing and prod(kept) >= ROW_KERNEL_ROWS:
        return None
    parts = _parts(row)
    if parts == 1:
        return None
    pieces = make_node("reshape", (source,), {"shape": kept + (parts, row // parts)}, node.site)
    partial = make_node(node.op, (pieces,), {"axes": (len(kept) + 1,)}, node.site)
    # the partials' total over both axes (the parts and the size-1 axis their reduction
    # kept): a row of ``parts`` values for one block, not a column one thread walks
    total = make_node(node.op, (partial,), {"axes": (len(kept), len(kept) + 1)}, node.site)
    return make_node("reshape", (total,), {"shape": node.shape}, node.site)


# a reduction over every axis of elementwise work on permuted values (gradient clipping's
# ``(permute(dW) ** 2).sum()``, the weight gradient arriving in another order than its
# parameter) reduces the values in their stored order: read in place, not tile-transposed
UNPERMUTE_TOTALS = True


def _product_turned(permute: Node) -> bool:
    """A transposed matrix product that simplify's ``TRANSPOSED_PRODUCTS`` computes in the
    permuted order (a Linear's weight gradient): taking the permute off for the total would
    give the product a second reader in its old order and keep the gradient transposed for
    the optimizer (the DiT's AdamW read its bf16 weight gradients through tile transposes)."""
    from flame.ir.passes import simplify

    base = permute.inputs[0]
    rank = len(permute.shape)
    swapped = (*range(rank - 2), rank - 1, rank - 2) if rank >= 2 else None
    return (
        simplify.TRANSPOSED_PRODUCTS and base.op == "matmul" and base.buffer is None
        and permute.attr("dims") == swapped
    )  # fmt: skip


def _unpermuted(source: Node) -> Node | None:
    """``source`` with the permutes under its elementwise ops taken off, when every full-size
    leaf is a permute by the same dims or a broadcast scalar (scalars of shape () too);
    None otherwise."""
    dims, stack, seen = set(), [source], set()
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if value.shape == ():
            continue  # a scalar operand: broadcast in any order
        if value.shape != source.shape:
            return None
        if value.op == "permute":
            if _product_turned(value):
                return None  # simplify computes the product in this order: read in place
            dims.add(value.attr("dims"))
            stored = value.inputs[0].shape
        elif value.op == "expand" and value.inputs[0].numel == 1:
            pass
        elif get_op(value.op).kind == "elementwise" and value.inputs:
            stack.extend(value.inputs)
        else:
            return None
    if len(dims) != 1 or next(iter(dims)) == tuple(range(len(source.shape))):
        return None
    memo: dict[int, Node] = {}

    def rebuilt(value: Node) -> Node:
        found = memo.get(id(value))
        if found is None:
            if value.shape == ():
                found = value
            elif value.op == "permute":
                found = value.inputs[0]
            elif value.op == "expand":
                found = make_node("expand", value.inputs, {"shape": stored}, value.site)
            else:
                inputs = tuple(rebuilt(child) for child in value.inputs)
                found = make_node(value.op, inputs, dict(value.attrs), value.site)
            memo[id(value)] = found
        return found

    return rebuilt(source)


def split_reductions(graph: Graph) -> Graph:
    rows = _row_reductions(graph)
    normalizing = _broadcast_back(graph)

    def visit(node: Node) -> Node:
        return _split(node, rows, normalizing) or node

    return rewrite(graph, visit)


def _broadcast_back(graph: Graph) -> frozenset:
    """Row keys (input shape, axes) of reductions whose result is broadcast back over their
    own input's shape, directly or through per-row arithmetic (``x - x.max(-1, keepdim)``,
    a group norm's mean and variance)."""
    sources = row_shapes(graph)
    found = set()
    # what a walk finds depends on the expand's shape alone: one set of visited values per
    # shape (the expands of a graph share their per-row values; walked once, not per expand)
    visited: dict[tuple, set[int]] = {}
    for node in graph.nodes:
        if node.op != "expand" or node.shape not in sources:
            continue
        stack, seen = [node.inputs[0]], visited.setdefault(node.shape, set())
        while stack:
            value = stack.pop()
            if id(value) in seen or value.numel * 2 > node.numel:
                continue  # per-row values only: at most half the rows' size
            seen.add(id(value))
            kind = get_op(value.op).kind
            if kind == "reduce" and value.inputs[0].shape == node.shape:
                found.add((node.shape, value.attr("axes")))
            elif kind in ("elementwise", "movement"):
                stack.extend(value.inputs)
    return frozenset(found)


def _row_reductions(graph: Graph) -> dict[tuple, int]:
    """For every (input shape, leading rank) of a reduction over trailing axes (rows): how
    many reductions over the leading axes of that shape (columns) the graph has."""
    rows, columns = set(), {}
    for node in graph.nodes:
        if get_op(node.op).kind != "reduce":
            continue
        rank, axes = len(node.inputs[0].shape), node.attr("axes")
        if axes and 0 < axes[0] and axes == tuple(range(axes[0], rank)):
            rows.add((node.inputs[0].shape, axes[0]))
        elif axes and axes == tuple(range(axes[0], axes[-1] + 1)) and axes[-1] < rank - 1:
            key = (node.inputs[0].shape, axes[-1] + 1)  # a middle axis: columns per group
            columns[key] = columns.get(key, 0) + 1
    return {key: count for key, count in columns.items() if key in rows}


COLUMN_OUTPUTS = 1 << 15  # a column reduction with fewer outputs than this is split
# Row kernels that also reduce columns: one block per strip of rows, each thread keeping its
# columns' partial results in registers. 256 strips keep two 512-thread blocks on each of the
# H100's 132 SMs; the partial results take ROW_STRIPS x row length values per reduction,
# unless the row kernel adds them atomically into a float32 result (row_columns.py).
ROW_STRIPS = 256
MIN_STRIP_ROWS = 8
# ROW_STRIPS counts 512-thread blocks; a short row's kernel runs smaller blocks (128 threads
# for a row of up to 1,024 four-lane items: reduce_space.block_size, restated here), so it
# takes more strips for as many threads on the SMs: 256 strips of 128 threads left 8 warps an
# SM walking 64 rows each (a DiT's LayerNorm backward at 28 % of its byte floor)
STRIPS_BY_THREADS = True
_STRIP_LANES = 4
STRIP_MIN_THREADS = 128  # reduce_space.MIN_ROW_THREADS, restated


def _strip_target(row: int) -> int:
    """The strips to aim at for rows of ``row`` values: ``ROW_STRIPS`` 512-thread blocks'
    worth of threads in blocks of the size the row kernel takes."""
    if not STRIPS_BY_THREADS:
        return ROW_STRIPS
    sizes = [size for size in (64, 128, 256) if size >= STRIP_MIN_THREADS]
    threads = next((size for size in sizes if row <= size * _STRIP_LANES * 2), 512)
    return ROW_STRIPS * 512 // threads


# column values (row length x column reductions) a row kernel keeps in registers; longer
# rows leave their column reductions to a kernel of their own (flame/ir/passes/row_columns.py)
ROW_COLUMN_VALUES = 8192


def _split_leading(node: Node, source: Node, axes, beside_rows=0) -> Node | None:
    """Sums over leading axes (``dw = (dy * x_hat).sum(0)``): each thread of the column kernel
    owns an output, so few outputs mean few threads. Cut the reduced rows into ``parts``
    blocks of rows, reduce each, then reduce the partial results. ``beside_rows``: how many
    such column reductions a graph that also reduces these rows has; when there are some and
    one reduction's columns fit a row kernel's registers, cut the rows into strips a row
    kernel can take over (row_columns.py decides, per kernel, how many it takes)."""
    lead = prod(source.shape[: len(axes)])
    rest = source.shape[len(axes) :]
    outputs = prod(rest)
    if outputs >= COLUMN_OUTPUTS or lead < 4096:
        return None
    fits = beside_rows and outputs <= ROW_COLUMN_VALUES  # row_columns checks each kernel
    parts = _strips(lead, _strip_target(outputs)) if fits else None
    if parts is None:
        parts = _column_parts(lead, outputs, source.dtype.itemsize)
    if parts == 1:
        return None
    partial = _partial(node, source, (parts, lead // parts) + rest)
    return _finished(node, make_node(node.op, (partial,), {"axes": (0,)}, node.site))


def _widened(node: Node) -> bool:
    """Whether the partial sums of a split reduction are kept in float32: sums of 16-bit
    floats, so the result is rounded once (as one reduction would round it), and a row
    kernel can add its strips' partial sums atomically into a float32 total
    (row_columns.py) instead of writing partial rows for a kernel of their own."""
    return node.op == "reduce_sum" and node.dtype in (dtypes.float16, dtypes.bfloat16)


def _partial(node: Node, source: Node, strips) -> Node:
    """The first stage: ``source`` viewed as ``strips`` (P, S, *rest), reduced over S."""
    pieces = make_node("reshape", (source,), {"shape": strips}, node.site)
    if _widened(node):
        pieces = make_node("cast", (pieces,), {"dtype": dtypes.float32}, node.site)
    return make_node(node.op, (pieces,), {"axes": (1,)}, node.site)


def _finished(node: Node, total: Node) -> Node:
    """The total in the reduction's own dtype and shape."""
    if _widened(node):
        total = make_node("cast", (total,), {"dtype": node.dtype}, node.site)
    return make_node("reshape", (total,), {"shape": node.shape}, node.site)


def _split_middle(node: Node, source: Node, axes, beside_rows=None) -> Node | None:
    """Sums over middle axes of rows a row kernel also reduces (adaLN's
    ``d_scale = (dy * x_hat).sum(1)`` over [N, T, D] tokens, next to the norm's row
    statistics): the row kernel takes them over as strips of ``(P, S, *rest)`` with P the
    kept leading size, one block a strip. With few leading items (a batch of 64) that is
    too few blocks, each walking hundreds of rows: the reduced rows are cut into k strips an
    item (``(P * k, S / k, *rest)``), then the k partial results of each item are reduced.
    Partial sums of a 16-bit float are kept in float32, so the result is rounded once."""
    kept = prod(source.shape[: axes[0]])
    reduced = prod(source.shape[axes[0] : axes[-1] + 1])
    rest = source.shape[axes[-1] + 1 :]
    target = _strip_target(prod(rest))
    if not beside_rows or kept * 2 > target or prod(rest) > ROW_COLUMN_VALUES:
        return _split_columns(node, source, (kept, reduced, rest)) if SPLIT_COLUMNS else None
    cuts = _cuts(kept, reduced, target)
    if cuts is None:
        return None
    partial = _partial(node, source, (kept * cuts, reduced // cuts) + rest)
    grouped = make_node("reshape", (partial,), {"shape": (kept, cuts) + rest}, node.site)
    return _finished(node, make_node(node.op, (grouped,), {"axes": (1,)}, node.site))


def _split_columns(node: Node, source: Node, sizes) -> Node | None:
    """A sum over a middle axis on its own (a channels-last GroupNorm's per-channel sums over
    the positions, [N, S, C] over S): the column kernel gives each thread its columns, so
    few outputs (N x C) mean few blocks, each walking every row. Cut the reduced axis as
    ``_split_leading`` cuts leading rows: (P * k, S / k, *rest), then the k partial results
    of each item."""
    kept, reduced, rest = sizes
    outputs = kept * prod(rest)
    if outputs >= COLUMN_OUTPUTS or reduced < 2 * MIN_COLUMN_ROWS:
        return None
    cuts = 1
    while (
        outputs * cuts < 4 * COLUMN_OUTPUTS
        and reduced % (cuts * 2) == 0
        and reduced // (cuts * 2) >= MIN_COLUMN_ROWS
    ):
        cuts *= 2
    if cuts == 1:
        return None
    partial = _partial(node, source, (kept * cuts, reduced // cuts) + rest)
    grouped = make_node("reshape", (partial,), {"shape": (kept, cuts) + rest}, node.site)
    return _finished(node, make_node(node.op, (grouped,), {"axes": (1,)}, node.site))


# the fewest rows a column kernel's block walks after _split_columns cuts them
MIN_COLUMN_ROWS = 64
# off with the layout pass (layouts.ENABLED): on the head's graphs the cut measured neutral
# to 1 % slower (notes/performance.md, session 18)
SPLIT_COLUMNS = False


def _cuts(kept: int, reduced: int, target: int = ROW_STRIPS) -> int | None:
    """Strips an item (a divisor of ``reduced``, each of at least ``MIN_STRIP_ROWS`` rows)
    that bring ``kept * cuts`` nearest ``target`` by ratio; None when only 1 fits."""
    best, best_ratio = None, 0.0
    for cuts in range(2, reduced // MIN_STRIP_ROWS + 1):
        if reduced % cuts:
            continue
        parts = kept * cuts
        ratio = max(parts, target) / min(parts, target)
        if best is None or ratio < best_ratio:
            best, best_ratio = cuts, ratio
        if parts >= target:
            break
    return best


# the column kernel's threads each own COLUMN_LANES neighbouring columns (16-byte loads of
# 16-bit values: 8; reduce.py's thread mode, restated); its blocks walk at least
# COLUMN_PART_ROWS rows of a part
COLUMN_LANES = 1
COLUMN_PART_ROWS = 64


def _column_parts(lead: int, outputs: int, itemsize: int = 4) -> int:
    lanes = max(1, min(COLUMN_LANES, 16 // itemsize))
    parts = 1
    while (
        outputs * parts < 4 * COLUMN_OUTPUTS * lanes
        and lead % (parts * 2) == 0
        and lead // (parts * 2) >= COLUMN_PART_ROWS
    ):
        parts *= 2
    return parts


def _strips(lead: int, target: int = ROW_STRIPS) -> int | None:
    """The number of equal strips of rows nearest ``target`` (by ratio), each of at least
    ``MIN_STRIP_ROWS`` rows; None when ``lead`` has no such divisor (a prime, say)."""
    best, best_ratio = None, 0.0
    for parts in range(target // 4, target * 4 + 1):
        if lead % parts or lead // parts < MIN_STRIP_ROWS:
            continue
        ratio = max(parts, target) / min(parts, target)
        if best is None or ratio < best_ratio:
            best, best_ratio = parts, ratio
    return best
