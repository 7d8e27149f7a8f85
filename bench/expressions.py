"""The computations the workloads time, each written once for every system.

An expression takes an ``ops`` namespace first and its input arrays after it; ``+``, ``-``,
``*`` and ``.sum(axis)`` come from the arrays themselves. One definition per workload means
FLAME, PyTorch, ``cupy.fuse`` and the NumPy oracle compute the same function by construction,
and each namespace spells an op the way that library's user would: ``flame.nn.functional``
and ``torch.nn.functional`` for the composites, ``v.mean(dim, keepdim=True)`` and
``.rsqrt()`` / ``torch.rsqrt`` for RMS norm written as ops. The NumPy namespace spells the
composites out; it is the float64 oracle where PyTorch does not run.
"""

import math
from types import SimpleNamespace

GELU_TANH_SCALE = math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715
LAYER_NORM_EPS = 1e-5
RMS_NORM_EPS = 1e-6


def ew_chain(ops, x, y):
    return ops.gelu_tanh(x * 1.5 + y) * ops.sigmoid(y) - 0.5 * x * x + ops.tanh(x - y)


def bias_gelu(ops, x, bias):
    return ops.gelu_tanh(x + bias)


def softmax(ops, x):
    return ops.softmax(x, -1)


def layer_norm(ops, x, weight, bias):
    return ops.layer_norm(x, (x.shape[-1],), weight, bias, eps=LAYER_NORM_EPS)


def rms_norm_ops(ops, x, weight):
    return x * ops.rsqrt(ops.mean_keepdim(x * x, -1) + RMS_NORM_EPS) * weight


def cross_entropy(ops, logits, target):
    return ops.cross_entropy(logits, target)


def differentiates(expression):
    """Marks an expression that computes gradients through ``ops.vjp_outputs`` (see
    ``bench.gradients``); torch.compile then compiles its forward, not the whole expression."""
    expression.differentiates = True
    return expression


@differentiates
def layer_norm_fwd_bwd(ops, x, weight, bias, dy):
    """y = layer_norm(x, w, b) and the gradients of sum(y * dy): (y, dx, dw, db)."""
    y, grads = ops.vjp_outputs(layer_norm, (x, weight, bias), (), dy)
    return (y, *grads)


@differentiates
def cross_entropy_fwd_bwd(ops, logits, target):
    """The mean cross-entropy and its gradient with respect to the logits: (loss, dlogits)."""
    loss, (dlogits,) = ops.vjp_outputs(cross_entropy, (logits,), (target,), None)
    return loss, dlogits


def sum_middle(ops, x):
    return x.sum(1)


def matmul(ops, left, right):
    return ops.matmul(left, right)


TINY20_OPS = 20


def tiny20(ops, x, y):
    """Twenty elementwise ops; each keeps values in a range where the next stays finite."""
    value = x * y
    value = value + x
    value = ops.tanh(value)
    value = value * 0.5
    value = value + y
    value = ops.sigmoid(value)
    value = value - x
    value = ops.exp(value)
    value = value * y
    value = ops.tanh(value)
    value = value + 1.0
    value = value * x
    value = ops.sigmoid(value)
    value = value * value
    value = value - y
    value = ops.tanh(value)
    value = ops.exp(value)
    value = value * 0.25
    value = value + x
    return ops.sigmoid(value)


def tiny20_compiled(ops, x, y):
    """tiny20, for FLAME through ``flame.compile`` (``compiled_by_flame``); the peers run it as
    they run tiny20 (torch.compile and cupy.fuse compile it, PyTorch eager has no such form)."""
    return tiny20(ops, x, y)


tiny20_compiled.compiled_by_flame = True


def mean_keepdim(value, dim):
    """FLAME and PyTorch spell it alike: ``value.mean(dim, keepdim=True)``."""
    return value.mean(dim, keepdim=True)


