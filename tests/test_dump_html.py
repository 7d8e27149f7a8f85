"""The dump's HTML page, rendered by headless Chromium (Debian's `chromium`) when installed."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

import flame as fl
import flame.nn.functional as F

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)"
)


@pytest.fixture
def page(tmp_path, nvrtc) -> Path:
    with fl.backend("reference"):
        x = fl.from_numpy(np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32))
        w = fl.from_numpy(np.ones((64, 16), np.float32))

        def model(x, w):
            return F.softmax(fl.matmul(F.layer_norm(x, (64,)), w), -1).sum(0)

        fl.dump(model, x, w, out=tmp_path / "dump", file=io.StringIO())
    return tmp_path / "dump" / "index.html"


def chromium(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", *arguments],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@needs_chromium
@pytest.mark.slow
def test_chromium_renders_graph_nodes_and_kernel_links(page):
    source = page.read_text()
    drawn = len(re.findall(r'<g class="node[^"]*" data-node=', source))
    result = chromium("--dump-dom", f"{page.as_uri()}#g1-k1")
    assert result.returncode == 0, result.stderr
    dom = result.stdout
    # the browser parsed the inline SVG: every node box is in the live DOM
    assert len(re.findall(r'<g class="node[^"]*" data-node=', dom)) == drawn >= 10
    links = set(re.findall(r'href="#(g\d+-k\d+)"', dom))
    assert {"g1-k0", "g1-k1"} <= links
    for target in links:
        assert f'id="{target}"' in dom
    # the page's script ran: the kernel named in the address is open
    assert re.search(r'<details class="kernel" id="g1-k1" open=""', dom)
    assert not re.search(r'<details class="kernel" id="g1-k0" open', dom)


@needs_chromium
@pytest.mark.slow
def test_chromium_screenshot_is_not_blank(page, tmp_path):
    shot = tmp_path / "page.png"
    result = chromium(f"--screenshot={shot}", "--window-size=1200,900", page.as_uri())
    assert result.returncode == 0 and shot.exists(), result.stderr
    assert _distinct_rows(shot.read_bytes()) > 50  # text and boxes, not one flat colour


def _distinct_rows(png: bytes) -> int:
    """How many different pixel rows an 8-bit RGB(A) PNG has (enough to tell a blank page)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    position, data, width, channels = 8, b"", 0, 4
    while position < len(png):
        length = int.from_bytes(png[position : position + 4], "big")
        kind = png[position + 4 : position + 8]
        body = png[position + 8 : position + 8 + length]
        if kind == b"IHDR":
            width = int.from_bytes(body[:4], "big")
            channels = {2: 3, 6: 4}[body[9]]
        elif kind == b"IDAT":
            data += body
        position += 12 + length
    raw = zlib.decompress(data)
    stride = 1 + width * channels
    # filter bytes differ row to row; compare the filtered rows, a fair proxy for content
    return len({raw[start : start + stride] for start in range(0, len(raw), stride)})
