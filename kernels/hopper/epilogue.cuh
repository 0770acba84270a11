// evotune: the Hopper kernel's epilogue (a piece of attention_hopper.cuh, included inside namespace evotune::hopper):
// a consumer warpgroup's O / l to the output, from registers (epilogue = regs: store_out) or through shared memory and
// TMA (epilogue = tma: store_out_tma), and with WRITE_LSE its rows' log-sum-exp (store_row_lse). Epilogue<T,
// WRITE_LSE> holds the output's pointers and strides and picks the variant by the traits' kTmaStore (template
// parameter TMA_STORE).
//
// With epilogue = regs each consumer thread writes its O fragments to global memory itself: per row of the tile,
// HEAD_DIM / 8 four-byte stores, 16 bytes of a row per quad of lanes, and the warpgroup's last instructions before
// its next tile (or its exit) are those stores. Here (FlashAttention-3's epilogue) the warpgroup writes its 64 x
// HEAD_DIM tile of O, normalised and rounded exactly as store_out does (so the output is bit for bit the same), into
// shared memory in the 128-byte-swizzled layout TMA reads, and one thread stores it with one TMA store per 64-column
// region: whole 128-byte rows, rows past seq_q clipped by the tensor map (no per-row test), and the store runs
// asynchronously while the warpgroup goes on. Under PERSISTENT that is the next query tile's first Q K^T.
//
// Staging buffer, per warpgroup its 64 rows in the layout of Q's tile (O's kTileDimV / 64 regions of kBlockM rows x 128
// B, warpgroup wg's rows at wg * 8 KB inside each region, so every box starts on the 1024-byte swizzle atom; O is V's
// head dim wide, never wider than Q's, HopperTraits asserts):
//   - one tile per CTA: Q's own buffer. The warpgroup's last reader of its Q rows, the last S = Q K^T, completed
//     before the last softmax (wgmma_wait), and no other warpgroup reads these rows;
//   - PERSISTENT: a buffer of its own after the K/V slots (kOStageBytes = kOBytes more shared memory: the instantiation's
//     traits add it to kSmemBytes), since the producer loads the next tile's Q into Q's buffer under this epilogue.
//     Before the warpgroup writes it again, the previous tile's store must have read it (cp.async.bulk.wait_group.read).

// A row's shift in log2 units: its running max m times scale_log2, or 0 for a row that has seen no key (m = -inf: a
// window's empty row), as the softmax shifted it (softmax_scores).
template <class T>
__device__ __forceinline__ float row_shift(float m, float scale_log2) {
    const float shift = m * scale_log2;
    if constexpr (T::kEmptyRows) return m == neg_inf() ? 0.f : shift;
    return shift;
}

// A row's sum over its quad: each of the four lanes holds a partial sum of the row's columns.
__device__ __forceinline__ float quad_sum(float l) {
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    return l + __shfl_xor_sync(0xffffffffu, l, 2);
}

// A row's softmax denominator relative to its shift: the thread's partial sum l with its quad's other three, and with
// kSinks the head's sink, exp2(sink_log2 - shift) (sink_log2: the sink logit times log2(e)). The sink is one more
// column of the row's softmax that has no value: it adds to the denominator only, so it needs no place in the main
// loop (flash-attention adds it the same way, at the end).

template <class T>
__device__ __forceinline__ float row_total(float l, float m, float scale_log2, float sink_log2) {
    l = quad_sum(l);
    // ex2.approx (the softmax's own, 2 ulp) rather than exp2f's denormal-safe sequence: a denominator term needs no
    // more, and the windowed layers' short loops make the epilogue a visible share of the tile.
    if constexpr (T::kSinks) l += fast_exp2(sink_log2 - row_shift<T>(m, scale_log2));
    return l;
}

// One named barrier per consumer warpgroup for the staging: ids from NamedBarrier::kEnd on.
constexpr int kOStageBarrier = static_cast<int>(NamedBarrier::kEnd);
static_assert(kOStageBarrier + 4 <= 16, "four consumer warpgroups' staging barriers must fit the CTA's 16");

__device__ __forceinline__ void o_stage_sync(int wg) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(kOStageBarrier + wg) : "memory");
}

// The staging rows of warpgroup `wg` (see above).
template <class T>
__device__ __forceinline__ u32 o_stage_addr(u32 sQ, u32 sV, int wg) {
    const u32 base = T::kPersistent ? sV + T::kStages * T::kVBytes : sQ;
    return base + wg * (64 * 128);
}

// The epilogue of one consumer warpgroup: O / l into its staging rows, then (one thread) TMA stores to the rows
// row0_wg.. of (head, batch). Every thread of the warpgroup calls it.
template <class T>
__device__ __forceinline__ void store_out_tma(const float (&o)[T::kOAcc], const float (&m)[2], const float (&l)[2],
                                              float scale_log2, float sink_log2, const CUtensorMap* o_map, u32 stage,
                                              int wg, int row0_wg, int head, int batch, int warp_in_wg, int lane) {
    const bool issuer = warp_in_wg == 0 && lane == 0;  // the thread that issues (and so must await) the stores
    if constexpr (T::kPersistent) {
        // The previous query tile's store has read the staging rows (then nobody writes them early).
        if (issuer) bulk_wait_read<0>();
        o_stage_sync(wg);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float sum = row_total<T>(l[r], m[r], scale_log2, sink_log2);
        float inv = 1.f / sum;
        if constexpr (T::kEmptyRows) inv = sum == 0.f ? 0.f : inv;  // a row that sees no key: O = 0, as flash-attention's
        const int row = 16 * warp_in_wg + (lane >> 2) + 8 * r;  // of the warpgroup's 64
        const u32 row_addr = stage + row * 128 + 4 * (lane & 3);
#pragma unroll
        for (int j = 0; j < T::kHeadDimV / 8; ++j) {
            // Columns 8j + 2 (lane % 4) + {0, 1}: 16-byte chunk j % 8 of region j / 8, swizzled by the row.
            const u32 addr = row_addr + (j / 8) * (T::kBlockM * 128) + (((j % 8) ^ (row & 7)) << 4);
            const u32 packed = pack2<T::kIsBf16>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(packed) : "memory");
        }
    }
    // The generic-proxy writes above become visible to the TMA (async proxy) of the thread that issues it.
    fence_proxy_async_smem();
    o_stage_sync(wg);
    if (issuer) {
#pragma unroll
        for (int region = 0; region < T::kRegionsV; ++region)
            tma_store_4d(o_map, stage + region * (T::kBlockM * 128), 64 * region, row0_wg, head, batch);
        bulk_commit();
        // One tile per CTA: the CTA may leave (and its shared memory be given to another) only once the store has
        // read it. PERSISTENT waits at its next epilogue, or after its last tile.
        if constexpr (!T::kPersistent) bulk_wait_read<0>();
    }
}

