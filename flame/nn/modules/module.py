"""``nn.Module``: PyTorch's module machinery, so model files port by changing imports.

Assigning a ``Parameter``, a ``Module`` or a registered buffer to an attribute registers it;
``parameters()``, ``state_dict()``, ``train()``/``eval()``, hooks and ``repr`` behave as
PyTorch's. A module is plain Python around FLAME tensors: calling it builds IR like any other
code, and under ``flame.compile`` all of this runs once, at trace time (parameters are read
through their memory at every call, so ``load_state_dict`` and optimizer steps need no
retrace).
The dtype and device conversions live in conversions.py, calling and hooks in calling.py (base
classes).
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple

from flame.nn.modules import loading
from flame.nn.modules.calling import Calling
from flame.nn.modules.calling import RemovableHandle as RemovableHandle  # re-exported
from flame.nn.modules.conversions import Conversions
from flame.nn.parameter import Buffer, Parameter, _own_node, alias
from flame.tensor import Tensor

_IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class Module(Calling, Conversions):
    """Base class of every layer and model (``torch.nn.Module``)."""

    dump_patches = False
    _version = 1
    training: bool
    call_super_init = False

    def __init__(self, *args, **kwargs):
        if args or kwargs:
            raise TypeError(
                f"{type(self).__name__}.__init__() got unexpected arguments (Module.__init__ "
                "takes none)"
            )
        setter = object.__setattr__
        setter(self, "training", True)
        setter(self, "_parameters", {})
        setter(self, "_buffers", {})
        setter(self, "_non_persistent_buffers_set", set())
        setter(self, "_modules", {})
        setter(self, "_forward_pre_hooks", OrderedDict())
        setter(self, "_forward_pre_hooks_with_kwargs", {})
        setter(self, "_forward_hooks", OrderedDict())
        setter(self, "_forward_hooks_with_kwargs", {})
        setter(self, "_backward_hooks", OrderedDict())

    forward = None  # subclasses define it

    # --- registration ---------------------------------------------------------------------
    def _check_ready(self, what: str) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError(
                f"cannot assign {what} before Module.__init__() call (call super().__init__() "
                f"first in {type(self).__name__}.__init__)"
            )

    @staticmethod
    def _check_name(kind: str, name) -> None:
        if not isinstance(name, str):
            raise TypeError(f"{kind} name should be a string, got {type(name).__name__}")
        if "." in name:
            raise KeyError(f'{kind} name can\'t contain ".", got {name!r}')
        if name == "":
            raise KeyError(f'{kind} name can\'t be empty string ""')

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        self._check_ready("parameters")
        self._check_name("parameter", name)
        if hasattr(self, name) and name not in self._parameters:
            raise KeyError(f"attribute '{name}' already exists")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(
                f"cannot assign '{type(param).__name__}' object to parameter '{name}' "
                "(flame.nn.Parameter or None required)"
            )
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        self._check_ready("buffers")
        self._check_name("buffer", name)
        if hasattr(self, name) and name not in self._buffers:
            raise KeyError(f"attribute '{name}' already exists")
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(
                f"cannot assign '{type(tensor).__name__}' object to buffer '{name}' "
                "(flame tensor or None required)"
            )
        if isinstance(tensor, Buffer):
            persistent = tensor.persistent
        if tensor is not None:  # a buffer has memory of its own, as a parameter does
            tensor = Tensor(_own_node(tensor), tensor.backend)
        self._buffers[name] = tensor
        if persistent:
            self._non_persistent_buffers_set.discard(name)
        else:
            self._non_persistent_buffers_set.add(name)

    def add_module(self, name: str, module: Module | None) -> None:
        if not isinstance(module, Module) and module is not None:
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._check_name("module", name)
        if hasattr(self, name) and name not in self._modules:
            raise KeyError(f"attribute '{name}' already exists")
        self._modules[name] = module

    register_module = add_module

    def __setattr__(self, name: str, value) -> None:
        params = self.__dict__.get("_parameters")
        if isinstance(value, Parameter):
            self._check_ready("parameters")
            _remove_from(self, name, "_buffers", "_modules")
            self._non_persistent_buffers_set.discard(name)
            self.__dict__.pop(name, None)
            self.register_parameter(name, value)
            return
        if params is not None and name in params:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as parameter '{name}' of "
                    f"{type(self).__name__} (flame.nn.Parameter or None expected)"
                )
            params[name] = None
            return
        modules = self.__dict__.get("_modules")
        if isinstance(value, Module):
            if modules is None:
                raise AttributeError("cannot assign module before Module.__init__() call")
            _remove_from(self, name, "_parameters", "_buffers")
            self._non_persistent_buffers_set.discard(name)
            self.__dict__.pop(name, None)
            modules[name] = value
            return
        if modules is not None and name in modules:
            if value is not None:
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as child module '{name}' of "
                    f"{type(self).__name__} (flame.nn.Module or None expected)"
                )
            modules[name] = None
            return
        buffers = self.__dict__.get("_buffers")
        if isinstance(value, Buffer):
            self._check_ready("buffers")
            _remove_from(self, name, "_parameters", "_modules")
            self.__dict__.pop(name, None)
            self.register_buffer(name, value)
            return
        if buffers is not None and name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(
                    f"cannot assign '{type(value).__name__}' as buffer '{name}' of "
                    f"{type(self).__name__} (flame tensor or None expected)"
                )
            buffers[name] = value
            return
        object.__setattr__(self, name, value)

    def __getattr__(self, name: str):
        # only called when normal lookup fails
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            entries = d.get(table)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for table in ("_parameters", "_buffers", "_modules"):
            entries = self.__dict__.get(table)
            if entries is not None and name in entries:
                del entries[name]
                self._non_persistent_buffers_set.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self):
        names = list(super().__dir__())
        names += list(self._parameters) + list(self._buffers) + list(self._modules)
        return sorted(set(n for n in names if not n[0].isdigit()))

    # --- walking --------------------------------------------------------------------------
    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate=True):
        # a stack, not recursion: nested generators cost a frame per level for every item,
        # and an EMA or an optimizer walks a model of hundreds of modules every step
        if memo is None:
            memo = set()
        stack = [(prefix, self)]
        while stack:
            prefix, module = stack.pop()
            if remove_duplicate:
                if id(module) in memo:
                    continue
                memo.add(id(module))
            yield prefix, module
            children = [
                (f"{prefix}.{name}" if prefix else name, child)
                for name, child in module._modules.items()
                if child is not None
            ]
            stack.extend(reversed(children))

    def modules(self):
        for _, module in self.named_modules():
            yield module

    def named_children(self):
        seen = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self):
        for _, module in self.named_children():
            yield module

    def _named_members(self, table: str, prefix: str, recurse: bool, remove_duplicate: bool):
        seen = set()
        modules = (
            self.named_modules(prefix=prefix, remove_duplicate=remove_duplicate)
            if recurse
            else [(prefix, self)]
        )
        for module_prefix, module in modules:
            for name, value in getattr(module, table).items():
                if value is None:
                    continue
                if remove_duplicate:
                    if id(value) in seen:
                        continue
                    seen.add(id(value))
                yield module_prefix + ("." if module_prefix else "") + name, value

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        yield from self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True):
        yield from self._members("_parameters", recurse)

    def _members(self, table: str, recurse: bool) -> list:
        """The values of ``table`` over the tree, each once (``parameters()`` without names)."""
        found, seen = [], set()
        for _, module in self.named_modules() if recurse else [("", self)]:
            for value in getattr(module, table).values():
                if value is not None and id(value) not in seen:
                    seen.add(id(value))
                    found.append(value)
        return found

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate=True):
        yield from self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True):
        yield from self._members("_buffers", recurse)

    def get_submodule(self, target: str) -> Module:
        module = self
        for item in target.split(".") if target else []:
            if item not in module._modules or module._modules[item] is None:
                raise AttributeError(f"{type(module).__name__} has no submodule `{item}`")
            module = module._modules[item]
        return module

    def get_parameter(self, target: str) -> Parameter:
        path, _, name = target.rpartition(".")
        module = self.get_submodule(path)
        if name not in module._parameters:
            raise AttributeError(f"{type(module).__name__} has no parameter `{name}`")
        return module._parameters[name]

    def get_buffer(self, target: str) -> Tensor:
        path, _, name = target.rpartition(".")
        module = self.get_submodule(path)
        if name not in module._buffers:
            raise AttributeError(f"{type(module).__name__} has no buffer `{name}`")
        return module._buffers[name]

    # --- modes and flags ------------------------------------------------------------------
    def train(self, mode: bool = True) -> Module:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        for module in self.children():
            module.train(mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> Module:
        for param in self.parameters():
            param.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        from flame.compile import note_grad_cleared
        from flame.creation import zeros_like

        for param in self.parameters():
            note_grad_cleared(param)  # flame.compile: a step that clears first reads none
            if param.grad is not None:
                param.grad = None if set_to_none else zeros_like(param.grad)

    def apply(self, fn) -> Module:
        for module in self.children():
            module.apply(fn)
        fn(self)
        return self

    # --- state_dict -----------------------------------------------------------------------
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for name, param in self._parameters.items():
            if param is not None:
                destination[prefix + name] = param if keep_vars else alias(param)
        for name, buffer in self._buffers.items():
            if buffer is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = buffer if keep_vars else alias(buffer)

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """An ordered ``{name: tensor}`` of parameters and persistent buffers, PyTorch's keys.
        The tensors share the module's memory (``keep_vars=False`` detaches them)."""
        if args:  # PyTorch's deprecated positional form: (destination, prefix, keep_vars)
            destination, prefix, keep_vars = (
                list(args) + [destination, prefix, keep_vars][len(args) :]
            )[:3]
        if destination is None:
            destination = OrderedDict()
        self._save_to_state_dict(destination, prefix, keep_vars)
        for name, module in self._modules.items():
            if module is not None:
                module.state_dict(destination=destination, prefix=prefix + name + ".",
                                  keep_vars=keep_vars)  # fmt: skip
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Copy ``state_dict``'s values into the module's parameters and buffers (their memory
        is written: compiled functions that read them see the new values).

        Everything is checked before anything is written: missing and unexpected keys (an
        error naming every one when ``strict``, reported in the result otherwise), wrong
        shapes, values that are not tensors or whose dtype FLAME lacks (always an error). On
        an error the module is unchanged. Values may be FLAME tensors or NumPy arrays; they
        are cast to the parameter's dtype and moved to its device, as ``copy_`` does."""
        plan = self._load_plan(state_dict, strict)
        self._apply_load(plan, assign)
        return _IncompatibleKeys(plan[1], plan[2])

    def _load_plan(self, state_dict, strict: bool):
        """``(writes, missing, unexpected)`` for ``load_state_dict``, or its error: nothing
        is written here (``flame.io.load_checkpoint`` checks every section first)."""
        return loading.plan(self, state_dict, strict)

    def _apply_load(self, plan, assign: bool) -> None:
        loading.apply(plan, assign)

    # --- printing -------------------------------------------------------------------------
    def extra_repr(self) -> str:
        return ""

    def _get_name(self) -> str:
        return type(self).__name__

    def __repr__(self) -> str:
        lines = []
        extra = self.extra_repr()
        if extra:
            lines = extra.split("\n")
        children = []
        for name, module in self._modules.items():
            text = _indent(repr(module), 2)
            children.append(f"({name}): {text}")
        body = lines + children
        head = self._get_name() + "("
        if not body:
            return head + ")"
        if len(lines) == 1 and not children:
            return head + lines[0] + ")"
        return head + "\n  " + "\n  ".join(body) + "\n)"

    def __getstate__(self):
        return self.__dict__.copy()

    def __setstate__(self, state):
        self.__dict__.update(state)


# --- helpers ---------------------------------------------------------------------------------


def _remove_from(module: Module, name: str, *tables: str) -> None:
    for table in tables:
        entries = module.__dict__.get(table)
        if entries is not None:
            entries.pop(name, None)


def _indent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    if len(lines) == 1:
        return text
    return lines[0] + "\n" + "\n".join(" " * spaces + line for line in lines[1:])
