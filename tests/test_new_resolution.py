"""A compiled step called at a new resolution or batch size (issue 21, scope 1 and 4): every
kernel it needs anew is explained by a named size class, never by a size alone.

The CPU tier plans ``fl.compile``d steps on the CUDA backend without a GPU (passes, lowering,
kernel keys; values of realizes from the reference interpreter, no kernel loaded), at one
shape and then at others, and compares the kernels the plans ask for: a kernel whose size
class is unchanged must be the same kernel (the same ``spec_key``, so a compile-cache hit).
notes/probes/new_resolution_cpu.py does the same for the whole UNet and DiT steps and
notes/new-resolution.md lists what it found.

Found so far: a random draw inside a compiled step starts its counters at its place among
the step's draws (flame/random.py), a number that follows the sizes of every draw before it
(the timesteps drawn before the noise: the batch); it was a literal in the CUDA source, and
made 44 of the UNet step's 47 new kernels at a new batch size or resolution. It is a kernel
argument now (flame/codegen/common.py ``counter_constants``).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.codegen import common
from flame.codegen.explain import compile_reason, spec_differences
from flame.codegen.lower import lower_group
from flame.codegen.render import render, spec_key
from flame.ir import dtypes
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime import executor as executor_module
from flame.runtime import launch, reference
from flame.runtime.cache import DiskCache
from flame.runtime.compiler import KernelCache
from flame.runtime.device import DeviceInfo
from flame.runtime.executor import Executor, _layout_of
from flame.runtime.storage import Storage
from flame.tensor import apply

FAKE_DEVICE = DeviceInfo("CPU stand-in for an H100", "sm_90", 132, 50 * 2**20)


class RecordingExecutor(Executor):
    """Plans as the GPU does and loads no kernel: records each plan's kernels."""

    def _load(self, sources):
        self.loaded.extend((name, key, spec) for _, name, key, spec in sources)
        return [("function of", key) for _, _, key, _ in sources]


class CompilingExecutor(RecordingExecutor):
    """Also compiles each plan's kernels with NVRTC into its kernel cache (no module load)."""

    def _load(self, sources):
        self.kernels.cubins(sources)
        return super()._load(sources)


def _realize_on_reference(nodes):
    reference.realize(nodes, lambda dtype, array: Storage("cuda", dtype, host=array))


@pytest.fixture
def cpu_planning(monkeypatch, tmp_path):
    """``fl.compile`` on the CUDA backend plans without a GPU, with an executor of its own
    (a fresh kernel cache in ``tmp_path``) and the default generator's state as host data;
    all of it for this test only."""
    monkeypatch.setenv("FLAME_SIBLING_CLASSES", "0")
    monkeypatch.setenv("FLAME_PLAN_CACHE", "0")
    monkeypatch.setattr(launch, "device_info", lambda: FAKE_DEVICE)
    backend_module = importlib.import_module("flame.backend")  # fl.backend is a function
    monkeypatch.setattr(backend_module, "_realize_on_gpu", _realize_on_reference)
    executor = RecordingExecutor(KernelCache(DiskCache(tmp_path), arch="sm_90"))
    executor.loaded = []
    monkeypatch.setattr(executor_module, "_executor", executor)
    state = Storage("cuda", dtypes.int64, host=np.zeros(2, np.int64))
    monkeypatch.setitem(fl.random.default_generator._states, "cuda", state)
    with fl.backend("cuda"):
        yield executor


def planned_kernels(executor, step, shape) -> list:
    """(name, spec_key, spec) of every kernel the plans of ``step``'s first call at
    ``shape`` ask for, in plan order."""
    del executor.loaded[:]
    try:
        step(fl.from_numpy(np.zeros(shape, np.float32)))
    except Exception:  # noqa: BLE001  planned; running it needs a GPU
        pass
    assert executor.loaded, f"no kernel planned at {shape} (the plan came from elsewhere?)"
    return list(executor.loaded)


def size_caused(before: list, after: list) -> list[str]:
    """The kernels of ``after`` that are new code although their size class is one that
    ``before`` has for the same operations: each with what changed."""
    by_stem: dict[tuple, list] = {}
    for name, key, spec in before:
        by_stem.setdefault((name.rsplit("_", 1)[0], spec.size_class), []).append((key, spec))
    keys = {key for _, key, _ in before}
    failures = []
    for name, key, spec in after:
        earlier = by_stem.get((name.rsplit("_", 1)[0], spec.size_class))
        if key in keys or not earlier:
            continue  # the same kernel, or another class (or other operations)
        closest = min((spec_differences(other, spec) for _, other in earlier), key=len)
        failures.append(f"{name} [{spec.size_class}]: {'; '.join(closest[:4])}")
    return failures


