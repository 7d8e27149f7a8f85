"""``flame.nn.parallel``: ``DistributedDataParallel`` (PyTorch's), over
``flame.distributed``'s default process group.

Imported on first use (``import flame`` does not load the distributed backends)."""

__all__ = ["DistributedDataParallel"]


def __getattr__(name: str):
    if name == "DistributedDataParallel":
        from flame.nn.parallel.distributed import DistributedDataParallel

        return DistributedDataParallel
    raise AttributeError(f"module 'flame.nn.parallel' has no attribute {name!r}")
