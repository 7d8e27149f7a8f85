"""Gradient checking for the autograd tests.

A check builds ``build(*inputs)`` on the reference backend from float32 (and integer) arrays,
projects its output on a random ``projection`` (the scalar ``sum(out * projection)``) and
compares the autograd cotangents, evaluated in float64 by the reference interpreter, with
float64 central differences of that scalar, one input element at a time. Both sides run the
same graph from the same float32 data in float64, so they agree to ~1e-9 where the function
is smooth; sample away from kinks (``abs`` at 0, ties of ``max``, ...).

``torch_vjp`` computes the same cotangents with PyTorch autograd, the independent reference
for float32 results.
"""

from __future__ import annotations

import numpy as np

import flame as fl
from flame.runtime import reference

STEP = 1e-6  # central differences in float64: truncation ~STEP^2, rounding ~1e-16/STEP
RTOL, ATOL = 1e-6, 1e-7


def float64_values(tensors) -> list[np.ndarray]:
    """Values of ``tensors`` computed in float64 from their data leaves (nothing cached)."""
    return reference.evaluate([t.node for t in tensors], precision=np.float64, realized=False)


def numeric_gradient(loss: fl.Tensor, leaf: fl.Tensor) -> np.ndarray:
    """d loss / d leaf by float64 central differences on the reference interpreter."""
    base = np.asarray(leaf.numpy(), dtype=np.float64)
    gradient = np.zeros_like(base)
    for index in np.ndindex(base.shape):
        values = []
        for step in (STEP, -STEP):
            shifted = base.copy()
            shifted[index] += step
            feed = {id(leaf.node): shifted}
            (value,) = reference.evaluate(
                [loss.node], precision=np.float64, inputs=feed, realized=False
            )
            values.append(float(value))
        gradient[index] = (values[0] - values[1]) / (2 * STEP)
    return gradient


def random_projection(rng: np.random.Generator, shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def flame_vjp(build, arrays, positions, rng):
    """``(primals, out, projection, cotangents)``: ``build`` over tensors of ``arrays`` on the
    current backend, differentiated with respect to the inputs at ``positions`` (the others,
    integer indices or bool masks, are held fixed), for a random output cotangent."""
    tensors = [fl.from_numpy(np.ascontiguousarray(array)) for array in arrays]

    def function(*primals):
        values = list(tensors)
        for position, primal in zip(positions, primals, strict=True):
            values[position] = primal
        return build(*values)

    primals = [tensors[position] for position in positions]
    out, pullback = fl.vjp(function, *primals)
    projection = random_projection(rng, out.shape)
    cotangents = pullback(fl.from_numpy(projection))
    return primals, out, projection, cotangents


def check_against_finite_differences(build, arrays, positions, rng, rtol=RTOL, atol=ATOL):
    """Assert that the cotangents of inputs ``positions`` match central differences."""
    with fl.backend("reference"):
        primals, out, projection, cotangents = flame_vjp(build, arrays, positions, rng)
        loss = fl.sum(out * fl.from_numpy(projection))
        analytic = float64_values(cotangents)
        for position, primal, value in zip(positions, primals, analytic, strict=True):
            numeric = numeric_gradient(loss, primal)
            np.testing.assert_allclose(
                value, numeric, rtol=rtol, atol=atol,
                err_msg=f"input {position}: autograd (float64) vs central differences",
            )  # fmt: skip


def torch_vjp(torch_fn, arrays, positions, projection, device="cpu"):
    """``(out, cotangents)`` of ``torch_fn`` by PyTorch autograd, as NumPy arrays."""
    import torch

    inputs = [torch.from_numpy(np.ascontiguousarray(array)).to(device) for array in arrays]
    for position in positions:
        inputs[position].requires_grad_(True)
    out = torch_fn(*inputs)
    seed = torch.from_numpy(projection).to(device)
    grads = torch.autograd.grad(out, [inputs[position] for position in positions], seed)
    return out.detach().cpu().numpy(), [grad.cpu().numpy() for grad in grads]


def check_against_torch(build, torch_fn, arrays, positions, rng, rtol=1e-4, atol=1e-5):
    """Assert that the float32 output and cotangents match PyTorch autograd's."""
    with fl.backend("reference"):
        _, out, projection, cotangents = flame_vjp(build, arrays, positions, rng)
        expected_out, expected = torch_vjp(torch_fn, arrays, positions, projection)
        np.testing.assert_allclose(out.numpy(), expected_out, rtol=rtol, atol=atol, err_msg="value")
        for position, cotangent, grad in zip(positions, cotangents, expected, strict=True):
            actual = cotangent.numpy()
            assert actual.dtype == grad.dtype, (position, actual.dtype, grad.dtype)
            np.testing.assert_allclose(
                actual, grad, rtol=rtol, atol=atol, err_msg=f"cotangent of input {position}"
            )
