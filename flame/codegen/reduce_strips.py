"""Strip reductions inside a row kernel (``flame/ir/passes/row_columns.py``).

A row kernel may also reduce columns over strips of its rows: reductions over axis 1 of
``(P, S, *row)``. A block owns a strip; each thread keeps the partial results of its columns
in registers over the strip's rows (accumulated in the last pass, with the row outputs) and
writes them once at the end, in one of two ways:

* as the strip's row of the ``(P, 1, *row)`` output, which a later kernel sums (the
  deterministic way: the same order on every run);
* added with ``atomicAdd`` into the total, when the row kernel took over that sum too (a
  float32 sum over axis 0 of the strip output): the total is zeroed before the launch
  (``Lowered.zeroed``) and no ``P x row`` buffer exists. 16-byte ``float4`` atomics where the
  GPU has them (compute capability 9.0), one per thread and chunk of 4 columns.
"""

from __future__ import annotations

from flame.codegen.common import store
from flame.codegen.doubles import double_text
from flame.codegen.spec import Arg
from flame.ir import dtypes
from flame.ir.ops import get_op
from flame.ir.shapes import prod


def rows_strips_totals(group, reduces):
    """Row reductions (they define the space), strip reductions, and the totals of strip
    reductions (sums over their axis 0) of a group."""
    keys = {(node.inputs[0].shape, node.attr("axes")) for node in reduces}
    if len(keys) == 1:
        return reduces, [], []
    found = partial_totals(reduces)
    if found is not None:
        return found[0], [], found[1]
    from flame.ir.passes.row_columns import column_reductions
    from flame.ir.passes.row_keys import row_key

    mixed = column_reductions(group, row_key)
    if mixed is None:
        raise ValueError(f"reduce group with reductions of several shapes: {sorted(keys)}")
    _, rows, others = mixed
    inner = {id(node) for node in others}
    totals = [node for node in others if id(node.inputs[0]) in inner]
    strips = [node for node in others if id(node.inputs[0]) not in inner]
    return rows, strips, totals


def partial_totals(reduces):
    """``(reductions, totals)`` of a column kernel that adds its partial sums into their
    float32 totals (split.py's second stage, a sum over axis 0 of one of its reductions,
    taken over by flame/ir/passes/row_columns.py); None for any other mix."""
    ids = {id(node) for node in reduces}
    totals = [
        node for node in reduces
        if node.op == "reduce_sum" and node.attr("axes") == (0,) and id(node.inputs[0]) in ids
        and node.dtype is node.inputs[0].dtype is dtypes.float32
    ]  # fmt: skip
    taken = {id(node) for node in totals}
    rows = [node for node in reduces if id(node) not in taken]
    if not totals or len({(node.inputs[0].shape, node.attr("axes")) for node in rows}) != 1:
        return None
    return rows, totals


def partial_total_adds(writer) -> list[str]:
    """A column kernel's partial sums added into their float32 totals (zeroed before the
    launch): the output of ``(P, S, C)`` summed over S is ``outer`` = p * C + c, its total's
    element c."""
    lines = []
    for position, total in sorted(writer.atomic.items()):
        source = total.inputs[0]
        if any(source is column for column in writer.columns):
            continue  # a strip's total: strip_sum adds it
        if writer.space.block_mode:
            raise ValueError("partial sums add into their total in column kernels only")
        name = f"total{position}_columns"
        writer.params.append(Arg("size", writer.index, name, prod(total.shape)))
        lines.append(f"atomicAdd(out{position} + outer % {name}, {writer._value(source, {})});")
    return lines


def atomic_outputs(group, totals, aliases) -> dict[int, object]:
    """``{output position: total}`` for the outputs that are totals (or views of one)."""
    ids = {id(node): node for node in totals}
    found = {}
    for position, output in enumerate(group.outputs):
        total = ids.get(id(aliases.get(id(output), output)))
        if total is not None:
            found[position] = total
    return found


def strip_sum(writer, node, values, lane) -> None:
    """Register accumulators of one strip reduction: their declaration, the update in the
    last pass (appended to ``lane``) and how they are written at the end."""
    op = get_op(node.op)
    ctype, letter = accumulator(node)
    identity = op.cuda["identity"][letter]
    combine_text = combine(node, writer.helpers)
    name = f"column{writer.columns.index(node)}"
    items, lanes = writer.loop_items, writer.lanes
    writer.column_lines["declare"].append(
        f"{ctype} {name}[{items}][{lanes}];\n"
        f"    #pragma unroll\n"
        f"    for (int item = 0; item < {items}; ++item)\n"
        f"        for (int k = 0; k < {lanes}; ++k) {name}[item][k] = {identity};"
    )
    value = writer._value(node.inputs[0], values)
    slot = f"{name}[item][k]"
    lane.append(f"{slot} = {combine_text.format(slot, f'({ctype}){value}')};")
    total = next((p for p, t in writer.atomic.items() if t.inputs[0] is node), None)
    if total is not None:
        writer.column_lines["store"].extend(_atomic_add(f"out{total}", name, lanes))
        return
    position = next(i for i, out in enumerate(writer.group.outputs) if out is node)
    writer.column_lines["store"].append(
        f"for (int k = 0; k < {lanes}; ++k) "
        f"out{position}[(Index)blockIdx.x * num_inner + chunk + k] = {store(node.dtype, slot)};"
    )


def _atomic_add(target: str, name: str, lanes: int) -> list[str]:
    """Add a thread's chunk of partial sums into the float32 total (a row of ``num_inner``)."""
    scalar = f"for (int k = 0; k < {lanes}; ++k) atomicAdd({target} + chunk + k, {name}[item][k]);"
    if lanes != 4:
        return [scalar]
    parts = ", ".join(f"{name}[item][{k}]" for k in range(4))
    return [
        "#if __CUDA_ARCH__ >= 900  // chunk is a multiple of 4: the address is 16-byte aligned",
        f"atomicAdd(reinterpret_cast<float4*>({target} + chunk), make_float4({parts}));",
        "#else",
        scalar,
        "#endif",
    ]


def accumulator(node) -> tuple[str, str]:
    """C type and identity key of a reduction's accumulator: float for 16- and 32-bit
    floats, double for float64; 8- and 16-bit integers take the max/min of an int (whose
    identities they can hold)."""
    source = node.inputs[0].dtype
    if source.is_float:
        return ("double" if source is dtypes.float64 else "float"), "f"
    if node.op in ("reduce_sum", "reduce_prod"):
        return "long long", "i"
    if source.is_bool:
        return "int", "b"
    if source.itemsize < 4:
        return "int", "i32"
    return source.c_compute, ("i32" if source is dtypes.int32 else "i")


def combine(node, helpers) -> str:
    """A reduction's combine expression (``{0}`` the accumulator, ``{1}`` the new value),
    with the helpers it calls added to ``helpers``: in double for float64."""
    op = get_op(node.op)
    text = op.cuda["combine"]
    if node.inputs[0].dtype is not dtypes.float64:
        helpers.need(op.helpers)
        return text
    helpers.need_double(op.helpers, used_in=text)
    return double_text(text, node.op)
