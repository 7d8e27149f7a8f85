"""Column kernels that load a vector across neighbouring columns (``flame/codegen/reduce.py``,
thread mode: a thread owns an outer index, the innermost axis kept, as in a bias gradient's
sums over rows). Where every operand and output is contiguous across columns at vector
alignment and the kernel is one pass of reductions writing per-column values, a thread loads
``COLUMN_VECTOR_BYTES`` across that many neighbouring columns and runs the one-column
statements once a column (a named size class, "column vectors of N"); else one column a
thread."""

from __future__ import annotations

import re

from flame.ir.shapes import prod

# Bytes a thread loads across columns; 0: one column a thread. Off: measured on the H100 at
# 16 bytes (session 21), the
# DiT-S/2 step went 14.65 -> 16.29 ms and the UNet's 18.60 -> 18.39 ms; the DiT's bias
# gradients are sums over 16,384 rows cut into parts, and a vector of 8 columns a thread
# leaves 8x fewer threads per part (not yet profiled). Kept, with its tests, switched off.
COLUMN_VECTOR_BYTES = 0


class ColumnVectors:
    """Mixed into the reduce writer: its space, reads, outputs and atomic totals."""

    def _column_lanes(self, depth: int) -> int:
        """Neighbouring columns a thread of a column kernel loads at once (see
        ``COLUMN_VECTOR_BYTES``); 1 where an operand or output is not contiguous across
        columns at vector alignment, or the kernel is more than one pass of sums."""
        space = self.space
        if space.block_mode or not COLUMN_VECTOR_BYTES or depth != 1 or self.final["lane"]:
            return 1
        per_column = [read for read in self.reads if id(read.top) in self.scalar_values]
        if len(space.inner_sizes) != 1 or per_column or not self.reads:
            return 1
        widest = max(read.base.dtype.itemsize for read in self.reads)
        lanes = COLUMN_VECTOR_BYTES // widest
        while lanes > 1 and not self._columns_fit(lanes):
            lanes //= 2
        return max(lanes, 1)

    def _columns_fit(self, lanes: int) -> bool:
        space = self.space
        if not space.outer_sizes or space.outer_sizes[-1] % lanes or space.num_outer % lanes:
            return False
        for position, read in enumerate(self.reads):
            outer, inner = space.outer_strides[position], space.inner_strides[position]
            if read.generated or not read.aligned or outer[-1] != 1:
                return False
            if read.view.offset % lanes or any(s % lanes for s in (*outer[:-1], *inner)):
                return False
        for position in range(len(self.group.outputs)):
            if position in self.atomic:
                if prod(self.atomic[position].shape) % lanes:
                    return False
                continue
            outer = space.outer_strides[self.out_index[position]]
            if outer[-1] != 1 or any(s % lanes for s in outer[:-1]):
                return False
        return True


_DECLARED = re.compile(r"^(?P<ctype>[\w ]+?) (?P<name>acc\d+) = (?P<value>.+);$")
_RAW_DECLARED = re.compile(r"^(?P<storage>[\w ]+?) raw_(?P<param>\w+)\[(?P<lanes>\d+)\];$")
_RAW_LOADED = re.compile(
    r"^for \(int j = 0; j < (?P<lanes>\d+); \+\+j\) raw_(?P<param>\w+)\[j\] = "
    r"(?P<bound>.+?) \? (?P<pointer>\w+)\[(?P<at>.+)\] : \((?P<storage>[\w ]+)\)0;$"
)
_ACCUMULATOR = re.compile(r"\b(acc\d+)\b")


def column_vector_lines(one_pass: dict, final: dict, lanes: int) -> dict:
    """A column kernel's one pass rewritten for ``lanes`` neighbouring columns a thread: each
    chunk loads one vector across the columns (the operands are contiguous there, checked by
    ``_columns_fit``), each accumulator is an array over them, and the per-column statements
    run once a column (``v``); the outer lines stay those of the first column (column v's
    offsets are its + v)."""
    init = []
    for line in one_pass["init"]:
        found = _DECLARED.match(line)
        if found is None:
            raise ValueError(f"column vectors: unexpected accumulator line {line!r}")
        name = found["name"]
        init += [f"{found['ctype']} {name}[{lanes}];", "#pragma unroll",
                 f"for (int v = 0; v < {lanes}; ++v) {name}[v] = {found['value']};"]  # fmt: skip
    chunk = []
    for line in one_pass["chunk"]:
        declared, loaded = _RAW_DECLARED.match(line), _RAW_LOADED.match(line)
        if declared is not None:
            vector = f"FlameVec<{declared['storage']}, {lanes}>"
            chunk.append(f"{vector} raw_{declared['param']}[{declared['lanes']}];")
        elif loaded is not None:
            vector = f"FlameVec<{loaded['storage']}, {lanes}>"
            chunk.append(
                f"for (int j = 0; j < {loaded['lanes']}; ++j) if ({loaded['bound']}) "
                f"raw_{loaded['param']}[j] = "
                f"*reinterpret_cast<const {vector}*>({loaded['pointer']} + {loaded['at']});"
            )
        elif line == "#pragma unroll":
            chunk.append(line)
        else:
            raise ValueError(f"column vectors: unexpected load line {line!r}")

    def per_column(line: str) -> str:
        line = re.sub(r"\braw_(\w+)\[k\]", r"raw_\1[k].v[v]", line)
        line = _ACCUMULATOR.sub(r"\1[v]", line)
        line = re.sub(r"\b(out\d+)\[(out\d+_outer)\]", r"\1[\2 + v]", line)
        return re.sub(r"\bouter %", "(outer + v) %", line)

    lane = ["#pragma unroll", f"for (int v = 0; v < {lanes}; ++v) {{"]
    lane += [per_column(line) for line in one_pass["lane"]] + ["}"]
    written = [per_column(line) for line in (*one_pass["finish"], *final["scalars"])]
    combine = [
        f"{name}[v] = " + text.format(f"{name}[v]", f"shared_{name}[part][column * {lanes} + v]")
        for (name, *_), text in zip(one_pass["accumulators"], one_pass["combines"])
    ]  # fmt: skip
    return {"init": tuple(init), "chunk": tuple(chunk), "lane": tuple(lane),
            "written": tuple(written), "combine": tuple(combine)}  # fmt: skip
