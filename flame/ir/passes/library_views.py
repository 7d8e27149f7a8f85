"""Views of library results: which chains of movement ops a library call (cuBLAS, cuDNN)
reads in place, and which graph outputs are handed out as views of a library call's result
instead of copies (shared by the fusion pass, remat, simplify and the executor)."""

from __future__ import annotations

from flame.ir.graph import is_input
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.views import MOVEMENT_OPS, View, resolve, storage_view


def library_view(node: Node, computed: bool = True, written=()):
    """``(base, view)`` when ``node`` is a chain of views over one value a library call can
    read in place: ``a @ b.T`` hands cuBLAS the transposed strides instead of a copy. The
    base is an input, another library call's result, or (with ``computed``) any value this
    plan writes in its own layout -- the fusion pass then materializes that value. The walk
    stops at a value in ``written`` (ids of values the plan writes, ``node`` included): the
    library reads that value's memory, not a copy of the chain's base made again in the
    same layout (the attention backward's dq/dk/dv, joined, permuted and written, are read
    by the matmuls as ``reshape(permute)`` of that buffer). None when the views do not
    compose to one strided view."""
    if node.op not in MOVEMENT_OPS:
        return None
    resolved = resolve(node, own_view, lambda movement: id(movement) not in written)
    if resolved is None:
        return None
    base = resolved[0]
    if computed or is_input(base) or get_op(base.op).kind == "library":
        return resolved
    return None


def materialized_reads(group, materialized) -> frozenset[int]:
    """The ids of the written (``materialized``) values a kernel group reads; a library
    group reads a view's base in place (or the written value the view stops at,
    ``library_view``'s ``written``), so that value counts. The one rule for "kernel A
    waits for kernel B" (fusion's ordering and every merge's cycle check)."""
    found = set()
    for node in group.nodes:
        for child in node.inputs:
            if group.kind == "library":
                view = library_view(child, written=materialized)
                child = view[0] if view else child
            if id(child) in materialized:
                found.add(id(child))
    return frozenset(found)


def own_view(node: Node) -> View:
    """A value's own layout: a realized input's storage strides, else contiguous (written by
    a kernel of the plan)."""
    return storage_view(node) if is_input(node) else View.contiguous(node.shape)


def output_view(node: Node, rows=frozenset()) -> Node | None:
    """The value whose memory a graph output ``node`` is handed out as a view of, instead of
    a copy: a chain of reshapes, slices and permutes (no broadcast: no two elements share
    memory) over a library result, or over a value a row kernel's group writes (``rows``:
    the shapes row kernels walk; a group norm's [N, G, C/G, S] result handed out as
    [N, C, H, W], a channels-last one's [N, S, G, C/G] as a permuted view). Packed results
    (the attention op's O and statistics, its backward's dQ, dK, dV) reach the user this
    way."""
    resolved = library_view(node, computed=bool(rows))
    if resolved is None or is_input(resolved[0]) or 0 in resolved[1].strides:
        return None
    base, view = resolved
    if get_op(base.op).kind == "library":
        return base
    if base.shape in rows and get_op(base.op).kind == "elementwise" and not view.offset:
        return base  # every element once (no broadcast): the kernel's buffer, viewed
    return None
