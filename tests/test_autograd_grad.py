"""PyTorch's gradient functions, ported by changing imports: ``flame.autograd.grad(outputs,
inputs, ...)`` against ``torch.autograd.grad``, ``flame.autograd.backward`` against
``torch.autograd.backward``, and ``flame.func.grad``/``grad_and_value``/``vjp`` against
``torch.func`` (has_aux, dict and tuple arguments). The callable form of
``flame.autograd.grad`` stays FLAME's functional transform. Every test runs on the reference
backend and, in the gpu tier, on the CUDA backend (the ``backend`` fixture).
"""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="PyTorch's gradients are the oracle of this test")


def _arrays(rng, *shapes):
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def _flame(arrays):
    return [fl.tensor(array).requires_grad_() for array in arrays]


def _torch(torch, arrays):
    return [torch.tensor(array, requires_grad=True) for array in arrays]


def _close(actual, expected):
    assert actual is not None and expected is not None
    np.testing.assert_allclose(actual.numpy(), expected.detach().numpy(), **TOLERANCE)


def _loss(lib, x, w):
    return (lib.tanh(x @ w) * x.sum(1, keepdim=True)).sum()


def test_one_output_one_input_returns_a_tuple_and_writes_no_grad(backend, rng, torch):
    arrays = _arrays(rng, (3, 4), (4, 5))
    x, w = _flame(arrays)
    tx, tw = _torch(torch, arrays)
    result = fl.autograd.grad(_loss(fl, x, w), w)
    (expected,) = torch.autograd.grad(_loss(torch, tx, tw), tw)
    assert isinstance(result, tuple) and len(result) == 1
    _close(result[0], expected)
    assert x.grad is None and w.grad is None
    assert not result[0].requires_grad  # without create_graph the result is detached


def test_several_outputs_inputs_and_grad_outputs(backend, rng, torch):
    arrays = _arrays(rng, (3, 4), (4, 5), (3, 5))
    x, w = _flame(arrays[:2])
    tx, tw = _torch(torch, arrays[:2])
    seed = arrays[2]

    def outputs(lib, x, w):
        return [lib.sin(x @ w), (x * x).sum()]  # a [3, 5] output and a one-element one

    got = fl.autograd.grad(outputs(fl, x, w), [x, w], grad_outputs=[fl.tensor(seed), None])
    expected = torch.autograd.grad(outputs(torch, tx, tw), [tx, tw], [torch.tensor(seed), None])
    assert len(got) == 2
    for actual, reference in zip(got, expected):
        _close(actual, reference)


def test_gradient_with_respect_to_an_intermediate_value_and_dict_inputs(backend, rng, torch):
    arrays = _arrays(rng, (2, 6))
    (x,) = _flame(arrays)
    (tx,) = _torch(torch, arrays)
    hidden, t_hidden = fl.exp(x) * 0.5, torch.exp(tx) * 0.5
    got = fl.autograd.grad((hidden * hidden).sum(), {"hidden": hidden, "x": x})
    # PyTorch takes a dict of inputs only in recent releases: compared as a tuple of them
    expected = torch.autograd.grad((t_hidden * t_hidden).sum(), (t_hidden, tx))
    assert list(got) == ["hidden", "x"]
    for key, reference in zip(got, expected):
        _close(got[key], reference)


def test_gradients_of_module_parameters_given_as_a_generator(backend, rng, torch):
    (array,) = _arrays(rng, (5, 4))
    layer = fl.nn.Linear(4, 3)
    t_layer = torch.nn.Linear(4, 3)
    with torch.no_grad():
        t_layer.weight.copy_(torch.tensor(layer.weight.numpy()))
        t_layer.bias.copy_(torch.tensor(layer.bias.numpy()))
    got = fl.autograd.grad(fl.tanh(layer(fl.tensor(array))).sum(), layer.parameters())
    expected = torch.autograd.grad(
        torch.tanh(t_layer(torch.tensor(array))).sum(), t_layer.parameters()
    )
    assert len(got) == 2
    for actual, reference in zip(got, expected):
        _close(actual, reference)
    assert layer.weight.grad is None


