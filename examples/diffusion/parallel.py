"""Data-parallel training for the diffusion example: what ``train.py`` does differently when
it is started by a launcher (``flame run --nproc-per-node N -m examples.diffusion.train``, or
``torchrun``).

A rank knows it was launched as PyTorch scripts do: RANK and WORLD_SIZE are in its
environment. Then, before anything starts CUDA, it keeps only its GPU (LOCAL_RANK) and joins
the default process group: ``nccl`` on the GPU, ``gloo`` on the reference backend (no GPU, or
``--reference``). Each rank then

* builds the model from the same seed and wraps it in ``DistributedDataParallel`` (rank 0's
  weights broadcast at wrap time, gradients averaged in the backward);
* draws its share of every epoch through a ``DistributedSampler`` (data.py): ``--batch-size``
  is per rank, as in PyTorch scripts, so the global batch is ``batch_size * world_size``;
* draws timesteps, noise, label dropout and the model's dropout from its own streams (the
  seeds of one process + rank);
* logs the loss averaged over the ranks (one all-reduce every ``LOG_EVERY`` steps and at
  each checkpoint; on nccl the host waits for it with the group's timeout, so a rank that
  stopped is a ``DistributedTimeout``, not a hang).

Rank 0 alone writes checkpoints (of the unwrapped model: no ``module.`` prefix, so they load
in any number of processes), ``loss.png``, the samples and ``quality.json``; the others wait
for it at a barrier at the end. A rank that raises aborts the group with its message, so the
others fail at their next collective instead of waiting (and ``flame run`` stops them).

``gloo``'s collectives read the tensors' values, which a function being traced by
``fl.compile`` does not have, so ``DistributedDataParallel`` refuses to be traced on it:
on the gloo backend the training step runs lazily, one graph per step, instead of compiled.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass

import numpy as np

import flame as fl

_INT64_SPAN = 1 << 64


@dataclass(frozen=True)
class World:
    """This process's place in the job: a world of one when it was not launched."""

    rank: int = 0
    world_size: int = 1
    group_backend: str | None = None  # "nccl", "gloo", or None: no process group

    @property
    def distributed(self) -> bool:
        return self.group_backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def compiles(self) -> bool:
        """Whether the training step can be one ``fl.compile``d program (see above)."""
        return self.group_backend != "gloo"


ONE_PROCESS = World()


def launched(environment=None) -> bool:
    """Started by ``flame run`` or ``torchrun`` (the check PyTorch training scripts make)."""
    environment = os.environ if environment is None else environment
    return "RANK" in environment and "WORLD_SIZE" in environment


def start(reference: bool, timeout_s: float = 1800.0) -> tuple[str, World]:
    """Choose FLAME's backend (the GPU where there is one) and, when launched, join the
    process group. Returns ``(backend, world)``."""
    from flame.runtime.device import gpu_available, gpu_unavailable_reason

    is_launched = launched()
    if is_launched and not reference:
        from flame.distributed.nccl import select_local_device

        select_local_device()  # before CUDA starts: this rank sees its GPU only
    backend = "reference" if reference else "cuda"
    if not reference and not gpu_available():
        if os.environ.get("RANK", "0") == "0":
            print(f"no GPU ({gpu_unavailable_reason()}): running on the reference backend")
        backend = "reference"
    if not is_launched:
        return backend, World()
    import flame.distributed as dist

    group_backend = "nccl" if backend == "cuda" else "gloo"
    dist.init_process_group(group_backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = World(dist.get_rank(), dist.get_world_size(), group_backend)
    if world.is_main:
        lazily = "" if world.compiles else " (the step runs lazily: gloo cannot be traced)"
        ranks = f"{world.world_size} rank" + ("s" if world.world_size > 1 else "")
        print(f"data-parallel: {ranks} on {group_backend}{lazily}")
    return backend, world


@contextlib.contextmanager
def failing_together(world: World):
    """Run the rank's work; an error aborts the group with it (the other ranks fail at their
    next collective with this rank's message), and the group is left at the end."""
    if not world.distributed:
        yield
        return
    import flame.distributed as dist

    try:
        with dist.abort_on_error():
            yield
    finally:
        dist.destroy_process_group()


def wrap(model, world: World):
    """The module the step calls: ``DistributedDataParallel(model)`` when distributed."""
    if not world.distributed:
        return model
    from flame.nn.parallel import DistributedDataParallel

    # the models' buffers are constants computed when they are built, alike on every rank:
    # broadcasting them before every forward would be a collective per step for nothing
    return DistributedDataParallel(model, broadcast_buffers=False)


def mean_over_ranks(values: fl.Tensor, world: World) -> fl.Tensor:
    """``values`` averaged over the ranks (in place, as ``dist.all_reduce``), ready to read."""
    if world.distributed:
        import flame.distributed as dist

        dist.all_reduce(values, op=dist.ReduceOp.AVG)
        settle(world, "the all_reduce of the losses")
    return values


def settle(world: World, what: str) -> None:
    """Before the host reads what collectives feed: on nccl, wait for them with the group's
    timeout (a peer that stopped is a ``DistributedTimeout`` naming ``what``, not a hang)."""
    if world.group_backend == "nccl":
        from flame.distributed.nccl import wait

        wait(what)


def barrier(world: World) -> None:
    if world.distributed:
        import flame.distributed as dist

        dist.barrier()


class Throughput:
    """The first step's time (tracing and compiling included) and the images per second of
    the steps after it, checkpoint writing left out, over the whole job (every rank's
    batch: a rank steps at the pace of the slowest, the all-reduce waits for it)."""

    def __init__(self, batch_size: int, world: World = ONE_PROCESS):
        self.batch_size, self.world = batch_size * world.world_size, world
        self.first_step_s, self.began = None, None
        self.steps, self.paused_s = 0, 0.0

    def stepped(self, clock: float, loss: fl.Tensor) -> None:
        if self.first_step_s is None:
            settle(self.world, "the first step")
            loss.item()  # waits for the step
            self.first_step_s = time.perf_counter() - clock
            self.began = time.perf_counter()
        else:
            self.steps += 1

    def images_per_s(self) -> float | None:
        if not self.steps:
            return None
        elapsed = time.perf_counter() - self.began - self.paused_s
        return self.steps * self.batch_size / elapsed


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s stream, given rank 0's (int64, wrapping)."""
    return (int(seed) + rank + (1 << 63)) % _INT64_SPAN - (1 << 63)


def own_streams(world: World, *generators: fl.Generator) -> None:
    """Give rank r > 0 its own stream of each generator: rank 0's seed + r at the same offset
    (rank 0's state is that of one process). Called once the model is built (its weights
    are drawn alike on every rank) and again after a checkpoint (of rank 0's states) loads:
    every rank draws as many numbers per step, so the same world size continues every
    stream exactly, and another gives each rank its stream where it would have been."""
    if world.rank == 0:
        return
    for generator in generators:
        seed, offset = (int(value) for value in generator.get_state().numpy())
        generator.set_state(np.array([rank_seed(seed, world.rank), offset], dtype=np.int64))
