"""Mixed precision: ``flame.autocast`` (the region's state, PyTorch's op lists, compiled
signatures) and ``flame.amp.GradScaler`` (skipped steps on the device, the scale's growth and
backoff, steps against ``torch.amp.GradScaler``).

CPU tier on the reference backend. The op lists are PyTorch's CUDA lists; PyTorch's CPU
autocast (the only one a machine without a GPU runs) agrees with them on the products and
the losses, which are compared with it directly.
"""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.amp import GradScaler

BF16, F16, F32 = fl.bfloat16, fl.float16, fl.float32


def _t(rng, *shape, dtype=F32):
    return fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(dtype)


# --- the region -----------------------------------------------------------------------------


def test_defaults_nesting_and_disabled_regions(reference_backend, rng):
    x, w = _t(rng, 4, 8), _t(rng, 8, 3)
    assert not fl.is_autocast_enabled()
    assert fl.get_autocast_dtype("cuda") is F16 and fl.get_autocast_dtype("cpu") is BF16
    with fl.autocast():  # "cuda": float16, as PyTorch
        assert fl.is_autocast_enabled() and (x @ w).dtype is F16
        with fl.autocast(dtype=BF16):  # the inner region overrides
            assert (x @ w).dtype is BF16 and fl.get_autocast_dtype("cuda") is BF16
            with fl.autocast(enabled=False):
                assert not fl.is_autocast_enabled() and (x @ w).dtype is F32
                assert fl.get_autocast_dtype("cuda") is BF16  # PyTorch: inherited
            assert (x @ w).dtype is BF16
        assert (x @ w).dtype is F16
    with fl.autocast("cpu"):  # bfloat16 by default
        assert (x @ w).dtype is BF16 and fl.amp.is_autocast_enabled("cuda")
    assert not fl.is_autocast_enabled() and (x @ w).dtype is F32


def test_decorator_and_reentrant_instance(reference_backend, rng):
    x, w = _t(rng, 4, 8), _t(rng, 8, 3)

    @fl.autocast(dtype=BF16)
    def product(a, b):
        return a @ b

    assert product(x, w).dtype is BF16 and product.__name__ == "product"
    assert not fl.is_autocast_enabled()
    region = fl.amp.autocast(dtype=F16)
    with region:
        with region:
            assert (x @ w).dtype is F16
        assert (x @ w).dtype is F16
    assert (x @ w).dtype is F32


def test_region_errors():
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fl.autocast(dtype=fl.float32)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fl.autocast("cpu", dtype=fl.float64)
    with pytest.raises(ValueError, match="device_type"):
        fl.autocast("xla")
    with pytest.raises(ValueError, match="device_type"):
        fl.get_autocast_dtype("tpu")


def test_the_state_is_per_thread(reference_backend):
    import threading

    seen = []
    with fl.autocast(dtype=BF16):
        thread = threading.Thread(target=lambda: seen.append(fl.is_autocast_enabled()))
        thread.start()
        thread.join()
    assert seen == [False]


# --- the op lists -----------------------------------------------------------------------------


def _lower_cases(rng):
    x, w = _t(rng, 4, 8), _t(rng, 8, 3)
    a, b = _t(rng, 2, 4, 8), _t(rng, 2, 8, 3)
    return {
        "matmul": lambda: fl.matmul(x, w),
        "operator": lambda: x @ w,
        "method": lambda: x.matmul(w),
        "bmm": lambda: fl.bmm(a, b),
        "einsum": lambda: fl.einsum("bij,bjk->bik", a, b),
        "einsum_reduce": lambda: fl.einsum("ij->i", x),
    }


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
def test_lower_precision_ops_run_in_the_region_dtype(reference_backend, rng, dtype):
    cases = _lower_cases(rng)
    with fl.autocast(dtype=dtype):
        for name, case in cases.items():
            assert case().dtype is dtype, name
        mixed = fl.matmul(_t(rng, 4, 8, dtype=BF16), _t(rng, 8, 3))  # every input cast
        assert mixed.dtype is dtype
        wide = fl.matmul(_t(rng, 4, 8, dtype=fl.float64), _t(rng, 8, 3, dtype=fl.float64))
        assert wide.dtype is fl.float64  # float64 is not eligible, as in PyTorch
    for name, case in cases.items():
        assert case().dtype is F32, name


