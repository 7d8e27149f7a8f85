"""Layer modules (issue 19): Linear, Bilinear, Identity, Conv1d/2d, ConvTranspose1d/2d,
LayerNorm, GroupNorm, RMSNorm, BatchNorm1d/2d and Embedding against PyTorch's.

One table of layer configurations drives the properties: ``state_dict`` keys, shapes and
dtypes and ``repr`` equal PyTorch's; forward values and every gradient (input and
parameters) equal PyTorch's once PyTorch's weights are loaded through a safetensors file;
default initialisation follows PyTorch's distributions; BatchNorm's running statistics
follow PyTorch's through training steps; the GPU gives the reference backend's numbers.

Tests that compare with PyTorch import it themselves; the rest run without it."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import flame as fl
from flame.nn.modules.batchnorm import BatchNorm1d, BatchNorm2d
from flame.nn.modules.conv import Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d
from flame.nn.modules.linear import Bilinear, Identity, Linear
from flame.nn.modules.normalization import GroupNorm, LayerNorm, RMSNorm
from flame.nn.modules.sparse import Embedding

LAYERS = {
    layer.__name__: layer
    for layer in (
        BatchNorm1d, BatchNorm2d, Bilinear, Conv1d, Conv2d, ConvTranspose1d, ConvTranspose2d,
        Embedding, GroupNorm, Identity, LayerNorm, Linear, RMSNorm,
    )
}  # fmt: skip


class Case:
    """One layer configuration: ``name(*args, **kwargs)`` called on inputs of ``shapes``
    (``indices``: int64 indices below ``indices`` instead of floats), with ``forward``'s
    keyword arguments."""

    def __init__(self, id, name, args, kwargs, shapes, indices=None, forward=None):  # noqa: A002
        self.id, self.name, self.args, self.kwargs = id, name, args, kwargs
        self.shapes, self.indices, self.forward = shapes, indices, forward or {}

    def make(self, library):
        layer = getattr(library.nn, self.name) if library is not None else LAYERS[self.name]
        return layer(*self.args, **self.kwargs)

    def inputs(self, rng) -> list[np.ndarray]:
        if self.indices is not None:
            return [rng.integers(0, self.indices, shape).astype(np.int64) for shape in self.shapes]
        return [rng.standard_normal(shape).astype(np.float32) for shape in self.shapes]


CASES = [
    Case("Identity", "Identity", (3,), {"unused": 1}, [(2, 3)]),
    Case("Linear", "Linear", (4, 3), {}, [(2, 4)]),
    Case("Linear-nobias-3d", "Linear", (4, 3), {"bias": False}, [(2, 5, 4)]),
    Case("Bilinear", "Bilinear", (3, 4, 2), {}, [(5, 3), (5, 4)]),
    Case("Bilinear-nobias", "Bilinear", (2, 3, 4), {"bias": False}, [(2, 2), (2, 3)]),
    Case("Conv1d", "Conv1d", (2, 4, 3), {}, [(2, 2, 7)]),
    Case("Conv1d-circular", "Conv1d", (4, 4, 3),
         {"stride": 2, "padding": 1, "groups": 2, "padding_mode": "circular"}, [(2, 4, 8)]),
    Case("Conv1d-same-dilated", "Conv1d", (2, 3, 2),
         {"padding": "same", "dilation": 2, "bias": False}, [(2, 2, 6)]),
    Case("Conv1d-unbatched", "Conv1d", (2, 3, 3), {"padding": 2}, [(2, 5)]),
    Case("Conv2d", "Conv2d", (3, 4, 3), {"padding": 1}, [(2, 3, 6, 6)]),
    Case("Conv2d-strided-grouped", "Conv2d", (4, 6, (3, 2)),
         {"stride": (2, 1), "padding": (1, 0), "dilation": (1, 2), "groups": 2}, [(2, 4, 7, 6)]),
    Case("Conv2d-reflect", "Conv2d", (3, 2, 3), {"padding": 1, "padding_mode": "reflect"},
         [(2, 3, 5, 5)]),
    Case("Conv2d-replicate", "Conv2d", (3, 2, 3), {"padding": (2, 1),
         "padding_mode": "replicate"}, [(1, 3, 4, 5)]),
    Case("Conv2d-circular-same", "Conv2d", (2, 2, (2, 3)),
         {"padding": "same", "padding_mode": "circular"}, [(1, 2, 4, 5)]),
    Case("Conv2d-same-even", "Conv2d", (2, 3, 2), {"padding": "same", "bias": False},
         [(2, 2, 5, 4)]),
    Case("Conv2d-valid-unbatched", "Conv2d", (3, 2, 3), {"padding": "valid"}, [(3, 5, 5)]),
    Case("ConvTranspose1d", "ConvTranspose1d", (2, 3, 3),
         {"stride": 2, "padding": 1, "output_padding": 1}, [(2, 2, 5)]),
    Case("ConvTranspose2d", "ConvTranspose2d", (4, 6, 3),
         {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2}, [(2, 4, 3, 4)]),
    Case("ConvTranspose2d-dilated-nobias", "ConvTranspose2d", (3, 2, (2, 3)),
         {"dilation": (2, 1), "bias": False}, [(2, 3, 3, 3)]),
    Case("ConvTranspose2d-output_size", "ConvTranspose2d", (2, 3, 3), {"stride": 2},
         [(1, 2, 3, 3)], forward={"output_size": [8, 7]}),
    Case("LayerNorm", "LayerNorm", (5,), {}, [(2, 3, 5)]),
    Case("LayerNorm-2d-nobias", "LayerNorm", ((3, 5),), {"bias": False, "eps": 1e-3},
         [(2, 3, 5)]),
    Case("LayerNorm-noaffine", "LayerNorm", (4,), {"elementwise_affine": False}, [(3, 4)]),
    Case("GroupNorm", "GroupNorm", (2, 4), {}, [(2, 4, 3, 3)]),
    Case("GroupNorm-noaffine", "GroupNorm", (1, 3), {"affine": False}, [(2, 3, 5)]),
    Case("GroupNorm-nobias", "GroupNorm", (3, 6), {"bias": False, "eps": 1e-3}, [(2, 6, 2)]),
    Case("RMSNorm", "RMSNorm", (6,), {}, [(2, 6)]),
    Case("RMSNorm-2d-eps", "RMSNorm", ((2, 6),), {"eps": 1e-3}, [(3, 2, 6)]),
    Case("RMSNorm-noaffine", "RMSNorm", (4,), {"elementwise_affine": False}, [(3, 4)]),
    Case("Embedding", "Embedding", (10, 4), {}, [(2, 3)], indices=10),
    Case("Embedding-padding_idx", "Embedding", (6, 3), {"padding_idx": 2}, [(4, 5)], indices=6),
    Case("BatchNorm1d", "BatchNorm1d", (4,), {}, [(6, 4)]),
    Case("BatchNorm1d-3d-noaffine", "BatchNorm1d", (3,), {"affine": False, "momentum": None},
         [(4, 3, 5)]),
    Case("BatchNorm2d", "BatchNorm2d", (3,), {"eps": 1e-3}, [(4, 3, 2, 2)]),
    Case("BatchNorm2d-untracked", "BatchNorm2d", (2,), {"track_running_stats": False},
         [(2, 2, 3, 3)]),
]  # fmt: skip


def case_id(case: Case) -> str:
    return case.id


# --- helpers --------------------------------------------------------------------------------------


def randomized(torch, module, seed: int = 0):
    """PyTorch's module with every floating parameter redrawn (norms would otherwise hold
    ones and zeros, and their gradients would be checked at a trivial point)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5 + 0.2)
    return module


