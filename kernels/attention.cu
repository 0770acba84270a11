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
//   KV_SPLITS      CTAs that share one query tile, each walking 1/KV_SPLITS of the
//                  K/V tiles (split-KV, for small problems that leave SMs idle); the
//                  last CTA of a tile to finish merges the partial results (fused combine)
//   WARP_KEY_GROUPS  compute warps that share the same query rows, each taking 1/WARP_KEY_GROUPS
//                  of every K/V tile's keys; their partial (max, sum, O) are merged through
//                  shared memory at the end (split-K inside the CTA: shorter serial chains per warp)
//   Q_IN_REGS      keep the Q fragments in registers for the whole K/V loop (true)
//                  or re-read them from shared memory at every k-step (false; frees
//                  HEAD_DIM/4 registers per 16 rows, which d128 tiles need)
// Problem traits (from the shape, also compile time):
//   HEAD_DIM (64, 128 or 256), IS_BF16, IS_CAUSAL (top-left aligned, as SDPA's is_causal)
//
// This file compiles standalone with NVRTC or nvcc; evotune appends one
// explicit instantiation (extern "C" entry point) per configuration.

#include <cuda_fp16.h>
#include <cuda_bf16.h>
// CUtensorMap: the Hopper variant's TMA descriptors arrive by value as __grid_constant__ kernel
// parameters. NVRTC cannot include <cuda.h> (it pulls in host headers), so there the same opaque
// type is declared as CUDA 13's cuda.h declares it (16 qwords, 128-byte aligned).
#if defined(__CUDACC_RTC__)
typedef struct CUtensorMap_st {
    alignas(128) unsigned long long opaque[16];
} CUtensorMap;
#else
#include <cuda.h>
#endif
static_assert(sizeof(CUtensorMap) == 128 && alignof(CUtensorMap) >= 64, "CUtensorMap is 128 bytes, 64-byte aligned or more");

namespace evotune {

#include "device_common.cuh"
#include "ptx.cuh"
#include "attention_exp2_fma.cuh"

enum SmemLayout { kPlain = 0, kPadded = 1, kSwizzled = 2 };

template <int BLOCK_M_, int BLOCK_N_, int COMPUTE_WARPS_, int PRODUCER_WARPS_, int STAGES_,
          int SMEM_LAYOUT_, bool Q_IN_REGS_, int KV_SPLITS_, int WARP_KEY_GROUPS_, bool PDL_, int EXP2_FMA_,
          bool SPLIT_MERGE_, int KV_LOAD_, int KV_CLUSTER_, int HEAD_DIM_, bool IS_BF16_, bool IS_CAUSAL_>
struct AttnTraits {
    static constexpr int kBlockM = BLOCK_M_;
    static constexpr int kBlockN = BLOCK_N_;
    static constexpr int kComputeWarps = COMPUTE_WARPS_;
    static constexpr int kProducerWarps = PRODUCER_WARPS_;
    static constexpr int kStages = STAGES_;
    static constexpr int kSmemLayout = SMEM_LAYOUT_;
    static constexpr bool kQInRegs = Q_IN_REGS_;
    static constexpr int kKVSplits = KV_SPLITS_;
    static constexpr int kKeyGroups = WARP_KEY_GROUPS_;
    static constexpr bool kPdl = PDL_;  // pdl: griddepcontrol.wait before the first global access (docs/PDL.md)
    static constexpr int kExp2FmaEighths = EXP2_FMA_;  // exp2_fma: eighths of each row's exp2 on the FMA pipe
    // key_merge = split (kernels/attention_split_merge.cuh): each key group merges and stores 1/G of the head dim
    static constexpr bool kSplitMerge = SPLIT_MERGE_;
    // kv_load: 0 cp.async, 1 TMA (kernels/attention_tma_load.cuh), 2 TMA with K's and V's barriers apart
    // (attention_tma_split.cuh); kv_cluster: CTAs sharing each K/V tile by TMA multicast (attention_tma_multicast.cuh)
    static constexpr int kKvLoad = KV_LOAD_;
    static constexpr bool kTmaLoad = kKvLoad >= 1;
    static constexpr bool kTmaSplit = kKvLoad == 2;
    static constexpr int kKVCluster = KV_CLUSTER_;
    static constexpr bool kTmaMulticast = kKVCluster > 1;
    static constexpr int kHeadDim = HEAD_DIM_;
    static constexpr bool kIsBf16 = IS_BF16_;
    static constexpr bool kIsCausal = IS_CAUSAL_;

    static constexpr int kComputeThreads = 32 * kComputeWarps;
    static constexpr int kProducerThreads = 32 * kProducerWarps;
    static constexpr int kThreads = kComputeThreads + kProducerThreads;
    static constexpr bool kHasProducers = kProducerWarps > 0;

    static constexpr int kRowGroups = kComputeWarps / kKeyGroups;
    static constexpr int kRowsPerWarp = kBlockM / kRowGroups;
    static constexpr int kWarpKeys = kBlockN / kKeyGroups;  // keys of each tile one warp handles
    static constexpr int kMFrags = kRowsPerWarp / 16;      // 16-row mma tiles per warp
    static constexpr int kNFrags = kWarpKeys / 8;          // 8-key column blocks of this warp's S
    static constexpr int kDFrags = kHeadDim / 8;           // 8-wide column blocks of O
    static constexpr int kQKSteps = kHeadDim / 16;         // k-steps of Q K^T
    static constexpr int kQRegSteps = kQInRegs ? kQKSteps : 1;  // k-steps of Q held in registers
    static constexpr int kPVSteps = kWarpKeys / 16;        // k-steps of P V
    static constexpr int kChunksPerRow = kHeadDim / 8;     // 16-byte chunks per row

