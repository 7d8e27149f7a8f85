"""The iteration space of a reduce kernel and its launch shape: outer (kept) and inner
(reduced) axes, each collapsed, and the block size a row gets."""

from __future__ import annotations

from flame.codegen.elementwise import collapse
from flame.ir.shapes import prod

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
