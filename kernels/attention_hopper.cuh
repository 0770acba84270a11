// evotune: the Hopper (sm_90a) variant of the fused attention forward (knob mma = wgmma).
//
// Same math and masking as attention_fwd (kernels/attention.cu); different machinery:
//   - Q, K and V tiles arrive by TMA (cp.async.bulk.tensor with a tensor map per tensor,
//     128-byte swizzle), each load completing on an mbarrier (transaction bytes);
//   - S = Q K^T and O += P V run on wgmma.mma_async (m64nNk16, fp32 accumulators): each
//     consumer warpgroup owns 64 query rows; K is read K-major and V N-major (transposed)
//     straight from the swizzled tiles through matrix descriptors; P goes from the S
//     accumulators to registers as the A operand of P V (never through shared memory);
//     Q is read from shared memory by each Q K^T (Q_IN_REGS = false) or loaded once into
//     registers with ldmatrix (true);
//   - PRODUCER_WARPS = 4: a producer warpgroup streams K/V through STAGES slots (full and
//     empty mbarriers per slot) and, with two consumer warpgroups, gives registers to them
//     with setmaxnreg; PRODUCER_WARPS = 0: one consumer thread issues the TMA loads;
//   - PINGPONG (two consumer warpgroups): named barriers take turns between the
//     warpgroups issuing their matrix products, so one warpgroup's softmax runs under the
//     other's wgmma (FlashAttention-3's inter-warpgroup schedule);
//   - PERSISTENT (with a producer warpgroup): a grid of at most one CTA per SM walks the query
//     tiles (persistent_tile's order); the producer loads the next tile's Q and first K/V tiles
//     while the consumers finish the current one (its last P V and the epilogue), the K/V slots'
//     phases counting on across tiles. Non-causal tiles are all alike, so CTA b takes tiles b,
//     b + gridDim.x, ...; causal ones differ up to seq_k / BLOCK_N-fold, and that fixed share
//     ran 10% slower than one tile per CTA on the H100 (llama-4k and long-16k causal), so each
//     CTA's producer takes its next tile from a global counter (FlashAttention-3's dynamic
//     scheduler for causal) and hands it to its consumers with the Q load. Otherwise each CTA
//     computes the one tile of its blockIdx.
//
// Tile layout in shared memory (what TMA writes with SWIZZLE_128B and wgmma reads with
// the 128-byte swizzle mode): a tile of R rows x HEAD_DIM columns is HEAD_DIM/64 regions,
// each R rows of 128 bytes (64 columns); 16-byte chunk c of row r sits at chunk c ^ (r & 7).
// Every tile starts on a 1024-byte boundary (the swizzle atom: 8 rows x 128 bytes).

#include "wgmma.cuh"
#include "wgmma_n192.cuh"

namespace hopper {

// PickType<B, A, C>::type: A when B, else C (std::conditional, without the standard headers NVRTC lacks).
template <bool B, class A, class C> struct PickType { using type = A; };
template <class A, class C> struct PickType<false, A, C> { using type = C; };

template <int BLOCK_N_, int CONSUMER_WGS_, int PRODUCER_WARPS_, int STAGES_, bool Q_IN_REGS_, bool PINGPONG_,
          bool PERSISTENT_, bool PDL_, bool TMA_STORE_, int EXP2_FMA_, int RESCALE_SLACK_, bool SOFTMAX_OVERLAP_,
          bool LEAN_ADDRESSING_, bool CAUSAL_WG_, bool SKIP_EMPTY_, bool P_SMEM_, bool STRIPE_MIRROR_, int HEAD_DIM_, bool IS_BF16_, bool IS_CAUSAL_>
struct HopperTraits {
    static constexpr int kBlockN = BLOCK_N_;
    static constexpr int kConsumerWGs = CONSUMER_WGS_;
    static constexpr int kProducerWarps = PRODUCER_WARPS_;
    static constexpr int kStages = STAGES_;
    static constexpr bool kQInRegs = Q_IN_REGS_;
    static constexpr bool kPingPong = PINGPONG_;
    static constexpr bool kPersistent = PERSISTENT_;
    static constexpr bool kPdl = PDL_;  // pdl: griddepcontrol.wait before the first global access (docs/PDL.md)
    static constexpr bool kTmaStore = TMA_STORE_;  // epilogue = tma: O staged in shared memory, stored by TMA
    static constexpr int kExp2FmaEighths = EXP2_FMA_;  // exp2_fma: eighths of each row's exp2 on the FMA pipe
    // rescale: a new max's slack, log2 (new_max 0, lazy 8); -1 = always (every tile's max taken, O always rescaled)
    static constexpr int kRescaleSlackLog2 = RESCALE_SLACK_;
    static constexpr bool kLazyRescale = kRescaleSlackLog2 >= 0;
    static constexpr bool kSoftmaxOverlap = SOFTMAX_OVERLAP_;  // softmax_overlap: the consumer loop rotated
    // lean_addressing: descriptors advanced by one add (smem_desc16), the K/V slots' sequence counted unsigned
    static constexpr bool kLeanAddressing = LEAN_ADDRESSING_;
    using SlotUse = typename PickType<kLeanAddressing, unsigned, int>::type;  // a K/V tile's place in the slots' sequence
    // causal_extent = warpgroup: each consumer warpgroup stops at its own diagonal (warpgroup_kv_tiles)
    static constexpr bool kCausalWarpgroup = CAUSAL_WG_;
    // empty_warpgroups = skip: a consumer warpgroup whose rows all lie past seq_q walks the barriers only (drain_tile)
    static constexpr bool kSkipEmpty = SKIP_EMPTY_;
    // p_operand = smem: P V's P from the warpgroup's P tile in shared memory (store_p, issue_pv_smem; kPBytes)
    static constexpr bool kPSmem = P_SMEM_;
    // stripe_order = mirrored: consumer warpgroup wg computes stripe wg of the CTA's even query tiles and W - 1 - wg of
    // its odd ones, with Q in two buffers (mirrored_stripe, q_buffer; the second at kQ1Offset, which the instantiation
    // adds)
    static constexpr bool kStripeMirror = STRIPE_MIRROR_;
    static constexpr int kHeadDim = HEAD_DIM_;
    static constexpr bool kIsBf16 = IS_BF16_;
    static constexpr bool kIsCausal = IS_CAUSAL_;

    static constexpr int kBlockM = 64 * kConsumerWGs;  // wgmma's M is 64 per warpgroup
    static constexpr int kConsumerThreads = 128 * kConsumerWGs;
    static constexpr bool kHasProducer = kProducerWarps > 0;
    static constexpr int kThreads = kConsumerThreads + 32 * kProducerWarps;
    static constexpr int kRegions = kHeadDim / 64;  // 128-byte column regions of a tile
    static constexpr int kQKSteps = kHeadDim / 16;
    static constexpr int kQRegSteps = kQInRegs ? kQKSteps : 1;  // Q k-steps held in registers
    static constexpr int kPVSteps = kBlockN / 16;
    static constexpr int kSAcc = kBlockN / 2;    // S accumulators per thread (64 rows x BLOCK_N / 128)
    static constexpr int kOAcc = kHeadDim / 2;   // O accumulators per thread
    static constexpr int kQBytes = kBlockM * kHeadDim * 2;
    static constexpr int kKVBytes = kBlockN * kHeadDim * 2;
    // Tiles plus the slack to align the dynamic shared memory to the 1024-byte swizzle atom.
    static constexpr int kSmemBytes = kQBytes + 2 * kStages * kKVBytes + 1024;
    // setmaxnreg: with a producer warpgroup the consumers take the producer's registers.
    // Two consumer warpgroups (384 threads, launch bound 168 registers each): producer 24,
    // consumers 240, 128*24 + 256*240 = 64512 of the 65536. Three (512 threads, launch bound
    // 128): producer 32, consumers 160, 128*32 + 384*160 = 65536 (FlashAttention-3's split for
    // its 192-row d64 tiles). One consumer warpgroup already has 255.
    static constexpr bool kSetMaxNReg = kHasProducer && kConsumerWGs >= 2;
    // Four consumer warpgroups (block_m 256: 640 threads, launch bound 96 registers each: 65536 / 640 rounded down to
    // the allocation's 8): producer 24, consumers 112, 128*24 + 512*112 = 60416 of the CTA's 61440. setmaxnreg.inc
    // takes what the CTA's setmaxnreg.dec freed, never the SM's unallocated rest: a split above the launch's
    // allocation (consumers 120: 64512) waits forever (it hung the H100).
    // stripe_order = mirrored at four consumer warpgroups: producer 32. Its two Q buffers' barriers and four handed-tile
    // entries took the 24-register producer over (ptxas spilled 8 bytes, the persistent order's section width, which
    // the consumers then reloaded from local memory at every tile); 128*32 + 512*112 = 61440 is the launch's whole
    // allocation, which setmaxnreg.inc may take.
    static constexpr int kProducerRegs = kConsumerWGs == 3 || (kStripeMirror && kConsumerWGs == 4) ? 32 : 24;
    static constexpr int kConsumerRegs = kConsumerWGs == 4 ? 112 : kConsumerWGs == 3 ? 160 : 240;