    // Shared-memory row pitch in elements: padding shifts each row by one
    // 16-byte bank group so ldmatrix's 8 row addresses hit different banks.
    static constexpr int kRowPitch = kHeadDim + (kSmemLayout == kPadded ? 8 : 0);
    static constexpr int kQElems = kBlockM * kRowPitch;
    static constexpr int kKVElems = kBlockN * kRowPitch;
    // Key-group merge: every warp but the first of a row group leaves its O (fp32), max and sum.
    static constexpr int kMergeSlotFloats = kBlockM * (kHeadDim + 2);
    static constexpr int kMergeBytes = kKeyGroups > 1 ? 4 * (kKeyGroups - 1) * kMergeSlotFloats : 0;
    static constexpr int kSmemBytes = 2 * (kQElems + 2 * kStages * kKVElems) + kMergeBytes;
    // Rows can meet a tile in which all of their keys are masked before any unmasked one:
    // their running max stays -inf and must not turn exp2 into NaN.
    static constexpr bool kGuardEmptyRows = (kIsCausal && kKVSplits > 1) || kKeyGroups > 1;
    // fp32 accumulator registers per thread, O and S (the search space's acc_regs).
    static constexpr int kAccRegs = 4 * kMFrags * (kDFrags + kNFrags);
    // Register-tight tiles: more than 160 accumulator registers, i.e. 32 rows per warp
    // with head_dim + keys = 192 (FA2's d128 128x64 and d64 128x128 tiles). Left to
    // itself, ptxas runs P V of the first 16-row tile under the softmax of the second and
    // keeps the next k-steps' Q/K fragments in flight across Q K^T, then spills loop
    // invariants and row sums (d128 128x64: 56 B; FA2's own sm80 build of that tile spills
    // 172 B, flash-attention issue 1630). Three code-shape changes, same arithmetic, keep
    // these tiles spill-free (d128 128x64: 254 registers, Q from shared memory):
    //  - kLazyRescale: O is rescaled after the softmax and only when some row max of the
    //    warp moved (otherwise alpha == 1 exactly and o * alpha == o). This genuine,
    //    warp-uniform branch closes the softmax's basic block, so P V no longer overlaps it.
    //  - kQKUnroll: Q K^T runs in trips of 4 k-steps, bounding the fragments in flight
    //    (Q re-read from shared memory only: Q in registers needs every k-step unrolled).
    //  - kPackEarly: P is packed to 16 bits as each probability is computed, not per
    //    k-step of P V. On tiles that fit this lets ptxas overlap more and costs registers
    //    (d64 128x32, Q in registers: 173 instead of 167, past the 168 of 3 CTAs per SM).
    // Tiles that fit keep the fully unrolled, always-rescaling, pack-per-k-step code.
    static constexpr bool kRegTight = kAccRegs > 160;
    static constexpr bool kLazyRescale = kRegTight;
    static constexpr bool kPackEarly = kRegTight;
    static constexpr int kQKUnroll = (kRegTight && !kQInRegs) ? 4 : kQKSteps;

    static_assert(kComputeWarps % kKeyGroups == 0, "compute warps must split evenly into key groups");
    static_assert(kBlockM % (16 * kRowGroups) == 0, "each row group must own a whole number of 16-row mma tiles");
    static_assert(kWarpKeys % 16 == 0, "each warp's share of a K/V tile must be a multiple of 16 keys");
    static_assert(kKeyGroups == 1 || kKVSplits == 1, "key groups and KV splits are not combined");
    static_assert(kKvLoad >= 0 && kKvLoad <= 2, "kv_load: 0 cp.async, 1 tma, 2 tma_split");
    static_assert(!kTmaLoad || (kProducerWarps == 0 && kSmemLayout == kSwizzled && kHeadDim == 64),
                  "TMA loads: no producer warps, the swizzled layout (TMA's 128-byte swizzle), head dim 64");
    static_assert(kKVCluster == 1 || kKVCluster == 2 || kKVCluster == 4, "kv_cluster: 1, 2 or 4 CTAs");
    static_assert(!kTmaMulticast || (kKvLoad == 1 && kKVSplits == 1),
                  "kv_cluster multicasts the plain TMA loads (kv_load = tma), without KV splits");
    static_assert(!kSplitMerge || (kKeyGroups > 1 && kDFrags % kKeyGroups == 0),
                  "key_merge = split: two or more key groups dividing the head dim's 8-column blocks");
    static_assert(kMFrags >= 1 && kMFrags <= 4, "1 to 4 mma row tiles per warp");
    static_assert(kQKSteps % kQKUnroll == 0, "Q K^T trips must cover the head dim evenly");
    static_assert(kBlockN % 16 == 0 && kBlockN <= 256, "BLOCK_N must be a multiple of 16 (ldmatrix.x4 covers 16 keys)");
    static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "head dim 64, 128 or 256");
    static_assert(kStages >= 1 && kStages <= 4, "1 to 4 pipeline stages");
    static_assert(kProducerWarps >= 0 && kProducerWarps <= 4, "0 to 4 producer warps");
    static_assert(kSmemLayout != kSwizzled || kChunksPerRow >= 8, "the XOR swizzle needs 8 chunks per row");
    static_assert(kStages <= static_cast<int>(NamedBarrier::kSlotEmpty) - static_cast<int>(NamedBarrier::kSlotFull),
                  "named barriers: one full and one empty id per K/V slot");
    static_assert(kKVSplits >= 1 && kKVSplits <= 16, "1 to 16 KV splits");
    // The device limits (threads and shared memory per CTA) are asserted by the instantiation against
    // evotune/limits.py, the one place they are written, together with the host's launch geometry.
};

// ---------------------------------------------------------------- the mma.sync product (the PTX wrappers: ptx.cuh)

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

// ldmatrix addressing. Each lane hands ldmatrix the address of one 16-byte chunk; the
// fragments of the other mma steps are the same lane's chunk moved by whole 8-row
// groups and by an even number of chunks. The swizzle XOR uses only (row & 7) and the
// chunk's low 3 bits, and a lane's own chunk bit (bit 0) never meets the even step, so
// a moved chunk is the lane's byte offset XOR-ed with a constant plus a constant: one
// register per operand and per lane, and at most one LOP3 per ldmatrix. Computing the
// row/chunk/XOR per fragment instead let the compiler keep every k-step's partial
// address live across Q K^T (7 registers at the d128 peak).
template <class T>
__device__ __forceinline__ u32 lane_offset(int row, int chunk) {
    return 2 * tile_offset<T>(row, chunk);
}
template <class T>
__device__ __forceinline__ u32 step_offset(u32 lane_off, int rows, int chunks) {
    // rows: a multiple of 8 (keeps row & 7); chunks: even (keeps the lane's chunk bit).
    const u32 row_bytes = 2 * rows * T::kRowPitch;
    if constexpr (T::kSmemLayout == kSwizzled) {
        return (lane_off ^ ((chunks & 7) << 4)) + ((chunks & ~7) << 4) + row_bytes;
    } else {
        return lane_off + (chunks << 4) + row_bytes;
    }
}

