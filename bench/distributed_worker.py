"""One rank's part of bench/distributed.py (issue 23's figures). Started by that driver,
alone (one GPU, no process group) or under ``flame run`` (one process per GPU):

    python -m bench.distributed_worker allreduce --out DIR [--sizes-mib 1,16,256]
    python -m bench.distributed_worker step --out DIR [--model unet --size full ...]
    python -m bench.distributed_worker curve --out DIR [--global-batch 128 --steps 200]

Each part writes ``<part>-world<N>-rank<r>.json`` into ``--out``; the driver reads them.

* ``allreduce``: the time of one all-reduce of each size, back to back over ``--iters``
  calls (CUDA events around them): NCCL called directly from CuPy on the group's own
  communicator and FLAME's stream (``nccl``), FLAME's collective as a value
  (``flame.distributed.functional.all_reduce``, what DistributedDataParallel uses) and
  ``dist.all_reduce`` in place (the collective, then a copy into the tensor). On the gloo
  backend only FLAME's in-place call is timed (wall clock).
* ``step``: the example's training step (``examples/diffusion/train.py``'s ``Trainer``:
  bf16 autocast, AdamW, clipping, EMA) at ``--batch`` images per rank, compiled with
  DistributedDataParallel inside when launched; the time of ``--steps`` steps after
  ``--warmup`` (the first compiles).
* ``curve``: the same Trainer with the draws (images, labels, timesteps, noise) given as
  inputs (bench/diffusion_parity.py's step): step s's global batch of ``--global-batch``
  draws comes from NumPy keyed by (seed, s), and rank r trains on its r-th slice, so one
  process and N ranks see the same global batches. Dropout is off. Each rank writes its
  losses (the mean over its slice) and the gradient norm (of the averaged gradients).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import flame as fl
from bench.diffusion_cases import CFG_DROPOUT, CHANNELS, CLASSES, EMA_DECAY, flame_batch
from bench.diffusion_parity import FlameSide, digits, draws, no_dropout
from examples.diffusion import parallel
from examples.diffusion.train import Trainer

LOG_EVERY = 10


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("part", choices=("allreduce", "step", "curve"))
    add("--out", type=Path, required=True)
    add("--reference", action="store_true", help="FLAME's reference backend (gloo when launched)")
    add("--sizes-mib", default="1,4,16,64,256", help="allreduce: buffer sizes in MiB")
    add("--iters", type=int, default=20, help="allreduce: calls timed per size")
    add("--model", choices=("unet", "dit"), default="unet")
    add("--size", default="full", help="the models' size name")
    add("--image", type=int, default=32)
    add("--batch", type=int, default=64, help="step: images per rank")
    add("--steps", type=int, default=30)
    add("--warmup", type=int, default=3, help="step: untimed steps first")
    add("--global-batch", type=int, default=128, help="curve: images per step, all ranks")
    add("--lr", type=float, default=2e-4)
    add("--seed", type=int, default=0)
    add("--no-bf16", action="store_true")
    return parser.parse_args(argv)


def write(options, world, result: dict) -> None:
    name = f"{options.part}-world{world.world_size}-rank{world.rank}.json"
    options.out.mkdir(parents=True, exist_ok=True)
    result.update(part=options.part, rank=world.rank, world_size=world.world_size)
    (options.out / name).write_text(json.dumps(result, indent=1))


# --- allreduce --------------------------------------------------------------------------------


def _event_ms(run, iters: int) -> float:
    import cupy

    stream = cupy.cuda.get_current_stream()
    run()  # once untimed: buffers from the pool, plans made
    stream.synchronize()
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(iters):
        run()
    end.record(stream)
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / iters


def allreduce(options, world) -> dict:
    import flame.distributed as dist

    rows = []
    for mib in (float(text) for text in options.sizes_mib.split(",")):
        count = max(1, int(mib * (1 << 20)) // 4)
        rows.append({"bytes": count * 4, "dtype": "float32", **_time_sizes(options, world, count)})
        dist.barrier()
    return {"rows": rows, "iters": options.iters}


def _time_sizes(options, world, count: int) -> dict:
    import flame.distributed as dist

    tensor = fl.ones(count)
    if world.group_backend != "nccl":
        tensor.realize()
        began = time.perf_counter()
        for _ in range(options.iters):
            dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        tensor.numpy()
        return {"flame_in_place_ms": (time.perf_counter() - began) * 1e3 / options.iters}
    import cupy

    from flame.distributed import _default, functional
    from flame.runtime import library_nccl

    group = _default().group
    communicator = library_nccl.communicator(group.name)
    raw = cupy.ones(count, dtype=cupy.float32)
    stream = cupy.cuda.get_current_stream()
    dtype, op = library_nccl.NCCL_DTYPE["float32"], library_nccl.NCCL_OP["avg"]

    def nccl():
        communicator.allReduce(raw.data.ptr, raw.data.ptr, count, dtype, op, stream.ptr)

    tensor = fl.ones(count).realize()
    held = []

    def flame_value():
        held[:] = [functional.all_reduce(tensor, "avg").realize()]

    def flame_in_place():
        dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        tensor.realize()

    found = {}
    for name, run in (("nccl_ms", nccl), ("flame_ms", flame_value),
                      ("flame_in_place_ms", flame_in_place)):  # fmt: skip
        dist.barrier()
        found[name] = _event_ms(run, options.iters)
    return found


# --- the training step ------------------------------------------------------------------------


def trainer(options, world, lr: float | None = None) -> Trainer:
    """The example's Trainer (as bench/diffusion.py's ``flame_trainer``) for this rank."""
    settings = SimpleNamespace(seed=options.seed, checkpoint_blocks=False, lr=lr or options.lr,
                               weight_decay=0.0, warmup=max(1, options.steps // 10),
                               bf16=not options.no_bf16, prediction="eps",
                               cfg_dropout=CFG_DROPOUT, grad_clip=1.0, ema=EMA_DECAY)  # fmt: skip
    config = {"model": options.model, "size": options.size, "image_size": options.image,
              "channels": CHANNELS, "num_classes": CLASSES, "schedule": "linear",
              "prediction": "eps"}  # fmt: skip
    made = Trainer(settings, config, None, world)
    made.prepare()
    return made


def step(options, world) -> dict:
    made = trainer(options, world)
    images, labels = flame_batch(options.image, options.batch)
    began = time.perf_counter()
    for _ in range(options.warmup):
        loss, _ = made.run_step(images, labels)
        parallel.settle(world, "a warm-up step")
        loss.item()
    first_s = time.perf_counter() - began
    fl.synchronize()
    began = time.perf_counter()
    for _ in range(options.steps):
        loss, _ = made.run_step(images, labels)
    parallel.settle(world, "the timed steps")
    final = loss.item()
    elapsed = time.perf_counter() - began
    ms = elapsed * 1e3 / options.steps
    return {"batch_per_rank": options.batch, "steps": options.steps, "ms_per_step": ms,
            "images_per_s": world.world_size * options.batch / (ms / 1e3),
            "warmup_s": first_s, "final_loss": final}  # fmt: skip


# --- the loss curve ---------------------------------------------------------------------------


class RankSide(FlameSide):
    """bench/diffusion_parity.py's FLAME side for one rank: its step's forward goes through
    the Trainer's DistributedDataParallel wrapper when launched."""

    def __init__(self, made: Trainer, bf16: bool, compiles: bool):
        self.fl, self.trainer = fl, made
        self.setup = SimpleNamespace(bf16=bf16)
        no_dropout(made.model)
        no_dropout(made.ema.module)
        self.compiled = fl.compile(self.train_step) if compiles else self.train_step


