"""Where the first compiled UNet training step spends its time (cold caches).

    FLAME_CACHE_DIR=$(mktemp -d) CUPY_CACHE_DIR=$(mktemp -d) \
        python notes/probes/first_step_profile.py OUT_DIR [size image batch]

Builds bench.diffusion's FLAME trainer, runs the first step under cProfile, and writes
``first_step.pstats`` plus a text summary (wall times, FLAME's kernel events, the top
functions by cumulative and by own time) under OUT_DIR.
"""

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

from bench import conv_attention as ca
from bench import diffusion as bd


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    size, image, batch = (sys.argv[2:5] + ["full", "32", "64"][len(sys.argv[2:5]) :])[:3]
    import cupy

    import flame as fl

    cupy.cuda.runtime.free(0)
    scope = fl.backend("cuda")
    scope.__enter__()
    started = time.perf_counter()
    trainer = bd.flame_trainer(("unet", size, int(image), int(batch)))
    built = time.perf_counter()
    images, labels = bd.flame_batch(int(image), int(batch))
    fl.synchronize()
    events = ca.EventTotals()
    profile = cProfile.Profile()
    with ca.recording(events):
        start = time.perf_counter()
        profile.enable()
        trainer.compiled(images, labels)
        fl.synchronize()
        profile.disable()
        first = time.perf_counter() - start
    start = time.perf_counter()
    trainer.compiled(images, labels)
    fl.synchronize()
    second = time.perf_counter() - start
    profile.dump_stats(out / "first_step.pstats")
    text = io.StringIO()
    summary = {"build_s": built - started, "first_step_s": first, "second_step_s": second,
               "events": events.totals}  # fmt: skip
    text.write(json.dumps(summary, indent=1, default=str) + "\n")
    for key in ("cumulative", "tottime"):
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats(key).print_stats(60)
    (out / "first_step.txt").write_text(text.getvalue())
    print(json.dumps(summary, default=str))


if __name__ == "__main__":
    main()
