"""``flame.nn.parallel.DistributedDataParallel``: PyTorch's data-parallel wrapper.

    dist.init_process_group("gloo")
    model = DistributedDataParallel(Net())   # rank 0's weights on every rank
    loss_fn(model(shard), target).backward() # .grad: the average over the ranks
    optimizer.step()

At wrap time every rank checks that every rank built the same model (parameter and buffer
names, shapes, dtypes) and takes rank 0's parameters and buffers. Each synchronized forward
(grad enabled, outside ``no_sync()``) first takes rank 0's buffers (``broadcast_buffers``)
and arms the reducer, which averages the gradients of the following ``backward()`` in
buckets (reducer.py says how, and what FLAME's lazy backward means for overlap).

Inside ``flame.compile`` (the whole step, forward and backward, traced together) on the
``nccl`` backend, the buffer broadcast and the buckets' all-reduces are IR nodes of the
program, planned once and replayed at every call. There ``no_sync()`` does not skip the
communication (the program is traced once and replayed whatever the context); the gradients
are still right, since averaging each micro-batch's gradient and then summing is the same as
averaging the sum. The ``gloo`` backend's collectives read values, which a traced function
does not have: DDP refuses to be traced there instead of skipping the averaging.
"""

from __future__ import annotations

import contextlib

import flame.distributed as dist
from flame.autograd import is_grad_enabled
from flame.compile import current_trace
from flame.nn.modules.module import Module
from flame.nn.parallel.reducer import DEFAULT_FIRST_BUCKET_BYTES, Reducer
from flame.nn.parallel.sync import broadcast_tensors, model_entries, verify_same_model
from flame.tensor import Tensor

_MB = 1024 * 1024
DEFAULT_BUCKET_CAP_MB = 25


def _refuse_tracing(what: str, unless_nccl: bool) -> None:
    if current_trace() is None or (unless_nccl and dist.get_backend() == "nccl"):
        return
    backend = "" if not unless_nccl else f" on the {dist.get_backend()} backend"
    raise RuntimeError(
        f"DistributedDataParallel: {what} inside flame.compile is not supported{backend}: "
        "its collectives run eagerly and read the tensors' values, which a function being "
        "traced does not have. Call the DistributedDataParallel module and backward() "
        "outside the compiled function"
        + (" (or use the nccl backend, whose collectives are IR ops)." if unless_nccl else ".")
    )


class DistributedDataParallel(Module):
    """``DistributedDataParallel(module, device_ids=None, output_device=None, dim=0,
    broadcast_buffers=True, init_sync=True, process_group=None, bucket_cap_mb=None,
    find_unused_parameters=False, check_reduction=False, gradient_as_bucket_view=False,
    static_graph=False)``, over the default process group."""

    def __init__(
        self,
        module: Module,
        device_ids=None,
        output_device=None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        init_sync: bool = True,
        process_group=None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
    ):
        super().__init__()
        _refuse_tracing("wrapping a module", unless_nccl=False)
        if not isinstance(module, Module):
            raise TypeError(
                f"DistributedDataParallel: expected a flame.nn.Module, got {type(module).__name__}"
            )
        if process_group is not None:
            raise NotImplementedError(
                "DistributedDataParallel: only the default process group exists "
                "(process_group=None)"
            )
        dist.get_world_size()  # a clear error when init_process_group was not called
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named_params = [(n, p) for n, p in module.named_parameters() if n not in ignored]
        trained = [(n, p) for n, p in named_params if p.requires_grad]
        if not trained:
            raise RuntimeError(
                "DistributedDataParallel is not needed when a module doesn't have any "
                "parameter that requires a gradient."
            )
        self.device_ids, self.output_device = _check_devices(
            [p for _, p in named_params], device_ids, output_device
        )
        self.module = module
        self.dim = dim
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.static_graph = bool(static_graph)
        self.parameters_to_ignore = ignored
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        if not cap > 0:
            raise ValueError(f"DistributedDataParallel: bucket_cap_mb must be > 0, got {cap}")
        self.bucket_bytes_cap = int(cap * _MB)
        first = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else self.bucket_bytes_cap
        limits = [first, self.bucket_bytes_cap] if first < self.bucket_bytes_cap else [first]
        if init_sync:
            options = {"bucket_bytes_cap": self.bucket_bytes_cap, "find_unused_parameters":
                       self.find_unused_parameters, "static_graph": self.static_graph,
                       "broadcast_buffers": self.broadcast_buffers}  # fmt: skip
            entries = model_entries(named_params, self._named_buffers())
            verify_same_model(entries, options, trained[0][1].backend)
            states = [p for _, p in named_params]
            if self.broadcast_buffers:
                states += [b for _, b in self._named_buffers()]
            broadcast_tensors(states, src=0)
        # static_graph: the same parameters are used at every step; finding the unused ones
        # at every step is PyTorch's first-iteration behaviour and costs one graph walk
        find_unused = self.find_unused_parameters or self.static_graph
        self._reducer = Reducer(trained, limits, find_unused)

    def _named_buffers(self) -> list:
        return [
            (name, buffer)
            for name, buffer in self.module.named_buffers()
            if name not in self.parameters_to_ignore
        ]

    def forward(self, *inputs, **kwargs):
        _refuse_tracing("the forward", unless_nccl=True)
        tracing = current_trace() is not None
        synchronized = is_grad_enabled() and (self.require_backward_grad_sync or tracing)
        if synchronized:
            self._reducer.prepare_for_forward()
        if self.require_forward_param_sync and self.broadcast_buffers:
            buffers = [b for _, b in self._named_buffers()]
            if buffers:
                broadcast_tensors(buffers, src=0)
        output = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = synchronized
        if synchronized:
            self._reducer.prepare_for_backward(_find_tensors(output))
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients of the forward/backward passes inside accumulate locally in ``.grad``;
        the first synchronized backward after it averages the accumulated sum. (The forward
        must run inside, as in PyTorch.)"""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: Module, params_and_buffers_to_ignore):
        """Names of parameters and buffers DDP neither broadcasts nor averages."""
        module._ddp_params_and_buffers_to_ignore = list(params_and_buffers_to_ignore)

    def _bucket_names(self) -> list[list[str]]:
        """The parameters of each bucket, in the order the buckets are all-reduced."""
        names = self._reducer.names
        return [[names[index] for index in bucket.indices] for bucket in self._reducer.buckets]


def _check_devices(params: list[Tensor], device_ids, output_device):
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    types = {p.device.type for p in params}
    if len(types) != 1:
        raise ValueError(
            "DistributedDataParallel's input module must be on the same type of devices, but "
            f"input module parameters locate in {sorted(types)}."
        )
    if not device_ids or types == {"cpu"}:
        if device_ids or output_device is not None:
            raise ValueError(
                "DistributedDataParallel device_ids and output_device arguments only work with "
                f"single-device GPU modules, but got device_ids {device_ids}, output_device "
                f"{output_device}, and module parameters on {sorted(types)}."
            )
        return None, None
    # FLAME drives one GPU per process (cuda:0 of what the process sees): the index names
    # this process's GPU, as LOCAL_RANK does in PyTorch scripts
    index = [_device_index(device_ids[0])]
    return index, _device_index(output_device) if output_device is not None else index[0]


def _device_index(value) -> int:
    if isinstance(value, int):
        return value
    text = str(value)
    kind, _, number = text.partition(":")
    if kind != "cuda":
        raise ValueError(f"DistributedDataParallel: device {text!r} is not a GPU")
    return int(number or 0)


def _find_tensors(value) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _find_tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _find_tensors(item)]
    return []