def test_non_scalar_output_needs_grad_outputs(backend, rng, torch):
    arrays = _arrays(rng, (3, 4))
    (x,) = _flame(arrays)
    (tx,) = _torch(torch, arrays)
    with pytest.raises(RuntimeError, match="implicitly created only for scalar"):
        torch.autograd.grad(tx * 2.0, tx)
    with pytest.raises(RuntimeError, match=r"shape \[3, 4\] needs grad_outputs="):
        fl.autograd.grad(x * 2.0, x)
    with pytest.raises(RuntimeError, match=r"grad_outputs\[0\] has a shape of \[4, 3\]"):
        fl.autograd.grad(x * 2.0, x, grad_outputs=fl.ones(4, 3))


def test_allow_unused_and_materialize_grads(backend, rng, torch):
    arrays = _arrays(rng, (3,), (2,))
    x, unused = _flame(arrays)
    tx, t_unused = _torch(torch, arrays)
    with pytest.raises(RuntimeError, match="appears to not have been used"):
        torch.autograd.grad((tx * tx).sum(), [tx, t_unused])
    with pytest.raises(RuntimeError, match=r"inputs\[1\].*float32\[2\].*not have been used"):
        fl.autograd.grad((x * x).sum(), [x, unused])

    got = fl.autograd.grad((x * x).sum(), [x, unused], allow_unused=True)
    expected = torch.autograd.grad((tx * tx).sum(), [tx, t_unused], allow_unused=True)
    _close(got[0], expected[0])
    assert got[1] is None and expected[1] is None

    got = fl.autograd.grad((x * x).sum(), [x, unused], materialize_grads=True)
    expected = torch.autograd.grad((tx * tx).sum(), [tx, t_unused], materialize_grads=True)
    for actual, reference in zip(got, expected):
        _close(actual, reference)
    for lib, inputs in ((torch, [tx, t_unused]), (fl, [x, unused])):
        with pytest.raises(ValueError, match="allow_unused"):
            lib.autograd.grad(inputs[0].sum(), inputs, materialize_grads=True, allow_unused=False)


def test_create_graph_gives_differentiable_gradients(backend, rng, torch):
    arrays = _arrays(rng, (3, 4), (4, 2))
    x, w = _flame(arrays)
    tx, tw = _torch(torch, arrays)
    (gx,) = fl.autograd.grad(_loss(fl, x, w), x, create_graph=True, retain_graph=True)
    (t_gx,) = torch.autograd.grad(_loss(torch, tx, tw), tx, create_graph=True)
    assert gx.node.buffer is None  # create_graph computes nothing yet
    got = fl.autograd.grad((gx * gx).sum(), [x, w])
    expected = torch.autograd.grad((t_gx * t_gx).sum(), [tx, tw])
    for actual, reference in zip(got, expected):
        _close(actual, reference)
    (detached,) = fl.autograd.grad(_loss(fl, x, w), x)  # no create_graph: not differentiable
    with pytest.raises(RuntimeError, match="not have been used"):
        fl.autograd.grad(detached.sum(), x)


def test_is_grads_batched_matches_torch(backend, rng, torch):
    arrays = _arrays(rng, (3, 4), (5, 3, 4))
    (x,) = _flame(arrays[:1])
    (tx,) = _torch(torch, arrays[:1])
    seeds = arrays[1]  # five cotangents of the [3, 4] output, one backward each
    (got,) = fl.autograd.grad(fl.sin(x) * x, x, fl.tensor(seeds), is_grads_batched=True)
    (expected,) = torch.autograd.grad(
        torch.sin(tx) * tx, tx, torch.tensor(seeds), is_grads_batched=True
    )
    assert got.shape == (5, 3, 4)
    _close(got, expected)
    with pytest.raises(RuntimeError, match="is_grads_batched"):
        fl.autograd.grad(fl.sin(x) * x, x, is_grads_batched=True)