def through_safetensors(torch_module, path) -> dict:
    """PyTorch's ``state_dict``, written by safetensors.torch and read back for FLAME."""
    from safetensors.torch import save_file

    save_file(torch_module.state_dict(), str(path))
    try:
        from flame.io import load_file
    except ImportError:
        from safetensors.numpy import load_file as load_numpy

        return {key: fl.tensor(value) for key, value in load_numpy(str(path)).items()}
    return load_file(str(path), device="cpu")


def assert_close(got, expected, what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(expected), rtol=rtol, atol=atol, err_msg=what
    )


def run_flame(module, arrays, forward: dict, cotangent):
    """Forward ``module`` on ``arrays``, backward ``sum(output * cotangent)`` (an array, or
    a function of the output's shape that gives one): the output, the input gradients
    (None for integer inputs) and ``{name: parameter gradient}``."""
    inputs = [fl.tensor(array) for array in arrays]
    for tensor in inputs:
        if tensor.dtype.is_float:
            tensor.requires_grad_()
    output = module(*inputs, **forward)
    if callable(cotangent):
        cotangent = cotangent(output.shape)
    (output * fl.tensor(cotangent)).sum().backward()
    input_grads = [None if t.grad is None else t.grad.numpy() for t in inputs]
    grads = {name: p.grad.numpy() for name, p in module.named_parameters() if p.grad is not None}
    return output.numpy(), input_grads, grads


