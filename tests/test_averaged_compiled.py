"""``AveragedModel.update_parameters(model)`` inside a ``flame.compile``d training step, as
PyTorch users write it: EMA, SWA and an EMA whose decay warms up from ``n_averaged`` (read on
the device), against lazy updates and torch.optim.swa_utils; a state load into the live
step. Reference backend (CPU tier) and, through the ``backend`` fixture, the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="PyTorch is the oracle of this test")


def _close(got, want, rtol, atol):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


class Tiny(fl.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = fl.nn.Linear(4, 6)
        self.second = fl.nn.Linear(6, 2)
        self.register_buffer("offset", fl.tensor(np.zeros(2, np.float32)))

    def forward(self, x):
        return self.second(fl.nn.functional.silu(self.first(x))) + self.offset


def warmed_up_ema(averaged, current, num_averaged):
    """An EMA whose decay warms up as ``(1 + n) / (10 + n)``, reading the count on the device."""
    count = num_averaged.float()
    decay = fl.clamp((1.0 + count) / (10.0 + count), max=0.95)
    return averaged + (current - averaged) * (1.0 - decay)


AVERAGING = {
    "ema": dict(multi_avg_fn=get_ema_multi_avg_fn(0.8)),
    "swa": dict(),
    "warmed-up": dict(avg_fn=warmed_up_ema),
}


def _averaged_run(kind, rng_seed, compiled: bool, steps: int):
    fl.manual_seed(rng_seed)
    model = Tiny()
    ema = AveragedModel(model, **AVERAGING[kind])
    optimizer = fl.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    data = np.random.default_rng(rng_seed)
    x = fl.tensor(data.standard_normal((8, 4)).astype(np.float32))

    def step(x):
        loss = (model(x) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with fl.no_grad():
            model.offset.add_(0.25)  # a buffer the EMA copies
        ema.update_parameters(model)
        return loss

    run = fl.compile(step) if compiled else step
    for _ in range(steps):
        run(x)
    return model, ema, run


@pytest.mark.parametrize("kind", list(AVERAGING))
def test_averaged_model_inside_the_compiled_step(kind, backend):
    model, ema, compiled = _averaged_run(kind, 11, compiled=True, steps=5)
    lazy_model, lazy_ema, _ = _averaged_run(kind, 11, compiled=False, steps=5)
    assert compiled.cache_info().traces == 1
    assert int(ema.n_averaged.item()) == 5 and int(lazy_ema.n_averaged.item()) == 5
    rtol = 1e-5 if backend == "reference" else 1e-4
    for mine, theirs in zip(ema.state_dict().values(), lazy_ema.state_dict().values()):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=rtol, atol=rtol / 10)
    averaged = ema.module.first.weight.numpy()
    assert not np.allclose(averaged, model.first.weight.numpy())  # an average, not a copy
    np.testing.assert_allclose(ema.module.offset.numpy(), 1.25)  # buffers follow the model
    ema.update_parameters(model)  # a lazy update after compiled ones reads the count
    assert int(ema.n_averaged.item()) == 6


def test_averaged_model_inside_the_compiled_step_matches_torch(reference_backend, torch):
    from torch.optim import swa_utils as torch_swa

    model, ema, _ = _averaged_run("ema", 12, compiled=True, steps=4)
    fl.manual_seed(12)
    start = Tiny()
    reference = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.SiLU(), torch.nn.Linear(6, 2))
    with torch.no_grad():
        for target, source in zip(reference.parameters(), start.parameters()):
            target.copy_(torch.tensor(source.numpy()))
    averaged = torch_swa.AveragedModel(reference, multi_avg_fn=torch_swa.get_ema_multi_avg_fn(0.8))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.5)
    x = torch.tensor(np.random.default_rng(12).standard_normal((8, 4)).astype(np.float32))
    for count in range(4):
        loss = ((reference(x) + 0.25 * count) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        averaged.update_parameters(reference)
    want = [p.detach().numpy() for p in averaged.module.parameters()]
    _close([p.numpy() for p in ema.module.parameters()], want, rtol=1e-5, atol=1e-6)


def test_averaged_model_state_loads_into_the_live_step(reference_backend):
    """A checkpoint's n_averaged and averages loaded into the AveragedModel a compiled step
    closes over are what the next compiled call reads."""
    model, ema, compiled = _averaged_run("warmed-up", 13, compiled=True, steps=3)
    saved = {k: v.numpy().copy() for k, v in ema.state_dict().items()}
    x = fl.tensor(np.random.default_rng(13).standard_normal((8, 4)).astype(np.float32))
    compiled(x)
    compiled(x)
    ema.load_state_dict({k: fl.tensor(v) for k, v in saved.items()})
    assert int(ema.n_averaged.item()) == 3
    compiled(x)
    assert int(ema.n_averaged.item()) == 4
    assert compiled.cache_info().traces == 1
