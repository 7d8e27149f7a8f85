"""The systems compared: FLAME and its peers, each behind the same small interface.

A system takes the shared input arrays (``adopt``), turns an expression into a function of the
inputs (``compile``), and says which part of a call is host preparation and which part is the
timed launch (``split``). A peer that cannot run here carries ``skip_reason`` instead.
"""

import contextlib

from bench import expressions
from bench.clocks import CupyClock, HostClock, TorchClock

# What the benchmark calls on FLAME; an import without these is a core that has not landed yet.
FLAME_API = ("tensor", "from_dlpack", "gelu", "sigmoid", "tanh", "exp", "synchronize", "backend")


class System:
    key = ""
    label = ""

    def __init__(self):
        self.skip_reason = None
        self.clock = None
        self.notes = []

    @property
    def available(self) -> bool:
        return self.skip_reason is None

    def scope(self, workload=None):
        """Where the workload runs: a backend, a matmul precision; entered around everything."""
        return contextlib.nullcontext()

    def settings(self, workload) -> dict:
        """Settings in force inside ``scope`` that the report should show (TF32 and the like)."""
        return {}

    def synchronize(self):
        self.clock.synchronize()

    def adopt(self, arrays, specs=None) -> list:
        """The shared arrays as this system's inputs, cast to each spec's dtype where it differs
        (bfloat16 inputs arrive as float32)."""
        return list(arrays)

    def compile(self, expression):
        raise NotImplementedError

    def split(self, expression, call, inputs):
        """(setup, timed): ``timed(setup())`` is one call; only ``timed`` is inside the events."""
        return (lambda: None), (lambda _token: call(*inputs))


class FlameSystem(System):
    key = "flame"
    label = "flame"

    def __init__(self, backend: str):
        super().__init__()
        self.backend = backend
        self.module = None
        try:
            import flame
        except Exception as error:
            self.skip_reason = f"import flame failed: {type(error).__name__}: {error}"
            return
        missing = [name for name in FLAME_API if not hasattr(flame, name)]
        if missing:
            self.skip_reason = f"flame has no {', '.join(missing)} (core not landed yet?)"
            return
        self.module = flame
        if backend == "reference":
            self.clock = HostClock(synchronize=flame.synchronize)
            return
        try:
            self.clock = CupyClock(synchronize=flame.synchronize)
        except Exception as error:
            self.skip_reason = f"import cupy failed: {type(error).__name__}: {error}"

    def scope(self, workload=None):
        # The default backend is FLAME's own choice (the GPU); only the reference is asked for.
        # The matmul precision is FLAME's default ("highest"); settings() records it.
        if self.backend == "reference":
            return self.module.backend("reference")
        return contextlib.nullcontext()

    def settings(self, workload) -> dict:
        if workload.matmul_precision is None:
            return {}
        getter = getattr(self.module, "get_matmul_precision", None)
        return {"matmul_precision": getter() if getter else "unknown (no get_matmul_precision)"}

    def adopt(self, arrays, specs=None) -> list:
        tensors = [self._tensor_from(array) for array in arrays]
        for index, spec in enumerate(specs or ()):
            if tensors[index].dtype.name != spec.dtype:
                tensors[index] = tensors[index].to(getattr(self.module, spec.dtype))
        return [tensor.realize() for tensor in tensors]

    def _tensor_from(self, array):
        if type(array).__module__.startswith("numpy"):
            return self.module.tensor(array)
        try:
            return self.module.from_dlpack(array)
        except Exception as error:
            import cupy

            note = f"from_dlpack failed ({type(error).__name__}: {error}); inputs were copied"
            if note not in self.notes:
                self.notes.append(note)
            return self.module.tensor(cupy.asnumpy(array))

    def realize(self, value):
        """One output, or several (forward + backward) realized together: one schedule."""
        if isinstance(value, tuple):
            self.module.realize(*value)
            return value
        return value.realize()

    def compile(self, expression):
        ops = expressions.flame_ops(self.module)
        if getattr(expression, "compiled_by_flame", False):
            return self.module.compile(expressions.bind(expression, ops))

        def call(*inputs):
            return self.realize(expression(ops, *inputs))

        return call

    def split(self, expression, call, inputs):
        # Device time: build the lazy graph (and its backward) outside the events, time only
        # realize().
        ops = expressions.flame_ops(self.module)
        return (lambda: expression(ops, *inputs)), self.realize