def curve(options, world) -> dict:
    if options.global_batch % world.world_size:
        raise SystemExit(f"--global-batch {options.global_batch} is not a multiple of the "
                         f"world size {world.world_size}")  # fmt: skip
    share = options.global_batch // world.world_size
    side = RankSide(trainer(options, world), not options.no_bf16, world.compiles)
    data, _ = digits(options.image)
    losses, norms, pending = [], [], []
    began = time.perf_counter()
    for index in range(options.steps):
        arrays = draws(data, index, options.global_batch, options.seed)
        mine = [array[world.rank * share : (world.rank + 1) * share] for array in arrays]
        pending.append(side.step(mine))
        if len(pending) == LOG_EVERY or index == options.steps - 1:
            parallel.settle(world, "the logged losses")
            losses += side.read([loss for loss, _ in pending])
            norms += side.read([norm for _, norm in pending])
            pending = []
    elapsed = time.perf_counter() - began
    return {"losses": losses, "grad_norms": norms, "share": share,
            "global_batch": options.global_batch, "train_s": elapsed}  # fmt: skip


def main(argv=None) -> int:
    options = parse(argv)
    backend, world = parallel.start(options.reference, timeout_s=300.0)
    with fl.backend(backend), parallel.failing_together(world):
        result = {"allreduce": allreduce, "step": step, "curve": curve}[options.part](
            options, world
        )
        write(options, world, result)
        parallel.barrier(world)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
