"""Online max and sum of exp in a row kernel: one read of the row instead of two.

The reduction pattern ``m = max(v)`` then ``s = sum(exp(v - c))``, with ``c`` a per-row value
computed from ``m`` (softmax and log_softmax: ``c = m``; logsumexp and cross-entropy: ``c = m``
made 0 where it is infinite), needs the max before the sum can start: two passes over the
row. A streamed row (one that is not held on chip) reads memory for each, so the two are
taken in one pass with a running max ``m`` and a running sum ``s`` of ``exp(v - shift(m))``,
rescaled by ``exp(shift(m_old) - shift(m_new))`` whenever the max grows; partial results of
threads and warps merge by the same rule. At the end of the pass the sum the graph asked for
is ``s * exp(shift(m) - c)`` (exactly ``s`` where ``c = m`` is finite).

``shift(m)`` is ``m``, or 0 where ``m`` is infinite: a row of ``-inf`` then sums to 0 (as
``sum(exp(-inf - c))`` does) instead of NaN, and ``+inf`` to ``+inf``; NaN stays NaN. A
partial sum of 0 is never rescaled (its max may be ``-inf``, whose shift 0 would overflow the
factor). The exp is the graph's own exp node, spelled for its dtype.
"""

from __future__ import annotations

from flame.codegen.common import op_expression
from flame.codegen.reduce_strips import combine
from flame.ir.ops import get_op
from flame.ir.views import MOVEMENT_OPS

SHIFT_HELPER = """\
// online max + sum (flame/codegen/reduce_online.py): the running max as the exponent's
// shift, 0 where it is infinite (NaN stays NaN)
template <typename T> __device__ __forceinline__ T flame_online_shift(T m) {
    return (m == m && m - m != (T)0) ? (T)0 : m;
}
"""


class OnlinePair:
    """A row max and the sum of exp over its shifted row, taken in one pass."""

    def __init__(self, peak, total, exp_node, shift):
        self.peak, self.total = peak, total  # the reduce_max and reduce_sum nodes
        self.exp_node = exp_node  # exp(v - shift): the summed value
        self.shift = shift  # the per-row value subtracted (a row-shaped node constant along it)


ENABLED = True  # False: the two-pass form everywhere (an A/B: long_rows_bench.py --two-pass)


def online_pairs(writer) -> dict[int, OnlinePair]:
    """``{id(sum): pair}`` for each sum of exp whose max can be taken with it (see module
    doc). Only streamed row kernels (block mode, no register cache, no strip reductions):
    where the row is on chip a second pass costs no memory traffic."""
    if not ENABLED or not writer.space.block_mode or writer.items or writer.columns:
        return {}
    reduces = [
        node for node in writer.group.nodes
        if get_op(node.op).kind == "reduce" and id(node) not in writer.column_ids
    ]  # fmt: skip
    peaks = {}
    for node in reduces:
        if node.op == "reduce_max" and node.inputs[0].dtype.is_float:
            peaks.setdefault(_key(writer, node.inputs[0]), node)
    found, used = {}, set()
    for node in reduces:
        pair = _pair(writer, node, peaks) if node.op == "reduce_sum" else None
        if pair is not None and id(pair.peak) not in used:
            used.add(id(pair.peak))
            found[id(node)] = pair
    return found


def _resolve(writer, node):
    return writer.aliases.get(id(node), node)


def _key(writer, node) -> int:
    """One key for every name of a value (a view read twice loads once: ``same_reads``)."""
    node = _resolve(writer, node)
    same = writer.same_reads.get(id(node))
    return id(same.top) if same is not None else id(node)


def _pair(writer, total, peaks) -> OnlinePair | None:
    exp_node = _resolve(writer, total.inputs[0])
    if exp_node.op != "exp" or id(exp_node) not in writer.members:
        return None
    difference = _resolve(writer, exp_node.inputs[0])
    if difference.op != "sub" or id(difference) not in writer.members:
        return None
    value, shift = difference.inputs
    peak = peaks.get(_key(writer, value))
    if peak is None or not total.dtype.is_float or not _from_peak(writer, shift, peak):
        return None
    return OnlinePair(peak, total, exp_node, shift)


def _from_peak(writer, shift, peak) -> bool:
    """``shift`` is constant along the row and computed from ``peak``: its inputs are the
    peak, constants and per-row values (no element of the row)."""
    stack, seen, reaches = [shift], set(), False
    while stack:
        node = _resolve(writer, stack.pop())
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node is peak:
            reaches = True
            continue
        if node.op == "const" or id(node) in writer.scalar_values:
            continue
        kind = get_op(node.op).kind
        if id(node) not in writer.members or node.op in MOVEMENT_OPS or kind != "elementwise":
            return False
        stack.extend(node.inputs)
    return reaches


