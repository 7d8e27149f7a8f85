"""bench/conv_attention.py's timed sections: conv2d forward and both gradients against cuDNN
(PyTorch eager), ``scaled_dot_product_attention`` against PyTorch's SDPA (both also against
FLAME's own kernels, cuDNN turned off), and a UNet ResBlock against eager and torch.compile:
the case tables, each case's systems, and the sections that run them."""

from __future__ import annotations

import contextlib

from bench.side_by_side import (
    System,
    Timing,
    clear_grads,
    flame_clock,
    flame_scope,
    make_row,
    progress,
    run_systems,
    to_flame,
    torch_clock,
    torch_compile_skip,
    torch_device,
    torch_inputs,
)

TARGETS = {
    "conv": "FLAME >= 0.97x PyTorch eager (cuDNN)",
    "attention": "FLAME >= 0.95x torch SDPA; FLAME fallback >= 0.5x",
    "resblock": "FLAME >= 1.2x torch.compile",
    "compile": "<= 150 ms cold, <= 5 ms from disk (library part)",
}

# (batch, channels in, channels out, height = width, kernel, stride)
CONV = [
    (8, 64, 64, 128, 3, 1),
    (16, 128, 128, 64, 3, 1),
    (32, 256, 256, 32, 3, 1),
    (32, 512, 512, 16, 3, 1),
    (64, 512, 512, 8, 3, 1),
    (16, 128, 128, 64, 3, 2),
    (32, 256, 512, 32, 1, 1),
]
CONV_QUICK = [(32, 256, 256, 32, 3, 1), (32, 256, 512, 32, 1, 1)]
CONV_TINY = [(2, 4, 4, 8, 3, 1), (2, 4, 4, 8, 3, 2), (2, 4, 8, 8, 1, 1)]
# (batch, channels, height = width, embedding width)
RESBLOCK = [(32, 128, 32, 512), (32, 256, 16, 512), (32, 512, 8, 512)]
RESBLOCK_QUICK = [(32, 256, 16, 512)]
RESBLOCK_TINY = [(2, 32, 4, 16)]
ATTENTION_TINY = [(1, 2, 16, 8, False), (1, 2, 16, 8, True)]  # (batch, heads, L, D, causal)
ATTENTION_QUICK = [(4, 16, 1024, 64, False), (1, 16, 4096, 128, True)]


