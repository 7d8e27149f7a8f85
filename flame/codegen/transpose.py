"""Elementwise kernels that change the memory order: tiles through shared memory.

An elementwise kernel writes its outputs contiguously. When a full-size operand lies in
another order (an NCHW value read into NHWC memory for a channels-last conv, or the
reverse), the plain kernel walks it with the output's innermost axis, so neighbouring
threads read elements a row apart: every load touches its own 32-byte sector, and the kernel
moves data at about a third of copy speed (20.5-21.5 us for an 8 MB bf16 NCHW <-> NHWC copy
on the H100, against 7.5-10 us for cuDNN's own transpose; notes/performance.md, session 18).

Here a block owns a square tile (64 or 32 a side) of two axes: ``a``, the transposed
operand's innermost axis, and the output's innermost axis ``l``. It first loads the
transposed operands' tile with threads along ``a`` (coalesced for them) into shared memory,
then computes and writes the tile with threads along ``l`` (coalesced for the output and
every operand in its order), reading the transposed operands from shared memory. The rest
of the kernel (the op expressions, the other reads, broadcasts, constants) is the
elementwise lowering's.

What goes into the source is what goes into the elementwise kernel's (dtypes, collapsed rank,
broadcast pattern, which operands are transposed), plus the tile axis: sizes and strides stay
arguments, and the grid (tiles x the other axes) is computed at plan time.
"""

from __future__ import annotations

from flame.codegen.common import Read, buffer_params, collect_reads, const_text, load, store
from flame.codegen.elementwise import (
    Lowered,
    _is_scalar,
    _Writer,
    collapse,
    index_type_for,
)  # fmt: skip
from flame.codegen.spec import Arg, KernelSpec
from flame.ir.graph import Group
from flame.ir.shapes import contiguous_strides, prod
from flame.ir.views import expand_view

TILES = (64, 32)  # the tile's side: the larger one where the operands' tiles fit
THREADS = 512  # a block's threads: (tile / lanes) along the contiguous axis x the rest in rows
# elements a thread moves at once along each phase's contiguous axis, by the storage's
# bytes: 8-byte loads and stores. One access per element left the kernel at 1.33-1.57 TB/s
# for bfloat16 and 2.06-2.30 TB/s for float32 NCHW <-> NHWC copies on the H100; bfloat16 in
# pairs 1.89-2.20, in fours 2.18-2.61, float32 in pairs 2.44-2.73 TB/s (copy: 2.39-2.93;
# notes/probes/transpose_bench.py, notes/performance-session21.md). Where a
# size, offset or stride does not divide, the kernel moves one element at a time (a size
# class, named in the dump).
LANES_16BIT = 4
LANES_32BIT = 2
# static shared memory the tiles of one kernel may take (the limit is 48 KiB); a transposed
# operand past it is read in place
SHARED_BYTES = 40 * 1024
# the fewest elements along each tiled axis for the tiled kernel (below, the plain one)
MIN_TILED = 16


def tile_axis(sizes, reads) -> int | None:
    """The axis a transposed operand walks contiguously, when some full-size operand has
    stride 1 on an axis other than the output's innermost one and is not broadcast or
    contiguous along that innermost axis; None when the plain kernel reads everything in
    order."""
    last = len(sizes) - 1
    if last < 1 or sizes[last] < MIN_TILED:
        return None
    for read in reads:
        if read.generated or _is_scalar(read) or read.strides[last] in (0, 1):
            continue
        for axis in range(last):
            if read.strides[axis] == 1 and sizes[axis] >= MIN_TILED:
                return axis
    return None


def lower_transposing(group: Group, layout_of) -> Lowered | None:
    """The tiled lowering of an elementwise group, or None where the plain one serves."""
    space = group.outputs[0].shape
    reads, aliases = collect_reads(group, layout_of)
    if any(base.op != "const" for base in aliases.values()) or any(r.generated for r in reads):
        return None
    views = [expand_view(read.view, space) for read in reads]
    sizes, collapsed = collapse(space, [contiguous_strides(space)] + [v.strides for v in views])
    for read, view, strides in zip(reads, views, collapsed[1:]):
        read.strides, read.offset = strides, view.offset
    axis = tile_axis(sizes, reads)
    if axis is None:
        return None
    writer = _TileWriter(group, sizes, reads, axis, index_type_for(prod(space), reads))
    for top, constant in aliases.items():
        writer.values[top] = writer.tail_values[top] = const_text(constant, writer.size_args)
    return writer.build(prod(space))