    static_assert(kHeadDim == 64 || kHeadDim == 128, "head dim 64 or 128");
    static_assert(kPSmem || kBlockN == 16 || kBlockN == 32 || kBlockN == 64 || kBlockN == 128 || kBlockN == 176,
                  "BLOCK_N: a wgmma N of 16 to 128, or 176 (FlashAttention-3's d128 tile)");
    static_assert(!kPSmem || kBlockN == 64 || kBlockN == 128 || kBlockN == 192,
                  "p_operand = smem: P in whole 64-key regions of the 128-byte swizzle, up to FlashAttention-3's 192-key "
                  "d64 tile");
    static_assert(kRescaleSlackLog2 >= -1 && kRescaleSlackLog2 <= 8,
                  "rescale: -1 (always), or a slack of 0 (new_max) to 8 (lazy: P at most 256, inside fp16's range)");
    static_assert(kConsumerWGs >= 1 && kConsumerWGs <= 4, "one to four consumer warpgroups (64 to 256 query rows)");
    static_assert(kProducerWarps == 0 || kProducerWarps == 4, "the producer is a whole warpgroup (setmaxnreg is per warpgroup)");
    static_assert(!kPingPong || kConsumerWGs == 2, "ping-pong needs two consumer warpgroups");
    static_assert(!kCausalWarpgroup || kIsCausal,
                  "causal_extent = warpgroup: only a causal tile has K/V tiles past a warpgroup's rows");
    static_assert(!kCausalWarpgroup || !kPingPong, "causal_extent = warpgroup: ping-pong's turns assume equal loops");
    // Persistent: the producer warpgroup alone loads, so it can run a tile ahead; ping-pong's per-tile turn
    // protocol (warpgroup 1 owes no turn after its last K/V tile) is not carried across tiles.
    static_assert(!kPersistent || (kHasProducer && !kPingPong), "a persistent CTA needs a producer and no ping-pong");
    // stripe_order = mirrored evens out the warpgroups' unequal K/V ranges over a persistent CTA's consecutive tiles:
    // only causal_extent = warpgroup makes them unequal, and only a persistent CTA has a next tile.
    static_assert(!kStripeMirror || (kPersistent && kCausalWarpgroup),
                  "stripe_order = mirrored: a persistent CTA with causal_extent = warpgroup");
    static_assert(!kSkipEmpty || !kPingPong, "empty_warpgroups = skip: an empty warpgroup does not take ping-pong's turns");
    static_assert(!kSkipEmpty || !kCausalWarpgroup || kHasProducer,
                  "causal_extent = warpgroup with skip: an empty last warpgroup would not refill");
    static_assert(kStages >= 1 && kStages <= 8, "1 to 8 pipeline stages (5 to 8: the deep ring's barriers)");
    // The K/V ring's barriers (Barriers): four slots, or eight for the deep ring (stages 5 to 8).
    static constexpr int kBarrierSlots = kStages > 4 ? 8 : 4;
    static_assert(kHasProducer || kStages >= 2,
                  "without a producer the loader refills a slot mid-tile: one stage would wait on itself");
    static_assert(kKVBytes % 1024 == 0, "K/V tiles must keep the 1024-byte swizzle alignment");
    // The per-CTA shared memory and thread limits: asserted by the instantiation (evotune/limits.py).
};

// ------------------------------------------------------------------ the math

// S = Q K^T for one K tile (64 rows of this warpgroup x BLOCK_N keys), issued and committed.
template <class T>
__device__ __forceinline__ void issue_qk(float (&s)[T::kSAcc], const u32 (&qr)[T::kQRegSteps][4], u32 sQ_wg, u32 sK) {
#pragma unroll
    for (int kk = 0; kk < T::kQKSteps; ++kk) {
        // k-step kk: region kk/4 of the tile, 32 bytes (16 columns) per step inside it.
        const u32 k_off = (kk / 4) * (T::kBlockN * 128) + (kk % 4) * 32;
        u64 desc_k;
        if constexpr (T::kLeanAddressing) desc_k = smem_desc16((sK >> 4) + (k_off >> 4), 16, 1024);
        else desc_k = smem_desc(sK + k_off, 16, 1024);
        if constexpr (T::kQInRegs) {
            wgmma_rs<0>(Wgmma<T::kBlockN, T::kIsBf16>{}, s, qr[T::kQInRegs ? kk : 0], desc_k, kk > 0);
        } else {
            const u32 q_off = (kk / 4) * (T::kBlockM * 128) + (kk % 4) * 32;
            if constexpr (T::kLeanAddressing)
                wgmma_ss<0>(Wgmma<T::kBlockN, T::kIsBf16>{}, s, smem_desc16((sQ_wg >> 4) + (q_off >> 4), 16, 1024),
                            desc_k, kk > 0);
            else
                wgmma_ss<0>(Wgmma<T::kBlockN, T::kIsBf16>{}, s, smem_desc(sQ_wg + q_off, 16, 1024), desc_k, kk > 0);
        }
    }
    wgmma_commit();
}

// O += P V for one V tile; P (this warpgroup's 64 x BLOCK_N probabilities) from registers.
template <class T>
__device__ __forceinline__ void issue_pv(float (&o)[T::kOAcc], const u32 (&p)[T::kPVSteps][4], u32 sV) {
#pragma unroll
    for (int kk = 0; kk < T::kPVSteps; ++kk) {  // 16 keys (2 swizzle atoms of 8 rows) per step
        if constexpr (T::kLeanAddressing)
            wgmma_rs<1>(Wgmma<T::kHeadDim, T::kIsBf16>{}, o, p[kk],
                        smem_desc16((sV >> 4) + kk * 128, T::kBlockN * 128, 1024), 1);
        else
            wgmma_rs<1>(Wgmma<T::kHeadDim, T::kIsBf16>{}, o, p[kk], smem_desc(sV + kk * 2048, T::kBlockN * 128, 1024), 1);
    }
    wgmma_commit();
}

// p_operand = smem (FlashAttention-3's d64 tile, its MmaPV_is_RS = false): P goes from its packed A fragments to
// this warpgroup's P tile in shared memory, laid out as Q's (64 rows x BLOCK_N keys as BLOCK_N / 64 regions of 64
// rows x 128 bytes, 128-byte swizzle), and P V reads it through descriptors as Q K^T reads Q. The BLOCK_N / 4
// registers a thread held for P from its packing until its P V completed are free (for a 192-key S tile), at the
// price of the stores and P V's A operand from shared memory. The tile is the traits' kPBytes at the end of the
// dynamic shared memory (the instantiation adds it to kSmemBytes).
// P's A fragments (rescale_and_pack's) into the warpgroup's P tile: stmatrix.x4 per 16x16 block, the addresses
// load_q_regs's ldmatrix reads Q's fragments from. Every P V before it has completed (the wgmma_wait<0> ahead of
// each packing), so one tile serves every K/V tile. The fence makes the stores visible to wgmma's async proxy;
// a warp's rows of P are read by its own part of the warpgroup's wgmma, so the warp's own barrier suffices
// (FlashAttention-3's reasoning; the GPU tests check the output bit for bit against P in registers).
template <class T>
__device__ __forceinline__ void store_p(const u32 (&p)[T::kPVSteps][4], u32 sP_wg, int warp_in_wg, int lane) {
    const int row = 16 * warp_in_wg + (lane & 15);
#pragma unroll
    for (int kk = 0; kk < T::kPVSteps; ++kk) {
        const int chunk = 2 * (kk % 4) + (lane >> 4);  // 16-byte chunk inside the 128-byte row
        stmatrix_x4(sP_wg + (kk / 4) * (64 * 128) + row * 128 + ((chunk ^ (row & 7)) << 4), p[kk]);
    }
    fence_proxy_async_smem();
    __syncwarp();
}

// O += P V for one V tile with P from the warpgroup's P tile (store_p's) rather than registers.
template <class T>
__device__ __forceinline__ void issue_pv_smem(float (&o)[T::kOAcc], u32 sP_wg, u32 sV) {
#pragma unroll
    for (int kk = 0; kk < T::kPVSteps; ++kk) {  // 16 keys per step: P's region kk / 4, 32 bytes a step inside it
        const u32 p_off = (kk / 4) * (64 * 128) + (kk % 4) * 32;
        if constexpr (T::kLeanAddressing)
            wgmma_ss<1>(Wgmma<T::kHeadDim, T::kIsBf16>{}, o, smem_desc16((sP_wg >> 4) + (p_off >> 4), 16, 1024),
                        smem_desc16((sV >> 4) + kk * 128, T::kBlockN * 128, 1024), 1);
        else
            wgmma_ss<1>(Wgmma<T::kHeadDim, T::kIsBf16>{}, o, smem_desc(sP_wg + p_off, 16, 1024),
                        smem_desc(sV + kk * 2048, T::kBlockN * 128, 1024), 1);
    }
    wgmma_commit();
}

// Q's A fragments for all k-steps from the swizzled tile (Q_IN_REGS): ldmatrix.x4 per 16x16 block.
template <class T>
__device__ __forceinline__ void load_q_regs(u32 (&qr)[T::kQRegSteps][4], u32 sQ_wg, int warp_in_wg, int lane) {
    const int row = 16 * warp_in_wg + (lane & 15);
#pragma unroll
    for (int kk = 0; kk < T::kQKSteps; ++kk) {
        const int chunk = 2 * (kk % 4) + (lane >> 4);  // 16-byte chunk inside the 128-byte row
        ldmatrix_x4(qr[kk], sQ_wg + (kk / 4) * (T::kBlockM * 128) + row * 128 + ((chunk ^ (row & 7)) << 4));
    }
}

// Accumulator layout (both products): register 4j+e of a thread holds row
// 16*warp + lane/4 + 8*(e/2), column 8j + 2*(lane%4) + e%2.
template <class T>
__device__ __forceinline__ void mask_scores(float (&s)[T::kSAcc], int q_row, int kv0, int seq_k, int lane) {
#pragma unroll
    for (int j = 0; j < T::kBlockN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = kv0 + 8 * j + 2 * (lane & 3) + (e & 1);
            bool masked = key >= seq_k;
            if constexpr (T::kIsCausal) masked = masked || key > q_row + 8 * (e >> 1);
            if (masked) s[4 * j + e] = neg_inf();
        }
}

// Online softmax, first half: running max m and per-thread partial sums l of the thread's two
// rows; the scores become exp2(s*scale_log2 - m*scale_log2) in place, and alpha is the factor
// exp2((m_old - m_new)*scale_log2) that O needs. O is not touched here: the previous tile's
// P V may still be accumulating into it.
template <class T>
__device__ __forceinline__ void softmax_scores(float (&s)[T::kSAcc], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                               float scale_log2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mx = m[r];
#pragma unroll
        for (int j = 0; j < T::kBlockN / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * r], s[4 * j + 2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Every row sees key 0 in its first tile, so mx is finite from the first tile on.
        if constexpr (T::kLazyRescale) {
            // rescale = new_max or lazy (kRescaleSlackLog2 = 0 or 8): the row keeps its max, alpha exactly 1 and O
            // left as it is, unless the new max exceeds it by more than 2^kRescaleSlackLog2 in exp2 terms. At 0 that
            // is every new max, and the output is bit for bit rescale = always's (whose alpha is ex2(0) = 1 then).
            // At 8 (FlashAttention-4's conditional rescaling) P reaches at most 256, far inside fp16's and bf16's
            // range, with l and O relative to the same stale m. NaN compares false: it keeps the finite max and
            // flows through its own score. The first tile (m = -inf) always takes the max.
            const bool grown = (mx - m[r]) * scale_log2 > static_cast<float>(T::kRescaleSlackLog2);
            alpha[r] = grown ? fast_exp2((m[r] - mx) * scale_log2) : 1.f;
            if (grown) m[r] = mx;
            mx = m[r];
        } else {
            alpha[r] = fast_exp2((m[r] - mx) * scale_log2);
            m[r] = mx;
        }
        const float shift = mx * scale_log2;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < T::kBlockN / 8; ++j) {
            s[4 * j + 2 * r] = exp2_mixed<T>(2 * j, fmaf(s[4 * j + 2 * r], scale_log2, -shift));
            s[4 * j + 2 * r + 1] = exp2_mixed<T>(2 * j + 1, fmaf(s[4 * j + 2 * r + 1], scale_log2, -shift));
            sum += s[4 * j + 2 * r] + s[4 * j + 2 * r + 1];
        }
        l[r] = l[r] * alpha[r] + sum;
    }
}

