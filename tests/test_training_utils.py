"""Training utilities: weight averaging (flame.optim.swa_utils), parameters as one vector
(flame.nn.utils) and LoRA adapters (flame.nn.lora), against PyTorch on the same weights.

CPU tier: the reference backend. gpu tier: the EMA's multi-tensor kernel and LoRA on the GPU
against the reference backend.
"""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn as nn
from flame.nn import lora, utils
from flame.nn.convolution import conv2d, linear
from flame.optim import swa_utils
from flame.runtime.storage import storage_of
from flame.tensor import Tensor

# --- small modules of our own (PyTorch's attribute names) ----------------------------------------


def _parameter(rng, *shape, scale=1.0):
    return nn.Parameter(fl.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)))


class Dense(nn.Module):
    def __init__(self, rng, in_features, out_features):
        super().__init__()
        self.weight = _parameter(rng, out_features, in_features, scale=0.5)
        self.bias = _parameter(rng, out_features)

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class Conv(nn.Module):
    def __init__(self, rng, in_channels, out_channels, kernel, stride=1, padding=0):
        super().__init__()
        self.weight = _parameter(rng, out_channels, in_channels, kernel, kernel, scale=0.3)
        self.bias = _parameter(rng, out_channels)
        self.stride, self.padding, self.dilation, self.groups = stride, padding, 1, 1

    def forward(self, x):
        return conv2d(x, self.weight, self.bias, self.stride, self.padding)


class Net(nn.Module):
    """Two dense layers and a float and an int buffer (as a batch norm's)."""

    def __init__(self, rng):
        super().__init__()
        self.q = Dense(rng, 4, 6)
        self.v = Dense(rng, 6, 3)
        self.register_buffer("running_mean", fl.zeros(3))
        self.register_buffer("num_batches_tracked", fl.tensor(0, dtype=fl.int64))

    def forward(self, x):
        return self.v(self.q(x).relu()) + self.running_mean


def torch_net(torch):
    class TorchNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Linear(4, 6)
            self.v = torch.nn.Linear(6, 3)
            self.register_buffer("running_mean", torch.zeros(3))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

        def forward(self, x):
            return self.v(self.q(x).relu()) + self.running_mean

    return TorchNet()


def tensors_of(module, with_buffers=True):
    named = dict(module.named_parameters())
    if with_buffers:
        named.update(module.named_buffers())
    return named


def set_both(step, rng, flame_model, torch_model):
    """Give both models the same new weights (the sequence an optimizer would produce)."""
    import torch

    theirs = tensors_of(torch_model)
    for name, mine in tensors_of(flame_model).items():
        if mine.dtype.is_float:
            value = rng.standard_normal(mine.shape).astype(np.float32)
        else:
            value = np.array(7 + 13 * step, dtype=np.int64)  # averages away from integers
        with fl.no_grad():
            mine.copy_(fl.from_numpy(value))
        with torch.no_grad():
            theirs[name].copy_(torch.from_numpy(value))


def assert_same_average(averaged, torch_averaged, rtol=1e-6):
    theirs = {k: v for k, v in torch_averaged.state_dict().items()}
    mine = averaged.state_dict()
    assert list(mine) == list(theirs)
    for key, value in mine.items():
        np.testing.assert_allclose(value.numpy(), theirs[key].numpy(), rtol=rtol, atol=1e-7,
                                   err_msg=key)  # fmt: skip


# --- swa_utils: AveragedModel against PyTorch's ------------------------------------------------