def run_torch(torch, module, arrays, forward: dict, rng):
    """As ``run_flame`` for PyTorch's module, with a cotangent drawn from ``rng`` (returned
    last)."""
    inputs = [torch.from_numpy(array) for array in arrays]
    for tensor in inputs:
        if tensor.is_floating_point():
            tensor.requires_grad_()
    output = module(*inputs, **forward)
    cotangent = rng.standard_normal(tuple(output.shape)).astype(np.float32)
    (output * torch.from_numpy(cotangent)).sum().backward()
    input_grads = [None if t.grad is None else t.grad.numpy() for t in inputs]
    grads = {n: p.grad.numpy() for n, p in module.named_parameters() if p.grad is not None}
    return output.detach().numpy(), input_grads, grads, cotangent


# --- state_dict and repr --------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_state_dict_and_repr_match_pytorch(case, reference_backend):
    torch = pytest.importorskip("torch")
    expected = case.make(torch)
    module = case.make(None)
    assert repr(module) == repr(expected)
    ours = module.state_dict()
    theirs = expected.state_dict()
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        assert tuple(ours[key].shape) == tuple(value.shape), key
        assert ours[key].dtype.name == str(value.dtype).removeprefix("torch."), key
    assert [name for name, _ in module.named_parameters()] == [
        name for name, _ in expected.named_parameters()
    ]
    for name, param in module.named_parameters():
        assert param.requires_grad == expected.get_parameter(name).requires_grad, name


# --- forward and gradients against PyTorch --------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_and_gradients_match_pytorch(case, reference_backend, rng, tmp_path):
    torch = pytest.importorskip("torch")
    expected = randomized(torch, case.make(torch))
    module = case.make(None)
    module.load_state_dict(through_safetensors(expected, tmp_path / "weights.safetensors"))
    arrays = case.inputs(rng)
    want_output, want_inputs, want_grads, cotangent = run_torch(
        torch, expected, arrays, case.forward, rng
    )
    output, input_grads, grads = run_flame(module, arrays, case.forward, cotangent)
    assert_close(output, want_output, "output")
    for index, (got, want) in enumerate(zip(input_grads, want_inputs)):
        if want is None:
            assert got is None
        else:
            assert_close(got, want, f"gradient of input {index}")
    assert sorted(grads) == sorted(want_grads)
    for name, want in want_grads.items():
        assert_close(grads[name], want, f"gradient of {name}")


# --- default initialisation -----------------------------------------------------------------------

