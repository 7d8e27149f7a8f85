"""The workloads: each one a declaration, timed by the shared harness according to its kind.

Kinds:
- ``DEVICE``: GPU work timed with CUDA events. Its floor is the bytes that must move over the
  measured copy bandwidth, or, where ``flops`` is given (matrix products), the FLOPs over the
  rate PyTorch eager measured in the same run.
- ``HOST``: tiny tensors, where the host's time per call is the cost; wall time over many calls.
- ``FLAME_ONLY``: FLAME's own costs (graph building, compiling); a runner in ``flame_only``.

Forward + backward workloads (``bench.gradients``) have several outputs (``output_names``; then
``output`` gives one shape per name), their own floor (``floor``: bytes from the input specs),
a float64 oracle with the backward written out (``oracle``), and a peak-memory measurement.

Inputs are standard-normal floats (never zeros) or integers drawn from ``[0, high)``.
bfloat16 inputs are drawn as float32 and cast by each system (CuPy has no bfloat16), so every
system sees the same rounded values.
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from bench import expressions, flame_only, gradients

DEVICE = "device"
HOST = "host"
FLAME_ONLY = "flame_only"

FLOAT32 = "float32"
BFLOAT16 = "bfloat16"
INT64 = "int64"
ITEMSIZE = {FLOAT32: 4, BFLOAT16: 2, "float16": 2, INT64: 8, "int32": 4}
FLOAT32_TOLERANCE = 1e-4  # relative L2 error, FLAME against PyTorch eager (or NumPy float64)
BFLOAT16_TOLERANCE = 1e-2
MI = 1 << 20

NO_FUSE_REDUCTIONS = {"cupy_fuse": "no reductions in cupy.fuse"}
NO_FUSE_MATMUL = {"cupy_fuse": "no matmul in cupy.fuse"}


@dataclass(frozen=True)
class ArraySpec:
    """One input at the size of this run."""

    shape: tuple[int, ...]
    dtype: str = FLOAT32
    high: int | None = None  # integers: values in [0, high)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Input:
    """One input as declared: full and quick shapes, dtype, and for integers the value range
    at each size (``high=(full, quick)``)."""

    full: tuple[int, ...]
    quick: tuple[int, ...]
    dtype: str = FLOAT32
    high: tuple[int, int] | None = None

    def spec(self, quick: bool) -> ArraySpec:
        high = None if self.high is None else self.high[1 if quick else 0]
        return ArraySpec(self.quick if quick else self.full, self.dtype, high)


def floats(*pairs, dtype: str = FLOAT32) -> tuple[Input, ...]:
    """Inputs of one float dtype from (full, quick) shape pairs."""
    return tuple(Input(full, quick, dtype) for full, quick in pairs)


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


def scalar_output(shapes) -> tuple[int, ...]:
    return ()


def without_axis_1(shapes) -> tuple[int, ...]:
    """The first input reduced over axis 1."""
    return tuple(shapes[0][:1]) + tuple(shapes[0][2:])


def matmul_shape(shapes) -> tuple[int, ...]:
    left, right = shapes
    return broadcast_shapes((left[:-2], right[:-2])) + (left[-2], right[-1])


def matmul_flops(shapes) -> int:
    """2·M·N·K per product, times the batch."""
    output = matmul_shape(shapes)
    return 2 * math.prod(output) * shapes[0][-1]


@dataclass(frozen=True)
class Workload:
    name: str
    kind: str
    description: str
    inputs: tuple[Input, ...]
    expression: Callable
    runner: Callable | None = None  # FLAME_ONLY: runner(session, workload) -> dict of results
    output: Callable = broadcast_shapes  # output shape from the input shapes
    flops: Callable | None = None  # compute-bound: FLOPs from the input shapes
    tolerance: float = FLOAT32_TOLERANCE
    skip: Mapping[str, str] = field(default_factory=dict)  # system key -> why it cannot run it
    requires: str | None = None  # a flame attribute; without it the whole row is skipped
    matmul_precision: str | None = None  # float32 products: "highest" means no TF32 anywhere
    output_names: tuple[str, ...] = ()  # several outputs: ``output`` gives a shape for each
    floor: Callable | None = None  # bytes that must move, from the input specs
    oracle: Callable | None = None  # NumPy float64 reference from the inputs, if not expression
    peak_memory: bool = False  # also measure the peak memory of one call

    def input_specs(self, quick: bool) -> tuple[ArraySpec, ...]:
        return tuple(declared.spec(quick) for declared in self.inputs)

    def shapes(self, quick: bool) -> tuple[tuple[int, ...], ...]:
        return tuple(spec.shape for spec in self.input_specs(quick))

    def output_shape(self, quick: bool) -> tuple[int, ...]:
        """The output's shape; with several outputs, the first one's."""
        if self.output_names:
            return self.output_shapes(quick)[0]
        return tuple(self.output(self.shapes(quick)))

    def output_shapes(self, quick: bool) -> tuple[tuple[int, ...], ...]:
        if not self.output_names:
            return (self.output_shape(quick),)
        return tuple(tuple(shape) for shape in self.output(self.shapes(quick)))

    @property
    def output_dtype(self) -> str:
        """The first input's dtype (a loss over int64 targets is still float32)."""
        return self.inputs[0].dtype

    def floor_bytes(self, quick: bool) -> int:
        """Bytes that must move: every input read once and the output written once, unless
        the workload declares its own ``floor``."""
        if self.floor is not None:
            return int(self.floor(self.input_specs(quick)))
        moved = sum(spec.nbytes for spec in self.input_specs(quick))
        return moved + math.prod(self.output_shape(quick)) * ITEMSIZE[self.output_dtype]

    def floor_flops(self, quick: bool) -> int | None:
        return None if self.flops is None else int(self.flops(self.shapes(quick)))


