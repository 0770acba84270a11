// evotune: decode-shaped attention, O = softmax(scale * Q K^T + mask) V for a few queries over a KV cache.
//
// Sq (1 to 16) query rows per query head over Sk keys, grouped-query attention (Hq query heads, Hkv K/V
// heads), fp16 or bf16 in and out, fp32 math, exp2 with scale*log2(e) folded into Q. Decode reads each K/V
// element once and does ~4 * rows FLOPs per byte: it is bound by HBM bandwidth, so the work is shaped to keep
// K/V streaming, not to use tensor cores.
//
//   * PackGQA: one CTA serves the GROUP = Hq / Hkv query heads of one K/V head times the Sq queries: ROWS =
//     GROUP * SEQ_Q rows share each K/V load (row r is query head kvh * GROUP + r / SEQ_Q, query r % SEQ_Q).
//   * Split-KV: the grid is (SPLITS, Hkv, B); CTA `split` takes one chunk of the keys (a multiple of BLOCK_N
//     keys), writes its partial (unnormalized O, row max, row sum) to an fp32 workspace, and the last CTA of a
//     (batch, K/V head) to finish -- an atomic counter, which that CTA re-zeroes -- combines the SPLITS partials
//     and writes O. SPLITS = 1 writes O directly and takes no workspace.
//   * Inside a CTA, a warp's lanes form key groups of LANES_PER_KEY = HEAD_DIM / VEC lanes: each lane holds
//     VEC elements of a key's row (a 4- or 16-byte vector), the group's partial dot products meet through xor
//     shuffles, and each group keeps its own running (max, sum, O slice) over the keys it is given. Key u of a
//     group in a tile is tile_start + u * GROUPS + group, so a warp's groups read adjacent rows (coalesced).
//   * K/V tiles go global -> shared through a STAGES-deep cp.async ring. Each lane copies exactly the bytes it
//     reads back, so the ring needs cp.async.wait_group only, no barrier: STAGES - 1 tiles stay in flight while
//     one is computed. The ring's memory is reused for the CTA's merge of its groups.
//   * Causal (bottom-right aligned, as a KV cache's): query i sees keys 0 .. Sk - Sq + i.
//
// Knobs (compile time, search_spaces/attention-decode.yaml):
//   WARPS     warps per CTA
//   VEC       elements per vector access (4 or 8: 8 or 16 bytes); LANES_PER_KEY = HEAD_DIM / VEC
//   UNROLL    keys each key group takes per tile (BLOCK_N = WARPS * (32 / LANES_PER_KEY) * UNROLL)
//   STAGES    cp.async ring depth (1: copy, wait, compute)
//   SPLITS    CTAs per (batch, K/V head) along the keys
// Problem traits: HEAD_DIM, GROUP, SEQ_Q, IS_BF16, CAUSAL.
//
// This file compiles standalone with NVRTC or nvcc; evotune appends one explicit instantiation (extern "C"
// entry point) per configuration.

namespace evotune {

template <int BYTES> struct DecodeWord;
template <> struct DecodeWord<8> { typedef uint2 T; };
template <> struct DecodeWord<16> { typedef uint4 T; };

template <int HEAD_DIM_, int GROUP_, int SEQ_Q_, int WARPS_, int VEC_, int UNROLL_, int STAGES_, int SPLITS_,
          bool IS_BF16_, bool CAUSAL_>
struct DecodeTraits {
    static constexpr int kHeadDim = HEAD_DIM_;
    static constexpr int kGroup = GROUP_;
    static constexpr int kSeqQ = SEQ_Q_;
    static constexpr int kWarps = WARPS_;
    static constexpr int kVec = VEC_;
    static constexpr int kUnroll = UNROLL_;
    static constexpr int kStages = STAGES_;
    static constexpr int kSplits = SPLITS_;
    static constexpr bool kIsBf16 = IS_BF16_;
    // Sq = 1 has nothing to mask: its one query sees every key.
    static constexpr bool kCausal = CAUSAL_ && SEQ_Q_ > 1;

