"""The diffusion example trained data-parallel (examples/diffusion/parallel.py): two ranks
through the real launcher (``python -m flame run --nproc-per-node 2``) on the gloo backend and
the reference interpreter, with the tiny UNet for a few steps; what only rank 0 writes; the
checkpoint loaded by one process; a rank that fails; and, in this process, the pieces that
need no world (the data shards, the generator streams).

Each rank runs a small script written into the test's folder that calls the example's
``main`` with its own model builder (the example's, recorded), then saves the rank's final
weights and the files it wrote or renamed under ``--out`` (an audit hook sees every
``open`` for writing, rename and removal) into a folder of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import flame as fl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the examples are not an installed package
    sys.path.insert(0, str(ROOT))

_MISSING = [
    name for name in ("sklearn", "PIL", "matplotlib", "tqdm")
    if importlib.util.find_spec(name) is None
]  # fmt: skip
needs_example_packages = pytest.mark.skipif(
    bool(_MISSING),
    reason=f"the diffusion example needs {', '.join(_MISSING)} (scikit-learn, Pillow, "
    "matplotlib, tqdm)",
)
DEADLINE_S = 120.0
# the tiny UNet at 8x8, two checkpoints, one sampling step: seconds on the reference backend
TINY = ["--reference", "--preset", "quick", "--size", "tiny", "--image-size", "8",
        "--batch-size", "8", "--warmup", "2", "--sample-steps", "1", "--columns", "1",
        "--no-progress"]  # fmt: skip

RANK_SCRIPT = """
import json, os, sys
from pathlib import Path

sys.path.insert(0, {root!r})
import flame as fl
from examples.diffusion import train

rank = int(os.environ["RANK"])
out = Path(sys.argv[sys.argv.index("--out") + 1]).resolve()
mine = Path(os.environ["FLAME_TEST_RANK_DIR"]) / f"rank{{rank}}"
mine.mkdir(parents=True)
writes = []

def audit(event, args):
    if event == "open" and args[0] is not None:
        mode, flags = args[1] or "", args[2] or 0
        writing = any(c in mode for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR)
        paths = [args[0]] if writing else []
    elif event in ("os.rename", "os.remove", "os.unlink"):
        paths = [args[0], args[1]] if event == "os.rename" else [args[0]]
    else:
        return
    for path in paths:
        if isinstance(path, (str, bytes, os.PathLike)):
            path = Path(os.fsdecode(path)).resolve()
            if out in path.parents:
                writes.append(f"{{event}} {{path.name}}")

sys.addaudithook(audit)
built = []

def builder(*args, **kwargs):
    model = train.default_builder(*args, **kwargs)
    built.append(model)
    if os.environ.get("FLAME_TEST_FAIL_RANK") == str(rank):
        forward = model.forward
        calls = []

        def failing(*inputs, **options):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError(f"injected failure in rank {{rank}}'s second step")
            return forward(*inputs, **options)

        model.forward = failing
    return model

summary = train.main(sys.argv[1:], builder=builder)
fl.save_file(dict(built[0].state_dict()), mine / "weights.safetensors")
(mine / "writes.json").write_text(json.dumps(writes))
(mine / "summary.json").write_text(json.dumps(summary))
"""


def launch_two_ranks(tmp_path: Path, out: Path, *arguments: str, **environment: str):
    """``flame run --nproc-per-node 2`` of the rank script; a new port where another process
    took the launcher's."""
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT.format(root=str(ROOT)))
    variables = dict(os.environ, **environment)
    variables.pop("FLAME_BACKEND", None)
    for _ in range(3):
        ranks = tmp_path / f"ranks-{time.monotonic_ns()}"
        variables["FLAME_TEST_RANK_DIR"] = str(ranks)
        result = subprocess.run(
            [sys.executable, "-m", "flame", "run", "--nproc-per-node", "2", str(script),
             *TINY, "--out", str(out), *arguments],
            cwd=ROOT, env=variables, capture_output=True, text=True, timeout=DEADLINE_S,
        )  # fmt: skip
        if "is the port in use" not in result.stderr:
            return result, ranks
    return result, ranks