INIT_CASES = [  # (layer, weight bound (U(-b, b) weight), fan_in of the bias bound)
    ("Linear", lambda: Linear(9, 30000), 1 / 3, 9),
    ("Conv2d", lambda: Conv2d(16, 64, 5), 1 / 20, 400),
    ("Conv1d-grouped", lambda: Conv1d(40, 256, 3, groups=4), 1 / math.sqrt(30), 30),
    # a transposed weight is [in, out/groups, k...]: PyTorch's fan_in is out/groups * k
    ("ConvTranspose2d", lambda: ConvTranspose2d(64, 32, 3), 1 / math.sqrt(288), 288),
    ("ConvTranspose1d-grouped", lambda: ConvTranspose1d(32, 64, 4, groups=2), 128**-0.5, 128),
    ("Bilinear", lambda: Bilinear(20, 30, 200), 1 / math.sqrt(20), 20),
]  # fmt: skip


def check_uniform(values: np.ndarray, bound: float, what: str) -> None:
    """U(-bound, bound): inside the bound, reaching near it, mean 0, std bound / sqrt(3)."""
    values = values.astype(np.float64).ravel()
    assert np.abs(values).max() <= bound * (1 + 1e-6), what
    assert np.abs(values).max() >= bound * (1 - 20 / values.size), what
    assert abs(values.mean()) < 4 * bound / math.sqrt(3 * values.size), what
    assert values.std() == pytest.approx(bound / math.sqrt(3), rel=0.03), what


@pytest.mark.parametrize(
    "name, make, weight_bound, fan_in", INIT_CASES, ids=[c[0] for c in INIT_CASES]
)
def test_default_init_follows_pytorch_distributions(
    name, make, weight_bound, fan_in, reference_backend
):
    fl.manual_seed(0)
    layer = make()
    check_uniform(layer.weight.numpy(), weight_bound, "weight")
    bias = layer.bias.numpy()
    bound = 1 / math.sqrt(fan_in)
    assert np.abs(bias).max() <= bound * (1 + 1e-6)
    assert np.abs(bias).max() > bound * 0.9
    assert len(np.unique(bias)) > bias.size // 2
    if bias.size >= 10000:
        check_uniform(bias, bound, "bias")


def test_embedding_init_is_standard_normal_with_the_padding_row_zeroed(reference_backend):
    fl.manual_seed(0)
    values = Embedding(2000, 64, padding_idx=-3).weight.numpy().astype(np.float64)
    np.testing.assert_array_equal(values[1997], 0.0)
    rest = np.delete(values, 1997, axis=0)
    assert abs(rest.mean()) < 0.01
    assert rest.std() == pytest.approx(1.0, rel=0.01)
    assert abs(((rest - rest.mean()) ** 3).mean()) < 0.03  # symmetric
    assert ((rest - rest.mean()) ** 4).mean() == pytest.approx(3.0, rel=0.03)  # normal kurtosis


@pytest.mark.parametrize(
    "make",
    [lambda: LayerNorm((3, 4)), lambda: GroupNorm(2, 6), lambda: RMSNorm(5),
     lambda: BatchNorm1d(4), lambda: BatchNorm2d(3, affine=True)],
    ids=["LayerNorm", "GroupNorm", "RMSNorm", "BatchNorm1d", "BatchNorm2d"],
)  # fmt: skip
def test_norms_start_with_ones_and_zeros(make, reference_backend):
    layer = make()
    np.testing.assert_array_equal(layer.weight.numpy(), 1.0)
    if getattr(layer, "bias", None) is not None:
        np.testing.assert_array_equal(layer.bias.numpy(), 0.0)
    if getattr(layer, "running_mean", None) is not None:
        np.testing.assert_array_equal(layer.running_mean.numpy(), 0.0)
        np.testing.assert_array_equal(layer.running_var.numpy(), 1.0)
        assert layer.num_batches_tracked.numpy() == 0


def test_seed_makes_initial_weights_reproducible(reference_backend):
    def weights(seed):
        fl.manual_seed(seed)
        layers = [Linear(6, 5), Conv2d(2, 3, 3), Embedding(7, 3), Bilinear(2, 3, 4)]
        return [p.numpy() for layer in layers for p in layer.parameters()]

    first, again, other = weights(0), weights(0), weights(1)
    for a, b, c in zip(first, again, other):
        np.testing.assert_array_equal(a, b)
        assert not np.array_equal(a, c)


