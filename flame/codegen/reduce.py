"""Lowering of a reduce group: reductions over one input shape and axes, with their prologue
(values of the input shape) and epilogue (values of the reduced shape), in passes.

Pass p computes the reductions whose inputs need only what passes before it produced; a
last pass writes the values of the input shape. Softmax is three passes (max, sum of exp,
write) over a row in one kernel. Two layouts:

* ``block``: the reduced axes include the innermost one; a block owns an outer index (a row)
  and its threads stride along the row, then combine through warp shuffles;
* ``thread``: the innermost axis is kept (e.g. a sum over the middle axis); a thread owns
  an outer index and walks the reduced axes, so a warp reads consecutive addresses.

A block-mode group may also hold *strip* reductions (``flame/ir/passes/row_columns.py``):
reductions over axis 1 of ``(P, S, *row)``, the rows cut into P strips of S rows. Then a block
owns a strip, each thread keeps the partial results of its columns in registers over the
strip's rows (accumulated in the last pass, with the row outputs) and writes them at the end:
as partial rows, or added atomically into their total (``reduce_strips.py``). Operand
addressing and loads live in ``reduce_loads.py``.
"""

from __future__ import annotations

import hashlib

from flame.codegen import reduce_shared
from flame.codegen.common import (
    Helpers,
    Read,
    SizeArgs,
    buffer_params,
    collect_reads,
    header,
    kernel_stem,
    store,
)  # fmt: skip
from flame.codegen.elementwise import Lowered, index_type_for
from flame.codegen.reduce_columns import ColumnVectors, column_vector_lines
from flame.codegen.reduce_loads import RowLoads
from flame.codegen.reduce_online import online_pairs
from flame.codegen.reduce_passes import RowPasses
from flame.codegen.reduce_space import (
    THREAD_BLOCK,
    THREAD_LANES,
    THREAD_SPLITS,
    VECTOR_LANES,
    Space,
    block_size,
    cache_class,
    output_strides,
    same_reads,
    space_view,
)  # fmt: skip
from flame.codegen.reduce_strips import (
    atomic_outputs,
    partial_total_adds,
    rows_strips_totals,
    strip_sum,
)  # fmt: skip
from flame.codegen.spec import Arg, KernelSpec
from flame.ir.graph import Group
from flame.ir.ops import get_op
from flame.ir.shapes import contiguous_strides, prod

COLUMN_MIN_BLOCKS = 2  # strip kernels: two blocks an SM (<= 64 registers at 512 threads)
# Rows of up to 32 lanes x WARP_MAX_ITEMS chunks (1,024 bf16 or 512 float32 values: a DiT's
# layer norms over 384) run a warp a row, WARP_ROWS rows a block, combined by shuffles alone,
# in one size class (each lane's cache is WARP_MAX_ITEMS chunks, predicated by the length):
# a block a row left most of a 128-thread block idle on them (50-54 % of the byte floor,
# notes/dit-kernel-floors.md). 0: a block a row always.
WARP_ROWS = 8
WARP_MAX_ITEMS = 4
# 2-byte rows in 16-byte vectors (8 lanes) instead of 8-byte ones. Measured on the H100
# (notes/performance.md, session 19): a bf16 ResBlock's GroupNorm row kernels 134.6 -> 98.8 us
# (38.8 -> 26.2 us for rows of 4,096), the UNet step 22.35 -> 22.14 ms
WIDE_HALF_VECTORS = True