    static constexpr int kRows = kGroup * kSeqQ;
    static constexpr int kThreads = 32 * kWarps;
    // A key's row spans a power-of-two group of lanes (the dot product's xor reduction stays inside it): head dim 96
    // takes the lanes of 128 columns, those past 96 idle (kPadded: they copy nothing, read zeros, store nothing), so
    // the shared-memory rows keep the head dim's pitch.
    static constexpr int kLaneDim = kHeadDim == 96 ? 128 : kHeadDim;
    static constexpr bool kPadded = kLaneDim != kHeadDim;
    static constexpr int kLanesPerKey = kLaneDim / kVec;
    static constexpr int kGroupsPerWarp = 32 / kLanesPerKey;
    static constexpr int kGroups = kWarps * kGroupsPerWarp;   // key groups per CTA
    static constexpr int kBlockN = kGroups * kUnroll;           // keys per tile
    static constexpr int kVecBytes = 2 * kVec;
    static constexpr int kTileBytes = kBlockN * kHeadDim * 2;   // one tile of K (or V)
    static constexpr int kRingBytes = kStages * 2 * kTileBytes;
    // The merge of the CTA's groups: each group's row max and sum, then its O slice of every row.
    static constexpr int kMergeBytes = kGroups * kRows * (2 + kHeadDim) * 4;
    static constexpr int kSmemBytes = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
    typedef typename DecodeWord<kVecBytes>::T Word;

    static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 256, "HEAD_DIM is 64, 96, 128 or 256");
    static_assert(kVec == 4 || kVec == 8, "VEC is 4 or 8 elements (one 8- or 16-byte cp.async)");
    static_assert(kLanesPerKey <= 32 && 32 % kLanesPerKey == 0, "a key's row spans a power-of-two lane group of a warp");
    static_assert(kSeqQ >= 1 && kSeqQ <= 16, "SEQ_Q is 1 to 16 queries (decode and short chunks)");
    static_assert(kGroup >= 1 && kRows <= 16, "GROUP * SEQ_Q rows (at most 16: their Q and O slices live in registers) share a CTA");
    static_assert(kWarps >= 1 && kWarps <= 16, "WARPS is 1 to 16");
    static_assert(kUnroll >= 1 && kUnroll <= 16, "UNROLL is 1 to 16 keys a group per tile");
    static_assert(kStages >= 1 && kStages <= 8, "STAGES is 1 to 8 tiles in the cp.async ring");
    static_assert(kSplits >= 1 && kSplits <= 256, "SPLITS is 1 to 256 CTAs along the keys");
};

#include "elementwise.cuh"

// ---------------------------------------------------------------- cp.async (a lane's own bytes)

template <int BYTES>
__device__ __forceinline__ void cp_async_vec(unsigned int dst, const void* src, bool valid) {
    // Invalid (past the chunk's last key): zero-filled, so V's unused rows multiply a zero probability by zero.
    if constexpr (BYTES == 16) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 8 : 0));
    }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// One vector of VEC elements from shared memory, as fp32.
template <class T>
__device__ __forceinline__ void smem_vec(const unsigned short* p, float (&x)[T::kVec]) {
    const typename T::Word w = *reinterpret_cast<const typename T::Word*>(p);
    const unsigned int* words = reinterpret_cast<const unsigned int*>(&w);
#pragma unroll
    for (int i = 0; i < T::kVec / 2; ++i) {
        x[2 * i] = to_float<T::kIsBf16>(static_cast<unsigned short>(words[i] & 0xffffu));
        x[2 * i + 1] = to_float<T::kIsBf16>(static_cast<unsigned short>(words[i] >> 16));
    }
}

// ---------------------------------------------------------------- pieces

// This lane's VEC elements of every row's query, times scale*log2(e).
template <class T>
__device__ __forceinline__ void load_q(const unsigned short* q, long long q_sh, long long q_ss, float scale_log2,
                                       float (&qf)[T::kRows][T::kVec]) {
#pragma unroll
    for (int r = 0; r < T::kRows; ++r) {
        const unsigned short* p = q + (r / T::kSeqQ) * q_sh + (r % T::kSeqQ) * q_ss;
#pragma unroll
        for (int i = 0; i < T::kVec; ++i) qf[r][i] = to_float<T::kIsBf16>(p[i]) * scale_log2;
    }
}

