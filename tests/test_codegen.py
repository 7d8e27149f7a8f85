"""Codegen: kernel sources, shape classes, vectorisation, NVRTC (CPU tier, no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import flame as fl
from flame.codegen.elementwise import lower_elementwise
from flame.codegen.render import code_key, render, spec_key
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.cache import DiskCache
from flame.runtime.compiler import KernelCache, KernelCompileError, nvrtc_compile
from flame.runtime.executor import _layout_of


def kernels_for(*tensors):
    graph = run_pipeline(Graph(tuple(t.node for t in tensors)))
    return [lower_elementwise(group, _layout_of) for group in graph.groups]


def data(shape, dtype=np.float32, seed=0):
    return fl.from_numpy(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def source_of(tensor):
    (kernel,) = kernels_for(tensor)
    return render(kernel.spec), kernel


def test_kernel_starts_with_its_ir_and_user_lines():
    x = data((64, 128))
    source, kernel = source_of(fl.tanh(x) * 2.0)
    header = source.split("extern")[0]
    assert header.startswith(f"// FLAME kernel {kernel.spec.name}")
    assert "tanh(in0)" in header
    assert "test_codegen.py:" in header


def test_new_sizes_reuse_the_same_source():
    def expression(rows, cols):
        x, b = data((rows, cols)), data((cols,), seed=1)
        return fl.gelu(x + b, approximate="tanh")

    first, first_kernel = source_of(expression(64, 128))
    second, second_kernel = source_of(expression(256, 512))
    assert code_key(first) == code_key(second)
    assert spec_key(first_kernel.spec) == spec_key(second_kernel.spec)


def test_broadcast_pattern_and_dtype_change_the_source():
    x = data((64, 128))
    row, column = data((128,), seed=1), data((64, 1), seed=2)
    keys = {
        code_key(source_of(x + row)[0]),
        code_key(source_of(x + column)[0]),
        code_key(source_of(x.half() + row.half())[0]),
    }
    assert len(keys) == 3


def test_moving_a_user_line_does_not_change_the_code_key():
    x = data((8, 8))
    first = source_of(x.exp())[0]
    second = source_of(x.exp())[0]  # built on another line
    assert first != second
    assert code_key(first) == code_key(second)


def test_contiguous_float32_uses_16_byte_vectors_and_odd_sizes_a_tail():
    even_source, even = source_of(data((1024,)).exp())
    odd_source, odd = source_of(data((1023,)).exp())
    # one kernel serves both sizes: a vector loop, then a scalar loop for n % 4 elements
    assert even.spec.vec == odd.spec.vec == 4 and odd.spec.tail
    assert code_key(even_source) == code_key(odd_source)
    _, ragged = source_of(data((7, 13)) + data((13,), seed=1))
    assert ragged.spec.vec == 1


def test_contiguous_inputs_collapse_to_one_dimension():
    _, kernel = source_of(data((8, 16, 32)) * data((8, 16, 32), seed=1))
    sizes = [arg for arg in kernel.spec.params if arg.kind in ("size", "stride")]
    assert [arg.name for arg in sizes] == ["n"]


def test_generated_kernels_compile_with_nvrtc():
    x, b = data((64, 128)), data((128,), seed=1)
    y = fl.randn(64, 128, seed=3).half()
    for kernel in kernels_for(fl.gelu(x * 1.5 + b, approximate="tanh") * x.sigmoid(), y):
        cubin = nvrtc_compile(render(kernel.spec), kernel.spec.name, "sm_90")
        assert cubin[:4] == b"\x7fELF"


def test_failed_compile_names_the_kernel_and_shows_log_and_source():
    source = 'extern "C" __global__ void broken_kernel(float* x) { x[0] = undefined_name; }'
    with pytest.raises(KernelCompileError) as caught:
        nvrtc_compile(source, "broken_kernel", "sm_90")
    message = str(caught.value)
    assert "broken_kernel" in message
    assert "undefined_name" in message  # the NVRTC log
    assert "x[0] = undefined_name" in message  # the source


def test_kernel_cache_hits_memory_then_disk(tmp_path):
    _, kernel = source_of(data((32,)).sin())
    source = render(kernel.spec)
    first = KernelCache(DiskCache(tmp_path), arch="sm_90")
    key, cubin = first.cubin(source, kernel.spec.name)
    first.cubin(source, kernel.spec.name)
    assert (first.stats.compiles, first.stats.memory_hits) == (1, 1)
    second = KernelCache(DiskCache(tmp_path), arch="sm_90")
    assert second.cubin(source, kernel.spec.name) == (key, cubin)
    assert (second.stats.compiles, second.stats.disk_hits) == (0, 1)


def test_kernel_cache_compiles_several_kernels_keyed_by_spec(tmp_path):
    from functools import partial

    from flame.codegen.render import spec_key

    kernels = kernels_for(data((16,)).sin(), data((4, 4), seed=1).exp())
    items = [(partial(render, k.spec), k.spec.name, spec_key(k.spec)) for k in kernels]
    cache = KernelCache(DiskCache(tmp_path), arch="sm_90")
    results = cache.cubins(items)
    assert len({key for key, _ in results}) == 2 and cache.stats.compiles == 2
    assert cache.cubins(items[:1]) == results[:1]  # one item takes the serial path
    assert cache.stats.memory_hits == 1


def test_row_kernel_with_a_per_row_int64_read_keeps_float_vectors(cuda_backend):
    """Cross-entropy's row kernel reads the logits in 16-byte vectors and the int64 class
    index once a row: the 8-byte index must not turn the row's vectors off (a 16-byte cap on
    vector loads once counted it, and the bench's cross-entropy fell from 0.41 to 0.50 ms)."""
    from flame.codegen.lower import lower_group
    from flame.runtime.executor import _over_stand_ins
    from flame.runtime.walks import linearize

    logits = fl.from_numpy(np.zeros((256, 4096), np.float32))
    target = fl.from_numpy(np.zeros(256, np.int64))
    loss = fl.nn.functional.cross_entropy(logits, target)
    pending, inputs = _over_stand_ins([loss.node], linearize([loss.node])[1])
    graph = run_pipeline(Graph(tuple(pending)))
    row = next(group for group in graph.groups if any(n.op == "reduce_max" for n in group.nodes))
    source = render(lower_group(row, _layout_of).spec)
    assert "FlameVec<float, 4>" in source
