"""One case of bench/diffusion.py's step and memory sections (quick timing), printed as
JSON: for a short device lease.

    python notes/probes/diffusion_step_case.py [model size image batch]
"""

import json
import sys

from bench import conv_attention as ca
from bench import diffusion as bd


def main() -> None:
    model, size, image, batch = (
        sys.argv[1:5] + ["unet", "full", "32", "64"][len(sys.argv[1:5]) :]
    )[:4]
    case = (model, size, int(image), int(batch))
    timing = ca.Timing(2, 4, 3)
    found = bd.training_sections("cuda", [case], timing, True, True)
    print(json.dumps(found, indent=1, default=str))


if __name__ == "__main__":
    main()
