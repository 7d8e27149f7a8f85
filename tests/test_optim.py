"""Optimizers and ``flame.foreach``: PyTorch's optimizers are the oracle.

CPU tier: every optimizer variant on the reference backend against torch.optim over several
steps, learning-rate schedules, state_dict round trips, foreach's errors, and the multi-tensor
kernels compiled by NVRTC. gpu tier: the same steps through the multi-tensor kernels.
"""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.codegen.multi_tensor import CHUNK, lower_multi_tensor
from flame.codegen.render import render
from flame.foreach import ForeachError, _trace, foreach
from flame.optim.adam import adam_amsgrad_rule, adam_rule
from flame.optim.sgd import sgd_nesterov_rule, sgd_rule

torch = pytest.importorskip("torch")

SMALL_SHAPES = [(5, 7), (13,), (3, 4, 2), (1,)]
# several chunks, a tail that is not a multiple of the vector width, and a one-element tensor
GPU_SHAPES = [(CHUNK * 2 + 3,), (257, 129), (1,), (64, 64)]

VARIANTS = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, weight_decay=0.05, maximize=True)),
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05, momentum=0.9, dampening=0.3, weight_decay=0.01)),
    ("SGD", dict(lr=0.05, momentum=0.8, nesterov=True)),
    ("Adam", dict(lr=1e-2)),
    ("Adam", dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.99))),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
]


def _loss(params, weights, lib):
    # a different gradient per parameter and per step (so moments and momentum matter)
    total = 0
    for index, (p, w) in enumerate(zip(params, weights)):
        total = total + ((p * p) * w).sum() * (index + 1) + (p * w).sum()
        total = total + (lib.sin(p) * w).sum()
    return total


def _run(name, options, shapes, rng, steps, backend):
    init = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    weights = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    with fl.backend(backend):
        params = [fl.tensor(a).requires_grad_() for a in init]
        ws = [fl.tensor(w) for w in weights]
        opt = getattr(fl.optim, name)(params, **options)
        for _ in range(steps):
            _loss(params, ws, fl).backward()
            opt.step()
            opt.zero_grad()
        got = [p.numpy() for p in params]
    tparams = [torch.tensor(a, requires_grad=True) for a in init]
    tws = [torch.tensor(w) for w in weights]
    topt = getattr(torch.optim, name)(tparams, **options)
    for _ in range(steps):
        _loss(tparams, tws, torch).backward()
        topt.step()
        topt.zero_grad()
    return got, [t.detach().numpy() for t in tparams], init


@pytest.mark.parametrize("name,options", VARIANTS, ids=lambda v: str(v))
def test_optimizer_matches_torch_reference(name, options, rng):
    got, want, init = _run(name, options, SMALL_SHAPES, rng, 5, "reference")
    for g, w, start in zip(got, want, init):
        assert not np.allclose(g, start)  # the step moved the parameter
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("name,options", VARIANTS, ids=lambda v: str(v))
def test_optimizer_matches_torch_gpu(name, options, rng):
    got, want, init = _run(name, options, GPU_SHAPES, rng, 4, "cuda")
    for g, w, start in zip(got, want, init):
        assert not np.allclose(g, start)
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_adamw_on_bfloat16_parameters(rng):
    """bfloat16 parameters and state, updated in float32 and rounded once per step: the GPU
    kernel against the reference backend (same rule), and PyTorch (which rounds after every
    op, so only to a few bfloat16 steps)."""
    shapes = [(CHUNK + 7,), (33, 65)]
    init = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    grads = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    results = {}
    for backend in ("cuda", "reference"):
        with fl.backend(backend):
            params = [fl.tensor(a).to(fl.bfloat16).realize().requires_grad_() for a in init]
            opt = fl.optim.AdamW(params, lr=0.05, weight_decay=0.1)
            for _ in range(3):
                for p, g in zip(params, grads):
                    p.grad = fl.tensor(g).to(fl.bfloat16)
                opt.step()
            assert all(p.dtype == fl.bfloat16 for p in params)
            results[backend] = [p.float().numpy() for p in params]
    tparams = [torch.tensor(a).bfloat16().requires_grad_() for a in init]
    topt = torch.optim.AdamW(tparams, lr=0.05, weight_decay=0.1)
    for _ in range(3):
        for t, g in zip(tparams, grads):
            t.grad = torch.tensor(g).bfloat16()
        topt.step()
    for gpu, ref, t, a in zip(results["cuda"], results["reference"], tparams, init):
        np.testing.assert_allclose(gpu, ref, rtol=8e-3, atol=1e-6)  # one bfloat16 step
        np.testing.assert_allclose(gpu, t.float().detach().numpy(), rtol=0.05, atol=0.05)
        assert not np.allclose(gpu, a, atol=1e-2)


