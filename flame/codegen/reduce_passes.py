"""The reduction passes of a row kernel (``flame/codegen/reduce.py``): per pass, the row
values its reductions need, their accumulators and how they combine, and the per-row
(scalar) values computed once the pass's reductions are complete. An online pair (a max and
the sum of exp over its shifted row, ``reduce_online.py``) is taken in one pass."""

from __future__ import annotations

from flame.codegen.common import const_text, op_expression
from flame.codegen.reduce_online import OnlineCode
from flame.codegen.reduce_strips import accumulator, combine
from flame.ir.ops import get_op
from flame.ir.views import MOVEMENT_OPS


class RowPasses:
    """Mixed into the reduce writer: its group, levels, scalar values and helpers."""

    def _row_statements(self, lines, targets, values):
        """Statements computing the row values ``targets`` need, inputs first."""
        needed: set[int] = set()
        stack = list(targets)
        while stack:
            node = stack.pop()
            node = self.aliases.get(id(node), node)
            if id(node) in needed or id(node) not in self.members or not self._is_row(node):
                continue
            needed.add(id(node))
            stack.extend(node.inputs)
        for node in self.group.nodes:
            if id(node) in needed and get_op(node.op).kind == "elementwise":
                name = f"t{len(values)}"
                arguments = [self._value(child, values) for child in node.inputs]
                lines.append(f"const {node.dtype.c_compute} {name} = "
                             f"{op_expression(node, arguments, self.helpers)};")  # fmt: skip
                values[id(node)] = name

    def _value(self, node, values) -> str:
        node = self.aliases.get(id(node), node)
        if node.op == "const":
            return const_text(node, self.size_args)
        if id(node) in values:
            return values[id(node)]
        return self.scalar_values[id(node)]

    def _pass(self, number) -> dict:
        reduces = [
            n for n in self.group.nodes
            if get_op(n.op).kind == "reduce" and self.level[id(n)] == number
            and id(n) not in self.column_ids
        ]  # fmt: skip
        init, chunk, lane, finish = [], [], [], []
        values: dict[int, str] = {}
        self._lane_reads(chunk, lane, values, cached=self.items > 0)
        online = [self.online[id(n)] for n in reduces if id(n) in self.online]
        inputs = [n.inputs[0] for n in reduces if id(n) not in self.online]
        self._row_statements(lane, inputs, values)
        accumulators, combines, codes = [], [], []
        for node in reduces:
            name = f"acc{len(self.scalar_values)}"
            op = get_op(node.op)
            ctype, letter = accumulator(node)
            identity = op.cuda["identity"][letter]
            combine_text = combine(node, self.helpers)
            init.append(f"{ctype} {name} = {identity};")
            self.scalar_values[id(node)] = name
            paired = any(node is pair.peak or node is pair.total for pair in online)
            shuffled = f"__shfl_xor_sync(0xffffffffu, {name}, shift)"
            # an online pair's two accumulators merge together (OnlineCode.shuffle)
            step = "" if paired else combine_text.format(name, shuffled)
            accumulators.append((name, ctype, identity, step))
            combines.append(combine_text)
            if not paired:
                value = self._value(node.inputs[0], values)
                lane.append(f"{name} = {combine_text.format(name, f'({ctype}){value}')};")
        for pair in online:
            ctype, _ = accumulator(pair.total)
            peak, total = self.scalar_values[id(pair.peak)], self.scalar_values[id(pair.total)]
            code = OnlineCode(self, pair, peak, total, ctype)
            lane.extend(code.lane(self._value(pair.peak.inputs[0], values)))
            codes.append(code)
        finish.extend(line for code in codes for line in code.finish())
        finish.extend(self._scalar_statements(number))
        return {"init": init, "chunk": chunk, "lane": lane, "accumulators": accumulators,
                "combines": combines, "finish": finish,
                "online": tuple(code.shuffle() for code in codes)}  # fmt: skip

    def _scalar_statements(self, number) -> list[str]:
        lines = []
        for node in self.group.nodes:
            if id(node) in self.scalar_values or node.op in MOVEMENT_OPS or node.op == "const":
                continue
            kind = get_op(node.op).kind
            if self._is_row(node) or kind in ("reduce", "leaf") or self.level[id(node)] != number:
                continue
            name = f"s{len(self.scalar_values)}"
            arguments = [self._value(child, {}) for child in node.inputs]
            lines.append(f"const {node.dtype.c_compute} {name} = "
                         f"{op_expression(node, arguments, self.helpers)};")  # fmt: skip
            self.scalar_values[id(node)] = name
        return lines
