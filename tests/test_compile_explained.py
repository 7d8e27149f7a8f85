"""Every compile explained (issue 21): a new size reuses the kernel of its size class, and a
kernel compiled after the first says what changed in its key.

CPU tier: kernels lowered for a sweep of sizes go through a ``KernelCache`` (NVRTC, a disk
cache of its own) inside ``kernel_loads``; gpu tier: a compiled step at new resolutions.
"""

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F
from flame.codegen.explain import changed_fields, compile_reason, stem
from flame.codegen.lower import lower_group
from flame.codegen.render import render, spec_key
from flame.ir.graph import Graph
from flame.ir.passes import run_pipeline
from flame.runtime.executor import _layout_of


def specs_of(*tensors):
    graph = run_pipeline(Graph(tuple(t.node for t in tensors)))
    return [lower_group(g, _layout_of).spec for g in graph.groups if g.kind != "library"]


def norm_silu(x, weight, bias):
    return F.silu(F.group_norm(x, 8, weight, bias))


def group_norm_specs(batch, channels, height, width):
    x = fl.tensor(np.ones((batch, channels, height, width), np.float32))
    weight = fl.tensor(np.ones(channels, np.float32))
    return specs_of(norm_silu(x, weight, weight))


# sizes of one size class each: aligned rows that fit in registers with two chunks a thread
SAME_CLASS = [(2, 32, 8, 8), (4, 32, 16, 16), (3, 32, 12, 20), (8, 64, 16, 16), (3, 32, 32, 8)]


def code(spec) -> str:
    """The rendered kernel without its comment header (which prints the IR, values too)."""
    return "\n".join(line for line in render(spec).splitlines() if not line.startswith("//"))


def test_sizes_of_one_class_run_one_kernel(cuda_backend):
    keys = {}
    for sizes in SAME_CLASS:
        for position, spec in enumerate(group_norm_specs(*sizes)):
            keys.setdefault((position, spec.size_class), set()).add(spec_key(spec))
    assert all(len(found) == 1 for found in keys.values()), {
        key: len(found) for key, found in keys.items()
    }


def test_mean_scale_is_a_kernel_argument(cuda_backend):
    """1/n of a mean is an argument: the source holds no literal that follows the size."""
    # rows of 256 and 512 values: both in the warp-rows class (reduce.WARP_MAX_ITEMS)
    (first, *_), (second, *_) = group_norm_specs(2, 32, 8, 8), group_norm_specs(2, 32, 8, 16)
    assert code(first) == code(second)
    values = [arg for arg in first.params if arg.kind == "value"]
    assert [arg.value for arg in values] == [pytest.approx(1 / (4 * 64))]
    assert [arg.value for arg in second.params if arg.kind == "value"] == [
        pytest.approx(1 / (4 * 128))
    ]
    assert "0.00390625" not in code(first) and "sized0" in code(first)


def test_compile_reason_names_the_size_class(cuda_backend):
    short = group_norm_specs(2, 32, 8, 8)[0]
    long = group_norm_specs(2, 32, 64, 64)[0]  # rows of 16384: more chunks a thread
    assert stem(short.name) == stem(long.name)
    reason = compile_reason(long, short)
    assert reason.startswith(f"size class {short.size_class!r} -> {long.size_class!r}"), reason
    assert "extras" in changed_fields(long, short)
    assert compile_reason(short, None).startswith("first kernel")
    odd = group_norm_specs(2, 32, 7, 5)[0]  # rows of 4 x 35: no 4-wide vectors
    even = group_norm_specs(2, 32, 8, 8)[0]
    assert "size class" in compile_reason(odd, even)
    assert "1 lanes" in odd.size_class and "4 lanes" in even.size_class


def test_kernel_loads_explain_each_compile(cuda_backend, nvrtc, tmp_path):
    """Through a kernel cache of its own: the first size of each class compiles, the rest of
    the sweep hits memory, and each compile after the first says what changed."""
    from flame.runtime.cache import DiskCache
    from flame.runtime.compiler import KernelCache, kernel_loads

    cache = KernelCache(DiskCache(tmp_path), arch="sm_90")
    sweep = [*SAME_CLASS, (2, 32, 64, 64), (4, 32, 64, 64), (2, 32, 7, 5), (2, 32, 9, 3)]
    sweep += [(1, 32, 8, 8), (1, 64, 16, 16)]  # batch 1: one axis fewer after collapsing
    with kernel_loads() as loads:
        for sizes in sweep:
            for spec in group_norm_specs(*sizes):
                cache.cubin(lambda spec=spec: render(spec), spec.name, spec_key(spec), spec)
    classes = {(stem(load["kernel"]), load["size_class"]) for load in loads}
    assert len(loads) == len(classes), [(load["kernel"], load["reason"]) for load in loads]
    assert all(load["origin"] == "compiled" for load in loads)
    later = [load for load in loads if not load["reason"].startswith("first kernel")]
    assert later and all(load["reason"].startswith("size class") for load in later), later