def test_param_groups_use_their_own_rates(rng, reference_backend):
    a = fl.tensor(np.ones(4, np.float32)).requires_grad_()
    b = fl.tensor(np.ones(4, np.float32)).requires_grad_()
    opt = fl.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    (a.sum() + b.sum()).backward()
    opt.step()
    np.testing.assert_allclose(a.numpy(), 0.9)
    np.testing.assert_allclose(b.numpy(), 0.5)


def test_parameters_without_gradients_are_left_alone(reference_backend):
    a = fl.tensor(np.ones(3, np.float32)).requires_grad_()
    b = fl.tensor(np.ones(3, np.float32)).requires_grad_()
    opt = fl.optim.Adam([a, b], lr=0.1)
    a.sum().backward()
    opt.step()
    assert b not in opt.state and a in opt.state
    np.testing.assert_array_equal(b.numpy(), 1.0)
    assert opt.state[a]["step"] == 1


def test_state_dict_round_trip_continues_identically(rng, reference_backend):
    init = rng.standard_normal((6, 5)).astype(np.float32)

    def make():
        p = fl.tensor(init.copy()).requires_grad_()
        return p, fl.optim.AdamW([p], lr=0.05, weight_decay=0.1)

    def train(p, opt, steps):
        for _ in range(steps):
            ((p * p).sum() + fl.sin(p).sum()).backward()
            opt.step()
            opt.zero_grad()

    p1, opt1 = make()
    train(p1, opt1, 3)
    saved = opt1.state_dict()
    assert saved["state"][0]["step"] == 3 and saved["param_groups"][0]["params"] == [0]
    p2, opt2 = make()
    with fl.no_grad():  # an in-place write to a leaf that requires grad, as in PyTorch
        p2.copy_(p1)
    opt2.load_state_dict(saved)
    assert opt2.state[p2]["exp_avg"] is not opt1.state[p1]["exp_avg"]  # its own copy
    train(p1, opt1, 2)
    train(p2, opt2, 2)
    np.testing.assert_array_equal(p1.numpy(), p2.numpy())


def test_load_state_dict_rejects_another_layout(reference_backend):
    p = fl.tensor(np.ones(3, np.float32)).requires_grad_()
    q = fl.tensor(np.ones(3, np.float32)).requires_grad_()
    opt = fl.optim.SGD([p, q], lr=0.1)
    other = fl.optim.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="group of 1 parameters given for one of 2"):
        opt.load_state_dict(other.state_dict())


def test_optimizer_errors(reference_backend):
    with pytest.raises(ValueError, match="empty parameter list"):
        fl.optim.SGD([], lr=0.1)
    p = fl.tensor(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="invalid learning rate"):
        fl.optim.Adam([p], lr=-1.0)
    with pytest.raises(ValueError, match="Nesterov"):
        fl.optim.SGD([p], lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match="cannot optimize a int32"):
        fl.optim.SGD([fl.tensor(np.ones(3, np.int32))], lr=0.1)
    with pytest.raises(ValueError, match="two groups"):
        fl.optim.SGD([{"params": [p]}, {"params": [p]}], lr=0.1)


SCHEDULES = [
    ("LinearLR", dict(start_factor=0.1, end_factor=1.0, total_iters=4)),
    ("CosineAnnealingLR", dict(T_max=6, eta_min=0.001)),
    ("LambdaLR", dict(lr_lambda=lambda epoch: 0.9**epoch)),
]


