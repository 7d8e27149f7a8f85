"""A/B of the gradient clipping's global norm in a training step: the ``global_norm``
multi-tensor op (default) against one reduction per gradient (``per_tensor``, the code
before it), through notes/probes/diffusion_step_case.py.

    python notes/probes/norm_ab.py {op,per_tensor} [model size image batch [systems]]
"""

import sys

import flame.nn.utils as utils
from notes.probes import diffusion_step_case

if __name__ == "__main__":
    mode = sys.argv.pop(1)
    if mode == "per_tensor":
        utils.global_norm = lambda grads, norm_type=2.0: utils._per_tensor_norm(
            grads, float(norm_type)
        )
    diffusion_step_case.main()
