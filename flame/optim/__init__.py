"""Optimizers with PyTorch's interface, each step a few multi-tensor kernels (``flame.foreach``).

Each optimizer writes its update rule once, with public FLAME ops, as an elementwise function
of one parameter, its gradient and its state; ``flame.foreach`` compiles that rule into one
kernel that walks every parameter of a group. The learning rate and the other per-step values
are read by the kernel from a small device buffer, so schedules never recompile.
"""

from flame.optim import lr_scheduler, swa_utils
from flame.optim.adam import Adam, AdamW
from flame.optim.optimizer import Optimizer
from flame.optim.sgd import SGD

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "lr_scheduler", "swa_utils"]