// Online softmax, second half (after the previous P V completed): rescale O by alpha and pack
// P as P V's A operand. A fragment of k-step kk: keys 16kk..16kk+15 = accumulator column
// blocks 2kk and 2kk+1, the same register order as mma.sync's m16n8k16.
template <class T>
__device__ __forceinline__ void rescale_and_pack(float (&o)[T::kOAcc], const float (&s)[T::kSAcc], const float (&alpha)[2],
                                                 u32 (&p)[T::kPVSteps][4]) {
    // rescale = new_max or lazy: skipped (a warp-uniform branch) when no row of the warp took a new max: every alpha
    // is exactly 1 then.
    if (!T::kLazyRescale || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int j = 0; j < T::kHeadDim / 8; ++j) {
            o[4 * j + 0] *= alpha[0];
            o[4 * j + 1] *= alpha[0];
            o[4 * j + 2] *= alpha[1];
            o[4 * j + 3] *= alpha[1];
        }
    }
#pragma unroll
    for (int kk = 0; kk < T::kPVSteps; ++kk) {
        p[kk][0] = pack2<T::kIsBf16>(s[8 * kk + 0], s[8 * kk + 1]);
        p[kk][1] = pack2<T::kIsBf16>(s[8 * kk + 2], s[8 * kk + 3]);
        p[kk][2] = pack2<T::kIsBf16>(s[8 * kk + 4], s[8 * kk + 5]);
        p[kk][3] = pack2<T::kIsBf16>(s[8 * kk + 6], s[8 * kk + 7]);
    }
}

// Mask (where the tile needs it) and run the first half of the softmax on tile kv0's scores.
// wg_row0: the warpgroup's first query row; q_row: the thread's first row.
template <class T>
__device__ __forceinline__ void scores_to_probs(float (&s)[T::kSAcc], float (&m)[2], float (&l)[2], float (&alpha)[2], int kv0,
                                                int wg_row0, int q_row, int seq_k, int lane, float scale_log2) {
    bool need_mask = kv0 + T::kBlockN > seq_k;
    if constexpr (T::kIsCausal) need_mask = need_mask || kv0 + T::kBlockN - 1 > wg_row0;
    if (need_mask) mask_scores<T>(s, q_row, kv0, seq_k, lane);
    softmax_scores<T>(s, m, l, alpha, scale_log2);
}

// O / l to the output rows of this thread (rows at or past seq_q are not written).
template <class T>
__device__ __forceinline__ void store_out(const float (&o)[T::kOAcc], const float (&l)[2], unsigned short* gO, long long o_ss,
                                          int q_row, int seq_q, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = 1.f / sum;
        const int row = q_row + 8 * r;
        if (row >= seq_q) continue;
        unsigned short* dst = gO + (long long)row * o_ss + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < T::kHeadDim / 8; ++j)
            *reinterpret_cast<u32*>(dst + 8 * j) = pack2<T::kIsBf16>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
}

