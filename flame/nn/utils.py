"""Gradient utilities: clip, add noise to, normalise and inspect the gradients of many tensors.

In FLAME a gradient is a lazy tensor (``p.grad``), so every function here only rebuilds
``p.grad`` from ops; nothing runs and nothing is copied to the host until a value is read.
``clip_grad_norm_`` in particular computes the global norm and the clipping scale as IR that
fuses into the backward: the norm is read back only if the caller reads the returned tensor
(``error_if_nonfinite=True`` reads it, as it must).

    loss.backward()
    norm = flame.nn.utils.clip_grad_norm_(params, max_norm=1.0)   # lazy: no sync here
    flame.realize(*(p.grad for p in params))                      # one schedule
    print(norm.item())                                            # the one host round trip

Gradient hooks are the per-tensor counterpart: ``fn(grad) -> new grad`` runs while the
backward graph is built, so its ops fuse with the backward like any other op::

    x.register_hook(lambda grad: grad * 2.0)               # double x's gradient
    handle = h.register_hook(lambda grad: flame.clamp(grad, -1.0, 1.0))  # clip an activation's
    handle.remove()                                         # gradient; remove the hook again
    w.register_hook(lambda grad: grad / (grad.abs().amax() + 1e-6))  # normalise one tensor

A hook must return a tensor of the gradient's shape and dtype (or None to keep it).
"""

from __future__ import annotations

import hashlib
import math

from flame import reductions
from flame.autograd import GradError
from flame.backend import backend as use_backend
from flame.backend import get_backend
from flame.creation import randn, zeros
from flame.functional import maximum
from flame.ir import dtypes
from flame.tensor import Tensor, clamp

__all__ = [
    "add_grad_noise_", "clip_grad_norm_", "clip_grad_value_", "grad_stats", "normalize_grads_",
    "parameters_to_vector", "vector_to_parameters",
]  # fmt: skip


def _with_grads(parameters) -> list[Tensor]:
    """The tensors of ``parameters`` (one tensor or an iterable of them) that have a grad."""
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    found = []
    for parameter in parameters:
        if not isinstance(parameter, Tensor):
            raise TypeError(f"expected flame.Tensor parameters, got {type(parameter).__name__}")
        if parameter.grad is not None:
            found.append(parameter)
    return found


def _zero(grads) -> Tensor:
    """A float32 0-d zero on the gradients' backend (the current one when there are none)."""
    with use_backend(grads[0].backend if grads else get_backend()):
        return zeros((), dtype=dtypes.float32)


def _norm_of(grad: Tensor, norm_type: float) -> Tensor:
    """One tensor's contribution to a global norm, in float32: ``sum(|g|^p)`` (``max |g|``
    for p = inf), so that the contributions of many tensors combine by addition (max)."""
    magnitude = grad.float().abs()
    if math.isinf(norm_type):
        return reductions.amax(magnitude)
    if norm_type == 2.0:
        return reductions.sum(magnitude * magnitude)
    if norm_type == 1.0:
        return reductions.sum(magnitude)
    return reductions.sum(magnitude**norm_type)


def global_norm(grads, norm_type: float = 2.0) -> Tensor:
    """The ``norm_type``-norm of all ``grads`` taken together, as a float32 0-d lazy tensor."""
    norm_type = float(norm_type)
    if not norm_type > 0:  # inf passes, NaN does not
        raise ValueError(f"norm_type must be positive or inf, got {norm_type}")
    if not grads:
        return _zero(grads)
    total = None
    for grad in grads:
        part = _norm_of(grad, norm_type)
        if total is None:
            total = part
        elif math.isinf(norm_type):
            total = maximum(total, part)
        else:
            total = total + part
    if math.isinf(norm_type) or norm_type == 1.0:
        return total
    return total.sqrt() if norm_type == 2.0 else total ** (1.0 / norm_type)


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False) -> Tensor:
    """Scale the gradients of ``parameters`` together so that their global norm is at most
    ``max_norm`` (``torch.nn.utils.clip_grad_norm_``). Returns the norm before clipping.

    The scale ``min(1, max_norm / (norm + 1e-6))`` is a lazy 0-d tensor multiplied into every
    gradient: no host round trip unless the returned norm is read, or
    ``error_if_nonfinite=True`` asks for a check of its value (that check realizes it)."""
    with_grads = _with_grads(parameters)  # a generator is read once
    grads = [parameter.grad for parameter in with_grads]
    total = global_norm(grads, norm_type)
    if not grads:
        return total
    if error_if_nonfinite and not math.isfinite(total.item()):
        raise GradError(
            f"clip_grad_norm_: the total norm of order {float(norm_type)} of the gradients is "
            f"{total.item()}, not finite (pass error_if_nonfinite=False to clip anyway)"
        )
    scale = clamp(max_norm / (total + 1e-6), max=1.0)
    for parameter in with_grads:
        parameter.grad = parameter.grad * scale.to(parameter.grad.dtype)
    return total


