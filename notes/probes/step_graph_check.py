"""A compiled training step captured as a CUDA graph (flame/step_graphs.py): the example's
UNet or DiT step, its captures, replays and failures, and wall ms per step.

    python notes/probes/step_graph_check.py [unet|dit] [size image batch]
"""

import sys
import time

from bench import diffusion as bd


def main() -> None:
    import flame as fl

    name = sys.argv[1] if len(sys.argv) > 1 else "unet"
    size, image, batch = (sys.argv[2:5] + ["full", "32", "64"][len(sys.argv[2:5]) :])[:3]
    with fl.backend("cuda"):
        trainer = bd.flame_trainer((name, size, int(image), int(batch)))
        images, labels = bd.flame_batch(int(image), int(batch))
        start = time.perf_counter()
        trainer.compiled(images, labels)
        fl.synchronize()
        print(f"first step {time.perf_counter() - start:.1f} s", flush=True)
        for _ in range(3):
            trainer.compiled(images, labels)
        fl.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            trainer.compiled(images, labels)
        fl.synchronize()
        info = trainer.compiled.cache_info()
        print(
            f"{name}: {(time.perf_counter() - start) / 20 * 1e3:.2f} ms/step wall; "
            f"captures {info.graph_captures} replays {info.graph_replays} traces {info.traces}"
        )
        for failure in info.graph_failures:
            print("FAILURE:", failure[:2000])
        programs = trainer.compiled.programs()
        print("launches per program:", [p.get("launches") for p in programs])


if __name__ == "__main__":
    main()
