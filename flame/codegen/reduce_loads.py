"""Addressing and loading the operands of a row kernel (``flame/codegen/reduce.py``).

The outer (kept) index of the block decomposed into per-operand offsets, per-row values
loaded once per row, the loads of one chunk of a row (vector loads where every operand
allows, all issued before any arithmetic), and the row cache held in registers.
"""

from __future__ import annotations

from flame.codegen.common import Read, generated_expression, load
from flame.codegen.spec import Arg


class RowLoads:
    """Mixed into the reduce writer: its space, reads, parameters and outer lines."""

    def _param(self, kind, name, value) -> str:
        if all(arg.name != name for arg in self.params):
            self.params.append(Arg(kind, self.index, name, value))
        return name

    # --- index math ---------------------------------------------------------------------
    def _decompose(self, lines, variable, sizes, prefix):
        if len(sizes) <= 1:
            return [variable] * len(sizes)
        lines.append(f"{self.index} {prefix}_rest = {variable};")
        names = []
        for axis in range(len(sizes) - 1, 0, -1):
            self._param("size", f"{prefix}_size{axis}", sizes[axis])
            lines.append(f"const {self.index} {prefix}{axis} = "
                         f"{prefix}_rest % {prefix}_size{axis}; "
                         f"{prefix}_rest /= {prefix}_size{axis};")  # fmt: skip
            names.append(f"{prefix}{axis}")
        lines.append(f"const {self.index} {prefix}0 = {prefix}_rest;")
        return [f"{prefix}0"] + list(reversed(names))

    def _linear(self, name, strides, indices, literal_unit=True) -> str:
        terms = []
        for axis, stride in enumerate(strides):
            if stride == 0:
                continue
            if stride == 1 and literal_unit:
                terms.append(indices[axis])
                continue
            self._param("stride", f"{name}_s{axis}", stride)
            terms.append(f"{indices[axis]} * {name}_s{axis}")
        return " + ".join(terms) or "0"

    def _outer_math(self, out_views):
        lines = self.outer_lines
        self.outer_index = self._decompose(lines, "outer", self.space.outer_sizes, "o")
        for position, read in enumerate(self.reads):
            strides = self.space.outer_strides[position]
            offset = self._linear(f"{read.param}_o", strides, self.outer_index)
            if read.view.offset:
                self._param("size", f"{read.param}_offset", read.view.offset)
                offset += f" + {read.param}_offset"
            lines.append(f"const {self.index} {read.param}_outer = {offset};")
        for position, index in self.out_index.items():
            strides = self.space.outer_strides[index]
            offset = self._linear(f"out{position}_o", strides, self.outer_index)
            lines.append(f"const {self.index} out{position}_outer = {offset};")
        for position, read in enumerate(self.reads):
            # constant along the row (a per-row value, or broadcast along the reduced axes):
            # loaded once per row, not once per element
            along_row = any(self.space.inner_strides[position])
            if read.top.shape not in (self.shape, self.column_shape) or not along_row:
                self.scalar_values[id(read.top)] = self._scalar_read(read)
        for top, read in self.same_reads.items():
            if id(read.top) in self.scalar_values:
                self.scalar_values[top] = self.scalar_values[id(read.top)]

    def _scalar_read(self, read: Read) -> str:
        name = f"s_{read.param}"
        ctype = read.top.dtype.c_compute
        if read.generated:
            value = generated_expression(read.base, f"{read.param}_outer", self.helpers)
        else:
            value = load(read.base.dtype, f"{read.param}[{read.param}_outer]")
        self.outer_lines.append(f"const {ctype} {name} = {value};")
        return name

    def _lane_reads(self, chunk_lines, lane_lines, values, cached):
        """Row reads of one chunk: loads at chunk level (all lanes' loads issued before any
        arithmetic), values per lane. ``cached``: read them from the row cache instead."""
        indices = None
        for position, read in enumerate(self.reads):
            if id(read.top) in self.scalar_values:
                values[id(read.top)] = self.scalar_values[id(read.top)]
                continue
            name = f"x_{read.param}"
            ctype = read.top.dtype.c_compute
            values[id(read.top)] = name
            for top, same in self.same_reads.items():
                if same is read:
                    values[top] = name
            if cached and id(read) in self.cached_reads:
                lane_lines.append(f"const {ctype} {name} = cache_{read.param}[item][k];")
                continue
            if read.generated:
                if indices is None:
                    indices = self._decompose(lane_lines, "inner", self.space.inner_sizes, "r")
                strides = self.space.inner_strides[position]
                offset = self._linear(f"{read.param}_r", strides, indices)
                at = f"{read.param}_outer + {offset}"
                lane_lines.append(f"const {ctype} {name} = "
                                  f"{generated_expression(read.base, at, self.helpers)};")  # fmt: skip  # noqa: E501
                continue
            lane_lines.append(f"const {ctype} {name} = {load(read.base.dtype, self._raw(read))};")
            chunk_lines.extend(self._chunk_load(read, position))

    def _raw(self, read: Read) -> str:
        """Lane k of a read's chunk of raw (storage-typed) values."""
        if self.vector_reads.get(id(read)):
            return f"raw_{read.param}.v[k]"
        return f"raw_{read.param}[k]"

    def _chunk_load(self, read: Read, position, filling: bool = False) -> list[str]:
        storage = read.base.dtype.c_storage
        if read.param in self.held and not filling:  # from the shared-memory row cache
            return self._shared_load(read)
        if self.vector_reads.get(id(read)):
            vector = f"FlameVec<{storage}, {self.lanes}>"
            pointer = (
                f"reinterpret_cast<const {vector}*>({read.param} + {read.param}_outer + chunk)"
            )
            return [f"const {vector} raw_{read.param} = *{pointer};"]
        strides = self.space.inner_strides[position]
        if len(self.space.inner_sizes) == 1:
            step = self._linear(f"{read.param}_r", strides, ["(chunk + j)"])
            at = f"{read.param}_outer + {step}"
        elif self._flat(position):  # several reduced axes walked in order: one axis
            at = f"{read.param}_outer + chunk + j"
        else:  # a chunk's index decomposed once; its lanes step along the innermost axis
            return self._decomposed_load(read, position)
        return [
            f"{storage} raw_{read.param}[{self.lanes}];",
            "#pragma unroll",
            f"for (int j = 0; j < {self.lanes}; ++j) "
            f"raw_{read.param}[j] = chunk + j < num_inner ? {read.param}[{at}] : ({storage})0;",
        ]

    def _decomposed_load(self, read, position) -> list[str]:
        """A read that is neither flat nor per row (a weight per channel of a group's row):
        the chunk's index decomposed once; lanes share every axis but the innermost, along
        which the read is broadcast (stride 0) or contiguous (stride 1)."""
        storage = read.base.dtype.c_storage
        strides = self.space.inner_strides[position]
        lines = [f"{storage} raw_{read.param}[{self.lanes}];"]
        indices = self._decompose(lines, "chunk", self.space.inner_sizes, f"c{read.param}_")
        offset = self._linear(f"{read.param}_r", strides, indices)
        at = f"{read.param}_outer + {offset}"
        if self.lanes == 1:
            lines.append(f"raw_{read.param}[0] = {read.param}[{at}];")
            return lines
        step = " + j" if strides[-1] else ""
        lines += [
            "#pragma unroll",
            f"for (int j = 0; j < {self.lanes}; ++j) "
            f"raw_{read.param}[j] = chunk < num_inner ? {read.param}[{at}{step}] : ({storage})0;",
        ]
        return lines

    def _cache_loads(self) -> list[str]:
        lines = []
        for position, read in enumerate(self.reads):
            if id(read) not in self.cached_reads:
                continue
            lanes: list[str] = []
            lines.extend(self._chunk_load(read, position))
            value = load(read.base.dtype, self._raw(read))
            lanes.append(f"cache_{read.param}[item][k] = {value};")
            lines.append("#pragma unroll")
            lines.append(f"for (int k = 0; k < {self.lanes}; ++k) {lanes[0]}")
            self.cache_declarations.append(
                f"{read.top.dtype.c_compute} cache_{read.param}[{self.items}][{self.lanes}];"
            )
        return lines

    # --- the shared-memory row cache (reduce_shared.py) ------------------------------------
    def _shared_load(self, read: Read) -> list[str]:
        storage = read.base.dtype.c_storage
        if self.vector_reads.get(id(read)):
            vector = f"FlameVec<{storage}, {self.lanes}>"
            pointer = f"reinterpret_cast<const {vector}*>(smem_{read.param} + chunk)"
            return [f"const {vector} raw_{read.param} = *{pointer};"]
        return [
            f"{storage} raw_{read.param}[{self.lanes}];",
            "#pragma unroll",
            f"for (int j = 0; j < {self.lanes}; ++j) raw_{read.param}[j] = "
            f"chunk + j < num_inner ? smem_{read.param}[chunk + j] : ({storage})0;",
        ]

    def _shared_fill(self) -> list[str]:
        """One chunk of each held read: loaded from global memory, stored where the same
        thread reads it back in every pass."""
        lines = []
        for position, read in enumerate(self.reads):
            if read.param not in self.held:
                continue
            lines.extend(self._chunk_load(read, position, filling=True))
            storage = read.base.dtype.c_storage
            if self.vector_reads.get(id(read)):
                vector = f"FlameVec<{storage}, {self.lanes}>"
                target = f"reinterpret_cast<{vector}*>(smem_{read.param} + chunk)"
                lines.append(f"*{target} = raw_{read.param};")
                continue
            lines += [
                "#pragma unroll",
                f"for (int j = 0; j < {self.lanes}; ++j) "
                f"if (chunk + j < num_inner) smem_{read.param}[chunk + j] = raw_{read.param}[j];",
            ]
        return lines
