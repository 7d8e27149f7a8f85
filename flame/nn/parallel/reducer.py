"""Gradient averaging for ``DistributedDataParallel``: parameters in buckets, one all-reduce
per bucket.

Buckets are made once, at wrap time, as PyTorch's reducer makes them after its first
iteration: parameters taken in reverse order (the order their gradients are produced in),
one dtype per bucket, a bucket closed once it holds ``limit`` bytes, the first bucket's
limit small (1 MiB with the default ``bucket_cap_mb``) so the first all-reduce is short.

When each gradient is ready: a post-accumulate-grad hook on every parameter tells the
reducer (``mark_ready``). FLAME's ``backward()`` builds the whole backward graph first and
then writes every ``.grad``, lazily, so the hooks of one backward all run at its end and
"ready" means "the graph of this gradient is built", not "computed". The reducer therefore
waits for the last parameter and then averages every bucket. On the ``gloo`` backend it
realizes every bucket in one schedule (the backward runs once, its work shared between
buckets) and then all-reduces them in order, with no overlap. On ``nccl`` each bucket's
all-reduce is a lazy IR node (``_nccl_average``), planned with the backward (and, inside
``flame.compile``, with the optimizer: once, with the program): the plan starts each
all-reduce on a communication stream as soon as its bucket is computed, in the same order
on every rank, runs the rest of the backward meanwhile, and waits for it before the first
kernel that reads the average (flame/runtime/plans.py ``overlap_collectives``).

After the all-reduce each ``param.grad`` is a view of its slice of the bucket's buffer (no
copy, as PyTorch's ``gradient_as_bucket_view=True``; the buffer is new at every
synchronization, so the views behave as separate tensors either way).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np

import flame.distributed as dist
from flame.autograd import _walk, no_grad
from flame.compile import current_trace
from flame.joining import cat
from flame.shaping import clone
from flame.tensor import Tensor, realize

# PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


@dataclass
class Bucket:
    indices: list[int]  # positions in the reducer's parameter list, in buffer order
    offsets: list[int] = field(default_factory=list)
    numel: int = 0


def assign_buckets(params: list[Tensor], limits: list[int]) -> list[Bucket]:
    """PyTorch's ``compute_bucket_assignment_by_size`` over the parameters in reverse order:
    per (dtype, backend), add parameters until a bucket holds ``limits[k]`` bytes or more,
    the k-th bucket of that kind using ``limits[k]`` (the last limit from then on)."""
    done: list[list[int]] = []
    open_buckets: dict = {}
    for index in reversed(range(len(params))):
        param = params[index]
        key = (param.dtype, param.backend)
        state = open_buckets.setdefault(key, {"indices": [], "bytes": 0, "limit": 0})
        state["indices"].append(index)
        state["bytes"] += param.numel() * param.dtype.itemsize
        if state["bytes"] >= limits[state["limit"]]:
            done.append(state["indices"])
            next_limit = min(state["limit"] + 1, len(limits) - 1)
            open_buckets[key] = {"indices": [], "bytes": 0, "limit": next_limit}
    done += [state["indices"] for state in open_buckets.values() if state["indices"]]
    buckets = []
    for indices in done:
        bucket = Bucket(indices)
        for index in indices:
            bucket.offsets.append(bucket.numel)
            bucket.numel += params[index].numel()
        buckets.append(bucket)
    return buckets


class Reducer:
    def __init__(self, named_params: list, limits: list[int], find_unused: bool):
        self.names = [name for name, _ in named_params]
        self.params = [param for _, param in named_params]
        self.buckets = assign_buckets(self.params, limits)
        self.find_unused = find_unused
        self.armed = False  # a synchronized forward ran; its backward will be averaged
        self.ready: set[int] = set()
        self.seen_grad = False  # a hook ran in this iteration (PyTorch's require_finalize)
        self.handles = []
        reducer = weakref.ref(self)
        for index, param in enumerate(self.params):
            self.handles.append(
                param.register_post_accumulate_grad_hook(_on_grad_ready(reducer, index))
            )

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # --- one iteration ----------------------------------------------------------------------
    def prepare_for_forward(self) -> None:
        """PyTorch's check: the previous synchronized backward reached every parameter."""
        if self.armed and self.seen_grad:
            missing = [name for i, name in enumerate(self.names) if i not in self.ready]
            self.armed = False
            raise RuntimeError(
                "DistributedDataParallel: expected to have finished reduction in the prior "
                "iteration before starting a new one. This error indicates that your module has "
                "parameters that were not used in producing loss. You can enable unused "
                "parameter detection by passing the keyword argument "
                "`find_unused_parameters=True` to `flame.nn.parallel.DistributedDataParallel`, "
                "and by making sure all `forward` function outputs participate in calculating "
                f"loss. Parameters which did not receive grad for rank {dist.get_rank()}: "
                + ", ".join(missing)
            )

    def prepare_for_backward(self, outputs: list[Tensor]) -> None:
        """Arm the hooks; with ``find_unused_parameters``, the parameters the outputs do not
        depend on count as ready now (they add zeros, or the gradient they hold)."""
        self.armed, self.ready, self.seen_grad = True, set(), False
        tracing = current_trace() is not None
        if not (self.find_unused or tracing):
            return
        reached = {id(node) for node in _walk([out.node for out in outputs])}
        unused = {index for index, param in enumerate(self.params) if id(param.node) not in reached}
        if tracing and (unused or self.find_unused):
            # a traced program that leaves a bucket out would skip its averaging at every
            # replay, with no later forward to notice; and finding the unused parameters of
            # every rank reads values
            names = ", ".join(self.names[index] for index in sorted(unused)) or "none"
            raise RuntimeError(
                "DistributedDataParallel inside flame.compile needs every parameter that "
                "requires grad to take part in the forward (find_unused_parameters and "
                f"static_graph are not supported there); not used: {names}"
            )
        self.ready = unused

    def mark_ready(self, index: int) -> None:
        if not self.armed:  # no_sync, or a second backward after one forward: local only
            return
        if current_trace() is not None and dist.get_backend() != "nccl":
            raise RuntimeError(
                "DistributedDataParallel: the gloo backend's collectives read the gradients' "
                "values, which a function being traced by flame.compile does not have; call "
                "backward() outside the compiled function (or use the nccl backend)"
            )
        self.seen_grad = True
        self.ready.add(index)
        if len(self.ready) == len(self.params):
            self.armed = False
            self._reduce()

    # --- the all-reduce ---------------------------------------------------------------------
    def _reduce(self) -> None:
        with no_grad():
            flats = [self._flatten(bucket) for bucket in self.buckets]
            has_grad = self._anyone_has_grad() if self.find_unused else None
            if dist.get_backend() == "nccl":
                reduced = _nccl_average(flats)
            else:
                realize(*flats)  # one schedule: the backward shared by every bucket runs once
                for flat in flats:
                    dist.all_reduce(flat, op=dist.ReduceOp.AVG)
                reduced = flats
            for bucket, flat in zip(self.buckets, reduced):
                for index, offset in zip(bucket.indices, bucket.offsets):
                    if has_grad is not None and not has_grad[index]:
                        continue  # unused on every rank: .grad stays as it was, as PyTorch
                    param = self.params[index]
                    param.grad = flat[offset : offset + param.numel()].reshape(param.shape)

    def _flatten(self, bucket: Bucket) -> Tensor:
        parts = []
        for index in bucket.indices:
            param = self.params[index]
            grad = param.grad
            if grad is None:  # unused here (find_unused_parameters): this rank adds zeros
                from flame.creation import zeros_like

                grad = zeros_like(param)
            parts.append(grad.reshape(-1))
        return cat(parts) if len(parts) > 1 else clone(parts[0])  # new memory either way

    def _anyone_has_grad(self) -> np.ndarray:
        """Per parameter: does any rank hold a gradient for it (used now or accumulated)."""
        from flame.backend import backend
        from flame.creation import tensor

        flags = np.array([param.grad is not None for param in self.params], np.int32)
        with backend(self.params[0].backend):
            shared = tensor(flags)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        return shared.numpy() > 0


def _nccl_average(flats: list[Tensor]) -> list[Tensor]:
    """Each bucket's all-reduce as a lazy IR node (flame/distributed/functional.py). Outside
    ``flame.compile`` they are realized together: one schedule holds the backward and every
    bucket's collective, each issued once its bucket is computed, in the same order on every
    rank (the graphs are the same); inside, they are part of the traced program."""
    from flame.distributed import functional

    reduced = [functional.all_reduce(flat, "avg") for flat in flats]
    if current_trace() is None:
        realize(*reduced)
    return reduced


def _on_grad_ready(reducer: weakref.ref, index: int):
    def hook(param: Tensor) -> None:
        owner = reducer()
        if owner is not None:
            owner.mark_ready(index)

    return hook