def test_reset_parameters_redraws(reference_backend):
    fl.manual_seed(0)
    layer = Conv1d(3, 4, 2)
    before = layer.weight.numpy().copy()
    weight = layer.weight
    layer.reset_parameters()
    assert layer.weight is weight and weight.requires_grad
    assert not np.array_equal(before, layer.weight.numpy())


# --- BatchNorm: training steps, eval --------------------------------------------------------------

BATCHNORM_CASES = [
    ("1d-momentum", lambda lib: lib.BatchNorm1d(3), (5, 3)),
    ("1d-3d-cumulative", lambda lib: lib.BatchNorm1d(3, momentum=None, affine=False), (4, 3, 6)),
    ("2d-momentum", lambda lib: lib.BatchNorm2d(2, momentum=0.5, eps=1e-3), (3, 2, 4, 3)),
    ("2d-cumulative-nobias", lambda lib: lib.BatchNorm2d(4, momentum=None, bias=False),
     (2, 4, 3, 3)),
    ("2d-untracked", lambda lib: lib.BatchNorm2d(2, track_running_stats=False), (3, 2, 2, 2)),
]  # fmt: skip


class _Layers:
    """``LAYERS`` as an attribute namespace, so one factory builds either library's layer."""

    def __getattr__(self, name):
        return LAYERS[name]


@pytest.mark.parametrize(
    "make, shape", [case[1:] for case in BATCHNORM_CASES], ids=[case[0] for case in BATCHNORM_CASES]
)
def test_batchnorm_training_steps_and_eval_match_pytorch(
    make, shape, reference_backend, rng, tmp_path
):
    torch = pytest.importorskip("torch")
    expected = randomized(torch, make(torch.nn))
    module = make(_Layers())
    module.load_state_dict(through_safetensors(expected, tmp_path / "bn.safetensors"))
    for step in range(3):
        arrays = [rng.standard_normal(shape).astype(np.float32) * (step + 1) + step]
        want = run_torch(torch, expected, arrays, {}, rng)
        got = run_flame(module, arrays, {}, want[3])
        assert_close(got[0], want[0], f"training output, step {step}")
        assert_close(got[1][0], want[1][0], f"training input gradient, step {step}")
        for key, value in expected.state_dict().items():
            assert_close(module.state_dict()[key].numpy(), value.numpy(), f"{key}, step {step}")
        expected.zero_grad()
        module.zero_grad()
    expected.eval()
    module.eval()
    arrays = [rng.standard_normal(shape).astype(np.float32) * 3 - 1]
    want = run_torch(torch, expected, arrays, {}, rng)
    got = run_flame(module, arrays, {}, want[3])
    assert_close(got[0], want[0], "eval output")
    assert_close(got[1][0], want[1][0], "eval input gradient")
    for key in want[2]:
        assert_close(got[2][key], want[2][key], f"eval gradient of {key}")
    for key, value in expected.state_dict().items():  # eval leaves the statistics alone
        assert_close(module.state_dict()[key].numpy(), value.numpy(), f"{key} after eval")


def test_batchnorm_eval_normalises_with_the_running_statistics(reference_backend, rng):
    layer = BatchNorm1d(2, affine=False).eval()
    layer.running_mean.copy_(fl.tensor(np.array([1.0, -2.0], np.float32)))
    layer.running_var.copy_(fl.tensor(np.array([4.0, 0.25], np.float32)))
    x = rng.standard_normal((5, 2)).astype(np.float32)
    expected = (x - [1.0, -2.0]) / np.sqrt(np.array([4.0, 0.25]) + 1e-5)
    assert_close(layer(fl.tensor(x)).numpy(), expected, "eval output")
    assert layer.num_batches_tracked.numpy() == 0
    layer.train()
    layer(fl.tensor(x))
    assert layer.num_batches_tracked.numpy() == 1
    assert not np.allclose(layer.running_mean.numpy(), [1.0, -2.0])


