"""``nn.Module`` machinery against PyTorch's: registration, walking, ``state_dict`` and
``load_state_dict`` (strict errors, the model unchanged on an error), train/eval, dtype moves,
hooks and their order, containers, and modules inside ``flame.compile``."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn as nn


class Block(nn.Module):
    def __init__(self, features: int = 4):
        super().__init__()
        self.weight = nn.Parameter(fl.ones(features, features))
        self.bias = nn.Parameter(fl.zeros(features))
        self.register_buffer("steps", fl.zeros(1))
        self.register_buffer("scratch", fl.zeros(features), persistent=False)

    def forward(self, x):
        return x @ self.weight + self.bias


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Block()
        self.layers = nn.ModuleList([Block(), Block()])
        self.head = nn.Sequential(Block(), Block())
        self.shared = self.first  # the same module twice: listed once

    def forward(self, x):
        x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _torch_net(torch):
    tnn = torch.nn

    class TBlock(tnn.Module):
        def __init__(self, features=4):
            super().__init__()
            self.weight = tnn.Parameter(torch.ones(features, features))
            self.bias = tnn.Parameter(torch.zeros(features))
            self.register_buffer("steps", torch.zeros(1))
            self.register_buffer("scratch", torch.zeros(features), persistent=False)

        def forward(self, x):
            return x @ self.weight + self.bias

    class TNet(tnn.Module):
        def __init__(self):
            super().__init__()
            self.first = TBlock()
            self.layers = tnn.ModuleList([TBlock(), TBlock()])
            self.head = tnn.Sequential(TBlock(), TBlock())
            self.shared = self.first

        def forward(self, x):
            x = self.first(x)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    return TNet()


def test_walking_matches_pytorch(reference_backend):
    torch = pytest.importorskip("torch")
    ours, theirs = Net(), _torch_net(torch)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]
    assert [n for n, _ in ours.named_children()] == [n for n, _ in theirs.named_children()]
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert len(list(ours.parameters())) == len(list(theirs.parameters())) == 10
    assert repr(ours) == repr(theirs).replace("TBlock", "Block").replace("TNet", "Net")
    dup = [n for n, _ in ours.named_parameters(remove_duplicate=False)]
    assert dup == [n for n, _ in theirs.named_parameters(remove_duplicate=False)]


def test_registration_rules(reference_backend):
    block = Block()
    with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'weight'"):
        block.weight = fl.ones(4, 4)
    assert isinstance(block.weight, nn.Parameter)  # unchanged
    block.weight = None
    assert "weight" in block._parameters and block.weight is None
    assert [n for n, _ in block.named_parameters()] == ["bias"]
    with pytest.raises(KeyError, match="contain"):
        block.register_buffer("a.b", fl.zeros(1))
    with pytest.raises(KeyError, match="already exists"):
        block.register_parameter("forward", nn.Parameter(fl.zeros(1)))
    with pytest.raises(TypeError, match="Parameter or None required"):
        block.register_parameter("w2", fl.zeros(1))

    class Early(nn.Module):
        def __init__(self):
            self.w = nn.Parameter(fl.zeros(1))

    with pytest.raises(AttributeError, match="before Module.__init__"):
        Early()
    block.extra = 3  # plain attributes stay plain
    assert block.extra == 3 and "extra" not in block._parameters
    del block.bias
    assert "bias" not in block._parameters
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = block.nothing


def test_parameter_shares_memory_and_owns_its_flag(reference_backend):
    data = fl.tensor(np.arange(4, dtype=np.float32)).realize()
    param = nn.Parameter(data)
    assert param.requires_grad and not data.requires_grad
    with fl.no_grad():
        param.add_(1)
    np.testing.assert_array_equal(data.numpy(), np.arange(4) + 1)  # one memory, as PyTorch
    frozen = nn.Parameter(fl.zeros(2), requires_grad=False)
    assert not frozen.requires_grad
    assert repr(param).startswith("Parameter containing:")


def test_state_dict_shares_memory_and_load_writes_it(reference_backend):
    net = Net()
    state = net.state_dict()
    assert not state["first.weight"].requires_grad
    new = {key: fl.full(value.shape, 2.0) for key, value in state.items()}
    result = net.load_state_dict(new)
    assert result.missing_keys == [] and result.unexpected_keys == []
    np.testing.assert_array_equal(net.layers[1].weight.numpy(), np.full((4, 4), 2.0))
    np.testing.assert_array_equal(state["head.0.bias"].numpy(), np.full(4, 2.0))
    assert isinstance(net.first.weight, nn.Parameter) and net.first.weight.requires_grad


def test_load_state_dict_errors_name_every_key_and_change_nothing(reference_backend):
    net = Net()
    before = {k: v.numpy().copy() for k, v in net.state_dict().items()}
    bad = {key: fl.full(value.shape, 5.0) for key, value in net.state_dict().items()}
    del bad["first.bias"], bad["head.1.steps"]
    bad["extra.weight"] = fl.zeros(1)
    bad["layers.0.weight"] = fl.zeros(3, 3)
    with pytest.raises(RuntimeError) as error:
        net.load_state_dict(bad)
    message = str(error.value)
    for text in ('"first.bias"', '"head.1.steps"', '"extra.weight"', "layers.0.weight", "[3, 3]"):
        assert text in message
    for key, value in net.state_dict().items():  # nothing was written
        np.testing.assert_array_equal(value.numpy(), before[key])
    with pytest.raises(RuntimeError, match="size mismatch"):  # shapes are checked even then
        net.load_state_dict(bad, strict=False)
    del bad["layers.0.weight"]
    result = net.load_state_dict(bad, strict=False)
    assert sorted(result.missing_keys) == ["first.bias", "head.1.steps", "layers.0.weight"]
    assert result.unexpected_keys == ["extra.weight"]
    np.testing.assert_array_equal(net.head[1].weight.numpy(), np.full((4, 4), 5.0))
    np.testing.assert_array_equal(net.head[1].steps.numpy(), before["head.1.steps"])
    np.testing.assert_array_equal(net.first.bias.numpy(), np.full(4, 5.0))  # as shared.bias
    with pytest.raises(RuntimeError, match="expected a flame tensor"):
        net.load_state_dict({**net.state_dict(), "first.bias": "zeros"})


def test_load_state_dict_from_pytorch(reference_backend):
    torch = pytest.importorskip("torch")
    theirs = _torch_net(torch)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape))
    ours = Net()
    ours.load_state_dict({k: v.numpy() for k, v in theirs.state_dict().items()})
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    expected = theirs(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(ours(fl.tensor(x)).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_train_eval_requires_grad_zero_grad_apply(reference_backend):
    net = Net()
    assert net.training and net.head[0].training
    net.eval()
    assert not any(m.training for m in net.modules())
    net.train()
    assert all(m.training for m in net.modules())
    net.requires_grad_(False)
    assert not any(p.requires_grad for p in net.parameters())
    net.requires_grad_()
    loss = net(fl.ones(2, 4)).sum()
    loss.backward()
    assert all(p.grad is not None for p in net.parameters())
    net.zero_grad(set_to_none=False)
    assert all(float(p.grad.abs().sum().item()) == 0.0 for p in net.parameters())
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    seen = []
    net.apply(lambda m: seen.append(type(m).__name__))
    assert seen[-1] == "Net" and seen.count("Block") == 5  # children first, shared once


def test_dtype_moves_keep_parameter_identity(reference_backend):
    net = Net()
    weight = net.first.weight
    optimizer = fl.optim.SGD(net.parameters(), lr=0.1)
    net.bfloat16()
    assert net.first.weight is weight and weight.dtype is fl.bfloat16
    assert weight.requires_grad and isinstance(weight, nn.Parameter)
    assert net.first.steps.dtype is fl.bfloat16
    net.to(fl.float32)
    assert weight.dtype is fl.float32
    assert optimizer.param_groups[0]["params"][0] is weight
    with pytest.raises(TypeError, match="floating point"):
        net.to(fl.int32)


def test_forward_hooks_order_and_results(reference_backend):
    torch = pytest.importorskip("torch")

    def record(log, tag):
        def pre(module, args):
            log.append(("pre", tag))

        def post(module, args, output):
            log.append(("post", tag))

        return pre, post

    logs = []
    for lib, module in ((fl, Block()), (torch, _torch_net(torch).first)):
        log = []
        pre_a, post_a = record(log, "a")
        pre_b, post_b = record(log, "b")
        module.register_forward_pre_hook(pre_a)
        handle = module.register_forward_pre_hook(pre_b, prepend=True)
        module.register_forward_hook(post_a)
        module.register_forward_hook(post_b, prepend=True)
        module(lib.ones(2, 4))
        handle.remove()
        module(lib.ones(2, 4))
        logs.append(log)
    assert logs[0] == logs[1]

    block = Block()
    block.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    block.register_forward_hook(lambda m, args, out: out + 1)
    np.testing.assert_array_equal(block(fl.ones(2, 4)).numpy(), np.ones((2, 4)))
    kw = Block()
    kw.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 2,), kwargs), with_kwargs=True)
    np.testing.assert_array_equal(kw(fl.ones(1, 4)).numpy(), np.full((1, 4), 8.0))


def test_full_backward_hook_matches_pytorch(reference_backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    seen = {}

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(fl.tensor(w))

        def forward(self, a, b):
            return (a * b) @ self.w

    class TTwo(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.from_numpy(w))

        def forward(self, a, b):
            return (a * b) @ self.w

    def hook_for(tag):
        def hook(module, grad_input, grad_output):
            seen[tag] = [np.asarray(g.detach().numpy()) for g in (*grad_input, *grad_output)]
            return (grad_input[0] * 3, grad_input[1])

        return hook

    ours, theirs = Two(), TTwo()
    ours.register_full_backward_hook(hook_for("flame"))
    theirs.register_full_backward_hook(hook_for("torch"))
    a, b = fl.tensor(x).requires_grad_(), fl.tensor(x[::-1].copy()).requires_grad_()
    ta = torch.from_numpy(x).requires_grad_()
    tb = torch.from_numpy(x[::-1].copy()).requires_grad_()
    (ours(a, b) ** 2).sum().backward()
    (theirs(ta, tb) ** 2).sum().backward()
    for got, expected in zip(seen["flame"], seen["torch"]):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(a.grad.numpy(), ta.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.grad.numpy(), tb.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ours.w.grad.numpy(), theirs.w.grad.numpy(), rtol=1e-5)


def test_containers(reference_backend):
    seq = nn.Sequential(Block(), Block(), Block())
    assert len(seq) == 3 and isinstance(seq[1:], nn.Sequential) and len(seq[1:]) == 2
    assert seq[-1] is seq[2]
    del seq[0]
    assert list(seq._modules) == ["0", "1"]
    seq.append(Block())
    assert [n for n, _ in seq.named_parameters()][-1] == "2.bias"
    with pytest.raises(IndexError):
        seq[5]
    layers = nn.ModuleList()
    layers += [Block()]
    layers.insert(0, Block())
    assert len(layers) == 2 and list(layers._modules) == ["0", "1"]
    table = nn.ModuleDict({"a": Block()})
    table["b"] = Block()
    assert list(table.keys()) == ["a", "b"] and "b" in table
    params = nn.ParameterList([fl.zeros(2), nn.Parameter(fl.ones(3))])
    assert isinstance(params[0], nn.Parameter) and len(list(params.parameters())) == 2
    assert list(params.state_dict()) == ["0", "1"]
    pdict = nn.ParameterDict({"x": fl.zeros(2)})
    assert list(pdict.state_dict()) == ["x"]
    with pytest.raises(TypeError, match="not a Module"):
        nn.ModuleList([3])


def test_module_inside_compile_reads_new_weights(reference_backend):
    block = Block()

    @fl.compile
    def run(x):
        return block(x)

    x = fl.ones(2, 4)
    np.testing.assert_array_equal(run(x).numpy(), np.full((2, 4), 4.0))
    block.load_state_dict(
        {"weight": fl.full((4, 4), 2.0), "bias": fl.ones(4), "steps": fl.zeros(1)}
    )
    np.testing.assert_array_equal(run(x).numpy(), np.full((2, 4), 9.0))
    assert run.cache_info().traces == 1


@pytest.mark.gpu
def test_module_training_step_on_gpu():
    with fl.backend("cuda"):
        net = Net()
        optimizer = fl.optim.SGD(net.parameters(), lr=0.01)

        @fl.compile
        def step(x):
            loss = (net(x) ** 2).mean()
            loss.backward()
            return loss

        x = fl.ones(8, 4) * 0.1
        losses = []
        for _ in range(3):
            losses.append(float(step(x).item()))
            optimizer.step()
            optimizer.zero_grad()
    with fl.backend("reference"):
        ref = Net()
        ref_opt = fl.optim.SGD(ref.parameters(), lr=0.01)
        expected = []
        for _ in range(3):
            loss = (ref(fl.ones(8, 4) * 0.1) ** 2).mean()
            loss.backward()
            expected.append(float(loss.item()))
            ref_opt.step()
            ref_opt.zero_grad()
    np.testing.assert_allclose(losses, expected, rtol=1e-4)
    assert step.cache_info().traces == 1


# --- found in review: each a silent difference from PyTorch before its fix -----------------


def test_state_dict_and_data_keep_sharing_memory_after_they_are_computed(reference_backend):
    block = Block()
    state = block.state_dict()
    state["weight"].numpy()  # computed once: before the fix it then had memory of its own
    data = block.weight.data
    data.numpy()
    with fl.no_grad():
        block.weight.add_(1)
    np.testing.assert_array_equal(state["weight"].numpy(), np.full((4, 4), 2.0))
    np.testing.assert_array_equal(data.numpy(), np.full((4, 4), 2.0))
    data.mul_(3)  # a write through .data reaches the parameter, as PyTorch's
    np.testing.assert_array_equal(block.weight.numpy(), np.full((4, 4), 6.0))
    assert block.weight.requires_grad and not data.requires_grad


def test_load_state_dict_refuses_a_dtype_it_cannot_convert_before_writing(reference_backend):
    block = Block()
    bad = {"weight": np.full((4, 4), 7.0, np.float32), "bias": np.zeros(4, np.complex64),
           "steps": np.zeros(1, np.float32)}  # fmt: skip
    with pytest.raises(RuntimeError, match="bias"):
        block.load_state_dict(bad)
    np.testing.assert_array_equal(block.weight.numpy(), np.ones((4, 4)))


def test_deepcopy_gives_a_model_with_memory_of_its_own(reference_backend):
    import copy

    net = Net()
    twin = copy.deepcopy(net)
    assert isinstance(twin.first.weight, nn.Parameter) and twin.first.weight.requires_grad
    assert twin.shared is twin.first  # sharing inside the model is kept
    with fl.no_grad():
        net.first.weight.add_(1)
    np.testing.assert_array_equal(twin.first.weight.numpy(), np.ones((4, 4)))
    x = fl.ones(2, 4).requires_grad_()
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(x * 2)


def test_is_leaf_follows_autograd_not_whether_a_value_was_computed(reference_backend):
    x = fl.ones(3).requires_grad_()
    y = x * 2
    assert x.is_leaf and not y.is_leaf
    y.realize()
    assert not y.is_leaf and fl.ones(2).is_leaf


def test_parameter_list_append_of_a_refused_value_leaves_no_gap(reference_backend):
    params = nn.ParameterList([fl.zeros(2)])
    with pytest.raises(TypeError):
        params.append(np.ones(2))
    params.append(fl.ones(3))
    assert len(params) == 2 and [n for n, _ in params.named_parameters()] == ["0", "1"]


def test_an_averaged_model_inside_a_parent_resumes_its_count(reference_backend):
    from flame.optim import swa_utils

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Block()
            decay = swa_utils.get_ema_multi_avg_fn(0.5)
            self.ema = swa_utils.AveragedModel(self.model, multi_avg_fn=decay)

    first = Holder()
    for _ in range(3):
        with fl.no_grad():
            first.model.weight.add_(1)
        first.ema.update_parameters(first.model)
    second = Holder()
    second.load_state_dict(first.state_dict())  # the parent's load writes n_averaged
    with fl.no_grad():
        second.model.weight.add_(1)
    second.ema.update_parameters(second.model)  # an average, not a first-call copy
    expected = 0.5 * first.ema.module.weight.numpy() + 0.5 * second.model.weight.numpy()
    np.testing.assert_allclose(second.ema.module.weight.numpy(), expected)


def test_compiling_a_module_keeps_it_a_module_to_its_user(reference_backend):
    net = Net()
    compiled = fl.compile(net)
    x = fl.ones(2, 4)
    for _ in range(3):
        out = compiled(x)
    np.testing.assert_allclose(out.numpy(), net(x).numpy())
    assert compiled.cache_info().traces == 1 and compiled._orig_mod is net
    assert list(compiled.state_dict()) == list(net.state_dict())
    assert len(list(compiled.parameters())) == 10
    compiled.eval()
    assert not net.training
