"""A loss read after the optimizer wrote the weights (``loss.backward(); opt.step();
loss.item()``, the line every training loop prints) is the loss of the step, as in PyTorch:
lazy mode computes the loss with the gradients in ``backward()`` (flame/autograd.py). Before,
the loss stayed lazy and was computed from the updated weights when read."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl


def _loss_after_step(backend: str, optimizer: str, clip: bool):
    with fl.backend(backend):
        fl.manual_seed(3)
        model = fl.nn.Sequential(fl.nn.Linear(6, 5), fl.nn.SiLU(), fl.nn.Linear(5, 1))
        options = {"lr": 0.5} if optimizer == "SGD" else {"lr": 0.1, "weight_decay": 0.01}
        opt = getattr(fl.optim, optimizer)(model.parameters(), **options)
        x = fl.tensor(np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32))
        losses, before = [], []
        for _ in range(3):
            with fl.no_grad():
                before.append(float(((model(x) - 1) ** 2).mean().item()))
            loss = ((model(x) - 1) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            if clip:
                fl.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            losses.append(loss.item())
        return losses, before


@pytest.mark.parametrize("clip", [False, True], ids=["plain", "clipped"])
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_loss_read_after_the_step_is_the_steps_loss(optimizer, clip):
    losses, before = _loss_after_step("reference", optimizer, clip)
    np.testing.assert_allclose(losses, before, rtol=1e-6)
    assert losses[0] != losses[-1]  # the weights did change between the steps


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_gpu_loss_read_after_the_step_is_the_steps_loss(optimizer):
    losses, before = _loss_after_step("cuda", optimizer, True)
    np.testing.assert_allclose(losses, before, rtol=1e-5)
    assert losses[0] != losses[-1]


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_a_lazy_value_of_the_old_weights_read_after_the_step_is_refused(optimizer):
    """Other lazy values built from the weights before ``opt.step()`` (its multi-tensor
    update writes them in place) are refused when read after it, naming both lines, as an
    in-place op's old values are; a value built after the step reads the new weights."""
    with fl.backend("reference"):
        fl.manual_seed(0)
        model = fl.nn.Linear(4, 2)
        opt = getattr(fl.optim, optimizer)(model.parameters(), lr=0.5)
        x = fl.tensor(np.ones((3, 4), np.float32))
        model(x).square().mean().backward()
        before = model(x) * 2  # lazy: built from the weights before the step
        opt.step()
        after = (model(x) * 2).numpy()
        expected = 2 * (np.ones((3, 4)) @ model.weight.numpy().T + model.bias.numpy())
        np.testing.assert_allclose(after, expected, rtol=1e-6)
        with pytest.raises(RuntimeError, match="in-place foreach .* overwrote afterwards"):
            before.numpy()
