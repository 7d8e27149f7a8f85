"""Weights through safetensors (flame/io.py): round trips bit for bit, PyTorch's files both
ways, every bad file named by file and key, checkpoints that resume a run exactly.

CPU tier: the reference backend, and the cuda path's chunked copies with CuPy replaced by a
host stand-in (so the offsets arithmetic is tested here). gpu tier: loading to the GPU.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
import types

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import flame as fl
from flame import io
from flame.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from flame.runtime import file_uploads

DTYPES = [
    (fl.float32, "F32"), (fl.float16, "F16"), (fl.bfloat16, "BF16"), (fl.float64, "F64"),
    (fl.int64, "I64"), (fl.int32, "I32"), (fl.int16, "I16"), (fl.int8, "I8"),
    (fl.uint8, "U8"), (fl.bool_, "BOOL"),
]  # fmt: skip
SHAPES = [(3, 5), (), (0, 4), (2, 3, 4)]


@pytest.fixture(autouse=True)
def keep_default_generator():
    """Checkpoint tests seed and restore the default generator: put it back after each."""
    state = fl.get_rng_state().numpy().copy()
    yield
    fl.set_rng_state(state)


def random_values(rng, dtype, shape) -> np.ndarray:
    """Any bit pattern of the dtype (NaN payloads, -0, infinities, subnormals included)."""
    if dtype is fl.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    host = np.dtype(dtype.numpy)
    bits = rng.integers(0, 256, (*shape, host.itemsize), dtype=np.uint8)
    return bits.view(host).reshape(shape)


def bits(array: np.ndarray) -> np.ndarray:
    array = np.asarray(array)
    return array.view(np.uint8) if array.dtype == bool else array.view(f"u{array.itemsize}")


def assert_same_bits(got, expected) -> None:
    got, expected = np.asarray(got), np.asarray(expected)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(bits(got), bits(expected))


def write_raw(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


# --- round trips ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,code", DTYPES, ids=[d.name for d, _ in DTYPES])
def test_round_trip_every_dtype_bit_exact(tmp_path, reference_backend, rng, dtype, code):
    values = {f"t{i}": random_values(rng, dtype, shape) for i, shape in enumerate(SHAPES)}
    tensors = {name: fl.from_numpy(array) for name, array in values.items()}
    path = tmp_path / "weights.safetensors"
    fl.save_file(tensors, path)
    with safe_open(path, framework="numpy") as file:
        for name, array in values.items():
            assert file.get_slice(name).get_dtype() == code
            assert file.get_slice(name).get_shape() == list(array.shape)
    loaded = fl.load_file(path)
    assert sorted(loaded) == sorted(values)
    for name, array in values.items():
        assert loaded[name].dtype is dtype and loaded[name].backend == "reference"
        assert_same_bits(loaded[name].numpy(), array)


def test_lazy_views_and_metadata(tmp_path, reference_backend, rng):
    base = rng.standard_normal((4, 6)).astype(np.float32)
    x = fl.tensor(base)
    # (x.T and x[:, 1] would overlap in x's memory: only one view of x)
    tensors = {"transposed": x.T, "sum": x * 2 + 1, "column": (x - 1)[:, 1], "cast": x.half()}
    path = tmp_path / "w.safetensors"
    fl.save_file(tensors, str(path), metadata={"format": "pt", "note": "ünïcode"})
    loaded = fl.load_file(path)
    np.testing.assert_array_equal(loaded["transposed"].numpy(), base.T)
    np.testing.assert_array_equal(loaded["sum"].numpy(), base * 2 + 1)
    np.testing.assert_array_equal(loaded["column"].numpy(), base[:, 1] - 1)
    assert_same_bits(loaded["cast"].numpy(), base.astype(np.float16))
    with safe_open(path, framework="numpy") as file:
        assert file.metadata() == {"format": "pt", "note": "ünïcode"}


def test_loaded_tensors_own_their_memory(tmp_path, reference_backend):
    path = tmp_path / "w.safetensors"
    fl.save_file({"a": fl.tensor([1.0, 2.0])}, path)
    loaded = fl.load_file(path)
    fl.save_file({"a": fl.tensor([5.0, 6.0])}, path)  # replaces the file under it
    path.unlink()
    np.testing.assert_array_equal(loaded["a"].numpy(), [1.0, 2.0])


def test_device_argument_picks_the_backend(tmp_path, cuda_backend):
    path = tmp_path / "w.safetensors"
    with fl.backend("reference"):
        fl.save_file({"a": fl.tensor([1, 2, 3])}, path)
    for device in ("cpu", fl.device("cpu"), "reference"):
        loaded = fl.load_file(path, device=device)
        assert loaded["a"].backend == "reference"
        np.testing.assert_array_equal(loaded["a"].numpy(), [1, 2, 3])
    with pytest.raises(ValueError, match="unknown device"):
        fl.load_file(path, device="tpu")


def test_empty_file(tmp_path, reference_backend):
    fl.save_file({}, tmp_path / "empty.safetensors")
    assert fl.load_file(tmp_path / "empty.safetensors") == {}


# --- shared memory, as safetensors.torch -----------------------------------------------------


def test_shared_memory_is_refused_naming_the_keys(tmp_path, reference_backend):
    w = fl.tensor(np.ones((4, 4), np.float32)).realize()
    path = tmp_path / "w.safetensors"
    with pytest.raises(ValueError, match=r"share memory: 'embed', 'head'"):
        fl.save_file({"embed": w, "head": w, "other": fl.ones(2)}, path)
    with pytest.raises(ValueError, match=r"'whole', 'row'"):
        fl.save_file({"whole": w, "row": w[1]}, path)
    assert not path.exists()  # nothing written, not even a partial file
    assert list(tmp_path.iterdir()) == []
    # disjoint views of one tensor, and equal lazy values, are separate tensors
    fl.save_file({"top": w[:2], "bottom": w[2:], "z1": fl.zeros(3), "z2": fl.zeros(3)}, path)
    loaded = fl.load_file(path)
    assert loaded["top"].shape == (2, 4) and loaded["z2"].shape == (3,)


def test_a_failed_save_keeps_the_old_file(tmp_path, reference_backend):
    path = tmp_path / "w.safetensors"
    fl.save_file({"a": fl.tensor([1.0])}, path)
    w = fl.tensor([2.0]).realize()
    with pytest.raises(ValueError):
        fl.save_file({"a": w, "b": w}, path)
    np.testing.assert_array_equal(fl.load_file(path)["a"].numpy(), [1.0])


# --- bad input ------------------------------------------------------------------------------


def test_save_rejects_non_tensors_and_non_string_keys(tmp_path, reference_backend):
    path = tmp_path / "w.safetensors"
    with pytest.raises(TypeError, match=r"w\.safetensors: 'bias' is a ndarray, not a flame"):
        fl.save_file({"weight": fl.ones(2), "bias": np.ones(2)}, path)
    with pytest.raises(TypeError, match=r"w\.safetensors: key 3 is a int"):
        fl.save_file({3: fl.ones(2)}, path)
    with pytest.raises(TypeError, match="expected a dict"):
        fl.save_file([fl.ones(2)], path)
    with pytest.raises(TypeError, match=r"metadata entry 'step': 3"):
        fl.save_file({"a": fl.ones(2)}, path, metadata={"step": 3})
    assert not path.exists()


def good_file(tmp_path, reference_backend_name="reference"):
    path = tmp_path / "good.safetensors"
    with fl.backend(reference_backend_name):
        fl.save_file({"a": fl.ones(4), "b": fl.zeros(2, 2, dtype=fl.int64)}, path)
    return path


def test_truncated_file(tmp_path, reference_backend):
    path = good_file(tmp_path)
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-5])
    with pytest.raises(io.WeightsFileError, match=r"cut\.safetensors: tensor '\w' ends at byte"):
        fl.load_file(cut)
    cut.write_bytes(data[:20])  # inside the header
    with pytest.raises(io.WeightsFileError, match=r"cut\.safetensors: the header claims"):
        fl.load_file(cut)
    cut.write_bytes(data[:3])
    with pytest.raises(io.WeightsFileError, match=r"cut\.safetensors: the file is 3 bytes"):
        fl.load_file(cut)


@pytest.mark.parametrize(
    "header,data,message",
    [
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
             "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
            24, r"tensor 'b' \(bytes 8\.\.24\) overlaps tensor 'a'",
        ),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
             "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}},
            16, r"tensor 'b' ends at byte 32 of the data, which has 16",
        ),
        (
            {"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}},
            16, r"tensor 'w': shape \[3\] of F32 needs 12 bytes, its offsets \[0, 16\] give 16",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
             "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}},
            12, r"a gap of 4 bytes before tensor 'b'",
        ),
        (
            {"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, 4,
            r"tensor 'a': unknown dtype 'F99'",
        ),
    ],
    ids=["overlap", "past-the-end", "size-mismatch", "gap", "unknown-dtype"],
)  # fmt: skip
def test_lying_headers(tmp_path, reference_backend, header, data, message):
    path = tmp_path / "lies.safetensors"
    write_raw(path, header, b"\0" * data)
    with pytest.raises(io.WeightsFileError, match=r"lies\.safetensors: " + message):
        fl.load_file(path)


@pytest.mark.parametrize("code,size", [("F8_E4M3", 1), ("U16", 2), ("U32", 4), ("U64", 8),
                                       ("C64", 8), ("F8_E5M2", 1)])  # fmt: skip
def test_dtypes_flame_lacks(tmp_path, reference_backend, code, size):
    path = tmp_path / "other.safetensors"
    header = {"fine": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
              "odd": {"dtype": code, "shape": [2], "data_offsets": [4, 4 + 2 * size]}}  # fmt: skip
    write_raw(path, header, b"\1" * (4 + 2 * size))
    with pytest.raises(
        io.WeightsFileError, match=rf"other\.safetensors: tensor 'odd' has dtype {code}, which"
    ):
        fl.load_file(path)


def test_not_json_and_missing_file(tmp_path, reference_backend):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"{abc}")
    with pytest.raises(io.WeightsFileError, match=r"bad\.safetensors: the header is not JSON"):
        fl.load_file(path)
    with pytest.raises(FileNotFoundError):
        fl.load_file(tmp_path / "missing.safetensors")


# --- PyTorch's files ------------------------------------------------------------------------

TORCH_DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
                "uint8", "bool"]  # fmt: skip


def torch_bits(tensor) -> np.ndarray:
    import torch

    if tensor.dtype is torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def test_torch_file_loads_into_flame(tmp_path, reference_backend, rng):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file as torch_save

    tensors = {}
    for name in TORCH_DTYPES:
        dtype = getattr(fl, "bool_" if name == "bool" else name)
        values = random_values(rng, dtype, (3, 7))
        host = values.view(np.int16) if dtype is fl.bfloat16 else values
        tensor = torch.from_numpy(host.copy())
        tensors[name] = tensor.view(torch.bfloat16) if dtype is fl.bfloat16 else tensor
    tensors["scalar"] = torch.tensor(2.5)
    path = tmp_path / "torch.safetensors"
    torch_save(tensors, path, metadata={"format": "pt"})
    loaded = fl.load_file(path)
    for name, tensor in tensors.items():
        assert_same_bits(loaded[name].numpy(), torch_bits(tensor))


def test_flame_file_loads_into_torch(tmp_path, reference_backend, rng):
    pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load

    arrays = {}
    for name in TORCH_DTYPES:
        arrays[name] = random_values(rng, getattr(fl, "bool_" if name == "bool" else name), (5,))
    arrays["scalar"] = np.array(-0.0, np.float32)
    path = tmp_path / "flame.safetensors"
    fl.save_file({name: fl.from_numpy(a) for name, a in arrays.items()}, path)
    loaded = torch_load(path)
    for name, array in arrays.items():
        assert_same_bits(torch_bits(loaded[name]), array)


# --- the cuda path's chunked copies, on the host ----------------------------------------------


class _HostArray(np.ndarray):
    """A NumPy array posing as a CuPy one: ``.data.ptr`` is its address."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)