@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_compiled_training_steps_match_lazy_steps(momentum, reference_backend, rng):
    """Running statistics and num_batches_tracked are written by the compiled program (the
    cumulative average's factor is a tensor, so the trace reads no values)."""
    from flame.nn.modules.container import Sequential

    batches = [fl.tensor(rng.standard_normal((3, 2, 4, 4)).astype(np.float32)) for _ in range(3)]
    results = []
    for compiled in (False, True):
        fl.manual_seed(0)
        model = Sequential(
            Conv2d(2, 4, 3, padding=1), BatchNorm2d(4, momentum=momentum), GroupNorm(2, 4)
        )

        def step(x, model=model):
            loss = (model(x) ** 2).mean()
            loss.backward()
            return loss

        run = fl.compile(step) if compiled else step
        losses = [run(x).item() for x in batches]
        state = {key: value.numpy().copy() for key, value in model.state_dict().items()}
        results.append((losses, state, [param.grad.numpy() for param in model.parameters()]))
    (lazy_losses, lazy_state, lazy_grads), (losses, state, grads) = results
    np.testing.assert_allclose(losses, lazy_losses, rtol=1e-6)
    assert state["1.num_batches_tracked"] == 3
    for key, value in lazy_state.items():
        assert_close(state[key], value, key, rtol=1e-6, atol=1e-7)
    for got, want in zip(grads, lazy_grads):
        assert_close(got, want, "accumulated gradient", rtol=1e-6, atol=1e-7)


# --- construction: PyTorch's checks, dtype and device ---------------------------------------------

BAD_CONFIGS = [
    ("Conv2d", (4, 6, 3), {"groups": 4}),
    ("Conv2d", (3, 6, 3), {"groups": 2}),
    ("Conv1d", (4, 4, 3), {"groups": 0}),
    ("Conv2d", (3, 3, 3), {"stride": 2, "padding": "same"}),
    ("Conv1d", (3, 3, 3), {"padding": "full"}),
    ("Conv2d", (3, 3, 3), {"padding_mode": "mirror"}),
    ("ConvTranspose2d", (3, 3, 3), {"padding_mode": "reflect"}),
    ("ConvTranspose1d", (4, 3, 3), {"groups": 2}),
    ("GroupNorm", (3, 4), {}),
    ("Embedding", (5, 2), {"padding_idx": 5}),
    ("Embedding", (5, 2), {"padding_idx": -6}),
    ("Bilinear", (0, 2, 3), {}),
]  # fmt: skip


