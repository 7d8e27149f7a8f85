"""GroupNorm + SiLU + time embedding on channels-last float32 memory, forward and backward,
on the GPU against the reference backend (the same graph): a script for `flame check` and
for finding which output goes wrong. Prints the largest difference of each result."""

import sys

import numpy as np

import flame as fl
import flame.nn.functional as F

channels, groups, height, width = (int(v) for v in (sys.argv[1:] or [16, 4, 5, 5]))
rng = np.random.default_rng(0)
shape = (2, channels, height, width)
x_nchw = (rng.standard_normal(shape) * (0.5 + 2 * rng.random((1, channels, 1, 1)))
          + 2 * rng.standard_normal((1, channels, 1, 1))).astype(np.float32)  # fmt: skip
arrays = {
    "x": np.ascontiguousarray(x_nchw.transpose(0, 2, 3, 1)),  # NHWC memory
    "w": (1 + 0.5 * rng.standard_normal(channels)).astype(np.float32),
    "b": (0.5 * rng.standard_normal(channels)).astype(np.float32),
    "t": rng.standard_normal((2, channels, 1, 1)).astype(np.float32),
    "gy": rng.standard_normal(shape).astype(np.float32),
}


def run(backend: str) -> dict:
    with fl.backend(backend):
        x = fl.from_numpy(arrays["x"]).permute(0, 3, 1, 2)
        w, b, t = (fl.from_numpy(arrays[key]) for key in "wbt")

        def block(x, w, b, t):
            return F.silu(F.group_norm(x, groups, w, b)) + t

        out, pullback = fl.vjp(block, x, w, b, t)
        grads = pullback(fl.from_numpy(arrays["gy"]))
        return {"out": out.numpy(), **{k: g.numpy() for k, g in zip("xwbt", grads)}}


gpu, ref = run("cuda"), run("reference")
for key in gpu:
    error = float(np.max(np.abs(gpu[key] - ref[key])))
    print(f"{key}: max |gpu - reference| {error:.3g} (reference max {np.abs(ref[key]).max():.3g})")
