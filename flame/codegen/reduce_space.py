"""The iteration space of a reduce kernel and its launch shape: outer (kept) and inner
(reduced) axes, each collapsed, and the block size a row gets."""

from __future__ import annotations

from flame.codegen.elementwise import collapse
from flame.ir.shapes import contiguous_strides, prod
from flame.ir.views import expand_view, reshape_view

THREAD_SPLITS = 8  # column reductions: 8 warps share each group of 32 columns
THREAD_BLOCK = 32 * THREAD_SPLITS
THREAD_LANES = 8  # a thread issues 8 loads before it adds any: latency hidden
VECTOR_LANES = 4  # block mode: 16-byte loads of float32 rows
MAX_CACHE_ITEMS = 8  # a row of up to block * lanes * 8 values stays in registers (16 at 512)


# the smallest row block (64: rows of up to 512 four-lane values in two warps)
MIN_ROW_THREADS = 128


def block_size(inner: int, lanes: int) -> int:
    """The smallest block that keeps a row in at most 2 chunks per thread; long rows take
    512 threads (up to 16 chunks each, still cached) and only the longest 1024."""
    # measured on the H100 (layer norm over 4096): 512 threads x 2 chunks 0.1800 ms,
    # 256 x 4 0.1813, 128 x 8 0.1847, 1024 x 1 0.2185 (notes/performance.md)
    for size in (64, 128, 256, 512):
        if size >= MIN_ROW_THREADS and inner <= size * lanes * 2:
            return size
    return 512 if inner <= 512 * lanes * 2 * MAX_CACHE_ITEMS else 1024


def cache_class(items: int, limit: int | None = 2 * MAX_CACHE_ITEMS) -> int:
    """The register cache a row of ``items`` chunks a thread gets: the next of 2, 4, 8, 16
    (0: beyond ``limit``, the row streams). Code depends on the class, never on the row
    length itself: rows of one class share one kernel, launched with the threads the length
    asks for (``block_size``)."""
    size = 2
    while size < items:
        size *= 2
    return 0 if limit is not None and size > limit else size


class Space:
    """The input space split into outer (kept) and inner (reduced) axes, each collapsed."""

    def __init__(self, shape, axes, stride_sets):
        kept = [axis for axis in range(len(shape)) if axis not in axes]
        self.outer_sizes, outer = collapse(
            [shape[a] for a in kept], [[s[a] for a in kept] for s in stride_sets]
        )
        self.inner_sizes, inner = collapse(
            [shape[a] for a in axes], [[s[a] for a in axes] for s in stride_sets]
        )
        self.outer_strides, self.inner_strides = outer, inner
        self.num_outer, self.num_inner = prod(self.outer_sizes), prod(self.inner_sizes)
        self.block_mode = bool(axes) and axes[-1] == len(shape) - 1


def same_reads(reads, views):
    """Reads of one buffer through one view over the space (``dy`` read by the rows and as
    ``(P, S, C)`` by the strip sums) load once: the later ones become names of the first."""
    kept, kept_views, same, first = [], [], {}, {}
    for read, view in zip(reads, views):
        key = (id(read.base), view, read.generated)
        if key in first:
            same[id(read.top)] = first[key]
            continue
        first[key] = read
        kept.append(read)
        kept_views.append(view)
    return kept, kept_views, same


def space_view(view, shape, kept):
    """A read's view over the input space. A per-row value without its reduced axes
    (``keepdim=False``) is first given them back, then broadcast over the rows; a value of
    the strip space ``(P, S, *row)`` is reshaped back onto the rows."""
    if view.shape != shape and prod(view.shape) == prod(kept) and len(view.shape) != len(shape):
        view = reshape_view(view, kept)
    elif view.shape != shape and prod(view.shape) == prod(shape) and len(view.shape) > 1:
        flat = reshape_view(view, shape)
        if flat is None:
            raise ValueError(f"strip read {view} is not a view of the rows {shape}")
        return flat
    return expand_view(view, shape)


def output_strides(node, shape, kept):
    """Outputs are contiguous: of the input shape, or of the reduced shape (broadcast)."""
    if node.shape == shape:
        return contiguous_strides(shape)
    strides = contiguous_strides(kept)
    return tuple(0 if size == 1 else stride for size, stride in zip(kept, strides))
