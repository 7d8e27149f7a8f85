"""Weight averaging (``torch.optim.swa_utils``): ``AveragedModel`` for SWA and EMA.

    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
    for batch in loader:
        ...; optimizer.step()
        ema.update_parameters(model)      # one multi-tensor kernel per dtype group

PyTorch's formulas and PyTorch's order of events: the first update copies the model, every
later one averages; ``n_averaged`` is an int64 buffer (in the state_dict, as PyTorch's).

Inside ``flame.compile``: ``update_parameters`` is traced as in-place writes (the choice
between copying and averaging made on the device from ``n_averaged``), and the averaging
functions above write with ``copy_`` while tracing (``flame.optim._common.apply_rule``): an
``avg_fn`` or ``multi_avg_fn`` of your own must use in-place tensor ops there (not
``flame.foreach``, which runs at once), and may read ``n_averaged`` as a tensor.

How an update runs. ``get_ema_multi_avg_fn`` and ``get_swa_multi_avg_fn`` give functions that
update a whole list in place through ``flame.foreach``: on the GPU one multi-tensor kernel per
dtype group, whatever the number of tensors. Their per-update values sit in a small device
tensor the kernel reads (EMA: made once; SWA: computed on the device from ``n_averaged``, one
tiny kernel), so an update never waits for the GPU. The model's count is mirrored on the host
to decide "copy or average" without reading ``n_averaged`` back (``load_state_dict`` drops
the mirror; the next update reads the buffer once). ``n_averaged += 1`` is one more tiny
write. ``avg_fn`` (one tensor at a time, PyTorch's slow path) is supported but runs one write
per tensor.

Non-float tensors (integer buffers with ``use_buffers=True``) are averaged in float and
truncated back, as PyTorch's EMA does (``p_ema.copy_(p_ema * decay + p_model * (1 - decay))``).
"""

from __future__ import annotations

import copy
import itertools

import numpy as np

from flame.ir import dtypes
from flame.nn.modules.module import Module
from flame.nn.parameter import Parameter
from flame.runtime.staging import StagedUploads
from flame.tensor import Tensor

__all__ = [
    "AveragedModel", "copy_module", "get_ema_avg_fn", "get_ema_multi_avg_fn", "get_swa_avg_fn",
    "get_swa_multi_avg_fn", "update_bn",
]  # fmt: skip

# the per-update values an averaging rule reads, in the order the rules index them
_WEIGHT, _ONE_MINUS_WEIGHT, _KEEP, _TAKE = range(4)


# --- the rules (elementwise: flame.foreach fuses each into one kernel) ------------------------


def _widen(tensor: Tensor) -> Tensor:
    """float16/bfloat16 compute in float32 (rounded once, at the write), as PyTorch's lerp."""
    if tensor.dtype in (dtypes.float16, dtypes.bfloat16):
        return tensor.to(dtypes.float32)
    return tensor


def lerp_rule(averaged, current, h):
    """``torch.lerp(averaged, current, weight)`` with its two formulas: for a weight below
    1/2 from the start, otherwise from the end (where the weight is near 1)."""
    from flame.functional import where

    averaged, current = _widen(averaged), _widen(current)
    weight = h[_WEIGHT]
    difference = current - averaged
    low = averaged + weight * difference
    high = current - difference * h[_ONE_MINUS_WEIGHT]
    return where(weight < 0.5, low, high)


def mix_rule(averaged, current, h):
    """``averaged * keep + current * take`` in float (the non-float tensors' way)."""
    return averaged * h[_KEEP] + current * h[_TAKE]


def copy_rule(averaged, current, h):
    """``current``, exactly, for any dtype (a select, so that the value is a new one)."""
    from flame.functional import where

    return where(h[_WEIGHT] >= 0.0, current, 0)


# --- the averaging functions (PyTorch's names and signatures) ---------------------------------


def _scalar_dtype(like: Tensor):
    return dtypes.float64 if like.dtype is dtypes.float64 else dtypes.float32


def _host_scalars(values, like: Tensor, dtype=None) -> Tensor:
    """``values`` as a realized tensor on ``like``'s backend, float64 for float64 tensors and
    float32 otherwise (foreach's kernels are keyed by the lists' dtypes, not the values': a
    rule must always get the same dtype of values for the same dtypes of lists)."""
    from flame.backend import backend
    from flame.creation import tensor

    dtype = dtype or _scalar_dtype(like)
    with backend(like.backend):
        return tensor(np.asarray(values, dtype=dtype.numpy)).realize()


