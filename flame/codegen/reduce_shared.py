"""The shared-memory row cache of a row kernel: a row too long for the register cache but
whose reads fit in a block's shared memory is loaded from global memory once and every pass
reads it from there.

Which reads are held is decided by counting (the cost model of a row kernel's class): the
kernel is first lowered streamed, and the passes that load each operand counted
(``row_passes``); operands loaded by two passes or more are held, most-read first, while
their rows fit ``SHARED_ROW_BYTES`` at the planned row length. Each held read saves its
passes minus one of global-memory traffic (x of a streamed softmax forward + backward: 4 of
5 reads). The budget keeps two 512-thread blocks an SM (228 KB of shared memory an SM on the
H100): one block an SM loads, reduces and writes its row with nothing on the SM to overlap
(the register cache's 16-chunk class measured that: notes/long-rows.md).

A thread keeps the elements it loads at the positions it reads them from in every pass (the
same chunks), so no barrier guards the cache: the next row's loads overwrite only what the
same thread has finished with. Sizes stay arguments: the held reads' offsets follow
``num_inner`` in the kernel, and the launch's dynamic shared memory (``Lowered.shared_bytes``)
follows the planned length.

The launch passes ``shared_bytes`` and, above 48 KB, raises the function's
``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` (``flame/runtime/launch.py``). On the
H100 (notes/long-rows.md) it took bf16 softmax fwd+bwd at 8192 x 32768 from 1.314 to 1.220 ms
and left the longer rows (which do not fit) as they were.
"""

from __future__ import annotations

import re

ENABLED = True  # the launch passes Lowered.shared_bytes (flame/runtime/launch.py, 03b7fc3)
SHARED_ROW_BYTES = 112 * 1024  # two blocks an SM on the H100 (228 KB), static slots aside
SHARED_THREADS = 512  # two 512-thread blocks an SM: at most 64 registers a thread


def align(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


def row_passes(spec) -> dict[str, int]:
    """Per ``in`` parameter of a block-mode row kernel: how many passes load it from memory
    (loads a pass issues but does not use are dead code, not counted)."""
    extras = spec.extras
    names = [arg.name for arg in spec.params if arg.kind == "in"]
    passes = [(chunk, lane) for _, chunk, lane, *_ in extras["passes"]]
    passes.append((extras["final_chunk"], extras["final_lane"]))
    counts = dict.fromkeys(names, 0)
    for chunk, lane in passes:
        for name in names:
            if f"raw_{name}" in "\n".join(chunk) and _used(lane, name):
                counts[name] += 1
    return counts


def _used(lines, name: str) -> bool:
    text = "\n".join(lines).split(f"x_{name} =", 1)[-1]
    return re.search(rf"\bx_{name}\b", text) is not None


def choose(counts: dict[str, int], itemsizes: dict[str, int], num_inner: int) -> tuple:
    """The reads to hold: loaded by >= 2 passes, most passes first, while they fit."""
    ranked = sorted((name for name in counts if counts[name] >= 2), key=lambda n: -counts[n])
    chosen, used = [], 0
    for name in ranked:
        size = align(num_inner * itemsizes[name])
        if used + size <= SHARED_ROW_BYTES:
            chosen.append(name)
            used += size
    return tuple(sorted(chosen, key=list(counts).index))


def shared_bytes(held: tuple, itemsizes: dict[str, int], num_inner: int) -> int:
    return sum(align(num_inner * itemsizes[name]) for name in held)


def pointers(held: tuple, storages: dict[str, str], itemsizes: dict[str, int]) -> list[str]:
    """The held reads' rows in the dynamic shared memory, one after the other (16-byte
    aligned; their lengths follow ``num_inner``)."""
    lines, offset = [], "0"
    for name in held:
        storage = storages[name]
        lines.append(
            f"{storage}* const smem_{name} = reinterpret_cast<{storage}*>(flame_row_cache + {offset});"  # noqa: E501
        )
        size = f"((((size_t)num_inner * {itemsizes[name]}) + 15) & ~(size_t)15)"
        offset = size if offset == "0" else f"{offset} + {size}"
    return lines