def clip_grad_value_(parameters, clip_value) -> None:
    """Clamp every gradient element into ``[-clip_value, clip_value]``."""
    clip_value = float(clip_value)
    if clip_value < 0:
        raise ValueError(f"clip_grad_value_: clip_value must be non-negative, got {clip_value}")
    for parameter in _with_grads(parameters):
        parameter.grad = clamp(parameter.grad, -clip_value, clip_value)


def _noise_seed(seed: int, position: int) -> int:
    """Independent seeds for the tensors of one call, so that ``seed`` and ``seed + 1`` (the
    next step) never share a stream."""
    digest = hashlib.blake2b(f"{seed}/{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def add_grad_noise_(parameters, std, seed: int) -> None:
    """Add Gaussian noise of standard deviation ``std`` (a number or a 0-d tensor, e.g. an
    annealed schedule) to every gradient. The noise is generated where it is consumed, keyed
    by ``seed`` and the tensor's position: the same seed gives the same noise."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise TypeError(f"add_grad_noise_: seed must be a non-negative int, got {seed!r}")
    for position, parameter in enumerate(_with_grads(parameters)):
        grad = parameter.grad
        with use_backend(grad.backend):
            noise = randn(grad.shape, seed=_noise_seed(seed, position), dtype=grad.dtype)
        scaled = noise * (std.to(grad.dtype) if isinstance(std, Tensor) else float(std))
        parameter.grad = grad + scaled


def normalize_grads_(parameters, eps: float = 1e-6) -> None:
    """Divide every gradient by its own 2-norm (plus ``eps``): unit-norm gradients."""
    for parameter in _with_grads(parameters):
        grad = parameter.grad
        norm = global_norm([grad], 2.0)
        parameter.grad = (grad.float() / (norm + eps)).to(grad.dtype)


def grad_stats(parameters) -> dict[str, Tensor]:
    """Lazy statistics of the gradients of ``parameters``, taken together: ``norm`` (global
    2-norm, float32), ``max_abs`` (float32), ``nan_count`` and ``inf_count`` (int64).
    Realize them in one schedule with ``flame.realize(*stats.values())``."""
    grads = [parameter.grad for parameter in _with_grads(parameters)]
    if not grads:
        zero = _zero(grads)
        return {"norm": zero, "max_abs": zero, "nan_count": zero.long(), "inf_count": zero.long()}
    max_abs = global_norm(grads, math.inf)
    nan_count = None
    inf_count = None
    for grad in grads:
        nans = reductions.sum(grad != grad)
        infs = reductions.sum(grad.abs() == math.inf)
        nan_count = nans if nan_count is None else nan_count + nans
        inf_count = infs if inf_count is None else inf_count + infs
    return {
        "norm": global_norm(grads, 2.0),
        "max_abs": max_abs,
        "nan_count": nan_count,
        "inf_count": inf_count,
    }


# --- parameters as one vector ----------------------------------------------------------------


def _tensor_list(parameters, op: str) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        return [parameters]
    found = list(parameters)
    for parameter in found:
        if not isinstance(parameter, Tensor):
            raise TypeError(
                f"{op}: expected flame.Tensor parameters, got {type(parameter).__name__}"
            )
    backends = {parameter.backend for parameter in found}
    if len(backends) > 1:
        raise TypeError(f"{op}: the parameters are on different backends ({sorted(backends)})")
    return found


def parameters_to_vector(parameters) -> Tensor:
    """All of ``parameters`` flattened and joined into one 1-d tensor, in order
    (``torch.nn.utils.parameters_to_vector``). Lazy, and differentiable: the gradient of a
    function of the vector flows back to the parameters."""
    from flame.joining import cat

    found = _tensor_list(parameters, "parameters_to_vector")
    if not found:
        raise ValueError("parameters_to_vector: no parameters given")
    return cat([parameter.reshape(-1) for parameter in found])


def vector_to_parameters(vec: Tensor, parameters) -> None:
    """Write consecutive slices of the 1-d ``vec`` into ``parameters``, in order
    (``torch.nn.utils.vector_to_parameters``).

    FLAME writes into each parameter's own memory (``copy_`` under no_grad), so optimizers
    and compiled functions that hold the parameters see the new values without a retrace.
    PyTorch instead points each parameter at a slice of ``vec`` (``param.data = ...``); the
    values are the same, but here a later write to ``vec`` does not change the parameters."""
    from flame.autograd import no_grad

    if not isinstance(vec, Tensor):
        raise TypeError(f"vector_to_parameters: expected a flame tensor, got {type(vec).__name__}")
    if vec.ndim != 1:
        raise ValueError(f"vector_to_parameters: vec must be 1-d, got shape {list(vec.shape)}")
    found = _tensor_list(parameters, "vector_to_parameters")
    total = sum(parameter.numel() for parameter in found)
    if vec.shape[0] < total:
        raise ValueError(
            f"vector_to_parameters: the parameters hold {total} values, vec has {vec.shape[0]}"
        )
    pointer = 0
    with no_grad():
        for parameter in found:
            count = parameter.numel()
            piece = vec[pointer : pointer + count].reshape(parameter.shape)
            if piece.backend != parameter.backend:
                piece = piece.to(parameter.device)
            parameter.copy_(piece)
            pointer += count
