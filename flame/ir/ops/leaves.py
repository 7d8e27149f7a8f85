"""Leaves (no tensor inputs) and movement ops.

Leaves that are functions of the element index (``rand``, ``randn``, ``arange``) are generated
inside whatever kernel consumes them, so ``fl.randn(...) * 2`` never writes the random numbers
to memory. Random numbers come from Philox-4x32-10 keyed by the seed and counted by the
element's index in its own tensor: the same seed gives the same numbers whatever the fusion
decided, on the GPU and in the reference interpreter alike.
"""

from __future__ import annotations

import numpy as np

from flame.ir.ops.registry import def_helper, def_op

# --- data and constants --------------------------------------------------------------------

def_op("buffer", "leaf", 0, differentiable=True, doc="a realized array (the Storage in attrs)")
def_op(
    "const",
    "leaf",
    0,
    differentiable=False,
    attrs={"value": 0, "sized": ""},
    doc="a scalar constant; ``sized`` (its role): derived from sizes, a kernel argument",
)

# --- index-generated leaves ---------------------------------------------------------------

_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32(index: np.ndarray, seed: int) -> tuple[np.ndarray, ...]:
    """Philox-4x32-10 of counter (index_lo, index_hi, 0, 0) and key (seed_lo, seed_hi)."""
    index = index.astype(np.uint64)
    counter = [index & _MASK32, index >> np.uint64(32)]
    counter += [np.zeros_like(counter[0]), np.zeros_like(counter[0])]
    if isinstance(seed, np.ndarray):  # one key per element (a generator's seed, broadcast)
        seed = seed.astype(np.uint64)
        key = [seed & _MASK32, seed >> np.uint64(32)]
    else:
        key = [np.uint64(seed & 0xFFFFFFFF), np.uint64((seed >> 32) & 0xFFFFFFFF)]
    for _ in range(10):
        product0 = counter[0] * np.uint64(_PHILOX_M0)
        product1 = counter[2] * np.uint64(_PHILOX_M1)
        counter = [
            (product1 >> np.uint64(32)) ^ counter[1] ^ key[0],
            product1 & _MASK32,
            (product0 >> np.uint64(32)) ^ counter[3] ^ key[1],
            product0 & _MASK32,
        ]
        key = [
            (key[0] + np.uint64(_PHILOX_W0)) & _MASK32,
            (key[1] + np.uint64(_PHILOX_W1)) & _MASK32,
        ]
    return tuple(word.astype(np.uint32) for word in counter)


def _uniform(word: np.ndarray) -> np.ndarray:
    return (word >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def rand_ref(shape, seed):
    words = philox4x32(np.arange(int(np.prod(shape)), dtype=np.uint64), seed)
    return _uniform(words[0]).reshape(shape)


def randn_ref(shape, seed):
    words = philox4x32(np.arange(int(np.prod(shape)), dtype=np.uint64), seed)
    radius_source = _uniform(words[0]) + np.float32(1.0 / (1 << 24))  # (0, 1]: log is finite
    angle = _uniform(words[1]) * np.float32(2 * np.pi)
    return (np.sqrt(-2.0 * np.log(radius_source)) * np.cos(angle)).astype(np.float32).reshape(shape)


def arange_ref(shape, start, step):
    return start + np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) * step


def_helper(
    "flame_philox",
    f"""
struct FlamePhilox {{ unsigned int word[4]; }};
__device__ __forceinline__ FlamePhilox flame_philox(unsigned long long index,
                                                    unsigned long long seed) {{
    unsigned int c0 = (unsigned int)index, c1 = (unsigned int)(index >> 32), c2 = 0, c3 = 0;
    unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
    #pragma unroll
    for (int round = 0; round < 10; ++round) {{
        const unsigned int hi0 = __umulhi({_PHILOX_M0:#x}u, c0), lo0 = {_PHILOX_M0:#x}u * c0;
        const unsigned int hi1 = __umulhi({_PHILOX_M1:#x}u, c2), lo1 = {_PHILOX_M1:#x}u * c2;
        c0 = hi1 ^ c1 ^ k0; c1 = lo1; c2 = hi0 ^ c3 ^ k1; c3 = lo0;
        k0 += {_PHILOX_W0:#x}u; k1 += {_PHILOX_W1:#x}u;
    }}
    FlamePhilox result = {{{{c0, c1, c2, c3}}}};
    return result;
}}
__device__ __forceinline__ float flame_uniform(unsigned int word) {{
    return (float)(word >> 8) * (1.0f / 16777216.0f);
}}
__device__ __forceinline__ float flame_rand(unsigned long long index, unsigned long long seed) {{
    return flame_uniform(flame_philox(index, seed).word[0]);
}}
__device__ __forceinline__ float flame_randn(unsigned long long index, unsigned long long seed) {{
    const FlamePhilox bits = flame_philox(index, seed);
    const float radius_source = flame_uniform(bits.word[0]) + (1.0f / 16777216.0f);
    const float angle = flame_uniform(bits.word[1]) * 6.283185307179586f;
    return sqrtf(-2.0f * logf(radius_source)) * cosf(angle);
}}""",
)
def_op(
    "rand", "leaf", 0, ref=rand_ref, cuda={"f": "flame_rand({index}, {seed}ull)"},
    helpers=("flame_philox",), attrs={"seed": 0}, differentiable=False,
    doc="uniform [0, 1) from Philox(seed, element index)",
)  # fmt: skip
def_op(
    "randn", "leaf", 0, ref=randn_ref, cuda={"f": "flame_randn({index}, {seed}ull)"},
    helpers=("flame_philox",), attrs={"seed": 0}, differentiable=False,
    doc="standard normal (Box-Muller) from Philox(seed, element index)",
)  # fmt: skip
def_op(
    "arange", "leaf", 0, ref=arange_ref,
    cuda={"f": "({start} + (float){index} * {step})", "i": "({start} + {index} * {step})"},
    attrs={"start": 0, "step": 1}, differentiable=False,
)  # fmt: skip
