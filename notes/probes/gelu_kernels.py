"""Why the bf16 MLP's GELU kernels run below the copy floor: variants timed alone.

    python3 notes/probes/gelu_kernels.py

The kernels are the generated ones of the MLP step (``flame dump`` of examples/mlp_train.py,
copied to kernels/): GELU forward ``out = gelu(h + b)`` and backward
``out = da * gelu'(h + b)`` over bf16 [8192, 16384], the bias [16384] broadcast. Each variant
is a text change to the kernel; times are the median of 30 CUDA-event timings, with the
bytes each moves (2 bytes per element read or written) over the floor.
"""

import pathlib
import re
import statistics

import cupy

ROWS, COLS = 8192, 16384
HERE = pathlib.Path(__file__).parent / "kernels"

FAST_ERF = r"""
__device__ __forceinline__ float probe_erf(float x) {
    // Abramowitz-Stegun 7.1.26: |error| < 1.5e-7 (absolute)
    const float a = fabsf(x);
    const float t = __fdividef(1.0f, 1.0f + 0.3275911f * a);
    const float poly = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f
                     + t * (-1.453152027f + t * 1.061405429f))));
    const float r = 1.0f - poly * __expf(-a * a);
    return copysignf(r, x);
}
"""


def fast_exp(text: str) -> str:
    return re.sub(r"(?<![\w])expf\(", "__expf(", text)


def variants(source: str) -> dict:
    kernel_start = source.index('extern "C"')
    prelude, body = source[:kernel_start], source[kernel_start:]
    vector_bias = body.replace(
        "const int v1_at = i1;",
        "const int v1_at = i1;\n        const FlameVec<unsigned short, 8> b_vec = "
        "*reinterpret_cast<const FlameVec<unsigned short, 8>*>(in1 + v1_at);",
    ).replace("flame_load_bf16(in1[v1_at + k * 1])", "flame_load_bf16(b_vec.v[k])")
    anchor = prelude.index("\n", prelude.index("struct alignas")) + 1
    with_erf = prelude[:anchor] + FAST_ERF + prelude[anchor:]
    return {
        "generated": source,
        "bias as one 16-byte load": prelude + vector_bias,
        "+ __expf": prelude + fast_exp(vector_bias),
        "+ __expf, fast erf": (with_erf + fast_exp(vector_bias)).replace("erff(", "probe_erf("),
    }


def time_ms(function, args, grid, block, repeats=30):
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(3):
        function((grid,), (block,), args)
    samples = []
    for _ in range(repeats):
        start.record()
        function((grid,), (block,), args)
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(samples)


def main():
    n = ROWS * COLS
    rng = cupy.random.default_rng(0)

    def bits(shape):  # bfloat16 bits of normal samples
        samples = rng.standard_normal(shape, dtype=cupy.float32).view(cupy.uint32)
        return (samples >> 16).astype(cupy.uint16)

    h, da, bias = bits((n,)), bits((n,)), bits((COLS,))
    out = cupy.empty(n, dtype=cupy.uint16)
    copy = cupy.empty_like(h)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    samples = []
    for _ in range(20):
        start.record()
        cupy.copyto(copy, h)
        stop.record()
        stop.synchronize()
        samples.append(cupy.cuda.get_elapsed_time(start, stop))
    bandwidth = 2 * h.nbytes / statistics.median(samples) / 1e6  # GB/s (ms timings), read + write
    print(f"copy bandwidth {bandwidth:.0f} GB/s")
    blocks = -(-(n // 8) // 256)
    for name, arrays, moved in (
        ("gelu_fwd", (out, h, bias), 2 * n * 2),
        ("gelu_bwd", (out, h, bias, da), 3 * n * 2),
    ):
        source = (HERE / f"{name}.cu").read_text()
        kernel = re.search(r"void __launch_bounds__\(256\) (\w+)\(", source).group(1)
        floor = moved / bandwidth / 1e6
        for label, text in variants(source).items():
            module = cupy.RawModule(code=text, options=("-std=c++17",), backend="nvrtc")
            function = module.get_function(kernel)
            ms = time_ms(function, (*arrays, cupy.int32(n), cupy.int32(COLS)), blocks, 256)
            print(f"{name:9s} {label:28s} {ms * 1e3:7.1f} us  {floor / ms * 100:5.1f} % of floor")


if __name__ == "__main__":
    main()
