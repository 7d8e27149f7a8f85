"""Whether NVRTC here prints ptxas resource usage (the dump reads spills from it)."""
from flame.tools.analysis import compile_with_resources

src = 'extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }'
print(compile_with_resources(src, "k", "sm_90"))
