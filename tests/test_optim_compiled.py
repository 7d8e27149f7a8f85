"""Optimizers and weight averaging inside ``flame.compile``: ``opt.step()`` and
``ema.update_parameters(model)`` in the compiled step, as PyTorch users write them.

Each optimizer traced once, stepped with a learning rate a schedule changes between calls,
against the same optimizer run lazily and against torch.optim (when importable); state made
before the trace or during it; state_dict round trips and a load into a live compiled step;
a GradScaler-stepped Adam saved and resumed (AveragedModel in the step:
tests/test_averaged_compiled.py). Reference backend (CPU tier); the gpu tier repeats the
compiled steps on the GPU.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import flame as fl
from flame.compile import TraceError
from flame.optim.lr_scheduler import LambdaLR

SHAPES = [(5, 7), (13,), (3, 4, 2)]

VARIANTS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, weight_decay=0.05, maximize=True)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True)),
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))),
    ("Adam", dict(lr=1e-2, amsgrad=True, maximize=True)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
]
IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in options.items())}" for name, options in VARIANTS]


def decaying(epoch: int) -> float:
    """A schedule that changes the rate at every step."""
    return 0.8**epoch


def _loss(params, weights, lib):
    # a different gradient per parameter and per step (so moments and momentum matter)
    total = 0
    for index, (p, w) in enumerate(zip(params, weights)):
        total = total + ((p * p) * w).sum() * (index + 1) + (p * w).sum()
        total = total + (lib.sin(p) * w).sum()
    return total


def _problem(rng):
    init = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
    weights = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
    return init, weights


class Run:
    """One FLAME optimizer over the test problem, stepped lazily or by a compiled step."""

    def __init__(self, name, options, init, weights, compiled: bool, lr_as_tensor=False):
        self.params = [fl.tensor(a).requires_grad_() for a in init]
        self.weights = [fl.tensor(w) for w in weights]
        if lr_as_tensor:
            options = {**options, "lr": fl.tensor(options["lr"])}
        self.optimizer = getattr(fl.optim, name)(self.params, **options)
        self.schedule = LambdaLR(self.optimizer, decaying)
        self.step = fl.compile(self._step) if compiled else self._step

    def _step(self, *weights):
        loss = _loss(self.params, weights, fl)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def steps(self, count: int, schedule: bool = True) -> None:
        for _ in range(count):
            self.step(*self.weights)
            if schedule:
                self.schedule.step()

    def values(self) -> list[np.ndarray]:
        return [p.numpy().copy() for p in self.params]


def _torch_run(torch, name, options, init, weights, steps: int) -> list[np.ndarray]:
    params = [torch.tensor(a, requires_grad=True) for a in init]
    ws = [torch.tensor(w) for w in weights]
    optimizer = getattr(torch.optim, name)(params, **options)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, decaying)
    for _ in range(steps):
        _loss(params, ws, torch).backward()
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()
    return [p.detach().numpy() for p in params]


def _close(got, want, rtol=2e-5, atol=2e-6):
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="PyTorch is the oracle of this test")


# --- every optimizer, traced once ---------------------------------------------------------------


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_compiled_step_matches_lazy_steps_with_a_changing_rate(name, options, rng, backend):
    init, weights = _problem(rng)
    compiled = Run(name, options, init, weights, compiled=True)
    lazy = Run(name, options, init, weights, compiled=False)
    compiled.steps(6)
    lazy.steps(6)
    got = compiled.values()
    for value, start in zip(got, init):
        assert not np.allclose(value, start)  # the compiled step moved every parameter
    rtol = 2e-5 if backend == "reference" else 1e-4
    _close(got, lazy.values(), rtol=rtol, atol=rtol / 10)
    info = compiled.step.cache_info()
    assert (info.traces, info.misses, info.replans) == (1, 1, 0), info.reasons  # no retrace
    for param in compiled.params:
        assert param.grad is None  # zero_grad inside the step


@pytest.mark.parametrize("name,options", VARIANTS, ids=IDS)
def test_compiled_step_matches_torch(name, options, rng, reference_backend, torch):
    init, weights = _problem(rng)
    run = Run(name, options, init, weights, compiled=True)
    run.steps(6)
    _close(run.values(), _torch_run(torch, name, options, init, weights, 6))


@pytest.mark.parametrize("name,options", [VARIANTS[3], VARIANTS[6], VARIANTS[9]], ids=str)
def test_learning_rate_as_a_tensor(name, options, rng, reference_backend, torch):
    """``lr=fl.tensor(...)``: the schedule writes the tensor in place (PyTorch's fill_), the
    compiled step reads it on the device; lazy steps read it there too."""
    init, weights = _problem(rng)
    compiled = Run(name, options, init, weights, compiled=True, lr_as_tensor=True)
    lazy = Run(name, options, init, weights, compiled=False, lr_as_tensor=True)
    rate = compiled.optimizer.param_groups[0]["lr"]
    compiled.steps(5)
    lazy.steps(5)
    assert compiled.optimizer.param_groups[0]["lr"] is rate  # written, not replaced
    np.testing.assert_allclose(rate.item(), options["lr"] * decaying(5), rtol=1e-6)
    assert compiled.schedule.get_last_lr() == pytest.approx([options["lr"] * decaying(5)])
    want = _torch_run(torch, name, options, init, weights, 5)
    _close(compiled.values(), want)
    _close(lazy.values(), want)
    assert compiled.step.cache_info().traces == 1


def test_a_rate_set_by_hand_reaches_the_compiled_step(rng, reference_backend):
    init, weights = _problem(rng)
    runs = [Run("AdamW", dict(lr=0.01), init, weights, compiled) for compiled in (True, False)]
    for run in runs:
        run.steps(2, schedule=False)
        run.optimizer.param_groups[0]["lr"] = 0.03
        run.optimizer.param_groups[0]["betas"] = (0.5, 0.9)
        run.steps(2, schedule=False)
    _close(runs[0].values(), runs[1].values())
    assert runs[0].step.cache_info().traces == 1


def test_a_rate_that_changes_kind_after_compiled_steps_is_refused(rng, reference_backend):
    init, weights = _problem(rng)
    run = Run("Adam", dict(lr=0.01), init, weights, compiled=True)
    run.steps(1)
    group = run.optimizer.param_groups[0]
    with pytest.raises(TypeError, match="changed from a number to a tensor; write"):
        group["lr"] = fl.tensor(0.02)
    assert group["lr"] == pytest.approx(0.01 * decaying(1))  # left as it was
    assert copy.deepcopy(run.optimizer.param_groups)[0]["lr"] == group["lr"]
    assert type(copy.deepcopy(group)) is dict
    plain = {key: value for key, value in group.items() if key != "params"}
    assert pickle.loads(pickle.dumps(type(group)(plain, run.optimizer))) == plain


def test_state_made_by_lazy_steps_before_the_trace(rng, reference_backend):
    """Lazy steps first (host step counts), then compiled ones (the counts move to the
    device), then lazy ones again: the same as an all-lazy run."""
    for name, options in (VARIANTS[4], VARIANTS[7], VARIANTS[3]):
        init, weights = _problem(rng)
        mixed = Run(name, options, init, weights, compiled=False)
        lazy = Run(name, options, init, weights, compiled=False)
        mixed.steps(2)
        mixed.step = fl.compile(mixed._step)
        mixed.steps(3)
        mixed.step = mixed._step  # and lazy steps after compiled ones (device counts)
        mixed.steps(2)
        lazy.steps(7)
        _close(mixed.values(), lazy.values())


def test_parameters_without_a_gradient_are_left_alone(rng, reference_backend):
    init, weights = _problem(rng)
    params = [fl.tensor(a).requires_grad_() for a in init]
    optimizer = fl.optim.Adam(params, lr=0.1)

    @fl.compile
    def step(w):
        (params[0] * w).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step(fl.tensor(weights[0]))
    assert not np.allclose(params[0].numpy(), init[0])
    for param, start in zip(params[1:], init[1:]):
        np.testing.assert_array_equal(param.numpy(), start)
        assert param not in optimizer.state or not optimizer.state[param]
    assert float(optimizer.state[params[0]]["step"].item()) == 3.0


def test_a_schedule_stepped_inside_the_compiled_step_is_refused(rng, reference_backend):
    init, weights = _problem(rng)
    run = Run("SGD", dict(lr=0.1), init, weights, compiled=False)

    @fl.compile
    def step(*weights):
        loss = run._step(*weights)
        run.schedule.step()
        return loss

    with pytest.raises(TraceError, match=r"LambdaLR.step\(\) inside a function being compiled"):
        step(*run.weights)


# --- state_dict and load_state_dict ---------------------------------------------------------------


def _snapshot(run: Run) -> tuple:
    """What a checkpoint keeps: parameter values, the optimizer's and the schedule's state,
    all as host copies."""
    state = run.optimizer.state_dict()
    copied = {
        index: {k: (v.numpy().copy() if isinstance(v, fl.Tensor) else v) for k, v in e.items()}
        for index, entry in state["state"].items()
        for e in [entry]
    }
    groups = [dict(group) for group in state["param_groups"]]
    return run.values(), {"state": copied, "param_groups": groups}, run.schedule.state_dict()


def _restore(run: Run, snapshot) -> None:
    values, state, schedule = snapshot
    with fl.no_grad():
        for param, value in zip(run.params, values):
            param.copy_(fl.tensor(value))
    run.optimizer.load_state_dict(state)
    run.schedule.load_state_dict(dict(schedule))


@pytest.mark.parametrize("name,options", [VARIANTS[3], VARIANTS[7], VARIANTS[9]], ids=str)
def test_load_state_dict_into_a_live_compiled_step(name, options, rng, reference_backend):
    """Build and run the compiled step, save, run on, load the saved state: the same
    compiled program (no retrace) continues from the loaded state as a lazy run would."""
    init, weights = _problem(rng)
    compiled = Run(name, options, init, weights, compiled=True)
    compiled.steps(2)
    saved = _snapshot(compiled)
    moments = dict(compiled.optimizer.state[compiled.params[0]])
    compiled.steps(3)
    _restore(compiled, saved)
    for key, tensor in moments.items():  # written into, not replaced
        assert compiled.optimizer.state[compiled.params[0]][key] is tensor
    compiled.steps(3)

    lazy = Run(name, options, init, weights, compiled=False)
    lazy.steps(2)
    lazy.steps(3)
    _restore(lazy, saved)
    lazy.steps(3)
    _close(compiled.values(), lazy.values())
    assert compiled.step.cache_info().traces == 1


def test_state_dict_round_trip_of_compiled_steps(rng, reference_backend):
    init, weights = _problem(rng)
    name, options = VARIANTS[9]
    compiled = Run(name, options, init, weights, compiled=True)
    compiled.steps(3)
    state = compiled.optimizer.state_dict()
    steps = [entry["step"] for entry in state["state"].values()]
    assert len({id(step) for step in steps}) == len(steps)  # each parameter its own count
    assert [float(step.item()) for step in steps] == [3.0] * len(SHAPES)
    fresh = Run(name, options, init, weights, compiled=True)
    _restore(fresh, (compiled.values(), state, compiled.schedule.state_dict()))
    fresh.steps(2)
    compiled.steps(2)
    _close(fresh.values(), compiled.values(), rtol=1e-6, atol=1e-7)


def test_load_state_dict_checks_its_input(reference_backend):
    param = fl.tensor(np.ones(3, np.float32)).requires_grad_()
    optimizer = fl.optim.Adam([param])
    with pytest.raises(ValueError, match="2 parameter groups given, the optimizer has 1"):
        optimizer.load_state_dict({"state": {}, "param_groups": [{"params": [0]}] * 2})
    with pytest.raises(ValueError, match="a group of 2 parameters given for one of 1"):
        optimizer.load_state_dict({"state": {}, "param_groups": [{"params": [0, 1]}]})
    with pytest.raises(ValueError, match="learning rate tensor must have one floating"):
        fl.optim.SGD([param], lr=fl.tensor([0.1, 0.2]))


# --- GradScaler: one step count shared on the device, saved per parameter -----------------------


def _scaled_steps(params, weights, optimizer, scaler, steps):
    for index in steps:
        loss = _loss(params, weights, fl)
        if index == 1:
            loss = loss * float("inf")  # a skipped step: the counts stay
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def test_grad_scaler_adam_checkpoint_resumes(rng, reference_backend, tmp_path):
    from flame.io import load_checkpoint, save_checkpoint

    init, weights = _problem(rng)
    ws = [fl.tensor(w) for w in weights]

    def make():
        params = [fl.tensor(a).requires_grad_() for a in init]
        return params, fl.optim.Adam(params, lr=0.05), fl.amp.GradScaler("cpu", init_scale=8.0)

    straight, straight_opt, straight_scaler = make()
    _scaled_steps(straight, ws, straight_opt, straight_scaler, range(5))

    first, optimizer, scaler = make()
    _scaled_steps(first, ws, optimizer, scaler, range(3))
    counts = {id(optimizer.state[p]["step"]) for p in first}
    assert len(counts) == 1  # one count on the device for the group
    path = tmp_path / "scaled.safetensors"
    save_checkpoint(path, optimizer=optimizer, extra={"scaler": scaler.state_dict()})
    stored = fl.load_file(path, device="cpu")
    assert all(f"optimizer.state.{i}.step" in stored for i in range(len(SHAPES)))
    assert [float(stored[f"optimizer.state.{i}.step"].numpy()) for i in range(3)] == [2.0] * 3

    second, resumed, resumed_scaler = make()
    loaded = load_checkpoint(path, optimizer=resumed)
    resumed_scaler.load_state_dict(loaded["extra"]["scaler"])
    with fl.no_grad():
        for param, value in zip(second, first):
            param.copy_(value)
    _scaled_steps(second, ws, resumed, resumed_scaler, range(3, 5))
    _close([p.numpy() for p in second], [p.numpy() for p in straight], rtol=1e-6, atol=1e-7)


def test_grad_scaler_counts_split_when_a_parameter_has_no_gradient(rng, reference_backend):
    """Parameters stepped together share one count; one left without a gradient keeps its
    own count (the others' is copied), as the per-parameter counts of an unscaled run."""
    init, weights = _problem(rng)
    results = []
    for scaled in (True, False):
        params = [fl.tensor(a).requires_grad_() for a in init]
        ws = [fl.tensor(w) for w in weights]
        optimizer = fl.optim.Adam(params, lr=0.05)
        scaler = fl.amp.GradScaler("cpu", init_scale=8.0, enabled=scaled)
        for index in range(5):
            chosen = params if index % 2 == 0 else params[:1]
            scaler.scale(_loss(chosen, ws, fl)).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        counts = [float(optimizer.state[p]["step"]) for p in params]
        assert counts == [5.0, 3.0, 3.0]
        results.append([p.numpy() for p in params])
    _close(*results)


# --- the gpu tier: the traced update against the lazy multi-tensor kernels ---------------------


@pytest.mark.gpu
@pytest.mark.parametrize("name,options", [VARIANTS[4], VARIANTS[7], VARIANTS[9]], ids=str)
def test_compiled_step_on_gpu_matches_the_reference_backend(name, options, rng):
    init, weights = _problem(rng)
    results = {}
    for backend in ("cuda", "reference"):
        with fl.backend(backend):
            run = Run(name, options, init, weights, compiled=backend == "cuda")
            run.steps(5)
            results[backend] = run.values()
            if backend == "cuda":
                assert run.step.cache_info().traces == 1
    _close(results["cuda"], results["reference"], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_traced_update_adds_at_most_one_kernel_per_parameter(rng):
    """The update traced into the step fuses per parameter (with the step count and the
    per-step values in a few more launches), not one launch per op."""
    init, weights = _problem(rng)
    with fl.backend("cuda"):
        run = Run("AdamW", dict(lr=0.01, weight_decay=0.1), init, weights, compiled=True)

        def gradients_only(*weights):
            loss = _loss(run.params, weights, fl)
            loss.backward()
            return loss

        alone = fl.compile(gradients_only)
        alone(*run.weights)
        for param in run.params:
            param.grad = None
        run.steps(2)
        assert run.step.cache_info().traces == 1
        with_update = run.step.programs()[0]["launches"]
        assert with_update <= alone.programs()[0]["launches"] + len(SHAPES) + 3
