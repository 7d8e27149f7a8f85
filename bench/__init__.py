"""FLAME benchmarks: FLAME and its peers (PyTorch eager, torch.compile, cupy.fuse) in one run.

Run ``python -m bench --help``. Nothing heavy is imported here on purpose: ``python -m bench``
must point the compile caches at fresh directories before torch, CuPy or FLAME load.
"""