def test_lower_precision_values_are_the_products_of_the_cast_inputs(reference_backend, rng):
    x, w = _t(rng, 16, 32), _t(rng, 32, 8)
    with fl.autocast(dtype=BF16):
        got = (x @ w).float().numpy()
    expected = (x.to(BF16) @ w.to(BF16)).float().numpy()
    np.testing.assert_array_equal(got, expected)


def _float32_cases(rng):
    y, t = _t(rng, 6, 8, dtype=BF16), fl.tensor(rng.integers(0, 8, 6))
    image = _t(rng, 2, 4, 3, 3, dtype=BF16)
    probabilities = fl.sigmoid(y)
    weight = _t(rng, 8, dtype=BF16).abs() + 0.5
    return {
        "softmax": lambda: F.softmax(y, -1),
        "log_softmax": lambda: F.log_softmax(y, 1),
        "layer_norm": lambda: F.layer_norm(y, (8,), weight, weight),
        "rms_norm": lambda: F.rms_norm(y, (8,), weight),
        "group_norm": lambda: F.group_norm(image, 2),
        "cross_entropy": lambda: F.cross_entropy(y, t),
        "cross_entropy_weighted": lambda: F.cross_entropy(y, t, weight=weight),
        "mse_loss": lambda: F.mse_loss(y, y * 0.5),
        "nll_loss": lambda: F.nll_loss(F.log_softmax(y.float(), 1).to(BF16), t),
        "binary_cross_entropy": lambda: F.binary_cross_entropy(probabilities, probabilities),
        "binary_cross_entropy_with_logits": lambda: F.binary_cross_entropy_with_logits(y, y),
        "l1_loss": lambda: F.l1_loss(y, y * 0.5),
        "smooth_l1_loss": lambda: F.smooth_l1_loss(y, y * 0.5),
        "huber_loss": lambda: F.huber_loss(y, y * 0.5),
        "kl_div": lambda: F.kl_div(y, probabilities, reduction="batchmean"),
        "sum": lambda: y.sum(),
        "sum_dim": lambda: fl.sum(y, 1),
        "prod": lambda: fl.prod(y, 0),
        "cumsum": lambda: fl.cumsum(y, 1),
        "cumprod": lambda: fl.cumprod(y, 0),
        "norm": lambda: fl.norm(y),  # through sum: PyTorch's float32 list has norm too
    }


def _unlisted_cases(rng):
    y = _t(rng, 6, 8, dtype=BF16)
    return {
        "mean": lambda: y.mean(),
        "var": lambda: y.var(1),
        "std": lambda: y.std(),
        "logsumexp": lambda: fl.logsumexp(y, 1),
        "amax": lambda: fl.amax(y, 1),
        "gelu": lambda: F.gelu(y),
        "add": lambda: y + y,
        "softmax_dtype": lambda: F.softmax(y, -1, dtype=BF16),  # dtype= is not eligible
        "sum_dtype": lambda: fl.sum(y, dtype=BF16),
        "cumsum_dtype": lambda: fl.cumsum(y, 0, dtype=BF16),
    }


def test_float32_list_ops_run_in_float32(reference_backend, rng):
    cases = _float32_cases(rng)
    with fl.autocast(dtype=BF16):
        for name, case in cases.items():
            assert case().dtype is F32, name
    for name, case in cases.items():  # outside a region: bfloat16 in, bfloat16 out
        assert case().dtype is BF16, name


def test_ops_on_neither_list_keep_their_dtype(reference_backend, rng):
    with fl.autocast(dtype=F16):
        for name, case in _unlisted_cases(rng).items():
            assert case().dtype is BF16, name