def _is_float(tensor: Tensor) -> bool:
    return tensor.dtype.is_float


def _check_decay(decay) -> None:
    if decay < 0.0 or decay > 1.0:
        raise ValueError(
            f"Invalid decay value {decay} provided. Please provide a value in [0,1] range."
        )


def get_ema_multi_avg_fn(decay=0.999):
    """``multi_avg_fn(averaged_list, current_list, n_averaged)`` for an EMA of ``decay``:
    ``averaged = lerp(averaged, current, 1 - decay)``, one ``flame.foreach`` call (one kernel
    on the GPU). Its values are made once per backend and dtype and read from memory."""
    _check_decay(decay)
    weight = 1.0 - decay
    made: dict[tuple, Tensor] = {}  # (backend, dtype) -> the realized per-update values

    def ema_update(ema_param_list, current_param_list, _=None) -> None:
        from flame.optim._common import apply_rule

        if not ema_param_list:
            return
        first = ema_param_list[0]
        key = (first.backend, _scalar_dtype(first))
        h = made.get(key)
        if h is None:
            lerp_weight = np.asarray(weight, dtype=key[1].numpy)
            values = [lerp_weight, 1 - lerp_weight, decay, weight]
            h = made[key] = _host_scalars(values, first)
        rule = lerp_rule if _is_float(first) else mix_rule
        apply_rule(rule, ema_param_list, current_param_list, scalars=h, into=(0,))

    return ema_update


def get_swa_multi_avg_fn():
    """``multi_avg_fn(averaged_list, current_list, n_averaged)`` for an equal average:
    ``averaged = lerp(averaged, current, 1 / (n_averaged + 1))``, one ``flame.foreach`` call.
    A tensor ``n_averaged`` is read on the device (one tiny kernel makes the weights)."""
    uploads = StagedUploads()

    def swa_update(averaged_param_list, current_param_list, num_averaged) -> None:
        from flame.optim._common import apply_rule

        if not averaged_param_list:
            return
        first = averaged_param_list[0]
        h = _swa_scalars(num_averaged, first, uploads)
        rule = lerp_rule if _is_float(first) else mix_rule
        apply_rule(rule, averaged_param_list, current_param_list, scalars=h, into=(0,))

    return swa_update


def _swa_scalars(num_averaged, like: Tensor, uploads) -> Tensor:
    dtype = _scalar_dtype(like)
    if isinstance(num_averaged, Tensor):
        from flame.joining import stack

        weight = 1.0 / (num_averaged.to(dtype).reshape(()) + 1.0)
        if weight.backend != like.backend:
            weight = weight.to(like.device)
        return stack([weight, 1.0 - weight, 1.0 - weight, weight])
    weight = 1.0 / (float(num_averaged) + 1.0)
    values = [weight, 1.0 - weight, 1.0 - weight, weight]
    from flame.optim._common import tracing

    if dtype is dtypes.float32 and not tracing():  # a staged upload is not memory to keep
        from flame.optim._common import scalars

        return scalars(values, like, uploads)
    return _host_scalars(values, like)


def get_ema_avg_fn(decay=0.999):
    """``avg_fn(averaged, current, n_averaged) -> decay * averaged + (1 - decay) * current``."""
    _check_decay(decay)

    def ema_update(ema_param, current_param, num_averaged=None):
        return decay * ema_param + (1 - decay) * current_param

    return ema_update


def get_swa_avg_fn():
    """``avg_fn(averaged, current, n) -> averaged + (current - averaged) / (n + 1)``."""

    def swa_update(averaged_param, current_param, num_averaged):
        return averaged_param + (current_param - averaged_param) / (num_averaged + 1)

    return swa_update


# --- copying a module ------------------------------------------------------------------------


def _fresh(tensor: Tensor) -> Tensor:
    """A realized tensor with memory of its own holding ``tensor``'s values."""
    from flame.autograd import no_grad
    from flame.shaping import clone

    if tensor.ndim == 0 and tensor.backend == "reference":
        # the reference interpreter stores a computed 0-d value as a one-element 1-d array
        # (np.ascontiguousarray), which an in-place write (copy_, add_) then refuses; an
        # array made from a 0-d NumPy value keeps its shape
        from flame.backend import backend
        from flame.creation import tensor as make

        with backend("reference"):
            return make(np.array(tensor.numpy())).realize()
    with no_grad():
        return clone(tensor.detach()).realize()


