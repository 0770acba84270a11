// evotune export: attention forward kernel, configuration baked in
//
// shape        1,8,512,64:fp16  (B=1 H=8 Sq=512 Sk=512 D=64)
// config       {"block_m": 32, "block_n": 128, "compute_warps": 2, "producer_warps": 2, "q_in_regs": false, "smem_layout": "swizzle", "stages": 1}
// entry        evotune_attention
// signature    evotune_attention(const unsigned short* q, k, v, unsigned short* o  /* fp16 or bf16 bit patterns */, int64 q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, o_sb, o_sh, o_ss, int seq_q, int seq_k, float scale_log2)  // strides in elements; scale_log2 = scale*log2(e)
// grid         (16, 8, 1)   block (128, 1, 1)   dynamic shared memory 36864 B
// NVRTC flags  --gpu-architecture=sm_90a -std=c++17 --ptxas-options=-v -lineinfo
// build        nvcc -arch=sm_90a -c THIS_FILE.cu
// resources    233 registers, 0 B spill stores, 0 B stack frame (ptxas -v, sm_90a)
// measured     7.97 us median (p10 7.97, p90 7.98; cuda-graph, 19 launches x 40 replays)
// error        max abs 0.000162 vs fp32 reference, gate ratio 0.0793 (atol 0.001, rtol 0.004), seeds [1, 2, 3]
// device       NVIDIA H100 80GB HBM3 (driver 580.159.04), torch ?, NVRTC 13.0
// run          mission-h100  git 47befbc43d86  evotune 0.1.0

// evotune: fused attention forward (FlashAttention-2 style) on tensor cores.
//
//   O = softmax(scale * Q K^T [+ causal mask]) V        per (batch, head)
//
// One CTA owns BLOCK_M query rows of one (batch, head). It streams K/V in
// tiles of BLOCK_N keys through a STAGES-deep cp.async pipeline in dynamic
// shared memory, computes S = Q K^T with mma.sync m16n8k16 (operands via
// ldmatrix, fp32 accumulation), applies the online softmax in registers
// (running max and sum in fp32, exp2 with scale*log2(e) folded in), and
// multiplies P (kept in registers, re-packed as the A operand) with V
// (ldmatrix.trans). Every knob is a template argument of AttnTraits: the
// generated code differs for every configuration.
//
// Knobs (compile time, see search_spaces/attention.yaml):
//   BLOCK_M        query rows per CTA
//   BLOCK_N        keys per K/V tile
//   COMPUTE_WARPS  warps doing the math; each owns BLOCK_M/COMPUTE_WARPS rows
//   PRODUCER_WARPS warps that only issue K/V copies (0 = the compute warps
//                  load their own tiles, one __syncthreads per tile)
//   STAGES         K/V tiles resident in shared memory
//   SMEM_LAYOUT    0 plain rows, 1 rows padded by 16 B, 2 XOR-swizzled 16 B chunks
//   Q_IN_REGS      keep the Q fragments in registers for the whole K/V loop (true)
//                  or re-read them from shared memory at every k-step (false; frees
//                  HEAD_DIM/4 registers per 16 rows, which d128 tiles need)
// Problem traits (from the shape, also compile time):
//   HEAD_DIM (64 or 128), IS_BF16, IS_CAUSAL (top-left aligned, as SDPA's is_causal)
//
// This file compiles standalone with NVRTC or nvcc; evotune appends one
// explicit instantiation (extern "C" entry point) per configuration.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace evotune {

typedef unsigned int u32;

// -inf without <math.h>'s INFINITY, which NVRTC does not provide.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

enum SmemLayout { kPlain = 0, kPadded = 1, kSwizzled = 2 };

template <int BLOCK_M_, int BLOCK_N_, int COMPUTE_WARPS_, int PRODUCER_WARPS_, int STAGES_,
          int SMEM_LAYOUT_, bool Q_IN_REGS_, int HEAD_DIM_, bool IS_BF16_, bool IS_CAUSAL_>
struct AttnTraits {
    static constexpr int kBlockM = BLOCK_M_;
    static constexpr int kBlockN = BLOCK_N_;
    static constexpr int kComputeWarps = COMPUTE_WARPS_;
    static constexpr int kProducerWarps = PRODUCER_WARPS_;
    static constexpr int kStages = STAGES_;
    static constexpr int kSmemLayout = SMEM_LAYOUT_;
    static constexpr bool kQInRegs = Q_IN_REGS_;
    static constexpr int kHeadDim = HEAD_DIM_;
    static constexpr bool kIsBf16 = IS_BF16_;
    static constexpr bool kIsCausal = IS_CAUSAL_;

