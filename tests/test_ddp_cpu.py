"""DistributedDataParallel and DistributedSampler on the CPU: worlds of 2 and 3 processes on
the gloo backend, and what needs no world in this process.

Each rank is this file run as a script (``python test_ddp_cpu.py SCENARIO``) with RANK
WORLD_SIZE MASTER_ADDR MASTER_PORT and FLAME_BACKEND=reference in its environment; the
scenario asserts its own results and exits 0 (the harness of test_distributed_cpu.py). The
oracle of every gradient is one process over the whole batch, computed in each rank with a
model built from rank 0's seed. The nccl path runs here over a stand-in group of one on the
reference backend (eager and inside flame.compile); the gpu tier runs it through NCCL, a
world of one and (with 2 GPUs) the train and compiled scenarios on two ranks.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

WORLD_DEADLINE_S = 60.0
# the oracle runs on the same backend; GPU reductions sum in another order
ON_GPU = os.environ.get("FLAME_BACKEND") == "cuda"
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5} if ON_GPU else {"rtol": 2e-5, "atol": 1e-6}


# --- the harness ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_world(scenario: str, world_size: int, process_group: str = "gloo") -> dict:
    """{rank: (returncode, output)}; a new port where another process took the port. With
    ``process_group="nccl"`` each rank drives GPU ``rank`` (LOCAL_RANK), tensors on cuda."""
    for _ in range(3):
        port, processes = free_port(), {}
        for rank in range(world_size):
            backend = "cuda" if process_group == "nccl" else "reference"
            environment = dict(os.environ, FLAME_BACKEND=backend, RANK=str(rank))
            environment.update(WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1")
            environment.update(MASTER_PORT=str(port), FLAME_TEST_PG=process_group)
            environment.update(LOCAL_RANK=str(rank))
            environment.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
            processes[rank] = subprocess.Popen(
                [sys.executable, __file__, scenario],
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        deadline, results = time.monotonic() + WORLD_DEADLINE_S, {}
        try:
            for rank, process in processes.items():
                output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
                results[rank] = (process.returncode, output)
        except subprocess.TimeoutExpired:
            for process in processes.values():
                process.kill()
            outputs = {rank: process.communicate()[0] for rank, process in processes.items()}
            pytest.fail(f"{scenario}: the world hung past {WORLD_DEADLINE_S}s: {outputs}")
        if not any("is the port in use" in output for _, output in results.values()):
            break
    return results


def assert_all_passed(results: dict) -> None:
    failed = {rank: output for rank, (code, output) in results.items() if code != 0}
    assert not failed, f"ranks failed: {failed}"


# --- models and data (the same in every rank) --------------------------------------------------
def make_mlp(seed: int):
    import flame as fl
    import flame.nn as nn

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
            )
            self.register_buffer("scale", fl.full((3,), 0.5))

        def forward(self, x):
            return self.body(x) * self.scale

    fl.manual_seed(seed)
    return Scaled()


def make_convnet(seed: int):
    import flame as fl
    import flame.nn as nn

    fl.manual_seed(seed)
    layers = [nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, stride=2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(16, 3))


def batch(size: int, shape, seed: int):
    import flame as fl

    data = np.random.default_rng(seed)
    inputs = data.standard_normal((size, *shape)).astype(np.float32)
    targets = data.standard_normal((size, 3)).astype(np.float32)
    return fl.tensor(inputs), fl.tensor(targets)


def loss_of(model, inputs, targets):
    import flame.nn.functional as F

    return F.mse_loss(model(inputs), targets)


def shard(tensor, rank: int, world: int):
    size = tensor.shape[0] // world
    return tensor[rank * size : (rank + 1) * size]


def grads(model) -> dict:
    return {name: p.grad.numpy() for name, p in model.named_parameters()}


def assert_grads_equal(model, reference, what: str, shift: float = 0.0) -> None:
    expected = grads(reference)
    for name, value in grads(model).items():
        np.testing.assert_allclose(
            value, expected[name] + shift, err_msg=f"{what}: {name}", **TOLERANCE
        )


def sgd_step(model, lr: float = 0.1) -> None:
    import flame as fl

    with fl.no_grad():
        for p in model.parameters():
            p.sub_(p.grad * lr)


def full_batch_reference(make, seed, inputs, targets):
    reference = make(seed)
    loss_of(reference, inputs, targets).backward()
    return reference


# --- scenarios (run inside each rank) ---------------------------------------------------------
def assert_same_on_every_rank(model) -> None:
    import flame as fl
    import flame.distributed as dist

    flat = fl.cat([p.reshape(-1) for p in model.parameters()])
    everyone = [fl.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, flat)
    for other in everyone:
        np.testing.assert_array_equal(other.numpy(), flat.numpy())


def join():
    import flame.distributed as dist

    process_group = os.environ.get("FLAME_TEST_PG", "gloo")
    dist.init_process_group(process_group, timeout=datetime.timedelta(seconds=60))
    return dist


def scenario_train():
    """Broadcast at wrap, gradients against the full batch (one bucket, many buckets, a conv
    net), no_sync, buffers, an optimizer step, state_dict: every rank checks itself."""
    from flame.nn.parallel import DistributedDataParallel as DDP

    dist = join()
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, targets = batch(12, (6,), seed=0)

    # ranks start with different weights and buffers; the wrap gives them rank 0's
    model = make_mlp(seed=100 + rank)
    model.scale.fill_(float(rank + 1))
    start = make_mlp(seed=100)
    pairs = zip(model.parameters(), start.parameters())
    assert all(np.array_equal(p.numpy(), q.numpy()) for p, q in pairs) == (rank == 0)
    ddp = DDP(model)
    for (name, p), q in zip(model.named_parameters(), start.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy(), err_msg=name)
    assert model.scale.tolist() == [1.0] * 3  # rank 0's buffer
    assert len(ddp._bucket_names()) == 1  # 2 KB of parameters: under the 1 MiB first bucket

    # one synchronized step == one process over the whole batch (the buffer taken from rank 0
    # again before the forward: the reference scale is 1.0)
    model.scale.fill_(float(rank + 1))
    loss_of(ddp, shard(inputs, rank, world), shard(targets, rank, world)).backward()
    assert model.scale.tolist() == [1.0] * 3
    reference = make_mlp(seed=100)
    reference.scale.fill_(1.0)
    loss_of(reference, inputs, targets).backward()
    assert_grads_equal(model, reference, "one bucket")

    # an SGD step on every rank keeps them equal (to each other and to the reference)
    sgd_step(ddp)
    sgd_step(reference)
    assert_same_on_every_rank(model)
    for p, q in zip(model.parameters(), reference.parameters()):
        np.testing.assert_allclose(p.numpy(), q.numpy(), **TOLERANCE)

    # no_sync: two micro-batches, the first only local, the second averages the sum
    ddp.zero_grad()
    first, second = (batch(12, (6,), seed=s) for s in (1, 2))
    with ddp.no_sync():
        loss_of(ddp, shard(first[0], rank, world), shard(first[1], rank, world)).backward()
    local = make_mlp(seed=0)
    local.load_state_dict(model.state_dict())
    loss_of(local, shard(first[0], rank, world), shard(first[1], rank, world)).backward()
    assert_grads_equal(model, local, "inside no_sync (not averaged)")
    loss_of(ddp, shard(second[0], rank, world), shard(second[1], rank, world)).backward()
    whole = make_mlp(seed=0)
    whole.load_state_dict(model.state_dict())
    (loss_of(whole, *first) + loss_of(whole, *second)).backward()
    assert_grads_equal(model, whole, "no_sync then a synchronized step")

    # the sampler's defaults come from the group
    from flame.utils.data import DistributedSampler

    shares = [list(DistributedSampler(range(10), world, other, seed=3)) for other in range(world)]
    assert list(DistributedSampler(range(10), seed=3)) == shares[rank]

    # state_dict: PyTorch's keys, loading round trip
    state = ddp.state_dict()
    assert list(state) == ["module." + key for key in model.state_dict()], list(state)
    copy = DDP(make_mlp(seed=7))
    copy.load_state_dict(state)
    for p, q in zip(copy.parameters(), model.parameters()):
        np.testing.assert_array_equal(p.numpy(), q.numpy())

    # many buckets (a tiny cap), and the bucket views kept across two steps
    small = DDP(make_mlp(seed=100 + rank), bucket_cap_mb=0.0002, gradient_as_bucket_view=True)
    names = small._bucket_names()
    assert len(names) >= 3 and names[0][0] == "body.4.bias", names
    for step_seed in (3, 4):
        small.zero_grad()
        step_inputs, step_targets = batch(12, (6,), seed=step_seed)
        local_batch = shard(step_inputs, rank, world), shard(step_targets, rank, world)
        loss_of(small, *local_batch).backward()
        expected = full_batch_reference(make_mlp, 100, step_inputs, step_targets)
        assert_grads_equal(small.module, expected, f"{len(names)} buckets, step {step_seed}")

    # a conv net, buckets of one or two parameters
    images, labels = batch(12, (2, 5, 5), seed=5)
    conv = DDP(make_convnet(seed=200 + rank), bucket_cap_mb=0.0002)
    assert len(conv._bucket_names()) >= 3
    loss_of(conv, shard(images, rank, world), shard(labels, rank, world)).backward()
    assert_grads_equal(conv.module, full_batch_reference(make_convnet, 200, images, labels), "conv")
    dist.destroy_process_group()


def scenario_unused():
    """find_unused_parameters: a parameter only rank 0 uses, one nobody uses; and without the
    flag, the next forward names the parameter that got no gradient."""
    import flame.nn as nn
    from flame.nn.parallel import DistributedDataParallel as DDP

    dist = join()
    rank, world = dist.get_rank(), dist.get_world_size()

    class Branches(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Linear(6, 3)
            self.only_rank0 = nn.Linear(6, 3)
            self.never = nn.Linear(6, 3)

        def forward(self, x, use_extra: bool):
            out = self.trunk(x)
            return out + self.only_rank0(x) if use_extra else out

    inputs, targets = batch(12, (6,), seed=6)

    def build():
        import flame as fl

        fl.manual_seed(9)
        return Branches()

    def local_loss(model, which):
        x, y = shard(inputs, which, world), shard(targets, which, world)
        import flame.nn.functional as F

        return F.mse_loss(model(x, which == 0), y)

    model = DDP(build(), find_unused_parameters=True, bucket_cap_mb=0.0001)
    local_loss(model, rank).backward()
    per_rank = []
    for other in range(world):  # the oracle: every rank's local gradient, averaged
        reference = build()
        local_loss(reference, other).backward()
        per_rank.append(reference)
    for name, p in model.module.named_parameters():
        if name.startswith("never"):
            assert p.grad is None, name  # unused on every rank: left alone, as PyTorch
            continue
        contributions = [dict(r.named_parameters())[name].grad for r in per_rank]
        expected = sum(g.numpy() for g in contributions if g is not None) / world
        np.testing.assert_allclose(p.grad.numpy(), expected, err_msg=name, **TOLERANCE)

    strict = DDP(build())
    local_loss(strict, 1).backward()  # only_rank0 and never get no gradient on any rank
    try:
        local_loss(strict, 1)
    except RuntimeError as error:
        message = str(error)
        assert "find_unused_parameters=True" in message, message
        assert "only_rank0.weight" in message and "never.bias" in message, message
        assert "trunk" not in message.split("rank")[-1], message
    else:
        raise AssertionError("an unfinished reduction was not reported")
    dist.destroy_process_group()


def scenario_compiled():
    """nccl: the whole step (forward, backward) compiled; buffers and gradients as eager."""
    import flame as fl
    from flame.nn.parallel import DistributedDataParallel as DDP

    dist = join()
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DDP(make_mlp(seed=100 + rank), bucket_cap_mb=0.0002)
    ddp.module.scale.fill_(float(rank + 1))  # the compiled forward takes rank 0's again

    @fl.compile
    def step(x, y):
        loss = loss_of(ddp, x, y)
        loss.backward()
        return loss

    for seed in (20, 21, 22):
        ddp.zero_grad()
        inputs, targets = batch(12, (6,), seed=seed)
        step(shard(inputs, rank, world), shard(targets, rank, world))
        assert ddp.module.scale.tolist() == [1.0] * 3
        expected = make_mlp(seed=0)
        expected.load_state_dict(ddp.module.state_dict())
        loss_of(expected, inputs, targets).backward()
        assert_grads_equal(ddp.module, expected, f"compiled, batch {seed}")
        sgd_step(ddp)
    assert step.cache_info().traces == 1, step.cache_info()
    assert_same_on_every_rank(ddp)
    dist.destroy_process_group()


def scenario_mismatch():
    import flame.nn as nn
    from flame.nn.parallel import DistributedDataParallel as DDP

    dist = join()
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 5 if rank == 2 else 3))
    with dist.abort_on_error():
        DDP(model)


# --- the tests: worlds ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_training_matches_one_process_over_the_whole_batch(world_size):
    assert_all_passed(run_world("train", world_size))


@pytest.mark.slow
def test_ddp_unused_parameters():
    assert_all_passed(run_world("unused", 2))


@pytest.mark.slow
def test_ddp_model_mismatch_fails_on_every_rank_naming_the_parameter():
    results = run_world("mismatch", 3)
    for rank, (code, output) in results.items():
        assert code != 0, f"rank {rank} passed: {output}"
        assert "the model differs across ranks" in output, output
        assert "parameter '2.weight' is float32[5, 8] on rank 2 but float32[3, 8] on rank 0" in (
            output
        ), output
        assert f"this process is rank {rank}" in output, output


if __name__ == "__main__":
    globals()[f"scenario_{sys.argv[1]}"]()


# --- in this process: buckets, hooks, the sampler, bad input ---------------------------------
def _params(specs):
    import flame as fl

    with fl.backend("reference"):
        return [fl.zeros(count, dtype=getattr(fl, dtype)) for count, dtype in specs]


BUCKET_CASES = [
    ([(3, "float32"), (100, "float32"), (5, "float64"), (300, "float32")], [400, 1000]),
    ([(50, "float32")] * 12 + [(7, "float16"), (900, "float16")], [256, 600]),
    ([(1, "float32")] * 5, [1000]),
    ([(1000, "float32"), (10, "bfloat16"), (1000, "float32")], [64]),
]


@pytest.mark.parametrize("specs,limits", BUCKET_CASES)
def test_bucket_assignment_is_pytorchs(specs, limits):
    torch = pytest.importorskip("torch", reason="the oracle is PyTorch's reducer")
    import torch.distributed as torch_dist

    from flame.nn.parallel.reducer import assign_buckets

    if not torch_dist.is_available():
        pytest.skip("this PyTorch build has no torch.distributed")
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16}
    dtypes.update(float32=torch.float32, float64=torch.float64)
    tensors = [torch.zeros(count, dtype=dtypes[dtype]) for count, dtype in specs]
    order = list(reversed(range(len(tensors))))  # gradient-ready order, as after a rebuild
    expected, _ = torch_dist._compute_bucket_assignment_by_size(
        [tensors[i] for i in order], limits, [False] * len(tensors), order
    )
    buckets = assign_buckets(_params(specs), limits)
    # the same buckets; PyTorch lists the buckets left open at the end in hash order
    assert sorted(bucket.indices for bucket in buckets) == sorted(list(b) for b in expected)


def test_bucket_assignment_rules_without_torch():
    from flame.nn.parallel.reducer import assign_buckets

    specs = [(100, "float32")] * 6 + [(10, "float64"), (10, "float32")]
    buckets = assign_buckets(_params(specs), [200, 800])
    # reverse order; a bucket closes once it holds its limit: the first float32 bucket's is
    # 200 bytes, the later ones' 800; the float64 parameter never shares a float32 bucket;
    # the buckets still open at the end come last
    assert [b.indices for b in buckets] == [[7, 5], [4, 3], [2, 1], [0], [6]]
    assert [b.offsets for b in buckets] == [[0, 10], [0, 100], [0, 100], [0], [0]]
    assert [b.numel for b in buckets] == [110, 200, 200, 100, 10]


def test_post_accumulate_grad_hook(reference_backend):
    import flame as fl

    weight = fl.tensor(np.array([1.0, 2.0], np.float32)).requires_grad_()
    seen = []
    handle = weight.register_post_accumulate_grad_hook(
        lambda tensor: seen.append((tensor is weight, tensor.grad.tolist()))
    )
    (weight * 3).sum().backward()
    (weight * weight).sum().backward()  # accumulated: the hook sees the sum
    assert seen == [(True, [3.0, 3.0]), (True, [5.0, 7.0])]
    handle.remove()
    weight.sum().backward()
    assert len(seen) == 2
    with pytest.raises(RuntimeError, match="non-leaf"):
        (weight * 2).register_post_accumulate_grad_hook(lambda tensor: None)
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        fl.ones(2).register_post_accumulate_grad_hook(lambda tensor: None)
    weight.register_post_accumulate_grad_hook(lambda tensor: tensor.grad)
    with pytest.raises(RuntimeError, match="should return None"):
        weight.sum().backward()


@pytest.fixture
def world_of_one(reference_backend):
    import flame.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{free_port()}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=10),
    )
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def test_world_of_one_and_bad_input(world_of_one):
    import flame as fl
    import flame.nn as nn
    from flame.nn.parallel import DistributedDataParallel as DDP

    model = make_mlp(seed=3)
    ddp = DDP(model, bucket_cap_mb=0.0002)
    inputs, targets = batch(4, (6,), seed=8)
    loss_of(ddp, inputs, targets).backward()
    assert_grads_equal(model, full_batch_reference(make_mlp, 3, inputs, targets), "world of 1")

    step = fl.compile(lambda x: ddp(x).sum())
    with pytest.raises(RuntimeError, match="inside flame.compile is not supported"):
        step(inputs)
    with pytest.raises(ValueError, match="device_ids and output_device arguments only work"):
        DDP(make_mlp(seed=3), device_ids=[0])
    with pytest.raises(ValueError, match="device_ids can only be None or contain a single"):
        DDP(make_mlp(seed=3), device_ids=[0, 1])
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(RuntimeError, match="doesn't have any parameter that requires a grad"):
        DDP(frozen)
    with pytest.raises(NotImplementedError, match="only the default process group"):
        DDP(make_mlp(seed=3), process_group=object())
    with pytest.raises(TypeError, match="expected a flame.nn.Module"):
        DDP(lambda x: x)


def test_ddp_without_a_process_group(reference_backend):
    from flame.nn.parallel import DistributedDataParallel as DDP
    from flame.utils.data import DistributedSampler

    with pytest.raises(RuntimeError, match="has not been initialized"):
        DDP(make_mlp(seed=0))
    with pytest.raises(RuntimeError, match="has not been initialized"):
        DistributedSampler(range(10))


SAMPLER_CASES = [
    (size, replicas, shuffle, drop_last)
    for size in (0, 1, 7, 10, 23)
    for replicas in (1, 3, 4)
    for shuffle in (False, True)
    for drop_last in (False, True)
]


@pytest.mark.parametrize("size,replicas,shuffle,drop_last", SAMPLER_CASES)
def test_distributed_sampler_is_pytorchs(size, replicas, shuffle, drop_last):
    torch_data = pytest.importorskip("torch.utils.data", reason="the oracle is PyTorch's")
    from flame.utils.data import DistributedSampler

    for rank in range(replicas):
        for epoch in (0, 5):
            mine = DistributedSampler(range(size), replicas, rank, shuffle, 17, drop_last)
            theirs = torch_data.DistributedSampler(
                range(size), replicas, rank, shuffle, 17, drop_last
            )
            mine.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(mine) == list(theirs) and len(mine) == len(theirs)


def test_distributed_sampler_rules_without_torch():
    from flame.utils import data
    from flame.utils.data.distributed import DistributedSampler

    assert data.DistributedSampler is DistributedSampler and issubclass(
        DistributedSampler, data.Sampler
    )
    shares = [list(DistributedSampler(range(10), 4, rank, shuffle=False)) for rank in range(4)]
    # padded with the first indices to 12, then every 4th from the rank
    padded = list(range(10)) + [0, 1]
    assert shares == [padded[rank::4] for rank in range(4)]
    for rank in range(4):
        dropped = DistributedSampler(range(10), 4, rank, shuffle=False, drop_last=True)
        assert list(dropped) == list(range(8))[rank::4]

    def epoch_order(seed, epoch):
        samplers = [DistributedSampler(range(50), 3, rank, seed=seed) for rank in range(3)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        return [list(sampler) for sampler in samplers]

    order = epoch_order(seed=4, epoch=0)
    assert [len(share) for share in order] == [17] * 3
    flat = [index for share in zip(*order) for index in share]  # undo the striding
    assert sorted(flat[:50]) == list(range(50)) and flat[50:] == flat[:1]
    assert flat[:50] != list(range(50))  # shuffled
    assert epoch_order(seed=4, epoch=0) == order  # the same on every call and every rank
    assert epoch_order(seed=4, epoch=1) != order and epoch_order(seed=5, epoch=0) != order
    with pytest.raises(
        ValueError, match=r"Invalid rank 3, rank should be in the interval \[0, 2\]"
    ):
        DistributedSampler(range(5), num_replicas=3, rank=3)


@pytest.fixture
def nccl_stand_in(monkeypatch):
    """The default group is an nccl group of a world of one that lets reference tensors
    through (as tests/test_distributed_nccl.py's): DDP's nccl path, lazy collectives and
    flame.compile included, runs on the CPU; no communicator is ever reached."""
    import flame as fl
    import flame.distributed as dist
    from flame.distributed.nccl import NcclGroup
    from flame.runtime import reference

    group = NcclGroup.__new__(NcclGroup)
    group.rank, group.world_size, group.timeout, group.aborted = 0, 1, 5.0, None
    group.name = "nccl-stand-in"
    monkeypatch.setattr(group, "_check", lambda name, tensor: group.check_alive(name))
    monkeypatch.setattr(dist, "_default_group", dist._ProcessGroup("nccl", None, group))
    # the shape of every all-reduce the reference backend computes; ``shift`` is added to
    # their results, so a gradient that did not come out of one shows
    seen = SimpleNamespace(calls=[], shift=0.25)
    original = reference._evaluate_node

    def counted(node, *args):
        if node.op != "all_reduce":
            return original(node, *args)
        seen.calls.append(node.shape)
        return original(node, *args) + np.asarray(seen.shift, node.dtype.numpy)

    monkeypatch.setattr(reference, "_evaluate_node", counted)
    with fl.backend("reference"):
        yield seen


def test_ddp_on_nccl_eager_and_inside_compile(nccl_stand_in):
    import flame as fl
    from flame.nn.parallel import DistributedDataParallel as DDP

    nccl_checks(nccl_stand_in)

    class Partial(fl.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = fl.nn.Linear(6, 3), fl.nn.Linear(6, 3)

        def forward(self, x):
            return self.used(x)

    partial = DDP(Partial())
    inputs, targets = batch(4, (6,), seed=8)
    with pytest.raises(RuntimeError, match="not used: spare.weight, spare.bias"):
        fl.compile(lambda x, y: loss_of(partial, x, y).backward() or x.sum())(inputs, targets)


def nccl_checks(seen) -> None:
    """DDP over an nccl group of one (``seen.calls``: the shapes of the all-reduces run;
    ``seen.shift``: what the stand-in adds to their results), eager and compiled."""
    import flame as fl
    from flame.nn.parallel import DistributedDataParallel as DDP

    calls = seen.calls
    ddp = DDP(make_mlp(seed=3), bucket_cap_mb=0.0002)
    sizes = [
        [sum(dict(ddp.module.named_parameters())[name].numel() for name in names)]
        for names in ddp._bucket_names()
    ]
    inputs, targets = batch(4, (6,), seed=8)
    loss_of(ddp, inputs, targets).backward()  # eager: every bucket's all-reduce in one schedule
    # one all-reduce per bucket; their order is the schedule's (the same on every rank)
    assert sorted(list(shape) for shape in calls) == sorted(sizes)
    expected = full_batch_reference(make_mlp, 3, inputs, targets)
    assert_grads_equal(ddp.module, expected, "eager", shift=seen.shift)

    @fl.compile
    def step(x, y):
        loss = loss_of(ddp, x, y)
        loss.backward()
        return loss

    for seed in (9, 10, 11):
        calls.clear()
        ddp.zero_grad()
        inputs, targets = batch(4, (6,), seed=seed)
        with ddp.no_sync():  # traced once, replayed: the program always averages
            step(inputs, targets)
        assert sorted(list(shape) for shape in calls) == sorted(sizes), calls
        expected = make_mlp(seed=0)
        expected.load_state_dict(ddp.module.state_dict())
        loss_of(expected, inputs, targets).backward()
        assert_grads_equal(ddp.module, expected, f"compiled, batch {seed}", shift=seen.shift)
    assert step.cache_info().traces == 1


@pytest.mark.gpu
def test_ddp_world_of_one_through_nccl(monkeypatch):
    import flame as fl
    import flame.distributed as dist
    from flame.runtime import library, library_nccl

    try:
        library_nccl.load()
    except library_nccl.NcclUnavailable as error:
        pytest.skip(f"NCCL is not available: {error}")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen = SimpleNamespace(calls=[], shift=0.0)
    original = library.IMPLEMENTATIONS["all_reduce"]

    def counted(node, arrays):
        seen.calls.append(node.shape)
        return original(node, arrays)

    monkeypatch.setitem(library.IMPLEMENTATIONS, "all_reduce", counted)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=30),
    )  # fmt: skip
    try:
        with fl.backend("cuda"):
            nccl_checks(seen)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["train", "compiled"])
def test_ddp_two_ranks_on_two_gpus(scenario):
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001
        count = 0
    if count < 2:
        pytest.skip(f"needs 2 GPUs (one per rank), {count} visible")
    assert_all_passed(run_world(scenario, 2, process_group="nccl"))


def _described(entries, world_size=2, **options):
    return {"world_size": world_size, "options": options, "entries": entries}


W = ["parameter", "w", "float32[4, 3]", True]
B = ["buffer", "b", "int64[]", False]


@pytest.mark.parametrize(
    "other,message",
    [
        (_described([W, B]), None),
        (_described([W, B], world_size=3), "rank 1 has world_size 3, rank 0 has 2"),
        (
            _described([W[:2] + ["float32[4, 4]", True], B]),
            "'w' is float32[4, 4] on rank 1 but float32[4, 3] on rank 0",
        ),  # fmt: skip
        (_described([W[:3] + [False], B]), "'w' has requires_grad=False on rank 1"),
        (_described([W]), "rank 1 lacks buffer 'b' (int64[]) that rank 0 has"),
        (_described([W, B, ["parameter", "x", "float16[2]", True]]), "extra parameter 'x'"),
        (_described([B, W]), "rank 1 has buffer 'b' where rank 0 has parameter 'w'"),
        (_described([W, B], static_graph=True), "(static_graph=True) on rank 1, None on"),
    ],
)
def test_model_differences_are_named(other, message):
    from flame.nn.parallel.sync import _first_difference

    found = _first_difference(_described([W, B]), other, 1)
    assert found is None if message is None else message in found, found