// Training (attention_fwd_wgmma<T, true> only): each row's natural-log log-sum-exp to gL[row]; m is
// quad-uniform (softmax_scores reduces it), l the thread's partial sum.
template <class T>
__device__ __forceinline__ void store_row_lse(const float (&m)[2], const float (&l)[2], float* gL, int q_row, int seq_q,
                                              float scale_log2, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int row = q_row + 8 * r;
        if ((lane & 3) == 0 && row < seq_q) gL[row] = lse_from_log2(m[r] * scale_log2, sum);
    }
}

// Shared-memory bookkeeping of one CTA: the barriers every variant has (Barriers adds stripe_order = mirrored's).
template <class T>
struct BarriersBase {
    unsigned long long q_full;
    unsigned long long k_full[T::kBarrierSlots];
    unsigned long long v_full[T::kBarrierSlots];
    unsigned long long k_empty[T::kBarrierSlots];  // every consumer warp is done reading K of the slot
    unsigned long long v_empty[T::kBarrierSlots];  // ... V of the slot
    unsigned long long q_empty;     // PERSISTENT: every consumer warp is done reading the Q tile
};
// The members of a derived struct follow its base's, so the mirrored barriers come after q_empty and every variant's
// common barriers keep their addresses.
template <class T, bool MIRRORED = T::kStripeMirror>
struct Barriers : BarriersBase<T> {};
template <class T>
struct Barriers<T, true> : BarriersBase<T> {
    // stripe_order = mirrored: Q's two buffers' full and empty barriers (q_full and q_empty stay unused).
    unsigned long long q_buf_full[2];
    unsigned long long q_buf_empty[2];
};

// stripe_order = mirrored (persistent, causal_extent = warpgroup). With causal_extent = warpgroup, the consumer
// warpgroup that takes the tile's last 64 rows (stripe W - 1 of W) walks W - 1 more K/V tiles than the one that
// takes its first, so in a fixed assignment the same warpgroup is always the longest and the others wait for it at
// every query tile (Q's one buffer frees only after the last warpgroup's last Q K^T). Here the assignment is
// mirrored on every other query tile of the CTA: warpgroup wg takes stripe wg on even tiles and W - 1 - wg on odd
// ones, so over two tiles every warpgroup walks the same number of K/V tiles, and Q has two buffers (query tile
// qi in buffer qi & 1, phase (qi >> 1) & 1), so that a warpgroup done with tile qi starts on tile qi + 1 while
// the longest one finishes qi. What stays per physical warpgroup: its O staging rows and named barrier (the
// TMA-store epilogue), its P tile (p_operand = smem), its register split.
template <class T>
__device__ __forceinline__ int mirrored_stripe(int wg, int qi) {
    static_assert(T::kStripeMirror, "the stripes are mirrored only with stripe_order = mirrored");
    return (qi & 1) ? T::kConsumerWGs - 1 - wg : wg;
}
// Query tile qi's Q buffer in shared memory: the first at sQ, the second at the traits' kQ1Offset.
template <class T>
__device__ __forceinline__ u32 q_buffer(u32 smem_base, int qi) {
    static_assert(T::kQ1Offset % 1024 == 0, "Q's second buffer keeps the 1024-byte swizzle alignment");
    return smem_base + ((qi & 1) ? T::kQ1Offset : 0);
}

// Issue the TMA loads of K (WHICH = 0) or V (1) tile `t` into slot `slot` (one thread).
template <class T, int WHICH>
__device__ __forceinline__ void load_kv(const CUtensorMap* map, u32 sKV, Barriers<T>* bars, int slot, int t, int head, int batch) {
    const u32 bar = smem_addr(WHICH == 0 ? &bars->k_full[slot] : &bars->v_full[slot]);
    mbar_expect_tx(bar, T::kKVBytes);
#pragma unroll
    for (int r = 0; r < T::kRegions; ++r)
        tma_load_4d(sKV + slot * T::kKVBytes + r * (T::kBlockN * 128), map, bar, 64 * r,
                    t * T::kBlockN, head, batch);
}

// Load tile t + STAGES into tile t's slot: K once every consumer warp released tile t's K,
// V once they released its V. K and V are released at different points of the consumer
// loop (K after S, V after the next tile's S), so they are refilled separately: waiting
// for both before loading K would deadlock a one-stage pipeline.
template <class T>
__device__ __forceinline__ void refill(const CUtensorMap* k_map, const CUtensorMap* v_map, u32 sK, u32 sV, Barriers<T>* bars,
                                       int t, int head, int batch) {
    // lean_addressing: t is never negative; unsigned, % and / by STAGES need no sign fix-up (at 2 and 4: a mask, a
    // shift).
    const int slot = static_cast<typename T::SlotUse>(t) % T::kStages;
    const u32 parity = (static_cast<typename T::SlotUse>(t) / T::kStages) & 1;
    mbar_wait(smem_addr(&bars->k_empty[slot]), parity);
    load_kv<T, 0>(k_map, sK, bars, slot, t + T::kStages, head, batch);
    mbar_wait(smem_addr(&bars->v_empty[slot]), parity);
    load_kv<T, 1>(v_map, sV, bars, slot, t + T::kStages, head, batch);
}

// empty_warpgroups = skip: one query tile of a consumer warpgroup whose 64 rows all lie at or past seq_q (the
// padding of a ragged last query tile; with 192-row tiles, gpt2's 1024 rows leave 128 of the last tile's 192
// empty). It computes nothing and stores nothing; it only gives the barriers the arrivals the loop would (one per
// warp): Q's release (persistent), K(t)'s after each S and V(t)'s after each P V (the last V only when the slot
// is refilled across query tiles, as consume_tile). Each arrival waits for the load it releases to have landed:
// that load proves the slot's previous phase complete, so the arrival counts towards this tile's phase and never
// the one before (a warpgroup that ran ahead would otherwise release a slot twice in one phase).
template <class T>
__device__ __forceinline__ void drain_tile(Barriers<T>* bars, int n_tiles, int it0, int q_phase, int lane) {
    if constexpr (T::kStripeMirror) {
        // q_phase is the query tile's index qi (Q's buffer qi & 1, its phase (qi >> 1) & 1).
        mbar_wait(smem_addr(&bars->q_buf_full[q_phase & 1]), (q_phase >> 1) & 1);
        if (lane == 0) mbar_arrive(smem_addr(&bars->q_buf_empty[q_phase & 1]));
    } else {
        mbar_wait(smem_addr(&bars->q_full), q_phase);
        if constexpr (T::kPersistent) {
            if (lane == 0) mbar_arrive(smem_addr(&bars->q_empty));
        }
    }
    for (int t = 0; t < n_tiles; ++t) {
        const unsigned use = it0 + t;  // K/V tile t's place in the slots' sequence
        const int slot = use % T::kStages;
        const u32 parity = (use / T::kStages) & 1;
        mbar_wait(smem_addr(&bars->k_full[slot]), parity);
        if (lane == 0) mbar_arrive(smem_addr(&bars->k_empty[slot]));
        mbar_wait(smem_addr(&bars->v_full[slot]), parity);
        if (lane == 0 && (T::kPersistent || t + 1 < n_tiles)) mbar_arrive(smem_addr(&bars->v_empty[slot]));
    }
}