def test_float32_list_values_are_the_float32_op(reference_backend, rng):
    y, t = _t(rng, 6, 8, dtype=BF16), fl.tensor(rng.integers(0, 8, 6))
    with fl.autocast(dtype=BF16):
        got = [F.softmax(y, -1), F.cross_entropy(y, t), F.layer_norm(y, (8,))]
    expected = [
        F.softmax(y.float(), -1),
        F.cross_entropy(y.float(), t),
        F.layer_norm(y.float(), (8,)),
    ]
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_output_dtypes_match_torch_cpu_autocast(reference_backend, rng):
    """The ops PyTorch's CPU and CUDA lists agree on, compared with PyTorch's CPU autocast."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as TF

    x = rng.standard_normal((4, 8)).astype(np.float32)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    target = rng.integers(0, 8, 4)
    cases = {  # name: (flame op, torch op), each of (product, class targets)
        "matmul": (lambda y, t: y, lambda y, t: y),
        "bmm": (lambda y, t: fl.bmm(y[None], fl.transpose(y, 0, 1)[None]),
                lambda y, t: torch.bmm(y[None], y.T[None])),
        "einsum": (lambda y, t: fl.einsum("ij,kj->ik", y, y),
                   lambda y, t: torch.einsum("ij,kj->ik", y, y)),
        "cross_entropy": (F.cross_entropy, TF.cross_entropy),
        "mse_loss": (lambda y, t: F.mse_loss(y, y * 2), lambda y, t: TF.mse_loss(y, y * 2)),
        "nll_loss": (F.nll_loss, TF.nll_loss),
        "l1_loss": (lambda y, t: F.l1_loss(y, y * 2), lambda y, t: TF.l1_loss(y, y * 2)),
        "smooth_l1_loss": (lambda y, t: F.smooth_l1_loss(y, y * 2),
                           lambda y, t: TF.smooth_l1_loss(y, y * 2)),
        "huber_loss": (lambda y, t: F.huber_loss(y, y * 2), lambda y, t: TF.huber_loss(y, y * 2)),
        "kl_div": (lambda y, t: F.kl_div(y, y.sigmoid(), reduction="batchmean"),
                   lambda y, t: TF.kl_div(y, y.sigmoid(), reduction="batchmean")),
        "bce_with_logits": (lambda y, t: F.binary_cross_entropy_with_logits(y, y.sigmoid()),
                            lambda y, t: TF.binary_cross_entropy_with_logits(y, y.sigmoid())),
        "binary_cross_entropy": (
            lambda y, t: F.binary_cross_entropy(y.sigmoid(), y.sigmoid()),
            lambda y, t: TF.binary_cross_entropy(y.sigmoid(), y.sigmoid()),
        ),
        "prod": (lambda y, t: fl.prod(y, 1), lambda y, t: torch.prod(y, 1)),
        "mean": (lambda y, t: y.mean(), lambda y, t: y.mean()),
        "logsumexp": (lambda y, t: fl.logsumexp(y, 1), lambda y, t: torch.logsumexp(y, 1)),
    }  # fmt: skip
    for name, (ours, theirs) in cases.items():
        with fl.autocast("cpu", dtype=BF16):
            got = ours(fl.tensor(x) @ fl.tensor(w), fl.tensor(target))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected = theirs(torch.tensor(x) @ torch.tensor(w), torch.tensor(target))
        assert got.dtype.name == str(expected.dtype).removeprefix("torch."), name
        np.testing.assert_allclose(
            got.float().numpy(), expected.float().numpy(), rtol=2e-2, atol=2e-2, err_msg=name
        )


def test_master_weights_stay_float32(reference_backend, rng):
    """float32 parameters, a bfloat16 forward: float32 gradients and float32 updates."""
    x, y = _t(rng, 16, 8), _t(rng, 16, 4)
    w1, w2 = (_t(rng, 8, 32) * 0.3).requires_grad_(), (_t(rng, 32, 4) * 0.3).requires_grad_()
    opt = fl.optim.AdamW([w1, w2], lr=1e-2)
    losses = []
    for _ in range(3):
        with fl.autocast(dtype=BF16):
            hidden = F.gelu(x @ w1)
            assert hidden.dtype is BF16
            loss = F.mse_loss(hidden @ w2, y)
            assert loss.dtype is F32
        loss.backward()
        assert w1.grad.dtype is F32 and w2.grad.dtype is F32
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert w1.dtype is F32 and opt.state[w1]["exp_avg"].dtype is F32
    assert losses[-1] < losses[0]


def test_backward_inside_a_region_keeps_the_gradients_dtypes(reference_backend, rng):
    x = _t(rng, 8, 16)
    w, b = _t(rng, 16, 4).requires_grad_(), _t(rng, 4).requires_grad_()
    with fl.autocast(dtype=BF16):
        loss = F.cross_entropy(x @ w + b, fl.tensor(rng.integers(0, 4, 8)))
        loss.backward()
    assert w.grad.dtype is F32 and b.grad.dtype is F32
    assert np.isfinite(w.grad.numpy()).all()


# --- flame.compile ------------------------------------------------------------------------------


def test_compiled_calls_key_on_the_autocast_state(reference_backend, rng):
    x, w = _t(rng, 4, 8).realize(), _t(rng, 8, 3).realize()
    compiled = fl.compile(lambda a, b: F.softmax(a @ b, -1) * 2.0)
    plain = compiled(x, w)
    with fl.autocast(dtype=BF16):
        cast = compiled(x, w)
        for _ in range(3):
            compiled(x, w)  # the same state: never retraces
    with fl.autocast(dtype=F16):
        compiled(x, w)
    with fl.autocast(dtype=BF16), fl.autocast(enabled=False):
        compiled(x, w)  # a disabled region is no region
    compiled(x, w)
    info = compiled.cache_info()
    assert info.traces == 3 and info.misses == 3
    assert info.reasons[1] == "miss: autocast changed: off -> bfloat16 (a new trace)"
    assert info.reasons[2] == "miss: autocast changed: bfloat16 -> float16 (a new trace)"
    assert plain.dtype is F32 and cast.dtype is F32
    expected = (F.softmax((x.to(BF16) @ w.to(BF16)).float(), -1) * 2.0).numpy()
    np.testing.assert_array_equal(cast.numpy(), expected)
    assert not np.array_equal(plain.numpy(), expected)


def test_autocast_inside_a_compiled_function_traces_once(reference_backend, rng):
    x, w = _t(rng, 4, 8).realize(), _t(rng, 8, 3).realize()

    @fl.compile
    def step(a, b):
        with fl.autocast(dtype=BF16):
            return a @ b

    results = [step(x, w) for _ in range(4)]
    assert step.cache_info().traces == 1 and step.cache_info().hits == 3
    assert all(result.dtype is BF16 for result in results)
    assert not fl.is_autocast_enabled()


def test_a_one_kernel_program_retraces_when_the_state_changes(backend, rng):
    """On the GPU, the generated one-kernel entry tests the autocast dtype too."""
    x = _t(rng, 64).realize()
    compiled = fl.compile(lambda a: a * 2.0 + 1.0)
    for _ in range(2):
        compiled(x)
        with fl.autocast(dtype=BF16):
            compiled(x)
    info = compiled.cache_info()
    assert info.traces == 2 and info.hits == 2
    assert info.reasons[-1] == "miss: autocast changed: off -> bfloat16 (a new trace)"


def test_the_direct_key_holds_the_autocast_dtype(reference_backend, rng):
    from flame.replay import direct_key

    x = _t(rng, 4).realize()
    plain = direct_key((x,))
    with fl.autocast(dtype=BF16):
        cast = direct_key((x,))
    assert plain[:-1] == cast[:-1] and plain[-1] is None and cast[-1] is BF16


def test_a_compiled_training_step_under_autocast(reference_backend, rng):
    """The step compiled under autocast matches the same step run lazily under autocast,
    and repeated calls replay the program."""
    x, y = _t(rng, 32, 8).realize(), _t(rng, 32, 4).realize()
    init = [rng.standard_normal(shape).astype(np.float32) * 0.3 for shape in ((8, 16), (16, 4))]

    def train(compiled: bool):
        params = [fl.tensor(a).requires_grad_() for a in init]
        opt = fl.optim.AdamW(params, lr=1e-2)

        def step(x, y):
            loss = F.mse_loss(F.gelu(x @ params[0]) @ params[1], y)
            loss.backward()
            return loss

        run = fl.compile(step) if compiled else step
        losses = []
        for _ in range(3):
            with fl.autocast(dtype=BF16):
                losses.append(run(x, y).item())
            opt.step()
            opt.zero_grad()
        return losses, [p.numpy() for p in params], run

    lazy_losses, lazy_params, _ = train(False)
    losses, params, run = train(True)
    np.testing.assert_allclose(losses, lazy_losses, rtol=1e-6)
    for got, expected in zip(params, lazy_params):
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    assert run.cache_info().traces == 1


# --- GradScaler ---------------------------------------------------------------------------------


def _model(rng, optimizer="AdamW", **options):
    x, y = _t(rng, 16, 8), _t(rng, 16, 4)
    params = [(_t(rng, 8, 4) * 0.3).requires_grad_(), _t(rng, 4).requires_grad_()]
    opt = getattr(fl.optim, optimizer)(params, **options)
    return x, y, params, opt


def _scaled_backward(scaler, x, y, params, factor=1.0):
    loss = F.mse_loss(x @ params[0] + params[1], y) * factor
    scaler.scale(loss).backward()


def test_a_step_with_an_inf_gradient_is_skipped_on_the_device(backend, rng):
    x, y, params, opt = _model(rng, "AdamW", lr=1e-2)
    scaler = GradScaler(init_scale=2.0**10)
    _scaled_backward(scaler, x, y, params)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    before = [p.numpy().copy() for p in params]
    state = {k: (v.numpy().copy() if isinstance(v, fl.Tensor) else v)
             for k, v in opt.state[params[0]].items()}  # fmt: skip
    _scaled_backward(scaler, x, y, params, factor=float("inf"))
    scaler.step(opt)
    scaler.update()
    for got, expected in zip(params, before):
        np.testing.assert_array_equal(got.numpy(), expected)
    for name, value in opt.state[params[0]].items():
        value = value.numpy() if isinstance(value, fl.Tensor) else value
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    assert float(opt.state[params[0]]["step"].item()) == 1.0  # the count did not advance
    assert scaler.get_scale() == 2.0**9  # backed off
    opt.zero_grad()
    _scaled_backward(scaler, x, y, params)  # a finite step again: it updates
    scaler.step(opt)
    scaler.update()
    assert not np.array_equal(params[0].numpy(), before[0])
    assert float(opt.state[params[0]]["step"].item()) == 2.0


def test_the_scale_grows_after_growth_interval_finite_steps(reference_backend, rng):
    x, y, params, opt = _model(rng, "SGD", lr=1e-3)
    scaler = GradScaler(init_scale=4.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=3)
    scales = []
    for _ in range(7):
        _scaled_backward(scaler, x, y, params)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    assert scales == [4.0, 4.0, 12.0, 12.0, 12.0, 36.0, 36.0]
    assert scaler.state_dict()["_growth_tracker"] == 1
    _scaled_backward(scaler, x, y, params, factor=float("nan"))
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 9.0 and scaler.state_dict()["_growth_tracker"] == 0


def test_unscale_then_clip_then_step(reference_backend, rng):
    x, y, params, opt = _model(rng, "SGD", lr=0.1)
    scaler = GradScaler(init_scale=256.0)
    loss = F.mse_loss(x @ params[0] + params[1], y)
    scaler.scale(loss).backward()
    scaled = params[0].grad.numpy().copy()
    scaler.unscale_(opt)
    np.testing.assert_allclose(params[0].grad.numpy(), scaled / 256.0, rtol=1e-6)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    fl.nn.utils.clip_grad_norm_(params, 0.1)
    before = params[0].numpy().copy()
    clipped = params[0].grad.numpy().copy()
    scaler.step(opt)  # does not unscale again
    np.testing.assert_allclose(params[0].numpy(), before - 0.1 * clipped, rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()


def test_scaler_api_and_state(reference_backend, rng):
    scaler = GradScaler("cpu", init_scale=8.0, growth_interval=5)
    assert scaler.is_enabled() and scaler.get_scale() == 8.0
    loss = _t(rng, 3, dtype=BF16).sum()
    scaled = scaler.scale(loss)
    assert scaled.dtype is F32  # the sum of bfloat16 runs in float32 only under autocast
    assert scaler.scale(_t(rng, 3, dtype=BF16)).dtype is BF16  # a 0-d scale does not widen
    pair = scaler.scale([_t(rng, 2), _t(rng, 2)])
    assert isinstance(pair, list) and len(pair) == 2
    state = scaler.state_dict()
    assert state == {"scale": 8.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                     "growth_interval": 5, "_growth_tracker": 0}  # fmt: skip
    other = GradScaler()
    other.load_state_dict({**state, "scale": 32.0, "_growth_tracker": 2})
    assert other.get_scale() == 32.0 and other.get_growth_interval() == 5
    scaler.load_state_dict({**state, "scale": 2.0})
    assert scaler.get_scale() == 2.0
    scaler.update(new_scale=64.0)
    assert scaler.get_scale() == 64.0
    off = GradScaler(enabled=False)
    assert off.scale(loss) is loss and off.get_scale() == 1.0 and off.state_dict() == {}
    with pytest.raises(RuntimeError, match="empty"):
        GradScaler().load_state_dict({})
    with pytest.raises(RuntimeError, match="_scale is None"):
        GradScaler().update()
    x, y, params, opt = _model(rng, "SGD", lr=0.1)
    params[0].grad = _t(rng, 8, 4, dtype=F16)
    fresh = GradScaler()
    fresh.scale(loss)
    with pytest.raises(ValueError, match="FP16 gradients"):
        fresh.unscale_(opt)


def test_the_scale_is_read_in_place_by_a_compiled_function(reference_backend, rng):
    x = _t(rng, 4).realize()
    scaler = GradScaler(init_scale=4.0)
    scaler.scale(x)
    compiled = fl.compile(lambda a: scaler.scale(a.sum()))
    np.testing.assert_allclose(compiled(x).item(), 4.0 * x.numpy().sum(), rtol=1e-6)
    scaler.update(new_scale=0.5)
    np.testing.assert_allclose(compiled(x).item(), 0.5 * x.numpy().sum(), rtol=1e-6)
    assert compiled.cache_info().traces == 1


CASES = [
    ("SGD", dict(lr=0.05, momentum=0.9)),
    ("SGD", dict(lr=0.05)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1)),
    ("Adam", dict(lr=1e-2, amsgrad=True)),
]


@pytest.mark.parametrize(
    ("name", "options"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)]
)
def test_steps_match_torch_grad_scaler(backend, rng, name, options):
    """Several steps, one of them with an inf gradient, against ``torch.amp.GradScaler``."""
    torch = pytest.importorskip("torch")

    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 4)).astype(np.float32)
    init = [rng.standard_normal((8, 4)).astype(np.float32) * 0.3, np.zeros(4, np.float32)]
    factors = [1.0, 1.0, float("inf"), 1.0, 1.0, 1.0]
    settings = dict(init_scale=2.0**8, growth_interval=2)

    params = [fl.tensor(a).requires_grad_() for a in init]
    opt = getattr(fl.optim, name)(params, **options)
    scaler = GradScaler("cpu", **settings)
    tparams = [torch.tensor(a, requires_grad=True) for a in init]
    topt = getattr(torch.optim, name)(tparams, **options)
    tscaler = torch.amp.GradScaler("cpu", **settings)
    for factor in factors:
        with fl.autocast("cpu", dtype=BF16):
            loss = F.mse_loss(fl.tensor(x) @ params[0] + params[1], fl.tensor(y)) * factor
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            tloss = torch.nn.functional.mse_loss(
                torch.tensor(x) @ tparams[0] + tparams[1], torch.tensor(y)
            ) * factor  # fmt: skip
        tscaler.scale(tloss).backward()
        tscaler.step(topt)
        tscaler.update()
        topt.zero_grad()
        assert scaler.get_scale() == tscaler.get_scale()
    for got, expected in zip(params, tparams):
        np.testing.assert_allclose(got.numpy(), expected.detach().numpy(), rtol=2e-5, atol=2e-6)
    assert scaler.state_dict() == tscaler.state_dict()


def test_the_benchmark_smoke_path_matches_torch():
    """bench/autocast.py's CPU path: FLAME's compiled autocast step and PyTorch's eager one
    give the same losses (and FLAME traces its step once)."""
    pytest.importorskip("torch")
    from bench.autocast import markdown, run_smoke

    report = run_smoke(steps=2)
    assert report["flame"]["traces"] == 1
    np.testing.assert_allclose(
        report["flame"]["losses"], report["torch_eager"]["losses"], rtol=1e-4
    )
    assert "torch_eager" in markdown(report)


def test_backward_built_under_autocast_runs_in_the_forwards_dtypes(reference_backend):
    # PyTorch does not autocast backward ops: the sum that undoes a broadcast stays bf16
    w = fl.ones(4, dtype=fl.bfloat16).requires_grad_()
    x = fl.ones(3, 4, dtype=fl.bfloat16)
    with fl.autocast(dtype=fl.bfloat16):
        y = x * w
        y.backward(fl.ones(3, 4, dtype=fl.bfloat16))
    graph = w.grad.ir()
    assert w.grad.dtype is fl.bfloat16
    assert "f32" not in graph, graph
