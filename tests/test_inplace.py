"""In-place writes (issue 18): they write the tensor's memory (a view writes its base), run
under no_grad and inside fl.compile, and refuse what PyTorch refuses, leaving the tensor
unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl


def _t(rng, *shape):
    return fl.tensor(rng.standard_normal(shape).astype(np.float32)).realize()


def test_ema_with_mul_add_lerp_matches_pytorch(backend, rng):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    params = [rng.standard_normal(shape).astype(np.float32) for shape in [(7, 5), (33,)]]
    ema_start = [p * 0.5 for p in params]
    decay = 0.9
    ours_a = [fl.tensor(e).realize() for e in ema_start]
    ours_b = [fl.tensor(e).realize() for e in ema_start]
    theirs_a = [torch.tensor(e) for e in ema_start]
    theirs_b = [torch.tensor(e) for e in ema_start]
    for step in range(4):
        scale = 1.0 + step
        with fl.no_grad(), torch.no_grad():
            for ea, eb, ta, tb, p in zip(ours_a, ours_b, theirs_a, theirs_b, params):
                ea.mul_(decay).add_(fl.tensor(p * scale), alpha=1 - decay)
                eb.lerp_(fl.tensor(p * scale), 1 - decay)
                ta.mul_(decay).add_(torch.tensor(p * scale), alpha=1 - decay)
                tb.lerp_(torch.tensor(p * scale), 1 - decay)
    for ea, eb, ta, tb in zip(ours_a, ours_b, theirs_a, theirs_b):
        np.testing.assert_allclose(ea.numpy(), ta.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(eb.numpy(), tb.numpy(), rtol=1e-5, atol=1e-6)


def test_augmented_operators_write_the_memory_views_see(backend, rng):
    e, p = _t(rng, 4, 6), _t(rng, 4, 6)
    expected = e.numpy() + p.numpy()
    alias = e[1:3]  # a view: reads the same memory
    same = e
    e += p
    assert e is same
    np.testing.assert_allclose(e.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(alias.numpy(), expected[1:3], rtol=1e-6)
    e *= 2
    e -= 1
    e /= 4
    np.testing.assert_allclose(e.numpy(), (expected * 2 - 1) / 4, rtol=1e-6)


def test_a_view_writes_its_base(backend, rng):
    base = _t(rng, 3, 4)
    start = base.numpy().copy()
    row = base[1]
    row.add_(10.0)
    base.T[0].zero_()  # through a transposed view: column 0
    start[1] += 10.0
    start[:, 0] = 0.0
    np.testing.assert_allclose(base.numpy(), start, rtol=1e-6)
    np.testing.assert_allclose(row.numpy(), start[1], rtol=1e-6)


def test_setitem_basic_mask_and_rows(backend, rng):
    x = _t(rng, 4, 5)
    want = x.numpy().copy()
    x[:, 0] = 5.0
    want[:, 0] = 5.0
    x[1] = fl.arange(5).to(fl.float32)
    want[1] = np.arange(5)
    x[2:, 1:3] = fl.tensor(np.array([[1.0, 2.0]], dtype=np.float32))
    want[2:, 1:3] = [[1.0, 2.0]]
    x[x > 1.5] = -1.0
    want[want > 1.5] = -1.0
    x[[0, 3]] = 7.0
    want[[0, 3]] = 7.0
    np.testing.assert_allclose(x.numpy(), want, rtol=1e-6)


def test_bad_writes_raise_at_the_users_line_and_change_nothing(backend, rng):
    x = _t(rng, 3, 4)
    before = x.numpy().copy()
    with pytest.raises(fl.ShapeError, match=r"add_: cannot broadcast.*\[2, 3, 4\].*test_inplace"):
        x.add_(_t(rng, 2, 3, 4))
    with pytest.raises(IndexError, match="out of range"):
        x[[0, 7]] = 1.0
    with pytest.raises(IndexError):
        x[5] = 1.0
    ints = fl.tensor(np.arange(4, dtype=np.int64)).realize()
    with pytest.raises(RuntimeError, match="result type float32 can't be cast.*int64"):
        ints.add_(0.5)
    with pytest.raises(RuntimeError, match="single memory location"):
        x.expand(2, 3, 4).add_(1.0)
    np.testing.assert_array_equal(x.numpy(), before)
    np.testing.assert_array_equal(ints.numpy(), np.arange(4))


def test_leaf_that_requires_grad_refuses_outside_no_grad(backend, rng):
    w = _t(rng, 3).requires_grad_()
    before = w.numpy().copy()
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        w.sub_(1.0)
    with pytest.raises(RuntimeError, match="leaf tensor that requires grad"):
        w[0].fill_(2.0)
    np.testing.assert_array_equal(w.numpy(), before)
    with fl.no_grad():  # an optimizer-style update
        w.sub_(0.5)
    assert w.requires_grad
    np.testing.assert_allclose(w.numpy(), before - 0.5)
    (w * w).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * (before - 0.5), rtol=1e-6)


def test_backward_of_an_overwritten_value_names_both_lines(backend, rng):
    w = _t(rng, 3).requires_grad_()
    a = _t(rng, 3)
    loss = (w * a).sum()  # mul saves a for w's gradient
    a.mul_(3.0)
    with pytest.raises(fl.GradError, match=r"from test_inplace.py:\d+.*mul_ at test_inplace.py"):
        loss.backward()


def test_value_built_before_a_write_is_refused_not_silently_wrong(backend, rng):
    b = _t(rng, 4)
    doubled = b * 2
    b.add_(1.0)
    with pytest.raises(RuntimeError, match="overwrote afterwards"):
        doubled.numpy()


def test_lazy_value_is_rebound_and_history_kept(backend, rng):
    x = _t(rng, 5).requires_grad_()
    h = x * 2
    h += x  # h had no memory: it now stands for the new value, with its history
    h.sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(5, 3.0, np.float32))


def test_in_place_inside_compile_updates_closed_over_memory(backend, rng):
    ema = fl.tensor(np.zeros(6, np.float32)).realize()
    chained = fl.tensor(np.zeros(6, np.float32)).realize()

    @fl.compile
    def update(p):
        with fl.no_grad():
            ema.lerp_(p, 0.5)
            chained.mul_(0.5).add_(p, alpha=0.5)  # a second write to the same memory
        return p.sum()

    target = fl.tensor(np.full(6, 8.0, np.float32))
    values = []
    for _ in range(3):
        update(target)
        values.append((ema.numpy()[0], chained.numpy()[0]))
    assert values == [(4.0, 4.0), (6.0, 6.0), (7.0, 7.0)]
    assert update.cache_info().traces == 1


def test_in_place_normal_uniform_fill_copy(backend, rng):
    x = _t(rng, 1000)
    fl.manual_seed(3)
    x.uniform_(2.0, 3.0)
    values = x.numpy()
    assert values.min() >= 2.0 and values.max() < 3.0
    x.normal_(1.0, 0.5, generator=fl.Generator().manual_seed(1))
    assert abs(x.numpy().mean() - 1.0) < 0.1
    x.fill_(4.0)
    np.testing.assert_array_equal(x.numpy(), np.full(1000, 4.0, np.float32))
    x.copy_(np.arange(1000, dtype=np.float64))
    np.testing.assert_array_equal(x.numpy(), np.arange(1000, dtype=np.float32))
    x.zero_().clamp_(1.0, 2.0)
    np.testing.assert_array_equal(x.numpy(), np.ones(1000, np.float32))


@pytest.mark.gpu
def test_gpu_write_is_the_computing_kernel_and_keeps_the_address(rng, monkeypatch):
    from flame.runtime.executor import Executor

    fused = []
    original = Executor.realize_into

    def counting(self, node, array):
        done = original(self, node, array)
        fused.append(done)
        return done

    monkeypatch.setattr(Executor, "realize_into", counting)
    with fl.backend("cuda"):
        e, p = _t(rng, 1 << 16), _t(rng, 1 << 16)
        address = e.data_ptr()
        expected = e.numpy() * 0.25 + p.numpy() * 0.75
        with fl.no_grad():
            e.lerp_(p, 0.75)
        assert e.data_ptr() == address
        np.testing.assert_allclose(e.numpy(), expected, rtol=1e-5, atol=1e-6)
        assert fused == [True]
        # read through another view in the same kernel: computed apart, then copied
        e.copy_(e.flip(0))
        np.testing.assert_allclose(e.numpy(), expected[::-1], rtol=1e-5, atol=1e-6)
        assert fused[-1] is False


@pytest.mark.gpu
def test_gpu_write_reaches_dlpack_consumers(rng):
    torch = pytest.importorskip("torch", reason="PyTorch shares the memory in this test")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here")
    with fl.backend("cuda"):
        shared = torch.zeros(8, device="cuda")
        x = fl.from_dlpack(shared)
        x += 2.5
        fl.synchronize()
        assert torch.equal(shared, torch.full((8,), 2.5, device="cuda"))


def test_requires_grad_setter_and_inference_mode(rng):
    with fl.backend("reference"):
        w = _t(rng, 3)
        w.requires_grad = True
        assert w.requires_grad
        with fl.inference_mode():
            assert not fl.is_grad_enabled()
            assert not (w * 2).requires_grad

        @fl.inference_mode()
        def predict(x):
            return x * w

        assert not predict(w).requires_grad and fl.is_grad_enabled()
        w.requires_grad = False
        assert not w.requires_grad
    assert issubclass(fl.ShapeError, RuntimeError)


@pytest.mark.gpu
def test_gpu_compiled_write_goes_straight_into_the_memory(rng):
    with fl.backend("cuda"):
        ema = _t(rng, 4096)
        address, start = ema.data_ptr(), ema.numpy().copy()

        @fl.compile
        def update(p):
            with fl.no_grad():
                ema.mul_(0.5).add_(p, alpha=0.5)
            return p.sum()

        p = _t(rng, 4096)
        for _ in range(3):
            update(p)
        expected = start
        for _ in range(3):
            expected = expected * 0.5 + p.numpy() * 0.5
        np.testing.assert_allclose(ema.numpy(), expected, rtol=1e-5, atol=1e-6)
        assert ema.data_ptr() == address
        (program,) = update._state._programs.values()
        assert program.direct == (program.plan.output_slots[1],)  # the kernel writes ema


def test_setitem_on_a_lazy_value_and_on_strided_memory(backend, rng):
    lazy = _t(rng, 3, 4) * 2
    want = lazy.numpy().copy()
    lazy[0, 1:3] = 9.0
    want[0, 1:3] = 9.0
    np.testing.assert_allclose(lazy.numpy(), want, rtol=1e-6)
    source = rng.standard_normal((4, 3)).astype(np.float32)
    strided = fl.from_numpy(source.T)  # a transposed (non-contiguous) array
    strided[1] = 0.0
    strided.add_(1.0)
    expected = source.T.copy()
    expected[1] = 0.0
    np.testing.assert_allclose(strided.numpy(), expected + 1.0, rtol=1e-6)


@pytest.mark.parametrize("name", ["elu", "celu", "selu", "relu6", "hardtanh", "hardswish",
                                  "hardsigmoid", "mish", "dropout"])  # fmt: skip
def test_inplace_activations_write_their_input(backend, rng, name):
    import flame.nn.functional as F

    x = _t(rng, 64)

    def options():  # dropout: the same mask twice, from a fresh generator of one seed
        return {"p": 0.5, "generator": fl.Generator().manual_seed(1)} if name == "dropout" else {}

    expected = getattr(F, name)(x, **options()).numpy()
    result = getattr(F, name)(x, inplace=True, **options())
    assert result is x
    np.testing.assert_allclose(x.numpy(), expected, rtol=1e-6)


def test_copying_a_lazy_value_does_not_alias_it(backend, rng):
    source = _t(rng, 8).requires_grad_()  # the write keeps the value's history
    doubled = source * 2  # lazy
    target = _t(rng, 8)
    target.copy_(doubled)
    target.add_(1.0)  # must not change doubled
    np.testing.assert_allclose(doubled.numpy(), source.numpy() * 2, rtol=1e-6)
    np.testing.assert_allclose(target.numpy(), source.numpy() * 2 + 1, rtol=1e-6)


def test_compiled_function_writing_one_value_into_two_tensors(backend, rng):
    first, second = _t(rng, 16), _t(rng, 16)

    @fl.compile
    def spread(p):
        value = p * 3
        with fl.no_grad():
            first.copy_(value)
            second.copy_(value)
        return p.sum()

    p = _t(rng, 16)
    spread(p)
    spread(p)
    np.testing.assert_allclose(first.numpy(), p.numpy() * 3, rtol=1e-6)
    np.testing.assert_allclose(second.numpy(), p.numpy() * 3, rtol=1e-6)


def test_compiled_training_step_updates_weights_in_place_and_clears_grad(backend):
    """A hand-written SGD step inside fl.compile: backward, an in-place update under
    no_grad, and ``w.grad = None`` (zero_grad(set_to_none=True)) in the function."""
    w = fl.tensor(np.ones(4, np.float32)).realize().requires_grad_()
    x = fl.tensor(np.full(4, 0.5, np.float32))

    @fl.compile
    def step(x):
        loss = ((w * x).sum() - 1.0) ** 2
        loss.backward()
        with fl.no_grad():
            w.sub_(0.1 * w.grad)
        w.grad = None
        return loss

    losses = [step(x).item() for _ in range(4)]
    expected, value = [], 1.0  # every weight moves alike: w <- w - 0.1 * 2 (2w - 1) * 0.5
    for _ in range(4):
        expected.append((2 * value - 1) ** 2)
        value -= 0.1 * (2 * value - 1)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    np.testing.assert_allclose(w.numpy(), np.full(4, value, np.float32), rtol=1e-5)
    assert w.grad is None and step.cache_info().traces == 1


def test_setitem_inside_compile(backend, rng):
    table = _t(rng, 3, 4)
    start = table.numpy().copy()

    @fl.compile
    def fill(v):
        local = v * 2
        local[:, 0] = 0.0  # a value of the trace
        table[1] = v[0]  # memory the function closes over
        return local

    v = _t(rng, 3, 4)
    out = fill(v).numpy()
    expected = v.numpy() * 2
    expected[:, 0] = 0.0
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    start[1] = v.numpy()[0]
    np.testing.assert_allclose(table.numpy(), start, rtol=1e-6)
    assert fill.cache_info().traces == 1


def test_writing_into_a_fresh_zeros_empty_or_full_gives_it_memory(reference_backend):
    # fl.zeros is a broadcast constant until realized; like PyTorch's, it is a tensor of its own
    for make in (lambda: fl.zeros(4, 5), lambda: fl.empty(4, 5), lambda: fl.full((4, 5), 3.0)):
        t = make()
        t.fill_(2.0)
        t[0, 1] = 7.0
        expected = np.full((4, 5), 2.0, np.float32)
        expected[0, 1] = 7.0
        np.testing.assert_array_equal(t.numpy(), expected)


def test_a_lazy_leaf_written_under_no_grad_still_requires_grad(reference_backend):
    w = fl.randn(4, 5).requires_grad_()
    x = fl.ones(4, 5)
    with fl.no_grad():
        w.copy_(x)  # the leaf keeps its flag; x does not take it
    assert w.requires_grad and not x.requires_grad
    (w * 3).sum().backward()
    np.testing.assert_array_equal(w.grad.numpy(), np.full((4, 5), 3.0))


def test_a_leaf_written_under_no_grad_inside_compile_still_requires_grad(backend):
    """As eagerly: a parameter written in place (a max_norm renorm) and then used in the
    same compiled step gets its gradient."""
    w = fl.tensor(np.full(4, 2.0, np.float32)).realize().requires_grad_()

    @fl.compile
    def step(x):
        with fl.no_grad():
            w.mul_(0.5)
        loss = (w * x).sum()
        loss.backward()
        return loss

    step(fl.tensor(np.arange(4, dtype=np.float32)))
    np.testing.assert_array_equal(w.grad.numpy(), np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(w.numpy(), np.ones(4, np.float32))


def test_in_place_write_into_a_computed_zero_dim_value(reference_backend):
    t = fl.zeros(()).realize()
    t.add_(1)
    u = fl.tensor(5.0).clone().realize()
    u.mul_(3)
    assert t.shape == () and float(t.item()) == 1.0 and float(u.item()) == 15.0


def test_in_place_ops_with_scalars_work_on_the_tensors_own_backend():
    with fl.backend("reference"):
        t = fl.ones(3).realize()
    with fl.backend("cuda"):  # building on another backend: the write stays on t's
        t.fill_(2.0)
        t.add_(1)
    assert t.backend == "reference"
    np.testing.assert_array_equal(t.numpy(), np.full(3, 3.0))


def test_a_realized_clone_has_memory_of_its_own(backend):
    # on the GPU, clone as ``x * 1`` was simplified to x and the realized clone shared x's
    # memory: a write into the clone (an EMA copy of a model, say) changed the model
    x = fl.ones(8).realize()
    y = fl.clone(x).realize()
    y.add_(1)
    np.testing.assert_array_equal(x.numpy(), np.ones(8))
    np.testing.assert_array_equal(y.numpy(), np.full(8, 2.0))


def test_compiled_write_into_a_closed_over_lazy_tensor_happens_every_call(backend):
    running = fl.zeros(3)  # never computed before the trace
    table = {"count": fl.zeros(())}
    step = fl.compile(lambda x: (running.add_(x), table["count"].add_(1)))
    for _ in range(3):
        step(fl.ones(3))
    np.testing.assert_array_equal(running.numpy(), np.full(3, 3.0))
    assert float(table["count"].item()) == 3.0

    def local(x):  # a tensor made inside the function starts afresh at every call
        buffer = fl.zeros(3)
        buffer.add_(x)
        return buffer

    compiled = fl.compile(local)
    for _ in range(3):
        out = compiled(fl.ones(3))
    np.testing.assert_array_equal(out.numpy(), np.ones(3))