// causal_extent = warpgroup: a consumer warpgroup stops at its own diagonal, the K/V tile of its last row (row0_wg
// + 63); the CTA's later tiles, there for the warpgroups below it, lie wholly past its rows (masked). For those
// it only gives the slots the releases a refill waits for: K(t)'s and V(t)'s where tile t + STAGES comes into
// t's slot (one tile per CTA: while t + STAGES < cta_tiles; persistent: always, the next query tile's K/V come
// after). Each release first waits for the load it releases, as drain_tile's do, so it counts towards this
// use of the slot and never the one before.
template <class T>
__device__ __forceinline__ int warpgroup_kv_tiles(int row0_wg, int seq_k) {
    static_assert(T::kIsCausal, "causal_extent = warpgroup: only a causal tile has K/V tiles past a warpgroup's rows");
    return (min(seq_k, row0_wg + 64) + T::kBlockN - 1) / T::kBlockN;
}
template <class T>
__device__ __forceinline__ void pass_masked_tiles(Barriers<T>* bars, int from, int cta_tiles, int it0, int lane) {
    const int released = T::kPersistent ? cta_tiles : cta_tiles - T::kStages;  // tiles whose slot is refilled
    for (int t = from; t < released; ++t) {
        const unsigned use = it0 + t;  // K/V tile t's place in the slots' sequence
        const int slot = use % T::kStages;
        const u32 parity = (use / T::kStages) & 1;
        mbar_wait(smem_addr(&bars->k_full[slot]), parity);
        if (lane == 0) mbar_arrive(smem_addr(&bars->k_empty[slot]));
        mbar_wait(smem_addr(&bars->v_full[slot]), parity);
        if (lane == 0) mbar_arrive(smem_addr(&bars->v_empty[slot]));
    }
}

// ---- persistent tile order (plain C++: tests/test_persistent.py compiles this stretch with the host compiler)
// A query tile: its first row, query head and batch index.
struct QTile {
    int row0, head, batch;
};

// Bytes of K and V (of all heads) a persistent grid's concurrent tiles should keep within: FlashAttention-3's
// causal scheduler sizes its head sections to 32 MB of the H100's 50 MB L2 as well.
constexpr long long kL2SectionBytes = 32ll << 20;

// (batch, query head) pairs per section of the causal order: as many as keep their K and V within
// kL2SectionBytes; with grouped-query attention `group` consecutive query heads share one K/V head.
template <class T>
__device__ __forceinline__ int l2_section_pairs(int head_batches, int seq_k, int group) {
    const long long kv_bytes = 4ll * T::kHeadDim * seq_k;  // K and V of one K/V head, 2 bytes an element
    return static_cast<int>(max(1ll, min(static_cast<long long>(head_batches), kL2SectionBytes * group / kv_bytes)));
}

// Tile `tile` of the persistent order. Non-causal: the query tiles of one (batch, head) are consecutive, so
// the ~132 tiles in flight at a time share the K/V of one to a few heads in L2. Causal: (batch, head) pairs
// in sections whose K/V fit kL2SectionBytes; within a section the heads vary fastest and the tiles go from the
// last query tile (the most K/V tiles) to the first, so the longest tiles start first and the short ones fill
// the end of the launch.
template <class T>
__device__ __forceinline__ QTile persistent_tile(int tile, int m_blocks, int heads, int head_batches, int section) {
    int m, hb;
    if constexpr (T::kIsCausal) {
        const int sec = tile / (section * m_blocks);
        const int base = sec * section;
        const int width = min(section, head_batches - base);  // the last section may hold fewer pairs
        const int idx = tile - base * m_blocks;
        m = m_blocks - 1 - idx / width;
        hb = base + idx % width;
    } else {
        m = tile % m_blocks;
        hb = tile / m_blocks;
    }
    return {m * T::kBlockM, hb % heads, hb / heads};
}

// K/V tiles a query tile starting at row q_row0 reads (causal: up to its last row's diagonal).
template <class T>
__device__ __forceinline__ int kv_tile_count(int q_row0, int seq_k) {
    int kv_end = seq_k;
    if constexpr (T::kIsCausal) kv_end = min(seq_k, q_row0 + T::kBlockM);
    return (kv_end + T::kBlockN - 1) / T::kBlockN;
}
// ---- end of the persistent tile order
#include "hopper_tma_store.cuh"

