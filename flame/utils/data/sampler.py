"""``Sampler``, and the permutation PyTorch's samplers draw (``torch.randperm`` on the CPU),
reproduced so a seed gives the same order as in PyTorch."""

from __future__ import annotations

import numpy as np

_UINT32 = 0xFFFFFFFF


class Sampler:
    """Base class of samplers: an iterable of dataset indices (``torch.utils.data.Sampler``)."""

    def __init__(self, data_source=None) -> None:
        pass

    def __iter__(self):
        raise NotImplementedError


def torch_randperm(n: int, seed: int) -> list[int]:
    """``torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()``.

    PyTorch's CPU generator is a 32-bit Mersenne Twister seeded with the seed's low 32 bits
    (NumPy's ``MT19937`` with legacy seeding is the same engine); ``randperm`` swaps
    ``r[i]`` with ``r[i + z]``, ``z = next() % (n - i)``, for ``i`` in ``0 .. n-2`` (for
    ``n`` of 2**32 / 20 or more it draws 64 bits per step, two outputs, first one high)."""
    if n < 0:
        raise ValueError(f"randperm: n must be non-negative, got {n}")
    legacy = np.random.RandomState(seed & _UINT32)
    _, key, position, _, _ = legacy.get_state()
    engine = np.random.MT19937()
    engine.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": position}}
    steps = max(n - 1, 0)
    if n < _UINT32 // 20:
        draws = engine.random_raw(steps).tolist()
    else:
        pairs = engine.random_raw(2 * steps).reshape(-1, 2)
        draws = ((pairs[:, 0] << np.uint64(32)) | pairs[:, 1]).tolist()
    order = list(range(n))
    for i, draw in enumerate(draws):
        j = i + draw % (n - i)
        order[i], order[j] = order[j], order[i]
    return order
