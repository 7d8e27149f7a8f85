"""`flame dump` and `flame check` over a script with a convolution and fused attention: the
dump names every conv with its chosen layout and the attention op as library calls (CPU tier,
where the script runs on the reference backend and the plans are still made), and on the GPU
`flame check` finds every kernel of such a program within its tolerance of the float64
reference."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import numpy as np
import flame as fl
import flame.nn.functional as F

rng = np.random.default_rng(0)
def bf16(*shape):
    return fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(fl.bfloat16)

x, w = bf16(2, 8, 6, 6).requires_grad_(), bf16(8, 8, 3, 3).requires_grad_()
q, k, v = (bf16(1, 2, 16, 32).requires_grad_() for _ in range(3))
h = F.silu(F.conv2d(x, w, padding=1))
o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
loss = h.float().square().mean() + o.float().square().mean()
loss.backward()
grads = [t.grad.float().sum() for t in (x, w, q, k, v)]
print("loss", float(loss.item()), [float(g.item()) for g in fl.realize(*grads)])
"""


def _flame(*arguments, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["FLAME_CACHE_DIR"] = str(cwd / "cache")  # never the user's cache
    env.pop("FLAME_DUMP", None)
    return subprocess.run(
        [sys.executable, "-m", "flame", *arguments], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_dump_shows_the_conv_layout_and_the_attention_calls(tmp_path, nvrtc):
    script = tmp_path / "step.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result = _flame("dump", str(script), "--out", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loss" in result.stdout
    fusion = "\n".join(path.read_text() for path in (tmp_path / "out").glob("*/fusion.txt"))
    for op in ("conv", "conv_data_grad", "conv_weight_grad", "attention", "attention_backward"):
        assert f"library over {op} " in fusion, op
    # the chosen layout of every conv is printed with it
    convs = [line for line in fusion.splitlines() if "= conv" in line]
    assert convs and all("channels_last=True" in line for line in convs), convs


@pytest.mark.gpu
@pytest.mark.slow
def test_flame_check_covers_conv_and_attention(tmp_path):
    script = tmp_path / "step.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result = _flame("check", str(script), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "every kernel is within its tolerance" in result.stdout
