"""The autograd API: backward and accumulation, hooks, no_grad and detach, the functional
transforms, higher-order gradients, checkpoint, random graphs, threads and bad input.

CPU-tier tests run on the reference backend; the ``gpu`` tier checks the key composites
(layer norm, softmax, cross-entropy, matmul) on the CUDA backend against PyTorch autograd,
realizing forward and gradients in one schedule.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from gradcheck import check_against_finite_differences, float64_values
from hypothesis import given, settings
from hypothesis import strategies as st

import flame as fl
from flame.ir.node import toposort

pytestmark = pytest.mark.usefixtures("reference_backend")


def leaf(values, dtype=np.float32) -> fl.Tensor:
    return fl.tensor(np.asarray(values, dtype=dtype)).requires_grad_()


def cube_loss(x):
    return fl.sum(x * x * x)


# --- backward, accumulation, zero_grad ---------------------------------------------------------


def test_backward_accumulates_across_calls():
    x = leaf([1.0, -2.0, 0.5])
    cube_loss(x).backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 12.0, 0.75])
    fl.sum(x.sin()).backward()  # a second loss adds to the first
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 12.0, 0.75] + np.cos(x.numpy()), rtol=1e-6)


def test_backward_twice_on_one_graph_doubles():
    x = leaf([1.0, 2.0])
    loss = fl.sum(x * x)
    loss.backward()
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), [4.0, 8.0])


def test_zero_grad_and_assigning_none_reset():
    x = leaf([1.0, 2.0])
    fl.sum(x * x).backward()
    x.zero_grad()
    assert x.grad is None
    fl.sum(x * 3.0).backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 3.0])
    x.grad = None
    fl.sum(x * x).backward()
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0])


def test_gradient_is_computed_by_backward_and_undoes_broadcasting():
    a = leaf(np.ones((3, 4)))
    b = leaf(np.arange(4.0))
    loss = fl.sum(a * b)
    loss.backward()
    # computed with the loss by backward(), as PyTorch has them: a loss read after an
    # optimizer step is the step's loss (tests/test_loss_after_step.py)
    assert b.grad.is_realized and a.grad.is_realized and loss.is_realized
    np.testing.assert_allclose(b.grad.numpy(), [3.0] * 4)
    np.testing.assert_allclose(a.grad.numpy(), np.tile(np.arange(4.0), (3, 1)))


def test_float16_leaf_gets_a_float16_gradient():
    x = leaf([1.0, 2.0], np.float16)
    fl.sum(x * x).backward()
    assert x.grad.dtype is fl.float16
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0])


# --- hooks ---------------------------------------------------------------------------------------


def test_hook_doubling_the_gradient_of_a_leaf_and_of_an_intermediate():
    x = leaf([1.0, 2.0])
    x.register_hook(lambda grad: grad * 2.0)
    fl.sum(x * x).backward()
    np.testing.assert_allclose(x.grad.numpy(), [4.0, 8.0])

    y = leaf([1.0, 2.0])
    hidden = y * 3.0
    seen = []
    hidden.register_hook(lambda grad: seen.append(grad) or grad * 2.0)
    fl.sum(hidden * hidden).backward()  # d/dy = 2 * (2 * hidden) * 3
    np.testing.assert_allclose(y.grad.numpy(), 2 * 2 * 9 * np.array([1.0, 2.0]))
    assert len(seen) == 1 and not seen[0].is_realized  # a lazy tensor: the hook is IR


def test_hook_returning_none_keeps_and_removed_hook_stops():
    x = leaf([1.0, 2.0])
    calls = []
    x.register_hook(lambda grad: calls.append(1))
    handle = x.register_hook(lambda grad: grad * 10.0)
    fl.sum(x).backward()
    np.testing.assert_allclose(x.grad.numpy(), [10.0, 10.0])
    handle.remove()
    x.grad = None
    fl.sum(x).backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0, 1.0])
    assert len(calls) == 2


def test_hook_of_wrong_shape_or_dtype_raises_and_graph_stays_usable():
    x = leaf([1.0, 2.0, 3.0])
    handle = x.register_hook(lambda grad: fl.sum(grad))
    loss = cube_loss(x)
    with pytest.raises(fl.GradError, match=r"float32\[\].*float32\[3\]"):
        loss.backward()
    assert x.grad is None
    handle.remove()
    handle = x.register_hook(lambda grad: grad.half())
    with pytest.raises(fl.GradError, match=r"float16\[3\].*float32\[3\]"):
        loss.backward()
    handle.remove()
    loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 12.0, 27.0])


# --- no_grad, detach ---------------------------------------------------------------------------


def test_no_grad_results_are_detached():
    x = leaf([1.0, 2.0])
    with fl.no_grad():
        assert not fl.is_grad_enabled()
        doubled = x * 2.0
        with fl.enable_grad():
            tripled = x * 3.0
    assert fl.is_grad_enabled()
    assert not doubled.requires_grad and tripled.requires_grad
    with pytest.raises(fl.GradError, match="nothing in this graph requires grad"):
        fl.sum(doubled).backward()
    fl.sum(doubled * x).backward()  # only the direct use of x carries a gradient
    np.testing.assert_allclose(x.grad.numpy(), [2.0, 4.0])


def test_detach_stops_the_gradient():
    x = leaf([1.0, 2.0])
    fl.sum(x.detach() * x).backward()
    np.testing.assert_allclose(x.grad.numpy(), [1.0, 2.0])
    assert not x.detach().requires_grad
    np.testing.assert_array_equal(x.detach().numpy(), x.numpy())


# --- functional transforms ---------------------------------------------------------------------


def test_grad_with_several_argnums():
    a, b = fl.tensor(np.float32([0.5, -1.0])), fl.tensor(np.float32([2.0, 3.0]))
    grad_a, grad_b = fl.grad(lambda a, b: fl.sum(a * b + a.sin()), argnums=(0, 1))(a, b)
    np.testing.assert_allclose(grad_a.numpy(), b.numpy() + np.cos(a.numpy()), rtol=1e-6)
    np.testing.assert_allclose(grad_b.numpy(), a.numpy())
    only_b = fl.grad(lambda a, b: fl.sum(a * b), argnums=1)(a, b)
    np.testing.assert_allclose(only_b.numpy(), a.numpy())


def test_value_and_grad():
    x = fl.tensor(np.float32([1.0, 2.0, -1.0]))
    value, gradient = fl.value_and_grad(cube_loss)(x)
    assert value.item() == pytest.approx(8.0)
    np.testing.assert_allclose(gradient.numpy(), 3 * x.numpy() ** 2)


def test_vjp_of_a_non_scalar_function_with_two_outputs():
    x, y = fl.tensor(np.float32([1.0, 2.0])), fl.tensor(np.float32([3.0, 4.0]))
    (product, total), pullback = fl.vjp(lambda x, y: (x * y, fl.sum(x)), x, y)
    np.testing.assert_allclose(product.numpy(), [3.0, 8.0])
    grad_x, grad_y = pullback(fl.tensor(np.float32([1.0, 10.0])), fl.tensor(np.float32(2.0)))
    np.testing.assert_allclose(grad_x.numpy(), [3.0 + 2.0, 40.0 + 2.0])
    np.testing.assert_allclose(grad_y.numpy(), [1.0, 20.0])


# --- higher order ------------------------------------------------------------------------------


def test_grad_of_grad_of_cube_is_six_x():
    x = fl.tensor(np.float32([0.5, -1.5, 2.0]))
    second = fl.grad(lambda t: fl.sum(fl.grad(cube_loss)(t)))(x)
    np.testing.assert_allclose(second.numpy(), 6 * x.numpy(), rtol=1e-6)
    third = fl.grad(lambda t: fl.sum(fl.grad(lambda u: fl.sum(fl.grad(cube_loss)(u)))(t)))(x)
    np.testing.assert_allclose(third.numpy(), [6.0] * 3)


def test_grad_of_grad_of_tanh():
    x = fl.tensor(np.float32([0.3, 1.7, -2.2]))
    second = fl.grad(lambda t: fl.sum(fl.grad(lambda u: fl.sum(u.tanh()))(t)))(x)
    tanh = np.tanh(x.numpy().astype(np.float64))
    np.testing.assert_allclose(float64_values([second])[0], -2 * tanh * (1 - tanh**2), rtol=1e-12)


def test_backward_with_create_graph_is_differentiable():
    x = leaf([1.0, 2.0])
    cube_loss(x).backward(create_graph=True)
    first = x.grad
    x.grad = None
    fl.sum(first).backward()
    np.testing.assert_allclose(x.grad.numpy(), [6.0, 12.0])


# --- checkpoint --------------------------------------------------------------------------------


def block(x, w):
    return fl.tanh(x * w).exp() * x.sin()


def test_checkpoint_gives_the_same_gradients():
    x, w = fl.tensor(np.float32([0.3, -1.2, 2.0])), fl.tensor(np.float32([0.7, 0.1, -0.4]))

    def loss(x, w, checkpointed):
        hidden = fl.checkpoint(block, x, w) if checkpointed else block(x, w)
        return fl.sum(hidden * hidden)

    plain = fl.value_and_grad(lambda x, w: loss(x, w, False), argnums=(0, 1))(x, w)
    saved = fl.value_and_grad(lambda x, w: loss(x, w, True), argnums=(0, 1))(x, w)
    expected = float64_values([plain[0], *plain[1]])
    for actual, value in zip(float64_values([saved[0], *saved[1]]), expected, strict=True):
        np.testing.assert_allclose(actual, value, rtol=1e-12)
    # the backward recomputes the block behind a barrier instead of reading the forward's values
    assert "barrier" in {node.op for node in toposort([saved[1][0].node])}
    second = fl.grad(lambda t: fl.sum(fl.grad(lambda u: loss(u, w, True))(t)))(x)
    second_plain = fl.grad(lambda t: fl.sum(fl.grad(lambda u: loss(u, w, False))(t)))(x)
    np.testing.assert_allclose(*float64_values([second, second_plain]), rtol=1e-12)


def test_checkpoint_accepts_a_number_argument():
    x = fl.tensor(np.float32([1.0, 2.0]))
    gradient = fl.grad(lambda t: fl.sum(fl.checkpoint(lambda a, scale: a * scale, t, 3.0)))(x)
    np.testing.assert_allclose(gradient.numpy(), [3.0, 3.0])


# --- random elementwise graphs (Hypothesis) ----------------------------------------------------

UNARY = {
    "sin": fl.sin, "cos": fl.cos, "tanh": fl.tanh, "sigmoid": fl.sigmoid, "erf": fl.erf,
    "silu": fl.silu, "softplus": fl.softplus, "gelu": fl.gelu, "neg": fl.neg,
    "exp_tanh": lambda x: fl.exp(fl.tanh(x)), "log1p_square": lambda x: fl.log1p(x * x),
    "sqrt_shifted": lambda x: fl.sqrt(x * x + 0.5),
}  # fmt: skip
BINARY = {
    "add": fl.add, "sub": fl.sub, "mul": lambda a, b: fl.tanh(a) * b,
    "div": lambda a, b: a / (b * b + 1.0), "pow": lambda a, b: fl.pow(a * a + 0.5, fl.tanh(b)),
    "where": lambda a, b: fl.where(a > b, a * 2.0, b * 0.5 + 1.0),
}  # fmt: skip
SHAPES = [(2, 3), (3,), (), (2, 1)]  # broadcast against each other: sum_to undoes them


@st.composite
def programs(draw):
    count = draw(st.integers(1, 3))
    shapes = [draw(st.sampled_from(SHAPES)) for _ in range(count)]
    steps = []
    for position in range(draw(st.integers(1, 8))):
        available = count + position
        if draw(st.booleans()):
            steps.append(
                (draw(st.sampled_from(sorted(UNARY))), draw(st.integers(0, available - 1)))
            )
        else:
            operands = [draw(st.integers(0, available - 1)) for _ in range(2)]
            steps.append((draw(st.sampled_from(sorted(BINARY))), *operands))
    return shapes, steps, draw(st.integers(0, 2**32 - 1))


def run_program(steps, inputs):
    values = list(inputs)
    for name, *operands in steps:
        function = UNARY.get(name) or BINARY[name]
        values.append(function(*(values[index] for index in operands)))
    return values[-1]


@settings(max_examples=25, deadline=None, database=None)
@given(programs())
def test_random_elementwise_graphs_match_finite_differences(program):
    shapes, steps, seed = program
    rng = np.random.default_rng(seed)
    arrays = [rng.uniform(-2, 2, shape).astype(np.float32) for shape in shapes]
    with fl.backend("reference"):  # Hypothesis reuses the test's context across examples
        positions = list(range(len(arrays)))
        check_against_finite_differences(
            lambda *inputs: run_program(steps, inputs), arrays, positions, rng, rtol=1e-5,
            atol=1e-6,
        )  # fmt: skip


# --- isolation: graphs and threads ---------------------------------------------------------------


def test_two_graphs_do_not_see_each_other():
    x, y = leaf([1.0, 2.0]), leaf([3.0, 4.0])
    loss_x, loss_y = cube_loss(x), fl.sum(y * 2.0)
    loss_y.backward()
    assert x.grad is None
    loss_x.backward()
    np.testing.assert_allclose(y.grad.numpy(), [2.0, 2.0])
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 12.0])


def test_two_threads_compute_independent_gradients():
    """Both threads build and differentiate at once; one enters no_grad between steps."""
    barrier = threading.Barrier(2)
    errors = []

    def worker(power, quiet):
        try:
            with fl.backend("reference"):
                barrier.wait()
                for step in range(15):
                    x = leaf([1.0 + step, 2.0])
                    if quiet:
                        with fl.no_grad():
                            assert not (x * 2.0).requires_grad
                    fl.sum(x**power).backward()
                    expected = power * np.array([1.0 + step, 2.0]) ** (power - 1)
                    np.testing.assert_allclose(x.grad.numpy(), expected, rtol=1e-6)
        except Exception as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=worker, args=args) for args in ((2.0, False), (3.0, True))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors


# --- bad input: clear errors, and the graph stays usable ---------------------------------------


def test_backward_of_a_non_scalar_needs_grad():
    x = leaf(np.ones((2, 3)))
    y = x * x
    with pytest.raises(fl.GradError, match=r"shape \[2, 3\] needs grad="):
        y.backward()
    y.backward(grad=fl.tensor(np.full((2, 3), 0.5, np.float32)))
    np.testing.assert_allclose(x.grad.numpy(), np.ones((2, 3)))


def test_gradient_of_an_unused_input():
    x, unused = fl.tensor(np.float32([1.0, 2.0])), fl.tensor(np.float32([5.0, 6.0, 7.0]))
    with pytest.raises(fl.GradError, match=r"float32\[3\] input does not influence"):
        fl.grad(lambda a, b: cube_loss(a), argnums=(0, 1))(x, unused)
    grad_x, grad_unused = fl.grad(lambda a, b: cube_loss(a), argnums=(0, 1), allow_unused=True)(
        x, unused
    )
    np.testing.assert_array_equal(grad_unused.numpy(), np.zeros(3, np.float32))
    np.testing.assert_allclose(grad_x.numpy(), [3.0, 12.0])


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.bool_])
def test_requires_grad_on_integer_or_bool_raises(dtype):
    values = fl.tensor(np.array([1, 0, 1], dtype=dtype))
    with pytest.raises(fl.GradError, match=f"only float tensors.*got {np.dtype(dtype).name}"):
        values.requires_grad_()
    x = leaf([1.0, 2.0, 3.0])  # the same graph, used correctly afterwards
    fl.sum(x * values.float()).backward()
    np.testing.assert_allclose(x.grad.numpy(), np.array([1, 0, 1], np.float32))


def test_grad_with_respect_to_an_integer_raises():
    x, counts = fl.tensor(np.float32([1.0, 2.0])), fl.tensor(np.array([1, 2]))
    with pytest.raises(fl.GradError, match="int64"):
        fl.grad(lambda a, b: fl.sum(a * b.float()), argnums=1)(x, counts)


def test_backward_seeds_on_the_loss_backend():
    x = leaf([1.0, 2.0])
    loss = cube_loss(x)
    with fl.backend("cuda"):
        loss.backward()
    np.testing.assert_allclose(x.grad.numpy(), [3.0, 12.0])


# --- gpu tier: composites on the CUDA backend vs PyTorch autograd ------------------------------


def _check_gpu_against_torch(flame_loss, torch_loss, arrays, positions, rtol=1e-4, atol=1e-5):
    """``flame_loss(*tensors)`` on the GPU, forward and gradients realized in one schedule,
    against ``torch_loss(torch, *tensors)`` by PyTorch autograd (on CUDA when this PyTorch
    has it); the inputs at ``positions`` are differentiated."""
    torch = pytest.importorskip("torch")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with fl.backend("cuda"):
        tensors = [fl.from_numpy(array) for array in arrays]
        leaves = [tensors[position].requires_grad_() for position in positions]
        loss = flame_loss(*tensors)
        loss.backward()
        fl.realize(loss, *(tensor.grad for tensor in leaves))
    expected = [torch.from_numpy(array).to(device) for array in arrays]
    differentiated = [expected[position].requires_grad_() for position in positions]
    expected_loss = torch_loss(torch, *expected)
    expected_grads = torch.autograd.grad(expected_loss, differentiated)
    np.testing.assert_allclose(loss.numpy(), expected_loss.item(), rtol=rtol, atol=atol)
    for tensor, grad in zip(leaves, expected_grads, strict=True):
        np.testing.assert_allclose(tensor.grad.numpy(), grad.cpu().numpy(), rtol=rtol, atol=atol)


def _projected(rng, shape):
    """A random projection, so that every output element gets its own cotangent."""
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.gpu
def test_gpu_layer_norm_gradients_match_torch(rng):
    arrays = [_projected(rng, shape) for shape in ((64, 256), (256,), (256,), (64, 256))]
    _check_gpu_against_torch(
        lambda x, w, b, v: fl.sum(fl.nn.functional.layer_norm(x, (256,), w, b) * v),
        lambda torch, x, w, b, v: (torch.nn.functional.layer_norm(x, (256,), w, b) * v).sum(),
        arrays, [0, 1, 2], rtol=1e-4, atol=1e-4,
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_softmax_gradients_match_torch(rng):
    arrays = [_projected(rng, (32, 1000)), _projected(rng, (32, 1000))]
    _check_gpu_against_torch(
        lambda x, v: fl.sum(fl.nn.functional.softmax(x, -1) * v),
        lambda torch, x, v: (x.softmax(-1) * v).sum(),
        arrays, [0],
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_cross_entropy_gradients_match_torch(rng):
    logits = _projected(rng, (128, 1000)) * 3
    target = rng.integers(0, 1000, 128).astype(np.int64)
    _check_gpu_against_torch(
        lambda x, t: fl.nn.functional.cross_entropy(x, t, label_smoothing=0.1),
        lambda torch, x, t: torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1),
        [logits, target], [0], rtol=1e-4, atol=1e-6,
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_matmul_gradients_match_torch(rng):
    arrays = [_projected(rng, shape) for shape in ((2, 64, 96), (96, 80), (2, 64, 80))]
    _check_gpu_against_torch(
        lambda a, b, v: fl.sum(fl.tanh(a @ b) * v),
        lambda torch, a, b, v: ((a @ b).tanh() * v).sum(),
        arrays, [0, 1], rtol=1e-4, atol=1e-4,
    )  # fmt: skip


@pytest.mark.gpu
def test_gpu_hooks_and_checkpoint(rng):
    """A hook and a checkpoint on the GPU give the gradients the reference backend gives."""
    array = rng.standard_normal((256, 300)).astype(np.float32)
    results = {}
    for backend in ("cuda", "reference"):
        with fl.backend(backend):
            x = fl.from_numpy(array).requires_grad_()
            hidden = fl.checkpoint(lambda t: fl.tanh(t * 1.5).exp(), x)
            hidden.register_hook(lambda grad: fl.clamp(grad * 2.0, -3.0, 3.0))
            loss = fl.sum(hidden * x)
            loss.backward()
            fl.realize(loss, x.grad)
            results[backend] = (loss.numpy(), x.grad.numpy())
    np.testing.assert_allclose(results["cuda"][0], results["reference"][0], rtol=1e-5)
    np.testing.assert_allclose(results["cuda"][1], results["reference"][1], rtol=1e-5, atol=1e-5)


def test_gradient_errors_name_the_users_line(reference_backend):
    x, y = fl.tensor(np.float32([1.0, 2.0])), fl.tensor(np.float32([3.0, 4.0]))
    with pytest.raises(fl.GradError, match=r"does not influence.*\[at test_autograd\.py:\d+\]"):
        fl.grad(lambda a, b: fl.sum(a * 2.0), argnums=1)(x, y)
    leaf = fl.tensor(np.float32([1.0, 2.0])).requires_grad_()
    leaf.register_hook(lambda g: fl.sum(g))
    with pytest.raises(fl.GradError, match=r"hook.*\[at test_autograd\.py:\d+\]"):
        fl.sum(leaf * 2.0).backward()
