// dump: graph 6, kernel k8: elementwise over bf16[256,512]
// dump: writes %34
// dump: why: writes %34: input of matmul, which reads memory
// dump: why: apart from k1 (same bf16[256,512]): it needs k1's results first (k8 <- k6 <- k4 <- k3 <- k2 <- k1)
// dump: launch: grid 64, block 256 (planned for 132 SMs (an H100); no GPU, not run)
// dump: resources: 32 registers, spills 0 B stored / 0 B loaded, 0 B stack, 0 B shared (ptxas -v for sm_90)
// dump: bytes moved: 787,456 (floor 0.265 us at 2970 GB/s)
// dump: cache: not cached (reference backend: compiled with NVRTC to be read, not run)
// FLAME kernel flame_ew_add_mul_erf_exp_e3f18912e7
//   %0: bf16[256,512] = expand(in0, shape=[256,512])  # mlp_train.py:47
//   %1: bf16[256,512] = add(in1, %0)                  # mlp_train.py:47
//   %2: bf16[] = const(value=0.5)
//   %3: bf16[] = const(value=1.0)
//   %4: bf16[] = const(value=0.7071067811865476)
//   %5: bf16[256,512] = mul(%1, %4)                   # mlp_train.py:48
//   %6: bf16[256,512] = erf(%5)                       # mlp_train.py:48
//   %7: bf16[256,512] = add(%3, %6)                   # mlp_train.py:48
//   %8: bf16[256,512] = mul(%2, %7)                   # mlp_train.py:48
//   %9: bf16[] = const(value=-0.5)
//   %10: bf16[256,512] = mul(%9, %1)                  # mlp_train.py:48
//   %11: bf16[256,512] = mul(%10, %1)                 # mlp_train.py:48
//   %12: bf16[256,512] = exp(%11)                     # mlp_train.py:48
//   %13: bf16[256,512] = mul(%1, %12)                 # mlp_train.py:48
//   %14: bf16[] = const(value=0.3989422804014327)
//   %15: bf16[256,512] = mul(%13, %14)                # mlp_train.py:48
//   %16: bf16[256,512] = add(%8, %15)                 # mlp_train.py:48
//   %17: bf16[256,512] = mul(in2, %16)                # mlp_train.py:48
//   writes %17
// FLAME device prelude: storage conversions and the vector type. No CUDA headers, so NVRTC
// compiles kernels quickly and without an include path.
template <typename T, int N> struct alignas(sizeof(T) * N) FlameVec { T v[N]; };

__device__ __forceinline__ float flame_load_f16(unsigned short bits) {
    float value;
    asm("cvt.f32.f16 %0, %1;" : "=f"(value) : "h"(bits));
    return value;
}
__device__ __forceinline__ unsigned short flame_store_f16(float value) {
    unsigned short bits;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
}
__device__ __forceinline__ float flame_load_bf16(unsigned short bits) {
    return __uint_as_float(((unsigned int)bits) << 16);
}
__device__ __forceinline__ unsigned short flame_store_bf16(float value) {
#if __CUDA_ARCH__ >= 800
    unsigned short bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(value));
    return bits;
#else
    unsigned int raw = __float_as_uint(value);
    if ((raw & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    raw += 0x7fffu + ((raw >> 16) & 1u);
    return (unsigned short)(raw >> 16);
#endif
}
extern "C" __global__ void __launch_bounds__(256) flame_ew_add_mul_erf_exp_e3f18912e7(
    unsigned short* out0,
    const unsigned short* __restrict__ in0,
    const unsigned short* __restrict__ in1,
    const unsigned short* __restrict__ in2,
    int n,
    int size1
) {
    typedef int Index;
    const Index stride = (Index)gridDim.x * blockDim.x;
    const Index first = (Index)blockIdx.x * blockDim.x + threadIdx.x;
    for (Index vector = first; vector < n / 8; vector += stride) {
        const Index base = vector * 8;
        int rest = base;
        const int i1 = rest % size1; rest /= size1;
        const int i0 = rest;
        const FlameVec<unsigned short, 8> v0_vec = *reinterpret_cast<const FlameVec<unsigned short, 8>*>(in0 + base);
        const int v1_at = i1;
        const FlameVec<unsigned short, 8> v2_vec = *reinterpret_cast<const FlameVec<unsigned short, 8>*>(in2 + base);
        FlameVec<unsigned short, 8> out0_vec;
        #pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float v0 = flame_load_bf16(v0_vec.v[k]);
            const float v1 = flame_load_bf16(in1[v1_at + k * 1]);
            const float v2 = flame_load_bf16(v2_vec.v[k]);
            const float v3 = (v0 + v1);
            const float v7 = (v3 * 0.7071067690849304f);
            const float v8 = erff(v7);
            const float v9 = (1.0f + v8);
            const float v10 = (0.5f * v9);
            const float v12 = (-0.5f * v3);
            const float v13 = (v12 * v3);
            const float v14 = expf(v13);
            const float v15 = (v3 * v14);
            const float v17 = (v15 * 0.3989422917366028f);
            const float v18 = (v10 + v17);
            const float v19 = (v2 * v18);
            out0_vec.v[k] = flame_store_bf16(v19);
        }
        *reinterpret_cast<FlameVec<unsigned short, 8>*>(out0 + base) = out0_vec;
    }
}
