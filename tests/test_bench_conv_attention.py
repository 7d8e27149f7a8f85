"""``bench/conv_attention.py`` runs end to end without a GPU (FLAME's reference backend,
PyTorch on the CPU, tiny shapes), and its bookkeeping is right. The GPU numbers need the
device machine."""

import json
import math

import pytest

from bench import conv_attention

SECTIONS = ("conv", "attention", "resblock")


def torch_missing_reason() -> str | None:
    try:
        import torch  # noqa: F401
    except Exception as error:
        return f"PyTorch not importable ({type(error).__name__}: {error})"
    return None


def test_reference_run_writes_every_section(tmp_path):
    reason = torch_missing_reason()
    if reason:
        pytest.skip(reason)
    assert conv_attention.main(["--backend", "reference", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "conv_attention.json").read_text())
    assert report["backend"] == "reference"
    for name in SECTIONS:
        section = report[name]
        assert section["target"] and section["rows"], (name, section)
        for row in section["rows"]:
            results = row["results"]
            flame, peer = results["flame"], results[next(iter(results))]
            assert flame["status"] == "ok", (name, row["label"], flame)
            assert peer["status"] == "ok", (name, row["label"], peer)
            for entry in (flame, peer):
                assert math.isfinite(entry["ms"]) and entry["ms"] > 0
                assert math.isfinite(entry["first_call_ms"])
            assert flame["check"]["agrees"], (name, row["label"], flame["check"])
            assert all(value is None for value in row["ratios"].values())  # CPU: no ratios
            if "flame_fallback" in results:  # nothing to turn off on the reference backend
                assert results["flame_fallback"]["status"] == "skipped"
    assert report["resblock"]["rows"][0]["results"]["torch_compile"]["status"] == "skipped"
    for run in ("cold", "warm_disk"):
        entry = report["compile"][run]
        assert entry["status"] == "ok", entry
        assert entry["first_call_ms"] > 0 and entry["import_flame_ms"] > 0
    table = (tmp_path / "conv_attention.md").read_text()
    for name in (*SECTIONS, "compile"):
        assert f"## {name}" in table


def test_ratios_are_peer_over_flame_and_none_off_the_gpu():
    results = {
        "torch_sdpa": {"status": "ok", "ms": 2.0},
        "flame": {"status": "ok", "ms": 1.0},
        "flame_fallback": {"status": "ok", "ms": 4.0},
    }
    found = conv_attention.ratios(results, "cuda", "torch_sdpa")
    assert found == {"torch_sdpa": 2.0, "torch_sdpa_over_fallback": 0.5}
    failed = {**results, "flame": {"status": "error", "error": "planted"}}
    assert conv_attention.ratios(failed, "cuda", "torch_sdpa")["torch_sdpa"] is None
    assert conv_attention.ratios(results, "reference", "torch_sdpa")["torch_sdpa"] is None


def test_a_failing_system_is_an_error_entry_not_a_crash():
    from bench.clocks import HostClock

    def broken():
        raise RuntimeError("planted failure")

    def working():
        import numpy

        return (lambda: (numpy.ones(3),)), HostClock()

    systems = {
        "torch_eager": conv_attention.System(working),
        "flame": conv_attention.System(broken),
        "flame_fallback": conv_attention.System(skip="no setting"),
    }
    timing = conv_attention.Timing(warmup=0, calls=1, repeats=1)
    results = conv_attention.run_systems(systems, timing, ("out",), "reference")
    assert results["torch_eager"]["status"] == "ok"
    assert "planted failure" in results["flame"]["error"]
    assert results["flame_fallback"] == {"status": "skipped", "reason": "no setting"}