def copy_module(module: Module) -> Module:
    """``copy.deepcopy(module)`` for FLAME modules: the same structure, hooks and attributes,
    and every parameter and buffer (and any other tensor a module holds) a new tensor with
    memory of its own and the same values. Parameters keep their ``requires_grad``;
    gradients are not copied."""
    memo: dict[int, object] = {}
    for submodule in module.modules():
        for param in submodule._parameters.values():
            if param is not None and id(param) not in memo:
                memo[id(param)] = Parameter(_fresh(param), requires_grad=param.requires_grad)
        for value in itertools.chain(submodule._buffers.values(), vars(submodule).values()):
            if isinstance(value, Tensor) and id(value) not in memo:
                memo[id(value)] = _fresh(value)
    return copy.deepcopy(module, memo)


# --- AveragedModel ---------------------------------------------------------------------------


class AveragedModel(Module):
    """``AveragedModel(model, device=None, avg_fn=None, multi_avg_fn=None, use_buffers=False)``:
    a copy of ``model`` whose parameters (and buffers, with ``use_buffers``) are running
    averages of ``model``'s, updated by ``update_parameters(model)``. Without an averaging
    function it is SWA's equal average."""

    def __init__(self, model, device=None, avg_fn=None, multi_avg_fn=None, use_buffers=False):
        super().__init__()
        if avg_fn is not None and multi_avg_fn is not None:
            raise AssertionError("Only one of avg_fn and multi_avg_fn should be provided")
        self.module = copy_module(model)
        if device is not None:
            self.module = self.module.to(device)
        self.register_buffer("n_averaged", self._new_count())
        self.avg_fn = avg_fn
        self.multi_avg_fn = multi_avg_fn
        self.use_buffers = use_buffers
        self._count = 0  # n_averaged, mirrored on the host (None: read the buffer)
        self._copy_values = None  # copy_rule's operand, made on the first update

    def _new_count(self) -> Tensor:
        from flame.backend import backend, get_backend
        from flame.creation import tensor

        first = next(itertools.chain(self.module.parameters(), self.module.buffers()), None)
        with backend(first.backend if first is not None else get_backend()):
            # from a 0-d array: a realized fl.zeros(()) is a one-element array on the
            # reference backend, which an in-place write into a 0-d view refuses
            return tensor(np.zeros((), dtype=np.int64)).realize()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _state_loaded(self) -> None:
        """Called by ``load_state_dict`` (this module's or a parent's) after it wrote
        ``n_averaged``: the host copy of the count is read again at the next update."""
        self._count = None

    def _pairs(self, model: Module, with_buffers: bool):
        if with_buffers:
            mine = [*self.module.parameters(), *self.module.buffers()]
            theirs = [*model.parameters(), *model.buffers()]
        else:
            mine, theirs = list(self.module.parameters()), list(model.parameters())
        if len(mine) != len(theirs):
            raise ValueError(
                f"AveragedModel.update_parameters: the model has {len(theirs)} tensors to "
                f"average, the averaged copy {len(mine)}"
            )
        for index, (averaged, current) in enumerate(zip(mine, theirs)):
            if tuple(averaged.shape) != tuple(current.shape):
                raise ValueError(
                    f"AveragedModel.update_parameters: tensor {index} has shape "
                    f"{list(current.shape)} in the model, {list(averaged.shape)} in the copy"
                )
        return mine, theirs

    def update_parameters(self, model: Module) -> None:
        """Copy ``model``'s values on the first call, average them in on every later one."""
        from flame.autograd import no_grad

        with no_grad():
            self._update(model)

    def _update(self, model: Module) -> None:
        from flame.optim._common import tracing

        if tracing():
            self._update_traced(model)
            return
        averaged, current = self._pairs(model, self.use_buffers)
        if self._count is None:
            self._count = int(self.n_averaged.item())
        groups = _groups(averaged, current)
        if self._count == 0:
            self._copy(groups)
        elif self.multi_avg_fn is not None or self.avg_fn is None:
            average = self.multi_avg_fn or get_swa_multi_avg_fn()
            for group_averaged, group_current in groups:
                average(group_averaged, group_current, self.n_averaged)
        else:
            self._average_one_by_one(averaged, current)
        if not self.use_buffers:  # buffers follow the model, as PyTorch's
            self._copy(_groups(*self._buffer_pairs(model)))
        self.n_averaged.add_(1)
        self._count += 1

    def _update_traced(self, model: Module) -> None:
        """Inside a ``flame.compile``d function: the update as in-place writes the program
        repeats at every call, so "copy on the first update, average after" is decided on
        the device, from ``n_averaged`` (the average is computed, then the model's value
        selected where the count is 0), and the host copy of the count is dropped."""
        from flame.functional import where

        averaged, current = self._pairs(model, self.use_buffers)
        first = self.n_averaged == 0
        groups = _groups(averaged, current)
        if self.multi_avg_fn is not None or self.avg_fn is None:
            average = self.multi_avg_fn or get_swa_multi_avg_fn()
            for group_averaged, group_current in groups:
                average(group_averaged, group_current, self.n_averaged)
        else:
            self._average_one_by_one(averaged, current)
        for group_averaged, group_current in groups:
            for mine, theirs in zip(group_averaged, group_current):
                mine.copy_(where(first, theirs, mine))
        if not self.use_buffers:
            for mine, theirs in zip(*self._buffer_pairs(model)):
                mine.copy_(_on(theirs, mine))
        self.n_averaged.add_(1)
        self._count = None  # the program counts: read the buffer at the next lazy update

    def _buffer_pairs(self, model: Module):
        mine, theirs = list(self.module.buffers()), list(model.buffers())
        if len(mine) != len(theirs):
            raise ValueError(
                f"AveragedModel.update_parameters: the model has {len(theirs)} buffers, the "
                f"averaged copy {len(mine)}"
            )
        return mine, theirs

    def _copy(self, groups) -> None:
        from flame.optim._common import apply_rule

        for group_averaged, group_current in groups:
            like = group_averaged[0]
            if self._copy_values is None or self._copy_values.backend != like.backend:
                self._copy_values = _host_scalars([1.0, 0.0, 0.0, 1.0], like, dtypes.float32)
            apply_rule(copy_rule, group_averaged, group_current, scalars=self._copy_values,
                       into=(0,))  # fmt: skip

    def _average_one_by_one(self, averaged, current) -> None:
        from flame.autograd import no_grad

        with no_grad():
            for mine, theirs in zip(averaged, current):
                theirs = _on(theirs, mine)
                mine.copy_(self.avg_fn(mine.detach(), theirs, self.n_averaged))


