"""Random bits from a generator's state: ``philox(seed, counter)``.

``rand``/``randn`` with ``seed=`` are index-generated leaves (flame/ir/ops/leaves.py) whose
seed is part of the kernel's source. A draw from a ``flame.Generator`` instead reads its seed
and its counter offset from memory (a small int64 buffer), so a new draw, or a compiled
step replayed with the generator advanced, runs the same kernel with new numbers:

    counter = offset + element index (an ``arange`` generated in the kernel)
    bits    = philox(seed, counter, word=k)     # 24 random bits of Philox word k

Uniform and normal numbers are then ordinary elementwise ops on ``bits`` (flame/random.py),
so the whole draw fuses into the kernel that consumes it. The words are those of the
``flame_philox`` helper, so ``philox(s, i, word=0) * 2**-24`` is exactly ``rand`` with
``seed=s`` at index ``i``.
"""

from __future__ import annotations

import numpy as np

from flame.ir.ops.leaves import philox4x32
from flame.ir.ops.registry import def_op


def philox_ref(seed, counter, word=0):
    seed, counter = np.broadcast_arrays(np.asarray(seed), np.asarray(counter))
    words = philox4x32(
        counter.astype(np.int64).view(np.uint64), seed.astype(np.int64).view(np.uint64)
    )
    return (words[int(word)] >> np.uint32(8)).astype(np.int64)


def_op(
    "philox", "elementwise", 2, ref=philox_ref,
    cuda={"i": "((long long)(flame_philox((unsigned long long)({1}), "
               "(unsigned long long)({0})).word[{word}] >> 8))"},
    helpers=("flame_philox",), categories="i", attrs={"word": 0}, differentiable=False,
    internal=True, doc="24 random bits: Philox-4x32-10 word `word` of (counter, key=seed) >> 8",
)  # fmt: skip