// Whether this lane's columns (d0 ...) hold the head dim's, not the idle padding of kPadded.
template <class T>
__device__ __forceinline__ bool active_lane(int d0) {
    if constexpr (T::kPadded) return d0 < T::kHeadDim;
    else return true;
}

// load_q for any lane: an idle padding lane's query slice is zeros (its dot products add nothing).
template <class T>
__device__ __forceinline__ void load_lane_q(const unsigned short* q, long long q_sh, long long q_ss, float scale_log2,
                                            int d0, float (&qf)[T::kRows][T::kVec]) {
    if (active_lane<T>(d0)) {
        load_q<T>(q, q_sh, q_ss, scale_log2, qf);
    } else {
#pragma unroll
        for (int r = 0; r < T::kRows; ++r)
#pragma unroll
            for (int i = 0; i < T::kVec; ++i) qf[r][i] = 0.f;
    }
}

// smem_vec for any lane: an idle padding lane reads zeros (the address past its row is never read).
template <class T>
__device__ __forceinline__ void lane_vec(const unsigned short* p, int d0, float (&x)[T::kVec]) {
    if (active_lane<T>(d0)) {
        smem_vec<T>(p, x);
    } else {
#pragma unroll
        for (int i = 0; i < T::kVec; ++i) x[i] = 0.f;
    }
}

// Issue this lane's cp.asyncs of one tile's K and V rows into ring slot `stage`.
template <class T>
__device__ __forceinline__ void issue_tile(unsigned int ring, int stage, const unsigned short* k, const unsigned short* v,
                                           long long k_ss, long long v_ss, int tile_start, int key_end, int group,
                                           int d0) {
    if (!active_lane<T>(d0)) return;  // idle padding: its columns are not in the rows
#pragma unroll
    for (int u = 0; u < T::kUnroll; ++u) {
        const int slot = u * T::kGroups + group;
        const int key = tile_start + slot;
        const bool valid = key < key_end;
        const long long row = valid ? key : 0;
        const unsigned int dst = ring + (stage * 2 * T::kTileBytes) + (slot * T::kHeadDim + d0) * 2;
        cp_async_vec<T::kVecBytes>(dst, k + row * k_ss, valid);
        cp_async_vec<T::kVecBytes>(dst + T::kTileBytes, v + row * v_ss, valid);
    }
}

// One tile of a key group: scores of its UNROLL keys for every row, the online softmax update, and P V.
template <class T>
__device__ __forceinline__ void consume_tile(const unsigned short* tile, int tile_start, int key_end, int causal_edge,
                                             int group, int d0, const float (&qf)[T::kRows][T::kVec],
                                             float (&m)[T::kRows], float (&l)[T::kRows],
                                             float (&acc)[T::kRows][T::kVec]) {
    float s[T::kRows][T::kUnroll];
#pragma unroll
    for (int u = 0; u < T::kUnroll; ++u) {
        float kx[T::kVec];
        lane_vec<T>(tile + (u * T::kGroups + group) * T::kHeadDim + d0, d0, kx);
#pragma unroll
        for (int r = 0; r < T::kRows; ++r) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < T::kVec; ++i) dot = fmaf(qf[r][i], kx[i], dot);
            s[r][u] = dot;
        }
    }
    // The group's lanes are an aligned block of LANES_PER_KEY lanes: xor offsets below that stay inside it.
#pragma unroll
    for (int off = T::kLanesPerKey / 2; off > 0; off /= 2)
#pragma unroll
        for (int r = 0; r < T::kRows; ++r)
#pragma unroll
            for (int u = 0; u < T::kUnroll; ++u) s[r][u] += __shfl_xor_sync(0xffffffffu, s[r][u], off);
#pragma unroll
    for (int u = 0; u < T::kUnroll; ++u) {
        const int key = tile_start + u * T::kGroups + group;
#pragma unroll
        for (int r = 0; r < T::kRows; ++r) {
            bool visible = key < key_end;
            if constexpr (T::kCausal) visible = visible && key <= causal_edge + r % T::kSeqQ;
            if (!visible) s[r][u] = neg_inf();
        }
    }