    static constexpr int kComputeThreads = 32 * kComputeWarps;
    static constexpr int kProducerThreads = 32 * kProducerWarps;
    static constexpr int kThreads = kComputeThreads + kProducerThreads;
    static constexpr bool kHasProducers = kProducerWarps > 0;

    static constexpr int kRowsPerWarp = kBlockM / kComputeWarps;
    static constexpr int kMFrags = kRowsPerWarp / 16;      // 16-row mma tiles per warp
    static constexpr int kNFrags = kBlockN / 8;            // 8-key column blocks of S
    static constexpr int kDFrags = kHeadDim / 8;           // 8-wide column blocks of O
    static constexpr int kQKSteps = kHeadDim / 16;         // k-steps of Q K^T
    static constexpr int kQRegSteps = kQInRegs ? kQKSteps : 1;  // k-steps of Q held in registers
    static constexpr int kPVSteps = kBlockN / 16;          // k-steps of P V
    static constexpr int kChunksPerRow = kHeadDim / 8;     // 16-byte chunks per row

    // Shared-memory row pitch in elements: padding shifts each row by one
    // 16-byte bank group so ldmatrix's 8 row addresses hit different banks.
    static constexpr int kRowPitch = kHeadDim + (kSmemLayout == kPadded ? 8 : 0);
    static constexpr int kQElems = kBlockM * kRowPitch;
    static constexpr int kKVElems = kBlockN * kRowPitch;
    static constexpr int kSmemBytes = 2 * (kQElems + 2 * kStages * kKVElems);

    static_assert(kBlockM % (16 * kComputeWarps) == 0, "each compute warp must own a whole number of 16-row mma tiles");
    static_assert(kMFrags >= 1 && kMFrags <= 4, "1 to 4 mma row tiles per warp");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "BLOCK_N must be a multiple of 16 (ldmatrix.x4 covers 16 keys)");
    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim 64 or 128");
    static_assert(kStages >= 1 && kStages <= 4, "1 to 4 pipeline stages");
    static_assert(kProducerWarps >= 0 && kProducerWarps <= 4, "0 to 4 producer warps");
    static_assert(kThreads <= 1024, "at most 1024 threads per CTA");
    static_assert(kSmemLayout != kSwizzled || kChunksPerRow >= 8, "the XOR swizzle needs 8 chunks per row");
    static_assert(!kHasProducers || 1 + 2 * kStages <= 16, "named barriers: 1 + 2*STAGES must fit the 16 per CTA");
    static_assert(kSmemBytes <= 227 * 1024, "Q tile + STAGES*(K,V) tiles exceed the 227 KB per-CTA shared memory");
};

// ---------------------------------------------------------------- PTX wrappers

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 zero-fills (used for rows past the sequence end).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <bool IS_BF16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    if constexpr (IS_BF16) {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Named barriers let producer and consumer warps hand tiles over without
// stopping the whole CTA. Both order prior memory accesses for participants.
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

template <bool IS_BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    if constexpr (IS_BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<u32*>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<u32*>(&v);
    }
}

// ------------------------------------------------------- shared-memory tiles

// Element offset of 16-byte chunk `chunk` of row `row` in a tile.
template <class T>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
    if constexpr (T::kSmemLayout == kSwizzled) {
        return row * T::kRowPitch + ((chunk ^ (row & 7)) << 3);
    } else {
        return row * T::kRowPitch + (chunk << 3);
    }
}

// Copy `ROWS` rows (starting at global row `row0`) of a [seq, HEAD_DIM] slab
// into a shared tile with 16-byte cp.async; rows at or past `seq_len` are zero-filled.
template <class T, int ROWS, int NTHREADS>
__device__ __forceinline__ void load_tile_async(unsigned short* tile, const unsigned short* gbase, long long row_stride,
                                                int row0, int seq_len, int tid) {
    constexpr int kChunks = ROWS * T::kChunksPerRow;
#pragma unroll
    for (int i = 0; i < (kChunks + NTHREADS - 1) / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS;
        if (kChunks % NTHREADS == 0 || c < kChunks) {
            const int row = c / T::kChunksPerRow;
            const int chunk = c % T::kChunksPerRow;
            const bool valid = row0 + row < seq_len;
            // Clamp the source of a zero-filled copy to a valid address.
            const unsigned short* src = gbase + (valid ? (long long)(row0 + row) * row_stride : 0) + chunk * 8;
            cp_async_16(smem_addr(tile + tile_offset<T>(row, chunk)), src, valid);
        }
    }
}