def test_sgd_loop_with_in_place_updates_matches_torch(backend, rng, torch):
    """The usual port: gradients from autograd.grad, parameters updated in place, the loss
    read after the update (it is the loss of the step: grad computed it with the gradients)."""
    arrays = _arrays(rng, (8, 4), (8, 3), (4, 3), (3,))
    x, y = (fl.tensor(array) for array in arrays[:2])
    tx, ty = (torch.tensor(array) for array in arrays[:2])
    params, t_params = _flame(arrays[2:]), _torch(torch, arrays[2:])
    for _ in range(3):
        losses = []
        for lib, (inputs, targets), (w, b) in (
            (fl, (x, y), params), (torch, (tx, ty), t_params)
        ):  # fmt: skip
            loss = ((lib.tanh(inputs @ w + b) - targets) ** 2).mean()
            grads = lib.autograd.grad(loss, [w, b])
            with lib.no_grad():
                for param, gradient in zip((w, b), grads):
                    param.sub_(0.5 * gradient)
            losses.append(loss.item())
        np.testing.assert_allclose(losses[0], losses[1], **TOLERANCE)
    for param, t_param in zip(params, t_params):
        _close(param, t_param)
    assert all(param.grad is None for param in params)


def test_backward_function_form_matches_torch(backend, rng, torch):
    arrays = _arrays(rng, (3, 4), (4, 5), (3, 5))
    x, w = _flame(arrays[:2])
    tx, tw = _torch(torch, arrays[:2])
    seed = arrays[2]
    fl.autograd.backward([fl.tanh(x @ w), (w * w).sum()], [fl.tensor(seed), None])
    torch.autograd.backward([torch.tanh(tx @ tw), (tw * tw).sum()], [torch.tensor(seed), None])
    _close(x.grad, tx.grad)
    _close(w.grad, tw.grad)
    fl.autograd.backward(_loss(fl, x, w), inputs=[w])  # accumulates, into w only
    torch.autograd.backward(_loss(torch, tx, tw), inputs=[tw])
    _close(x.grad, tx.grad)
    _close(w.grad, tw.grad)
    _loss(fl, x, w).backward(inputs=[x], retain_graph=True)  # Tensor.backward's PyTorch form
    _loss(torch, tx, tw).backward(inputs=[tx], retain_graph=True)
    _close(x.grad, tx.grad)
    with pytest.raises(RuntimeError, match=r"shape \[3, 5\] needs grad_tensors="):
        fl.autograd.backward(fl.tanh(x @ w))


def test_both_forms_trace_inside_compile(backend, rng, torch):
    arrays = _arrays(rng, (3, 4), (4, 5))
    w = fl.tensor(arrays[1]).requires_grad_()

    @fl.compile
    def step(x):
        loss = _loss(fl, x, w)
        (tensor_form,) = fl.autograd.grad(loss, [w])
        functional = fl.autograd.grad(lambda v: _loss(fl, x, v))(w)
        (batched,) = fl.autograd.grad(x @ w, w, fl.ones(2, 3, 5), is_grads_batched=True)
        return loss, tensor_form, functional, batched

    for scale in (1.0, 2.0):  # the second call runs the traced program again
        x = fl.tensor(arrays[0] * scale)
        tx, tw = torch.tensor(arrays[0] * scale), torch.tensor(arrays[1], requires_grad=True)
        loss, tensor_form, functional, batched = step(x)
        (expected,) = torch.autograd.grad(_loss(torch, tx, tw), tw)
        _close(tensor_form, expected)
        _close(functional, expected)
        (ones,) = torch.autograd.grad((tx @ tw).sum(), tw)
        _close(batched, torch.stack([ones, ones]))
    assert step.cache_info().traces == 1
    assert w.grad is None


def test_callable_form_keeps_flame_functional_grad(backend, rng, torch):
    arrays = _arrays(rng, (4,), (3,))
    x, unused = (fl.tensor(array) for array in arrays)  # no requires_grad needed
    cube = fl.autograd.grad(lambda a: (a**3).sum())(x)
    np.testing.assert_allclose(cube.numpy(), 3 * arrays[0] ** 2, rtol=1e-5)
    with pytest.raises(RuntimeError, match="does not influence"):
        fl.autograd.grad(lambda a, b: (a * a).sum(), argnums=(0, 1))(x, unused)
    got = fl.func.grad(lambda a, b: (a * a).sum(), argnums=(0, 1))(x, unused)  # torch.func: zeros
    tx, t_unused = (torch.tensor(array) for array in arrays)
    expected = torch.func.grad(lambda a, b: (a * a).sum(), argnums=(0, 1))(tx, t_unused)
    for actual, reference in zip(got, expected):
        _close(actual, reference)


