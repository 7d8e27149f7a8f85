"""The `flame` command, run as `python -m flame` in a child process, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flame._version import __version__
from flame.runtime.cache import DiskCache

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_flame(*arguments: str, cache_dir: Path) -> subprocess.CompletedProcess:
    environment = dict(os.environ)
    existing = environment.get("PYTHONPATH")
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), existing]))
    # Never let a test see or touch the user's real cache.
    environment["FLAME_CACHE_DIR"] = str(cache_dir)
    return subprocess.run(
        [sys.executable, "-m", "flame", *arguments],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )


def fill_cache(cache_dir: Path, count: int) -> DiskCache:
    cache = DiskCache(cache_dir)
    for index in range(count):
        cache.put(DiskCache.key("kernel", str(index)), b"\x7fELF" + bytes(1000))
    return cache


def test_version(tmp_path):
    result = run_flame("--version", cache_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"flame {__version__}"
    assert __version__ == "0.1.0"


def test_no_command_prints_help(tmp_path):
    result = run_flame(cache_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "usage: flame" in result.stdout and "cache" in result.stdout


def test_info_reports_versions_gpu_and_cache(tmp_path):
    cache_dir = tmp_path / "cache"
    fill_cache(cache_dir, 2)
    result = run_flame("info", cache_dir=cache_dir)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    lines = {line.split()[0] for line in result.stdout.splitlines() if line.strip()}
    assert {"flame", "python", "numpy", "cupy", "nvrtc", "cache"} <= lines
    assert any(line.startswith("gpu") for line in result.stdout.splitlines())
    assert str(cache_dir) in result.stdout
    assert "2 entries" in result.stdout


def test_cache_size_list_and_clear(tmp_path):
    cache_dir = tmp_path / "cache"
    cache = fill_cache(cache_dir, 3)

    size = run_flame("cache", "size", cache_dir=cache_dir)
    assert size.returncode == 0, size.stderr
    assert "3 entries" in size.stdout and str(cache_dir) in size.stdout

    listing = run_flame("cache", "list", cache_dir=cache_dir)
    assert listing.returncode == 0, listing.stderr
    for key, _, _ in cache.entries():
        assert key in listing.stdout

    cleared = run_flame("cache", "clear", cache_dir=cache_dir)
    assert cleared.returncode == 0, cleared.stderr
    assert "removed 3 entries" in cleared.stdout
    assert cache.entries() == []

    empty = run_flame("cache", "size", cache_dir=cache_dir)
    assert "0 entries" in empty.stdout


def test_cache_dir_option_overrides_environment(tmp_path):
    fill_cache(tmp_path / "other", 1)
    result = run_flame("cache", "--dir", str(tmp_path / "other"), "size", cache_dir=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "1 entry" in result.stdout and str(tmp_path / "other") in result.stdout


def test_cache_without_action_is_a_usage_error(tmp_path):
    result = run_flame("cache", cache_dir=tmp_path)
    assert result.returncode == 2
    assert "usage: flame cache" in result.stderr


def test_main_is_callable_in_process(tmp_path, monkeypatch, capsys):
    from flame.tools.cli import main

    monkeypatch.setenv("FLAME_CACHE_DIR", str(tmp_path))
    assert main(["cache", "size"]) == 0
    assert str(tmp_path) in capsys.readouterr().out
