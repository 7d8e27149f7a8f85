"""The workloads: each one a declaration, timed by the shared harness according to its kind.

Kinds:
- ``DEVICE``: memory-bound GPU work; timed with CUDA events and compared with the copy floor.
- ``HOST``: tiny tensors, where the host's time per call is the cost; wall time over many calls.
- ``FLAME_ONLY``: FLAME's own costs (graph building, compiling); a runner in ``flame_only``.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

from bench import expressions, flame_only

DEVICE = "device"
HOST = "host"
FLAME_ONLY = "flame_only"

FLOAT32_BYTES = 4
MI = 1 << 20


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    description: str
    full_shapes: tuple[tuple[int, ...], ...]
    quick_shapes: tuple[tuple[int, ...], ...]
    expression: Callable
    runner: Callable | None = None  # FLAME_ONLY: runner(session, workload) -> dict of results

    def shapes(self, quick: bool) -> tuple[tuple[int, ...], ...]:
        return self.quick_shapes if quick else self.full_shapes

    def output_shape(self, quick: bool) -> tuple[int, ...]:
        return broadcast_shapes(self.shapes(quick))

    def floor_bytes(self, quick: bool) -> int:
        """Bytes that must move: every input read once and the output written once (float32)."""
        elements = sum(math.prod(shape) for shape in self.shapes(quick))
        elements += math.prod(self.output_shape(quick))
        return elements * FLOAT32_BYTES


def broadcast_shapes(shapes) -> tuple[int, ...]:
    """NumPy's broadcasting rule, kept here so that ``--help`` imports no NumPy."""
    rank = max(len(shape) for shape in shapes)
    padded = [(1,) * (rank - len(shape)) + tuple(shape) for shape in shapes]
    result = []
    for sizes in zip(*padded, strict=True):
        wide = {size for size in sizes if size != 1}
        if len(wide) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        result.append(wide.pop() if wide else 1)
    return tuple(result)


WORKLOADS = (
    Workload(
        name="ew_chain",
        kind=DEVICE,
        description="gelu_tanh(x*1.5+y)*sigmoid(y) - 0.5*x*x + tanh(x-y), 64 Mi elements",
        full_shapes=((64 * MI,), (64 * MI,)),
        quick_shapes=((MI // 4,), (MI // 4,)),
        expression=expressions.ew_chain,
    ),
    Workload(
        name="bias_gelu",
        kind=DEVICE,
        description="gelu_tanh(x + b), x [8192,8192], b [8192]",
        full_shapes=((8192, 8192), (8192,)),
        quick_shapes=((512, 512), (512,)),
        expression=expressions.bias_gelu,
    ),
    Workload(
        name="tiny20",
        kind=HOST,
        description="20 elementwise ops on [1024]: host wall time per call",
        full_shapes=((1024,), (1024,)),
        quick_shapes=((1024,), (1024,)),
        expression=expressions.tiny20,
    ),
    Workload(
        name="graph_build",
        kind=FLAME_ONLY,
        description="build a lazy graph of 1000 elementwise ops (50 x tiny20), no realize",
        full_shapes=((1024,), (1024,)),
        quick_shapes=((1024,), (1024,)),
        expression=expressions.tiny20,
        runner=flame_only.graph_build,
    ),
    Workload(
        name="compile_time",
        kind=FLAME_ONLY,
        description="ew_chain's first call in a new process: empty, then warm disk cache",
        # Compile time does not depend on the size; 1 Mi elements keeps the run short.
        full_shapes=((MI,), (MI,)),
        quick_shapes=((MI,), (MI,)),
        expression=expressions.ew_chain,
        runner=flame_only.compile_time,
    ),
)

WORKLOAD_NAMES = tuple(workload.name for workload in WORKLOADS)


def find_workload(name: str) -> Workload:
    for workload in WORKLOADS:
        if workload.name == name:
            return workload
    raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOAD_NAMES)}")