// Copy `ROWS` rows (starting at global row `row0`) of a [seq, HEAD_DIM] slab
// into a shared tile with 16-byte cp.async; rows at or past `seq_len` are zero-filled.
// Each thread keeps one chunk column and walks down the rows NTHREADS/kChunksPerRow at
// a time: the global source is a pointer bumped by a constant stride and the shared
// destination is one base plus compile-time offsets. Per-copy addresses computed from
// (tid + i*NTHREADS) are loop-invariant in the K/V loop and the compiler kept every one
// of them (64-bit sources included) in registers across it: one producer warp copying
// d128 64-key tiles (32 copies per thread per tensor) spilled 852 B at its 168-register cap.
template <class T, int ROWS, int NTHREADS>
__device__ __forceinline__ void load_tile_async(unsigned short* tile, const unsigned short* gbase, long long row_stride,
                                                int row0, int seq_len, int tid) {
    static_assert(NTHREADS % T::kChunksPerRow == 0, "loader threads must cover whole rows");
    constexpr int kRowsPerPass = NTHREADS / T::kChunksPerRow;
    constexpr int kPasses = (ROWS + kRowsPerPass - 1) / kRowsPerPass;
    // The swizzle pattern (row & 7) repeats every 8 rows, so when a pass advances by a
    // multiple of 8 rows the destination is the first pass's plus a constant.
    constexpr bool kConstStep = T::kSmemLayout != kSwizzled || kRowsPerPass % 8 == 0;
    const int chunk = tid % T::kChunksPerRow;
    const int row = tid / T::kChunksPerRow;
    const int rows_left = seq_len - row0 - row;  // pass i is in range iff i*kRowsPerPass < rows_left
    const u32 dst = smem_addr(tile + tile_offset<T>(row, chunk));
    const unsigned short* src = gbase + (long long)(row0 + row) * row_stride + chunk * 8;
#pragma unroll
    for (int i = 0; i < kPasses; ++i) {
        if (ROWS % kRowsPerPass == 0 || row + i * kRowsPerPass < ROWS) {
            const bool valid = i * kRowsPerPass < rows_left;
            const u32 dst_i = kConstStep ? dst + 2 * i * kRowsPerPass * T::kRowPitch
                                         : smem_addr(tile + tile_offset<T>(row + i * kRowsPerPass, chunk));
            // Clamp the source of a zero-filled copy to a valid address.
            cp_async_16(dst_i, valid ? src : gbase, valid);
        }
        src += kRowsPerPass * row_stride;
    }
}

// K and V tile `t` (keys t*BLOCK_N ...) into pipeline slot `slot`, by NTHREADS loader threads.
template <class T, int NTHREADS>
__device__ __forceinline__ void load_kv_tile(unsigned short* sK, unsigned short* sV, const unsigned short* gK,
                                             const unsigned short* gV, long long k_ss, long long v_ss, int slot, int t,
                                             int seq_k, int loader_tid) {
    // Opaque to the compiler: otherwise it strength-reduces row0 * stride into 64-bit
    // pointers stepped by BLOCK_N * stride, and those and their steps (8 registers for K
    // and V) live across the whole K/V loop; a few integer ops per tile are cheaper.
    int row0 = t * T::kBlockN;
    asm volatile("" : "+r"(row0));
    load_tile_async<T, T::kBlockN, NTHREADS>(sK + slot * T::kKVElems, gK, k_ss, row0, seq_k, loader_tid);
    load_tile_async<T, T::kBlockN, NTHREADS>(sV + slot * T::kKVElems, gV, v_ss, row0, seq_k, loader_tid);
}

// --------------------------------------------------------- warp-level math

