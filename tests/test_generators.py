"""Generators (issue 18): draws advance, seeds reproduce, compiled steps draw anew at every
call without a retrace, and lazy, compiled and reference runs draw the same numbers.

Each test seeds the generator it uses (the default one is process-wide, as PyTorch's)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F


def test_draws_advance_and_a_seed_reproduces_them(backend):
    fl.manual_seed(123)
    first, second = fl.rand(64).numpy(), fl.randn(8, 8).numpy()
    fl.manual_seed(123)
    np.testing.assert_array_equal(fl.rand(64).numpy(), first)
    np.testing.assert_array_equal(fl.randn(8, 8).numpy(), second)
    assert not np.array_equal(fl.rand(64).numpy(), first)  # the offset moved on
    assert ((first >= 0) & (first < 1)).all()


def test_generator_numbers_are_philox_of_seed_and_counter(backend):
    """The first draw after manual_seed(s) is the index-keyed Philox stream of seed s; the
    second continues the counter where the first stopped."""
    generator = fl.Generator().manual_seed(7)
    first = fl.rand(10, generator=generator).numpy()
    second = fl.rand(6, generator=generator).numpy()
    with fl.backend("reference"):
        stream = fl.rand(16, seed=7).numpy()
    np.testing.assert_array_equal(np.concatenate([first, second]), stream)


def test_uniform_and_normal_moments(backend):
    generator = fl.Generator().manual_seed(1)
    uniform = fl.rand(200_000, generator=generator).numpy()
    normal = fl.randn(200_000, generator=generator).numpy()
    assert abs(uniform.mean() - 0.5) < 0.005 and abs(uniform.var() - 1 / 12) < 0.002
    assert abs(normal.mean()) < 0.01 and abs(normal.std() - 1) < 0.01


def test_own_generator_state_round_trips(backend):
    generator = fl.Generator().manual_seed(99)
    fl.rand(5, generator=generator).numpy()
    state = generator.get_state()
    assert state.shape == (2,) and state.dtype is fl.int64
    after = fl.randn(5, generator=generator).numpy()
    generator.set_state(state)
    np.testing.assert_array_equal(fl.randn(5, generator=generator).numpy(), after)
    assert generator.initial_seed() == 99


def test_a_state_of_the_wrong_size_is_refused_and_changes_nothing():
    generator = fl.Generator().manual_seed(5)
    before = generator.get_state().numpy()
    with pytest.raises(ValueError, match=r"int64 tensor of shape \[2\].*\[at test_generators"):
        generator.set_state(fl.tensor(np.zeros(3, dtype=np.int64)))
    np.testing.assert_array_equal(generator.get_state().numpy(), before)


def test_two_generators_do_not_share_a_counter(backend):
    one, two = fl.Generator().manual_seed(3), fl.Generator().manual_seed(3)
    a = fl.rand(4, generator=one).numpy()
    fl.rand(100, generator=one).numpy()
    np.testing.assert_array_equal(fl.rand(4, generator=two).numpy(), a)


def test_compiled_step_draws_new_noise_every_call_without_retracing(backend):
    @fl.compile
    def noisy(x):
        return x + fl.randn_like(x)

    x = fl.zeros(4, 8)
    fl.manual_seed(2024)
    calls = [noisy(x).numpy() for _ in range(3)]
    assert not np.array_equal(calls[0], calls[1]) and not np.array_equal(calls[1], calls[2])
    assert noisy.cache_info().traces == 1
    fl.manual_seed(2024)
    again = [noisy(x).numpy() for _ in range(3)]
    for expected, actual in zip(calls, again):
        np.testing.assert_array_equal(actual, expected)
    fl.manual_seed(2024)  # lazy mode draws the same numbers
    lazy = [(x + fl.randn_like(x)).numpy() for _ in range(3)]
    for expected, actual in zip(calls, lazy):
        np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)


def test_compiled_dropout_and_timesteps_change_per_call(backend):
    generator = fl.Generator().manual_seed(11)

    @fl.compile
    def step(x):
        t = fl.randint(0, 1000, (x.shape[0],), generator=generator)
        return F.dropout(x, 0.5, generator=generator), t

    x = fl.ones(16, 32)
    (mask0, t0), (mask1, t1) = [tuple(v.numpy() for v in step(x)) for _ in range(2)]
    assert not np.array_equal(mask0, mask1) and not np.array_equal(t0, t1)
    assert set(np.unique(mask0)) <= {0.0, 2.0} and 0.3 < (mask0 == 0).mean() < 0.7
    assert t0.dtype == np.int64 and t0.min() >= 0 and t0.max() < 1000
    assert step.cache_info().traces == 1


def test_seed_argument_keeps_its_numbers(backend):
    a = fl.rand(32, seed=5).numpy()
    np.testing.assert_array_equal(fl.rand(32, seed=5).numpy(), a)
    with pytest.raises(TypeError, match="seed= or generator="):
        fl.rand(3, seed=1, generator=fl.Generator())


def test_randint_randperm_multinomial_bernoulli(backend):
    generator = fl.Generator().manual_seed(8)
    values = fl.randint(-3, 4, (5000,), generator=generator).numpy()
    assert values.min() == -3 and values.max() == 3
    assert fl.randint(10, (3,)).shape == (3,)
    perm = fl.randperm(50, generator=generator).numpy()
    np.testing.assert_array_equal(np.sort(perm), np.arange(50))
    probs = fl.tensor(np.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]], dtype=np.float32))
    picks = fl.multinomial(probs, 4, replacement=True, generator=generator).numpy()
    assert (picks[0] == 1).all() and set(np.unique(picks[1])) <= {0, 2}
    coins = fl.bernoulli(fl.full((4000,), 0.25), generator=generator).numpy()
    assert 0.2 < coins.mean() < 0.3


def test_host_draws_refuse_inside_compile():
    with fl.backend("reference"):

        @fl.compile
        def shuffled(x):
            return x[fl.randperm(x.shape[0])]

        with pytest.raises(fl.TraceError, match="randperm"):
            shuffled(fl.zeros(4))


def test_checkpoint_replays_dropout_and_differentiates_closed_over_weights(backend, rng):
    w = fl.tensor(rng.standard_normal((6, 6)).astype(np.float32)).requires_grad_()
    x = fl.tensor(rng.standard_normal((3, 6)).astype(np.float32)).requires_grad_()

    def block(h):
        return F.dropout((h @ w).tanh(), 0.3) * 1.5

    fl.manual_seed(77)
    fl.checkpoint(block, x).sum().backward()
    checkpointed = (w.grad.numpy(), x.grad.numpy())
    assert np.abs(checkpointed[0]).max() > 0  # the weights get a gradient
    w.grad = x.grad = None
    fl.manual_seed(77)
    block(x).sum().backward()
    np.testing.assert_allclose(checkpointed[0], w.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(checkpointed[1], x.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_checkpoint_closed_over_gradient_matches_pytorch(rng):
    torch = pytest.importorskip("torch", reason="PyTorch is the oracle of this test")
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    w0 = rng.standard_normal((5, 5)).astype(np.float32)
    x0 = rng.standard_normal((2, 5)).astype(np.float32)
    with fl.backend("reference"):
        w = fl.tensor(w0).requires_grad_()
        x = fl.tensor(x0).requires_grad_()
        fl.checkpoint(lambda h: (h @ w).sin() * w[0], x, use_reentrant=False).sum().backward()
        ours = w.grad.numpy()
    tw = torch.tensor(w0, requires_grad=True)
    tx = torch.tensor(x0, requires_grad=True)
    torch_checkpoint(lambda h: (h @ tw).sin() * tw[0], tx, use_reentrant=False).sum().backward()
    np.testing.assert_allclose(ours, tw.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_checkpoint_refuses_unknown_keywords():
    with fl.backend("reference"), pytest.raises(TypeError, match="unexpected keyword"):
        fl.checkpoint(lambda h: h * 2, fl.ones(2), debug=True)


@pytest.mark.gpu
def test_cuda_graph_replays_draw_new_numbers():
    with fl.backend("cuda"):

        @fl.compile(cuda_graph=True)
        def step(x):
            noise = fl.randn_like(x)
            return (x + noise).sum(-1), noise * 2

        x = fl.zeros(8, 128)
        fl.manual_seed(5)
        first = [v.numpy() for v in step(x)]
        second = [v.numpy() for v in step(x)]
        third = [v.numpy() for v in step(x)]
        info = step.cache_info()
        assert info.traces == 1 and info.graph_replays >= 1, info
        assert not np.array_equal(first[1], second[1]) and not np.array_equal(second[1], third[1])
        fl.manual_seed(5)
        np.testing.assert_array_equal(step(x)[1].numpy(), first[1])


@pytest.mark.gpu
def test_generated_entries_that_miss_give_their_numbers_back():
    """Two one-kernel programs of one function, called in turn: each call first tries the
    other's generated entry (a miss), which must not consume numbers."""
    with fl.backend("cuda"):
        step = fl.compile(lambda x: x + fl.rand_like(x))
        inputs = [fl.zeros(16), fl.zeros(16, dtype=fl.float16)] * 3
        fl.manual_seed(1)
        compiled = [step(x).numpy() for x in inputs]
        fl.manual_seed(1)
        lazy = [(x + fl.rand_like(x)).numpy() for x in inputs]
        for expected, actual in zip(lazy, compiled):
            np.testing.assert_allclose(actual, expected, rtol=1e-3)
        assert step.cache_info().traces == 2


def test_compiled_step_with_checkpointed_dropout_matches_the_plain_step(backend, rng):
    w = fl.tensor(rng.standard_normal((4, 4)).astype(np.float32)).requires_grad_()
    x = fl.tensor(rng.standard_normal((3, 4)).astype(np.float32))

    def block(h):
        return F.dropout((h @ w).tanh(), 0.5)

    def checkpointed(x):
        loss = fl.checkpoint(block, x).sum()
        loss.backward()
        return loss

    def plain(x):
        loss = block(x).sum()
        loss.backward()
        return loss

    runs = []
    for function in (checkpointed, plain):
        step = fl.compile(function)
        fl.manual_seed(0)
        calls = []
        for _ in range(3):
            w.grad = None
            loss = step(x)
            calls.append((loss.item(), w.grad.numpy().copy()))
        runs.append(calls)
    assert len({loss for loss, _ in runs[0]}) == 3  # new dropout masks at every call
    for (loss, grad), (plain_loss, plain_grad) in zip(*runs):
        assert loss == pytest.approx(plain_loss, rel=1e-6)
        np.testing.assert_allclose(grad, plain_grad, rtol=1e-5, atol=1e-6)
