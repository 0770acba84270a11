// A tiled fp16/bf16 GEMM, C[M,N] = A[M,K] B[K,N] (row-major, fp32 accumulation): tensor cores through WMMA,
// tiles of A and B streamed into shared memory by a STAGES-deep cp.async pipeline.
// The knobs are the template parameters; evotune writes the extern "C" entry point that calls gemm<...>.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ __half from_float(float x, __half) { return __float2half_rn(x); }
__device__ __forceinline__ __nv_bfloat16 from_float(float x, __nv_bfloat16) { return __float2bfloat16_rn(x); }

template <typename T, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES>
struct GemmTraits {
    static constexpr int kThreads = WARPS_M * WARPS_N * 32;
    static constexpr int kWarpM = BM / WARPS_M, kWarpN = BN / WARPS_N;   // a warp's tile of C
    static constexpr int kFragM = kWarpM / 16, kFragN = kWarpN / 16;     // its 16x16 accumulators
    static constexpr int kPad = 8;                                       // 16 bytes: rows stay 16-byte aligned
    static constexpr int kLdA = BK + kPad, kLdB = BN + kPad;
    static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "a warp's tile is whole 16x16 fragments");
    static_assert(BK % 16 == 0, "BK is whole 16-deep MMA steps");
    static_assert(STAGES >= 2, "the pipeline loads one stage ahead at least");
};

template <typename T, int BM, int BN, int BK, int WARPS_M, int WARPS_N, int STAGES>
__device__ void gemm(const T* __restrict__ A, const T* __restrict__ B, T* __restrict__ C, int M, int N, int K) {
    using namespace nvcuda;
    using Tr = GemmTraits<T, BM, BN, BK, WARPS_M, WARPS_N, STAGES>;
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sA = reinterpret_cast<T*>(smem_raw);          // STAGES x BM x kLdA
    T* sB = sA + STAGES * BM * Tr::kLdA;             // STAGES x BK x kLdB
    float* scratch = reinterpret_cast<float*>(sB + STAGES * BK * Tr::kLdB) + (threadIdx.x / 32) * 256;

    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int row0 = blockIdx.y * BM, col0 = blockIdx.x * BN;

    auto load_stage = [&](int stage, int k0) {
        T* a = sA + stage * BM * Tr::kLdA;
        T* b = sB + stage * BK * Tr::kLdB;
        for (int c = tid; c < BM * BK / 8; c += Tr::kThreads) {
            int r = c / (BK / 8), k = (c % (BK / 8)) * 8;
            cp_async16(a + r * Tr::kLdA + k, A + (size_t)(row0 + r) * K + k0 + k);
        }
        for (int c = tid; c < BK * BN / 8; c += Tr::kThreads) {
            int r = c / (BN / 8), n = (c % (BN / 8)) * 8;
            cp_async16(b + r * Tr::kLdB + n, B + (size_t)(k0 + r) * N + col0 + n);
        }
    };

    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[Tr::kFragM][Tr::kFragN];
#pragma unroll
    for (int i = 0; i < Tr::kFragM; ++i)
#pragma unroll
        for (int j = 0; j < Tr::kFragN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);

    const int k_tiles = K / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) load_stage(s, s * BK);
        cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();   // tile kt has landed (for this thread) ...
        __syncthreads();               // ... for every thread, and every warp is done with tile kt - 1
        const int next = kt + STAGES - 1;
        if (next < k_tiles) load_stage(next % STAGES, next * BK);  // into the stage tile kt - 1 used
        cp_async_commit();
        const T* a = sA + (kt % STAGES) * BM * Tr::kLdA;
        const T* b = sB + (kt % STAGES) * BK * Tr::kLdB;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[Tr::kFragM];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb[Tr::kFragN];
#pragma unroll
            for (int i = 0; i < Tr::kFragM; ++i)
                wmma::load_matrix_sync(fa[i], a + (wm * Tr::kWarpM + i * 16) * Tr::kLdA + kk, Tr::kLdA);
#pragma unroll
            for (int j = 0; j < Tr::kFragN; ++j)
                wmma::load_matrix_sync(fb[j], b + kk * Tr::kLdB + wn * Tr::kWarpN + j * 16, Tr::kLdB);
#pragma unroll
            for (int i = 0; i < Tr::kFragM; ++i)
#pragma unroll
                for (int j = 0; j < Tr::kFragN; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
    }
    cp_async_wait<0>();

    // Epilogue: each accumulator through the warp's own 16x16 fp32 scratch, rounded to T, 8 elements per lane.
#pragma unroll
    for (int i = 0; i < Tr::kFragM; ++i)
#pragma unroll
        for (int j = 0; j < Tr::kFragN; ++j) {
            wmma::store_matrix_sync(scratch, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            const int r0 = row0 + wm * Tr::kWarpM + i * 16, c0 = col0 + wn * Tr::kWarpN + j * 16;
            for (int e = lane; e < 256; e += 32)
                C[(size_t)(r0 + e / 16) * N + c0 + e % 16] = from_float(scratch[e], T());
            __syncwarp();
        }
}