#pragma unroll
    for (int r = 0; r < T::kRows; ++r) {
        float mx = m[r];
#pragma unroll
        for (int u = 0; u < T::kUnroll; ++u) mx = fmaxf(mx, s[r][u]);
        // Nothing visible yet to this row: keep its state (and avoid exp2(-inf - -inf)).
        const float base = mx == neg_inf() ? 0.f : mx;
        const float rescale = fast_exp2(m[r] - base);
        float sum = l[r] * rescale;
#pragma unroll
        for (int u = 0; u < T::kUnroll; ++u) {
            s[r][u] = fast_exp2(s[r][u] - base);
            sum += s[r][u];
        }
        l[r] = sum;
        m[r] = mx;
#pragma unroll
        for (int i = 0; i < T::kVec; ++i) acc[r][i] *= rescale;
    }
#pragma unroll
    for (int u = 0; u < T::kUnroll; ++u) {
        float vx[T::kVec];
        lane_vec<T>(tile + T::kTileBytes / 2 + (u * T::kGroups + group) * T::kHeadDim + d0, d0, vx);
#pragma unroll
        for (int r = 0; r < T::kRows; ++r)
#pragma unroll
            for (int i = 0; i < T::kVec; ++i) acc[r][i] = fmaf(s[r][u], vx[i], acc[r][i]);
    }
}

// O's element (row r, column d) as the output dtype, where that row's query head and query live.
template <class T>
__device__ __forceinline__ void store_o(unsigned short* o, long long o_sh, long long o_ss, int r, int d, float x) {
    o[(r / T::kSeqQ) * o_sh + (r % T::kSeqQ) * o_ss + d] = from_float<T::kIsBf16>(x);
}

// ---------------------------------------------------------------- the kernel body

template <class T>
__device__ __forceinline__ void decode_attention(
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,
    unsigned short* __restrict__ o, long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh,
    long long k_ss, long long v_sb, long long v_sh, long long v_ss, long long o_sb, long long o_sh, long long o_ss,
    int seq_k, float scale_log2, float* __restrict__ ws_o, float* __restrict__ ws_ml, int* __restrict__ ws_count) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int is_last;
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x % 32;
    const int group = (threadIdx.x / 32) * T::kGroupsPerWarp + lane / T::kLanesPerKey;
    const int d0 = (lane % T::kLanesPerKey) * T::kVec;

    // This CTA's keys: a chunk of whole tiles (the last chunks may be short or empty).
    const int per_split = (((seq_k + T::kSplits - 1) / T::kSplits + T::kBlockN - 1) / T::kBlockN) * T::kBlockN;
    const int key_begin = min(seq_k, split * per_split);
    const int key_end = min(seq_k, key_begin + per_split);
    const int causal_edge = seq_k - T::kSeqQ;  // query i sees keys <= causal_edge + i

    float qf[T::kRows][T::kVec];
    load_lane_q<T>(q + b * q_sb + static_cast<long long>(kvh) * T::kGroup * q_sh + d0, q_sh, q_ss, scale_log2, d0, qf);
    const unsigned short* kb = k + b * k_sb + kvh * k_sh + d0;
    const unsigned short* vb = v + b * v_sb + kvh * v_sh + d0;

    float m[T::kRows], l[T::kRows], acc[T::kRows][T::kVec];
#pragma unroll
    for (int r = 0; r < T::kRows; ++r) {
        m[r] = neg_inf();
        l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < T::kVec; ++i) acc[r][i] = 0.f;
    }

    const unsigned int ring = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    const unsigned short* ring_ptr = reinterpret_cast<const unsigned short*>(smem);
    const int tiles = (key_end - key_begin + T::kBlockN - 1) / T::kBlockN;
#pragma unroll
    for (int s = 0; s < T::kStages - 1; ++s) {
        if (s < tiles) issue_tile<T>(ring, s, kb, vb, k_ss, v_ss, key_begin + s * T::kBlockN, key_end, group, d0);
        cp_async_commit();  // empty groups too: wait_group counts groups, one per tile
    }
    for (int t = 0; t < tiles; ++t) {
        // The slot refilled here was read by this lane in the previous iteration (into registers): free.
        const int ahead = t + T::kStages - 1;
        if (ahead < tiles) {
            issue_tile<T>(ring, ahead % T::kStages, kb, vb, k_ss, v_ss, key_begin + ahead * T::kBlockN, key_end, group, d0);
        }
        cp_async_commit();
        cp_async_wait<T::kStages - 1>();  // this lane's copies of tile t have landed
        consume_tile<T>(ring_ptr + (t % T::kStages) * T::kTileBytes, key_begin + t * T::kBlockN, key_end, causal_edge,
                        group, d0, qf, m, l, acc);
    }
    cp_async_wait<0>();
    __syncthreads();  // every lane is done with the ring: it becomes the merge buffer

    // Merge the CTA's key groups: their (max, sum) and O slices through shared memory.
    float* red_m = reinterpret_cast<float*>(smem);
    float* red_l = red_m + T::kGroups * T::kRows;
    float* red_o = red_l + T::kGroups * T::kRows;
