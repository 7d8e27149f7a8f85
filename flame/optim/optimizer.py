"""The optimizer base: parameter groups, per-parameter state, ``state_dict``, ``zero_grad``.

Parameters are updated in place: their memory keeps its address, so a compiled function
that closes over them (``flame.compile``) reads the new values without retracing, and the
state (momentum, moments) lives in buffers the optimizer owns.
"""

from __future__ import annotations

import abc
import copy

import numpy as np

from flame.runtime.staging import StagedUploads
from flame.tensor import Tensor


class ParamState:
    """``optimizer.state[param]`` -> that parameter's state dict (keyed by identity)."""

    def __init__(self):
        self._states: dict[int, tuple[Tensor, dict]] = {}

    def __getitem__(self, param: Tensor) -> dict:
        return self._states[id(param)][1]

    def get(self, param: Tensor, default=None):
        entry = self._states.get(id(param))
        return entry[1] if entry is not None else default

    def setdefault(self, param: Tensor) -> dict:
        entry = self._states.get(id(param))
        if entry is None:
            entry = self._states[id(param)] = (param, {})
        return entry[1]

    def __contains__(self, param) -> bool:
        return id(param) in self._states

    def __len__(self) -> int:
        return len(self._states)

    def clear(self) -> None:
        self._states.clear()


class Optimizer(abc.ABC):
    # flame.amp.GradScaler's found-inf flag while it runs ``step``: a 0-d float32 device
    # tensor, 1.0 when the step must change nothing. Optimizers that honour it on the device
    # (``_skips_on_device``: their rules keep the old values where it is set, through
    # ``_common.guarded``) never wait for it; for the others the scaler reads it first.
    _skip_if = None
    _skips_on_device = False

    def __init__(self, params, defaults: dict):
        self.defaults = dict(defaults)
        self.param_groups: list[dict] = []
        self.state = ParamState()
        self._uploads = StagedUploads()  # the per-step values' way to the GPU
        params = list(params)
        if not params:
            raise ValueError(f"{type(self).__name__}: got an empty parameter list")
        if not isinstance(params[0], dict):
            params = [{"params": params}]
        for group in params:
            self.add_param_group(group)

    def add_param_group(self, group: dict) -> None:
        group = dict(group)
        params = group["params"]
        group["params"] = [params] if isinstance(params, Tensor) else list(params)
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        for param in group["params"]:
            if not isinstance(param, Tensor):
                raise TypeError(
                    f"{type(self).__name__}: parameters must be flame tensors, got "
                    f"{type(param).__name__}"
                )
            if not param.dtype.is_float:
                raise TypeError(
                    f"{type(self).__name__}: cannot optimize a {param.dtype.name} tensor"
                )
            if id(param) in seen:
                raise ValueError(f"{type(self).__name__}: a parameter appears in two groups")
            seen.add(id(param))
        for name, default in self.defaults.items():
            group.setdefault(name, default)
        self._check_group(group)
        self.param_groups.append(group)

    def _check_group(self, group: dict) -> None:
        if group["lr"] < 0:
            raise ValueError(f"{type(self).__name__}: invalid learning rate {group['lr']}")

    def zero_grad(self, set_to_none: bool = True) -> None:
        from flame.creation import zeros_like

        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad = None if set_to_none else zeros_like(param)

    def step(self, closure=None):
        loss = None
        if closure is not None:
            from flame.autograd import enable_grad

            with enable_grad():
                loss = closure()
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if with_grad:
                self._update(group, with_grad)
        return loss

    @abc.abstractmethod
    def _update(self, group: dict, params: list[Tensor]) -> None:
        """One step for ``params`` (those of ``group`` that have a gradient)."""

    # --- state_dict ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """PyTorch's layout: ``{"state": {index: {...}}, "param_groups": [{..., "params":
        [index, ...]}]}``; state tensors are the optimizer's own (not copies)."""
        index_of, groups, position = {}, [], 0
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = list(range(position, position + len(group["params"])))
            for param in group["params"]:
                index_of[id(param)] = position
                position += 1
            groups.append(packed)
        state = {
            index_of[key]: dict(value) for key, (_, value) in self.state._states.items()
            if key in index_of
        }  # fmt: skip
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy hyperparameters and state in (state values: flame tensors, NumPy arrays or
        numbers); the optimizer keeps its own copies."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError(
                f"load_state_dict: {len(groups)} parameter groups given, the optimizer has "
                f"{len(self.param_groups)}"
            )
        params = []
        for saved, group in zip(groups, self.param_groups):
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"load_state_dict: a group of {len(saved['params'])} parameters given for "
                    f"one of {len(group['params'])}"
                )
            params += list(zip(saved["params"], group["params"]))
        loaded = {}
        for index, param in params:
            entry = state_dict["state"].get(index)
            if entry is not None:
                loaded[id(param)] = (param, {k: _own(v, param) for k, v in entry.items()})
        for saved, group in zip(groups, self.param_groups):
            for key, value in saved.items():
                if key != "params":
                    group[key] = copy.deepcopy(value)
        self.state._states = loaded


def _own(value, param: Tensor):
    """A private, realized copy of a state value, on the parameter's backend."""
    from flame.creation import tensor as make_tensor

    if isinstance(value, Tensor):
        array = value.numpy()
    elif isinstance(value, np.ndarray):
        array = value
    elif hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        array = value.detach().cpu().float().numpy()
        if array.shape == ():
            return float(array)
    else:
        return copy.deepcopy(value)
    if array.shape != tuple(param.shape):
        return float(array) if array.size == 1 else array
    from flame.backend import backend

    with backend(param.backend):
        return make_tensor(np.ascontiguousarray(array), dtype=param.dtype).realize()