@pytest.mark.gpu
def test_compiled_step_at_new_resolutions_compiles_only_new_size_classes(cuda_backend):
    """A compiled training-style step at new image sizes: re-planned, and a kernel is loaded
    after the first trace only for a size class not seen before (the loss's sum over the
    whole batch changes class with the total size), each saying so."""
    weight = fl.ones(32, requires_grad=True)
    bias = fl.zeros(32, requires_grad=True)

    @fl.compile
    def step(x):
        loss = (norm_silu(x, weight, bias) ** 2).mean()
        loss.backward()
        return loss

    rng = np.random.default_rng(0)
    for height, width in [(8, 8), (16, 16), (12, 20), (16, 8), (24, 24)]:
        x = fl.tensor(rng.standard_normal((2, 32, height, width)).astype(np.float32))
        step(x).item()
        weight.grad = bias.grad = None
    info = step.cache_info()
    assert info.traces == 5 and info.replans == 4, info.reasons
    seen = {
        (stem(load["kernel"]), load["size_class"]) for load in info.kernels if load["trace"] == 1
    }
    for load in info.kernels:
        if load["trace"] > 1:
            assert load["reason"].startswith("size class"), load
            assert (stem(load["kernel"]), load["size_class"]) not in seen, load
            seen.add((stem(load["kernel"]), load["size_class"]))


def test_sibling_classes_are_the_kernels_other_sizes_need(cuda_backend):
    """``sibling_specs`` of a row kernel lowered at one size: the very code other sizes of
    every other row-cache class lower to (so compiling them ahead serves those sizes)."""
    from flame.codegen.reduce import sibling_specs
    from flame.runtime.executor import _layout_of

    def lowered(height):
        x = fl.tensor(np.ones((2, 64, height, height), np.float32))
        weight = fl.tensor(np.ones(64, np.float32))
        graph = run_pipeline(Graph((norm_silu(x, weight, weight).node,)))
        (group,) = [g for g in graph.groups if g.kind == "reduce"]
        return group, lower_group(group, _layout_of)

    group, small = lowered(16)
    siblings = {spec_key(spec) for spec in sibling_specs(group, _layout_of, small)}
    # the register classes of 4, 8, 16 chunks, streamed, and the row held in shared memory
    assert spec_key(small.spec) not in siblings and len(siblings) == 5
    for height in (32, 40, 48, 90):  # rows of 8192 .. 64800: 4, 8, 16 chunks, streamed
        spec = lowered(height)[1].spec
        assert spec_key(spec) in siblings, spec.size_class
    # a short row (a warp a row): every block class is a sibling, 2 chunks included
    group, short = lowered(8)
    assert "warp rows" in short.spec.size_class
    siblings = {spec_key(spec) for spec in sibling_specs(group, _layout_of, short)}
    assert len(siblings) == 6
    for height in (16, 32, 40, 48, 90):
        spec = lowered(height)[1].spec
        assert spec_key(spec) in siblings, spec.size_class


def test_sibling_compiler_fills_the_kernel_cache(cuda_backend, nvrtc, tmp_path):
    from flame.codegen.reduce import sibling_specs
    from flame.runtime.cache import DiskCache
    from flame.runtime.compiler import KernelCache
    from flame.runtime.executor import _layout_of
    from flame.runtime.siblings import SiblingCompiler

    x = fl.tensor(np.ones((2, 64, 16, 16), np.float32))  # rows of 2,048: a block a row
    graph = run_pipeline(Graph((norm_silu(x, None, None).node,)))
    (group,) = [g for g in graph.groups if g.kind == "reduce"]
    lowered = lower_group(group, _layout_of)
    cache = KernelCache(DiskCache(tmp_path), arch="sm_90")
    compiler = SiblingCompiler(cache)
    compiler.submit([(group, lowered), (group, lowered)])  # the same kernel once
    compiler.drain()
    # background work is counted apart: a plan's own compiles stay countable
    assert cache.stats.background == len(sibling_specs(group, _layout_of, lowered)) == 5
    assert cache.stats.compiles == 0
    for spec in sibling_specs(group, _layout_of, lowered):
        cache.cubin(lambda spec=spec: render(spec), spec.name, spec_key(spec))
    assert cache.stats.memory_hits == 5 and cache.stats.compiles == 0
    compiler.stop()
    compiler.submit([(group, lowered)])  # after stop: nothing queued, drain returns
    compiler.drain()


def test_an_element_picked_by_index_is_an_argument(cuda_backend):
    """``x * alphas[t]`` for every t of a sampler's loop, t = 0 included: one kernel (the
    element's offset is a kernel argument, never a literal)."""
    alphas = fl.tensor(np.linspace(0.1, 0.9, 10).astype(np.float32))
    x = fl.tensor(np.ones((4, 8), np.float32))
    keys = {spec_key(spec) for t in (0, 3, 9) for spec in specs_of(x * alphas[t] + 1.0)}
    assert len(keys) == 1
