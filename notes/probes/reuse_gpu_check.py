"""Plan reuse across sizes on the GPU: bench.diffusion's FLAME trainer called at a first
shape, then at others, in one process; prints per call the loss, host seconds and the
executor's fusion counters (reused / fused / refused). Run with FLAME_PLAN_REUSE=1 and =0
(same seed, fresh FLAME_CACHE_DIR each): the losses must agree.

    FLAME_CACHE_DIR=$(mktemp -d) FLAME_PLAN_REUSE=1 python3 notes/probes/reuse_gpu_check.py \
        [unet|dit] [32x32:64,64x64:64,48x48:16]
"""

import json
import sys
import time

import flame as fl
from bench.diffusion_cases import flame_batch, flame_trainer
from flame.runtime.executor import default_executor


def main(model: str = "unet", shapes: str = "32x32:64,64x64:64,48x48:16") -> None:
    import cupy

    cupy.cuda.runtime.free(0)
    with fl.backend("cuda"):
        fl.manual_seed(0)
        trainer = flame_trainer((model, "full", 32, 64))
        for text in shapes.split(","):
            side, batch = text.split(":")
            size = int(side.split("x")[0])
            fl.manual_seed(1)
            inputs = flame_batch(size, int(batch))
            fl.synchronize()
            started = time.perf_counter()
            loss, _ = trainer.compiled(*inputs)  # (loss, gradient norm)
            value = float(loss.item())
            seconds = time.perf_counter() - started
            decisions = default_executor().decisions
            print(json.dumps({"shape": text, "loss": value, "seconds": round(seconds, 2),
                              "reused": decisions.reused, "fused": decisions.fused,
                              "refused": decisions.refused}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main(*sys.argv[1:])