def lower_reduce(group: Group, layout_of, cache_items: int | None = None) -> Lowered:
    """``cache_items``: lower for that row-cache class (2, 4, 8, 16; 0 streamed; ``SHARED``
    the shared-memory row cache) whatever the sizes ask for -- another size class of the same
    kernel (``sibling_specs``). A streamed row whose reads are loaded by several passes holds
    those that fit in shared memory (``reduce_shared.py``: chosen by counting the passes)."""
    shared = cache_items == SHARED
    writer, lowered = _lower(group, layout_of, 0 if shared else cache_items, ())
    automatic = cache_items is None and reduce_shared.ENABLED  # a forced class stays
    if not (shared or automatic) or not writer.space.block_mode:
        return lowered
    if writer.items or writer.columns or not writer.walkable:
        return lowered
    counts = reduce_shared.row_passes(lowered.spec)
    counts = {name: n for name, n in counts.items() if name in writer.holdable}
    held = reduce_shared.choose(counts, writer.itemsizes, writer.space.num_inner)
    if not held:
        return lowered
    return _lower(group, layout_of, 0, held)[1]


def _lower(group: Group, layout_of, cache_items, held) -> tuple:
    reduces = [node for node in group.nodes if get_op(node.op).kind == "reduce"]
    rows, columns, totals = rows_strips_totals(group, reduces)
    shape, axes = rows[0].inputs[0].shape, rows[0].attr("axes")
    kept = tuple(1 if axis in axes else size for axis, size in enumerate(shape))
    reads, aliases = collect_reads(group, layout_of)
    views = [space_view(read.view, shape, kept) for read in reads]
    reads, views, same = same_reads(reads, views)
    column_ids = {id(node) for node in columns + totals}
    atomic = atomic_outputs(group, totals, aliases)
    skipped = column_ids | {id(group.outputs[position]) for position in atomic}
    outputs = [node for node in group.outputs if id(node) not in skipped]
    out_views = [output_strides(node, shape, kept) for node in outputs]
    stride_sets = [view.strides for view in views] + out_views
    space = Space(shape, axes, stride_sets)
    writer = _ReduceWriter(group, space, reads, aliases, shape, kept)
    writer.same_reads, writer.columns = same, columns
    writer.column_ids, writer.atomic, writer.skipped = column_ids, atomic, skipped
    writer.column_shape = columns[0].inputs[0].shape if columns else None
    writer.out_index = {
        position: len(reads) + outputs.index(node)
        for position, node in enumerate(group.outputs) if id(node) not in skipped
    }  # fmt: skip
    writer.index = index_type_for(prod(shape), reads)
    writer.size_args.index = writer.index
    writer.forced = cache_items
    writer.held = held
    return writer, writer.build(out_views)


SHARED = -1  # ``cache_items`` asking for the shared-memory row cache (sibling_specs)
# the row classes of a row kernel: register caches, streamed (0), shared memory (SHARED)
ROW_CLASSES = (2, 4, 8, 16, 0, SHARED)


def sibling_specs(group: Group, layout_of, lowered: Lowered) -> list[KernelSpec]:
    """The other row-cache classes of a row kernel's code: what a new image size of the same
    model would need. Compiled in the background (flame/runtime/siblings.py), they make a
    new resolution's first call a re-plan without an NVRTC compile."""
    extras = lowered.spec.extras
    if extras.get("mode") != "block" or extras.get("column_declare"):
        return []
    specs = []
    for items in ROW_CLASSES:
        if items == SHARED and not reduce_shared.ENABLED:
            continue
        if items == _row_class(lowered.spec) and not extras.get("warp_rows"):
            continue  # (a warp-rows kernel's block classes are all other code)
        sibling = lower_reduce(group, layout_of, items)
        if _row_class(sibling.spec) == items:  # it fits (its registers, or a held read)
            specs.append(sibling.spec)
    return specs


def _row_class(spec) -> int:
    return SHARED if "shared_fill" in spec.extras else spec.extras["cache_items"]