class TorchEagerSystem(System):
    key = "torch_eager"
    label = "torch eager"

    def __init__(self, peer_skip_reason: str | None):
        super().__init__()
        self.skip_reason = peer_skip_reason or self._probe()
        if self.skip_reason is None:
            import torch

            self.torch = torch
            self.clock = TorchClock()

    @staticmethod
    def _probe() -> str | None:
        try:
            import torch
        except Exception as error:
            return f"import torch failed: {type(error).__name__}: {error}"
        if not torch.cuda.is_available():
            return "no GPU (torch.cuda.is_available() is False)"
        return None

    @contextlib.contextmanager
    def scope(self, workload=None):
        """float32 matmuls at precision "highest" run with TF32 off, restored afterwards."""
        precision = getattr(workload, "matmul_precision", None)
        flags = self.torch.backends.cuda.matmul
        saved = flags.allow_tf32
        if precision is not None:
            flags.allow_tf32 = precision != "highest"
        try:
            yield
        finally:
            flags.allow_tf32 = saved

    def settings(self, workload) -> dict:
        if workload.matmul_precision is None:
            return {}
        return {"allow_tf32": self.torch.backends.cuda.matmul.allow_tf32}

    def adopt(self, arrays, specs=None) -> list:
        adopted = []
        for array in arrays:
            if type(array).__module__.startswith("numpy"):
                adopted.append(self.torch.from_numpy(array).to("cuda"))
            else:
                adopted.append(self.torch.from_dlpack(array))  # zero-copy view of the CuPy array
        for index, spec in enumerate(specs or ()):
            adopted[index] = adopted[index].to(getattr(self.torch, spec.dtype))  # no-op if same
        return adopted

    def compile(self, expression):
        return expressions.bind(expression, expressions.torch_ops(self.torch))


class TorchCompileSystem(TorchEagerSystem):
    key = "torch_compile"
    label = "torch.compile"

    def __init__(self, peer_skip_reason: str | None):
        super().__init__(peer_skip_reason)
        if self.available and not hasattr(self.torch, "compile"):
            self.skip_reason = f"torch {self.torch.__version__} has no torch.compile"

    def compile(self, expression):
        if getattr(expression, "differentiates", False):
            # The forward is compiled; AOTAutograd compiles its backward, and autograd.grad
            # runs it (autograd.grad inside a compiled function would be a graph break).
            ops = expressions.torch_ops(self.torch, compiler=self.torch.compile)
            return expressions.bind(expression, ops)
        return self.torch.compile(super().compile(expression))


class CupyFuseSystem(System):
    key = "cupy_fuse"
    label = "cupy.fuse"

    def __init__(self, peer_skip_reason: str | None):
        super().__init__()
        self.skip_reason = peer_skip_reason or self._probe()
        if self.skip_reason is None:
            import cupy

            self.cupy = cupy
            self.clock = CupyClock()

    @staticmethod
    def _probe() -> str | None:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() == 0:
                return "no GPU (CuPy sees 0 devices)"
        except Exception as error:
            return f"no GPU or no CuPy ({type(error).__name__}: {error})"
        return None

    def adopt(self, arrays, specs=None) -> list:
        adopted = [self.cupy.asarray(array) for array in arrays]
        for index, spec in enumerate(specs or ()):
            adopted[index] = adopted[index].astype(spec.dtype, copy=False)
        return adopted

    def compile(self, expression):
        return self.cupy.fuse(expressions.bind(expression, expressions.array_ops(self.cupy)))


def peer_skip_reason(backend: str, gpu: dict | None, gpu_reason: str | None) -> str | None:
    if gpu is None:
        return gpu_reason or "no GPU"
    if backend == "reference":
        return "--backend reference: FLAME runs on the CPU, GPU peers would not be comparable"
    return None


def discover_systems(backend: str, gpu: dict | None, gpu_reason: str | None) -> list[System]:
    """FLAME first, then the peers in the order of the report's columns."""
    reason = peer_skip_reason(backend, gpu, gpu_reason)
    flame = FlameSystem(backend)
    if flame.available and backend != "reference" and gpu is None:
        flame.skip_reason = f"{gpu_reason or 'no GPU'}; use --backend reference on this machine"
    return [flame, TorchEagerSystem(reason), TorchCompileSystem(reason), CupyFuseSystem(reason)]