// q_map, k_map, v_map: the CUtensorMaps of Q, K and V, each over the 4-D view (head_dim, seq, head,
// batch) with boxes of 64 columns x BLOCK_M (Q) or BLOCK_N (K, V) rows. They point at the entry
// point's __grid_constant__ parameters (kernel parameter space, as FlashAttention-3 and CUTLASS pass
// them): a launch carries them by value, so nothing is uploaded per call and a CUDA graph records them.
// K's and V's maps describe heads / group heads (grouped-query attention): query head h loads K/V
// head h / group (kv_head_of; kv_magic is 0 without grouping).
//
// Consumer loop, per warpgroup (FlashAttention-3's intra-warpgroup pipelining): iteration t
// issues S(t) = Q K(t)^T and then O += P(t-1) V(t-1), waits for S(t) only, runs the softmax
// of tile t while P V runs on the tensor cores, then waits for P V, rescales O and packs
// P(t). K(t)'s slot is released as soon as S(t) is done, V(t-1)'s after P V.
// WRITE_LSE (training, not a knob): also write each row's log-sum-exp to lse[batch * lse_sb + head *
// lse_sh + row] (see attention_fwd). n_heads, n_batch: the query heads and batch (read by PERSISTENT only;
// the one-tile grid has them as gridDim.y and z). tile_counter: PERSISTENT causal only (else unread), two
// unsigned counters that are zero when the launch starts (the tiles handed out past the first gridDim.x, and
// the CTAs done); the last CTA to finish zeroes them again, so one zeroed pair serves launch after launch on
// one stream (two launches running at once need a pair each).
template <class T, bool WRITE_LSE = false>
__device__ __forceinline__ void attention_fwd_wgmma(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                                    const CUtensorMap* v_map, unsigned short* __restrict__ o,
                                                    long long o_sb, long long o_sh, long long o_ss, int seq_q, int seq_k,
                                                    float scale_log2, unsigned kv_magic, int n_heads, int n_batch,
                                                    unsigned* __restrict__ tile_counter,
                                                    const CUtensorMap* o_map,  // epilogue = tma only (else null)
                                                    float* __restrict__ lse = nullptr, long long lse_sb = 0,
                                                    long long lse_sh = 0) {
    // Aligned by hand (kSmemBytes has the slack): __align__(1024) here would pad the static
    // shared memory to 1024 bytes as well.
    extern __shared__ __align__(16) unsigned char smem_raw[];
    __shared__ Barriers<T> bars;
    const u32 smem_base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 sQ = smem_base;
    const u32 sK = sQ + T::kQBytes;
    const u32 sV = sK + T::kStages * T::kKVBytes;

    const int tid = threadIdx.x;
    // Without PERSISTENT, the CTA's one query tile: the grid's (x, y, z) = (query tile, head, batch).
    const QTile grid_tile{static_cast<int>(blockIdx.x) * T::kBlockM, static_cast<int>(blockIdx.y),
                          static_cast<int>(blockIdx.z)};
    const int grid_kv_head = kv_head_of(grid_tile.head, kv_magic);  // the K/V maps' head coordinate
    const int grid_n_tiles = kv_tile_count<T>(grid_tile.row0, seq_k);
    // The thread that issues TMA: the producer warpgroup's first, or the first consumer's.
    // causal_extent = warpgroup, without a producer: the last consumer warpgroup's first thread, since that warpgroup
    // alone walks every K/V tile of the CTA (the others stop at their own diagonals) and so refills every slot.
    const int loader = T::kHasProducer ? T::kConsumerThreads : T::kCausalWarpgroup ? T::kConsumerThreads - 128 : 0;

    if (tid == loader) {
        mbar_init(smem_addr(&bars.q_full), 1);
        if constexpr (T::kPersistent) mbar_init(smem_addr(&bars.q_empty), T::kConsumerThreads / 32);
        if constexpr (T::kStripeMirror) {
            for (int b = 0; b < 2; ++b) {
                mbar_init(smem_addr(&bars.q_buf_full[b]), 1);
                mbar_init(smem_addr(&bars.q_buf_empty[b]), T::kConsumerThreads / 32);
            }
        }
#pragma unroll
        for (int s = 0; s < T::kStages; ++s) {
            mbar_init(smem_addr(&bars.k_full[s]), 1);
            mbar_init(smem_addr(&bars.v_full[s]), 1);
            mbar_init(smem_addr(&bars.k_empty[s]), T::kConsumerThreads / 32);  // one arrival per consumer warp
            mbar_init(smem_addr(&bars.v_empty[s]), T::kConsumerThreads / 32);
        }
        mbar_init_fence();
        tma_prefetch_map(q_map);
        tma_prefetch_map(k_map);
        tma_prefetch_map(v_map);
        if constexpr (T::kTmaStore) tma_prefetch_map(o_map);
    }
    __syncthreads();
    // Above: shared-memory carve-up, index arithmetic, mbarrier init and the prefetch of the tensor maps (kernel
    // parameters, not memory another grid writes). Every global access of this CTA follows, in every thread:
    // the TMA loads of Q, K and V, the stores of O (and the log-sum-exp), the persistent causal grid's tile
    // counters. So each one sees the previous grid's writes complete and cannot overwrite what that grid
    // still reads. Then the next PDL-launched grid may begin launching while this one runs.
    if constexpr (T::kPdl) {
        pdl_wait();
        pdl_launch_dependents();
    }

    // One query tile of the consumer warpgroups: `it0` K/V tiles went through the slots before it (the
    // slot of its K/V tile t is (it0 + t) % STAGES), and its Q arrives in phase `q_phase` of q_full. stripe_order =
    // mirrored: q_phase is qi, the CTA's query tiles before this one, which picks Q's buffer, its phase and the stripes.
    auto consume_tile = [&](const QTile& w, int kv_head, int cta_tiles, int it0, int q_phase) {
        // The CTA's K/V tiles, then (causal_extent = warpgroup, below the empty test) this warpgroup's.
        int n_tiles = cta_tiles;
        const int wg = tid / 128;
        const int warp_in_wg = (tid % 128) / 32;
        const int lane = tid & 31;
        const int qi = q_phase;  // stripe_order = mirrored: the CTA's query tiles before this one
        // The tile's 64-row stripe this warpgroup computes: its own, or with stripe_order = mirrored mirrored_stripe's.
        int stripe = wg;
        if constexpr (T::kStripeMirror) stripe = mirrored_stripe<T>(wg, qi);
        u32 sQ_wg;  // this warpgroup's 64 rows inside each region
        if constexpr (T::kStripeMirror) sQ_wg = q_buffer<T>(smem_base, qi) + stripe * (64 * 128);
        else sQ_wg = sQ + wg * (64 * 128);
        u32 sP_wg = 0;  // p_operand = smem: its P tile
        if constexpr (T::kPSmem) sP_wg = smem_base + T::kSmemBytes - 1024 - T::kPBytes + wg * (64 * T::kBlockN * 2);
        // Every use of the tile's first row below is q_row0 + 64 * wg, the first row of the warpgroup's rows (wg stays
        // the physical warpgroup: it indexes the staging rows, the P tile and the named barriers). Shifted by the
        // stripe's offset (mirrored), that sum is the first row of the stripe this warpgroup computes.
        int q_row0 = w.row0;
        if constexpr (T::kStripeMirror) q_row0 = w.row0 + 64 * (stripe - wg);
        const int head = w.head, batch = w.batch;
        const int q_row = q_row0 + 64 * wg + 16 * warp_in_wg + (lane >> 2);  // the first of the thread's two rows
        if constexpr (T::kSkipEmpty) {
            if (q_row0 + 64 * wg >= seq_q) {  // every row of this warpgroup is padding (uniform per warpgroup)
                drain_tile<T>(&bars, n_tiles, it0, q_phase, lane);
                return;
            }
        }
        if constexpr (T::kCausalWarpgroup) n_tiles = warpgroup_kv_tiles<T>(q_row0 + 64 * wg, seq_k);  // to its diagonal

        float o_acc[T::kOAcc];
        float s_acc[T::kSAcc];
        u32 p[T::kPVSteps][4];
        u32 qr[T::kQRegSteps][4];
        float m_run[2] = {neg_inf(), neg_inf()}, l_run[2] = {0.f, 0.f};
#pragma unroll
        for (int i = 0; i < T::kOAcc; ++i) o_acc[i] = 0.f;
#pragma unroll
        for (int i = 0; i < T::kSAcc; ++i) s_acc[i] = 0.f;

        if constexpr (T::kStripeMirror) mbar_wait(smem_addr(&bars.q_buf_full[qi & 1]), (qi >> 1) & 1);
        else mbar_wait(smem_addr(&bars.q_full), q_phase);
        // The previous tile's epilogue branched per lane (rows past seq_q): reconverge before the .aligned
        // instructions (ldmatrix's users, wgmma) rather than rely on ptxas to.
        if constexpr (T::kPersistent) __syncwarp();
        if constexpr (T::kQInRegs) {
            load_q_regs<T>(qr, sQ_wg, warp_in_wg, lane);
            if constexpr (T::kPersistent) {
                // Q is in registers: the producer may load the next tile's over it. The generic-proxy reads
                // (ldmatrix) are ordered before the TMA's async-proxy writes by the fence.
                fence_proxy_async_smem();
                __syncwarp();
                if constexpr (T::kStripeMirror) {
                    if (lane == 0) mbar_arrive(smem_addr(&bars.q_buf_empty[qi & 1]));
                } else {
                    if (lane == 0) mbar_arrive(smem_addr(&bars.q_empty));
                }
            }
        }
        if constexpr (T::kPingPong) {
            if (wg == 1) named_bar_arrive(NamedBarrier::kWarpgroupTurn, 0, 256);  // warpgroup 0 takes the first turn
        }
        float alpha[2];

        // Tile 0: S only (no P V before it). Peeled so the loop below issues both products
        // unconditionally: a conditional wgmma let the compiler sink P's packing into the
        // branch, after wgmma.fence, and ptxas then serialised every wgmma (C7514).
        const int slot0 = it0 % T::kStages;
        mbar_wait(smem_addr(&bars.k_full[slot0]), (it0 / T::kStages) & 1);
        if constexpr (T::kPingPong) named_bar_sync(NamedBarrier::kWarpgroupTurn, wg, 256);
        fence_regs(s_acc);
        wgmma_fence();
        issue_qk<T>(s_acc, qr, sQ_wg, sK + slot0 * T::kKVBytes);
        if constexpr (T::kPingPong) named_bar_arrive(NamedBarrier::kWarpgroupTurn, 1 - wg, 256);
        wgmma_wait<0>();
        fence_regs(s_acc);
        if (lane == 0) mbar_arrive(smem_addr(&bars.k_empty[slot0]));
        // Persistent, Q from shared memory: its last reader has completed when the tile has one K/V tile (mirrored:
        // released after the tile's loop).
        if constexpr (T::kPersistent && !T::kQInRegs && !T::kStripeMirror) {
            if (lane == 0 && n_tiles == 1) mbar_arrive(smem_addr(&bars.q_empty));
        }
        scores_to_probs<T>(s_acc, m_run, l_run, alpha, 0, q_row0 + 64 * wg, q_row, seq_k, lane, scale_log2);
        if constexpr (!T::kSoftmaxOverlap) {
            rescale_and_pack<T>(o_acc, s_acc, alpha, p);
            if constexpr (T::kPSmem) store_p<T>(p, sP_wg, warp_in_wg, lane);
        }
        // softmax_overlap (kSoftmaxOverlap): the loop below is rotated. Written as one iteration (products of tile t,
        // its softmax, the wait for P(t-1) V(t-1), O's rescaling and P's packing), ptxas schedules that wait near the
        // top of the block, above the softmax, which then never runs under its own P V (the SASS has no MUFU.EX2
        // between the waits for S and for P V). Here the wait opens the next iteration, across the back edge
        // from the softmax. The instructions run in the same order as without the knob, so is the output.
        // finish_tile(u): tile u's softmax is done; wait for P(u-1) V(u-1), release V(u-1)'s slot (and refill it
        // without a producer), rescale O and pack P(u).
        auto finish_tile = [&](int u) {
            wgmma_wait<0>();
            fence_regs(o_acc);
            if constexpr (!T::kPSmem) fence_a_regs(p);
            if (u >= 1) {
                if (lane == 0) mbar_arrive(smem_addr(&bars.v_empty[(it0 + u - 1) % T::kStages]));
                if constexpr (!T::kHasProducer) {
                    if (tid == loader && u - 1 + T::kStages < n_tiles)
                        refill<T>(k_map, v_map, sK, sV, &bars, u - 1, kv_head, batch);
                    __syncwarp();
                }
            }
            rescale_and_pack<T>(o_acc, s_acc, alpha, p);
            if constexpr (T::kPSmem) store_p<T>(p, sP_wg, warp_in_wg, lane);
        };

        for (int t = 1; t < n_tiles; ++t) {
            if constexpr (T::kSoftmaxOverlap) finish_tile(t - 1);
            // K/V tile t's place in the slots' sequence (lean_addressing: unsigned, no sign fix-up in % and /)
            const typename T::SlotUse use = it0 + t;
            const int slot = use % T::kStages;
            const int prev = (use - 1) % T::kStages;  // tile t-1's slot
            mbar_wait(smem_addr(&bars.k_full[slot]), (use / T::kStages) & 1);
            // V(t-1) left with K(t-1), so it is normally here already. Waiting for it before the
            // fence keeps the spin loop out of the fence-to-wgmma stretch, where ptxas would
            // insert a second fence of its own (C7519).
            mbar_wait(smem_addr(&bars.v_full[prev]), ((use - 1) / T::kStages) & 1);
            if constexpr (T::kPingPong) named_bar_sync(NamedBarrier::kWarpgroupTurn, wg, 256);
            // Everything the two products read from registers is final before the fence.
            fence_regs(s_acc);
            fence_regs(o_acc);
            if constexpr (!T::kPSmem) fence_a_regs(p);
            wgmma_fence();
            issue_qk<T>(s_acc, qr, sQ_wg, sK + slot * T::kKVBytes);
            if constexpr (T::kPSmem) issue_pv_smem<T>(o_acc, sP_wg, sV + prev * T::kKVBytes);
            else issue_pv<T>(o_acc, p, sV + prev * T::kKVBytes);
            if constexpr (T::kPingPong) {
                // Hand the tensor cores to the other warpgroup; warpgroup 1 owes none after its last tile.
                if (wg == 0 || t + 1 < n_tiles) named_bar_arrive(NamedBarrier::kWarpgroupTurn, 1 - wg, 256);
            }
            wgmma_wait<1>();  // S(t) is done; P(t-1) V(t-1) may still run
            //[no_wg_overlap] // Only `tools/time_configs.py --with-flag no_wg_overlap` (no config has it): wait for P(t-1) V(t-1)
            //[no_wg_overlap] // too, so this warpgroup's softmax of tile t no longer runs under its own P V.
            //[no_wg_overlap] wgmma_wait<0>();
            fence_regs(s_acc);
            if (lane == 0) mbar_arrive(smem_addr(&bars.k_empty[slot]));
            // Persistent, Q from shared memory: S(t) of the last K/V tile was Q's last reader, so the next tile's
            // Q may come in under this tile's last softmax, P V and epilogue.
            if constexpr (T::kPersistent && !T::kQInRegs && !T::kStripeMirror) {
                if (lane == 0 && t == n_tiles - 1) mbar_arrive(smem_addr(&bars.q_empty));
            }
            scores_to_probs<T>(s_acc, m_run, l_run, alpha, t * T::kBlockN, q_row0 + 64 * wg, q_row, seq_k, lane,
                               scale_log2);
            if constexpr (!T::kSoftmaxOverlap) {
                wgmma_wait<0>();
                fence_regs(o_acc);
                if constexpr (!T::kPSmem) fence_a_regs(p);
                if (lane == 0) mbar_arrive(smem_addr(&bars.v_empty[prev]));
                if constexpr (!T::kHasProducer) {
                    if (tid == loader && t - 1 + T::kStages < n_tiles)
                        refill<T>(k_map, v_map, sK, sV, &bars, t - 1, kv_head, batch);
                    __syncwarp();
                }
                rescale_and_pack<T>(o_acc, s_acc, alpha, p);
                if constexpr (T::kPSmem) store_p<T>(p, sP_wg, warp_in_wg, lane);
            }
        }
        if constexpr (T::kSoftmaxOverlap) finish_tile(n_tiles - 1);
        // stripe_order = mirrored, Q from shared memory: released after the loop rather than at its last Q K^T. The
        // next tile's Q goes to the other buffer, so this release only gates tile qi + 2's load, and a barrier indexed
        // by qi inside the loop cost the 112-register consumers a spill.
        if constexpr (T::kStripeMirror && !T::kQInRegs) {
            if (lane == 0) mbar_arrive(smem_addr(&bars.q_buf_empty[qi & 1]));
        }
        // P V of the last tile.
        const int last = (it0 + n_tiles - 1) % T::kStages;
        mbar_wait(smem_addr(&bars.v_full[last]), ((it0 + n_tiles - 1) / T::kStages) & 1);
        fence_regs(o_acc);
        if constexpr (!T::kPSmem) fence_a_regs(p);
        wgmma_fence();
        if constexpr (T::kPSmem) issue_pv_smem<T>(o_acc, sP_wg, sV + last * T::kKVBytes);
        else issue_pv<T>(o_acc, p, sV + last * T::kKVBytes);
        wgmma_wait<0>();
        fence_regs(o_acc);
        if constexpr (!T::kPSmem) fence_a_regs(p);
        if constexpr (T::kPersistent) {
            // The last V slot is free for the next tile's loads.
            if (lane == 0) mbar_arrive(smem_addr(&bars.v_empty[last]));
        }
        if constexpr (T::kCausalWarpgroup && !T::kPersistent) {
            // A later K/V tile of the CTA comes into the slot of this warpgroup's last V.
            if (lane == 0 && n_tiles - 1 + T::kStages < cta_tiles) mbar_arrive(smem_addr(&bars.v_empty[last]));
        }

        if constexpr (T::kTmaStore) {
            // epilogue = tma (kernels/hopper_tma_store.cuh): O goes out through shared memory and TMA instead.
            store_out_tma<T>(o_acc, l_run, o_map, o_stage_addr<T>(sQ, sV, wg), wg, q_row0 + 64 * wg, head, batch,
                             warp_in_wg, lane);
        } else {
            unsigned short* gO = o + batch * o_sb + head * o_sh;
            store_out<T>(o_acc, l_run, gO, o_ss, q_row, seq_q, lane);
        }
        if constexpr (WRITE_LSE)
            store_row_lse<T>(m_run, l_run, lse + batch * lse_sb + head * lse_sh, q_row, seq_q, scale_log2, lane);
        if constexpr (T::kCausalWarpgroup) {
            // Its output is out; now the K/V tiles past its diagonal (their releases only).
            pass_masked_tiles<T>(&bars, n_tiles, cta_tiles, it0, lane);
        }
    };

    if constexpr (!T::kPersistent) {
        const QTile& w = grid_tile;
        const int kv_head = grid_kv_head, n_tiles = grid_n_tiles;
        if (tid == loader) {
            const u32 qb = smem_addr(&bars.q_full);
            mbar_expect_tx(qb, T::kQBytes);
#pragma unroll
            for (int r = 0; r < T::kRegions; ++r) tma_load_4d(sQ + r * (T::kBlockM * 128), q_map, qb, 64 * r, w.row0, w.head, w.batch);
            for (int t = 0; t < min(n_tiles, T::kStages); ++t) {
                load_kv<T, 0>(k_map, sK, &bars, t, t, kv_head, w.batch);
                load_kv<T, 1>(v_map, sV, &bars, t, t, kv_head, w.batch);
            }
        }
        __syncwarp();  // the warp reconverges before the .aligned instructions below

        if constexpr (T::kHasProducer) {
            if (tid >= T::kConsumerThreads) {
                if constexpr (T::kSetMaxNReg) setmaxnreg_dec<T::kProducerRegs>();
                if (tid == loader)
                    for (int t = 0; t + T::kStages < n_tiles; ++t) refill<T>(k_map, v_map, sK, sV, &bars, t, kv_head, w.batch);
                return;
            }
            if constexpr (T::kSetMaxNReg) setmaxnreg_inc<T::kConsumerRegs>();
        }
        consume_tile(w, kv_head, n_tiles, 0, 0);
    } else {
        // Persistent: CTA b takes tile b of persistent_tile's order first, then (non-causal) b + gridDim.x, ...
        // or (causal) the tiles its producer is handed by tile_counter; the consumers walk the same sequence
        // (computed, or read with each Q) and count the K/V tiles before each query tile the same way.
        const int m_blocks = (seq_q + T::kBlockM - 1) / T::kBlockM;
        const int head_batches = n_heads * n_batch;
        const int n_work = m_blocks * head_batches;
        // Causal only (the non-causal order has no sections). K/V heads: the last query head's, plus one.
        const int section =
            T::kIsCausal ? l2_section_pairs<T>(head_batches, seq_k, n_heads / (kv_head_of(n_heads - 1, kv_magic) + 1)) : 1;
        // empty_warpgroups = skip: the non-causal tiles are handed out too. A head's last query tile, whose empty
        // warpgroups skip it, costs less than a full one; with the fixed stride every CTA would take tiles of one
        // row block only (132 SMs and 6 row blocks on gpt2), so some CTAs would get only the cheap ones and the
        // launch would last as long as the full ones. Handed out in persistent_tile's order, each head's tiles
        // stay together (its K/V in L2); an order with every thin tile last measured 2.5-4% slower on gpt2.
        constexpr bool kDynamic = T::kIsCausal || T::kSkipEmpty;
        // kDynamic: per q_full phase, its query tile (or -1: none left), query tile qi's entry qi % kHanded.
        // stripe_order = mirrored: four entries. The producer writes tile qi's at the top of tile qi, before it
        // awaits anything there. Its last reader was tile qi - 4's: each consumer warp reads before it releases that
        // tile's Q, and the producer awaited the release (q_buf_empty) at tile qi - 2's Q load. With two entries the
        // last reader would be tile qi - 2's, whose release is awaited only at tile qi's Q load.
        constexpr int kHanded = T::kStripeMirror ? 4 : 2;
        __shared__ int handed_tile[kHanded];
        if (tid >= T::kConsumerThreads) {
            if constexpr (T::kSetMaxNReg) setmaxnreg_dec<T::kProducerRegs>();
            if (tid == loader) {
                int it = 0;  // K/V tiles loaded so far
                int qi = 0;  // query tiles so far
                for (int work = blockIdx.x; work < n_work; ++qi) {
                    // Causal: the consumers read the tile after q_full's phase qi completes (the Q load's arrival
                    // releases this store). The entry was last read for tile qi - 2, before its Q was released,
                    // which the wait for q_empty at tile qi - 1's Q load saw. Both sides use atomics: the mbarriers
                    // order them, but compute-sanitizer's racecheck does not model mbarrier waits and reports
                    // plain accesses here as a race (measured); it leaves atomic ones alone.
                    if constexpr (kDynamic) atomicExch(&handed_tile[qi & (kHanded - 1)], work);  // mirrored is causal
                    const QTile w = persistent_tile<T>(work, m_blocks, n_heads, head_batches, section);
                    const int kv_head = kv_head_of(w.head, kv_magic);
                    const int n_tiles = kv_tile_count<T>(w.row0, seq_k);
                    for (int t = 0; t < n_tiles; ++t, ++it) {
                        // The slot's previous use (it - STAGES) must be released: its K after S, its V after P V.
                        const int slot = it % T::kStages;
                        const int use = it / T::kStages;
                        if (use > 0) mbar_wait(smem_addr(&bars.k_empty[slot]), (use - 1) & 1);
                        load_kv<T, 0>(k_map, sK, &bars, slot, t, kv_head, w.batch);
                        if (t == 0) {
                            // Q after the first K: that K's slot was released a few K/V tiles back, Q's buffer only
                            // after the previous tile's last Q K^T (or once it was in registers).
                            if constexpr (T::kStripeMirror) {
                                // Into buffer qi & 1, once every consumer warp released tile qi - 2's Q there.
                                if (qi > 1) mbar_wait(smem_addr(&bars.q_buf_empty[qi & 1]), ((qi - 2) >> 1) & 1);
                                const u32 qb = smem_addr(&bars.q_buf_full[qi & 1]);
                                mbar_expect_tx(qb, T::kQBytes);
                                const u32 q_dst = q_buffer<T>(smem_base, qi);
#pragma unroll
                                for (int r = 0; r < T::kRegions; ++r)
                                    tma_load_4d(q_dst + r * (T::kBlockM * 128), q_map, qb, 64 * r, w.row0, w.head, w.batch);
                            } else {
                                if (qi > 0) mbar_wait(smem_addr(&bars.q_empty), (qi - 1) & 1);
                                const u32 qb = smem_addr(&bars.q_full);
                                mbar_expect_tx(qb, T::kQBytes);
#pragma unroll
                                for (int r = 0; r < T::kRegions; ++r)
                                    tma_load_4d(sQ + r * (T::kBlockM * 128), q_map, qb, 64 * r, w.row0, w.head, w.batch);
                            }
                        }
                        if (use > 0) mbar_wait(smem_addr(&bars.v_empty[slot]), (use - 1) & 1);
                        load_kv<T, 1>(v_map, sV, &bars, slot, t, kv_head, w.batch);
                    }
                    // Causal: ask for the next tile only now, when this CTA is about to run out of queued work
                    // (one tile asked for earlier could sit here while another CTA idles at the end of the
                    // launch). The answer's latency hides under the wait for the next free slot.
                    if constexpr (kDynamic) work = static_cast<int>(atomicAdd(tile_counter, 1u) + gridDim.x);
                    else work += gridDim.x;
                }
                if constexpr (kDynamic) {
                    // No tile left: hand the consumers -1 (their signal to stop) with a bare arrival, once
                    // q_full's previous phase is complete (seen through q_empty).
                    atomicExch(&handed_tile[qi & (kHanded - 1)], -1);
                    if constexpr (T::kStripeMirror) {
                        if (qi > 1) mbar_wait(smem_addr(&bars.q_buf_empty[qi & 1]), ((qi - 2) >> 1) & 1);
                        mbar_arrive(smem_addr(&bars.q_buf_full[qi & 1]));
                    } else {
                        if (qi > 0) mbar_wait(smem_addr(&bars.q_empty), (qi - 1) & 1);
                        mbar_arrive(smem_addr(&bars.q_full));
                    }
                    // Every CTA asks until it is refused, then counts itself done: the last one done knows no
                    // CTA of this launch will ask again and zeroes both counters for the next launch.
                    __threadfence();
                    if (atomicAdd(tile_counter + 1, 1u) == gridDim.x - 1) {
                        atomicExch(tile_counter, 0u);
                        atomicExch(tile_counter + 1, 0u);
                    }
                }
            }
            return;
        }
        if constexpr (T::kSetMaxNReg) setmaxnreg_inc<T::kConsumerRegs>();
        int it = 0, qi = 0;
        for (int work = blockIdx.x;; ++qi) {
            if constexpr (kDynamic) {
                // consume_tile's own wait then passes at once
                if constexpr (T::kStripeMirror) mbar_wait(smem_addr(&bars.q_buf_full[qi & 1]), (qi >> 1) & 1);
                else mbar_wait(smem_addr(&bars.q_full), qi & 1);
                // One read per warp (see the producer's store), broadcast.
                int handed = 0;
                if ((tid & 31) == 0) handed = atomicAdd(&handed_tile[qi & (kHanded - 1)], 0);
                work = __shfl_sync(0xffffffffu, handed, 0);
            } else if (qi > 0) {
                work += gridDim.x;
            }
            if (kDynamic ? work < 0 : work >= n_work) break;
            const QTile w = persistent_tile<T>(work, m_blocks, n_heads, head_batches, section);
            const int n_tiles = kv_tile_count<T>(w.row0, seq_k);
            // Q's phase in q_full, or (stripe_order = mirrored) the tile's index, which picks Q's buffer and phase.
            consume_tile(w, kv_head_of(w.head, kv_magic), n_tiles, it, T::kStripeMirror ? qi : qi & 1);
            it += n_tiles;
        }
        // The last tile's O store must have read the staging rows before the CTA may leave.
        if constexpr (T::kTmaStore) {
            if (tid % 128 == 0) bulk_wait_read<0>();
        }
    }
}

}  // namespace hopper
