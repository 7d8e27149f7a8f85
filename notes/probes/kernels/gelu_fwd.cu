// dump: graph 6, kernel k1: elementwise over bf16[256,512]
// dump: writes %9
// dump: why: writes %9: input of matmul, which reads memory
// dump: launch: grid 64, block 256 (planned for 132 SMs (an H100); no GPU, not run)
// dump: resources: 32 registers, spills 0 B stored / 0 B loaded, 0 B stack, 0 B shared (ptxas -v for sm_90)
// dump: bytes moved: 525,312 (floor 0.177 us at 2970 GB/s)
// dump: cache: not cached (reference backend: compiled with NVRTC to be read, not run)
// FLAME kernel flame_ew_add_gelu_90371a41db
//   %0: bf16[256,512] = expand(in0, shape=[256,512])  # mlp_train.py:47
//   %1: bf16[256,512] = add(in1, %0)                  # mlp_train.py:47
//   %2: bf16[256,512] = gelu(%1, approximate="none")  # mlp_train.py:47
//   writes %2
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
__device__ __forceinline__ float flame_gelu_none(float x) {
    return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f));
}

__device__ __forceinline__ float flame_gelu_tanh(float x) {
    // 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u): no tanhf, no cancellation near -inf
    const float inner = 0.79788456080286536f * (x + 0.044715f * x * x * x);
    return __fdividef(x, 1.0f + __expf(-2.0f * inner));
}

extern "C" __global__ void __launch_bounds__(256) flame_ew_add_gelu_90371a41db(
    unsigned short* out0,
    const unsigned short* __restrict__ in0,
    const unsigned short* __restrict__ in1,
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
        FlameVec<unsigned short, 8> out0_vec;
        #pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float v0 = flame_load_bf16(v0_vec.v[k]);
            const float v1 = flame_load_bf16(in1[v1_at + k * 1]);
            const float v2 = (v0 + v1);
            const float v3 = flame_gelu_none(v2);
            out0_vec.v[k] = flame_store_bf16(v3);
        }
        *reinterpret_cast<FlameVec<unsigned short, 8>*>(out0 + base) = out0_vec;
    }
}
