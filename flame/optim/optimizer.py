"""The optimizer base: parameter groups, per-parameter state, ``state_dict``, ``zero_grad``.

Parameters are updated in place: their memory keeps its address, so a compiled function
that closes over them (``flame.compile``) reads the new values without retracing, and the
state (momentum, moments) lives in buffers the optimizer owns.
"""

from __future__ import annotations

import abc
import copy
import weakref

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


class ParamGroup(dict):
    """One of ``optimizer.param_groups``: the dict PyTorch's optimizers hold, which also tells
    its optimizer when a value is set (``group["lr"] = ...``, by a schedule or by hand), so
    that the device copy of the group's values that compiled steps read follows at once
    (``Optimizer._hyper``). Copies and pickles of it are plain dicts."""

    def __init__(self, values: dict, owner: Optimizer):
        super().__init__(values)
        self._owner = weakref.ref(owner)

    def __setitem__(self, key, value) -> None:
        owner = self._owner()
        if key == "lr" and owner is not None:
            owner._check_rate(self, value)
        super().__setitem__(key, value)
        if key != "params":
            self._changed()

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def _changed(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner._group_changed(self)

    def __reduce_ex__(self, protocol):
        return (dict, (dict(self),))


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
        # id(group) -> (its values on the device, the host values they hold, whether its
        # rate is a tensor): see ``_hyper``
        self._mirrors: dict[int, tuple[Tensor, tuple, bool]] = {}
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
        self.param_groups.append(ParamGroup(group, self))

    def _check_group(self, group: dict) -> None:
        lr = group["lr"]
        if isinstance(lr, Tensor):  # read on the device at every step (PyTorch allows it)
            if lr.numel() != 1 or not lr.dtype.is_float:
                raise ValueError(
                    f"{type(self).__name__}: a learning rate tensor must have one floating "
                    f"element, got shape {list(lr.shape)} of {lr.dtype.name}"
                )
            lr.realize()  # memory of its own: a schedule writes it, compiled steps read it
            from flame.optim._common import tracing

            lr = 0.0 if tracing() else float(lr.item())
        if lr < 0:
            raise ValueError(f"{type(self).__name__}: invalid learning rate {lr}")

    # --- the group's values on the device (what compiled steps read) --------------------------
    def _hyper_values(self, group: dict) -> list[float]:
        """The values of ``group`` a step reads, computed on the host (a tensor learning rate
        counts as 0 here: it is read on the device)."""
        raise NotImplementedError

    def _hyper(self, group: dict, like: Tensor) -> Tensor:
        """``_hyper_values(group)`` as a float32 tensor of its own memory on ``like``'s
        backend, made once and written again whenever a value of the group is set: a
        compiled step reads the rate a schedule set after it was traced, with no retrace."""
        entry = self._mirrors.get(id(group))
        if entry is None or entry[0].backend != like.backend:
            from flame.backend import backend
            from flame.creation import tensor

            values = tuple(self._hyper_values(group))
            with backend(like.backend):
                mirror = tensor(np.asarray(values, dtype=np.float32)).realize()
            is_tensor = isinstance(group["lr"], Tensor)
            entry = self._mirrors[id(group)] = (mirror, values, is_tensor)
        return entry[0]

    def _check_rate(self, group: dict, rate) -> None:
        """Refuses a rate that changes between a number and a tensor once the group has been
        stepped on the device: those steps (compiled ones included) read it where it was."""
        entry = self._mirrors.get(id(group))
        if entry is not None and isinstance(rate, Tensor) != entry[2]:
            was, now = ("tensor", "number") if entry[2] else ("number", "tensor")
            raise TypeError(
                f"{type(self).__name__}: the learning rate of a group already stepped on the "
                f"device changed from a {was} to a {now}; write the new rate into the tensor "
                "(as a schedule does), or set a number, as before"
            )

    def _group_changed(self, group: dict) -> None:
        entry = self._mirrors.get(id(group))
        if entry is None:
            return
        values = tuple(self._hyper_values(group))
        if values != entry[1]:
            from flame.optim._common import write_values

            write_values(entry[0], values, self._uploads)
            self._mirrors[id(group)] = (entry[0], values, entry[2])

    def zero_grad(self, set_to_none: bool = True) -> None:
        from flame.compile import note_grad_cleared
        from flame.creation import zeros_like

        for group in self.param_groups:
            for param in group["params"]:
                note_grad_cleared(param)  # flame.compile: a step that clears first reads none
                if param.grad is not None:
                    param.grad = None if set_to_none else zeros_like(param)

    def step(self, closure=None):
        """One update of every parameter with a gradient. Inside a ``flame.compile``d function
        the update is traced as in-place writes into the parameters and the state, repeated
        at every call; the step counts and the group's values are read from device memory
        there (``_hyper``), so a schedule changes the rate without a retrace."""
        from flame.autograd import enable_grad, no_grad

        loss = None
        if closure is not None:
            with enable_grad():
                loss = closure()
        with no_grad():
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
        [index, ...]}]}``. State tensors are the optimizer's own (not copies), except a step
        count kept on the device: the parameters stepped together share one count, and each
        gets a copy of it here, as each has its own ``step`` in PyTorch (a checkpoint file
        refuses tensors that share memory)."""
        index_of, groups, position = {}, [], 0
        for group in self.param_groups:
            packed = {key: value for key, value in group.items() if key != "params"}
            packed["params"] = list(range(position, position + len(group["params"])))
            for param in group["params"]:
                index_of[id(param)] = position
                position += 1
            groups.append(packed)
        state, counts = {}, []
        for key, (_, value) in self.state._states.items():
            if key not in index_of:
                continue
            entry = state[index_of[key]] = dict(value)
            if isinstance(entry.get("step"), Tensor):
                from flame.shaping import clone

                entry["step"] = clone(entry["step"])
                counts.append(entry["step"])
        if counts:
            from flame.tensor import realize

            realize(*counts)
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Copy hyperparameters and state in (state values: flame tensors, NumPy arrays or
        numbers). Values are written into the state tensors the optimizer already has where
        their shapes match (and into a tensor learning rate), so a compiled step built before
        the load goes on with the loaded state; other values become tensors of its own."""
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
        loaded, writes, written = {}, [], {}
        for index, param in params:
            entry = state_dict["state"].get(index)
            if entry is None:
                continue
            current = self.state.get(param) or {}
            values = {}
            for key, value in entry.items():
                target = _writable_target(current.get(key), value)
                if target is None:
                    values[key] = _own(value, param)
                    continue
                host = target[1]
                before = written.get(id(target[0]))
                if before is None:  # the first value for this tensor: written into it
                    written[id(target[0])] = host
                    writes.append(target)
                    values[key] = target[0]
                elif np.array_equal(before, host):  # a count shared, with the same value
                    values[key] = target[0]
                else:  # shared until now, loaded with another value: a tensor of its own
                    values[key] = _own_tensor(host, target[0])
            loaded[id(param)] = (param, values)
        for tensor, host in writes:
            _write_into(tensor, host)
        for saved, group in zip(groups, self.param_groups):
            for key, value in saved.items():
                if key == "params":
                    continue
                if isinstance(group.get(key), Tensor) and _host_array(value) is not None:
                    _write_into(group[key], _host_array(value).reshape(group[key].shape))
                elif isinstance(value, Tensor):  # a tensor rate saved, a number here
                    number = value.numel() == 1
                    group[key] = (
                        float(value.item()) if number else _own_tensor(value.numpy(), value)
                    )
                else:
                    group[key] = copy.deepcopy(value)
        self.state._states = loaded