def flame_ops(flame):
    # Ops past the core's FLAME_API are looked up when called: a FLAME without one fails
    # the workloads that use it, not the whole run.
    from bench import gradients

    ops = SimpleNamespace(
        gelu_tanh=lambda value: flame.gelu(value, approximate="tanh"),
        sigmoid=flame.sigmoid,
        tanh=flame.tanh,
        exp=flame.exp,
        softmax=lambda value, dim: flame.nn.functional.softmax(value, dim),
        layer_norm=lambda *args, **kwargs: flame.nn.functional.layer_norm(*args, **kwargs),
        cross_entropy=lambda logits, target: flame.nn.functional.cross_entropy(logits, target),
        rsqrt=lambda value: value.rsqrt(),
        mean_keepdim=mean_keepdim,
        matmul=lambda left, right: flame.matmul(left, right),
    )
    ops.vjp_outputs = gradients.flame_vjp_outputs(flame, ops)
    return ops


def torch_ops(torch, compiler=None):
    """``compiler``: ``torch.compile`` for the forward of expressions that differentiate."""
    from bench import gradients

    functional = torch.nn.functional
    ops = SimpleNamespace(
        gelu_tanh=lambda value: functional.gelu(value, approximate="tanh"),
        sigmoid=torch.sigmoid,
        tanh=torch.tanh,
        exp=torch.exp,
        softmax=torch.softmax,
        layer_norm=functional.layer_norm,
        cross_entropy=functional.cross_entropy,
        rsqrt=torch.rsqrt,
        mean_keepdim=mean_keepdim,
        matmul=torch.matmul,
    )
    ops.vjp_outputs = gradients.torch_vjp_outputs(torch, ops, compiler)
    return ops


def array_ops(xp):
    """NumPy or CuPy; inside ``cupy.fuse`` the same calls trace into one kernel."""

    def gelu_tanh(value):
        inner = GELU_TANH_SCALE * (value + GELU_TANH_CUBIC * value * value * value)
        return 0.5 * value * (1.0 + xp.tanh(inner))

    def sigmoid(value):
        return 1.0 / (1.0 + xp.exp(-value))

    return SimpleNamespace(
        gelu_tanh=gelu_tanh,
        sigmoid=sigmoid,
        tanh=xp.tanh,
        exp=xp.exp,
        **array_composites(xp),
    )


def array_composites(xp) -> dict:
    """Reductions and composites spelled out for NumPy (the oracle) or CuPy."""

    def softmax(value, dim):
        exponent = xp.exp(value - value.max(dim, keepdims=True))
        return exponent / exponent.sum(dim, keepdims=True)

    def layer_norm(value, normalized_shape, weight, bias, eps):
        axes = tuple(range(-len(normalized_shape), 0))
        centered = value - value.mean(axes, keepdims=True)
        variance = (centered * centered).mean(axes, keepdims=True)
        return centered / xp.sqrt(variance + eps) * weight + bias

    def cross_entropy(logits, target):
        shifted = logits - logits.max(1, keepdims=True)
        normalizer = xp.log(xp.exp(shifted).sum(1))
        picked = xp.take_along_axis(shifted, target[:, None], 1)[:, 0]
        return (normalizer - picked).mean()

    return {
        "softmax": softmax,
        "layer_norm": layer_norm,
        "cross_entropy": cross_entropy,
        "rsqrt": lambda value: 1.0 / xp.sqrt(value),
        "mean_keepdim": lambda value, dim: value.mean(dim, keepdims=True),
        "matmul": xp.matmul,
    }


def bind(expression, ops):
    """A plain function of the inputs alone, named after the expression.

    ``cupy.fuse`` names its kernel after the function and ``torch.compile`` wants a callable of
    the tensors only, so the namespace is closed over rather than passed.
    """

    def call(*inputs):
        return expression(ops, *inputs)

    call.__name__ = expression.__name__
    call.__qualname__ = expression.__name__
    return call
