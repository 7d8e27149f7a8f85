"""Correctness before timing: every system's first output against one reference.

The reference is PyTorch eager's own first output where it runs (it goes first), otherwise the
expression in NumPy float64 on the same inputs (rounded to bfloat16 first where the workload's
inputs are bfloat16, as every system sees them).
"""

import numpy

from bench.expressions import array_ops
from bench.workloads import BFLOAT16


def widened(value):
    """A 16-bit float output as float32: CuPy has no bfloat16, and the error is computed wide.
    FLAME and PyTorch tensors both have ``.float()``."""
    if "float16" in str(getattr(value, "dtype", "")) and hasattr(value, "float"):
        value = value.float()
        if hasattr(value, "realize"):
            value = value.realize()
    return value


def as_check_array(value, xp):
    """Any system's output as an array of ``xp`` (CuPy reads FLAME and torch tensors zero-copy)."""
    value = widened(value)
    if xp is numpy:
        if type(value).__module__.startswith("torch"):
            return value.detach().cpu().numpy()
        if hasattr(value, "numpy"):
            return numpy.asarray(value.numpy())
        return numpy.asarray(value)
    return xp.asarray(value)


def relative_l2_error(result, reference, xp) -> float:
    if tuple(result.shape) != tuple(reference.shape):
        raise ValueError(f"result shape {tuple(result.shape)} != reference {reference.shape}")
    wide_reference = reference.astype(xp.float64).ravel()
    difference = result.astype(xp.float64).ravel() - wide_reference
    return float(xp.linalg.norm(difference) / xp.linalg.norm(wide_reference))


def round_to_bfloat16(array):
    """float32 values rounded to the nearest bfloat16 (ties to even), still as float32."""
    bits = numpy.ascontiguousarray(array, dtype=numpy.float32).view(numpy.uint32)
    rounded = (bits + numpy.uint32(0x7FFF) + ((bits >> 16) & 1)) & numpy.uint32(0xFFFF0000)
    return rounded.astype(numpy.uint32).view(numpy.float32)


def oracle_input(array, spec):
    """One input for the NumPy oracle: floats in float64 (after bfloat16 rounding), integers
    as they are."""
    host = as_check_array(array, numpy)
    if spec.dtype == BFLOAT16:
        host = round_to_bfloat16(host)
    return host.astype(numpy.float64) if host.dtype.kind == "f" else host


class Reference:
    """The answer every system is checked against, and the check itself."""

    def __init__(self, workload, inputs, specs, xp):
        self.workload = workload
        self.inputs = inputs
        self.specs = specs
        self.xp = xp
        self.expected_shape = workload.output(tuple(spec.shape for spec in specs))
        self.array = None
        self.name = None

    def check(self, system, output) -> dict:
        if self.array is None and system.key == "torch_eager":
            self._set(as_check_array(output, self.xp), "torch eager")
            return {"is_reference": True}
        if self.array is None:
            self._set(self._numpy_float64(), "numpy float64")
        result = as_check_array(output, self.xp)
        error = relative_l2_error(result, self.array, self.xp)
        finite = bool(self.xp.isfinite(result).all())
        tolerance = self.workload.tolerance
        return {
            "reference": self.name,
            "rel_l2_error": error,
            "all_finite": finite,
            "tolerance": tolerance,
            "passed": finite and error < tolerance,  # NaN compares false, so it fails too
        }

    def _set(self, array, name: str):
        # The declared output shape sets the floor: a reference of another shape means the
        # declaration is wrong, and the floor with it.
        if tuple(array.shape) != tuple(self.expected_shape):
            raise ValueError(
                f"{name} output shape {tuple(array.shape)} != declared {self.expected_shape}"
            )
        self.array, self.name = array, name

    def _numpy_float64(self):
        host = [
            oracle_input(array, spec) for array, spec in zip(self.inputs, self.specs, strict=True)
        ]
        value = self.workload.expression(array_ops(numpy), *host)
        return self.xp.asarray(value)
