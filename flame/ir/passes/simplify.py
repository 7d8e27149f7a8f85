"""Constant folding and algebraic simplification.

Afterwards: no elementwise node has only constant inputs; movement ops (expand, reshape,
permute, slice) sit on leaves, reductions or library results, or on a computation too
expensive to recompute under a broadcast; none is an identity or stacked on one of its kind;
``x*1``, ``x/1``, ``x-0``, integer ``x+0``, ``--x``,
``x**1`` are gone; ``x**2`` is ``x*x``; a matmul read only through a transpose of its result
computes the transposed product instead (``TRANSPOSED_PRODUCTS``). Rules that would change a
float result are not applied (``x + 0.0`` turns ``-0.0`` into ``0.0``; ``x * 0`` is not ``0``
for NaN or infinity).
"""

from __future__ import annotations

import numpy as np

from flame.ir.evaluate import compute_dtype, evaluate_elementwise
from flame.ir.graph import Graph, is_input
from flame.ir.infer import SizeValue, make_const, make_node
from flame.ir.node import Node
from flame.ir.ops import get_op
from flame.ir.passes.cost import RECOMPUTE_LIMIT
from flame.ir.passes.library_views import own_view
from flame.ir.passes.rewrite import with_inputs
from flame.ir.passes.row_keys import row_shapes
from flame.ir.views import MOVEMENT_OPS, resolve

# (A B)^T = B^T A^T: cuBLAS writes a Linear's weight gradient in the parameter's [out, in]
# layout instead of [in, out] read transposed by clipping and the optimizer (A/B switch)
TRANSPOSED_PRODUCTS = True


def constant_value(node: Node):
    """The scalar a node always equals (a constant, maybe broadcast), else None."""
    while node.op == "expand":
        node = node.inputs[0]
    if node.op == "const":
        return node.attr("value")
    return None


def _sized(node: Node) -> str:
    while node.op == "expand":
        node = node.inputs[0]
    return node.attr("sized", "") if node.op == "const" else ""


def _fold(node: Node) -> Node | None:
    values = [constant_value(child) for child in node.inputs]
    if any(value is None for value in values):
        return None
    arrays = [
        np.asarray(value, dtype=compute_dtype(child.dtype))
        for value, child in zip(values, node.inputs)
    ]
    result = evaluate_elementwise(node, arrays)  # a computed value: rounded to node.dtype
    value = result.item()
    roles = [_sized(child) for child in node.inputs if _sized(child)]
    if node.dtype.is_float and roles:  # still derived from sizes: still a kernel argument
        value = SizeValue(value, f"{node.op}({','.join(roles)})")
    const = make_const(value, node.dtype, node.site, round_to_dtype=True)
    if node.shape == ():
        return const
    return make_node("expand", (const,), {"shape": node.shape}, node.site)


def _identity(node: Node) -> Node | None:
    op = node.op
    if op == "detach":  # an autograd marker: the same value (and, as in PyTorch, memory)
        return node.inputs[0]
    if get_op(op).kind == "reduce":
        source = node.inputs[0]
        if source.dtype is node.dtype and all(source.shape[a] == 1 for a in node.attr("axes")):
            # a sum/prod/max/min over axes of size 1 is its input, reshaped (a row kernel
            # cannot hold two reductions whose rows are the same elements)
            return make_node("reshape", (source,), {"shape": node.shape}, node.site)
        return None
    if op == "neg" and node.inputs[0].op == "neg":
        return node.inputs[0].inputs[0]
    if op == "cast" and node.inputs[0].dtype is node.dtype:
        return node.inputs[0]
    if len(node.inputs) != 2:
        return None
    left, right = node.inputs
    right_value = constant_value(right)
    if op in ("mul", "div", "pow") and right_value == 1 and not right.dtype.is_bool:
        return left
    if op == "mul" and constant_value(left) == 1 and not left.dtype.is_bool:
        return right
    if op == "sub" and right_value == 0:
        return left
    if op == "add" and not node.dtype.is_float and not node.dtype.is_bool:
        if right_value == 0:
            return left
        if constant_value(left) == 0:
            return right
    if op == "pow" and right_value == 2 and node.dtype.is_float:
        return make_node("mul", (left, left), {}, node.site)
    return None


MOVEMENT = ("expand", "reshape", "permute", "slice")


def _movement(op: str, attrs, child: Node, site, keep=frozenset(), memo=None) -> Node:
    """``op`` over ``child``, pushed through elementwise ops down to the leaves, so that in
    kernels every movement becomes the index map of a load. Broadcasts go through only
    cheap computations (see RECOMPUTE_LIMIT); expensive ones are written once instead.
    ``memo``: one push's results and reshape checks by value (``h * h`` reads h twice)."""
    memo = {} if memo is None else memo
    key = (op, id(child))
    if key not in memo:
        memo[key] = _pushed(op, attrs, child, site, keep, memo)
    return memo[key]