// K and V tile `t` into pipeline slot t % STAGES, by NTHREADS loader threads.
template <class T, int NTHREADS>
__device__ __forceinline__ void load_kv_tile(unsigned short* sK, unsigned short* sV, const unsigned short* gK,
                                             const unsigned short* gV, long long k_ss, long long v_ss, int t, int seq_k,
                                             int loader_tid) {
    const int slot = t % T::kStages;
    load_tile_async<T, T::kBlockN, NTHREADS>(sK + slot * T::kKVElems, gK, k_ss, t * T::kBlockN, seq_k, loader_tid);
    load_tile_async<T, T::kBlockN, NTHREADS>(sV + slot * T::kKVElems, gV, v_ss, t * T::kBlockN, seq_k, loader_tid);
}

// --------------------------------------------------------- warp-level math

// Q fragments (A operand, 16x16) of this warp's rows for k-step kk, via ldmatrix.x4.
template <class T>
__device__ __forceinline__ void load_q_step(u32 (&qa)[4], const unsigned short* sQ, int row0, int kk, int lane) {
    const int row = row0 + (lane & 15);
    const int chunk = kk * 2 + (lane >> 4);
    ldmatrix_x4(qa, smem_addr(sQ + tile_offset<T>(row, chunk)));
}

template <class T>
__device__ __forceinline__ void load_q_frags(u32 (&qf)[T::kMFrags][T::kQRegSteps][4], const unsigned short* sQ,
                                             int warp_row0, int lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int kk = 0; kk < T::kQRegSteps; ++kk) load_q_step<T>(qf[mf][kk], sQ, warp_row0 + mf * 16, kk, lane);
}

// S = Q K^T for one K tile: each ldmatrix.x4 gives the B fragments of two 8-key blocks.
template <class T>
__device__ __forceinline__ void qk_tile(float (&s)[T::kMFrags][T::kNFrags][4], u32 (&qf)[T::kMFrags][T::kQRegSteps][4],
                                        const unsigned short* sQ, int warp_row0, const unsigned short* sK, int lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int nf = 0; nf < T::kNFrags; ++nf)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[mf][nf][i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < T::kQKSteps; ++kk) {
        if constexpr (!T::kQInRegs) {
#pragma unroll
            for (int mf = 0; mf < T::kMFrags; ++mf) load_q_step<T>(qf[mf][0], sQ, warp_row0 + mf * 16, kk, lane);
        }
        const int qs = T::kQInRegs ? kk : 0;
#pragma unroll
        for (int np = 0; np < T::kNFrags / 2; ++np) {
            u32 b[4];
            const int key = np * 16 + (lane & 7) + ((lane >> 4) << 3);
            const int chunk = kk * 2 + ((lane >> 3) & 1);
            ldmatrix_x4(b, smem_addr(sK + tile_offset<T>(key, chunk)));
#pragma unroll
            for (int mf = 0; mf < T::kMFrags; ++mf) {
                mma_16816<T::kIsBf16>(s[mf][2 * np], qf[mf][qs], b[0], b[1]);
                mma_16816<T::kIsBf16>(s[mf][2 * np + 1], qf[mf][qs], b[2], b[3]);
            }
        }
    }
}

// Set scores of keys past seq_k (ragged last tile) and, if causal, of keys
// after the query (top-left aligned: key j visible to query i iff j <= i) to -inf.
template <class T>
__device__ __forceinline__ void mask_tile(float (&s)[T::kMFrags][T::kNFrags][4], int q_row0, int kv0, int seq_k, int lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int nf = 0; nf < T::kNFrags; ++nf)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int key = kv0 + nf * 8 + 2 * (lane & 3) + (i & 1);
                const int q = q_row0 + mf * 16 + (lane >> 2) + ((i >> 1) << 3);
                bool masked = key >= seq_k;
                if constexpr (T::kIsCausal) masked = masked || key > q;
                if (masked) s[mf][nf][i] = neg_inf();
            }
}