@pytest.mark.parametrize("name, args, kwargs", BAD_CONFIGS, ids=lambda v: str(v))
def test_constructor_errors_match_pytorch(name, args, kwargs, reference_backend):
    torch = pytest.importorskip("torch")
    with pytest.raises(Exception) as theirs:
        getattr(torch.nn, name)(*args, **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        LAYERS[name](*args, **kwargs)
    assert sets_sorted(str(ours.value)) == sets_sorted(str(theirs.value))


def sets_sorted(message: str) -> str:
    """A message with each printed set's items sorted (a set of strings prints in an order
    that changes between processes)."""

    def sort(match):
        return "{" + ", ".join(sorted(match.group(1).split(", "))) + "}"

    return re.sub(r"\{([^{}]*)\}", sort, message)


@pytest.mark.parametrize(
    "layer, shape, message",
    [(BatchNorm2d, (2, 3, 4), "expected 4D input (got 3D input)"),
     (BatchNorm1d, (2, 3, 4, 4), "expected 2D or 3D input (got 4D input)")],
    ids=["BatchNorm2d", "BatchNorm1d"],
)  # fmt: skip
def test_batchnorm_refuses_the_wrong_rank(layer, shape, message, reference_backend):
    with pytest.raises(ValueError, match=re.escape(message)):
        layer(3)(fl.zeros(shape))


def test_unsupported_options_are_refused_clearly(reference_backend):
    with pytest.raises(NotImplementedError, match="sparse"):
        Embedding(5, 2, sparse=True)
    with pytest.raises(ValueError, match="padding must be an int or a tuple"):
        ConvTranspose2d(2, 2, 3, padding="same")


def test_transposed_output_size_out_of_range_is_refused(reference_backend):
    layer = ConvTranspose2d(2, 3, 3, stride=2)
    x = fl.zeros(1, 2, 3, 3)
    assert layer(x, output_size=[8, 8]).shape == (1, 3, 8, 8)
    assert layer(x, output_size=(1, 3, 7, 8)).shape == (1, 3, 7, 8)
    with pytest.raises(ValueError, match="valid sizes range from \\[7, 7\\] to \\[8, 8\\]"):
        layer(x, output_size=[9, 7])
    with pytest.raises(ValueError, match="output_size must have 2 or 4 elements"):
        layer(x, output_size=[8])


@pytest.mark.parametrize("dtype", [fl.float64, fl.float16, fl.bfloat16], ids=lambda d: d.name)
def test_dtype_makes_parameters_and_float_buffers_in_that_dtype(dtype, reference_backend):
    layers = [
        Linear(3, 2, dtype=dtype), Bilinear(2, 2, 3, dtype=dtype), Conv1d(2, 2, 3, dtype=dtype),
        Conv2d(2, 2, 3, dtype=dtype), ConvTranspose2d(2, 2, 3, dtype=dtype),
        LayerNorm(3, dtype=dtype), GroupNorm(1, 2, dtype=dtype), RMSNorm(3, dtype=dtype),
        Embedding(4, 2, dtype=dtype), BatchNorm2d(2, dtype=dtype),
    ]  # fmt: skip
    for layer in layers:
        for key, value in layer.state_dict().items():
            want = fl.int64 if key == "num_batches_tracked" else dtype
            assert value.dtype is want, f"{layer!r} {key}"
    x = fl.randn(2, 3).to(fl.float64)
    assert Linear(3, 2, dtype="float64")(x).dtype is fl.float64


def test_device_cpu_is_the_reference_backend():
    with fl.backend("cuda"):  # building on the reference backend needs no GPU
        layers = [Linear(3, 2, device="cpu"), Conv2d(2, 2, 3, device=fl.device("cpu")),
                  BatchNorm1d(2, device="cpu"), Embedding(3, 2, device="cpu"),
                  LayerNorm(2, device="cpu")]  # fmt: skip
    for layer in layers:
        for key, value in layer.state_dict().items():
            assert value.backend == "reference", f"{layer!r} {key}"
            assert value.device == fl.device("cpu")


# --- Embedding ------------------------------------------------------------------------------------


def test_embedding_from_pretrained_shares_and_freezes(reference_backend):
    values = np.arange(12, dtype=np.float32).reshape(4, 3)
    frozen = Embedding.from_pretrained(fl.tensor(values))
    assert not frozen.weight.requires_grad
    assert repr(frozen) == "Embedding(4, 3)"
    indices = fl.tensor(np.array([[3, 0], [1, 1]], dtype=np.int64))
    np.testing.assert_array_equal(frozen(indices).numpy(), values[[[3, 0], [1, 1]]])
    trained = Embedding.from_pretrained(fl.tensor(values), freeze=False, padding_idx=1)
    assert trained.weight.requires_grad
    np.testing.assert_array_equal(trained.weight.numpy()[1], values[1])  # not zeroed
    trained(indices).sum().backward()
    np.testing.assert_array_equal(trained.weight.grad.numpy()[1], 0.0)
    np.testing.assert_array_equal(trained.weight.grad.numpy()[3], 1.0)
    with pytest.raises(AssertionError, match="2-dimensional"):
        Embedding.from_pretrained(fl.zeros(3))
    with pytest.raises(AssertionError, match="Shape of weight"):
        Embedding(3, 3, _weight=fl.zeros(4, 3))


def test_embedding_repr_matches_pytorch(reference_backend):
    torch = pytest.importorskip("torch")
    for kwargs in ({"padding_idx": 0}, {"norm_type": 1.0}, {"_freeze": True}):
        assert repr(Embedding(5, 2, **kwargs)) == repr(torch.nn.Embedding(5, 2, **kwargs))


def test_cpu_layers_train_under_another_current_backend(rng):
    x = rng.standard_normal((4, 2)).astype(np.float32)
    layer = BatchNorm1d(2, device="cpu")
    embedding = Embedding(5, 2, padding_idx=0, device="cpu")
    with fl.backend("reference"):
        inputs = fl.tensor(x)
    with fl.backend("cuda"):
        layer(inputs)
        layer.reset_parameters()
        embedding.reset_parameters()
    assert layer.num_batches_tracked.numpy() == 0
    np.testing.assert_array_equal(embedding.weight.numpy()[0], 0.0)


# --- the GPU against the reference backend --------------------------------------------------------

GPU_CASES = [
    case for case in CASES
    if case.id in (
        "Linear", "Bilinear", "Conv1d-circular", "Conv2d-strided-grouped", "Conv2d-reflect",
        "ConvTranspose1d", "ConvTranspose2d", "LayerNorm", "GroupNorm", "RMSNorm",
        "Embedding-padding_idx", "BatchNorm1d-3d-noaffine", "BatchNorm2d",
    )
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=case_id)
def test_gpu_matches_the_reference_backend(case, rng):
    arrays = case.inputs(rng)
    cotangents = {}

    def cotangent(shape):
        if shape not in cotangents:
            cotangents[shape] = rng.standard_normal(shape).astype(np.float32)
        return cotangents[shape]

    with fl.backend("reference"):
        fl.manual_seed(0)
        reference = case.make(None)
        # numpy() shares the memory (as PyTorch's): copy before the forward updates it
        state = {key: value.numpy().copy() for key, value in reference.state_dict().items()}
        want = run_flame(reference, arrays, case.forward, cotangent)
    with fl.backend("reference"):
        module = type(reference)(*case.args, **{**case.kwargs, "device": "cuda"})
    module.load_state_dict(state)
    assert all(value.backend == "cuda" for value in module.state_dict().values())
    with fl.backend("cuda"):
        got = run_flame(module, arrays, case.forward, cotangent)
    tolerance = {"rtol": 1e-4, "atol": 1e-4}
    assert_close(got[0], want[0], "output", **tolerance)
    for index, (ours, theirs) in enumerate(zip(got[1], want[1])):
        assert (ours is None) == (theirs is None)
        if theirs is not None:
            assert_close(ours, theirs, f"gradient of input {index}", **tolerance)
    assert sorted(got[2]) == sorted(want[2])
    for name, theirs in want[2].items():
        assert_close(got[2][name], theirs, f"gradient of {name}", **tolerance)
    for key, value in reference.state_dict().items():  # BatchNorm's running statistics
        assert_close(module.state_dict()[key].numpy(), value.numpy(), key, **tolerance)


@pytest.mark.gpu
def test_gpu_initial_weights_equal_the_reference_ones():
    """device="cuda" puts every parameter and buffer on the GPU, drawn from the same seed
    to the same numbers as on the reference backend."""

    def layers(device):
        fl.manual_seed(0)
        return [
            Linear(6, 5, device=device), Conv2d(2, 3, 3, device=device),
            Embedding(7, 3, padding_idx=1, device=device), BatchNorm1d(3, device=device),
        ]  # fmt: skip

    for gpu, cpu in zip(layers("cuda"), layers("cpu")):
        for key, value in cpu.state_dict().items():
            assert gpu.state_dict()[key].backend == "cuda", key
            got = gpu.state_dict()[key].numpy()  # the bounds multiply in another order: 1 ulp
            np.testing.assert_allclose(got, value.numpy(), rtol=1e-6, atol=1e-7, err_msg=key)
