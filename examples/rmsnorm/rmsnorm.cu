// Fused RMSNorm forward: y = x * rstd * w and rstd = 1 / sqrt(mean(x^2) + eps) per row, x [M, N] fp16/bf16,
// rstd fp32 (what a backward pass keeps). THREADS_PER_ROW threads share a row, ROWS rows a CTA, VEC elements
// per vector load; evotune writes the extern "C" entry point that calls rms_norm<...>.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
    T v[VEC];
};

template <typename T, int THREADS_PER_ROW, int ROWS, int VEC>
__device__ void rms_norm(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                         float* __restrict__ rstd, int M, int N, float eps) {
    static_assert(VEC == 2 || VEC == 4 || VEC == 8, "vectors of 4, 8 or 16 bytes");
    static_assert((THREADS_PER_ROW & (THREADS_PER_ROW - 1)) == 0, "a row's threads are a power of two");
    static_assert(THREADS_PER_ROW * ROWS % 32 == 0 && THREADS_PER_ROW * ROWS <= 1024, "whole warps, one CTA");
    constexpr int kWarpsPerRow = THREADS_PER_ROW > 32 ? THREADS_PER_ROW / 32 : 1;
    __shared__ float partial[ROWS][kWarpsPerRow];
    using V = Vec<T, VEC>;

    const int lane = threadIdx.x % THREADS_PER_ROW, slot = threadIdx.x / THREADS_PER_ROW;
    const int row = blockIdx.x * ROWS + slot;
    const bool active = row < M;
    const V* xr = reinterpret_cast<const V*>(x + (size_t)(active ? row : 0) * N);
    const int vecs = N / VEC;

    float ss = 0.0f;
    if (active)
        for (int i = lane; i < vecs; i += THREADS_PER_ROW) {
            V v = xr[i];
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                float f = static_cast<float>(v.v[e]);
                ss += f * f;
            }
        }
    // Within a warp: the row's lanes (xor offsets below THREADS_PER_ROW stay inside the row's aligned group).
#pragma unroll
    for (int off = (THREADS_PER_ROW < 32 ? THREADS_PER_ROW : 32) / 2; off > 0; off /= 2)
        ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if constexpr (kWarpsPerRow > 1) {
        if (lane % 32 == 0) partial[slot][lane / 32] = ss;
        __syncthreads();
        ss = 0.0f;
#pragma unroll
        for (int i = 0; i < kWarpsPerRow; ++i) ss += partial[slot][i];
    }
    if (!active) return;
    const float r = rsqrtf(ss / N + eps);
    if (lane == 0) rstd[row] = r;
    const V* wv = reinterpret_cast<const V*>(w);
    V* yr = reinterpret_cast<V*>(y + (size_t)row * N);
    for (int i = lane; i < vecs; i += THREADS_PER_ROW) {
        V v = xr[i], g = wv[i], o;
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            o.v[e] = static_cast<T>(static_cast<float>(v.v[e]) * r * static_cast<float>(g.v[e]));
        yr[i] = o;
    }
}