// Online softmax on one tile of scores: update running max m and partial
// sums l (per thread, reduced across the quad only at the end), rescale O,
// and overwrite s with P = exp2(s*scale_log2 - m*scale_log2).
template <class T>
__device__ __forceinline__ void online_softmax(float (&s)[T::kMFrags][T::kNFrags][4], float (&o)[T::kMFrags][T::kDFrags][4],
                                               float (&m)[T::kMFrags][2], float (&l)[T::kMFrags][2], float scale_log2) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // r = 0: row lane/4, r = 1: row lane/4 + 8
            float mx = m[mf][r];
#pragma unroll
            for (int nf = 0; nf < T::kNFrags; ++nf) mx = fmaxf(mx, fmaxf(s[mf][nf][2 * r], s[mf][nf][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // Every row sees at least one unmasked key in its first tile, so mx is finite here.
            const float m_scaled = mx * scale_log2;
            const float alpha = fast_exp2(m[mf][r] * scale_log2 - m_scaled);  // 0 on the first tile (m = -inf)
            m[mf][r] = mx;
            float row_sum = 0.f;
#pragma unroll
            for (int nf = 0; nf < T::kNFrags; ++nf) {
                s[mf][nf][2 * r] = fast_exp2(fmaf(s[mf][nf][2 * r], scale_log2, -m_scaled));
                s[mf][nf][2 * r + 1] = fast_exp2(fmaf(s[mf][nf][2 * r + 1], scale_log2, -m_scaled));
                row_sum += s[mf][nf][2 * r] + s[mf][nf][2 * r + 1];
            }
            l[mf][r] = l[mf][r] * alpha + row_sum;
#pragma unroll
            for (int df = 0; df < T::kDFrags; ++df) {
                o[mf][df][2 * r] *= alpha;
                o[mf][df][2 * r + 1] *= alpha;
            }
        }
}

// O += P V: P's accumulator layout of two adjacent 8-key blocks is exactly the
// A-operand layout of one 16-key k-step, so P never leaves registers.
template <class T>
__device__ __forceinline__ void pv_tile(float (&o)[T::kMFrags][T::kDFrags][4], const float (&p)[T::kMFrags][T::kNFrags][4],
                                        const unsigned short* sV, int lane) {
#pragma unroll
    for (int kk = 0; kk < T::kPVSteps; ++kk) {
        u32 a[T::kMFrags][4];
#pragma unroll
        for (int mf = 0; mf < T::kMFrags; ++mf) {
            a[mf][0] = pack2<T::kIsBf16>(p[mf][2 * kk][0], p[mf][2 * kk][1]);
            a[mf][1] = pack2<T::kIsBf16>(p[mf][2 * kk][2], p[mf][2 * kk][3]);
            a[mf][2] = pack2<T::kIsBf16>(p[mf][2 * kk + 1][0], p[mf][2 * kk + 1][1]);
            a[mf][3] = pack2<T::kIsBf16>(p[mf][2 * kk + 1][2], p[mf][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < T::kDFrags / 2; ++dp) {
            u32 b[4];
            const int key = kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
            const int chunk = dp * 2 + (lane >> 4);
            ldmatrix_x4_trans(b, smem_addr(sV + tile_offset<T>(key, chunk)));
#pragma unroll
            for (int mf = 0; mf < T::kMFrags; ++mf) {
                mma_16816<T::kIsBf16>(o[mf][2 * dp], a[mf], b[0], b[1]);
                mma_16816<T::kIsBf16>(o[mf][2 * dp + 1], a[mf], b[2], b[3]);
            }
        }
    }
}

// Normalise O by the row sums, stage this warp's rows in its own slice of the
// Q tile (only this warp ever reads that slice, and it is done with Q), then
// write them to global memory with 16-byte stores.
template <class T>
__device__ __forceinline__ void store_o(float (&o)[T::kMFrags][T::kDFrags][4], float (&l)[T::kMFrags][2], unsigned short* sO,
                                        unsigned short* gO, long long row_stride, int q_row0, int warp_row0, int seq_q, int lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mf][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = 1.f / sum;
            const int row = warp_row0 + mf * 16 + (lane >> 2) + 8 * r;
#pragma unroll
            for (int df = 0; df < T::kDFrags; ++df) {
                const int col = df * 8 + 2 * (lane & 3);
                *reinterpret_cast<u32*>(sO + tile_offset<T>(row, col >> 3) + (col & 7)) =
                    pack2<T::kIsBf16>(o[mf][df][2 * r] * inv, o[mf][df][2 * r + 1] * inv);
            }
        }
    __syncwarp();
    constexpr int kChunks = T::kRowsPerWarp * T::kChunksPerRow;
#pragma unroll
    for (int i = 0; i < (kChunks + 31) / 32; ++i) {
        const int c = lane + 32 * i;
        if (kChunks % 32 == 0 || c < kChunks) {
            const int row = c / T::kChunksPerRow;
            const int chunk = c % T::kChunksPerRow;
            const int q = q_row0 + warp_row0 + row;
            if (q < seq_q) {
                const uint4 v = *reinterpret_cast<const uint4*>(sO + tile_offset<T>(warp_row0 + row, chunk));
                *reinterpret_cast<uint4*>(gO + (long long)q * row_stride + chunk * 8) = v;
            }
        }
    }
}

// ------------------------------------------------------------------ kernel

// Strides are in elements: *_sb batch, *_sh head, *_ss sequence (the head-dim stride is 1).
template <class T>
__device__ __forceinline__ void attention_fwd(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                                              const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
                                              long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh,
                                              long long k_ss, long long v_sb, long long v_sh, long long v_ss, long long o_sb,
                                              long long o_sh, long long o_ss, int seq_q, int seq_k, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned short* sQ = reinterpret_cast<unsigned short*>(smem_raw);
    unsigned short* sK = sQ + T::kQElems;
    unsigned short* sV = sK + T::kStages * T::kKVElems;

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int q_row0 = blockIdx.x * T::kBlockM;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const unsigned short* gQ = q + batch * q_sb + head * q_sh;
    const unsigned short* gK = k + batch * k_sb + head * k_sh;
    const unsigned short* gV = v + batch * v_sb + head * v_sh;
    unsigned short* gO = o + batch * o_sb + head * o_sh;

    // Causal: tiles wholly after this CTA's last query row contribute nothing; skip them.
    int kv_end = seq_k;
    if constexpr (T::kIsCausal) kv_end = min(seq_k, q_row0 + T::kBlockM);
    const int n_tiles = (kv_end + T::kBlockN - 1) / T::kBlockN;

    if constexpr (T::kHasProducers) {
        // Named barrier ids: FULL[s] = 1 + s (producers arrive, consumers wait),
        // EMPTY[s] = 1 + STAGES + s (consumers arrive, producers wait).
        if (warp >= T::kComputeWarps) {
            const int ptid = tid - T::kComputeThreads;
            load_tile_async<T, T::kBlockM, T::kProducerThreads>(sQ, gQ, q_ss, q_row0, seq_q, ptid);
#pragma unroll
            for (int s = 0; s < T::kStages - 1; ++s) {
                if (s < n_tiles) load_kv_tile<T, T::kProducerThreads>(sK, sV, gK, gV, k_ss, v_ss, s, seq_k, ptid);
                cp_async_commit();  // Q joins tile 0's group
            }
            for (int t = 0; t < n_tiles; ++t) {
                const int next = t + T::kStages - 1;
                if (next < n_tiles) {
                    // Slot of `next` last held tile t-1: wait until the consumers released it.
                    if (t >= 1) named_bar_sync(1 + T::kStages + (t - 1) % T::kStages, T::kThreads);
                    load_kv_tile<T, T::kProducerThreads>(sK, sV, gK, gV, k_ss, v_ss, next, seq_k, ptid);
                }
                cp_async_commit();  // empty groups keep the wait count uniform
                cp_async_wait<T::kStages - 1>();
                named_bar_arrive(1 + t % T::kStages, T::kThreads);
            }
            return;
        }
    } else {
        load_tile_async<T, T::kBlockM, T::kComputeThreads>(sQ, gQ, q_ss, q_row0, seq_q, tid);
        cp_async_commit();
#pragma unroll
        for (int s = 0; s < T::kStages - 1; ++s) {
            if (s < n_tiles) load_kv_tile<T, T::kComputeThreads>(sK, sV, gK, gV, k_ss, v_ss, s, seq_k, tid);
            cp_async_commit();
        }
    }

    // ---- compute warps
    const int warp_row0 = warp * T::kRowsPerWarp;
    u32 qf[T::kMFrags][T::kQRegSteps][4];
    float o_acc[T::kMFrags][T::kDFrags][4];
    float s_acc[T::kMFrags][T::kNFrags][4];
    float m_run[T::kMFrags][2], l_run[T::kMFrags][2];
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf) {
#pragma unroll
        for (int r = 0; r < 2; ++r) { m_run[mf][r] = neg_inf(); l_run[mf][r] = 0.f; }
#pragma unroll
        for (int df = 0; df < T::kDFrags; ++df)
#pragma unroll
            for (int i = 0; i < 4; ++i) o_acc[mf][df][i] = 0.f;
    }

    for (int t = 0; t < n_tiles; ++t) {
        // ---- wait for tile t (and, at t = 0, for Q)
        if constexpr (T::kHasProducers) {
            named_bar_sync(1 + t % T::kStages, T::kThreads);
        } else if constexpr (T::kStages == 1) {
            // One slot: everyone must be done with tile t-1 before it is overwritten.
            if (t > 0) __syncthreads();
            load_kv_tile<T, T::kComputeThreads>(sK, sV, gK, gV, k_ss, v_ss, t, seq_k, tid);
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
        } else {
            cp_async_wait<T::kStages - 2>();
            // After this barrier tile t is visible to all, and every warp has
            // finished tile t-1, so its slot can take tile t + STAGES - 1.
            __syncthreads();
            const int next = t + T::kStages - 1;
            if (next < n_tiles) load_kv_tile<T, T::kComputeThreads>(sK, sV, gK, gV, k_ss, v_ss, next, seq_k, tid);
            cp_async_commit();
        }
        if (T::kQInRegs && t == 0) load_q_frags<T>(qf, sQ, warp_row0, lane);

        const int slot = t % T::kStages;
        const int kv0 = t * T::kBlockN;
        qk_tile<T>(s_acc, qf, sQ, warp_row0, sK + slot * T::kKVElems, lane);
        bool need_mask = kv0 + T::kBlockN > seq_k;
        if constexpr (T::kIsCausal) need_mask = need_mask || kv0 + T::kBlockN - 1 > q_row0 + warp_row0;
        if (need_mask) mask_tile<T>(s_acc, q_row0 + warp_row0, kv0, seq_k, lane);
        online_softmax<T>(s_acc, o_acc, m_run, l_run, scale_log2);
        pv_tile<T>(o_acc, s_acc, sV + slot * T::kKVElems, lane);

        if constexpr (T::kHasProducers) {
            if (t + T::kStages < n_tiles) named_bar_arrive(1 + T::kStages + slot, T::kThreads);
        }
    }
    store_o<T>(o_acc, l_run, sQ, gO, o_ss, q_row0, warp_row0, seq_q, lane);
}

}  // namespace evotune