// Lane byte offsets of the three ldmatrix.x4 patterns; `row0` is a multiple of 16.
// Q (A operand, 16x16): matrices rows 0-7 / 8-15 of chunk 0, then of chunk 1.
template <class T>
__device__ __forceinline__ u32 q_lane_offset(int row0, int lane) {
    return lane_offset<T>(row0 + (lane & 15), lane >> 4);
}
// K (B operands of two 8-key blocks): keys 0-7 chunk 0, keys 0-7 chunk 1, keys 8-15 chunk 0, 1.
template <class T>
__device__ __forceinline__ u32 k_lane_offset(int key0, int lane) {
    return lane_offset<T>(key0 + (lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1);
}
// V (B operands of two 8-column blocks, transposed): keys 0-7 / 8-15 of chunk 0, then of chunk 1.
template <class T>
__device__ __forceinline__ u32 v_lane_offset(int key0, int lane) {
    return lane_offset<T>(key0 + (lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4);
}

// Q fragments of 16-row tile mf for k-step kk (16 head-dim columns).
template <class T>
__device__ __forceinline__ void load_q_step(u32 (&qa)[4], u32 sQ, u32 q_lane, int mf, int kk) {
    ldmatrix_x4(qa, sQ + step_offset<T>(q_lane, mf * 16, kk * 2));
}

template <class T>
__device__ __forceinline__ void load_q_frags(u32 (&qf)[T::kMFrags][T::kQRegSteps][4], u32 sQ, u32 q_lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int kk = 0; kk < T::kQRegSteps; ++kk) load_q_step<T>(qf[mf][kk], sQ, q_lane, mf, kk);
}

// S = Q K^T for one K tile: each ldmatrix.x4 gives the B fragments of two 8-key blocks.
template <class T>
__device__ __forceinline__ void qk_tile(float (&s)[T::kMFrags][T::kNFrags][4], u32 (&qf)[T::kMFrags][T::kQRegSteps][4],
                                        u32 sQ, u32 q_lane, u32 sK, u32 k_lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int nf = 0; nf < T::kNFrags; ++nf)
#pragma unroll
            for (int i = 0; i < 4; ++i) s[mf][nf][i] = 0.f;
    // One trip unless register-tight (T::kQKUnroll); k0 is a multiple of kQKUnroll, so
    // the swizzle XOR of every unrolled step stays a compile-time constant.
#pragma unroll 1
    for (int k0 = 0; k0 < T::kQKSteps; k0 += T::kQKUnroll) {
#pragma unroll
        for (int j = 0; j < T::kQKUnroll; ++j) {
            const int kk = k0 + j;
            if constexpr (!T::kQInRegs) {
#pragma unroll
                for (int mf = 0; mf < T::kMFrags; ++mf) load_q_step<T>(qf[mf][0], sQ, q_lane, mf, kk);
            }
            const int qs = T::kQInRegs ? kk : 0;
#pragma unroll
            for (int np = 0; np < T::kNFrags / 2; ++np) {
                u32 b[4];
                ldmatrix_x4(b, sK + step_offset<T>(k_lane, np * 16, kk * 2));
#pragma unroll
                for (int mf = 0; mf < T::kMFrags; ++mf) {
                    mma_16816<T::kIsBf16>(s[mf][2 * np], qf[mf][qs], b[0], b[1]);
                    mma_16816<T::kIsBf16>(s[mf][2 * np + 1], qf[mf][qs], b[2], b[3]);
                }
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

// Online softmax on one tile of scores: update running max m and partial sums l
// (per thread, reduced across the quad only at the end), rescale O by
// alpha = exp2((m_old - m_new) * scale_log2) (register-tight tiles return alpha to
// rescale_o_lazy instead), and turn the scores into P = exp2(s*scale_log2 - m*scale_log2):
// in place in s, or, on register-tight tiles, straight into the packed A operands of
// P V (FA2's convert_type), so the fp32 P needs no register beyond the pack and the
// row sum. Either way the row sum adds the unrounded fp32 values in the same order.
template <class T>
__device__ __forceinline__ void online_softmax(float (&s)[T::kMFrags][T::kNFrags][4], float (&o)[T::kMFrags][T::kDFrags][4],
                                               float (&m)[T::kMFrags][2], float (&l)[T::kMFrags][2],
                                               float (&alpha)[T::kMFrags][2], u32 (&pa)[T::kMFrags][T::kPVSteps][4],
                                               float scale_log2) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // r = 0: row lane/4, r = 1: row lane/4 + 8
            float mx = m[mf][r];
#pragma unroll
            for (int nf = 0; nf < T::kNFrags; ++nf) mx = fmaxf(mx, fmaxf(s[mf][nf][2 * r], s[mf][nf][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            // A row whose keys so far are all masked (causal KV split, or a key group whose
            // share of the first tile is masked) keeps m = -inf; scaling by 0 then keeps p = 0
            // and alpha finite. Elsewhere every row sees a key in its first tile, so the guard
            // is compiled only where needed (T::kGuardEmptyRows).
            float m_scaled = mx * scale_log2;
            if constexpr (T::kGuardEmptyRows) m_scaled = mx == neg_inf() ? 0.f : m_scaled;
            alpha[mf][r] = fast_exp2(m[mf][r] * scale_log2 - m_scaled);  // 0 on the first tile (m = -inf)
            m[mf][r] = mx;
            float row_sum = 0.f;
#pragma unroll
            for (int nf = 0; nf < T::kNFrags; ++nf) {
                const float p0 = exp2_mixed<T>(2 * nf, fmaf(s[mf][nf][2 * r], scale_log2, -m_scaled));
                const float p1 = exp2_mixed<T>(2 * nf + 1, fmaf(s[mf][nf][2 * r + 1], scale_log2, -m_scaled));
                row_sum += p0 + p1;
                if constexpr (T::kPackEarly) {
                    // Row r of 8-key block nf: A-operand register r of k-step nf/2, +2 for the odd block.
                    pa[mf][nf / 2][(nf & 1) * 2 + r] = pack2<T::kIsBf16>(p0, p1);
                } else {
                    s[mf][nf][2 * r] = p0;
                    s[mf][nf][2 * r + 1] = p1;
                }
            }
            l[mf][r] = l[mf][r] * alpha[mf][r] + row_sum;
            if constexpr (!T::kLazyRescale) {
#pragma unroll
                for (int df = 0; df < T::kDFrags; ++df) {
                    o[mf][df][2 * r] *= alpha[mf][r];
                    o[mf][df][2 * r + 1] *= alpha[mf][r];
                }
            }
        }
}

// Register-tight tiles: O *= alpha after the softmax, skipped when no row max of the
// warp moved: alpha is then exactly 1 (ex2 of 0) for every row and each product would
// be o itself. The warp-uniform branch also closes the softmax's basic block, which
// keeps ptxas from overlapping P V with it (see AttnTraits::kRegTight).
template <class T>
__device__ __forceinline__ void rescale_o_lazy(float (&o)[T::kMFrags][T::kDFrags][4], const float (&alpha)[T::kMFrags][2]) {
    bool moved = false;
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf) moved = moved || alpha[mf][0] != 1.f || alpha[mf][1] != 1.f;
    if (!__any_sync(0xffffffffu, moved)) return;
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int df = 0; df < T::kDFrags; ++df)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[mf][df][i] *= alpha[mf][i >> 1];
}

// O += P V, with V's B fragments from ldmatrix.trans. P's accumulator layout of two
// adjacent 8-key blocks is exactly the A-operand layout of one 16-key k-step, so P
// never leaves registers: packed here per k-step from p, or already packed in pa
// (T::kPackEarly; p is then unused).
template <class T>
__device__ __forceinline__ void pv_tile(float (&o)[T::kMFrags][T::kDFrags][4], const float (&p)[T::kMFrags][T::kNFrags][4],
                                        const u32 (&pa)[T::kMFrags][T::kPVSteps][4], u32 sV, u32 v_lane) {
#pragma unroll
    for (int kk = 0; kk < T::kPVSteps; ++kk) {
        u32 a[T::kMFrags][4];
#pragma unroll
        for (int mf = 0; mf < T::kMFrags; ++mf) {
            if constexpr (T::kPackEarly) {
#pragma unroll
                for (int i = 0; i < 4; ++i) a[mf][i] = pa[mf][kk][i];
            } else {
                a[mf][0] = pack2<T::kIsBf16>(p[mf][2 * kk][0], p[mf][2 * kk][1]);
                a[mf][1] = pack2<T::kIsBf16>(p[mf][2 * kk][2], p[mf][2 * kk][3]);
                a[mf][2] = pack2<T::kIsBf16>(p[mf][2 * kk + 1][0], p[mf][2 * kk + 1][1]);
                a[mf][3] = pack2<T::kIsBf16>(p[mf][2 * kk + 1][2], p[mf][2 * kk + 1][3]);
            }
        }
#pragma unroll
        for (int dp = 0; dp < T::kDFrags / 2; ++dp) {
            u32 b[4];
            ldmatrix_x4_trans(b, sV + step_offset<T>(v_lane, kk * 16, dp * 2));
#pragma unroll
            for (int mf = 0; mf < T::kMFrags; ++mf) {
                mma_16816<T::kIsBf16>(o[mf][2 * dp], a[mf], b[0], b[1]);
                mma_16816<T::kIsBf16>(o[mf][2 * dp + 1], a[mf], b[2], b[3]);
            }
        }
    }
}

// Row sums reduced across the quad; 0 for a row that saw no unmasked key.
template <class T>
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

// Training: the natural-log row log-sum-exp of the scaled scores, ln(sum_j exp(scale * s_ij)), for
// PyTorch's attention backward (its flash and efficient kernels recompute P from Q, K and this).
// Only instantiations that ask for it (attention_fwd<T, true>) contain this code. `l` is the
// per-lane partial sum unless L_REDUCED; m is quad-uniform (online_softmax reduces it).
template <class T, bool L_REDUCED = false>
__device__ __forceinline__ void store_lse(const float (&m)[T::kMFrags][2], const float (&l)[T::kMFrags][2], float* gL,
                                          int q_row0, int warp_row0, int seq_q, float scale_log2, int lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float sum = L_REDUCED ? l[mf][r] : quad_sum<T>(l[mf][r]);
            const int q = q_row0 + warp_row0 + mf * 16 + (lane >> 2) + 8 * r;
            if ((lane & 3) == 0 && q < seq_q) gL[q] = lse_from_log2(m[mf][r] * scale_log2, sum);
        }
}

// Normalise O by the row sums, stage this warp's rows in its own slice of the
// Q tile (only this warp ever reads that slice, and it is done with Q), then
// write them to global memory with 16-byte stores.
template <class T, bool L_REDUCED = false>
__device__ __forceinline__ void store_o(float (&o)[T::kMFrags][T::kDFrags][4], float (&l)[T::kMFrags][2], unsigned short* sO,
                                        unsigned short* gO, long long row_stride, int q_row0, int warp_row0, int seq_q, int lane) {
    // Other lanes of this warp may still be reading these rows as Q (ldmatrix); under
    // independent thread scheduling only a warp barrier orders that before our writes
    // (racecheck reported the hazard on causal shapes without it).
    __syncwarp();
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float inv = 1.f / (L_REDUCED ? l[mf][r] : quad_sum<T>(l[mf][r]));
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

// Split-KV: write this CTA's normalised partial O (fp32) and per-row log2-sum-exp
// to its workspace slice. A row with no unmasked key in this split gets lse = -inf.
template <class T>
__device__ __forceinline__ void store_partial(float (&o)[T::kMFrags][T::kDFrags][4], float (&m)[T::kMFrags][2],
                                              float (&l)[T::kMFrags][2], float* wo, float* wlse, int warp_row0,
                                              float scale_log2, int lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float sum = quad_sum<T>(l[mf][r]);
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            const int row = warp_row0 + mf * 16 + (lane >> 2) + 8 * r;
            if ((lane & 3) == 0) wlse[row] = sum > 0.f ? m[mf][r] * scale_log2 + __log2f(sum) : neg_inf();
#pragma unroll
            for (int df = 0; df < T::kDFrags; ++df) {
                const int col = df * 8 + 2 * (lane & 3);
                *reinterpret_cast<float2*>(wo + row * T::kHeadDim + col) =
                    make_float2(o[mf][df][2 * r] * inv, o[mf][df][2 * r + 1] * inv);
            }
        }
}

// Split-KV: merge the KV_SPLITS partials of one query tile, weighting each by
// 2^(lse_s - max lse), and write O. Run by the compute threads of the last CTA.
template <class T, bool WRITE_LSE>
__device__ __forceinline__ void combine_partials(const float* wo, const float* wlse, unsigned short* gO,
                                                 long long row_stride, int q_row0, int seq_q, int tid, float* gL) {
    constexpr int kSliceO = T::kBlockM * T::kHeadDim;
    constexpr int kQuads = T::kHeadDim / 4;
    for (int idx = tid; idx < T::kBlockM * kQuads; idx += T::kComputeThreads) {
        const int row = idx / kQuads;
        const int col = (idx % kQuads) * 4;
        if (q_row0 + row >= seq_q) continue;
        float lse_max = neg_inf();
#pragma unroll
        for (int s = 0; s < T::kKVSplits; ++s) lse_max = fmaxf(lse_max, __ldcg(wlse + s * T::kBlockM + row));
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        float wsum = 0.f;
#pragma unroll
        for (int s = 0; s < T::kKVSplits; ++s) {
            const float w = fast_exp2(__ldcg(wlse + s * T::kBlockM + row) - lse_max);  // 0 for an empty split
            const float4 p = __ldcg(reinterpret_cast<const float4*>(wo + s * kSliceO + row * T::kHeadDim + col));
            acc.x += w * p.x; acc.y += w * p.y; acc.z += w * p.z; acc.w += w * p.w;
            wsum += w;
        }
        const float inv = 1.f / wsum;
        if constexpr (WRITE_LSE) {
            if (col == 0) gL[q_row0 + row] = lse_from_log2(lse_max, wsum);
        }
        uint2 packed;
        packed.x = pack2<T::kIsBf16>(acc.x * inv, acc.y * inv);
        packed.y = pack2<T::kIsBf16>(acc.z * inv, acc.w * inv);
        *reinterpret_cast<uint2*>(gO + (long long)(q_row0 + row) * row_stride + col) = packed;
    }
}

// Key groups: a warp other than its row group's first writes its unnormalised O, running
// max and quad-reduced sum to its merge slot.
template <class T>
__device__ __forceinline__ void write_key_group_partial(const float (&o)[T::kMFrags][T::kDFrags][4], const float (&m)[T::kMFrags][2],
                                                        const float (&l)[T::kMFrags][2], float* slot, int warp_row0, int lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row0 + mf * 16 + (lane >> 2) + 8 * r;
            const float sum = quad_sum<T>(l[mf][r]);
            if ((lane & 3) == 0) {
                slot[T::kBlockM * T::kHeadDim + row] = m[mf][r];
                slot[T::kBlockM * (T::kHeadDim + 1) + row] = sum;
            }
#pragma unroll
            for (int df = 0; df < T::kDFrags; ++df) {
                const int col = df * 8 + 2 * (lane & 3);
                *reinterpret_cast<float2*>(slot + row * T::kHeadDim + col) = make_float2(o[mf][df][2 * r], o[mf][df][2 * r + 1]);
            }
        }
}

// Key groups: the row group's first warp folds the other warps' partials into its own
// accumulators; afterwards `l` holds the full (quad-reduced) row sums and `m` the row maxima.
template <class T>
__device__ __forceinline__ void merge_key_groups(float (&o)[T::kMFrags][T::kDFrags][4], float (&m)[T::kMFrags][2],
                                                 float (&l)[T::kMFrags][2], const float* slots, int warp_row0,
                                                 float scale_log2, int lane) {
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row0 + mf * 16 + (lane >> 2) + 8 * r;
            // Row max over all groups; the first group always holds key 0, so it is finite.
            float mx = m[mf][r];
#pragma unroll
            for (int g = 1; g < T::kKeyGroups; ++g)
                mx = fmaxf(mx, slots[(g - 1) * T::kMergeSlotFloats + T::kBlockM * T::kHeadDim + row]);
            const float w0 = fast_exp2((m[mf][r] - mx) * scale_log2);
            float sum = quad_sum<T>(l[mf][r]) * w0;
#pragma unroll
            for (int df = 0; df < T::kDFrags; ++df) {
                o[mf][df][2 * r] *= w0;
                o[mf][df][2 * r + 1] *= w0;
            }
#pragma unroll
            for (int g = 1; g < T::kKeyGroups; ++g) {
                const float* slot = slots + (g - 1) * T::kMergeSlotFloats;
                const float w = fast_exp2((slot[T::kBlockM * T::kHeadDim + row] - mx) * scale_log2);  // 0 if that group saw no key
                sum += w * slot[T::kBlockM * (T::kHeadDim + 1) + row];
#pragma unroll
                for (int df = 0; df < T::kDFrags; ++df) {
                    const int col = df * 8 + 2 * (lane & 3);
                    const float2 p = *reinterpret_cast<const float2*>(slot + row * T::kHeadDim + col);
                    o[mf][df][2 * r] += w * p.x;
                    o[mf][df][2 * r + 1] += w * p.y;
                }
            }
            l[mf][r] = sum;
            m[mf][r] = mx;
        }
}

