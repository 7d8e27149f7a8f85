"""Correctness before timing: every system's first output against one reference.

The reference is PyTorch eager's own first output where it runs (it goes first), otherwise the
expression in NumPy float64 on the same inputs (rounded to bfloat16 first where the workload's
inputs are bfloat16, as every system sees them), or the workload's own float64 oracle.

A workload with several outputs (forward + backward) is checked output by output; its error is
the largest, and each output's error is kept under ``per_output``.
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
        if type(value).__module__.startswith("cupy"):
            return value.get()  # CuPy refuses an implicit copy to the host
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


def output_parts(workload, output) -> list:
    """The outputs of one call as a list: one entry, or one per declared output name."""
    if not workload.output_names:
        return [output]
    parts = list(output)
    if len(parts) != len(workload.output_names):
        raise ValueError(f"{len(parts)} outputs, declared {workload.output_names}")
    return parts


class Reference:
    """The answer every system is checked against, and the check itself."""

    def __init__(self, workload, inputs, specs, xp):
        self.workload = workload
        self.inputs = inputs
        self.specs = specs
        self.xp = xp
        shapes = tuple(spec.shape for spec in specs)
        output = workload.output(shapes)
        self.expected_shapes = [tuple(s) for s in output] if workload.output_names else [output]
        self.arrays = None
        self.name = None

    def check(self, system, output) -> dict:
        parts = [as_check_array(part, self.xp) for part in output_parts(self.workload, output)]
        if self.arrays is None and system.key == "torch_eager":
            self._set(parts, "torch eager")
            return {"is_reference": True}
        if self.arrays is None:
            self._set(self._numpy_float64(), "numpy float64")
        errors = [
            relative_l2_error(part, reference, self.xp)
            for part, reference in zip(parts, self.arrays, strict=True)
        ]
        finite = all(bool(self.xp.isfinite(part).all()) for part in parts)
        tolerance = self.workload.tolerance
        error = max(errors, key=lambda value: value if value == value else float("inf"))
        result = {
            "reference": self.name,
            "rel_l2_error": error,
            "all_finite": finite,
            "tolerance": tolerance,
            # NaN compares false, so it fails too
            "passed": finite and all(value < tolerance for value in errors),
        }
        if self.workload.output_names:
            result["per_output"] = dict(zip(self.workload.output_names, errors, strict=True))
        return result

    def _set(self, arrays, name: str):
        # The declared output shape sets the floor: a reference of another shape means the
        # declaration is wrong, and the floor with it.
        shapes = [tuple(array.shape) for array in arrays]
        if shapes != [tuple(shape) for shape in self.expected_shapes]:
            raise ValueError(f"{name} output shapes {shapes} != declared {self.expected_shapes}")
        self.arrays, self.name = arrays, name

    def _numpy_float64(self) -> list:
        host = [
            oracle_input(array, spec) for array, spec in zip(self.inputs, self.specs, strict=True)
        ]
        if self.workload.oracle is not None:
            value = self.workload.oracle(*host)
        else:
            value = self.workload.expression(array_ops(numpy), *host)
        return [self.xp.asarray(part) for part in output_parts(self.workload, value)]