def _pushed(op: str, attrs, child: Node, site, keep, memo) -> Node:
    node = make_node(op, (child,), dict(attrs), site)
    if node.shape == child.shape and op in ("expand", "reshape"):
        return child
    if op == "reshape" and child.op != "copy":  # a push that lands on rows read across memory
        copied = _copied_input(node, memo.get("rows", frozenset()))
        if copied is not None:
            return copied
    if child.op == "const" and child.shape == ():
        return make_node("expand", (child,), {"shape": node.shape}, site)
    if child.buffer is not None:
        return node  # realized: an input of this graph, read through the view, never recomputed
    if child.op == op and op in ("expand", "reshape"):  # two steps of one kind are one
        return _movement(op, attrs, child.inputs[0], site, keep, memo)
    if op == "permute" and child.op == "permute":
        inner = child.attr("dims")
        dims = tuple(inner[d] for d in node.attr("dims"))
        return _movement("permute", {"dims": dims}, child.inputs[0], site, keep)  # new memo
    checks = memo.setdefault("reshape checks", {})
    if op == "reshape" and not _reshape_stays_strided(attrs, child, keep, checks):
        # pushed down, the reshape would reach a value it cannot view (a group's statistic
        # broadcast over [N, G, Cg*H*W], reshaped to [N, C, H, W]): that value would be
        # written out at full size. Computed in its own shape, the result is viewed instead.
        return node
    if get_op(child.op).kind != "elementwise" or id(child) in keep:
        # ``keep``: graph outputs, and values a library call (matmul) reads from memory --
        # written anyway, so read them through the view rather than recompute them in
        # another order (transposed: uncoalesced reads; reshaped for a split reduction:
        # every input read again)
        return node
    if op == "expand" and _computes_more_than(child, RECOMPUTE_LIMIT):
        return node
    if op == "permute" and id(child) in memo.get("shared", ()):
        # a value other ops also read in its own order (a DiT's residual stream, read by
        # the blocks as tokens and by the patch embedding's backward as channels): pushed
        # down, a transposed copy of its whole computation would be made (every matmul
        # output under it copied transposed, the stream written twice). Read it through
        # the permuted view instead, unless recomputing it is cheap.
        if _computes_more_than(child, RECOMPUTE_LIMIT):
            return node
    inputs = tuple(
        grand
        if (grand.op == "const" and grand.shape == ())
        else _movement(op, attrs, grand, site, keep, memo)
        for grand in child.inputs
    )
    return make_node(child.op, inputs, dict(child.attrs), child.site)


def _computes_more_than(root: Node, limit: int) -> bool:
    """``computed_size(root) > limit``, walking only until the count passes ``limit``: a
    broadcast over a training step's deep graph asked for the size of everything under it
    (3401 walks of the UNet's step: 26 s of its 51 s of simplify on the CPU probe)."""
    count = 0
    seen: set[int] = set()
    stack = [root]
    while stack:
        node = stack.pop()
        if id(node) in seen or is_input(node):
            continue
        seen.add(id(node))
        if node.inputs and node.op not in MOVEMENT:
            count += 1
            if count > limit:
                return True
        stack.extend(node.inputs)
    return False


def _reshape_stays_strided(attrs, child: Node, keep, seen=None) -> bool:
    """Whether a reshape pushed down through the elementwise ops under ``child`` lands on
    values it can read as strided views (their own layout: contiguous, or a realized input's).
    ``seen``: the answers so far (a value read twice, ``h * h``, is looked at once)."""
    seen = {} if seen is None else seen
    known = seen.get(id(child))
    if known is not None:
        return known
    if child.op == "const" and child.shape == ():
        answer = True
    elif get_op(child.op).kind == "elementwise" and id(child) not in keep and child.buffer is None:
        answer = all(_reshape_stays_strided(attrs, grand, keep, seen) for grand in child.inputs)
    else:
        tentative = make_node("reshape", (child,), dict(attrs), child.site)
        answer = tentative.shape == child.shape or (
            resolve(tentative, own_view, lambda movement: True) is not None
        )
    seen[id(child)] = answer
    return answer