// Synchronise the compute warps only (producer warps may have exited).
template <class T>
__device__ __forceinline__ void compute_sync() {
    if constexpr (T::kHasProducers) named_bar_sync(NamedBarrier::kComputeWarps, 0, T::kComputeThreads);
    else __syncthreads();
}

#include "attention_split_merge.cuh"

#include "attention_tma_load.cuh"
#include "attention_tma_multicast.cuh"
#include "attention_tma_split.cuh"

// ------------------------------------------------------------------ kernel

// Grouped-query attention: the K/V head that query head `head` reads, head / group, where the launch
// passes kv_magic = ceil(2^32 / group) for a group of 2 or more query heads per K/V head and 0 for none
// (then the K/V head is the query head, the code path of every ungrouped shape). A multiply-high, not a
// division: exact for head < 2^16 (shapes.MAX_DIMS) and cheap enough for the compiler to recompute
// rather than hold; `head / kv_group` cost up to 16 registers on mma.sync (attention-small.yaml on
// mission, 32x32 tiles of 2 warps: 80 -> 96), this costs none.
__device__ __forceinline__ int kv_head_of(int head, unsigned kv_magic) {
    return kv_magic ? static_cast<int>(__umulhi(static_cast<unsigned>(head), kv_magic)) : head;
}

