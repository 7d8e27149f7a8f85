"""Forward + backward workloads: how each system differentiates, the float64 oracles, the floors.

An expression that differentiates calls ``ops.vjp_outputs(forward, primals, constants, seed)``:
the output of ``forward(ops, *primals, *constants)`` and the vector-Jacobian product of that
output with ``seed`` (``None`` for a one-element output: the gradient of the output itself),
one gradient per primal. Each system spells it the way its user would:

- FLAME: ``fl.value_and_grad(objective, argnums=(0, 1, ...))`` where ``objective`` returns
  ``sum(out * seed)`` (or ``out``) and keeps ``out``; the caller realizes the output and the
  gradients together with ``fl.realize(out, *grads)``, one schedule. The loss itself is not
  realized: nothing reads it, as in PyTorch's ``autograd.grad(out, primals, seed)``.
- PyTorch eager: leaves ``p.detach().requires_grad_()``, ``out = forward(...)``,
  ``torch.autograd.grad(out, leaves, seed)``.
- torch.compile: the same, with ``forward`` compiled by ``torch.compile``; AOTAutograd compiles
  the matching backward graph, which ``autograd.grad`` runs (the usual torch.compile training
  path; ``autograd.grad`` inside a compiled function is a graph break).

The NumPy oracle has no autograd: it is the textbook backward formulas in float64.
"""

import numpy

from bench.expressions import LAYER_NORM_EPS

FORWARD_BACKWARD_SKIP = {"cupy_fuse": "no autograd in cupy.fuse"}


def flame_vjp_outputs(flame, ops):
    def vjp_outputs(forward, primals, constants, seed):
        kept = {}

        def objective(*leaves):
            out = forward(ops, *leaves, *constants)
            kept["out"] = out
            return out if seed is None else (out * seed).sum()

        argnums = tuple(range(len(primals)))
        _, grads = flame.value_and_grad(objective, argnums=argnums)(*primals)
        return kept["out"], tuple(grads)

    return vjp_outputs


def torch_vjp_outputs(torch, ops, compiler=None):
    """``compiler``: ``torch.compile`` for the torch.compile peer; each forward compiles once."""
    compiled = {}

    def vjp_outputs(forward, primals, constants, seed):
        if compiler is None:
            function = lambda *tensors: forward(ops, *tensors)  # noqa: E731
        else:
            function = compiled.get(forward)
            if function is None:
                function = compiled[forward] = compiler(_bound(forward, ops))
        leaves = [primal.detach().requires_grad_() for primal in primals]
        out = function(*leaves, *constants)
        grads = torch.autograd.grad(out, leaves, seed)
        return out.detach(), tuple(grads)

    return vjp_outputs


def _bound(forward, ops):
    def call(*tensors):
        return forward(ops, *tensors)

    call.__name__ = call.__qualname__ = forward.__name__
    return call


# --- float64 oracles: the backward written out ---------------------------------------------------


def layer_norm_fwd_bwd_oracle(x, weight, bias, dy):
    """y and the gradients of sum(y * dy) with respect to x, weight and bias."""
    mean = x.mean(-1, keepdims=True)
    centered = x - mean
    rstd = 1.0 / numpy.sqrt((centered * centered).mean(-1, keepdims=True) + LAYER_NORM_EPS)
    normalized = centered * rstd
    y = normalized * weight + bias
    g = dy * weight
    dx = rstd * (
        g - g.mean(-1, keepdims=True) - normalized * (g * normalized).mean(-1, keepdims=True)
    )
    rows = tuple(range(x.ndim - 1))
    return y, dx, (dy * normalized).sum(rows), dy.sum(rows)


def cross_entropy_fwd_bwd_oracle(logits, target):
    """Mean cross-entropy over the rows and its gradient with respect to the logits."""
    shifted = logits - logits.max(1, keepdims=True)
    exponent = numpy.exp(shifted)
    total = exponent.sum(1, keepdims=True)
    rows = numpy.arange(logits.shape[0])
    loss = (numpy.log(total[:, 0]) - shifted[rows, target]).mean()
    dlogits = exponent / total
    dlogits[rows, target] -= 1.0
    return numpy.asarray(loss), dlogits / logits.shape[0]


# --- shapes and floors ---------------------------------------------------------------------------


def layer_norm_outputs(shapes):
    """y and dx like x; dw and db like the weight."""
    x, weight = shapes[0], shapes[1]
    return (tuple(x), tuple(x), tuple(weight), tuple(weight))


def cross_entropy_outputs(shapes):
    """The loss (a scalar) and dlogits like the logits."""
    return ((), tuple(shapes[0]))


def layer_norm_floor_bytes(specs) -> int:
    """Forward reads x and writes y; backward reads x and dy and writes dx: 5 passes over x's
    size. Plus w and b read and dw, db written (4 feature vectors, negligible)."""
    x, weight = specs[0], specs[1]
    return 5 * x.nbytes + 4 * weight.nbytes


def cross_entropy_floor_bytes(specs) -> int:
    """Logits read twice (the row maxima and sums first, then the gradient) and dlogits written:
    3 passes over the logits. Plus the targets read and the loss written."""
    logits, target = specs
    return 3 * logits.nbytes + target.nbytes + 4
