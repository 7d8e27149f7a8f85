"""``Module.register_full_backward_hook``, built from tensor hooks (IR, like the rest).

The module's tensor inputs go in through one fresh node (the inputs flattened and joined, or
a copy when there is one) and its outputs come out through another; a tensor hook on each
fires once its gradient is complete. The output side records ``grad_output``; the input side
splits its gradient into ``grad_input``, calls the module's hooks and joins what they return
back into the gradient that flows on. Both bundles exist only in graphs built with gradients
enabled, for modules that have backward hooks.
"""

from __future__ import annotations

from flame.tensor import Tensor, grad_enabled


def _bundle(tensors: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
    """One fresh node holding ``tensors``, and each tensor read back out of it. Tensors of
    different dtypes are joined in their promoted dtype (bfloat16 and float16 in float32):
    each is read back in its own dtype, exactly, and its gradient passes through the wider
    one unchanged."""
    from flame.joining import cat

    if len(tensors) == 1:
        joined = tensors[0] * 1
        return joined, [joined]
    wide = _joined_dtype(tensors)
    joined = cat([t.to(wide).reshape(-1) for t in tensors])
    return joined, _split(joined, tensors)


def _joined_dtype(tensors: list[Tensor]):
    from flame.ir.dtypes import promote

    wide = tensors[0].dtype
    for t in tensors[1:]:
        wide = promote(wide, t.dtype)
    return wide


def _split(g: Tensor, like: list[Tensor]) -> list[Tensor]:
    """``g`` (a bundle or its gradient) cut into ``like``'s shapes and dtypes."""
    if len(like) == 1:
        return [g]
    parts, start = [], 0
    for t in like:
        parts.append(g[start : start + t.numel()].reshape(t.shape).to(t.dtype))
        start += t.numel()
    return parts


class BackwardHook:
    def __init__(self, module, hooks: list):
        self.module = module
        self.hooks = hooks
        self.grad_output: tuple | None = None
        self.inputs: list[Tensor] = []
        self.positions: list[int] = []
        self.arg_count = 0
        self.active = grad_enabled.get()

    def setup_inputs(self, args: tuple) -> tuple:
        if not self.active:
            return args
        tensor_positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
        self.arg_count = len(tensor_positions)
        self.tensor_positions = tensor_positions
        self.positions = [i for i in tensor_positions if args[i].requires_grad]
        if not self.positions:
            return args
        self.inputs = [args[i] for i in self.positions]
        joined, parts = _bundle(self.inputs)
        joined.register_hook(self._on_input_grad)
        args = list(args)
        for i, part in zip(self.positions, parts):
            args[i] = part
        return tuple(args)

    def setup_outputs(self, output):
        if not self.active:
            return output
        single = isinstance(output, Tensor)
        outputs = [output] if single else list(output) if isinstance(output, tuple) else None
        if outputs is None:
            return output
        chosen = [i for i, o in enumerate(outputs) if isinstance(o, Tensor) and o.requires_grad]
        if not chosen:
            return output
        self.outputs = [outputs[i] for i in chosen]
        self.output_positions = chosen
        self.output_count = len(outputs)
        joined, parts = _bundle(self.outputs)
        joined.register_hook(self._on_output_grad)
        for i, part in zip(chosen, parts):
            outputs[i] = part
        return outputs[0] if single else tuple(outputs)

    def _on_output_grad(self, g: Tensor):
        grads = [None] * self.output_count
        for i, part in zip(self.output_positions, _split(g, self.outputs)):
            grads[i] = part
        self.grad_output = tuple(grads)
        if not self.positions:  # no input needs a gradient: the hooks see None for each
            self._call_hooks(tuple([None] * self.arg_count))
        return None

    def _on_input_grad(self, g: Tensor):
        grad_input = [None] * self.arg_count
        slot = {position: k for k, position in enumerate(self.tensor_positions)}
        for position, part in zip(self.positions, _split(g, self.inputs)):
            grad_input[slot[position]] = part
        result = self._call_hooks(tuple(grad_input))
        if result is None:
            return None
        new = [result[slot[position]] for position in self.positions]
        for position, value, old in zip(self.positions, new, _split(g, self.inputs)):
            if not isinstance(value, Tensor) or value.shape != old.shape:
                raise RuntimeError(
                    f"backward hook of {type(self.module).__name__} returned a gradient for "
                    f"input {position} of shape "
                    f"{list(value.shape) if isinstance(value, Tensor) else type(value).__name__}"
                    f"; the input has shape {list(old.shape)}"
                )
        if len(new) == 1:
            return new[0].to(g.dtype)
        from flame.joining import cat

        return cat([value.to(g.dtype).reshape(-1) for value in new])

    def _call_hooks(self, grad_input: tuple):
        grad_output = self.grad_output
        if grad_output is None:  # the outputs took no part in the loss
            grad_output = tuple([None] * getattr(self, "output_count", 1))
        changed = None
        for hook in self.hooks:
            result = hook(self.module, grad_input, grad_output)
            if result is None:
                continue
            result = tuple(result) if isinstance(result, (tuple, list)) else (result,)
            if len(result) != len(grad_input):
                raise RuntimeError(
                    f"backward hook returned {len(result)} gradients; the module has "
                    f"{len(grad_input)} tensor inputs"
                )
            grad_input = changed = result
        return changed
