"""flame.compile for training: size-generic signatures, weights as runtime buffers, backward()
inside a compiled function, nested results, static arguments, compiled == lazy steps."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F


def _t(rng, *shape):
    return fl.tensor(rng.standard_normal(shape).astype(np.float32))


def _mlp_loss(x, y, w1, b1, w2):
    return F.mse_loss(F.gelu(x @ w1 + b1) @ w2, y)


def test_new_sizes_replan_instead_of_missing(rng, reference_backend):
    compiled = fl.compile(lambda x, y: (x * y + 1.0).sum(0))
    compiled(_t(rng, 4, 8), _t(rng, 4, 8))
    out = compiled(*(a := (_t(rng, 16, 8), _t(rng, 16, 8))))  # new batch size
    np.testing.assert_allclose(out.numpy(), (a[0].numpy() * a[1].numpy() + 1).sum(0), rtol=1e-5)
    compiled(_t(rng, 16, 8), _t(rng, 16, 8))  # known sizes: a hit
    info = compiled.cache_info()
    assert (info.misses, info.replans, info.hits, info.traces) == (1, 1, 1, 2)
    assert info.reasons[1].startswith("replan: new sizes [[16, 8], [16, 8]]")


def test_broadcast_pattern_is_part_of_the_signature(rng, reference_backend):
    compiled = fl.compile(lambda x, y: x + y)
    compiled(_t(rng, 4, 8), _t(rng, 4, 8))
    compiled(_t(rng, 4, 8), _t(rng, 1, 8))  # y now broadcasts along axis 0
    info = compiled.cache_info()
    assert info.misses == 2 and info.replans == 0
    assert "argument 'y'" in info.reasons[1] and "[1n]" in info.reasons[1]


def test_closed_over_weights_are_read_at_every_call(rng, reference_backend):
    w = _t(rng, 8, 8)
    compiled = fl.compile(lambda x: x @ w)
    x = _t(rng, 2, 8)
    first = compiled(x).numpy()
    new_weights = rng.standard_normal((8, 8)).astype(np.float32)
    w.copy_(new_weights)  # load other weights in place
    second = compiled(x).numpy()
    np.testing.assert_allclose(second, x.numpy() @ new_weights, rtol=1e-5)
    assert not np.allclose(first, second)
    assert compiled.cache_info().traces == 1


def test_backward_inside_a_compiled_step_sets_grads(rng, reference_backend):
    x, y = _t(rng, 4, 6), _t(rng, 4, 3)
    w1, b1, w2 = _t(rng, 6, 5), _t(rng, 5), _t(rng, 5, 3)
    params = [p.requires_grad_() for p in (w1, b1, w2)]

    @fl.compile
    def step(x, y):
        loss = _mlp_loss(x, y, w1, b1, w2)
        loss.backward()
        return loss

    loss = step(x, y)
    got = [p.grad.numpy() for p in params]
    for p in params:
        p.grad = None
    lazy = _mlp_loss(x, y, w1, b1, w2)
    lazy.backward()
    np.testing.assert_allclose(loss.numpy(), lazy.numpy(), rtol=1e-6)
    for g, p in zip(got, params):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-5, atol=1e-7)
    # grads accumulate across calls, as in lazy mode: the held .grad is an input
    for p in params:
        p.grad = None
    step(x, y)
    step(x, y)
    step(x, y)
    for g, p in zip(got, params):
        np.testing.assert_allclose(p.grad.numpy(), 3 * g, rtol=1e-5, atol=1e-6)
    info = step.cache_info()
    assert info.traces == 2 and info.hits == 2  # .grad None at the first trace, set later
    assert "grad" in info.reasons[1]


def _train(compiled: bool, x, y, init, lr: float, steps: int):
    """AdamW steps of the MLP, the step compiled or lazy: (losses, parameters, step)."""
    params = [fl.tensor(a.copy()).requires_grad_() for a in init]
    opt = fl.optim.AdamW(params, lr=lr)

    def step(x, y):
        loss = _mlp_loss(x, y, *params)
        loss.backward()
        return loss

    run = fl.compile(step) if compiled else step
    losses = []
    for _ in range(steps):
        losses.append(run(x, y).item())
        opt.step()
        opt.zero_grad()
    return losses, [p.numpy() for p in params], run


def test_compiled_training_step_matches_lazy_steps(rng, reference_backend):
    data = [rng.standard_normal(s).astype(np.float32) for s in ((4, 6), (4, 3))]
    init = [rng.standard_normal(s).astype(np.float32) * 0.5 for s in ((6, 5), (5,), (5, 3))]

    def train(compiled: bool):
        x, y = (fl.tensor(a) for a in data)
        return _train(compiled, x, y, init, lr=0.05, steps=4)

    lazy_losses, lazy_params, _ = train(False)
    losses, params, run = train(True)
    np.testing.assert_allclose(losses, lazy_losses, rtol=1e-5)
    assert losses[-1] < losses[0]
    for a, b in zip(params, lazy_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert run.cache_info().traces == 1  # parameters updated in place: no retrace


def test_nested_results_and_value_and_grad(rng, reference_backend):
    @fl.compile
    def loss_and_grads(x, y, w1, b1, w2):
        value, grads = fl.value_and_grad(_mlp_loss, argnums=(2, 3, 4))(x, y, w1, b1, w2)
        return {"loss": value, "grads": grads, "nothing": None}

    args = [_t(rng, 4, 6), _t(rng, 4, 3), _t(rng, 6, 5), _t(rng, 5), _t(rng, 5, 3)]
    out = loss_and_grads(*args)
    assert set(out) == {"loss", "grads", "nothing"} and out["nothing"] is None
    value, grads = fl.value_and_grad(_mlp_loss, argnums=(2, 3, 4))(*args)
    np.testing.assert_allclose(out["loss"].numpy(), value.numpy(), rtol=1e-6)
    assert isinstance(out["grads"], tuple) and len(out["grads"]) == 3
    for a, b in zip(out["grads"], grads):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)


def test_static_argnames(rng, reference_backend):
    def scaled(x, *, power):
        return x**power

    compiled = fl.compile(scaled, static_argnames=("power",))
    x = _t(rng, 5)
    np.testing.assert_allclose(compiled(x, power=2).numpy(), x.numpy() ** 2, rtol=1e-6)
    np.testing.assert_allclose(compiled(x, power=3).numpy(), x.numpy() ** 3, rtol=1e-5)
    compiled(x, power=3)
    info = compiled.cache_info()
    assert (info.misses, info.hits) == (2, 1) and "power" in info.reasons[1]
    with pytest.raises(TypeError, match="static argument 'power' is a tensor"):
        compiled(x, power=x)


def test_a_failed_trace_leaves_no_state(rng, reference_backend):
    w = _t(rng, 3).requires_grad_()

    def broken(x):
        (x * w).sum().backward()
        raise RuntimeError("user error after backward")

    compiled = fl.compile(broken)
    with pytest.raises(RuntimeError, match="user error"):
        compiled(_t(rng, 3))
    assert w.grad is None
    assert compiled.cache_info().traces == 0


def test_static_bool_and_int_are_different_signatures(rng, reference_backend):
    compiled = fl.compile(lambda x, flag: x * 2 if flag is True else x * 3)
    x = _t(rng, 3)
    np.testing.assert_allclose(compiled(x, True).numpy(), x.numpy() * 2)
    np.testing.assert_allclose(compiled(x, 1).numpy(), x.numpy() * 3)


def test_returning_an_input_or_a_closed_over_tensor(rng, reference_backend):
    w = _t(rng, 3).realize()
    compiled = fl.compile(lambda x: (x, w, x + w))
    x = _t(rng, 3)
    a, b, c = compiled(x)
    assert a is x and b is w
    np.testing.assert_allclose(c.numpy(), x.numpy() + w.numpy(), rtol=1e-6)


@pytest.mark.gpu
def test_new_sizes_reuse_compiled_kernels_on_the_gpu(rng):
    from flame.runtime.executor import default_executor

    compiled = fl.compile(lambda x, b: fl.gelu(x + b).sum(-1))
    compiled(_t(rng, 64, 256), _t(rng, 256)).numpy()
    compiles = default_executor().kernels.stats.compiles
    x, b = _t(rng, 96, 384), _t(rng, 384)
    got = compiled(x, b).numpy()
    expected = fl.gelu(x + b).sum(-1).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-4)
    assert default_executor().kernels.stats.compiles == compiles
    assert compiled.cache_info().replans == 1


@pytest.mark.gpu
def test_compiled_training_step_on_the_gpu(rng):
    x, y = _t(rng, 64, 32), _t(rng, 64, 16)
    init = [rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((32, 48), (48,), (48, 16))]
    results = [_train(compiled, x, y, init, lr=0.01, steps=3) for compiled in (False, True)]
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-4)
    for a, b in zip(results[1][1], results[0][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_programs_report_signature_and_sizes(rng, reference_backend):
    compiled = fl.compile(lambda x, y: x * y)
    compiled(_t(rng, 4, 8), _t(rng, 8))
    (entry,) = compiled.programs()
    assert entry["signature"] == [
        "float32 rank 2 [nn] on reference",
        "float32 rank 1 [n] on reference",
    ]
    assert entry["sizes"] == [[4, 8], [8]]


@pytest.mark.gpu
def test_plan_releases_intermediates_after_their_last_reader(rng):
    # softmax-then-matmul: the softmax's result is an intermediate read only by the matmul
    x, w = _t(rng, 256, 512), _t(rng, 512, 64)
    compiled = fl.compile(lambda x, w: (F.softmax(x, -1) @ w).sum(-1) * 2.0)
    got = compiled(x, w)
    np.testing.assert_allclose(
        got.numpy(), (F.softmax(x, -1) @ w).sum(-1).numpy() * 2.0, rtol=1e-4, atol=1e-5
    )
    program = next(iter(compiled._state._programs.values()))
    plan = program.plan
    released = {slot for slots in plan.releases for slot in slots}
    assert released and not released & set(plan.output_slots)
    everything = sum(n.numel * n.dtype.itemsize for g in plan.graph.groups for n in g.outputs)
    assert 0 < plan.planned_peak_bytes < everything
    assert compiled.programs()[0]["planned_peak_bytes"] == plan.planned_peak_bytes


def _two_kernels(x):
    column = (x * 2.0).sum(0)  # a column reduction, then an elementwise kernel reading it
    return fl.tanh(x + column), column


@pytest.mark.gpu
def test_cuda_graph_replay_is_correct_and_follows_inputs_changed_in_place(rng):
    compiled = fl.compile(_two_kernels)
    x = _t(rng, 256, 64).realize()
    first = compiled(x)
    program = next(iter(compiled._state._programs.values()))
    assert len(program.plan.launches) >= 2
    for got, want in zip(first, _two_kernels(x)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    held = first[0].numpy().copy()
    x.copy_(rng.standard_normal((256, 64)).astype(np.float32))  # same address, new values
    second = compiled(x)
    for got, want in zip(second, _two_kernels(x)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    # the first result was still held during the second replay: it was not overwritten
    np.testing.assert_array_equal(first[0].numpy(), held)
    info = compiled.cache_info()
    assert info.graph_captures == 1 and info.graph_replays == 2
    other = _t(rng, 256, 64).realize()  # another address: another capture
    third = compiled(other)
    np.testing.assert_allclose(third[1].numpy(), (other.numpy() * 2).sum(0), rtol=1e-4)
    assert compiled.cache_info().graph_captures == 2


@pytest.mark.gpu
def test_cuda_graphs_can_be_switched_off(rng):
    compiled = fl.compile(_two_kernels, cuda_graph=False)
    x = _t(rng, 128, 32).realize()
    for _ in range(2):
        got = compiled(x)
    np.testing.assert_allclose(got[1].numpy(), (x.numpy() * 2).sum(0), rtol=1e-4)
    assert compiled.cache_info().graph_replays == 0


def test_reference_backend_never_captures(rng, reference_backend):
    compiled = fl.compile(_two_kernels, cuda_graph=True)
    x = _t(rng, 16, 8)
    compiled(x)
    compiled(x)
    assert compiled.cache_info().graph_captures == 0 and compiled.cache_info().hits == 1


def test_a_compiled_program_on_the_reference_backend_is_reported_once(rng, reference_backend):
    from flame.runtime import events

    seen = []
    compiled = fl.compile(lambda x, w: fl.gelu(x @ w).sum())
    x, w = _t(rng, 4, 8), _t(rng, 8, 3)
    with events.recording(lambda kind, data: seen.append((kind, data))):
        compiled(x, w)
        compiled(x, w)
    reported = [data["outputs"] for kind, data in seen if kind == "reference"]
    assert len(reported) == 1  # at trace time: the dump renders its kernels from it
    assert [kind for kind, _ in seen].count("trace") == 1


def test_copy_into_a_tensor_checks_the_source(rng, reference_backend):
    w = _t(rng, 3, 4).realize()
    w.copy_(np.arange(4, dtype=np.float32))  # broadcast along the rows
    np.testing.assert_array_equal(w.numpy(), np.tile(np.arange(4, dtype=np.float32), (3, 1)))
    with pytest.raises(fl.ShapeError, match=r"copy_: cannot broadcast a source of shape \[3, 5\]"):
        w.copy_(np.ones((3, 5), np.float32))
    with pytest.raises(fl.ShapeError, match=r"copy_: .*shape \[2, 3, 4\]"):
        w.copy_(np.ones((2, 3, 4), np.float32))  # broadcasts, but to a larger shape
