"""``Module.__call__`` and the hooks it runs (``register_forward_pre_hook``,
``register_forward_hook``, ``register_full_backward_hook``), as a base class of ``Module``, and
``RemovableHandle``, what registering a hook returns. ``Module.__init__`` makes the hook
tables; the backward hooks' IR is built in hooks.py."""

from __future__ import annotations

import itertools
from collections import OrderedDict


class RemovableHandle:
    """What ``register_*_hook`` returns: ``handle.remove()`` takes the hook out."""

    _ids = itertools.count()

    def __init__(self, hooks: dict, *extra: dict):
        self.hooks = hooks
        self.extra = extra
        self.id = next(RemovableHandle._ids)

    def remove(self) -> None:
        for table in (self.hooks, *self.extra):
            table.pop(self.id, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class Calling:
    """Calling a module: its forward pre-hooks, ``forward``, its forward hooks, and the
    bundles its full backward hooks fire from."""

    def register_forward_pre_hook(self, hook, *, prepend=False, with_kwargs=False):
        """``hook(module, args) -> None | new args`` (``with_kwargs``: ``hook(module, args,
        kwargs) -> None | (args, kwargs)``), before every ``forward``."""
        handle = RemovableHandle(self._forward_pre_hooks, self._forward_pre_hooks_with_kwargs)
        _insert(self._forward_pre_hooks, handle.id, hook, prepend)
        if with_kwargs:
            self._forward_pre_hooks_with_kwargs[handle.id] = True
        return handle

    def register_forward_hook(self, hook, *, prepend=False, with_kwargs=False, always_call=False):
        """``hook(module, args, output) -> None | new output`` after every ``forward``."""
        handle = RemovableHandle(self._forward_hooks, self._forward_hooks_with_kwargs)
        _insert(self._forward_hooks, handle.id, hook, prepend)
        if with_kwargs:
            self._forward_hooks_with_kwargs[handle.id] = True
        return handle

    def register_full_backward_hook(self, hook, prepend: bool = False):
        """``hook(module, grad_input, grad_output) -> None | new grad_input``, when the
        gradients of the module's tensor inputs are computed. It runs while the backward
        graph is built, so what it returns is IR of that graph (it fuses, and under
        ``flame.compile`` it is traced once): as tensor hooks (``register_hook``)."""
        handle = RemovableHandle(self._backward_hooks)
        _insert(self._backward_hooks, handle.id, hook, prepend)
        return handle

    def register_backward_hook(self, hook):
        raise NotImplementedError(
            "register_backward_hook is deprecated in PyTorch; use register_full_backward_hook"
        )

    def __call__(self, *args, **kwargs):
        for key, hook in list(self._forward_pre_hooks.items()):
            if key in self._forward_pre_hooks_with_kwargs:
                result = hook(self, args, kwargs)
                if result is not None:
                    if not (isinstance(result, tuple) and len(result) == 2):
                        raise RuntimeError(
                            "forward pre-hook must return None or a tuple of (new_args, "
                            f"new_kwargs), but got {result}."
                        )
                    args, kwargs = result
            else:
                result = hook(self, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        if self._backward_hooks:
            from flame.nn.modules.hooks import BackwardHook

            backward = BackwardHook(self, list(self._backward_hooks.values()))
            args = backward.setup_inputs(args)
        if self.forward is None:
            raise NotImplementedError(
                f'Module [{type(self).__name__}] is missing the required "forward" function'
            )
        output = self.forward(*args, **kwargs)
        for key, hook in list(self._forward_hooks.items()):
            if key in self._forward_hooks_with_kwargs:
                result = hook(self, args, kwargs, output)
            else:
                result = hook(self, args, output)
            if result is not None:
                output = result
        if self._backward_hooks:
            output = backward.setup_outputs(output)
        return output


def _insert(hooks: OrderedDict, key: int, hook, prepend: bool) -> None:
    hooks[key] = hook
    if prepend:
        hooks.move_to_end(key, last=False)