@pytest.mark.parametrize("name,options", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_schedules_match_torch(name, options, reference_backend):
    p = fl.tensor(np.ones(2, np.float32))
    opt = fl.optim.SGD([p], lr=0.1)
    ours = getattr(fl.optim.lr_scheduler, name)(opt, **options)
    t = torch.ones(2, requires_grad=True)
    topt = torch.optim.SGD([t], lr=0.1)
    theirs = getattr(torch.optim.lr_scheduler, name)(topt, **options)
    for _ in range(8):
        np.testing.assert_allclose(ours.get_last_lr(), theirs.get_last_lr(), rtol=1e-6)
        assert opt.param_groups[0]["lr"] == ours.get_last_lr()[0]
        topt.step()
        ours.step()
        theirs.step()


def test_warmup_then_cosine_matches_torch(reference_backend):
    p = fl.tensor(np.ones(2, np.float32))
    opt = fl.optim.AdamW([p], lr=0.1)
    sched = fl.optim.lr_scheduler
    ours = sched.SequentialLR(
        opt, [sched.LinearLR(opt, 0.25, 1.0, 3), sched.CosineAnnealingLR(opt, 5)], [3]
    )
    t = torch.ones(2, requires_grad=True)
    topt = torch.optim.AdamW([t], lr=0.1)
    tsched = torch.optim.lr_scheduler
    theirs = tsched.SequentialLR(
        topt, [tsched.LinearLR(topt, 0.25, 1.0, 3), tsched.CosineAnnealingLR(topt, 5)], [3]
    )
    for _ in range(9):
        np.testing.assert_allclose(ours.get_last_lr(), theirs.get_last_lr(), rtol=1e-6, atol=1e-9)
        topt.step()
        ours.step()
        theirs.step()


# --- foreach -----------------------------------------------------------------------------


def test_foreach_errors(reference_backend):
    a = [fl.ones(3), fl.ones(4)]
    with pytest.raises(ForeachError, match="list 1 has 1 tensors, list 0 has 2"):
        foreach(lambda x, y: x + y, a, [fl.ones(3)], into=(0,))
    with pytest.raises(ForeachError, match=r"shape \[4\] in list 0 but \[5\] in list 1"):
        foreach(lambda x, y: x + y, a, [fl.ones(3), fl.ones(5)], into=(0,))
    with pytest.raises(ForeachError, match="into names list 3"):
        foreach(lambda x, y: x + y, a, a, into=(3,))


def test_foreach_rule_must_be_elementwise(cuda_backend):
    with pytest.raises(ForeachError, match="must fuse into one elementwise kernel"):
        _trace(lambda x: x - x.sum(), (fl.float32,), None, (0,))
    with pytest.raises(ForeachError, match="must be a new value"):
        _trace(lambda x, y: (x + y, x), (fl.float32, fl.float32), None, (0, 1))


def test_foreach_updates_in_place_on_reference(reference_backend):
    xs = [fl.tensor(np.arange(5, dtype=np.float32)), fl.tensor(np.ones((2, 2), np.float32))]
    ys = [fl.full((5,), 2.0), fl.full((2, 2), 3.0)]
    storages = [x.node.buffer or x.node.attr("storage") for x in xs]
    assert all(storage is not None for storage in storages)
    foreach(lambda x, y, h: x * y + h[0], xs, ys, scalars=fl.tensor([0.5]), into=(0,))
    np.testing.assert_array_equal(xs[0].numpy(), np.arange(5) * 2 + 0.5)
    np.testing.assert_array_equal(xs[1].numpy(), np.full((2, 2), 3.5))
    # the same storage objects, written in place
    assert [x.node.buffer or x.node.attr("storage") for x in xs] == storages


@pytest.mark.gpu
def test_foreach_updates_in_place_on_gpu(rng, cuda_backend):
    import cupy

    data = [rng.standard_normal(n).astype(np.float32) for n in (CHUNK + 5, 3, 1000)]
    xs = [fl.tensor(d).realize() for d in data]
    pointers = [x.data_ptr() for x in xs]
    # an unaligned (but contiguous) parameter takes the scalar-load variant
    base = cupy.asarray(rng.standard_normal(1001).astype(np.float32))
    odd = fl.from_dlpack(base[1:])
    xs.append(odd)
    data.append(cupy.asnumpy(base[1:]))
    ys = [fl.full(x.shape, 2.0) for x in xs]
    foreach(lambda x, y, h: x * y + h[0], xs, ys, scalars=fl.tensor([0.25]), into=(0,))
    for x, d in zip(xs, data):
        np.testing.assert_allclose(x.numpy(), d * 2 + 0.25, rtol=1e-6)
    assert [x.data_ptr() for x in xs[:3]] == pointers
    np.testing.assert_allclose(cupy.asnumpy(base[1:]), data[-1] * 2 + 0.25, rtol=1e-6)


@pytest.mark.gpu
def test_learning_rate_schedule_never_recompiles(rng, cuda_backend):
    from flame.runtime.executor import default_executor

    p = fl.tensor(rng.standard_normal(1000).astype(np.float32)).requires_grad_()
    opt = fl.optim.AdamW([p], lr=0.1)
    sched = fl.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    (p * p).sum().backward()
    opt.step()
    opt.zero_grad()
    compiles = default_executor().kernels.stats.compiles
    before = p.numpy().copy()
    for _ in range(3):
        sched.step()
        (p * p).sum().backward()
        opt.step()
        opt.zero_grad()
    assert default_executor().kernels.stats.compiles == compiles
    assert not np.allclose(p.numpy(), before)


RULES = [
    (adam_rule, (fl.float32,) * 4, 9, (0, 2, 3)),
    (adam_rule, (fl.bfloat16,) * 4, 9, (0, 2, 3)),
    (adam_amsgrad_rule, (fl.float16,) * 5, 9, (0, 2, 3, 4)),
    (sgd_rule, (fl.float32,) * 2, 6, (0,)),
    (sgd_nesterov_rule, (fl.bfloat16, fl.bfloat16, fl.float32), 6, (0, 2)),
]


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("rule,dtypes,hyper,into", RULES, ids=lambda v: getattr(v, "__name__", ""))
def test_multi_tensor_kernels_compile(rule, dtypes, hyper, into, aligned, wide, nvrtc):
    from flame.runtime.compiler import nvrtc_compile

    with fl.backend("cuda"):
        scalars = fl.zeros(hyper)
    traced = _trace(rule, dtypes, scalars, into)
    varying = {id(node) for node in traced.placeholders}
    low = lower_multi_tensor(traced.group, varying, aligned, wide)
    source = render(low.spec)
    assert ("FlameVec" in source.split("extern")[1]) == aligned
    assert ("typedef long long Index" in source) == wide
    assert sum(kind == "out" for kind, _ in low.per_tensor) == len(into)
    # every output is stored in its list's own type (a float32 store into a bfloat16
    # parameter would write past its end)
    stored = [output.dtype for output in low.lowered.outputs]
    assert sorted(d.name for d in stored) == sorted(dtypes[i].name for i in into)
    assert len(nvrtc_compile(source, low.spec.name, "sm_90")) > 0


@pytest.mark.gpu
def test_per_step_values_reach_the_gpu_in_order(rng):
    """The learning rate changes every step; the per-step values go through a ring of
    page-locked buffers copied asynchronously, reused every 8 copies: after
    more steps than that, the GPU's parameters equal the reference backend's."""
    from flame.runtime.staging import StagedUploads

    init = rng.standard_normal(4096).astype(np.float32)
    grads = [rng.standard_normal(4096).astype(np.float32) for _ in range(3)]
    results = {}
    for backend in ("cuda", "reference"):
        with fl.backend(backend):
            param = fl.tensor(init).realize().requires_grad_()
            opt = fl.optim.AdamW([param], lr=0.01, weight_decay=0.05)
            for step in range(3 * StagedUploads().slots + 1):
                opt.param_groups[0]["lr"] = 0.01 * (1 + step % 5)
                param.grad = fl.tensor(grads[step % 3])
                opt.step()
            results[backend] = param.numpy()
    np.testing.assert_allclose(results["cuda"], results["reference"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(results["cuda"], init, atol=1e-3)