def attention_cases() -> list[tuple]:
    cases = []
    for dim in (64, 128):
        for length in (256, 1024, 4096, 16384):
            batch_heads = max(1, 65536 // length)
            heads = min(16, batch_heads)
            for causal in (False, True):
                cases.append((batch_heads // heads, heads, length, dim, causal))
    return cases


# --- conv and attention ------------------------------------------------------------------------


def fallback_setting():
    """(a context manager under which FLAME runs its own conv and attention kernels, what it
    sets), or (None, why there is none)."""
    import flame as fl

    cudnn = getattr(getattr(fl, "backends", None), "cudnn", None)
    if cudnn is None or not hasattr(cudnn, "enabled"):
        return None, "flame.backends.cudnn.enabled does not exist"

    @contextlib.contextmanager
    def disabled():
        saved = cudnn.enabled
        cudnn.enabled = False
        try:
            yield
        finally:
            cudnn.enabled = saved

    return disabled, "flame.backends.cudnn.enabled = False"


def flame_systems(build, backend: str, fallback) -> dict:
    """FLAME, and FLAME with its library kernels turned off (built and timed under the setting)."""
    setting, why = fallback
    skip = "reference backend: no library kernel to turn off" if backend != "cuda" else None
    return {
        "flame": System(build, flame_scope(backend)),
        "flame_fallback": System(
            build, flame_scope(backend, setting), skip=skip or (why if setting is None else None)
        ),
    }


@contextlib.contextmanager
def cudnn_benchmark(flag: bool):
    import torch

    saved = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = flag
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = saved


def conv_systems(case: tuple, backend: str, fallback) -> dict:
    import torch

    import flame as fl
    import flame.nn.functional as F

    batch, cin, cout, size, kernel, stride = case
    padding = kernel // 2
    out_size = (size + 2 * padding - kernel) // stride + 1
    shapes = [(batch, cin, size, size), (cout, cin, kernel, kernel)]
    x, w, gy = torch_inputs(
        [*shapes, (batch, cout, out_size, out_size)], backend, [True, True, False]
    )

    def torch_build():
        def call():
            clear_grads((x, w))
            y = torch.nn.functional.conv2d(x, w, stride=stride, padding=padding)
            y.backward(gy)
            return y, x.grad, w.grad

        return call, torch_clock(torch_device(backend))

    def flame_build():
        fx, fw, fgy = to_flame(x, backend, True), to_flame(w, backend, True), to_flame(gy, backend)

        @fl.compile
        def step(x, w, gy):
            y = F.conv2d(x, w, stride=stride, padding=padding)
            y.backward(gy)
            return y

        def call():
            clear_grads((fx, fw))
            return step(fx, fw, fgy), fx.grad, fw.grad

        return call, flame_clock(backend)

    skip = None if backend == "cuda" else "reference backend: PyTorch on the CPU"
    return {
        "torch_eager": System(torch_build, lambda: cudnn_benchmark(False)),
        "torch_eager_cudnn_benchmark": System(torch_build, lambda: cudnn_benchmark(True), skip),
        **flame_systems(flame_build, backend, fallback),
    }


def conv_section(backend: str, cases: list, timing: Timing) -> dict:
    fallback, rows = fallback_setting(), []
    for case in cases:
        batch, cin, cout, size, kernel, stride = case
        label = f"{cin}->{cout}ch {size}x{size} b{batch} {kernel}x{kernel} s{stride}"
        progress(f"conv {label}")
        out_size = (size + 2 * (kernel // 2) - kernel) // stride + 1
        flops = 3 * 2 * batch * cout * out_size * out_size * cin * kernel * kernel
        systems = conv_systems(case, backend, fallback)
        results = run_systems(systems, timing, ("y", "grad_x", "grad_w"), backend)
        fields = ("batch", "channels_in", "channels_out", "size", "kernel", "stride")
        rows.append(make_row(label, fields, case, results, backend, "torch_eager", flops=flops))
    return {"target": TARGETS["conv"], "fallback_setting": fallback[1], "rows": rows}


def attention_systems(case: tuple, backward: bool, backend: str, fallback) -> dict:
    import torch

    import flame as fl
    import flame.nn.functional as F

    batch, heads, length, dim, causal = case
    shape = (batch, heads, length, dim)
    q, k, v, go = torch_inputs([shape] * 4, backend, [backward] * 3 + [False])
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_build():
        def call():
            clear_grads((q, k, v))
            with torch.set_grad_enabled(backward):
                out = sdpa(q, k, v, is_causal=causal)
            if not backward:
                return (out,)
            out.backward(go)
            return out, q.grad, k.grad, v.grad

        return call, torch_clock(torch_device(backend))

    def flame_build():
        fq, fk, fv = (to_flame(t, backend, backward) for t in (q, k, v))
        fgo = to_flame(go, backend)

        @fl.compile
        def step(q, k, v, go):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            if backward:
                out.backward(go)
            return out

        def call():
            clear_grads((fq, fk, fv))
            out = step(fq, fk, fv, fgo)
            return (out, fq.grad, fk.grad, fv.grad) if backward else (out,)

        return call, flame_clock(backend)

    return {"torch_sdpa": System(torch_build), **flame_systems(flame_build, backend, fallback)}


def attention_section(backend: str, cases: list, timing: Timing) -> dict:
    fallback, rows = fallback_setting(), []
    fields = ("batch", "heads", "length", "head_dim", "causal")
    for case in cases:
        batch, heads, length, dim, causal = case
        forward_flops = 4 * batch * heads * length * length * dim / (2 if causal else 1)
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            label = f"B{batch} H{heads} L{length} D{dim}{' causal' if causal else ''} {mode}"
            progress(f"attention {label}")
            names = ("out", "grad_q", "grad_k", "grad_v") if backward else ("out",)
            systems = attention_systems(case, backward, backend, fallback)
            results = run_systems(systems, timing, names, backend, "torch_sdpa")
            flops = forward_flops * (3.5 if backward else 1.0)
            rows.append(make_row(label, fields, case, results, backend, "torch_sdpa",
                                 flops=flops, mode=mode))  # fmt: skip
    return {"target": TARGETS["attention"], "fallback_setting": fallback[1], "rows": rows}


# --- resblock ----------------------------------------------------------------------------------


def resblock_class(library_nn):
    """The same ResBlock for ``torch.nn`` and ``flame.nn``: the two modules match by design."""

    class ResBlock(library_nn.Module):
        def __init__(self, channels: int, embedding: int):
            super().__init__()
            self.norm1 = library_nn.GroupNorm(32, channels)
            self.conv1 = library_nn.Conv2d(channels, channels, 3, padding=1)
            self.time = library_nn.Linear(embedding, channels)
            self.norm2 = library_nn.GroupNorm(32, channels)
            self.conv2 = library_nn.Conv2d(channels, channels, 3, padding=1)
            self.act = library_nn.SiLU()

        def forward(self, x, time_embedding):
            h = self.conv1(self.act(self.norm1(x)))
            h = h + self.time(self.act(time_embedding)).reshape(x.shape[0], -1, 1, 1)
            h = self.conv2(self.act(self.norm2(h)))
            return x + h

    return ResBlock


def resblock_systems(case: tuple, backend: str) -> dict:
    import torch

    import flame as fl
    import flame.nn as fnn

    batch, channels, size, embedding = case
    device = torch_device(backend)
    torch.manual_seed(0)
    module = resblock_class(torch.nn)(channels, embedding).to(device, torch.bfloat16)
    shapes = [(batch, channels, size, size), (batch, embedding), (batch, channels, size, size)]
    x, temb, gout = torch_inputs(shapes, backend, [True, True, False])

    def torch_build(compiled: bool):
        def build():
            forward = torch.compile(module) if compiled else module

            def call():
                module.zero_grad(set_to_none=True)
                clear_grads((x, temb))
                out = forward(x, temb)
                out.backward(gout)
                return out, x.grad, module.conv1.weight.grad

            return call, torch_clock(device)

        return build

    def flame_build():
        block = resblock_class(fnn)(channels, embedding).bfloat16()
        block.load_state_dict({k: v.float().cpu().numpy() for k, v in module.state_dict().items()})
        fx, ftemb, fgout = (
            to_flame(x, backend, True),
            to_flame(temb, backend, True),
            to_flame(gout, backend),
        )

        @fl.compile
        def step(x, temb, gout):
            out = block(x, temb)
            out.backward(gout)
            return out

        def call():
            block.zero_grad(set_to_none=True)
            clear_grads((fx, ftemb))
            return step(fx, ftemb, fgout), fx.grad, block.conv1.weight.grad

        return call, flame_clock(backend)

    compile_skip = torch_compile_skip(backend)
    return {
        "torch_eager": System(torch_build(False)),
        "flame": System(flame_build, flame_scope(backend)),
        "torch_compile": System(torch_build(True), skip=compile_skip),
    }


def resblock_section(backend: str, cases: list, timing: Timing) -> dict:
    rows = []
    for case in cases:
        batch, channels, size, embedding = case
        label = f"{channels}ch {size}x{size} b{batch} (time embedding {embedding})"
        progress(f"resblock {label}")
        names = ("out", "grad_x", "grad_conv1_weight")
        results = run_systems(resblock_systems(case, backend), timing, names, backend)
        fields = ("batch", "channels", "size", "embedding")
        rows.append(make_row(label, fields, case, results, backend, "torch_eager"))
    return {"target": TARGETS["resblock"], "rows": rows}