@pytest.mark.parametrize("use_buffers", [False, True])
def test_ema_matches_torch(reference_backend, use_buffers):
    torch = pytest.importorskip("torch")
    from torch.optim import swa_utils as torch_swa

    rng = np.random.default_rng(0)
    model, torch_model = Net(rng), torch_net(torch)
    set_both(0, rng, model, torch_model)
    ema = swa_utils.AveragedModel(
        model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=use_buffers
    )
    torch_ema = torch_swa.AveragedModel(
        torch_model, multi_avg_fn=torch_swa.get_ema_multi_avg_fn(0.9), use_buffers=use_buffers
    )
    for step in range(1, 6):
        set_both(step, rng, model, torch_model)
        ema.update_parameters(model)
        torch_ema.update_parameters(torch_model)
        assert_same_average(ema, torch_ema)
    assert ema.n_averaged.item() == 5
    x = rng.standard_normal((2, 4)).astype(np.float32)
    with torch.no_grad():
        expected = torch_ema(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(ema(fl.from_numpy(x)).numpy(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["swa", "ema_avg_fn", "swa_avg_fn"])
def test_other_averages_match_torch(reference_backend, kind):
    torch = pytest.importorskip("torch")
    from torch.optim import swa_utils as torch_swa

    def arguments(module):
        if kind == "ema_avg_fn":
            return {"avg_fn": module.get_ema_avg_fn(0.8)}
        if kind == "swa_avg_fn":
            return {"avg_fn": module.get_swa_avg_fn()}
        return {}

    rng = np.random.default_rng(1)
    model, torch_model = Net(rng), torch_net(torch)
    set_both(0, rng, model, torch_model)
    averaged = swa_utils.AveragedModel(model, **arguments(swa_utils))
    torch_averaged = torch_swa.AveragedModel(torch_model, **arguments(torch_swa))
    for step in range(1, 5):
        set_both(step, rng, model, torch_model)
        averaged.update_parameters(model)
        torch_averaged.update_parameters(torch_model)
        assert_same_average(averaged, torch_averaged, rtol=2e-6)


def test_averaged_model_is_a_copy(reference_backend):
    rng = np.random.default_rng(2)
    model = Net(rng)
    averaged = swa_utils.AveragedModel(model)
    for (name, mine), theirs in zip(
        tensors_of(averaged.module).items(), tensors_of(model).values()
    ):
        assert mine is not theirs
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy(), err_msg=name)
    assert averaged.module.q.weight.requires_grad
    with fl.no_grad():
        model.q.weight.mul_(2.0)
    assert not np.allclose(averaged.module.q.weight.numpy(), model.q.weight.numpy())
    assert list(averaged.state_dict())[0] == "n_averaged"
    assert averaged.n_averaged.dtype == fl.int64 and averaged.n_averaged.shape == ()


def test_ema_state_dict_round_trip(reference_backend):
    """A restored AveragedModel reads n_averaged once and averages (does not copy again)."""
    rng = np.random.default_rng(3)
    model = Net(rng)
    fn = swa_utils.get_ema_multi_avg_fn(0.5)
    ema = swa_utils.AveragedModel(model, multi_avg_fn=fn)
    ema.update_parameters(model)
    ema.update_parameters(model)
    restored = swa_utils.AveragedModel(Net(rng), multi_avg_fn=fn)
    restored.load_state_dict(ema.state_dict())
    assert restored.n_averaged.item() == 2
    before = restored.module.q.weight.numpy().copy()
    restored.update_parameters(model)
    expected = 0.5 * before + 0.5 * model.q.weight.numpy()
    np.testing.assert_allclose(restored.module.q.weight.numpy(), expected, rtol=1e-6)
    assert restored.n_averaged.item() == 3


def test_averaged_model_refuses_mismatched_models(reference_backend):
    rng = np.random.default_rng(4)
    averaged = swa_utils.AveragedModel(Net(rng))
    with pytest.raises(ValueError, match="tensors to average"):
        averaged.update_parameters(Dense(rng, 4, 6))
    with pytest.raises(AssertionError):
        swa_utils.AveragedModel(Net(rng), avg_fn=swa_utils.get_swa_avg_fn(),
                                multi_avg_fn=swa_utils.get_swa_multi_avg_fn())  # fmt: skip
    with pytest.raises(ValueError, match="decay"):
        swa_utils.get_ema_multi_avg_fn(1.5)


def test_ema_of_half_and_double_tensors(reference_backend):
    """float16 lerps in float32 and rounds once; float64 keeps float64 (as torch's lerp)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    fn = swa_utils.get_ema_multi_avg_fn(0.75)
    for np_dtype, torch_dtype in ((np.float16, torch.float16), (np.float64, torch.float64)):
        start = rng.standard_normal(300).astype(np_dtype)
        current = rng.standard_normal(300).astype(np_dtype)
        mine = fl.from_numpy(start.copy()).realize()
        fn([mine], [fl.from_numpy(current)], None)
        theirs = torch.from_numpy(start.copy())
        torch._foreach_lerp_([theirs], [torch.from_numpy(current)], 0.25)
        assert theirs.dtype == torch_dtype
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


# --- swa_utils: one multi-tensor kernel, no host read ------------------------------------------


class _Counting:
    def __init__(self, monkeypatch):
        import importlib

        # the module (flame.foreach the attribute is the function of that name)
        foreach_module = importlib.import_module("flame.foreach")
        self.calls = []
        original = foreach_module.foreach

        def counting(rule, *lists, **kwargs):
            self.calls.append((rule.__name__, len(lists[0])))
            return original(rule, *lists, **kwargs)

        monkeypatch.setattr(foreach_module, "foreach", counting)


def _refuse_host_reads(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("a host read of a device value during the update")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(Tensor, name, refuse)


class Many(nn.Module):
    def __init__(self, rng, count):
        super().__init__()
        self.layers = nn.ModuleList([Dense(rng, 3, 3) for _ in range(count)])


def test_ema_update_is_one_foreach_and_reads_nothing_back(reference_backend, monkeypatch):
    """Lazy mode: an EMA update of 60 tensors is one flame.foreach call (one multi-tensor
    kernel on the GPU) and reads no value back to the host."""
    rng = np.random.default_rng(6)
    model = Many(rng, 30)
    ema = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9))
    ema.update_parameters(model)  # the first: a copy (also one foreach)
    counting = _Counting(monkeypatch)
    _refuse_host_reads(monkeypatch)
    ema.update_parameters(model)
    ema.update_parameters(model)
    assert counting.calls == [("lerp_rule", 60), ("lerp_rule", 60)]
    monkeypatch.undo()
    assert ema.n_averaged.item() == 3


def test_ema_groups_by_dtype(reference_backend, monkeypatch):
    rng = np.random.default_rng(7)
    model = Net(rng)
    ema = swa_utils.AveragedModel(
        model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True
    )
    ema.update_parameters(model)
    counting = _Counting(monkeypatch)
    ema.update_parameters(model)
    assert sorted(counting.calls) == [("lerp_rule", 5), ("mix_rule", 1)]


AVERAGING_RULES = [
    (swa_utils.lerp_rule, fl.float32, fl.float32),
    (swa_utils.lerp_rule, fl.bfloat16, fl.float32),
    (swa_utils.lerp_rule, fl.float16, fl.float32),
    (swa_utils.lerp_rule, fl.float64, fl.float64),
    (swa_utils.mix_rule, fl.int64, fl.float32),
    (swa_utils.copy_rule, fl.int64, fl.float32),
    (swa_utils.copy_rule, fl.bool, fl.float32),
]


@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize(
    "rule,dtype,values_dtype", AVERAGING_RULES, ids=lambda v: getattr(v, "__name__", str(v))
)
def test_averaging_rules_are_one_multi_tensor_kernel(rule, dtype, values_dtype, wide, nvrtc):
    """Each rule fuses into one elementwise group that stores the list's own dtype, and its
    multi-tensor kernel compiles (no GPU needed)."""
    from flame.codegen.multi_tensor import lower_multi_tensor
    from flame.codegen.render import render
    from flame.foreach import _trace
    from flame.runtime.compiler import nvrtc_compile

    with fl.backend("cuda"):
        values = fl.zeros(4, dtype=values_dtype)
    traced = _trace(rule, (dtype, dtype), values, (0,))
    varying = {id(node) for node in traced.placeholders}
    low = lower_multi_tensor(traced.group, varying, not wide, wide)
    assert [output.dtype for output in low.lowered.outputs] == [dtype]
    assert len(nvrtc_compile(render(low.spec), low.spec.name, "sm_90")) > 0


# --- parameters_to_vector / vector_to_parameters -----------------------------------------------


def test_parameters_vector_round_trip(reference_backend):
    rng = np.random.default_rng(8)
    model = Net(rng)
    params = list(model.parameters())
    vector = utils.parameters_to_vector(params)
    expected = np.concatenate([p.numpy().reshape(-1) for p in params])
    assert vector.shape == (expected.size,)
    np.testing.assert_array_equal(vector.numpy(), expected)
    new = rng.standard_normal(expected.size).astype(np.float32)
    memory = [storage_of(p.node) for p in params]
    step = fl.compile(lambda x: model(x))
    x = fl.from_numpy(rng.standard_normal((2, 4)).astype(np.float32))
    step(x)
    utils.vector_to_parameters(fl.from_numpy(new), params)
    np.testing.assert_array_equal(utils.parameters_to_vector(params).numpy(), new)
    assert all(storage_of(p.node) is found for p, found in zip(params, memory))
    assert all(p.requires_grad for p in params)
    # written in place: a compiled function that closes over them sees the new values
    np.testing.assert_allclose(step(x).numpy(), model(x).numpy(), rtol=1e-6)
    assert step.cache_info().traces == 1


def test_parameters_vector_matches_torch(reference_backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in ((3, 4), (5,), (2, 1, 3))]
    mine = [nn.Parameter(fl.from_numpy(a)) for a in arrays]
    theirs = [torch.nn.Parameter(torch.from_numpy(a.copy())) for a in arrays]
    np.testing.assert_array_equal(
        utils.parameters_to_vector(mine).numpy(),
        torch.nn.utils.parameters_to_vector(theirs).detach().numpy(),
    )
    new = rng.standard_normal(23).astype(np.float32)
    utils.vector_to_parameters(fl.from_numpy(new), mine)
    torch.nn.utils.vector_to_parameters(torch.from_numpy(new), theirs)
    for m, t in zip(mine, theirs):
        np.testing.assert_array_equal(m.numpy(), t.detach().numpy())
    single = utils.parameters_to_vector(mine[0])  # one tensor is a list of one
    assert single.shape == (12,)


def test_vector_to_parameters_errors(reference_backend):
    params = [nn.Parameter(fl.ones(3)), nn.Parameter(fl.ones(2))]
    with pytest.raises(TypeError, match="flame tensor"):
        utils.vector_to_parameters(np.ones(5, np.float32), params)
    with pytest.raises(ValueError, match="5 values"):
        utils.vector_to_parameters(fl.ones(4), params)
    with pytest.raises(ValueError, match="1-d"):
        utils.vector_to_parameters(fl.ones(5, 1), params)
    np.testing.assert_array_equal(params[0].numpy(), np.ones(3))  # nothing was written


def test_parameters_to_vector_keeps_gradients(reference_backend):
    """As PyTorch's: the vector is a differentiable function of the parameters."""
    params = [nn.Parameter(fl.ones(3)), nn.Parameter(fl.ones(2, 2))]
    vector = utils.parameters_to_vector(params)
    (vector * fl.arange(7).float()).sum().backward()
    np.testing.assert_array_equal(params[0].grad.numpy(), [0, 1, 2])
    np.testing.assert_array_equal(params[1].grad.numpy(), [[3, 4], [5, 6]])


# --- LoRA --------------------------------------------------------------------------------------


def lora_net(rng, rank=2, alpha=4.0):
    """Net with LoRA on both dense layers and random (not zero) B, so every path matters."""
    model = lora.inject_lora(Net(rng), ["q", "v"], rank=rank, alpha=alpha)
    for layer in (model.q, model.v):
        with fl.no_grad():
            layer.lora_B.copy_(fl.from_numpy(rng.standard_normal(layer.lora_B.shape) * 0.5))
    return model


def torch_lora_forward(torch, values, x, scale):
    """The same network in PyTorch, from a {name: array} of the FLAME model's state."""
    t = {
        key: torch.from_numpy(value.copy()).requires_grad_(value.dtype == np.float32)
        for key, value in values.items()
    }  # fmt: skip

    def dense(h, name):
        base = h @ t[f"{name}.base.weight"].T + t[f"{name}.base.bias"]
        return base + scale * ((h @ t[f"{name}.lora_A"].T) @ t[f"{name}.lora_B"].T)

    y = dense(dense(torch.from_numpy(x), "q").relu(), "v") + t["running_mean"]
    return y, t


def state_arrays(model):
    return {key: value.numpy().copy() for key, value in model.state_dict().items()}


def test_lora_freezes_the_base_and_names_its_weights(reference_backend):
    rng = np.random.default_rng(10)
    model = lora.inject_lora(Net(rng), ["q", "v"], rank=3, alpha=6)
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["q.lora_A", "q.lora_B", "v.lora_A", "v.lora_B"]
    assert set(model.state_dict()) == {
        "running_mean", "num_batches_tracked", "q.lora_A", "q.lora_B", "q.base.weight",
        "q.base.bias", "v.lora_A", "v.lora_B", "v.base.weight", "v.base.bias",
    }  # fmt: skip
    assert list(lora.lora_state_dict(model)) == ["q.lora_A", "q.lora_B", "v.lora_A", "v.lora_B"]
    assert model.q.scaling == 2.0 and model.q.lora_A.shape == (3, 4)
    assert model.q.lora_B.shape == (6, 3) and not model.q.lora_B.numpy().any()
    bound = 1 / np.sqrt(4)  # kaiming_uniform(a=sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert np.abs(model.q.lora_A.numpy()).max() <= bound and model.q.lora_A.numpy().std() > 0
    assert "rank=3, alpha=6, scaling=2.0" in repr(model)


def test_new_adapter_leaves_the_output_unchanged(reference_backend):
    rng = np.random.default_rng(11)
    plain = Net(rng)
    x = fl.from_numpy(rng.standard_normal((5, 4)).astype(np.float32))
    before = plain(x).numpy()
    model = lora.inject_lora(plain, ["q", "v"], rank=2)
    np.testing.assert_array_equal(model(x).numpy(), before)


def test_lora_linear_gradients_match_torch(reference_backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(12)
    model = lora_net(rng)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = model(fl.from_numpy(x))
    (y * y).sum().backward()
    expected, t = torch_lora_forward(torch, state_arrays(model), x, model.q.scaling)
    (expected * expected).sum().backward()
    np.testing.assert_allclose(y.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        if "lora" in name:
            np.testing.assert_allclose(param.grad.numpy(), t[name].grad.numpy(), rtol=1e-4,
                                       atol=1e-5, err_msg=name)  # fmt: skip
        else:
            assert param.grad is None, name


def test_lora_conv2d_matches_torch(reference_backend):
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    rng = np.random.default_rng(13)
    base = Conv(rng, 3, 5, 3, stride=2, padding=1)
    layer = lora.LoRAConv2d(base, rank=2, alpha=3)
    assert layer.lora_A.shape == (2, 3, 3, 3) and layer.lora_B.shape == (5, 2, 1, 1)
    with fl.no_grad():
        layer.lora_B.copy_(fl.from_numpy(rng.standard_normal((5, 2, 1, 1)) * 0.5))
    x = rng.standard_normal((2, 3, 7, 7)).astype(np.float32)
    y = layer(fl.from_numpy(x))
    (y * y).sum().backward()
    t = {k: torch.from_numpy(v.copy()).requires_grad_() for k, v in state_arrays(layer).items()}
    inputs = torch.from_numpy(x)
    down = functional.conv2d(inputs, t["lora_A"], stride=2, padding=1)
    expected = functional.conv2d(inputs, t["base.weight"], t["base.bias"], stride=2, padding=1)
    expected = expected + layer.scaling * functional.conv2d(down, t["lora_B"])
    (expected * expected).sum().backward()
    np.testing.assert_allclose(y.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    assert base.weight.grad is None and base.bias.grad is None
    for name in ("lora_A", "lora_B"):
        np.testing.assert_allclose(getattr(layer, name).grad.numpy(), t[name].grad.numpy(),
                                   rtol=1e-4, atol=1e-4, err_msg=name)  # fmt: skip


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_merge_and_unmerge(reference_backend, kind):
    rng = np.random.default_rng(14)
    if kind == "linear":
        layer = lora.LoRALinear(Dense(rng, 6, 4), rank=3, alpha=5)
        x = fl.from_numpy(rng.standard_normal((3, 6)).astype(np.float32))
    else:
        layer = lora.LoRAConv2d(Conv(rng, 3, 4, 3, padding=1), rank=3, alpha=5)
        x = fl.from_numpy(rng.standard_normal((2, 3, 5, 5)).astype(np.float32))
    with fl.no_grad():
        layer.lora_B.copy_(fl.from_numpy(rng.standard_normal(layer.lora_B.shape)))
    original = layer.base.weight.numpy().copy()
    unmerged = layer(x).numpy()
    a = layer.lora_A.numpy().reshape(3, -1)
    b = layer.lora_B.numpy().reshape(-1, 3)
    layer.merge()
    assert layer.merged
    expected_weight = original + layer.scaling * (b @ a).reshape(original.shape)
    np.testing.assert_allclose(layer.base.weight.numpy(), expected_weight, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer(x).numpy(), unmerged, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="already merged"):
        layer.merge()
    layer.unmerge()
    assert not layer.merged
    np.testing.assert_allclose(layer.base.weight.numpy(), original, rtol=0, atol=1e-6)
    np.testing.assert_allclose(layer(x).numpy(), unmerged, rtol=1e-6, atol=1e-6)
    with pytest.raises(RuntimeError, match="not merged"):
        layer.unmerge()


def test_adapter_swap_never_retraces(reference_backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(15)
    model = lora_net(rng)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    step = fl.compile(lambda inputs: model(inputs))
    first = step(fl.from_numpy(x)).numpy()
    first_adapter = {k: v.numpy().copy() for k, v in lora.lora_state_dict(model).items()}
    adapter = {
        key: rng.standard_normal(value.shape).astype(np.float32)
        for key, value in lora.lora_state_dict(model).items()
    }  # fmt: skip
    result = lora.load_lora_state_dict(model, {k: fl.from_numpy(v) for k, v in adapter.items()})
    assert result.missing_keys == [] and result.unexpected_keys == []
    second = step(fl.from_numpy(x)).numpy()
    assert step.cache_info().traces == 1
    assert not np.allclose(first, second)
    values = state_arrays(model)
    for key, value in adapter.items():
        np.testing.assert_array_equal(values[key], value)
    expected, _ = torch_lora_forward(torch, values, x, model.q.scaling)
    np.testing.assert_allclose(second, expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    lora.load_lora_state_dict(model, first_adapter)  # and back, still one trace
    np.testing.assert_allclose(step(fl.from_numpy(x)).numpy(), first, rtol=1e-6, atol=1e-6)
    assert step.cache_info().traces == 1


def test_adapter_swap_round_trip_and_merged_layers(reference_backend):
    rng = np.random.default_rng(16)
    model = lora_net(rng)
    x = fl.from_numpy(rng.standard_normal((5, 4)).astype(np.float32))
    first_adapter = {k: v.numpy().copy() for k, v in lora.lora_state_dict(model).items()}
    first = model(x).numpy()
    second_adapter = {k: v * 0.5 for k, v in first_adapter.items()}
    model.q.merge()  # a merged layer is unmerged, written and merged again
    lora.load_lora_state_dict(model, second_adapter)  # arrays are accepted
    assert model.q.merged
    second = model(x).numpy()
    lora.load_lora_state_dict(model, first_adapter)
    np.testing.assert_allclose(model(x).numpy(), first, rtol=1e-5, atol=1e-5)
    assert not np.allclose(first, second)


def test_load_lora_state_dict_checks_before_writing(reference_backend):
    rng = np.random.default_rng(17)
    model = lora_net(rng)
    before = {k: v.numpy().copy() for k, v in lora.lora_state_dict(model).items()}
    bad = {k: np.zeros(v.shape, np.float32) for k, v in before.items()}
    bad["v.lora_B"] = np.zeros((3, 5), np.float32)  # another rank
    with pytest.raises(RuntimeError, match="v.lora_B has shape"):
        lora.load_lora_state_dict(model, bad)
    with pytest.raises(RuntimeError, match="missing keys"):
        lora.load_lora_state_dict(model, {"q.lora_A": before["q.lora_A"]})
    for key, value in lora.lora_state_dict(model).items():
        np.testing.assert_array_equal(value.numpy(), before[key])
    partial = lora.load_lora_state_dict(model, {"q.lora_A": before["q.lora_A"]}, strict=False)
    assert partial.missing_keys == ["q.lora_B", "v.lora_A", "v.lora_B"]


def test_inject_lora_targets(reference_backend):
    rng = np.random.default_rng(18)
    by_regex = lora.inject_lora(Net(rng), r"q", rank=2)
    assert isinstance(by_regex.q, lora.LoRALinear) and not isinstance(by_regex.v, lora.LoRALinear)
    by_predicate = lora.inject_lora(Net(rng), lambda name, module: name == "v", rank=2)
    assert isinstance(by_predicate.v, lora.LoRALinear)
    assert by_predicate.q.weight.requires_grad is False  # everything else is frozen
    again = lora.inject_lora(by_predicate, ["q", "v"], rank=2)  # v is wrapped already
    assert isinstance(again.v.base, Dense) and isinstance(again.q, lora.LoRALinear)
    with pytest.raises(ValueError, match="no module"):
        lora.inject_lora(Net(rng), ["k_proj"])

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(fl.ones(3))

    with pytest.raises(TypeError, match="neither a linear layer"):
        lora.inject_lora(Odd(), ["norm"])
    with pytest.raises(ValueError, match="rank"):
        lora.LoRALinear(Dense(rng, 2, 2), rank=0)


def test_merge_and_unload(reference_backend):
    rng = np.random.default_rng(19)
    model = lora_net(rng)
    x = fl.from_numpy(rng.standard_normal((5, 4)).astype(np.float32))
    expected = model(x).numpy()
    lora.merge_and_unload(model)
    assert isinstance(model.q, Dense) and isinstance(model.v, Dense)
    np.testing.assert_allclose(model(x).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_lora_dropout_only_in_training(reference_backend):
    rng = np.random.default_rng(20)
    model = lora.inject_lora(Net(rng), ["q"], rank=2, dropout=0.5)
    with fl.no_grad():
        model.q.lora_B.copy_(fl.ones(6, 2))
    x = fl.from_numpy(rng.standard_normal((8, 4)).astype(np.float32))
    model.eval()
    first, second = model(x).numpy(), model(x).numpy()
    np.testing.assert_array_equal(first, second)
    model.train()
    assert not np.allclose(model(x).numpy(), first)


# --- with FLAME's own layers (Linear, Conv2d, BatchNorm2d) ----------------------------------------


def _layers():
    try:
        from flame.nn.modules.batchnorm import BatchNorm2d
        from flame.nn.modules.conv import Conv2d
        from flame.nn.modules.linear import Linear
    except ImportError:  # pragma: no cover (the layers land separately)
        pytest.skip("flame.nn's Linear/Conv2d/BatchNorm2d are not there yet")
    return Linear, Conv2d, BatchNorm2d


def conv_bn_pair(torch):
    """The same conv + batch-norm net in FLAME and PyTorch, with PyTorch's weights."""
    _, Conv2d, BatchNorm2d = _layers()
    theirs = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4))
    mine = nn.Sequential(Conv2d(3, 4, 3, padding=1), BatchNorm2d(4))
    mine.load_state_dict({k: v.numpy() for k, v in theirs.state_dict().items()})
    return mine, theirs


def test_ema_of_conv_batch_norm_matches_torch(reference_backend):
    """use_buffers=True averages the running statistics and num_batches_tracked too."""
    torch = pytest.importorskip("torch")
    from torch.optim import swa_utils as torch_swa

    rng = np.random.default_rng(21)
    mine, theirs = conv_bn_pair(torch)
    ema = swa_utils.AveragedModel(
        mine, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True
    )
    torch_ema = torch_swa.AveragedModel(
        theirs, multi_avg_fn=torch_swa.get_ema_multi_avg_fn(0.9), use_buffers=True
    )
    for _ in range(4):
        x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
        mine(fl.from_numpy(x)).realize()  # training mode: the running statistics move
        with torch.no_grad():
            theirs(torch.from_numpy(x))
        with fl.no_grad():
            for param in mine.parameters():
                param.mul_(0.9)
        with torch.no_grad():
            for param in theirs.parameters():
                param.mul_(0.9)
        ema.update_parameters(mine)
        torch_ema.update_parameters(theirs)
        assert_same_average(ema, torch_ema, rtol=1e-5)


def test_update_bn_matches_torch(reference_backend):
    torch = pytest.importorskip("torch")
    from torch.optim import swa_utils as torch_swa

    rng = np.random.default_rng(22)
    mine, theirs = conv_bn_pair(torch)
    batches = [rng.standard_normal((2, 3, 5, 5)).astype(np.float32) for _ in range(3)]
    mine.eval()
    theirs.eval()
    swa_utils.update_bn([(fl.from_numpy(b), 0) for b in batches], mine)
    torch_swa.update_bn([(torch.from_numpy(b), 0) for b in batches], theirs)
    assert not mine.training and mine[1].momentum == 0.1
    for key, value in mine.state_dict().items():
        np.testing.assert_allclose(value.numpy(), theirs.state_dict()[key].numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=key)  # fmt: skip


def test_lora_on_flame_layers_matches_torch(reference_backend):
    """inject_lora on nn.Linear / nn.Conv2d; PEFT-style torch reference built by hand."""
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    Linear, Conv2d, _ = _layers()
    rng = np.random.default_rng(23)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = Conv2d(2, 3, 3, stride=2, padding=1)
            self.head = Linear(27, 4)

        def forward(self, x):
            return self.head(self.conv(x).relu().reshape(x.shape[0], -1))

    model = lora.inject_lora(Model(), ["conv", "head"], rank=2, alpha=2)
    assert isinstance(model.conv, lora.LoRAConv2d) and isinstance(model.head, lora.LoRALinear)
    for layer in (model.conv, model.head):
        with fl.no_grad():
            layer.lora_B.copy_(fl.from_numpy(rng.standard_normal(layer.lora_B.shape) * 0.3))
    x = rng.standard_normal((2, 2, 5, 5)).astype(np.float32)
    y = model(fl.from_numpy(x))
    (y * y).sum().backward()
    t = {k: torch.from_numpy(v.copy()).requires_grad_() for k, v in state_arrays(model).items()}
    h = torch.from_numpy(x)
    conv = functional.conv2d(h, t["conv.base.weight"], t["conv.base.bias"], stride=2, padding=1)
    down = functional.conv2d(h, t["conv.lora_A"], stride=2, padding=1)
    h = (conv + functional.conv2d(down, t["conv.lora_B"])).relu().reshape(2, -1)
    expected = functional.linear(h, t["head.base.weight"], t["head.base.bias"])
    expected = expected + functional.linear(functional.linear(h, t["head.lora_A"]),
                                            t["head.lora_B"])  # fmt: skip
    (expected * expected).sum().backward()
    np.testing.assert_allclose(y.numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        if "lora" in name:
            np.testing.assert_allclose(param.grad.numpy(), t[name].grad.numpy(), rtol=1e-4,
                                       atol=1e-4, err_msg=name)  # fmt: skip
        else:
            assert param.grad is None, name


# --- gpu tier: the multi-tensor kernel and LoRA on the GPU vs the reference backend --------------


def _count_gpu_launches(monkeypatch):
    """Multi-tensor kernel launches, and the launches of every other plan run."""
    from flame.runtime import events
    from flame.runtime.multi_tensor import MultiTensorKernel

    counts = {"multi_tensor": 0, "plans": 0}
    original = MultiTensorKernel.launch

    def launch(self, *args, **kwargs):
        counts["multi_tensor"] += 1
        return original(self, *args, **kwargs)

    def recorder(kind, data):
        if kind == "run":
            counts["plans"] += len(data["plan"].launches)

    monkeypatch.setattr(MultiTensorKernel, "launch", launch)
    return counts, events.recording(recorder)


def _ema_run(backend_name, rng_seed, steps=3):
    """Values of an EMA (use_buffers: a float and an int64 group) after ``steps`` updates."""
    with fl.backend(backend_name):
        rng = np.random.default_rng(rng_seed)
        model = Net(rng)
        ema = swa_utils.AveragedModel(
            model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9), use_buffers=True
        )
        for step in range(steps):
            for tensor in tensors_of(model).values():
                value = (
                    rng.standard_normal(tensor.shape).astype(np.float32)
                    if tensor.dtype.is_float
                    else np.array(7 + 13 * step, dtype=np.int64)
                )
                with fl.no_grad():
                    tensor.copy_(fl.from_numpy(value))
            ema.update_parameters(model)
        return ema, model, {k: v.numpy().copy() for k, v in ema.state_dict().items()}


@pytest.mark.gpu
def test_ema_on_gpu_is_one_multi_tensor_kernel_per_dtype(monkeypatch):
    _, _, expected = _ema_run("reference", 24)
    ema, model, found = _ema_run("cuda", 24)
    for key, value in expected.items():
        np.testing.assert_allclose(found[key], value, rtol=1e-6, atol=1e-7, err_msg=key)
    counts, recording = _count_gpu_launches(monkeypatch)
    _refuse_host_reads(monkeypatch)
    with fl.backend("cuda"), recording:
        ema.update_parameters(model)  # float32 and int64: two kernels, plus n_averaged += 1
    assert counts["multi_tensor"] == 2
    assert counts["plans"] <= 1


@pytest.mark.gpu
def test_ema_of_300_tensors_on_gpu_is_one_launch(monkeypatch):
    with fl.backend("cuda"):
        rng = np.random.default_rng(25)
        model = Many(rng, 150)
        ema = swa_utils.AveragedModel(model, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.5))
        ema.update_parameters(model)
        start = ema.module.layers[7].weight.numpy().copy()
        with fl.no_grad():
            for param in model.parameters():
                param.mul_(3.0)
        counts, recording = _count_gpu_launches(monkeypatch)
        with recording:
            ema.update_parameters(model)
        assert counts["multi_tensor"] == 1
        np.testing.assert_allclose(ema.module.layers[7].weight.numpy(), 2.0 * start, rtol=1e-6)


@pytest.mark.gpu
def test_swa_on_gpu_matches_reference():
    results = []
    for backend_name in ("reference", "cuda"):
        with fl.backend(backend_name):
            rng = np.random.default_rng(26)
            model = Net(rng)
            swa = swa_utils.AveragedModel(model)
            for _ in range(4):
                with fl.no_grad():
                    for param in model.parameters():
                        param.add_(
                            fl.from_numpy(
                                rng.standard_normal(param.shape),
                            ).float()
                        )
                swa.update_parameters(model)
            results.append({k: v.numpy().copy() for k, v in swa.state_dict().items()})
    for key, value in results[0].items():
        np.testing.assert_allclose(results[1][key], value, rtol=1e-6, atol=1e-6, err_msg=key)


def _lora_run(backend_name):
    with fl.backend(backend_name):
        fl.manual_seed(0)  # lora_A is drawn from the default generator: the same on both
        rng = np.random.default_rng(27)
        model = lora_net(rng)
        x = fl.from_numpy(rng.standard_normal((5, 4)).astype(np.float32))
        y = model(x)
        (y * y).sum().backward()
        output = y.numpy()
        grads = {n: p.grad.numpy() for n, p in model.named_parameters() if p.grad is not None}
        step = fl.compile(lambda inputs: model(inputs))
        step(x)
        adapter = {k: v.numpy() * 0.5 for k, v in lora.lora_state_dict(model).items()}
        lora.load_lora_state_dict(model, adapter)
        swapped = step(x).numpy()
        assert step.cache_info().traces == 1
        model.q.merge()
        merged = model(x).numpy()
        return output, grads, swapped, merged


@pytest.mark.gpu
def test_lora_on_gpu_matches_reference():
    expected = _lora_run("reference")
    found = _lora_run("cuda")
    np.testing.assert_allclose(found[0], expected[0], rtol=1e-4, atol=1e-4)
    assert set(found[1]) == set(expected[1]) == {"q.lora_A", "q.lora_B", "v.lora_A", "v.lora_B"}
    for name, grad in expected[1].items():
        np.testing.assert_allclose(found[1][name], grad, rtol=1e-4, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(found[2], expected[2], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(found[3], expected[3], rtol=1e-4, atol=1e-4)


def test_inject_lora_that_refuses_a_layer_leaves_the_model_as_it_was(reference_backend):
    from flame.nn.modules.container import Sequential
    from flame.nn.modules.conv import Conv2d

    model = Sequential(Conv2d(4, 4, 3), Conv2d(4, 4, 3, groups=4))  # the second: depthwise
    with pytest.raises(ValueError, match="multiple of the base convolution's groups"):
        lora.inject_lora(model, ["0", "1"], rank=2)  # rank 2 over 4 groups
    assert type(model[0]) is Conv2d and type(model[1]) is Conv2d
    assert all(param.requires_grad for param in model.parameters())
