"""Staged host-to-device copies (flame/runtime/staging.py): each array arrives whole and in
order, through more copies than the ring has buffers, whatever its shape, dtype and size."""

from __future__ import annotations

import numpy as np
import pytest

from flame.runtime.staging import StagedUploads

pytestmark = pytest.mark.gpu


def test_many_uploads_of_growing_size_arrive_intact(rng):
    import cupy

    uploads = StagedUploads(slots=3)
    sent, received = [], []
    for index in range(4 * uploads.slots + 1):
        size = 1 + index * 37
        values = rng.standard_normal(size).astype(np.float32 if index % 2 else np.float64)
        sent.append(values.copy())
        received.append(uploads.put(values))
        values[...] = -1  # the caller's array may change at once: it was staged
    tables = rng.integers(0, 2**40, size=(5, 4)).astype(np.int64)
    received_table = uploads.put(tables)
    cupy.cuda.get_current_stream().synchronize()
    for values, array in zip(sent, received):
        assert array.dtype == values.dtype and array.shape == values.shape
        np.testing.assert_array_equal(cupy.asnumpy(array), values)
    np.testing.assert_array_equal(cupy.asnumpy(received_table), tables)