def _diffusion_step():
    """A training step's random parts, as bench.diffusion's: timesteps, then noise of the
    images' shape, a GroupNorm + SiLU, dropout, an MSE against the noise."""
    weight = fl.tensor(np.linspace(0.5, 1.5, 8, dtype=np.float32))
    bias = fl.tensor(np.linspace(-0.1, 0.1, 8, dtype=np.float32))

    @fl.compile
    def step(images):
        steps = fl.randint(0, 1000, (images.shape[0],))
        noise = fl.randn(images.shape)
        hidden = F.silu(F.group_norm(images + noise, 4, weight, bias))
        hidden = F.dropout(hidden, 0.1, training=True)
        return ((hidden - noise) ** 2).mean() + steps.float().mean() * 1e-3

    return step


# shapes of one size class each: a new batch, a new resolution, both
SHAPES = [(2, 8, 8, 8), (3, 8, 8, 8), (5, 8, 8, 8), (2, 8, 12, 12), (3, 8, 12, 12)]


def test_a_new_batch_or_resolution_plans_the_same_kernels(cpu_planning):
    step = _diffusion_step()
    first = planned_kernels(cpu_planning, step, SHAPES[0])
    assert any("philox" in name for name, _, _ in first), "the step's kernels draw nothing"
    failures = []
    for shape in SHAPES[1:]:
        kernels = planned_kernels(cpu_planning, step, shape)
        failures += [f"{shape}: {line}" for line in size_caused(first, kernels)]
    assert not failures, "kernels new at a new size within their size class:\n" + "\n".join(
        failures
    )


def test_a_same_class_shape_compiles_nothing(cpu_planning):
    """The shapes above stay in the first one's size classes: every kernel is one already
    planned (a compile-cache hit on the GPU)."""
    step = _diffusion_step()
    keys = {key for _, key, _ in planned_kernels(cpu_planning, step, SHAPES[0])}
    for shape in SHAPES[1:]:
        kernels = planned_kernels(cpu_planning, step, shape)
        new = [f"{name} [{spec.size_class}]" for name, key, spec in kernels if key not in keys]
        assert not new, f"{shape}: new kernels after {SHAPES[0]}: {new}"


def test_a_new_size_runs_no_nvrtc_compile(cpu_planning, nvrtc):
    """The step's kernels compiled by NVRTC at the first shape; at a new batch and a new
    resolution every kernel is a hit of the kernel cache, and no NVRTC compile runs."""
    executor = CompilingExecutor(cpu_planning.kernels)
    executor.loaded = []
    executor_module._executor = executor  # the fixture's monkeypatch restores the original
    step = _diffusion_step()
    planned_kernels(executor, step, SHAPES[0])
    stats = executor.kernels.stats
    compiled, hits = stats.compiles, stats.memory_hits
    assert compiled > 0
    for shape in (SHAPES[1], SHAPES[3]):
        planned_kernels(executor, step, shape)
        new = [name for name, origin, _ in stats.events[compiled:] if origin == "compiled"]
        assert stats.compiles == compiled, f"{shape}: compiled {new}"
    assert stats.memory_hits > hits


def test_draw_offsets_are_launch_arguments(cpu_planning):
    """The noise is drawn after ``batch`` timesteps: its counters start at ``batch``, a
    kernel argument whose value follows the batch (the launch passes ``Arg.value``)."""
    step = _diffusion_step()
    for shape in SHAPES[:3]:
        kernels = planned_kernels(cpu_planning, step, shape)
        offsets = {
            arg.value
            for name, _, spec in kernels
            if "philox" in name
            for arg in spec.params
            if arg.kind == "size" and arg.name.startswith("sized")
        }
        assert shape[0] in offsets, (shape, sorted(offsets))


# --- one draw lowered by hand: the counter constant -----------------------------------------


def _draw(offset: int, count: int = 96):
    """``philox(seed, arange + (state offset + offset))`` as a compiled step's draw is."""
    state = fl.from_numpy(np.array([7, 0], np.int64))
    counter = fl.arange(count, dtype=fl.int64) + (state[1] + offset)
    bits = apply("philox", state[0].expand(count), counter, word=0)
    return bits.to(fl.float32) * (1.0 / (1 << 24))


def _code(spec) -> str:
    """The rendered kernel less its comment header (which prints the IR, constants too)."""
    return "\n".join(line for line in render(spec).splitlines() if not line.startswith("//"))


def _lowered(outputs):
    graph = run_pipeline(Graph(tuple(tensor.node for tensor in outputs)))
    return [lower_group(group, _layout_of) for group in graph.groups if group.kind != "library"]