def _identity_movement(node: Node, keep, rows=frozenset(), shared=frozenset()) -> Node | None:
    if node.op == "permute" and node.attr("dims") == tuple(range(len(node.shape))):
        return node.inputs[0]
    if (
        node.op == "slice"
        and node.shape == node.inputs[0].shape
        and all(step == 1 for step in node.attr("steps"))
    ):
        return node.inputs[0]
    if node.op == "slice" and node.inputs[0].op == "pad":
        inside = _slice_inside_pad(node, node.inputs[0])
        if inside is not None:
            return inside
    if node.op == "reshape" and node.inputs[0].op != "copy":
        copied = _copied_input(node, rows)
        if copied is not None:
            return copied
    if node.op in MOVEMENT:
        memo = {"rows": rows, "shared": shared}
        pushed = _movement(node.op, node.attrs, node.inputs[0], node.site, keep, memo)
        return None if pushed is node or _same(pushed, node) else pushed
    return None


def _copied_input(node: Node, rows=frozenset()) -> Node | None:
    """A reshape that reads a copy of its input:

    - of a realized input's memory that no strides can express (a channels-last tensor from
      DLPack viewed as [N, G, C/G * S]): kernels read inputs only through strided views, and a
      computed value would be written out by the fusion pass instead (fuse.py), but an input
      is no value a kernel computes;
    - onto the rows of a reduction (``rows``: their shapes) when the view would walk the rows
      across memory (innermost stride not 1: a group norm's [N, G, C/G, S] over channels-last
      memory, whose neighbours along S lie C apart): the row kernel would read every element
      from another sector. The copy reads the memory once, in its own order (measured: the
      ResBlock's backward read its NHWC gradient so, 0.59x torch.compile against 0.91x)."""
    resolved = resolve(node, own_view, lambda movement: True)
    if resolved is not None:
        strides, shape = resolved[1].strides, node.shape
        across = node.shape in rows and shape and shape[-1] > 1 and strides[-1] != 1
        if not across or 0 in strides:  # a broadcast is read where it is, not copied
            return None
        return make_node("reshape", (make_node("copy", (node.inputs[0],), {}, node.site),),
                         dict(node.attrs), node.site)  # fmt: skip
    base = node.inputs[0]
    while base.op in MOVEMENT_OPS and base.buffer is None:
        base = base.inputs[0]
    if not is_input(base):
        return None
    copy = make_node("copy", (node.inputs[0],), {}, node.site)
    return make_node("reshape", (copy,), dict(node.attrs), node.site)


def _slice_inside_pad(node: Node, pad: Node) -> Node | None:
    """A slice that reads only the unpadded part of a ``pad`` is that slice of the pad's
    input (autograd makes such pairs: a view's cotangent is padded into its base's shape,
    and a rule that reads the base's cotangent through the same view slices it out again)."""
    source = pad.inputs[0]
    starts, stops, steps = (node.attr(name) for name in ("starts", "stops", "steps"))
    shifted_starts, shifted_stops = [], []
    for start, stop, step, (before, _), size in zip(
        starts, stops, steps, pad.attr("widths"), source.shape
    ):
        if step <= 0 or start < before or stop > before + size:
            return None
        shifted_starts.append(start - before)
        shifted_stops.append(stop - before)
    attrs = {"starts": tuple(shifted_starts), "stops": tuple(shifted_stops), "steps": steps}
    return make_node("slice", (source,), attrs, node.site)


def _cat_of_permutes(node: Node) -> Node | None:
    """``cat`` of pieces that are all the same permute of their values (a UNet's skip join
    of two channels-last conv results, each seen as NCHW) is that permute of the ``cat`` of
    the values, joined along the axis the permute maps the dim to: the join copies memory in
    its own order instead of transposing every piece into a layout nothing wrote."""
    pieces = node.inputs
    if len(pieces) < 2 or any(piece.op != "permute" for piece in pieces):
        return None
    dims = pieces[0].attr("dims")
    if any(piece.attr("dims") != dims for piece in pieces[1:]):
        return None
    values = tuple(piece.inputs[0] for piece in pieces)
    joined = make_node("cat", values, {"dim": dims[node.attr("dim")]}, node.site)
    return make_node("permute", (joined,), {"dims": dims}, node.site)


def _swapped_last(rank: int) -> tuple[int, ...]:
    return tuple(range(rank - 2)) + (rank - 1, rank - 2)


def _transposed(operand: Node, site) -> Node:
    """``operand`` with its last two axes swapped, as a view; a permute under it is folded in
    (``x.T.T`` is ``x``), so a library call reads one strided view of the same memory."""
    dims = _swapped_last(len(operand.shape))
    if operand.op == "permute" and operand.buffer is None:
        inner = operand.attr("dims")
        dims = tuple(inner[d] for d in dims)
        operand = operand.inputs[0]
        if dims == tuple(range(len(dims))):
            return operand
    return make_node("permute", (operand,), {"dims": dims}, site)


