// evotune: scalar helpers of the CUDA-core kernels (softmax.cu, attention_decode.cu): -inf, exp2 on the SFU, and
// fp16/bf16 bits <-> fp32. Included inside namespace evotune. The tensor-core kernels keep their own in
// device_common.cuh, whose text (and so their recorded source digests) this header leaves as it was.

// -inf without <math.h>'s INFINITY, which NVRTC does not provide.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ float fast_exp2(float x) {  // ex2.approx(-inf) = +0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

template <bool IS_BF16>
__device__ __forceinline__ float to_float(unsigned short bits) {
    if constexpr (IS_BF16) {
        return __uint_as_float(static_cast<unsigned int>(bits) << 16);
    } else {
        float f;
        asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(bits));
        return f;
    }
}

template <bool IS_BF16>
__device__ __forceinline__ unsigned short from_float(float f) {
    unsigned short bits;
    if constexpr (IS_BF16) {
        asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(bits) : "f"(f));
    } else {
        asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(bits) : "f"(f));
    }
    return bits;
}