#pragma unroll
    for (int r = 0; r < T::kRows; ++r) {
        if (d0 == 0) {
            red_m[group * T::kRows + r] = m[r];
            red_l[group * T::kRows + r] = l[r];
        }
        if (active_lane<T>(d0)) {  // an idle padding lane has no columns
#pragma unroll
            for (int i = 0; i < T::kVec; ++i) red_o[(group * T::kRows + r) * T::kHeadDim + d0 + i] = acc[r][i];
        }
    }
    __syncthreads();

    o += b * o_sb + static_cast<long long>(kvh) * T::kGroup * o_sh;
    const long long slice = (static_cast<long long>(b) * gridDim.y + kvh) * T::kSplits + split;
    for (int idx = threadIdx.x; idx < T::kRows * T::kHeadDim; idx += T::kThreads) {
        const int r = idx / T::kHeadDim, d = idx % T::kHeadDim;
        float mx = neg_inf();
        for (int g = 0; g < T::kGroups; ++g) mx = fmaxf(mx, red_m[g * T::kRows + r]);
        const float base = mx == neg_inf() ? 0.f : mx;
        float sum = 0.f, x = 0.f;
        for (int g = 0; g < T::kGroups; ++g) {
            const float w = fast_exp2(red_m[g * T::kRows + r] - base);
            sum += red_l[g * T::kRows + r] * w;
            x += red_o[(g * T::kRows + r) * T::kHeadDim + d] * w;
        }
        if constexpr (T::kSplits == 1) {
            store_o<T>(o, o_sh, o_ss, r, d, x / sum);
        } else {
            ws_o[slice * T::kRows * T::kHeadDim + idx] = x;
            if (d == 0) {
                ws_ml[(slice * T::kRows + r) * 2] = mx;
                ws_ml[(slice * T::kRows + r) * 2 + 1] = sum;
            }
        }
    }

    if constexpr (T::kSplits > 1) {
        // The last CTA of this (batch, K/V head) to arrive combines the splits (the threadFenceReduction pattern).
        __threadfence();
        __syncthreads();
        int* count = ws_count + static_cast<long long>(b) * gridDim.y + kvh;
        if (threadIdx.x == 0) is_last = atomicAdd(count, 1) == T::kSplits - 1;
        __syncthreads();
        if (!is_last) return;
        __threadfence();
        const long long first = (static_cast<long long>(b) * gridDim.y + kvh) * T::kSplits;
        for (int idx = threadIdx.x; idx < T::kRows * T::kHeadDim; idx += T::kThreads) {
            const int r = idx / T::kHeadDim, d = idx % T::kHeadDim;
            float mx = neg_inf();
            for (int s = 0; s < T::kSplits; ++s) mx = fmaxf(mx, __ldcg(ws_ml + ((first + s) * T::kRows + r) * 2));
            float sum = 0.f, x = 0.f;
            for (int s = 0; s < T::kSplits; ++s) {
                // An empty split (max -inf, sum 0) weighs 0; every row sees at least one key, so mx is finite.
                const float w = fast_exp2(__ldcg(ws_ml + ((first + s) * T::kRows + r) * 2) - mx);
                sum += __ldcg(ws_ml + ((first + s) * T::kRows + r) * 2 + 1) * w;
                x += __ldcg(ws_o + (first + s) * T::kRows * T::kHeadDim + idx) * w;
            }
            store_o<T>(o, o_sh, o_ss, r, d, x / sum);
        }
        if (threadIdx.x == 0) *count = 0;  // left zero for the next launch (and a graph replay)
    }
}

}  // namespace evotune
