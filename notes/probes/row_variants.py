"""Run a probe or bench module with the row-kernel launch switches flipped, in this process
only: an A/B of the row (block-mode reduce) kernels without editing the code.

    FLAME_ROW_VARIANT=wide,small PYTHONPATH=. python3 notes/probes/row_variants.py \
        notes/probes/diffusion_step_case.py unet full 32 64 flame

``wide``: 2-byte rows load 16-byte vectors (``reduce.WIDE_HALF_VECTORS``). ``small``: a row
gets the smallest block that holds it in up to 8 register chunks a thread (128 threads for
rows of up to 4096 values at 4 lanes) instead of up to 2. Use a fresh ``FLAME_CACHE_DIR``
and ``FLAME_PLAN_CACHE=0`` so no stored plan of the other code is loaded.
"""

import os
import runpy
import sys

from flame.codegen import reduce, reduce_space

variant = set(filter(None, os.environ.get("FLAME_ROW_VARIANT", "").split(",")))
if "wide" in variant:
    reduce.WIDE_HALF_VECTORS = True
if "small" in variant:
    original = reduce_space.block_size

    def block_size(inner: int, lanes: int) -> int:
        for size in (128, 256, 512):
            if inner <= size * lanes * reduce_space.MAX_CACHE_ITEMS:
                return size
        return original(inner, lanes)

    reduce.block_size = block_size
print(f"row variant: {sorted(variant) or 'head'}", flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