// Strides are in elements: *_sb batch, *_sh head, *_ss sequence (the head-dim stride is 1).
// kv_magic: grouped-query attention, query head h reads K/V head h / group (kv_head_of; 0 without
// grouping), so K and V hold heads / group heads and are never copied per query head. A shape, not a
// tile knob, hence a launch argument: one cubin serves every group size.
// Split-KV workspace (KV_SPLITS > 1 only; null otherwise), per (batch, head, query tile):
//   ws_o   [KV_SPLITS][BLOCK_M][HEAD_DIM] fp32 partial outputs
//   ws_lse [KV_SPLITS][BLOCK_M]           fp32 log2-sum-exp of the scaled scores
//   ws_count                              int, zero before a launch; the kernel leaves it zero
// WRITE_LSE (training, not a knob): also write each query row's natural-log log-sum-exp, fp32, to
// lse[batch * lse_sb + head * lse_sh + row]; otherwise lse is unused and no code reads it.
template <class T, bool WRITE_LSE = false>
__device__ __forceinline__ void attention_fwd(const unsigned short* __restrict__ q, const unsigned short* __restrict__ k,
                                              const unsigned short* __restrict__ v, unsigned short* __restrict__ o,
                                              long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh,
                                              long long k_ss, long long v_sb, long long v_sh, long long v_ss, long long o_sb,
                                              long long o_sh, long long o_ss, int seq_q, int seq_k, float scale_log2,
                                              float* __restrict__ ws_o, float* __restrict__ ws_lse, int* __restrict__ ws_count,
                                              // kv_load = tma or tma_split only (else null):
                                              const CUtensorMap* q_map, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                              unsigned kv_magic, float* __restrict__ lse = nullptr, long long lse_sb = 0,
                                              long long lse_sh = 0) {
    //[trace] // Phase trace (tools/phase_trace.py, docs/TRACE.md): the entry stamps, held until the recorder below
    //[trace] // (made after the prologue and the pdl wait) stores them.
    //[trace] const u64 trace_entry_gt = trace_globaltimer(), trace_entry_clk = trace_clock64();
    extern __shared__ __align__(128) unsigned char smem_raw[];
    unsigned short* sQ = reinterpret_cast<unsigned short*>(smem_raw);
    if constexpr (T::kTmaSplit)
        sQ = tma_split_aligned_tiles<T>(smem_raw);  // kv_load = tma_split (attention_tma_split.cuh): 2 barriers a slot
    else if constexpr (T::kTmaLoad)
        sQ = tma_aligned_tiles<T>(smem_raw);  // kv_load = tma (attention_tma_load.cuh): tiles on the swizzle atom
    unsigned short* sK = sQ + T::kQElems;
    unsigned short* sV = sK + T::kStages * T::kKVElems;

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int m_tile = blockIdx.x;
    const int q_row0 = m_tile * T::kBlockM;
    const int head = blockIdx.y;
    const int batch = blockIdx.z / T::kKVSplits;
    const int split = blockIdx.z % T::kKVSplits;
    const unsigned short* gQ = q + batch * q_sb + head * q_sh;
    const int kv_head = kv_head_of(head, kv_magic);  // the split-KV workspace and O stay per query head
    const unsigned short* gK = k + batch * k_sb + kv_head * k_sh;
    const unsigned short* gV = v + batch * v_sb + kv_head * v_sh;
    unsigned short* gO = o + batch * o_sb + head * o_sh;
    float* gL = WRITE_LSE ? lse + batch * lse_sb + head * lse_sh : nullptr;

    // Causal: tiles wholly after this CTA's last query row contribute nothing; skip them.
    int kv_end = seq_k;
    if constexpr (T::kIsCausal) kv_end = min(seq_k, q_row0 + T::kBlockM);
    // kv_cluster: this CTA's tiles; a causal cluster's may be more
    const int own_tiles = (kv_end + T::kBlockN - 1) / T::kBlockN;
    if constexpr (T::kTmaMulticast && T::kIsCausal) kv_end = min(seq_k, tma_cluster_row_end<T>(q_row0));  // the cluster's
    const int n_tiles_all = (kv_end + T::kBlockN - 1) / T::kBlockN;
    // This CTA's share of the K/V tiles: [t_begin, t_begin + n_tiles); may be empty in a split.
    // Without splits both are written plainly: with t_begin = min(0, ...) the compiler could
    // no longer split off the masked last tile, and the mission winner lost 27% on the H100.
    int t_begin = 0, n_tiles = n_tiles_all;
    if constexpr (T::kKVSplits > 1) {
        const int per_split = (n_tiles_all + T::kKVSplits - 1) / T::kKVSplits;
        t_begin = min(split * per_split, n_tiles_all);
        n_tiles = min(n_tiles_all - t_begin, per_split);
    }
    const u32 tma_bars = smem_addr(smem_raw);  // TMA: slot s's "full" barrier at + 8 s: its K and V (step 0: and Q) arrived
    if constexpr (T::kTmaMulticast)
        tma_mc_init<T>(tma_bars, q_map, k_map, v_map);  // kv_cluster (attention_tma_multicast.cuh): + a cluster barrier
    else if constexpr (T::kTmaSplit)
        tma_split_init<T>(tma_bars, q_map, k_map, v_map);  // kv_load = tma_split: K's and V's barriers
    else if constexpr (T::kTmaLoad)
        tma_load_init<T>(tma_bars, q_map, k_map, v_map);
    // Everything above is index arithmetic. Every global access of this CTA follows, in every thread: the
    // cp.async loads of Q, K and V, the stores of O (and the log-sum-exp), the split-KV workspace and its
    // arrival counter. So each one sees the previous grid's writes complete and cannot overwrite what that
    // grid still reads. Then the next PDL-launched grid may begin launching while this one runs.
    if constexpr (T::kPdl) {
        pdl_wait();
        pdl_launch_dependents();
    }
    //[trace] const TraceWarp tracer(trace_entry_gt, trace_entry_clk, n_tiles);  // stamps entry and start; exit when it ends

    if constexpr (T::kHasProducers) {
        // Named barrier ids: FULL[s] = 1 + s (producers arrive, consumers wait),
        // EMPTY[s] = 1 + STAGES + s (consumers arrive, producers wait). Pipeline
        // step i holds tile t_begin + i in slot i % STAGES.
        if (warp >= T::kComputeWarps) {
            const int ptid = tid - T::kComputeThreads;
            load_tile_async<T, T::kBlockM, T::kProducerThreads>(sQ, gQ, q_ss, q_row0, seq_q, ptid);
#pragma unroll
            for (int s = 0; s < T::kStages - 1; ++s) {
                if (s < n_tiles) load_kv_tile<T, T::kProducerThreads>(sK, sV, gK, gV, k_ss, v_ss, s, t_begin + s, seq_k, ptid);
                cp_async_commit();  // Q joins tile 0's group
            }
            for (int i = 0; i < n_tiles; ++i) {
                const int next = i + T::kStages - 1;
                if (next < n_tiles) {
                    // Slot of `next` last held step i-1: wait until the consumers released it.
                    if (i >= 1) named_bar_sync(NamedBarrier::kSlotEmpty, (i - 1) % T::kStages, T::kThreads);
                    load_kv_tile<T, T::kProducerThreads>(sK, sV, gK, gV, k_ss, v_ss, next % T::kStages, t_begin + next,
                                                         seq_k, thread_id() - T::kComputeThreads);
                }
                cp_async_commit();  // empty groups keep the wait count uniform
                cp_async_wait<T::kStages - 1>();
                named_bar_arrive(NamedBarrier::kSlotFull, i % T::kStages, T::kThreads);
            }
            return;
        }
    } else {
        if constexpr (T::kTmaMulticast) {
            tma_mc_first<T>(tma_bars, smem_addr(sQ), smem_addr(sK), smem_addr(sV), q_map, k_map, v_map, q_row0, head,
                            kv_head, batch, t_begin, n_tiles);
        } else if constexpr (T::kTmaSplit) {
            tma_split_first<T>(tma_bars, smem_addr(sQ), smem_addr(sK), smem_addr(sV), q_map, k_map, v_map, q_row0, head,
                               kv_head, batch, t_begin, n_tiles);
        } else if constexpr (T::kTmaLoad) {
            tma_load_first<T>(tma_bars, smem_addr(sQ), smem_addr(sK), smem_addr(sV), q_map, k_map, v_map, q_row0, head,
                              kv_head, batch, t_begin, n_tiles);
        } else {
            load_tile_async<T, T::kBlockM, T::kComputeThreads>(sQ, gQ, q_ss, q_row0, seq_q, tid);
            cp_async_commit();
#pragma unroll
            for (int s = 0; s < T::kStages - 1; ++s) {
                if (s < n_tiles) load_kv_tile<T, T::kComputeThreads>(sK, sV, gK, gV, k_ss, v_ss, s, t_begin + s, seq_k, tid);
                cp_async_commit();
            }
        }
    }

    // ---- compute warps
    const int key_group = warp % T::kKeyGroups;
    const int warp_row0 = (warp / T::kKeyGroups) * T::kRowsPerWarp;
    const int warp_key0 = key_group * T::kWarpKeys;  // this warp's keys within each tile
    const u32 sQ_addr = smem_addr(sQ);
    const u32 sK_addr = smem_addr(sK);  // V slots follow the STAGES K slots
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

    for (int i = 0; i < n_tiles; ++i) {
        const int slot = i % T::kStages;
        // ---- wait for step i (and, at i = 0, for Q)
        if constexpr (T::kTmaLoad) {
            if constexpr (T::kTmaSplit) tma_split_wait_k<T>(tma_bars, i);  // K (step 0: and Q); V before P V
            else tma_wait_tile<T>(tma_bars, i);
            //[trace_tma] tracer.mark_tile(i, trace::kWait);
            if constexpr (T::kTmaMulticast) {
                if (i >= own_tiles) {  // a causal cluster's tile past this CTA's last row: loaded for the others
                    tma_mc_refill<T>(tma_bars, smem_addr(sK), smem_addr(sV), k_map, v_map, i, t_begin, n_tiles, kv_head,
                                     batch);
                    continue;
                }
            }
        } else {
            if constexpr (T::kHasProducers) {
                named_bar_sync(NamedBarrier::kSlotFull, slot, T::kThreads);
                //[trace] tracer.mark_tile(i, trace::kWait);
            } else if constexpr (T::kStages == 1) {
                // One slot: everyone must be done with step i-1 before it is overwritten.
                if (i > 0) __syncthreads();
                load_kv_tile<T, T::kComputeThreads>(sK, sV, gK, gV, k_ss, v_ss, 0, t_begin + i, seq_k, thread_id());
                cp_async_commit();
                cp_async_wait<0>();
                __syncthreads();
                //[trace] tracer.mark_tile(i, trace::kWait);
            } else {
                cp_async_wait<T::kStages - 2>();
                // After this barrier step i is visible to all, and every warp has
                // finished step i-1, so its slot can take step i + STAGES - 1.
                __syncthreads();
                //[trace] tracer.mark_tile(i, trace::kWait);
                const int next = i + T::kStages - 1;
                if (next < n_tiles)
                    load_kv_tile<T, T::kComputeThreads>(sK, sV, gK, gV, k_ss, v_ss, next % T::kStages, t_begin + next, seq_k,
                                                        thread_id());
                cp_async_commit();
            }
        }
        //[trace] tracer.mark_tile(i, trace::kReady);  // the freed slot's refill issued (where this warp issues one)
        // This lane's ldmatrix offsets, from a lane id re-read every tile (as the loaders
        // re-read the thread id above): a few integer ops per tile instead of registers held
        // across the loop. Held, they (up to ten XOR variants of them) and the loader offsets
        // were what ptxas spilled when it squeezed a tile to the next occupancy step, e.g.
        // mission 32x128 key groups: 128 registers and 8 B of spill; re-read: 128 and none.
        // Key groups read their keys of a tile through these offsets: warp_key0 is a
        // multiple of 16, so the swizzle (row & 7) is unchanged.
        const int lane_t = lane_id();
        const u32 q_lane = q_lane_offset<T>(warp_row0, lane_t);
        const u32 k_lane = k_lane_offset<T>(warp_key0, lane_t);
        const u32 v_lane = v_lane_offset<T>(warp_key0, lane_t);
        if (T::kQInRegs && i == 0) load_q_frags<T>(qf, sQ_addr, q_lane);
        //[trace] if constexpr (T::kQInRegs) { if (i == 0) tracer.mark_after(trace::kQ, qf[T::kMFrags - 1][T::kQRegSteps - 1][3]); }
        //[trace] else if (i == 0) tracer.mark(trace::kQ);  // Q arrived with tile 0 (same cp.async wait); read per k-step

        const int kv0 = (t_begin + i) * T::kBlockN + warp_key0;
        qk_tile<T>(s_acc, qf, sQ_addr, q_lane, sK_addr + slot * (2 * T::kKVElems), k_lane);
        //[trace] tracer.mark_tile_after(i, trace::kQK, s_acc[T::kMFrags - 1][T::kNFrags - 1][3]);
        bool need_mask = kv0 + T::kWarpKeys > seq_k;
        if constexpr (T::kIsCausal) need_mask = need_mask || kv0 + T::kWarpKeys - 1 > q_row0 + warp_row0;
        if (need_mask) mask_tile<T>(s_acc, q_row0 + warp_row0, kv0, seq_k, lane);
        u32 p_a[T::kMFrags][T::kPVSteps][4];
        float alpha[T::kMFrags][2];
        online_softmax<T>(s_acc, o_acc, m_run, l_run, alpha, p_a, scale_log2);
        if constexpr (T::kLazyRescale) rescale_o_lazy<T>(o_acc, alpha);
        //[trace] tracer.mark_tile_after(i, trace::kSoftmax, l_run[T::kMFrags - 1][1]);  // masking included
        if constexpr (T::kTmaSplit) tma_split_wait_v<T>(tma_bars, i);
        pv_tile<T>(o_acc, s_acc, p_a, sK_addr + (T::kStages + slot) * (2 * T::kKVElems), v_lane);
        //[trace] tracer.mark_tile_after(i, trace::kPV, o_acc[T::kMFrags - 1][T::kDFrags - 1][3]);

        if constexpr (T::kHasProducers) {
            if (i + T::kStages < n_tiles) named_bar_arrive(NamedBarrier::kSlotEmpty, slot, T::kThreads);
        }
        if constexpr (T::kTmaMulticast)
            tma_mc_refill<T>(tma_bars, smem_addr(sK), smem_addr(sV), k_map, v_map, i, t_begin, n_tiles, kv_head, batch);
        else if constexpr (T::kTmaSplit)
            tma_split_refill<T>(tma_bars, smem_addr(sK), smem_addr(sV), k_map, v_map, i, t_begin, n_tiles, kv_head, batch);
        else if constexpr (T::kTmaLoad)
            tma_refill<T>(tma_bars, smem_addr(sK), smem_addr(sV), k_map, v_map, i, t_begin, n_tiles, kv_head, batch);
    }
    if constexpr (T::kTmaMulticast) tma_mc_loads_landed();  // every part multicast to this CTA has landed: arrive (exit waits)

    if constexpr (T::kKeyGroups > 1) {
        float* slots = reinterpret_cast<float*>(sV + T::kStages * T::kKVElems);
        if constexpr (T::kSplitMerge) {
            // key_merge = split (kernels/attention_split_merge.cuh): each key group merges and stores its 1/G of
            // the head dim.
            write_split_partial<T>(o_acc, m_run, l_run, slots, key_group, warp_row0, lane);
            compute_sync<T>();
            //[trace_split] tracer.mark(trace::kSync);  // every key group's published columns are in shared memory
            merge_split<T>(o_acc, m_run, l_run, slots, key_group, warp_row0, scale_log2, lane);
            //[trace_split] tracer.mark_after(trace::kMerge, split_last_merged<T>(o_acc, key_group));
            if constexpr (WRITE_LSE) {
                if (key_group == 0) store_lse<T, true>(m_run, l_run, gL, q_row0, warp_row0, seq_q, scale_log2, lane);
            }
            store_o_split<T>(o_acc, l_run, sQ, gO, o_ss, q_row0, warp_row0, seq_q, key_group, lane);
            //[trace_split] tracer.mark(trace::kStore);  // this warp's stores issued
        } else {
            if (key_group > 0)
                write_key_group_partial<T>(o_acc, m_run, l_run, slots + (key_group - 1) * T::kMergeSlotFloats, warp_row0,
                                           lane);
            compute_sync<T>();
            //[trace] tracer.mark(trace::kSync);  // every key group's partial is in shared memory
            if (key_group > 0) return;
            merge_key_groups<T>(o_acc, m_run, l_run, slots, warp_row0, scale_log2, lane);
            //[trace] tracer.mark_after(trace::kMerge, o_acc[T::kMFrags - 1][T::kDFrags - 1][3]);
            if constexpr (WRITE_LSE) store_lse<T, true>(m_run, l_run, gL, q_row0, warp_row0, seq_q, scale_log2, lane);
            store_o<T, true>(o_acc, l_run, sQ, gO, o_ss, q_row0, warp_row0, seq_q, lane);
            //[trace] tracer.mark(trace::kStore);  // the stores issued
        }
    } else if constexpr (T::kKVSplits == 1) {
        if constexpr (WRITE_LSE) store_lse<T>(m_run, l_run, gL, q_row0, warp_row0, seq_q, scale_log2, lane);
        store_o<T>(o_acc, l_run, sQ, gO, o_ss, q_row0, warp_row0, seq_q, lane);
        //[trace] tracer.mark(trace::kStore);  // the stores issued
    } else {
        const long long tile_index = ((long long)(batch * gridDim.y + head)) * gridDim.x + m_tile;
        float* wo = ws_o + tile_index * (T::kKVSplits * T::kBlockM * T::kHeadDim);
        float* wlse = ws_lse + tile_index * (T::kKVSplits * T::kBlockM);
        store_partial<T>(o_acc, m_run, l_run, wo + split * (T::kBlockM * T::kHeadDim), wlse + split * T::kBlockM,
                         warp_row0, scale_log2, lane);
        // Publish the partial, then count arrivals: the CTA that brings the count to
        // KV_SPLITS sees every other partial (threadfence-reduction pattern).
        __threadfence();
        compute_sync<T>();
        __shared__ int is_last;
        if (tid == 0) {
            const int arrived = atomicAdd(ws_count + tile_index, 1);
            is_last = arrived == T::kKVSplits - 1;
            if (is_last) ws_count[tile_index] = 0;  // ready for the next launch
        }
        compute_sync<T>();
        //[trace] tracer.mark(trace::kSync);  // this split's partial published and counted
        if (!is_last) return;
        __threadfence();
        combine_partials<T, WRITE_LSE>(wo, wlse, gO, o_ss, q_row0, seq_q, tid, gL);
        //[trace] tracer.mark(trace::kStore);  // the last split's combined O stores issued
    }
    if constexpr (T::kTmaMulticast) tma_mc_exit_wait();  // no CTA of the cluster exits while a part it multicast is in flight
}

// The Hopper variant (mma = wgmma): sm_90a only, instantiated only by configs that ask for it.
#include "attention_hopper.cuh"

}  // namespace evotune