// O / l to the output rows of this thread (rows at or past seq_q are not written).
template <class T>
__device__ __forceinline__ void store_out(const float (&o)[T::kOAcc], const float (&m)[2], const float (&l)[2],
                                          float scale_log2, float sink_log2, unsigned short* gO, long long o_ss,
                                          int q_row, int seq_q, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float sum = row_total<T>(l[r], m[r], scale_log2, sink_log2);
        float inv = 1.f / sum;
        if constexpr (T::kEmptyRows) inv = sum == 0.f ? 0.f : inv;  // a row that sees no key: O = 0, as flash-attention's
        const int row = q_row + 8 * r;
        if (row >= seq_q) continue;
        unsigned short* dst = gO + (long long)row * o_ss + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < T::kHeadDimV / 8; ++j)
            *reinterpret_cast<u32*>(dst + 8 * j) = pack2<T::kIsBf16>(o[4 * j + 2 * r] * inv, o[4 * j + 2 * r + 1] * inv);
    }
}

// Training (attention_fwd_wgmma<T, true> only): each row's natural-log log-sum-exp to gL[row]; m is
// quad-uniform (softmax_scores reduces it), l the thread's partial sum. With kSinks the sink's column is in the sum;
// the larger of the shift and the sink is taken out first, so a sink far above the row's scores stays finite.
template <class T>
__device__ __forceinline__ void store_row_lse(const float (&m)[2], const float (&l)[2], float* gL, int q_row, int seq_q,
                                              float scale_log2, float sink_log2, int lane) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q_row + 8 * r;
        const float sum = quad_sum(l[r]);
        if constexpr (T::kSinks) {
            const float shift = row_shift<T>(m[r], scale_log2);
            const float top = fmaxf(shift, sink_log2);
            const float total = sum * exp2f(shift - top) + exp2f(sink_log2 - top);
            if ((lane & 3) == 0 && row < seq_q) gL[row] = (top + log2f(total)) * 0.69314718055994531f;
        } else {
            if ((lane & 3) == 0 && row < seq_q) gL[row] = lse_from_log2(m[r] * scale_log2, sum);
        }
    }
}

// The output of the kernel: O (fp16/bf16 bit patterns, strides in elements; o_map: its tensor map, epilogue = tma
// only, else null) and, with WRITE_LSE (training), each row's log-sum-exp at lse[batch * lse_sb + head * lse_sh + row].
// sinks: kSinks only (else unread), the query heads' sink logits.
template <class T, bool WRITE_LSE>
struct Epilogue {
    unsigned short* o;
    long long o_sb, o_sh, o_ss;
    const CUtensorMap* o_map;
    float* lse;
    long long lse_sb, lse_sh;
    int seq_q;
    float scale_log2;
    const float* sinks;

    // kSinks: query head `head`'s sink logit times log2(e), the unit of the rows' shifts (row_total); else 0.
    __device__ __forceinline__ float sink_log2_of(int head) const {
        if constexpr (T::kSinks) return __ldg(sinks + head) * 1.4426950408889634f;
        return 0.f;
    }

    // One consumer warpgroup's query tile (every thread of it calls this): row0_wg its first row, q_row the thread's
    // first; m, l the rows' running max and this thread's partial sums; sink_log2: sink_log2_of(head); sQ, sV where
    // the staging rows lie.
    __device__ __forceinline__ void store(const float (&o_acc)[T::kOAcc], const float (&m)[2], const float (&l)[2],
                                          float sink_log2, u32 sQ, u32 sV, int wg, int row0_wg, int q_row, int head,
                                          int batch, int warp_in_wg, int lane) const {
        if constexpr (T::kTmaStore) {
            store_out_tma<T>(o_acc, m, l, scale_log2, sink_log2, o_map, o_stage_addr<T>(sQ, sV, wg), wg, row0_wg, head,
                             batch, warp_in_wg, lane);
        } else {
            unsigned short* gO = o + batch * o_sb + head * o_sh;
            store_out<T>(o_acc, m, l, scale_log2, sink_log2, gO, o_ss, q_row, seq_q, lane);
        }
        if constexpr (WRITE_LSE)
            store_row_lse<T>(m, l, lse + batch * lse_sb + head * lse_sh, q_row, seq_q, scale_log2, sink_log2, lane);
    }
    // A persistent CTA, after its last tile: the last O store must have read the staging rows before the CTA may
    // leave (one tile per CTA: store_out_tma waited already).
    __device__ __forceinline__ void finish(int tid) const {
        if constexpr (T::kTmaStore) {
            if (tid % 128 == 0) bulk_wait_read<0>();
        }
    }
};
