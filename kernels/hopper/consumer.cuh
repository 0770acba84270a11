// evotune: the Hopper kernel's consumer tile algebra (a piece of attention_hopper.cuh, included inside namespace
// evotune::hopper): per consumer warpgroup, S = Q K^T (issue_qk; Q from shared memory or registers, load_q_regs), the
// masks and the online softmax (scores_to_probs: mask_scores, softmax_scores with the rescale knob's slack), O's
// rescaling and P's packing (rescale_and_pack), and O += P V with P from registers (issue_pv) or from the
// warpgroup's P tile (p_operand = smem: store_p, issue_pv_smem). attention_fwd_wgmma's consume_tile sequences them
// over the K/V ring.

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

// O += P V for one V tile (N: V's tile width, kTileDimV); P (this warpgroup's 64 x BLOCK_N probabilities) from registers.
template <class T>
__device__ __forceinline__ void issue_pv(float (&o)[T::kOAcc], const u32 (&p)[T::kPVSteps][4], u32 sV) {
#pragma unroll
    for (int kk = 0; kk < T::kPVSteps; ++kk) {  // 16 keys (2 swizzle atoms of 8 rows) per step
        if constexpr (T::kLeanAddressing)
            wgmma_rs<1>(Wgmma<T::kTileDimV, T::kIsBf16>{}, o, p[kk],
                        smem_desc16((sV >> 4) + kk * 128, T::kBlockN * 128, 1024), 1);
        else
            wgmma_rs<1>(Wgmma<T::kTileDimV, T::kIsBf16>{}, o, p[kk], smem_desc(sV + kk * 2048, T::kBlockN * 128, 1024), 1);
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
            wgmma_ss<1>(Wgmma<T::kTileDimV, T::kIsBf16>{}, o, smem_desc16((sP_wg >> 4) + (p_off >> 4), 16, 1024),
                        smem_desc16((sV >> 4) + kk * 128, T::kBlockN * 128, 1024), 1);
        else
            wgmma_ss<1>(Wgmma<T::kTileDimV, T::kIsBf16>{}, o, smem_desc(sP_wg + p_off, 16, 1024),
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
__device__ __forceinline__ void mask_scores(float (&s)[T::kSAcc], int q_row, int kv0, int seq_k, int lane,
                                            const KvWindow& win) {
#pragma unroll
    for (int j = 0; j < T::kBlockN / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = kv0 + 8 * j + 2 * (lane & 3) + (e & 1);
            bool masked = key >= seq_k;
            if constexpr (T::kIsCausal) masked = masked || key > q_row + 8 * (e >> 1);
            if constexpr (T::kLocal) {
                const int diag_key = q_row + 8 * (e >> 1) + win.diag;  // the key on this row's diagonal
                masked = masked || key < diag_key - win.left || key > diag_key + win.right;
            }
            if (masked) s[4 * j + e] = neg_inf();
        }
}

// Logit soft-capping (kSoftcap): s becomes tanh(s * softcap_scale), softcap_scale = scale / C; scale_log2 = C log2(e)
// then turns it into C tanh(s scale / C) in log2 units inside softmax_scores' FMA. Before the mask, so that a masked
// score stays -inf (tanh would make it -1).
template <class T>
__device__ __forceinline__ void softcap_scores(float (&s)[T::kSAcc], float softcap_scale) {
#pragma unroll
    for (int i = 0; i < T::kSAcc; ++i) s[i] = tanh_ex2(s[i] * softcap_scale);
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
        // Every row sees key 0 in its first tile, so mx is finite from the first tile on; but with a window (kLocal) a
        // row may have seen no key yet, or none at all, and so may the rows of a varlen sequence without keys
        // (kEmptyRows): its max is -inf, and the shift and alpha below take 0 and 1 (FlashAttention's Check_inf)
        // rather than NaN from -inf - -inf.
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
            if constexpr (T::kEmptyRows) alpha[r] = mx == neg_inf() ? 1.f : alpha[r];
            m[r] = mx;
        }
        float shift = mx * scale_log2;
        if constexpr (T::kEmptyRows) shift = mx == neg_inf() ? 0.f : shift;
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
        for (int j = 0; j < T::kHeadDimV / 8; ++j) {
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
// softcap_scale, win: kSoftcap's and kLocal's runtime values (else unread).
template <class T>
__device__ __forceinline__ void scores_to_probs(float (&s)[T::kSAcc], float (&m)[2], float (&l)[2], float (&alpha)[2], int kv0,
                                                int wg_row0, int q_row, int seq_k, int lane, float scale_log2,
                                                float softcap_scale, const KvWindow& win) {
    if constexpr (T::kSoftcap) softcap_scores<T>(s, softcap_scale);
    bool need_mask = kv0 + T::kBlockN > seq_k;
    if constexpr (T::kIsCausal) need_mask = need_mask || kv0 + T::kBlockN - 1 > wg_row0;
    if constexpr (T::kLocal) need_mask = need_mask || !window_holds_tile<T>(kv0, wg_row0, win);
    if (need_mask) mask_scores<T>(s, q_row, kv0, seq_k, lane, win);
    softmax_scores<T>(s, m, l, alpha, scale_log2);
}