def matmul_workload(name: str, description: str, full, quick, dtype: str) -> Workload:
    """``a @ b``; only where FLAME has ``flame.matmul``. float32 runs without TF32 everywhere."""
    return Workload(
        name=name,
        kind=DEVICE,
        description=description,
        inputs=floats(*zip(full, quick, strict=True), dtype=dtype),
        expression=expressions.matmul,
        output=matmul_shape,
        flops=matmul_flops,
        tolerance=FLOAT32_TOLERANCE if dtype == FLOAT32 else BFLOAT16_TOLERANCE,
        skip=NO_FUSE_MATMUL,
        requires="matmul",
        matmul_precision="highest" if dtype == FLOAT32 else None,
    )


ROWS_FULL, ROWS_QUICK = (16384, 4096), (256, 512)
FEATURES_FULL, FEATURES_QUICK = (4096,), (512,)

WORKLOADS = (
    Workload(
        name="ew_chain",
        kind=DEVICE,
        description="gelu_tanh(x*1.5+y)*sigmoid(y) - 0.5*x*x + tanh(x-y), 64 Mi elements",
        inputs=floats(((64 * MI,), (MI // 4,)), ((64 * MI,), (MI // 4,))),
        expression=expressions.ew_chain,
    ),
    Workload(
        name="bias_gelu",
        kind=DEVICE,
        description="gelu_tanh(x + b), x [8192,8192], b [8192]",
        inputs=floats(((8192, 8192), (512, 512)), ((8192,), (512,))),
        expression=expressions.bias_gelu,
    ),
    Workload(
        name="softmax",
        kind=DEVICE,
        description="softmax(x, -1), x [16384,4096]",
        inputs=floats((ROWS_FULL, ROWS_QUICK)),
        expression=expressions.softmax,
        skip=NO_FUSE_REDUCTIONS,
    ),
    Workload(
        name="layer_norm",
        kind=DEVICE,
        description="layer_norm(x, (4096,), w, b, eps=1e-5), x [16384,4096], w, b [4096]",
        inputs=floats(
            (ROWS_FULL, ROWS_QUICK),
            (FEATURES_FULL, FEATURES_QUICK),
            (FEATURES_FULL, FEATURES_QUICK),
        ),
        expression=expressions.layer_norm,
        skip=NO_FUSE_REDUCTIONS,
    ),
    Workload(
        name="rms_norm_ops",
        kind=DEVICE,
        description="x * rsqrt(mean(x*x, -1, keepdim) + 1e-6) * w written as ops, x [16384,4096]",
        inputs=floats((ROWS_FULL, ROWS_QUICK), (FEATURES_FULL, FEATURES_QUICK)),
        expression=expressions.rms_norm_ops,
        skip=NO_FUSE_REDUCTIONS,
    ),
    Workload(
        name="cross_entropy_fwd",
        kind=DEVICE,
        description="cross_entropy(logits, target), mean; logits [8192,32000], target [8192] int64",
        inputs=(
            Input((8192, 32000), (256, 512)),
            Input((8192,), (256,), INT64, high=(32000, 512)),
        ),
        expression=expressions.cross_entropy,
        output=scalar_output,
        skip=NO_FUSE_REDUCTIONS,
    ),
    Workload(
        name="layer_norm_fwd_bwd",
        kind=DEVICE,
        description="y = layer_norm(x, (4096,), w, b) and the gradients of sum(y * dy) (dy a fixed "
        "random [16384,4096]): y, dx, dw, db; floor 5 passes over x's 268 MB = 1.34 GB "
        "(forward reads x, writes y; backward reads x, dy, writes dx; w, b, dw, db negligible)",
        inputs=floats(
            (ROWS_FULL, ROWS_QUICK),
            (FEATURES_FULL, FEATURES_QUICK),
            (FEATURES_FULL, FEATURES_QUICK),
            (ROWS_FULL, ROWS_QUICK),
        ),
        expression=expressions.layer_norm_fwd_bwd,
        output=gradients.layer_norm_outputs,
        output_names=("y", "dx", "dw", "db"),
        floor=gradients.layer_norm_floor_bytes,
        oracle=gradients.layer_norm_fwd_bwd_oracle,
        peak_memory=True,
        skip=gradients.FORWARD_BACKWARD_SKIP,
    ),
    Workload(
        name="cross_entropy_fwd_bwd",
        kind=DEVICE,
        description="loss = cross_entropy(logits, target) (mean) and dlogits; logits [8192,32000], "
        "target [8192] int64; floor 3 passes over the logits' 1.05 GB = 3.15 GB (read twice, "
        "dlogits written)",
        inputs=(
            Input((8192, 32000), (256, 512)),
            Input((8192,), (256,), INT64, high=(32000, 512)),
        ),
        expression=expressions.cross_entropy_fwd_bwd,
        output=gradients.cross_entropy_outputs,
        output_names=("loss", "dlogits"),
        floor=gradients.cross_entropy_floor_bytes,
        oracle=gradients.cross_entropy_fwd_bwd_oracle,
        peak_memory=True,
        skip=gradients.FORWARD_BACKWARD_SKIP,
    ),
    Workload(
        name="sum_middle",
        kind=DEVICE,
        description="x.sum(1), x [256,4096,256]",
        inputs=floats(((256, 4096, 256), (8, 256, 16))),
        expression=expressions.sum_middle,
        output=without_axis_1,
        skip=NO_FUSE_REDUCTIONS,
    ),
    matmul_workload(
        "matmul_f32",
        "a @ b, 8192³ float32, no TF32 (FLAME precision 'highest', torch allow_tf32=False)",
        full=((8192, 8192), (8192, 8192)),
        quick=((256, 256), (256, 256)),
        dtype=FLOAT32,
    ),
    matmul_workload(
        "matmul_bf16",
        "a @ b, 8192³ bfloat16",
        full=((8192, 8192), (8192, 8192)),
        quick=((256, 256), (256, 256)),
        dtype=BFLOAT16,
    ),
    matmul_workload(
        "bmm_bf16",
        "a @ b, [32,2048,2048] @ [32,2048,2048] bfloat16",
        full=((32, 2048, 2048), (32, 2048, 2048)),
        quick=((4, 128, 128), (4, 128, 128)),
        dtype=BFLOAT16,
    ),
    Workload(
        name="tiny20",
        kind=HOST,
        description="20 elementwise ops on [1024]: host wall time per call",
        inputs=floats(((1024,), (1024,)), ((1024,), (1024,))),
        expression=expressions.tiny20,
    ),
    Workload(
        name="graph_build",
        kind=FLAME_ONLY,
        description="build a lazy graph of 1000 elementwise ops (50 x tiny20), no realize",
        inputs=floats(((1024,), (1024,)), ((1024,), (1024,))),
        expression=expressions.tiny20,
        runner=flame_only.graph_build,
    ),
    Workload(
        name="tiny20_compiled",
        kind=HOST,
        description="the 20 tiny ops through flame.compile (peers compiled as in tiny20): "
        "host wall time per call",
        inputs=floats(((1024,), (1024,)), ((1024,), (1024,))),
        expression=expressions.tiny20_compiled,
        skip={"torch_eager": "no compiled form (its time is in tiny20's row)"},
    ),
    Workload(
        name="compile_time",
        kind=FLAME_ONLY,
        description="ew_chain's first call in a new process: empty, then warm disk cache",
        # Compile time does not depend on the size; 1 Mi elements keeps the run short.
        inputs=floats(((MI,), (MI,)), ((MI,), (MI,))),
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