def _on(tensor: Tensor, like: Tensor) -> Tensor:
    """``tensor`` on ``like``'s backend, with its dtype (lazy: a no-op when they match)."""
    if tensor.backend != like.backend:
        tensor = tensor.to(like.device)
    if tensor.dtype is not like.dtype:
        tensor = tensor.to(like.dtype)
    return tensor


def _groups(averaged, current):
    """``[(averaged, current)]`` lists per (backend, dtype) of the averaged tensor, the model's
    tensors moved and cast to match (PyTorch's ``_group_tensors_by_device_and_dtype``)."""
    groups: dict[tuple, tuple[list, list]] = {}
    for mine, theirs in zip(averaged, current):
        lists = groups.setdefault((mine.backend, mine.dtype), ([], []))
        lists[0].append(mine)
        lists[1].append(_on(theirs, mine))  # not detached: foreach reads the memory itself
    return list(groups.values())


# --- update_bn -------------------------------------------------------------------------------


def _is_batch_norm(module) -> bool:
    return all(
        hasattr(module, name) for name in ("running_mean", "running_var", "momentum")
    ) and callable(getattr(module, "reset_running_stats", None))


def update_bn(loader, model: Module, device=None) -> None:
    """Recompute the running statistics of every batch-norm layer of ``model`` (a module with
    ``running_mean``, ``running_var``, ``momentum`` and ``reset_running_stats()``) with one
    pass over ``loader`` (a cumulative average: ``momentum=None``), as PyTorch's."""
    from flame.autograd import no_grad

    momenta = {}
    for module in model.modules():
        if _is_batch_norm(module):
            module.reset_running_stats()
            momenta[module] = module.momentum
    if not momenta:
        return
    was_training = model.training
    model.train()
    for module in momenta:
        module.momentum = None
    with no_grad():
        for batch in loader:
            if isinstance(batch, (list, tuple)):
                batch = batch[0]
            if device is not None:
                batch = batch.to(device)
            model(batch)
    for module, momentum in momenta.items():
        module.momentum = momentum
    model.train(was_training)
