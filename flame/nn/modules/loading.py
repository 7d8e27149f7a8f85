"""Loading a ``state_dict`` into a module (``Module.load_state_dict``): every entry checked
and converted first (``plan``), then written (``apply``), so that an error leaves the module
as it was; ``flame.io.load_checkpoint`` plans every section of a checkpoint before it writes
any."""

from __future__ import annotations

from flame.tensor import Tensor


def entries(module):
    """``{key: (module, table, name)}`` for every entry ``state_dict`` would hold."""
    found = {}
    for prefix, owner in module.named_modules(remove_duplicate=False):
        base = prefix + "." if prefix else ""
        for name, param in owner._parameters.items():
            if param is not None:
                found[base + name] = (owner, "_parameters", name)
        for name, buffer in owner._buffers.items():
            if buffer is not None and name not in owner._non_persistent_buffers_set:
                found[base + name] = (owner, "_buffers", name)
    return found


def plan(module, state_dict, strict: bool):
    """``(writes, missing, unexpected)`` for ``load_state_dict``, or its error: nothing
    is written here (``flame.io.load_checkpoint`` checks every section first)."""
    import numpy as np

    if not hasattr(state_dict, "keys"):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict).__name__}.")
    found = entries(module)
    missing = [key for key in found if key not in state_dict]
    unexpected = [key for key in state_dict if key not in found]
    errors = []
    if strict:
        if unexpected:
            errors.append(
                "Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected)
                + ". "
            )  # fmt: skip
        if missing:
            errors.append(
                "Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ". "
            )
    writes = []
    for key, (owner, table, name) in found.items():
        if key not in state_dict:
            continue
        value = state_dict[key]
        current = getattr(owner, table)[name]
        if isinstance(value, np.ndarray) or (
            hasattr(value, "__array__") and not isinstance(value, Tensor)
        ):
            value = np.asarray(value)
        elif not isinstance(value, Tensor):
            errors.append(
                f'While copying the parameter named "{key}", expected a flame tensor or '
                f"array from checkpoint but received {type(value).__name__}"
            )
            continue
        if tuple(value.shape) != tuple(current.shape):
            errors.append(
                f"size mismatch for {key}: copying a param with shape {list(value.shape)} "
                f"from checkpoint, the shape in current model is {list(current.shape)}."
            )
            continue
        try:
            source = _as_tensor(value, current)
        except (TypeError, ValueError) as error:
            errors.append(f"While copying the parameter named {key!r}: {error}")
            continue
        writes.append((owner, table, name, current, source))
    if errors:
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(errors)
        )
    return writes, missing, unexpected


def apply(plan, assign: bool) -> None:
    from flame.autograd import no_grad

    writes = plan[0]
    with no_grad():
        for module, table, name, current, source in writes:
            if assign:
                if table == "_parameters":
                    current.data = source
                else:
                    getattr(module, table)[name] = source.realize()
            else:
                current.copy_(source)
    for module in {id(entry[0]): entry[0] for entry in writes}.values():
        loaded = getattr(module, "_state_loaded", None)
        if loaded is not None:  # a module that keeps host copies of its buffers
            loaded()


def _as_tensor(value, current: Tensor) -> Tensor:
    """``value`` (a FLAME tensor or an array) as a tensor on ``current``'s backend."""
    from flame.backend import backend as use_backend
    from flame.creation import tensor as make_tensor

    if isinstance(value, Tensor):
        if value.backend == current.backend:
            return value
        value = value.numpy()
    with use_backend(current.backend):
        return make_tensor(value)