class _TileWriter(_Writer):
    """The elementwise writer with the tile's index math: ``body`` holds the compute lines
    of one element, ``prologue`` the transposed operands' loads into shared memory."""

    def __init__(self, group, sizes, reads: list[Read], axis: int, index_type):
        super().__init__(group, sizes, reads, 1, index_type)
        self.axis = axis
        self.last = len(sizes) - 1
        self.transposed = [
            read for read in reads
            if not read.generated and not _is_scalar(read)
            and read.strides[axis] == 1 and read.strides[self.last] not in (0, 1)
        ]  # fmt: skip
        self.outer: list[str] = []  # lines: the other axes' indices from the block's number
        self.before: list[str] = []  # phase two, before a thread's lanes: output vectors
        self.stores: list[str] = []  # ... and after them: their stores
        # tiles hold the stored values (2 bytes for 16-bit types): a dozen transposed
        # operands (an optimizer kernel over the weight gradients of one shape) fit
        sizes = [read.base.dtype.itemsize for read in self.transposed]
        self.tile = next(
            (tile for tile in TILES if sum(sizes) * tile * (tile + 1) <= SHARED_BYTES), TILES[-1]
        )
        kept, used = [], 0
        for read, size in zip(self.transposed, sizes):
            used += size * self.tile * (self.tile + 1)
            if used <= SHARED_BYTES:
                kept.append(read)
        self.transposed = kept
        self.lanes = self._lanes()

    def _lanes(self) -> int:
        """Elements a thread loads and stores at once: the most (up to the storage's
        ``LANES_*``, halving) that the tiled sizes, the transposed operands' offsets and
        strides allow as aligned vector accesses; 1 without transposed operands."""
        itemsizes = {read.base.dtype.itemsize for read in self.transposed}
        itemsizes |= {output.dtype.itemsize for output in self.group.outputs}
        by_size = {2: LANES_16BIT, 4: LANES_32BIT}
        lanes = min(by_size.get(size, 1) for size in itemsizes) if self.transposed else 1
        while lanes > 1 and not self._aligned(lanes):
            lanes //= 2
        return lanes

    def _aligned(self, lanes: int) -> bool:
        if self.sizes[self.axis] % lanes or self.sizes[self.last] % lanes:
            return False
        for read in self.transposed:
            moved = [s for axis, s in enumerate(read.strides) if axis != self.axis]
            if read.offset % lanes or any(s % lanes for s in moved):
                return False
        return True

    def build(self, numel) -> Lowered:
        self.params, buffers = buffer_params(self.group, self.reads)
        self.params.append(Arg("size", self.index, "n", numel))
        self._tile_index()
        shared_ids = {id(read.top) for read in self.transposed}
        for read in self.reads:
            if id(read.top) in shared_ids:
                self._shared_read(read)
            else:
                self._read(read)
        for node in self.group.nodes:
            self._compute(node)
        for position, output in enumerate(self.group.outputs):
            value = self._value(output, self.values)
            if self.lanes == 1:
                self.body.append(f"out{position}[out_at] = {store(output.dtype, value)};")
                continue
            vector = f"FlameVec<{output.dtype.c_storage}, {self.lanes}>"
            self.before.append(f"{vector} out{position}_vec;")
            self.body.append(f"out{position}_vec.v[k] = {store(output.dtype, value)};")
            self.stores.append(
                f"*reinterpret_cast<{vector}*>(out{position} + out_first) = out{position}_vec;"
            )
        self.params.extend(self.size_args.values())
        reads = tuple(read.base for read in buffers)
        tiles = 1
        for axis, size in enumerate(self.sizes):
            tiles *= -(-size // self.tile) if axis in (self.axis, self.last) else size
        return Lowered(self._tile_spec(), reads, tuple(self.group.outputs), numel,
                       grid_items=tiles, threads=THREADS)  # fmt: skip

    def _tile_index(self) -> None:
        """Axis names: ``ia`` and ``il`` for the tiled axes (declared per element by the
        template), ``i<k>`` for the others (from the block's number); ``out_at``'s terms."""
        names = []
        for axis in range(len(self.sizes)):
            self.params.append(Arg("size", self.index, f"size{axis}", self.sizes[axis]))
            names.append("ia" if axis == self.axis else "il" if axis == self.last else f"i{axis}")
        self.axis_index = names

        def tiles(axis: int) -> str:
            return f"((size{axis} + {self.tile - 1}) / {self.tile})"

        self.outer.append(f"{self.index} rest = blockIdx.x;")
        self.outer.append(f"const {self.index} tile_l = rest % {tiles(self.last)};")
        self.outer.append(f"rest /= {tiles(self.last)};")
        for axis in range(self.last - 1, -1, -1):
            if axis == self.axis:
                self.outer.append(f"const {self.index} tile_a = rest % {tiles(axis)};")
                self.outer.append(f"rest /= {tiles(axis)};")
            else:
                self.outer.append(f"const {self.index} i{axis} = rest % size{axis};")
                self.outer.append(f"rest /= size{axis};")
        terms = []
        for axis, stride in enumerate(self.flat):
            if axis != self.last:
                self.params.append(Arg("stride", self.index, f"out_s{axis}", stride))
                terms.append(f"{names[axis]} * out_s{axis}")
        # the output is contiguous along the last axis: a thread's lanes are consecutive
        self.out_first = " + ".join([*terms, "il_first"])
        self.out_at = "out_first + k"

    def _shared_read(self, read: Read) -> None:
        """A transposed operand: loaded tile-wise into shared memory (phase one), read back
        at the element's place (phase two)."""
        name = f"v{len(self.values)}"
        ctype, stored = read.top.dtype.c_compute, read.base.dtype.c_storage
        offset = self._unit_offset(read)
        self.setup.append(f"__shared__ {stored} {name}_tile[{self.tile}][{self.tile + 1}];")
        if self.lanes == 1:
            self.prologue.append(f"{name}_tile[row][column] = {read.param}[{offset}];")
        else:
            vector = f"FlameVec<{stored}, {self.lanes}>"
            self.prologue.append(
                f"const {vector} {name}_vec = "
                f"*reinterpret_cast<const {vector}*>({read.param} + {offset});"
            )
            self.prologue.extend(
                f"{name}_tile[row][column + {j}] = {name}_vec.v[{j}];" for j in range(self.lanes)
            )
        value = load(read.base.dtype, f"{name}_tile[column + k][row]")
        self.body.append(f"const {ctype} {name} = {value};")
        self.values[id(read.top)] = self.tail_values[id(read.top)] = name

    def _unit_offset(self, read: Read) -> str:
        """A transposed operand's offset: its stride along the tile axis is 1 (what makes it
        transposed), spelled as a literal so the loads' addresses step by one element."""
        saved = read.strides
        read.strides = tuple(0 if axis == self.axis else s for axis, s in enumerate(saved))
        offset, _ = self._offset(read)
        read.strides = saved
        return f"{offset} + ia" if offset != "0" else "ia"

    def _read(self, read: Read) -> None:
        if _is_scalar(read):
            return super()._read(read)
        name = f"v{len(self.values)}"
        ctype = read.top.dtype.c_compute
        offset, _ = self._offset(read)
        self.body.append(
            f"const {ctype} {name} = {load(read.base.dtype, f'{read.param}[{offset}]')};"
        )
        self.values[id(read.top)] = self.tail_values[id(read.top)] = name

    def _tile_spec(self) -> KernelSpec:
        plain = self._spec()
        return KernelSpec(
            name=plain.name.replace("flame_ew_", f"flame_tile{self.axis}_", 1),
            template="transpose.cu.j2",
            index_type=self.index,
            block=THREADS,
            params=plain.params,
            header=plain.header,
            helpers=plain.helpers,
            setup=tuple(self.setup),
            prologue=tuple(self.prologue),
            body=(f"const {self.index} out_at = {self.out_at};",) + tuple(self.body),
            vec=self.lanes,
            epilogue=(),
            extras={
                "outer": tuple(self.outer),
                "tile": self.tile,
                "columns": self.tile // self.lanes,  # threads along a tile's row
                "rows": THREADS // (self.tile // self.lanes),
                "out_first": self.out_first,
                "before": tuple(self.before),
                "stores": tuple(self.stores),
                "axis": f"size{self.axis}",
                "last": f"size{self.last}",
            },  # fmt: skip
            size_class=f"tiled transpose (axis {self.axis} of {len(self.sizes)}), "
            f"{self.lanes} lanes, {'int64' if self.index != 'int' else 'int32'} index",
        )
