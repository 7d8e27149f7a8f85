"""Where a compiled call that draws random numbers spends its host time (H100 host):
cProfile over 2000 calls of a step with 8 draws, and the per-call wall time with 0/1/8 draws.

    PYTHONPATH=. python notes/probes/random_host.py
"""

import cProfile
import pstats
import time

import flame as fl


def body(x, draws):
    out = x * 1.5
    for _ in range(draws):
        out = out + fl.rand_like(x)
    return out


def main():
    with fl.backend("cuda"):
        x = fl.randn(1024).realize()
        for draws in (0, 1, 8):
            step = fl.compile(lambda x, draws=draws: body(x, draws))
            for _ in range(100):
                step(x)
            fl.synchronize()
            start = time.perf_counter()
            for _ in range(2000):
                step(x)
            fl.synchronize()
            print(f"{draws} draws: {(time.perf_counter() - start) / 2000 * 1e6:.2f} us/call")
            if draws == 8:
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(2000):
                    step(x)
                fl.synchronize()
                profile.disable()
                pstats.Stats(profile).sort_stats("tottime").print_stats(15)


main()
