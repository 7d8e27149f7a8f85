"""A fusion grouping is reused only under the mode it was made in (flame/ir/passes/reuse.py):
deterministic algorithms keep a row kernel's column sums out of atomics (row_columns.py),
so the same graph is grouped otherwise. Planned on the CUDA backend without a GPU."""

from __future__ import annotations

import numpy as np

import flame as fl
from flame.runtime.walks import linearize
from tests.test_plan_reuse_sizes import (  # noqa: F401  (planning: a fixture)
    SHAPES,
    _diffusion_step,
    _images,
    call,
    planning,
)
from tests.test_row_column_fusion import _layer_norm_fwd_bwd


def _launches(executor, deterministic: bool) -> int:
    with fl.use_deterministic_algorithms(deterministic):
        outputs = _layer_norm_fwd_bwd(np.random.default_rng(11), (4096, 512))
        pending = [tensor.node for tensor in outputs]
        _, inputs, key = linearize(pending)
        return len(executor.plan_for(pending, inputs, key).launches)


def test_the_deterministic_mode_is_grouped_apart(planning, monkeypatch):  # noqa: F811
    monkeypatch.setenv("FLAME_PLAN_CACHE", "1")  # the groupings on disk are kept apart too
    assert [_launches(planning, mode) for mode in (False, True, False)] == [1, 2, 1]
    fresh = type(planning)(planning.kernels)  # a new process over the same cache directory
    fresh.loaded, fresh.made = [], []
    assert _launches(fresh, True) == 2


def _plan(executor, shape) -> None:
    outputs = _layer_norm_fwd_bwd(np.random.default_rng(11), shape)
    pending = [tensor.node for tensor in outputs]
    _, inputs, key = linearize(pending)
    executor.plan_for(pending, inputs, key)


def test_a_patched_fusion_setting_is_grouped_apart(planning, monkeypatch):  # noqa: F811
    """A grouping made under one value of a fusion setting (``reuse.FUSION_SETTINGS``) is
    not reused under another: in this process (a layer norm's step at a new size, reused
    with the setting unchanged) or from disk (the diffusion step in a new process)."""
    from flame.ir.passes import materialize

    monkeypatch.setenv("FLAME_PLAN_CACHE", "1")
    _plan(planning, (4096, 512))
    _plan(planning, (8192, 512))
    assert planning.decisions.reused == 1  # same setting: reused
    call(planning, _diffusion_step(), _images(SHAPES[0]))  # stored on disk
    monkeypatch.setattr(materialize, "WIDE_SOURCES", materialize.WIDE_SOURCES + 3)
    _plan(planning, (16384, 512))
    assert planning.decisions.reused == 1
    fresh = type(planning)(planning.kernels)
    fresh.loaded, fresh.made = [], []
    call(fresh, _diffusion_step(), _images(SHAPES[1]))
    assert fresh.decisions.read == 0 and fresh.decisions.reused == 0
