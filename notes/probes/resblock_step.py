"""A UNet ResBlock's compiled forward + backward (bf16, 128ch 32x32 b32), run a few times: a
script for `flame dump --profile`."""

import numpy as np

import flame as fl
import flame.nn as nn
from bench.conv_attention import resblock_class

fl.manual_seed(0)
block = resblock_class(nn)(128, 512).bfloat16()
rng = np.random.default_rng(0)
x, temb, gout = (
    fl.tensor(rng.standard_normal(shape).astype(np.float32)).to(fl.bfloat16).realize()
    for shape in ((32, 128, 32, 32), (32, 512), (32, 128, 32, 32))
)
x.requires_grad_()


@fl.compile
def step(x, temb, gout):
    out = block(x, temb)
    out.backward(gout)
    return out


for _ in range(3):
    block.zero_grad(set_to_none=True)
    x.grad = None
    step(x, temb, gout)
fl.synchronize()
