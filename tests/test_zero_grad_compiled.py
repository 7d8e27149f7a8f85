"""``opt.zero_grad()`` inside a compiled training step, as PyTorch scripts write it under
``torch.compile``: the step clears the gradients before its backward, so it never reads the
ones the last call left, and gradients appearing after the first call cause no retrace."""

import numpy as np
import pytest

import flame as fl
import flame.nn as nn
import flame.nn.functional as F


def _run(compiled: bool, zero: str, steps: int = 4):
    fl.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 1))
    opt = fl.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = fl.tensor(np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32))

    def step(x):
        if zero == "optimizer":
            opt.zero_grad()
        else:
            model.zero_grad()
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        if not compiled:  # lazy: computed before the step overwrites the weights it reads
            loss.realize()
        opt.step()
        return loss

    fn = fl.compile(step) if compiled else step
    losses = [float(fn(x).item()) for _ in range(steps)]
    return losses, [p.numpy() for p in model.parameters()], fn


@pytest.mark.parametrize("zero", ["optimizer", "module"])
def test_zero_grad_inside_the_step_traces_once(backend, zero):
    losses, params, fn = _run(True, zero)
    want_losses, want_params, _ = _run(False, zero)
    assert fn.cache_info().traces == 1, fn.cache_info().reasons
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for got, want in zip(params, want_params):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert losses[-1] < losses[0]


def test_a_step_that_accumulates_still_retraces_when_grads_appear(reference_backend):
    """Without zero_grad the program reads the gradient it accumulates into: a first call
    with no .grad and a second with one are two programs."""
    fl.manual_seed(4)
    w = fl.randn(3).requires_grad_()

    @fl.compile
    def accumulate(x):
        (w * x).sum().backward()
        return w.grad

    x = fl.ones(3)
    first = accumulate(x).numpy().copy()
    second = accumulate(x).numpy()
    np.testing.assert_allclose(second, 2 * first)
    assert accumulate.cache_info().traces == 2