# --- code ----------------------------------------------------------------------------------


class OnlineCode:
    """The statements of one pair, its accumulators named ``peak`` and ``total``."""

    def __init__(self, writer, pair: OnlinePair, peak: str, total: str, ctype: str):
        self.writer, self.pair, self.peak, self.total, self.ctype = writer, pair, peak, total, ctype
        writer.helpers._add(SHIFT_HELPER)
        self.maximum = combine(pair.peak, writer.helpers)  # flame_max (NaN propagates)

    def _exp(self, argument: str) -> str:
        return op_expression(self.pair.exp_node, [argument], self.writer.helpers)

    def _rescaled(self, total: str, old: str, new: str) -> str:
        factor = self._exp(f"flame_online_shift({old}) - flame_online_shift({new})")
        return f"(({total}) == ({self.ctype})0 || ({old}) == ({new}) ? ({total}) : ({total}) * {factor})"  # noqa: E501

    def lane(self, value: str) -> list[str]:
        """One element ``value`` of the row folded into the running max and sum: one exp an
        element; the rescale (a second exp) only where the max grows, a branch rarely taken
        once the running max has settled."""
        peak, total, ctype = self.peak, self.total, self.ctype
        new = f"online_{peak}"
        element = self._exp(f"({ctype}){value} - flame_online_shift({new})")
        factor = self._exp(f"flame_online_shift({peak}) - flame_online_shift({new})")
        return [
            f"const {ctype} {new} = {self.maximum.format(peak, f'({ctype}){value}')};",
            f"if ({peak} != {new} && {total} != ({ctype})0) {total} = {total} * {factor};",
            f"{total} = {total} + {element};",
            f"{peak} = {new};",
        ]

    def merge(self, other_peak: str, other_total: str) -> str:
        """A statement folding another partial ``(other_peak, other_total)`` in."""
        peak, total, ctype = self.peak, self.total, self.ctype
        new = f"online_{peak}"
        return (
            f"{{ const {ctype} other_{peak} = {other_peak}; "
            f"const {ctype} other_{total} = {other_total}; "
            f"const {ctype} {new} = {self.maximum.format(peak, f'other_{peak}')}; "
            f"{total} = {self._rescaled(total, peak, new)} + "
            f"{self._rescaled(f'other_{total}', f'other_{peak}', new)}; {peak} = {new}; }}"
        )

    def shuffle(self) -> str:
        return self.merge(
            f"__shfl_xor_sync(0xffffffffu, {self.peak}, shift)",
            f"__shfl_xor_sync(0xffffffffu, {self.total}, shift)",
        )

    def finish(self) -> list[str]:
        """After the block's merge: the sum the graph asked for, ``s * exp(shift(m) - c)``."""
        lines: list[str] = []
        shift = self._shift_value(lines)
        factor = self._exp(f"flame_online_shift({self.peak}) - ({self.ctype})({shift})")
        lines.append(f"{self.total} = {self.total} * {factor};")
        return lines

    def _shift_value(self, lines) -> str:
        """C statements (appended to ``lines``) computing the row's shift ``c`` once."""
        writer, names = self.writer, {}
        names[id(self.pair.peak)] = self.peak

        def value(node) -> str:
            node = _resolve(writer, node)
            if id(node) in names:
                return names[id(node)]
            return writer._value(node, {})

        needed = _subgraph(writer, self.pair.shift, self.pair.peak)
        for node in writer.group.nodes:
            if id(node) in needed:
                name = f"shift_{self.total}_{len(names)}"
                arguments = [value(child) for child in node.inputs]
                lines.append(f"const {node.dtype.c_compute} {name} = "
                             f"{op_expression(node, arguments, writer.helpers)};")  # fmt: skip
                names[id(node)] = name
        return value(self.pair.shift)


def _subgraph(writer, shift, peak) -> set[int]:
    """The elementwise members between ``peak`` (and per-row values) and ``shift``."""
    needed, stack = set(), [shift]
    while stack:
        node = _resolve(writer, stack.pop())
        if node is peak or id(node) in needed or node.op == "const":
            continue
        if id(node) in writer.scalar_values or id(node) not in writer.members:
            continue
        needed.add(id(node))
        stack.extend(node.inputs)
    return needed
