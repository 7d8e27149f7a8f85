"""Switches for the libraries FLAME calls, as PyTorch's ``torch.backends``:
``flame.backends.cudnn.enabled`` (default True) lets convolutions and attention run through
cuDNN; set it to False to run FLAME's own kernels (the CuPy convolution fallback, FLAME's
flash-attention kernel). Like PyTorch's, it is a process-wide default read when an op runs."""

from flame.backends import cudnn

__all__ = ["cudnn"]