class _Pinned(bytearray):
    def size(self) -> int:
        return len(self)


def fake_cupy(copies: list) -> types.ModuleType:
    event = types.SimpleNamespace(synchronize=lambda: None)
    stream = types.SimpleNamespace(ptr=0, record=lambda: event)

    def memcpy(target, source, count, kind, stream_ptr):
        copies.append(count)
        ctypes.memmove(target, source, count)

    runtime = types.SimpleNamespace(memcpyAsync=memcpy, memcpyHostToDevice=1)
    cuda = types.SimpleNamespace(
        alloc_pinned_memory=lambda n: _Pinned(n), get_current_stream=lambda: stream,
        runtime=runtime,
    )  # fmt: skip
    module = types.ModuleType("cupy")
    module.cuda = cuda
    module.empty = lambda shape, dtype: np.empty(shape, dtype).view(_HostArray)
    return module


@pytest.mark.parametrize("host_read", ["pread", "mmap"])
@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_chunked_copies_reassemble_every_tensor(
    tmp_path, reference_backend, rng, monkeypatch, host_read, chunk
):
    kinds = [(fl.float32, (5, 3)), (fl.bfloat16, (9,)), (fl.bool_, (0,)), (fl.int8, (13,)),
             (fl.float64, ()), (fl.uint8, (40,))]  # fmt: skip
    arrays = {f"t{i}": random_values(rng, dtype, shape) for i, (dtype, shape) in enumerate(kinds)}
    path = tmp_path / "w.safetensors"
    fl.save_file({name: fl.from_numpy(a) for name, a in arrays.items()}, path)
    copies: list = []
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(copies))
    monkeypatch.setattr(
        file_uploads, "_staging", None
    )  # a ring of the stand-in's buffers, dropped after
    monkeypatch.setattr(file_uploads, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(file_uploads, "HOST_READ", host_read)
    entries = io._read_header(str(path))[0]
    got = file_uploads.read_to_gpu(str(path), entries)
    for name, array in arrays.items():
        expected = array.view(np.uint16) if array.dtype == ml_dtypes.bfloat16 else array
        assert_same_bits(np.asarray(got[name]).view(np.ndarray), expected)
    total = sum(a.nbytes for a in arrays.values())
    assert sum(copies) == total
    assert len(copies) >= -(-total // chunk)  # at least one copy per chunk


# --- checkpoints ----------------------------------------------------------------------------


class Params:
    """A stand-in for a module: ``state_dict``/``load_state_dict`` over named tensors, loading
    in place (the optimizer keeps pointing at the same tensors)."""

    def __init__(self, arrays: dict):
        self.tensors = {name: fl.tensor(a).requires_grad_() for name, a in arrays.items()}

    def state_dict(self) -> dict:
        return dict(self.tensors)

    def load_state_dict(self, state: dict) -> None:
        assert sorted(state) == sorted(self.tensors)
        with fl.no_grad():
            for name, value in state.items():
                self.tensors[name].copy_(value)


def make_run(rng_seed: int):
    rng = np.random.default_rng(rng_seed)
    arrays = {"w": rng.standard_normal((4, 3)).astype(np.float32),
              "b": rng.standard_normal(3).astype(ml_dtypes.bfloat16)}  # fmt: skip
    model = Params(arrays)
    groups = [{"params": [model.tensors["w"]]},
              {"params": [model.tensors["b"]], "weight_decay": 0.0, "lr": 3e-2}]  # fmt: skip
    optimizer = fl.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    scheduler = SequentialLR(
        optimizer,
        [LinearLR(optimizer, start_factor=0.5, total_iters=2), CosineAnnealingLR(optimizer, 5)],
        milestones=[2],
    )  # fmt: skip
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, x, steps: int) -> None:
    for _ in range(steps):
        w, b = model.tensors["w"], model.tensors["b"]
        noise = fl.randn(*x.shape)  # the default generator: resumes only if its state does
        loss = (((x + 0.1 * noise) @ w + b.to(fl.float32)) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def test_checkpoint_resumes_bit_for_bit(tmp_path, reference_backend):
    x = fl.tensor(np.random.default_rng(7).standard_normal((8, 4)).astype(np.float32))
    fl.manual_seed(1234)
    model, optimizer, scheduler = make_run(0)
    train(model, optimizer, scheduler, x, 6)
    straight = {name: t.numpy().copy() for name, t in model.tensors.items()}

    fl.manual_seed(1234)
    model, optimizer, scheduler = make_run(0)
    train(model, optimizer, scheduler, x, 3)
    ema = Params({"w": model.tensors["w"].numpy() * 0.5})
    path = tmp_path / "ckpt.safetensors"
    io.save_checkpoint(
        path, model=model, ema=ema, optimizer=optimizer, scheduler=scheduler, step=3,
        extra={"epoch": 1, "betas": (0.1, 0.2), "mask": fl.tensor([True, False])},
    )  # fmt: skip
    with safe_open(path, framework="numpy") as file:
        names = set(file.keys())
    assert {"model.w", "model.b", "ema.w", "optimizer.state.0.exp_avg",
            "optimizer.state.1.exp_avg_sq", "extra.mask"} <= names  # fmt: skip

    fl.manual_seed(99)  # a different generator state, parameters and learning rates
    resumed, optimizer2, scheduler2 = make_run(5)
    ema2 = Params({"w": np.zeros((4, 3), np.float32)})
    fl.randn(100).numpy()
    info = io.load_checkpoint(
        path, model=resumed, ema=ema2, optimizer=optimizer2, scheduler=scheduler2
    )  # fmt: skip
    assert info["step"] == 3
    assert info["extra"]["epoch"] == 1 and info["extra"]["betas"] == (0.1, 0.2)
    np.testing.assert_array_equal(info["extra"]["mask"].numpy(), [True, False])
    assert_same_bits(ema2.tensors["w"].numpy(), ema.tensors["w"].numpy())
    assert optimizer2.param_groups[0]["betas"] == (0.8, 0.95)
    assert scheduler2.last_epoch == scheduler.last_epoch == 3
    assert scheduler2.schedulers[1].last_epoch == scheduler.schedulers[1].last_epoch
    train(resumed, optimizer2, scheduler2, x, 3)
    for name, value in straight.items():
        assert_same_bits(resumed.tensors[name].numpy(), value)


def test_checkpoint_errors(tmp_path, reference_backend):
    weights = tmp_path / "plain.safetensors"
    fl.save_file({"a": fl.ones(2)}, weights)
    with pytest.raises(io.WeightsFileError, match=r"plain\.safetensors: not a FLAME checkpoint"):
        io.load_checkpoint(weights)
    model, optimizer, _ = make_run(0)
    path = tmp_path / "ckpt.safetensors"
    io.save_checkpoint(path, model=model)
    with pytest.raises(io.WeightsFileError, match=r"ckpt\.safetensors: no 'flame.optimizer'"):
        io.load_checkpoint(path, optimizer=optimizer)
    with pytest.raises(io.WeightsFileError, match=r"ckpt\.safetensors: no ema tensors"):
        io.load_checkpoint(path, ema=model)
    with pytest.raises(TypeError, match=r"extra\['when'\] is a object"):
        io.save_checkpoint(path, extra={"when": object()})
    assert io.load_checkpoint(path, model=model) == {"step": None, "extra": {}}


def test_checkpoint_restores_the_generator(tmp_path, reference_backend):
    fl.manual_seed(5)
    fl.rand(10).numpy()
    path = tmp_path / "ckpt.safetensors"
    io.save_checkpoint(path, step=10)
    expected = fl.rand(4).numpy()
    fl.manual_seed(6)
    assert io.load_checkpoint(path)["step"] == 10
    np.testing.assert_array_equal(fl.rand(4).numpy(), expected)
    fl.manual_seed(6)
    io.load_checkpoint(path, rng=False)
    assert not np.array_equal(fl.rand(4).numpy(), expected)


# --- gpu tier -------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("host_read", ["pread", "mmap"])
def test_load_to_gpu_matches_reference(tmp_path, rng, monkeypatch, host_read):
    monkeypatch.setattr(file_uploads, "CHUNK_BYTES", 1 << 16)  # several chunks, pieces across them
    monkeypatch.setattr(file_uploads, "HOST_READ", host_read)
    shapes = [(3, 5), (), (0, 4), (97, 131)]
    arrays = {f"{dtype.name}{i}": random_values(rng, dtype, shape)
              for dtype, _ in DTYPES for i, shape in enumerate(shapes)}  # fmt: skip
    path = tmp_path / "w.safetensors"
    with fl.backend("reference"):
        fl.save_file({name: fl.from_numpy(a) for name, a in arrays.items()}, path)
        reference = fl.load_file(path)
    on_gpu = fl.load_file(path, device="cuda")
    for name, array in arrays.items():
        assert on_gpu[name].backend == "cuda" and on_gpu[name].dtype is reference[name].dtype
        assert_same_bits(on_gpu[name].numpy(), reference[name].numpy())
        assert_same_bits(on_gpu[name].numpy(), array)
    # the tensors are usable by kernels, and saving them from the GPU gives the same file
    doubled = (on_gpu["float321"] * 2).numpy()
    np.testing.assert_array_equal(doubled, arrays["float321"] * 2)
    fl.save_file(on_gpu, tmp_path / "again.safetensors")
    assert (tmp_path / "again.safetensors").read_bytes() == path.read_bytes()


def test_weights_benchmark_smoke(tmp_path, reference_backend):
    """bench/weights.py end to end on the CPU (its GPU timings need the device machine)."""
    weights = pytest.importorskip("bench.weights")
    assert weights.main(["--out", str(tmp_path), "--size-mb", "1", "--backend", "reference",
                         "--repeats", "2"]) == 0  # fmt: skip
    report = json.loads((tmp_path / "weights.json").read_text())
    assert report["checkpoint"]["tensors"] >= 290
    assert report["timings"]["mismatched_tensors"] == []
    assert set(report["timings"]["ms"]) == {"flame", "safetensors_numpy"}
    assert "flame.load_file" in (tmp_path / "weights.md").read_text()


def test_checkpoint_of_tied_weights_round_trips_and_a_misfit_changes_nothing(
    tmp_path, reference_backend
):
    import flame.nn as nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.emb.weight  # GPT-style tied embedding

    source = Tied()
    optimizer = fl.optim.AdamW(source.parameters(), lr=0.1)
    path = tmp_path / "tied.safetensors"
    io.save_checkpoint(path, model=source, optimizer=optimizer, step=4)
    target = Tied()
    state = io.load_checkpoint(path, model=target, optimizer=fl.optim.AdamW(target.parameters()))
    assert state["step"] == 4 and target.head.weight is target.emb.weight
    np.testing.assert_array_equal(target.emb.weight.numpy(), source.emb.weight.numpy())
    misfit = Tied()
    before = misfit.emb.weight.numpy().copy()
    two_groups = fl.optim.AdamW(
        [{"params": [misfit.emb.weight]}, {"params": [fl.zeros(2).requires_grad_()]}]
    )
    with pytest.raises(ValueError, match="parameter groups"):
        io.load_checkpoint(path, model=misfit, optimizer=two_groups)
    np.testing.assert_array_equal(misfit.emb.weight.numpy(), before)
