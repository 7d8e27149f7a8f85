"""One case of bench/diffusion.py's step and memory sections (quick timing), each system's
result printed as one JSON line as soon as it is measured: for a short device lease.

    python notes/probes/diffusion_step_case.py [model size image batch [systems]]

``systems``: comma-separated keys of ``bench.diffusion.step_systems`` (flame,
flame_checkpoint, torch_eager, torch_compile); all of them by default.
"""

import json
import sys

from bench import conv_attention as ca
from bench import diffusion as bd


def main() -> None:
    model, size, image, batch = (
        sys.argv[1:5] + ["unet", "full", "32", "64"][len(sys.argv[1:5]) :]
    )[:4]
    wanted = sys.argv[5].split(",") if len(sys.argv) > 5 else None
    case = (model, size, int(image), int(batch))
    timing = ca.Timing(2, 4, 3)
    for key, system in bd.step_systems(case, "cuda", True).items():
        if (wanted and key not in wanted) or system.skip is not None:
            continue
        entry = bd.guarded(bd.measure_step, system, key, case, "cuda", timing, True, True)
        print(json.dumps({"case": list(case), "system": key, **entry}, default=str), flush=True)
        ca.release_memory("cuda")


if __name__ == "__main__":
    main()