def _transposed_product(node: Node, uses) -> Node | None:
    """``permute(matmul(a, b))`` swapping the last two axes, the product's only reader, is
    ``matmul(b^T, a^T)``: the library writes the result in the order its readers want (a
    Linear's weight gradient, [in, out] from the vjp, in the parameter's [out, in] order, so
    clipping and the optimizer read it as plain elementwise kernels, not through a tile
    transpose). The operands' transposes are free: cuBLAS reads a transposed view with
    ``OP_T`` (flame/runtime/library_linalg.py). ``uses``: per rewritten value, its readers
    (a product read also in its own order is not computed twice). Same dtype and attributes:
    both operands share one dtype, which is the result's."""
    if not TRANSPOSED_PRODUCTS or node.op != "permute":
        return None
    product = node.inputs[0]
    if product.op != "matmul" or product.buffer is not None or uses.get(id(product)) != 1:
        return None
    left, right = product.inputs
    # equal ranks: no vectors, and no batch of rows times one matrix (one folded GEMM)
    if len(left.shape) != len(right.shape) or len(left.shape) < 2:
        return None
    if node.attr("dims") != _swapped_last(len(node.shape)):
        return None
    site = product.site
    operands = (_transposed(right, site), _transposed(left, site))
    return make_node("matmul", operands, dict(product.attrs), site)


def _row_reads(graph: Graph) -> set[int]:
    """The values a reduction reads as its rows: its input, and what that computes from
    elementwise over the same shape (a cast, ``x - mean``), up to the first value that is
    not elementwise. Only a reshape among these is copied onto rows read across memory
    (``_copied_input``): a reshape elsewhere whose shape merely equals some reduction's rows
    (a square attention product at one image size) stays a view."""
    found: set[int] = set()
    for node in graph.nodes:
        if get_op(node.op).kind != "reduce":
            continue
        shape, stack = node.inputs[0].shape, [node.inputs[0]]
        while stack:
            value = stack.pop()
            if id(value) in found or value.shape != shape:
                continue
            found.add(id(value))
            if get_op(value.op).kind == "elementwise":
                stack.extend(value.inputs)
    return found


def _same(first: Node, second: Node) -> bool:
    return (
        first.op == second.op and first.attrs == second.attrs
        and len(first.inputs) == len(second.inputs)
        and all(a is b for a, b in zip(first.inputs, second.inputs))
    )  # fmt: skip


def simplify(graph: Graph) -> Graph:
    rows = row_shapes(graph)
    row_reads = _row_reads(graph)
    # values that will be in memory whatever else happens: the outputs, and (added as they
    # are rewritten) the values library calls read, directly or through views
    outputs = {id(node) for node in graph.outputs}
    keep = set(outputs)
    library_reads: set[int] = set()
    for node in graph.nodes:
        if get_op(node.op).kind == "library":
            for child in node.inputs:
                while get_op(child.op).kind == "movement" and child.buffer is None:
                    child = child.inputs[0]
                library_reads.add(id(child))

    def visit(node: Node, on_rows: frozenset) -> Node:
        while True:
            kind = get_op(node.op).kind
            replacement = None
            if kind == "elementwise":
                replacement = _fold(node)
            elif kind == "movement":
                replacement = _identity_movement(node, keep, on_rows, shared)
            elif node.op == "cat":
                replacement = _cat_of_permutes(node)
            if replacement is None:
                replacement = _identity(node)
            if replacement is None:
                return node
            node = replacement

    readers: dict[int, int] = {}  # per value: how many ops read it
    for node in graph.nodes:
        for child in node.inputs:
            readers[id(child)] = readers.get(id(child), 0) + 1
    shared: set[int] = set()  # rewritten values that several ops read
    uses: dict[int, int] = {}  # per rewritten value: its readers and outputs, aliases summed

    mapped: dict[int, Node] = {}  # rewrite(), remembering the values library calls read
    for node in graph.nodes:
        if is_input(node):
            mapped[id(node)] = node
            continue
        rebuilt = with_inputs(node, tuple(mapped[id(child)] for child in node.inputs))
        # the product rule sees only a permute built on the product itself (one the visit
        # composes there may be the product's second reader)
        on_rows = rows if id(node) in row_reads else frozenset()
        result = _transposed_product(rebuilt, uses) or visit(rebuilt, on_rows)
        mapped[id(node)] = result
        count = readers.get(id(node), 0) + (id(node) in outputs)
        uses[id(result)] = uses.get(id(result), 0) + count
        if id(node) in library_reads:
            keep.add(id(result))
        if readers.get(id(node), 0) > 1:
            shared.add(id(result))
    return Graph(tuple(mapped[id(node)] for node in graph.outputs), graph.name)