@pytest.mark.parametrize("reduced", [False, True], ids=["elementwise", "reduction"])
def test_a_draw_offset_is_an_argument_not_a_literal(cuda_backend, reduced):
    def build(offset):
        values = _draw(offset)
        return [values.sum()] if reduced else [values * 2.0]

    (small,), (large,) = _lowered(build(16)), _lowered(build(61603840))
    assert spec_key(small.spec) == spec_key(large.spec), spec_differences(small.spec, large.spec)
    (arg,) = [arg for arg in large.spec.params if arg.name.startswith("sized")]
    assert (arg.kind, arg.ctype, arg.value) == ("size", large.spec.index_type, 61603840)
    assert "61603840" not in _code(large.spec)


def test_an_offset_past_a_32_bit_index_is_a_literal(cuda_backend):
    """A 32-bit-index kernel passes its sizes as int: an offset that does not fit is written
    into the code (a draw of 2**31 numbers before it; the code then follows it)."""
    (kernel,) = _lowered([_draw(2**33) * 2.0])
    assert kernel.spec.index_type == "int"
    assert not [arg for arg in kernel.spec.params if arg.name.startswith("sized")]
    assert str(2**33) in _code(kernel.spec)


def test_draw_kernels_compile(cuda_backend, nvrtc):
    """The argument form and the literal form are both real CUDA (NVRTC, sm_90)."""
    from flame.runtime.compiler import nvrtc_compile

    for outputs in ([_draw(16).sum()], [_draw(16) * 2.0], [_draw(2**33) * 2.0]):
        (kernel,) = _lowered(outputs)
        cubin = nvrtc_compile(render(kernel.spec), kernel.spec.name, "sm_90")
        assert cubin[:4] == b"\x7fELF", kernel.spec.name


def test_counter_constants_follow_only_the_counter(cuda_backend):
    """An integer constant elsewhere in the kernel (not added into a counter) stays a
    literal: only a counter's value never changes the code."""
    values = _draw(16) + fl.from_numpy(np.arange(96, dtype=np.int64)) * 3
    (kernel,) = _lowered([values])
    sized = [arg for arg in kernel.spec.params if arg.name.startswith("sized")]
    assert [arg.value for arg in sized] == [16]
    assert "3LL" in _code(kernel.spec)


# --- explanations ---------------------------------------------------------------------------


def test_a_size_caused_change_is_named_by_its_field(cuda_backend, monkeypatch):
    """Were the offset still a literal, the explanation of the compile (cache_info, the
    dump) names the class unchanged and the code line that changed."""
    monkeypatch.setattr(common, "counter_constants", lambda group: frozenset())
    (small,), (large,) = _lowered([_draw(16) * 2.0]), _lowered([_draw(17) * 2.0])
    reason = compile_reason(large.spec, small.spec)
    assert reason.startswith(f"same size class {small.spec.size_class!r}"), reason
    assert "16LL" in reason and "17LL" in reason, reason  # where: the literal itself
    differences = spec_differences(small.spec, large.spec)
    assert differences and all(line.startswith(("body[", "tail[")) for line in differences)
    assert "16LL" in differences[0] and "17LL" in differences[0], differences


def test_a_new_size_class_is_named(cuda_backend):
    def softmax(n):
        return _lowered([F.softmax(fl.from_numpy(np.zeros((4, n), np.float32)), -1)])

    (short,), (long,) = softmax(64), softmax(16384)
    assert short.spec.size_class != long.spec.size_class
    reason = compile_reason(long.spec, short.spec)
    assert reason.startswith(f"size class {short.spec.size_class!r} -> "), reason
    assert any(line.startswith("size_class: ") for line in spec_differences(short.spec, long.spec))


# --- the GPU: values at each size, and no compile ------------------------------------------


@pytest.mark.gpu
def test_a_new_batch_draws_the_reference_numbers_without_compiling():
    """The compiled step at two batch sizes on the GPU: the reference backend's values for
    the same seed, and no kernel compiled or loaded for the second size."""
    from flame.runtime.compiler import kernel_loads

    def run(backend, shape, loads=None):
        with fl.backend(backend):
            step = _diffusion_step()
            results = []
            for size in (SHAPES[0], shape):
                fl.manual_seed(1234)
                images = fl.from_numpy(np.linspace(-1, 1, np.prod(size), dtype=np.float32))
                if loads is not None and size is shape:
                    with kernel_loads() as found:
                        results.append(float(step(images.reshape(size)).item()))
                    loads.extend(found)
                else:
                    results.append(float(step(images.reshape(size)).item()))
            return results

    for shape in SHAPES[1:3]:
        loads: list = []
        on_gpu = run("cuda", shape, loads)
        expected = run("reference", shape)
        np.testing.assert_allclose(on_gpu, expected, rtol=1e-4, atol=1e-5)
        assert not loads, f"{shape}: kernels loaded for a new size: {loads}"
