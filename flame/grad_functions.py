"""The functions backward rules are written with.

Every ``registry.def_vjp`` rule is called as ``rule(F, g, out, *inputs, **attrs)``; ``F`` is
this namespace: differentiable FLAME ops (``where``, ``exp``, ``reshape``, ``matmul``, ...)
plus the two helpers rules share, ``sum_to`` (undo broadcasting, in this one place) and
``unslice_axis`` (a slice's cotangent padded back to the full axis). flame/autograd.py's
sweep hands it to the rules; ``flame.autograd.functions`` is the same function.
"""

from __future__ import annotations

from types import SimpleNamespace

from flame.tensor import Tensor


def _functions() -> SimpleNamespace:
    import flame as fl
    from flame import views

    def sum_to(g: Tensor, shape) -> Tensor:
        """Undo broadcasting: sum ``g`` over the axes that were broadcast to reach it."""
        shape = tuple(shape)
        if g.shape == shape:
            return g
        lead = g.ndim - len(shape)
        axes = tuple(range(lead)) + tuple(
            lead + axis
            for axis, size in enumerate(shape)
            if size == 1 and g.shape[lead + axis] != 1
        )
        summed = fl.sum(g, axes, keepdim=True) if axes else g
        return views.reshape(summed, shape)

    def unslice_axis(g: Tensor, axis: int, size: int, start: int, step: int) -> Tensor:
        count = g.shape[axis]
        if count == size and step == 1:
            return g
        if step < 0:  # walk it forwards: element i sits at start + i*step
            g = views.flip(g, axis)
            start, step = start + (count - 1) * step, -step
        if step > 1:  # interleave zeros: [.., n, 1] -> [.., n, step] -> [.., n*step]
            spread = views.unsqueeze(g, axis + 1)
            widths = [0] * (2 * spread.ndim)
            widths[2 * (spread.ndim - 1 - (axis + 1)) + 1] = step - 1
            spread = fl.pad(spread, widths)
            merged = list(g.shape)
            merged[axis] = count * step
            g = views.reshape(spread, tuple(merged))
            g = views.narrow(g, axis, 0, (count - 1) * step + 1)
        widths = [0] * (2 * g.ndim)
        widths[2 * (g.ndim - 1 - axis)] = start
        widths[2 * (g.ndim - 1 - axis) + 1] = size - start - g.shape[axis]
        return fl.pad(g, widths)

    return SimpleNamespace(
        where=fl.where, sign=fl.sign, exp=fl.exp, log=fl.log, sin=fl.sin, cos=fl.cos,
        tanh=fl.tanh, sigmoid=fl.sigmoid, erf=fl.erf, pow=fl.pow, floordiv=fl.floordiv,
        reshape=views.reshape, permute=views.permute, transpose=views.transpose,
        expand=views.expand, unsqueeze=views.unsqueeze, narrow=views.narrow, flip=views.flip,
        matmul=fl.matmul, sum_to=sum_to, unslice_axis=unslice_axis,
        reduce_sum=lambda t, axes: fl.sum(t, axes, keepdim=True),
        scatter_add=fl.scatter_add, gather=fl.gather, zeros=fl.zeros, copy=fl.clone,
    )  # fmt: skip


_F: SimpleNamespace | None = None


def functions() -> SimpleNamespace:
    global _F  # a namespace of functions, built once: not state
    if _F is None:
        _F = _functions()
    return _F