class _ReduceWriter(RowLoads, RowPasses, ColumnVectors):
    def __init__(self, group, space, reads, aliases, shape, kept):
        self.group, self.space, self.reads, self.aliases = group, space, reads, aliases
        self.shape, self.kept = shape, kept
        self.members = {id(node) for node in group.nodes}
        self.params: list[Arg] = []
        self.helpers = Helpers()
        self.outer_lines: list[str] = []
        self.passes: list[dict] = []
        self.index = "int"
        self.scalar_values: dict[int, str] = {}
        self.same_reads: dict[int, Read] = {}
        self.columns: list = []
        self.column_ids: set[int] = set()  # strip reductions and their totals
        self.atomic: dict[int, object] = {}  # output position -> total added atomically
        self.skipped: set[int] = set()  # outputs the row and scalar stores leave alone
        self.column_shape = None
        self.out_index: dict[int, int] = {}
        self.forced: int | None = None  # a row-cache class asked for (lower_reduce)
        self.warp_rows = 0  # rows a block when a warp owns a row (short rows), else 0
        self.column_lanes = 1  # neighbouring columns a column kernel's thread loads at once
        self.block_rows = False  # a block a row whatever the length
        self.held: tuple = ()  # ``in`` parameters held in shared memory (reduce_shared.py)
        self.size_args = SizeArgs(group)  # constants as arguments (const_text)
        self.online: dict = {}  # id(sum of exp) -> its max taken with it (reduce_online.py)
        self.level = self._levels()

    def _levels(self) -> dict[int, int]:
        """How many reduction passes must finish before each value can be computed (strip
        reductions are no pass of their own: the last pass accumulates them)."""
        level: dict[int, int] = {}
        rows = self.shape
        for node in self.group.nodes:
            needs = max([self._level_of(child, level) for child in node.inputs], default=0)
            kind = get_op(node.op).kind
            row_reduce = kind == "reduce" and node.inputs[0].shape == rows
            # an online sum of exp is taken in its max's pass (reduce_online.py)
            ahead = row_reduce and id(node) not in self.online
            level[id(node)] = needs + 1 if ahead else needs
        return level

    def _level_of(self, node, level) -> int:
        node = self.aliases.get(id(node), node)
        return level.get(id(node), 0)

    def _is_row(self, node) -> bool:
        shapes = (self.shape, self.column_shape)
        return node.shape in shapes and get_op(node.op).kind != "reduce"

    def build(self, out_views) -> Lowered:
        self.params, buffers = buffer_params(self.group, self.reads)
        self.params.append(Arg("size", self.index, "num_outer", self.space.num_outer))
        self.params.append(Arg("size", self.index, "num_inner", self.space.num_inner))
        if self.columns:
            self.params.append(Arg("size", self.index, "strip_rows", self.column_shape[1]))
        self._outer_math(out_views)
        self.outer_lines.extend(self._scalar_statements(0))
        self._choose_layout()
        self.online = online_pairs(self)
        if self.online:
            self.level = self._levels()
        self.cache_declarations: list[str] = []
        self.cache_load_lines = self._cache_loads() if self.items else []
        self.shared_fill = self._shared_fill() if self.held else []
        depth = max(self.level.values(), default=0)
        for number in range(1, depth + 1):
            self.passes.append(self._pass(number))
        self.final = self._final_pass(out_views)
        self.column_lanes = self._column_lanes(depth)
        self.params.extend(self.size_args.values())
        shared = 0
        if self.held:
            shared = reduce_shared.shared_bytes(self.held, self.itemsizes, self.space.num_inner)
        return Lowered(self._spec(depth), tuple(r.base for r in buffers), tuple(self.group.outputs),
                       prod(self.shape), self._blocks(), tuple(sorted(self.atomic)),
                       self.threads, shared)  # fmt: skip

    def _choose_layout(self) -> None:
        """Lanes per chunk, vector loads, block size and the row cache (see module doc)."""
        space = self.space
        self.vector_reads, self.vector_outputs, self.items = {}, False, 0
        self.cached_reads: set[int] = set()
        self.loop_items = 0
        if self.columns and not space.block_mode:
            raise ValueError("strip reductions need a row kernel (reduced innermost axis)")
        if not space.block_mode:
            self.lanes = THREAD_LANES if len(space.inner_sizes) == 1 else 1
            self.block = self.threads = THREAD_BLOCK
            return
        self.lanes = 1
        # several reduced axes (a group norm's channels x positions): reads that walk the
        # row in order (``flat``) load, vectorize and cache as one axis; the others (a
        # per-channel weight) decompose each chunk's index
        walkable = self.walkable = self._walkable()
        # a vector's lanes share every reduced axis but the last
        for lanes in self._vector_choices():
            vector_fits = walkable and space.inner_sizes[-1] % lanes == 0
            if vector_fits and space.num_inner % lanes == 0 and self._vectorizable(lanes):
                self.lanes = lanes
                break
            self.vector_reads, self.vector_outputs = {}, False
        # the launch's threads follow the row length; the code only follows its size class
        self.threads = block_size(space.num_inner, self.lanes)
        # short rows: a warp a row, WARP_ROWS rows a block (a named size class; the forced
        # classes of the background sibling compiler stay one block a row)
        short = space.num_inner <= 32 * self.lanes * WARP_MAX_ITEMS
        warp = short and self.forced is None and not self.columns and not self.block_rows
        self.warp_rows = WARP_ROWS if warp else 0
        row_threads = 32 if self.warp_rows else self.threads
        items = -(-space.num_inner // (row_threads * self.lanes))
        # rows of data are cached; values the same for every row (weights, biases) are
        # re-read from L1 where needed instead of holding registers
        row_reads = [
            r for position, r in enumerate(self.reads)
            if id(r.top) not in self.scalar_values and not r.generated
            and any(self.space.outer_strides[position]) and self._cacheable(position)
        ]  # fmt: skip
        self.cached_reads = {id(r) for r in row_reads}
        self.holdable = {r.param for r in row_reads}  # what the shared row cache may hold
        self.itemsizes = {r.param: r.base.dtype.itemsize for r in self.reads}
        # 1024-thread blocks leave 64 registers a thread: rows that long stream from L2
        held = len(row_reads) + len(self.columns)  # strip sums stay in registers too
        cached = cache_class(items) if self.forced is None else self.forced
        if self.warp_rows:  # one class for every short row: its length changes no code
            cached = WARP_MAX_ITEMS
        fits = cached * self.lanes * held <= 96 and (self.threads <= 512 or self.forced)
        if walkable and cached and fits and held:  # a class only where something is held
            self.items = cached
        # strip sums: every thread owns the same columns in every row of its strip
        self.loop_items = cache_class(items, limit=None) if self.columns else self.items
        # __launch_bounds__: the most threads any row of the class launches with
        self.block = 512 if self.items or self.columns else 1024
        if self.warp_rows and not self.items:
            self.block_rows = True  # a streamed row keeps a block (and the shared row cache)
            return self._choose_layout()
        if self.warp_rows:
            self.block = self.threads = 32 * self.warp_rows
        if self.held:  # two blocks an SM share its shared memory (reduce_shared.py)
            self.block = self.threads = min(self.threads, reduce_shared.SHARED_THREADS)

    def _flat(self, position: int) -> bool:
        """Operand ``position`` walks the reduced axes in order, as one contiguous axis."""
        return self.space.inner_strides[position] == contiguous_strides(self.space.inner_sizes)

    def _cacheable(self, position: int) -> bool:
        """Operand ``position``'s chunk loads need no per-chunk index decomposition: one
        reduced axis (any stride), or several walked in order."""
        return len(self.space.inner_sizes) == 1 or self._flat(position)

    def _walkable(self) -> bool:
        """The row is one axis for every operand, or its operands are flat, per-row scalars,
        or broadcast along the innermost reduced axis or contiguous in it (decomposed once a
        chunk)."""
        if len(self.space.inner_sizes) <= 1:
            return bool(self.space.inner_sizes)  # no reduced axis left: one value a row
        for position, read in enumerate(self.reads):
            if id(read.top) in self.scalar_values or self._flat(position):
                continue
            if read.generated or self.space.inner_strides[position][-1] not in (0, 1):
                return False
        return not self.columns

    def _vector_choices(self) -> tuple[int, ...]:
        """Lanes a chunk may take, widest first: 16-byte vectors of 2-byte rows (8 lanes)
        where ``WIDE_HALF_VECTORS`` is on (not with strip sums: their float4 atomics take 4),
        else 4 (16 bytes of float32, 8 of a 2-byte type)."""
        if WIDE_HALF_VECTORS and not self.columns:
            return (2 * VECTOR_LANES, VECTOR_LANES)
        return (VECTOR_LANES,)

    def _vectorizable(self, lanes: int = VECTOR_LANES) -> bool:
        vectorized = [  # per-row values (a class index) are read once a row, not in vectors
            read for read in self.reads
            if not read.generated and id(read.top) not in self.scalar_values
        ]  # fmt: skip
        widest = max([read.base.dtype.itemsize for read in vectorized], default=1)
        rows = [node for node in self.group.outputs if node.shape == self.shape]
        widest = max([widest] + [node.dtype.itemsize for node in rows])
        if widest * lanes > 16:  # vectors of 16 bytes at most: their alignment
            return False
        for position, read in enumerate(self.reads):
            if id(read.top) in self.scalar_values or read.generated:
                continue
            inner = self.space.inner_strides[position][-1]
            outer = self.space.outer_strides[position]
            if inner not in (0, 1) or not read.aligned:
                return False
            if inner == 1 and self._flat(position):
                if read.view.offset % lanes or any(s % lanes for s in outer):
                    return False
                self.vector_reads[id(read)] = True
        for position, output in enumerate(self.group.outputs):
            if output.shape == self.shape:
                inner = self.space.inner_strides[self.out_index[position]][-1]
                outer = self.space.outer_strides[self.out_index[position]]
                flat = self._flat(self.out_index[position])
                if inner != 1 or not flat or any(s % lanes for s in outer):
                    self.vector_reads.clear()
                    self.vector_outputs = False
                    return False
                self.vector_outputs = True
        return True

    def _blocks(self) -> int:
        if self.columns:
            return self.column_shape[0]  # a block per strip
        if self.space.block_mode:
            return -(-self.space.num_outer // max(self.warp_rows, 1))
        return -(-self.space.num_outer // (32 * self.column_lanes))

    def _final_pass(self, out_views) -> dict:
        rows = [o for o in self.group.outputs if o.shape == self.shape]
        chunk, lane, after, scalars = [], [], [], []
        self.column_lines: dict[str, list[str]] = {"declare": [], "store": []}
        if rows or self.columns:
            values: dict[int, str] = {}
            self._lane_reads(chunk, lane, values, cached=self.items > 0)
            targets = rows + [node.inputs[0] for node in self.columns]
            self._row_statements(lane, targets, values)
            for position, output in enumerate(self.group.outputs):
                if output.shape == self.shape:
                    self._row_store(position, output, values, chunk, lane, after)
            for node in self.columns:
                strip_sum(self, node, values, lane)
        for position, output in enumerate(self.group.outputs):
            if output.shape != self.shape and id(output) not in self.skipped:
                value = store(output.dtype, self._value(output, {}))
                scalars.append(f"out{position}[out{position}_outer] = {value};")
        scalars.extend(partial_total_adds(self))
        return {"chunk": chunk, "lane": lane, "after": after, "scalars": scalars}

    def _row_store(self, position, output, values, chunk, lane, after):
        value = store(output.dtype, self._value(output, values))
        strides = self.space.inner_strides[self.out_index[position]]
        if self.vector_outputs:
            vector = f"FlameVec<{output.dtype.c_storage}, {self.lanes}>"
            chunk.append(f"{vector} store_{position};")
            lane.append(f"store_{position}.v[k] = {value};")
            target = f"out{position} + out{position}_outer + chunk"
            after.append(f"*reinterpret_cast<{vector}*>({target}) = store_{position};")
            return
        if self._flat(self.out_index[position]):
            offset = "inner"  # in row order: the row's linear index
        else:
            indices = self._decompose(lane, "inner", self.space.inner_sizes, f"w{position}_")
            offset = self._linear(f"out{position}_r", strides, indices)
        lane.append(f"out{position}[out{position}_outer + {offset}] = {value};")

    def _spec(self, depth) -> KernelSpec:
        extras = {
            "mode": "block" if self.space.block_mode else "thread",
            "splits": THREAD_SPLITS,
            "split_combines": tuple(
                tuple(
                    (name, ctype, identity, _split_combine(name, combine_template))
                    for (name, ctype, identity, _), combine_template in zip(
                        p["accumulators"], p["combines"]
                    )
                )
                for p in self.passes
            ),
            "lanes": self.lanes,
            "cache_items": self.items,
            "cache": tuple(self.cache_declarations),
            "cache_loads": tuple(self.cache_load_lines),
            "outer": tuple(self.outer_lines),
            "passes": tuple(
                (
                    tuple(p["init"]),
                    tuple(p["chunk"]),
                    tuple(p["lane"]),
                    tuple(p["accumulators"]),
                    tuple(p["finish"]),
                )
                for p in self.passes
            ),  # fmt: skip
            "final_chunk": tuple(self.final["chunk"]),
            "final_lane": tuple(self.final["lane"]),
            "final_after": tuple(self.final["after"]),
            "final_scalars": tuple(self.final["scalars"]),
            "loop_items": self.loop_items,
            "warp_rows": self.warp_rows,
            "column_lanes": self.column_lanes,
            "min_blocks": COLUMN_MIN_BLOCKS if self.columns else 0,
            "column_declare": tuple(self.column_lines["declare"]),
            "column_store": tuple(self.column_lines["store"]),
        }
        if self.column_lanes > 1:
            extras["column_vectors"] = column_vector_lines(
                self.passes[0], self.final, self.column_lanes
            )
        if self.held:  # the shared-memory row cache (reduce_shared.py)
            storages = {r.param: r.base.dtype.c_storage for r in self.reads}
            extras["shared"] = tuple(reduce_shared.pointers(self.held, storages, self.itemsizes))
            extras["shared_fill"] = tuple(self.shared_fill)
            extras["min_blocks"] = 2
        if self.online:  # per pass, the online pairs' merge statements (reduce_online.py)
            extras["online"] = tuple(p["online"] for p in self.passes)
        code = [(a.kind, a.ctype, a.name) for a in self.params]  # sizes are arguments, not code
        text = repr((self.index, self.block, code, extras, self.helpers.sources))
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        return KernelSpec(
            name=f"flame_reduce_{kernel_stem(self.group)}_{digest}", template="reduce.cu.j2",
            index_type=self.index, vec=self.lanes, block=self.block, params=tuple(self.params),
            header=header(self.group), helpers=tuple(self.helpers.sources), setup=(),
            prologue=(), body=(), epilogue=(), extras=extras, size_class=self._size_class(),
        )  # fmt: skip

    def _size_class(self) -> str:
        """The sizes this code serves, named: vector lanes, how a row is held, index width."""
        if not self.space.block_mode and self.column_lanes == 1:
            row = "columns"
        elif self.columns:
            row = f"strips of <= {self.loop_items} chunks a thread"
        elif not self.space.block_mode and self.column_lanes > 1:
            row = f"column vectors of {self.column_lanes}"
        elif self.items and self.warp_rows:
            row = f"warp rows, <= {self.items} chunks a lane"
        elif self.items:
            row = f"row cached, <= {self.items} chunks a thread"
        elif self.held:
            row = f"row in shared memory ({len(self.held)} of {len(self.holdable)} reads)"
        else:
            row = "row streamed"
        axes = f"{len(self.space.outer_sizes)}+{len(self.space.inner_sizes)} axes"  # kept+reduced
        index = "int64" if self.index != "int" else "int32"
        return f"{row}, {axes}, {self.lanes} lanes, {index} index"


def _split_combine(name: str, combine: str) -> str:
    """The statement folding split ``part``'s partial result into ``name``."""
    return f"{name} = " + combine.format(name, f"shared_{name}[part][column]")