// ---- evotune instantiation: attention block_m=32,block_n=128,compute_warps=2,producer_warps=2,q_in_regs=False,smem_layout=swizzle,stages=1
using EvotuneTraits = evotune::AttnTraits<
    /* BLOCK_M = */ 32,
    /* BLOCK_N = */ 128,
    /* COMPUTE_WARPS = */ 2,
    /* PRODUCER_WARPS = */ 2,
    /* STAGES = */ 1,
    /* SMEM_LAYOUT = */ 2,
    /* Q_IN_REGS = */ false,
    /* HEAD_DIM = */ 64,
    /* IS_BF16 = */ false,
    /* IS_CAUSAL = */ false>;

// Launch: grid (ceil(seq_q / BLOCK_M), heads, batch), block (EvotuneTraits::kThreads),
// dynamic shared memory EvotuneTraits::kSmemBytes. Pointers are fp16/bf16 bit patterns;
// strides are in elements (b = batch, h = head, s = sequence; the head-dim stride is 1).
extern "C" __global__ void __launch_bounds__(EvotuneTraits::kThreads)
evotune_attention(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                  const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
                  long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh, long long k_ss,
                  long long v_sb, long long v_sh, long long v_ss, long long o_sb, long long o_sh, long long o_ss,
                  int seq_q, int seq_k, float scale_log2) {
    evotune::attention_fwd<EvotuneTraits>(q, k, v, o, q_sb, q_sh, q_ss, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss,
                                          o_sb, o_sh, o_ss, seq_q, seq_k, scale_log2);
}
