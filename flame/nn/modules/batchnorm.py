"""``BatchNorm1d`` and ``BatchNorm2d``, as PyTorch's: the same constructor arguments, the
buffers ``running_mean``, ``running_var`` and ``num_batches_tracked`` (int64), the
``state_dict`` keys, train/eval behaviour and ``repr``.

In training the batch's statistics normalise and the running ones move toward them (in
place, inside ``F.batch_norm``); in eval the running ones normalise. ``momentum=None`` is
PyTorch's cumulative average, factor ``1 / num_batches_tracked``: FLAME passes that factor
to ``F.batch_norm`` as a 0-d tensor (PyTorch reads the count to the host, a sync every
step), so it works under ``flame.compile`` too.
With ``track_running_stats=False`` there are no buffers and the batch's statistics are used
in eval too.
"""

from __future__ import annotations

from flame.backend import backend as use_backend
from flame.creation import ones, tensor, zeros
from flame.ir import dtypes
from flame.nn import init
from flame.nn.modules.module import Module
from flame.nn.modules.normalization import affine_parameters, reset_affine
from flame.nn.normalization import batch_norm
from flame.tensor import Tensor

__all__ = ["BatchNorm1d", "BatchNorm2d"]


class _NormBase(Module):
    """Parameters, buffers, their reset and ``repr`` (shared with future instance norms)."""

    _version = 2
    __constants__ = ["track_running_stats", "momentum", "eps", "num_features", "affine"]

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device=None,
        dtype=None,
        *,
        bias: bool = True,
    ):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        affine_parameters(self, (num_features,), affine, bias, device, dtype)
        if track_running_stats:
            dtype = dtypes.float32 if dtype is None else dtypes.dtype(dtype)
            self.register_buffer("running_mean", zeros(num_features, dtype=dtype, device=device))
            self.register_buffer("running_var", ones(num_features, dtype=dtype, device=device))
            count = tensor(0, dtype=dtypes.int64, device=device)
            self.register_buffer("num_batches_tracked", count)
        else:
            self.register_buffer("running_mean", None)
            self.register_buffer("running_var", None)
            self.register_buffer("num_batches_tracked", None)
        self.reset_parameters()

    def reset_running_stats(self) -> None:
        # through nn.init, which writes on the tensor's own backend (a bare ``zero_`` makes
        # its zeros on the current one, and refuses a cpu buffer under fl.backend("cuda"))
        if self.track_running_stats:
            init.zeros_(self.running_mean)
            init.ones_(self.running_var)
            init.zeros_(self.num_batches_tracked)

    def reset_parameters(self) -> None:
        self.reset_running_stats()
        reset_affine(self)

    def _check_input_dim(self, input: Tensor) -> None:  # noqa: A002 (PyTorch's name)
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, bias={self.bias is not None}, "
            f"track_running_stats={self.track_running_stats}"
        )


class _BatchNorm(_NormBase):
    def forward(self, input: Tensor) -> Tensor:  # noqa: A002
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            with use_backend(self.num_batches_tracked.backend):
                self.num_batches_tracked.add_(1)
            if self.momentum is None:  # the cumulative average, 1 / count as a tensor
                count = self.num_batches_tracked.to(self.running_mean.dtype)
                factor = count.reciprocal()
        # the batch's statistics in training, and in eval when there are no running ones
        use_batch = self.training or (self.running_mean is None and self.running_var is None)
        # the running statistics are passed where they are updated or used
        pass_running = not self.training or self.track_running_stats
        return batch_norm(
            input,
            self.running_mean if pass_running else None,
            self.running_var if pass_running else None,
            self.weight,
            self.bias,
            use_batch,
            factor,
            self.eps,
        )


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of [N, C] or [N, C, L] per channel C."""

    def _check_input_dim(self, input: Tensor) -> None:  # noqa: A002
        if input.ndim != 2 and input.ndim != 3:
            raise ValueError(f"expected 2D or 3D input (got {input.ndim}D input)")


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of [N, C, H, W] per channel C."""

    def _check_input_dim(self, input: Tensor) -> None:  # noqa: A002
        if input.ndim != 4:
            raise ValueError(f"expected 4D input (got {input.ndim}D input)")
