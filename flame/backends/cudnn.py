"""``flame.backends.cudnn``: whether cuDNN computes convolutions and attention."""

from __future__ import annotations

import contextlib
import sys

enabled = True  # read at run time by flame/runtime/library_conv.py and library_attention.py
# FLAME's layout choice for float16/bfloat16 2-d convolutions, read when a convolution is
# built (a compiled function keeps the choice it traced with): True computes them on
# channels-last memory (flame/ir/ops/conv.py says why); False keeps the user's NCHW.
channels_last = True


def is_available() -> bool:
    """Whether the cuDNN frontend and library load (True does not mean ``enabled``)."""
    from flame.runtime import library_cudnn

    return library_cudnn.status().reason in ("", "disabled by flame.backends.cudnn.enabled = False")


def version() -> str | None:
    """cuDNN's version ("9.10.2"), or None where it does not load."""
    from flame.runtime import library_cudnn

    return library_cudnn.status().version or None


@contextlib.contextmanager
def flags(enabled: bool | None = None, channels_last: bool | None = None):
    """``with flame.backends.cudnn.flags(enabled=False): ...``: the settings for the block,
    restored after it (PyTorch's ``torch.backends.cudnn.flags``; its other settings have no
    FLAME counterpart)."""
    module = sys.modules[__name__]
    given = {"enabled": enabled, "channels_last": channels_last}
    previous = {name: getattr(module, name) for name in given}
    for name, value in given.items():
        if value is not None:
            setattr(module, name, bool(value))
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)
