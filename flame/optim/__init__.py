"""Optimizers with PyTorch's interface, each step a few multi-tensor kernels (``flame.foreach``).

Each optimizer writes its update rule once, with public FLAME ops, as an elementwise function
of one parameter, its gradient and its state; ``flame.foreach`` compiles that rule into one
kernel that walks every parameter of a group. The learning rate and the other per-step values
are read by the kernel from a small device buffer, so schedules never recompile.

Inside ``flame.compile`` (``loss.backward(); opt.step(); opt.zero_grad()`` in the compiled
step, as with ``torch.compile``) the same rule is traced as in-place writes into the
parameters and the state, fused by the compiler per parameter; the step counts are 0-d
device tensors in the state, and the group's values (the rate a schedule sets between
calls) are read from a device copy the group keeps current (``Optimizer._hyper``), or from
the rate itself when it is a tensor: a new rate is never a retrace.
"""

from flame.optim import lr_scheduler, swa_utils
from flame.optim.adam import Adam, AdamW
from flame.optim.optimizer import Optimizer
from flame.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "lr_scheduler", "swa_utils"]
