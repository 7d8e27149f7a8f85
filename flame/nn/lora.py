"""LoRA adapters (Hu et al. 2021) for linear and 2-d convolution layers, PEFT's layout.

    model = inject_lora(model, target_modules=["q_proj", "v_proj"], rank=8, alpha=16)
    ...train: only the lora_A / lora_B parameters require grad...
    adapter = lora_state_dict(model)              # {"....q_proj.lora_A": ..., ...}
    load_lora_state_dict(model, other_adapter)    # writes A/B memory: no retrace

A wrapped layer computes ``base(x) + scale * B(A(dropout(x)))`` with ``scale = alpha / rank``:

* ``LoRALinear``: ``lora_A`` [rank, in_features] (kaiming-uniform, ``a=sqrt(5)``, as PEFT),
  ``lora_B`` [out_features, rank] (zeros: a new adapter leaves the model unchanged);
* ``LoRAConv2d``: ``lora_A`` [rank, in_channels, kH, kW], a convolution with the base's
  kernel, stride, padding and dilation; ``lora_B`` [out_channels, rank, 1, 1], a 1x1
  convolution (PEFT's layout; groups=1 only).

The base layer is frozen (``requires_grad=False``) and kept whole as the ``base`` child, so
the state_dict keys are ``<layer>.base.weight``, ``<layer>.base.bias``, ``<layer>.lora_A`` and
``<layer>.lora_B`` (PEFT's ``lora_A.default.weight`` names map one to one).

``merge()`` adds ``scale * B @ A`` into the base weight's memory (``unmerge()`` subtracts it;
the ``merged`` flag says which): an exported or inference model then pays nothing for the
adapter. The sum is computed in float32 (float64 for float64 weights) and rounded once.
Merging changes which ops ``forward`` runs, so a function compiled before it must be compiled
again; swapping adapters (``load_lora_state_dict``) writes memory only and never retraces.
The scale is a Python number baked into traces: adapters of one model share rank and alpha.
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict

from flame.ir import dtypes
from flame.nn.modules.module import Module
from flame.nn.parameter import Parameter, alias
from flame.tensor import Tensor

__all__ = [
    "LoRAConv2d", "LoRALinear", "inject_lora", "load_lora_state_dict", "lora_state_dict",
    "merge_and_unload",
]  # fmt: skip


def _parameter(shape, like: Tensor, fill: str) -> Parameter:
    """A trainable parameter of ``shape`` on ``like``'s backend and dtype, kaiming-uniform
    (``a=sqrt(5)``, PEFT's lora_A) or zeros (lora_B)."""
    from flame.backend import backend
    from flame.creation import zeros
    from flame.nn import init

    with backend(like.backend):
        param = Parameter(zeros(tuple(shape), dtype=like.dtype))
    if fill == "kaiming":
        init.kaiming_uniform_(param, a=math.sqrt(5))
    return param


class _LoRA(Module):
    """What both wrappers share: the frozen base, the scale, dropout, merging."""

    def __init__(self, base: Module, rank: int, alpha: float, dropout: float):
        super().__init__()
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise ValueError(f"{type(self).__name__}: rank must be a positive int, got {rank!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"{type(self).__name__}: dropout must be in [0, 1), got {dropout}")
        weight = getattr(base, "weight", None)
        if not isinstance(weight, Tensor):
            raise TypeError(f"{type(self).__name__}: the base layer has no weight tensor")
        base.requires_grad_(False)
        self.base = base
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.dropout = float(dropout)
        self.merged = False

    @property
    def weight(self) -> Tensor:
        return self.base.weight

    @property
    def bias(self) -> Tensor | None:
        return getattr(self.base, "bias", None)

    def _dropped(self, x: Tensor) -> Tensor:
        from flame.nn.functional import dropout

        return dropout(x, self.dropout, training=self.training)

    def delta_weight(self) -> Tensor:
        """``scale * B @ A`` in the base weight's shape, computed in float32 (float64 for a
        float64 weight) and left there: the caller rounds it once."""
        weight = self.base.weight
        wide = dtypes.float64 if weight.dtype is dtypes.float64 else dtypes.float32
        lora_a = self.lora_A.detach().to(wide).reshape(self.rank, -1)
        lora_b = self.lora_B.detach().to(wide).reshape(-1, self.rank)
        return (lora_b @ lora_a).reshape(weight.shape) * self.scaling

    def _write_delta(self, sign: float) -> None:
        from flame.autograd import no_grad

        weight = self.base.weight
        with no_grad():
            wide = self.delta_weight()
            weight.copy_((weight.to(wide.dtype) + wide * sign).to(weight.dtype))

    def merge(self) -> None:
        """Add ``scale * B @ A`` into the base weight (in place); ``forward`` then runs the
        base layer alone."""
        if self.merged:
            raise RuntimeError(f"{type(self).__name__}.merge: the adapter is already merged")
        self._write_delta(1.0)
        self.merged = True

    def unmerge(self) -> None:
        """Subtract the merged ``scale * B @ A`` again (the base weight as it was, within
        the rounding of the two writes)."""
        if not self.merged:
            raise RuntimeError(f"{type(self).__name__}.unmerge: the adapter is not merged")
        self._write_delta(-1.0)
        self.merged = False

    def forward(self, x: Tensor) -> Tensor:
        result = self.base(x)
        if self.merged:
            return result
        return result + self._adapter(self._dropped(x)) * self.scaling

    def extra_repr(self) -> str:
        return (
            f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling}, "
            f"dropout={self.dropout}, merged={self.merged}"
        )


class LoRALinear(_LoRA):
    """``LoRALinear(base, rank=8, alpha=8, dropout=0.0)`` around a linear layer (a module
    with ``weight`` [out_features, in_features] computing ``x @ weight.T + bias``)."""

    def __init__(self, base: Module, rank: int = 8, alpha: float = 8, dropout: float = 0.0):
        super().__init__(base, rank, alpha, dropout)
        weight = base.weight
        if weight.ndim != 2:
            raise TypeError(
                f"LoRALinear: the base weight must be 2-d [out, in], got {list(weight.shape)}"
            )
        out_features, in_features = weight.shape
        self.in_features, self.out_features = in_features, out_features
        self.lora_A = _parameter((rank, in_features), weight, "kaiming")
        self.lora_B = _parameter((out_features, rank), weight, "zeros")

    def _adapter(self, x: Tensor) -> Tensor:
        from flame.nn.convolution import linear

        return linear(linear(x, self.lora_A), self.lora_B)


class LoRAConv2d(_LoRA):
    """``LoRAConv2d(base, rank=8, alpha=8, dropout=0.0)`` around a 2-d convolution (a module
    with PyTorch's ``weight`` [out, in / groups, kH, kW], ``stride``, ``padding``,
    ``dilation``, ``groups`` and ``padding_mode``).

    The adapter is ``A``, a convolution like the base's (its stride, padding, padding mode,
    dilation and groups) to ``rank`` channels, then ``B``, a 1x1 convolution with the same
    groups: each group's update is ``B_g @ A_g``, so it merges into the grouped base weight.
    With groups, ``rank`` must be a multiple of them."""

    def __init__(self, base: Module, rank: int = 8, alpha: float = 8, dropout: float = 0.0):
        super().__init__(base, rank, alpha, dropout)
        weight = base.weight
        if weight.ndim != 4:
            raise TypeError(
                f"LoRAConv2d: the base weight must be 4-d [out, in, kH, kW], got "
                f"{list(weight.shape)}"
            )
        groups = getattr(base, "groups", 1)
        if rank % groups:
            raise ValueError(
                f"LoRAConv2d: rank must be a multiple of the base convolution's groups, got "
                f"rank={rank} and groups={groups}"
            )
        out_channels, group_channels, *kernel = weight.shape
        self.in_channels, self.out_channels = group_channels * groups, out_channels
        self.groups = groups
        self.stride = getattr(base, "stride", 1)
        self.padding = getattr(base, "padding", 0)
        self.dilation = getattr(base, "dilation", 1)
        self.padding_mode = getattr(base, "padding_mode", "zeros")
        self._pad_widths = None
        if self.padding_mode != "zeros":  # the input padded as the base pads it
            from flame.nn.modules.conv import _pad_widths, _pair

            self._pad_widths = getattr(base, "_reversed_padding_repeated_twice", None)
            if self._pad_widths is None:
                padding = self.padding if isinstance(self.padding, str) else _pair(self.padding)
                self._pad_widths = _pad_widths(padding, tuple(kernel), _pair(self.dilation))
        self.lora_A = _parameter((rank, group_channels, *kernel), weight, "kaiming")
        self.lora_B = _parameter((out_channels, rank // groups, 1, 1), weight, "zeros")

    def _adapter(self, x: Tensor) -> Tensor:
        from flame.nn.convolution import conv2d
        from flame.nn.functional import pad

        padding = self.padding
        if self._pad_widths is not None:
            x = pad(x, self._pad_widths, mode=self.padding_mode)
            padding = 0
        down = conv2d(x, self.lora_A, None, self.stride, padding, self.dilation, self.groups)
        return conv2d(down, self.lora_B, None, 1, 0, 1, self.groups)

    def delta_weight(self) -> Tensor:
        """``scale * B_g @ A_g`` of each group, stacked in the base weight's shape."""
        if self.groups == 1:
            return super().delta_weight()
        weight, groups = self.base.weight, self.groups
        wide = dtypes.float64 if weight.dtype is dtypes.float64 else dtypes.float32
        lora_a = self.lora_A.detach().to(wide).reshape(groups, self.rank // groups, -1)
        lora_b = self.lora_B.detach().to(wide).reshape(groups, -1, self.rank // groups)
        return (lora_b @ lora_a).reshape(weight.shape) * self.scaling


# --- whole models -----------------------------------------------------------------------------


def _matcher(target_modules):
    """``target_modules`` as a predicate of (name, module): a string is a regular expression
    matched against the whole name (PEFT's rule); a list names modules by their last parts
    (``"q_proj"`` matches ``"layers.0.attn.q_proj"``); a callable is the predicate."""
    if callable(target_modules):
        return target_modules
    if isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        return lambda name, module: pattern.fullmatch(name) is not None
    targets = tuple(target_modules)

    def matches(name: str, module) -> bool:
        return any(name == target or name.endswith("." + target) for target in targets)

    return matches


def _wrapper_for(name: str, module: Module):
    weight = getattr(module, "weight", None)
    if isinstance(weight, Tensor) and weight.ndim == 2:
        return LoRALinear
    if isinstance(weight, Tensor) and weight.ndim == 4:
        return LoRAConv2d
    raise TypeError(
        f"inject_lora: target {name!r} ({type(module).__name__}) is neither a linear layer "
        "(2-d weight) nor a 2-d convolution (4-d weight)"
    )


def inject_lora(model: Module, target_modules, rank: int = 8, alpha: float = 8,
                dropout: float = 0.0) -> Module:  # fmt: skip
    """Freeze every parameter of ``model`` and replace each target layer with its LoRA
    wrapper (in place; returns ``model``). Only the adapters' ``lora_A``/``lora_B`` are
    trainable afterwards, as PEFT's ``get_peft_model`` with ``bias="none"``."""
    matches = _matcher(target_modules)
    wrapped = tuple(name + "." for name in _adapters(model))  # their layers stay as they are
    found = [
        (name, module) for name, module in model.named_modules()
        if name and not isinstance(module, _LoRA) and not name.startswith(wrapped)
        and matches(name, module)
    ]  # fmt: skip
    if not found:
        raise ValueError(f"inject_lora: no module of the model matches {target_modules!r}")
    # every wrapper is built (their checks run) before the model changes: a layer it
    # refuses leaves the model as it was
    flags = [(param, param.requires_grad) for param in model.parameters()]
    try:
        made = [(name, _wrapper_for(name, module)(module, rank, alpha, dropout))
                for name, module in found]  # fmt: skip
    except Exception:
        for param, flag in flags:  # a wrapper built before the refusal froze its base
            param.requires_grad_(flag)
        raise
    model.requires_grad_(False)
    for _, adapter in made:  # the adapters' own parameters train
        for param in (adapter.lora_A, adapter.lora_B):
            param.requires_grad_(True)
    for name, adapter in made:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, adapter)
    return model


def _adapters(model: Module) -> dict[str, _LoRA]:
    return {name: module for name, module in model.named_modules() if isinstance(module, _LoRA)}


def lora_state_dict(model: Module) -> OrderedDict:
    """The adapters' weights, ``{"<layer>.lora_A": tensor, "<layer>.lora_B": tensor}`` (the
    keys of ``model.state_dict()``; detached tensors sharing the parameters' memory)."""
    state = OrderedDict()
    for name, layer in _adapters(model).items():
        prefix = name + "." if name else ""
        state[prefix + "lora_A"] = alias(layer.lora_A)
        state[prefix + "lora_B"] = alias(layer.lora_B)
    return state


def load_lora_state_dict(model: Module, state_dict, strict: bool = True):
    """Write an adapter (``lora_state_dict``'s keys; tensors or arrays) into the adapters'
    memory: compiled functions that read them see the new adapter without a retrace. A
    merged layer is unmerged, written and merged again. Everything is checked before
    anything is written; returns ``(missing_keys, unexpected_keys)``."""
    from flame.autograd import no_grad
    from flame.nn.modules.loading import _as_tensor
    from flame.nn.modules.module import _IncompatibleKeys

    targets = {}
    for name, layer in _adapters(model).items():
        prefix = name + "." if name else ""
        targets[prefix + "lora_A"] = (layer, layer.lora_A)
        targets[prefix + "lora_B"] = (layer, layer.lora_B)
    missing = [key for key in targets if key not in state_dict]
    unexpected = [key for key in state_dict if key not in targets]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_lora_state_dict: missing keys {missing}, unexpected keys {unexpected}"
        )
    writes = []
    for key, (layer, param) in targets.items():
        if key in state_dict:
            value = state_dict[key]
            if tuple(value.shape) != tuple(param.shape):
                raise RuntimeError(
                    f"load_lora_state_dict: {key} has shape {list(value.shape)}, the adapter "
                    f"{list(param.shape)} (adapters must share the rank)"
                )
            try:  # converted now: a value that cannot be leaves every adapter as it was
                value = _as_tensor(value, param)
            except (TypeError, ValueError) as error:
                raise RuntimeError(f"load_lora_state_dict: {key}: {error}") from error
            writes.append((layer, param, value))
    remerge = {id(layer): layer for layer, _, _ in writes if layer.merged}
    for layer in remerge.values():
        layer.unmerge()
    with no_grad():
        for _, param, value in writes:
            param.copy_(value)
    for layer in remerge.values():
        layer.merge()
    return _IncompatibleKeys(missing, unexpected)


def merge_and_unload(model: Module) -> Module:
    """Merge every adapter into its base layer and put the base layer back in its place
    (in place; returns ``model``, or the base layer when ``model`` itself is a wrapper)."""
    if isinstance(model, _LoRA):
        if not model.merged:
            model.merge()
        return model.base
    for name, layer in _adapters(model).items():
        if not layer.merged:
            layer.merge()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, layer.base)
    return model
