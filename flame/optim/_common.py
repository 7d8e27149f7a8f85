"""What the optimizers share: their state buffers and the per-step scalar buffer."""

from __future__ import annotations

import functools

import numpy as np

from flame.ir.dtypes import float32
from flame.runtime.staging import StagedUploads
from flame.tensor import Tensor


def zeros_state(param: Tensor) -> Tensor:
    """A realized buffer of zeros shaped and typed like ``param``, on its backend."""
    from flame.backend import backend, get_backend
    from flame.creation import zeros

    if get_backend() == param.backend:  # the usual case: no context to enter
        return zeros(param.shape, dtype=param.dtype).realize()
    with backend(param.backend):
        return zeros(param.shape, dtype=param.dtype).realize()


def scalars(values, like: Tensor, uploads: StagedUploads | None = None) -> Tensor:
    """The per-step values (computed on the host in float64) as a float32 tensor the update
    kernel reads: data, so a new learning rate is never new code. On the GPU, through
    ``uploads`` (the optimizer's own) when given: copied without waiting for the GPU."""
    from flame.backend import backend
    from flame.creation import tensor

    host = np.asarray(values, dtype=np.float32)
    if uploads is not None and like.backend == "cuda":
        array = uploads.put(host)
        if array is not None:
            from flame.replay import wrap
            from flame.runtime.storage import Storage

            return wrap(Storage("cuda", float32, array=array), float32, host.shape, None)
    with backend(like.backend):
        return tensor(host)


def in_float32(*tensors: Tensor) -> list[Tensor]:
    """The update rules' operands in float32: the arithmetic of a step runs in float32 and
    its results are rounded once, when they are written back to parameters and state of a
    narrower type (the per-step values are zero-dimensional, so they do not widen a
    float16/bfloat16 parameter by promotion, as in PyTorch)."""
    from flame.ir import dtypes

    return [t if t.dtype is dtypes.float32 else t.to(dtypes.float32) for t in tensors]


def guarded(optimizer, rule, h: Tensor, into: tuple):
    """``(rule, h)`` for ``foreach``: as given, or, while a GradScaler's found-inf flag is
    set on ``optimizer`` (``Optimizer._skip_if``), the flag appended to ``h`` and the rule
    wrapped to keep every old value (parameter and state) where the flag is 1: a skipped
    step changes nothing, decided on the device, in the same kernel."""
    flag = optimizer._skip_if
    if flag is None:
        return rule, h
    from flame.joining import cat
    from flame.views import reshape

    return _keeping(rule, tuple(into)), cat([h, reshape(flag.to(h.dtype), (1,))])


@functools.cache
def _keeping(rule, into: tuple):
    """``rule`` whose results are the old values where the last of its per-step values is
    nonzero (one function per rule, so ``foreach`` traces it once)."""
    from flame.functional import where

    def keeping(*args):
        *tensors, h = args
        results = rule(*tensors, h)
        results = (results,) if isinstance(results, Tensor) else tuple(results)
        skip = h[h.shape[0] - 1] != 0.0
        return tuple(where(skip, tensors[i], result) for i, result in zip(into, results))

    keeping.__name__ = keeping.__qualname__ = f"{rule.__name__}_skippable"
    return keeping


def grad_of(param: Tensor) -> Tensor:
    grad = param.grad
    if grad.node.shape == param.node.shape and grad.node.dtype is param.node.dtype:
        return grad
    if grad.shape != param.shape:
        raise ValueError(
            f"optimizer: a gradient of shape {list(grad.shape)} for a parameter of shape "
            f"{list(param.shape)}"
        )
    if grad.dtype != param.dtype:
        grad = grad.to(param.dtype)
    return grad


# --- inside flame.compile ---------------------------------------------------------------------


def tracing() -> bool:
    """Whether a ``flame.compile``d function is being traced in this context."""
    from flame.compile import current_trace

    return current_trace() is not None


def apply_rule(rule, *lists, scalars: Tensor | None = None, into=()) -> None:
    """``flame.foreach(rule, *lists, scalars=, into=)``, which runs at once, or, while a
    compiled function is traced, the same rule applied to each index and its results written
    with ``copy_``: in-place writes the program repeats at every call (flame/inplace.py), each
    fused by the compiler with the work that computes its operands."""
    if not tracing():
        import importlib

        # the module (``flame.foreach`` the attribute is the function), looked up at the
        # call: tests count its calls
        module = importlib.import_module("flame.foreach")
        module.foreach(rule, *lists, scalars=scalars, into=into)
        return
    from flame.autograd import no_grad

    extra = () if scalars is None else (_Slices(scalars),)
    with no_grad():
        for index in range(len(lists[0])):
            results = rule(*[column[index] for column in lists], *extra)
            results = (results,) if isinstance(results, Tensor) else tuple(results)
            for result, position in zip(results, into):
                lists[position][index].copy_(result)


class _Slices:
    """A rule's per-step vector ``h`` while a step is traced: ``h[i]`` is sliced once and
    shared by every parameter the rule is applied to (an AdamW over 305 parameters sliced
    ``h`` 2,745 times, ~0.1 s of the first step's trace; the graph is the same after CSE)."""

    __slots__ = ("vector", "shape", "_made")

    def __init__(self, vector: Tensor):
        self.vector, self.shape, self._made = vector, vector.shape, {}

    def __getitem__(self, index: int) -> Tensor:
        made = self._made.get(index)
        if made is None:
            made = self._made[index] = self.vector[index]
        return made


def new_scalar(value: float, like: Tensor, dtype=float32) -> Tensor:
    """A realized 0-d tensor of its own memory on ``like``'s backend (made from a 0-d array:
    a computed 0-d value is kept as a one-element array on the reference backend, which an
    in-place write refuses). Made while tracing, it is memory the program reads and writes."""
    from flame.backend import backend
    from flame.creation import tensor

    with backend(like.backend):
        return tensor(np.array(value, dtype=dtype.numpy)).realize()


def write_values(target: Tensor, values, uploads: StagedUploads | None = None) -> None:
    """Host ``values`` written into ``target``'s memory (in place, so compiled programs that
    read it see them): through ``uploads`` on the GPU (no wait), as plain data while tracing."""
    from flame.autograd import no_grad

    host = np.asarray(values, dtype=np.float64).reshape(target.shape)
    if tracing() or target.dtype is not float32:
        from flame.backend import backend
        from flame.creation import tensor

        with backend(target.backend):
            source = tensor(host.astype(target.dtype.numpy))
    else:
        source = scalars(host.reshape(-1), target, uploads).reshape(target.shape)
    with no_grad():
        target.copy_(source)


def lr_tensor(group: dict, like: Tensor) -> Tensor | None:
    """A group's learning rate as a 0-d float32 tensor when it is a tensor (PyTorch allows
    ``lr=torch.tensor(...)``: read on the device at every step), else None."""
    lr = group["lr"]
    if not isinstance(lr, Tensor):
        return None
    if lr.backend != like.backend:
        raise ValueError(
            f"optimizer: the learning rate tensor is on the {lr.backend} backend, the "
            f"parameters on {like.backend}"
        )
    return lr.reshape(()).to(float32)
