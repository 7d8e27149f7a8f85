"""cProfile of lazy-mode ``e.lerp_(p, w)`` (200 tensors of [1024, 784], no_grad) on the GPU:
where the host time of an in-place write goes.

    PYTHONPATH=. python notes/probes/inplace_profile.py
"""

import cProfile
import pstats

import numpy as np

import flame as fl


def main():
    rng = np.random.default_rng(0)
    with fl.backend("cuda"):
        params = [fl.tensor(rng.standard_normal((1024, 784), dtype=np.float32)).realize()
                  for _ in range(200)]  # fmt: skip
        ema = [fl.tensor(rng.standard_normal((1024, 784), dtype=np.float32)).realize()
               for _ in range(200)]  # fmt: skip

        def lazy():
            with fl.no_grad():
                for e, p in zip(ema, params):
                    e.lerp_(p, 1e-3)

        for _ in range(3):
            lazy()
        fl.synchronize()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(5):
            lazy()
        fl.synchronize()
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
        pstats.Stats(profile).sort_stats("cumtime").print_stats(25)


main()