def _host_array(value) -> np.ndarray | None:
    """A state value's numbers as a NumPy array (None for what is not a number or array)."""
    if isinstance(value, Tensor):
        return value.numpy()
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch tensor
        return value.detach().cpu().float().numpy()
    if isinstance(value, (int, float, np.number)) and not isinstance(value, bool):
        return np.asarray(float(value))
    return None


def _writable_target(existing, value):
    """``(existing, value's numbers)`` when ``value`` can be written into the state tensor
    ``existing`` (same number of elements, shapes equal up to a 0-d kept as one element);
    else None."""
    if not isinstance(existing, Tensor) or not existing.is_realized:
        return None
    host = _host_array(value)
    if host is None or host.size != existing.numel():
        return None
    if host.ndim and tuple(host.shape) != tuple(existing.shape):
        return None
    return existing, host.reshape(existing.shape)


def _write_into(tensor: Tensor, host: np.ndarray) -> None:
    """``host`` written into ``tensor``'s memory (cast to its dtype), in place."""
    from flame.autograd import no_grad

    source = _own_tensor(host, tensor)
    with no_grad():
        tensor.copy_(source)


def _own_tensor(host: np.ndarray, like: Tensor) -> Tensor:
    """A realized tensor of its own memory holding ``host``, with ``like``'s backend, dtype
    and shape."""
    from flame.backend import backend
    from flame.creation import tensor as make_tensor

    array = np.array(np.asarray(host).reshape(like.shape), order="C")  # keeps 0-d (not [1])
    with backend(like.backend):
        return make_tensor(array, dtype=like.dtype).realize()


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