def _model(lib, params, x):
    hidden = lib.tanh(x @ params["w"] + params["b"])
    return (hidden * hidden).mean(), hidden.sum(0)


def test_func_grad_and_grad_and_value_with_aux_and_dict_arguments(backend, rng, torch):
    arrays = _arrays(rng, (4, 3), (3,), (2, 4))
    params = {"w": fl.tensor(arrays[0]), "b": fl.tensor(arrays[1])}
    t_params = {"w": torch.tensor(arrays[0]), "b": torch.tensor(arrays[1])}
    x, tx = fl.tensor(arrays[2]), torch.tensor(arrays[2])

    grads, aux = fl.func.grad(lambda p, x: _model(fl, p, x), has_aux=True)(params, x)
    t_grads, t_aux = torch.func.grad(lambda p, x: _model(torch, p, x), has_aux=True)(t_params, tx)
    assert isinstance(grads, dict) and list(grads) == ["w", "b"]
    for key in grads:
        _close(grads[key], t_grads[key])
    _close(aux, t_aux)

    def loss(lib, pair, x):
        return _model(lib, {"w": pair[0], "b": pair[1]}, x)[0]

    function = fl.func.grad_and_value(lambda p, x: loss(fl, p, x), argnums=(0, 1))
    (grads, grad_x), value = function((params["w"], params["b"]), x)
    t_function = torch.func.grad_and_value(lambda p, x: loss(torch, p, x), argnums=(0, 1))
    (t_grads, t_grad_x), t_value = t_function((t_params["w"], t_params["b"]), tx)
    assert isinstance(grads, tuple) and len(grads) == 2
    for actual, reference in zip((*grads, grad_x, value), (*t_grads, t_grad_x, t_value)):
        _close(actual, reference)


def test_func_vjp_with_aux_tuple_outputs_and_dict_primals(backend, rng, torch):
    arrays = _arrays(rng, (4, 3), (3,), (2, 4), (3,))
    params = {"w": fl.tensor(arrays[0]), "b": fl.tensor(arrays[1])}
    t_params = {"w": torch.tensor(arrays[0]), "b": torch.tensor(arrays[1])}
    x, tx = fl.tensor(arrays[2]), torch.tensor(arrays[2])

    def function(lib, params, x):
        loss, column = _model(lib, params, x)
        return (loss, column), x * 2.0

    out, vjp_fn, aux = fl.func.vjp(lambda p, x: function(fl, p, x), params, x, has_aux=True)
    t_out, t_vjp_fn, t_aux = torch.func.vjp(
        lambda p, x: function(torch, p, x), t_params, tx, has_aux=True
    )
    _close(aux, t_aux)
    seeds = (fl.tensor(np.float32(0.5)), fl.tensor(arrays[3]))
    got = vjp_fn(seeds)  # torch.func's form: one cotangent shaped as the outputs
    expected = t_vjp_fn((torch.tensor(0.5), torch.tensor(arrays[3])))
    assert isinstance(got[0], dict) and list(got[0]) == ["w", "b"]
    for key in got[0]:
        _close(got[0][key], expected[0][key])
    _close(got[1], expected[1])
    separate = vjp_fn(*seeds)  # FLAME's older form: one argument per output
    _close(separate[1], expected[1])
    with pytest.raises(RuntimeError, match="2 outputs and 1 cotangents"):
        vjp_fn(seeds[0])


def test_bad_arguments_name_what_is_wrong(reference_backend, rng):
    x = fl.tensor(_arrays(rng, (3,))[0]).requires_grad_()
    with pytest.raises(TypeError, match=r"outputs\[1\] is a float"):
        fl.autograd.grad([x.sum(), 2.0], x)
    with pytest.raises(RuntimeError, match=r"inputs\[0\] is int32\[3\]"):
        fl.autograd.grad(x.sum(), fl.tensor(np.arange(3, dtype=np.int32)))
    with pytest.raises(RuntimeError, match="1 outputs but 2 grad_outputs"):
        fl.autograd.grad(x.sum(), x, grad_outputs=[None, None])
    with pytest.raises(RuntimeError, match="cannot be empty"):
        fl.autograd.grad(x.sum(), [])
