"""bfloat16 through DLPack, which CuPy (FLAME's array library) does not know.

FLAME keeps bfloat16 on the GPU as 16-bit integers in CuPy arrays. DLPack itself has a
bfloat16 type (``kDLBfloat``), so the exchange is a relabelling of the capsule's dtype field:
exporting, CuPy's uint16 capsule is marked bfloat16 before the consumer (PyTorch, JAX) opens
it; importing, a bfloat16 capsule is marked uint16 before CuPy opens it. The memory and its
owner are the producer's either way: no copy, no new lifetime rules.

Layouts (dlpack.h): a ``DLTensor`` starts ``data`` (8 bytes), ``device`` (8), ``ndim`` (4),
then ``dtype`` {code u8, bits u8, lanes u16} at byte 20. A ``"dltensor"`` capsule points at a
``DLManagedTensor`` whose first member is the DLTensor; a ``"dltensor_versioned"`` capsule at
a ``DLManagedTensorVersioned``: version (8), manager_ctx (8), deleter (8), flags (8), then the
DLTensor at byte 32.
"""

from __future__ import annotations

import ctypes

K_DL_UINT = 1
K_DL_BFLOAT = 4
_DTYPE_OFFSET = 20
_TENSOR_OFFSET = {b"dltensor": 0, b"dltensor_versioned": 32}

_get_name = ctypes.pythonapi.PyCapsule_GetName
_get_name.restype = ctypes.c_char_p
_get_name.argtypes = [ctypes.py_object]
_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


def _dtype_field(capsule) -> _DType:
    name = _get_name(capsule)
    if name not in _TENSOR_OFFSET:
        raise BufferError(f"DLPack: not an unconsumed DLPack capsule (named {name!r})")
    address = _get_pointer(capsule, name)
    return _DType.from_address(address + _TENSOR_OFFSET[name] + _DTYPE_OFFSET)


def capsule_dtype(capsule) -> tuple[int, int, int]:
    field = _dtype_field(capsule)
    return field.code, field.bits, field.lanes


def relabel(capsule, code: int, bits: int):
    """Set the capsule's element type to (code, bits) in place and return it."""
    field = _dtype_field(capsule)
    if field.bits != bits or field.lanes != 1:
        raise BufferError(
            f"DLPack: cannot relabel {field.bits}-bit x{field.lanes} elements as {bits}-bit"
        )
    field.code = code
    return capsule


class CapsuleSource:
    """Hands an already-made capsule to a consumer that asks through ``__dlpack__``."""

    def __init__(self, capsule, device):
        self._capsule, self._device = capsule, device

    def __dlpack__(self, stream=None, **kwargs):
        capsule, self._capsule = self._capsule, None
        if capsule is None:
            raise BufferError("DLPack: this capsule was already consumed")
        return capsule

    def __dlpack_device__(self):
        return self._device