def extra_of(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        return json.loads(handle.metadata()["flame.extra"])


def contents(path: Path) -> dict:
    """A checkpoint's entries: its tensors' names with their shapes, and the optimizer's
    per-parameter numbers kept in its JSON instead (a step count is a tensor after a compiled
    step, a number after a lazy one, as the gloo ranks run it)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as handle:
        entries = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
        optimizer = json.loads(handle.metadata()["flame.optimizer"])
    for index, numbers in optimizer["state"].items():
        for key, value in numbers.items():
            entries[f"optimizer.state.{index}.{key}"] = value
    return entries


def load(path: Path) -> dict:
    return {name: value.numpy() for name, value in fl.load_file(path, device="cpu").items()}


# --- two ranks through the launcher ------------------------------------------------------------


@needs_example_packages
@pytest.mark.slow
def test_two_ranks_train_rank0_writes_and_one_process_resumes(tmp_path):
    from examples.diffusion import train

    two = tmp_path / "two"
    result, ranks = launch_two_ranks(tmp_path, two, "--steps", "4", "--save-every", "2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "[rank0]: data-parallel: 2 ranks on gloo" in result.stdout, result.stdout

    # rank 0 alone wrote the outputs; rank 1 wrote nothing there
    names = sorted(path.name for path in two.iterdir())
    assert names == ["ckpt-00000002.safetensors", "ckpt-00000004.safetensors", "loss.png",
                     "quality.json", "samples.png"]  # fmt: skip
    writes = [json.loads((ranks / f"rank{rank}" / "writes.json").read_text()) for rank in (0, 1)]
    assert writes[1] == [], writes[1]
    assert any("loss.png" in entry for entry in writes[0]), writes[0]  # the hook sees writes
    assert any("ckpt-00000004.safetensors" in entry for entry in writes[0]), writes[0]
    summaries = [
        json.loads((ranks / f"rank{rank}" / "summary.json").read_text()) for rank in (0, 1)
    ]
    assert summaries[0]["agreement"] is not None and summaries[1]["agreement"] is None
    assert summaries[0]["final_loss"] == summaries[1]["final_loss"]  # the mean over the ranks

    # both ranks end with identical weights, the checkpoint's (the unwrapped model: no prefix)
    weights = [load(ranks / f"rank{rank}" / "weights.safetensors") for rank in (0, 1)]
    assert weights[0].keys() == weights[1].keys() and weights[0]
    for name, value in weights[0].items():
        np.testing.assert_array_equal(weights[1][name], value, err_msg=name)
    last, first = load(two / "ckpt-00000004.safetensors"), load(two / "ckpt-00000002.safetensors")
    for name, value in weights[0].items():
        np.testing.assert_array_equal(last[f"model.{name}"], value, err_msg=name)
    assert any(not np.array_equal(first[name], last[name]) for name in last if "model." in name)

    # the same checkpoint keys as one process's run
    one = tmp_path / "one"
    train.main([*TINY, "--out", str(one), "--steps", "4", "--save-every", "2"])
    mine, theirs = (contents(run / "ckpt-00000004.safetensors") for run in (two, one))
    assert sorted(mine) == sorted(theirs)
    for name, value in mine.items():
        assert value == (4.0 if name.endswith(".step") else theirs[name]), name
    assert (
        extra_of(one / "ckpt-00000004.safetensors").keys()
        == extra_of(two / "ckpt-00000004.safetensors").keys()
    )

    # one process resumes the two ranks' checkpoint, at the global batch of 16 they trained
    # with: the data continue where the two ranks stopped, the generator stream is rank 0's
    saved = extra_of(two / "ckpt-00000004.safetensors")
    assert saved["data"] == {"epoch": 0, "batch": 4, "images": 64}
    summary = train.main(
        [*TINY, "--out", str(two), "--resume", "--steps", "6", "--save-every", "2",
         "--batch-size", "16"]
    )  # fmt: skip
    assert summary["steps"] == 6
    resumed = extra_of(two / "ckpt-00000006.safetensors")
    assert resumed["data"] == {"epoch": 0, "batch": 6, "images": 96}
    assert len(resumed["losses"]) == 6 and resumed["losses"][:4] == saved["losses"]
    assert resumed["generator"][0] == saved["generator"][0]
    assert resumed["generator"][1] > saved["generator"][1]


@needs_example_packages
@pytest.mark.slow
def test_a_failing_rank_stops_the_other_with_its_message(tmp_path):
    started = time.monotonic()
    result, _ = launch_two_ranks(
        tmp_path, tmp_path / "out", "--steps", "6", "--save-every", "100", FLAME_TEST_FAIL_RANK="1"
    )
    assert time.monotonic() - started < DEADLINE_S / 2  # no timeout waited for
    assert result.returncode != 0
    assert "injected failure in rank 1's second step" in result.stderr, result.stderr[-4000:]
    # rank 0, waiting for rank 1 in the gradients' all-reduce, fails with rank 1's message
    # or is stopped by the launcher, whichever comes first
    lines = [line for line in result.stderr.splitlines() if line.startswith("[rank0]:")]
    told = any("rank 1 failed: RuntimeError: injected failure" in line for line in lines)
    assert told or "flame run: rank 0: stopped by SIGTERM" in result.stderr, result.stderr[-4000:]
    assert not (tmp_path / "out" / "loss.png").exists()


# --- what needs no world ------------------------------------------------------------------------


@needs_example_packages
def test_rank_shards_make_the_global_batches_of_one_process(reference_backend):
    from examples.diffusion.data import BatchLoader, DataError, Dataset

    count = 23
    images = np.arange(count, dtype=np.float32).reshape(count, 1, 1, 1)
    data = Dataset(images, np.arange(count, dtype=np.int64), ["x"])
    ranks = [BatchLoader(data, 3, seed=5, rank=rank, world_size=2) for rank in (0, 1)]
    whole = BatchLoader(data, 6, seed=5)
    try:
        for _ in range(5):  # 3 batches an epoch on each rank (11 images each), then epoch 1
            shards = [next(loader)[1].numpy() for loader in ranks]
            assert not set(shards[0]) & set(shards[1])
            assert sorted(np.concatenate(shards)) == sorted(next(whole)[1].numpy())
        state = ranks[0].state_dict()
        assert state == ranks[1].state_dict() == {"epoch": 1, "batch": 2, "images": 12}
        following = next(whole)[1].numpy()
        again = BatchLoader(data, 6, seed=5)  # one process from the two ranks' position
        again.load_state_dict(state)
        np.testing.assert_array_equal(next(again)[1].numpy(), following)
        again.close()
    finally:
        for loader in (*ranks, whole):
            loader.close()
    with pytest.raises(DataError, match=r"larger than a rank's share .* \(5 with 4 ranks\)"):
        BatchLoader(data, 6, rank=0, world_size=4)


def test_launched_and_the_streams_of_the_ranks(reference_backend):
    from examples.diffusion import parallel

    assert parallel.launched({"RANK": "0", "WORLD_SIZE": "2"})
    assert not parallel.launched({"RANK": "0"}) and not parallel.launched({})
    streams = {}
    for rank in (0, 1, 2):
        generator = fl.Generator().manual_seed(41)
        fl.rand(5, generator=generator)  # an offset to keep
        before = generator.get_state().numpy().tolist()
        parallel.own_streams(parallel.World(rank, 3, "gloo"), generator)
        after = generator.get_state().numpy().tolist()
        assert after == [before[0] + rank, before[1]]
        streams[rank] = fl.rand(4, generator=generator).numpy()
    assert not np.array_equal(streams[0], streams[1])
    assert not np.array_equal(streams[1], streams[2])
    assert parallel.rank_seed(2**63 - 1, 1) == -(2**63)  # int64 wraps
    one = parallel.ONE_PROCESS
    assert (one.rank, one.world_size, one.distributed, one.is_main, one.compiles) == (
        0, 1, False, True, True,
    )  # fmt: skip
    assert not parallel.World(1, 2, "gloo").compiles and parallel.World(1, 2, "nccl").compiles


@pytest.fixture
def nccl_world_of_one(monkeypatch):
    """The default group is an nccl group of one that lets reference tensors through (as in
    tests/test_ddp_cpu.py): the example's DistributedDataParallel step compiles and runs on
    the CPU with its collectives as IR nodes; counts the all-reduces the reference runs."""
    import flame.distributed as dist
    from flame.distributed.nccl import NcclGroup
    from flame.runtime import reference

    group = NcclGroup.__new__(NcclGroup)
    group.rank, group.world_size, group.timeout, group.aborted = 0, 1, 5.0, None
    group.name = "nccl-stand-in"
    monkeypatch.setattr(group, "_check", lambda name, tensor: group.check_alive(name))
    monkeypatch.setattr(dist, "_default_group", dist._ProcessGroup("nccl", None, group))
    calls = []
    original = reference._evaluate_node

    def counted(node, *args):
        if node.op == "all_reduce":
            calls.append(node.shape)
        return original(node, *args)

    monkeypatch.setattr(reference, "_evaluate_node", counted)
    with fl.backend("reference"):
        yield calls


@needs_example_packages
def test_the_compiled_ddp_step_is_the_plain_one_in_a_world_of_one(nccl_world_of_one, rng):
    from examples.diffusion import parallel, train
    from flame.nn.parallel import DistributedDataParallel

    options = train.parse_args([*TINY, "--out", "unused"], gpu=False)
    config = {"model": "unet", "size": "tiny", "image_size": 8, "channels": 1,
              "num_classes": 10, "schedule": "linear", "prediction": "eps"}  # fmt: skip
    ddp = train.Trainer(options, config, world=parallel.World(0, 1, "nccl"))
    plain = train.Trainer(options, config)
    for trainer in (ddp, plain):
        trainer.prepare()
    assert isinstance(ddp.forward_model, DistributedDataParallel)
    assert plain.forward_model is plain.model
    images = fl.tensor(rng.uniform(-1, 1, (4, 1, 8, 8)).astype(np.float32)).realize()
    labels = fl.tensor(np.array([0, 3, 7, 9], dtype=np.int64)).realize()
    dropout = fl.get_rng_state()  # the models' dropout draws from the default generator
    losses = []
    for _ in range(3):
        nccl_world_of_one.clear()
        losses.append(ddp.run_step(images, labels)[0].item())
        assert nccl_world_of_one, "the compiled step ran no all-reduce"
    fl.set_rng_state(dropout)
    expected = [plain.run_step(images, labels)[0].item() for _ in range(3)]
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert ddp.compiled.cache_info().traces == 1
    for (name, mine), theirs in zip(ddp.model.named_parameters(), plain.model.parameters()):
        np.testing.assert_allclose(mine.numpy(), theirs.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
