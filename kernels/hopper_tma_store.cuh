// evotune: the Hopper variant's TMA-store epilogue (knob epilogue = tma, search_spaces/attention.yaml).
//
// The Hopper traits' kTmaStore (template parameter TMA_STORE) selects it: attention_fwd_wgmma calls store_out_tma under
// `if constexpr (T::kTmaStore)`, store_out otherwise.
//
// With epilogue = regs each consumer thread writes its O fragments to global memory itself: per row of the tile,
// HEAD_DIM / 8 four-byte stores, 16 bytes of a row per quad of lanes, and the warpgroup's last instructions before
// its next tile (or its exit) are those stores. Here (FlashAttention-3's epilogue) the warpgroup writes its 64 x
// HEAD_DIM tile of O, normalised and rounded exactly as store_out does (so the output is bit for bit the same), into
// shared memory in the 128-byte-swizzled layout TMA reads, and one thread stores it with one TMA store per 64-column
// region: whole 128-byte rows, rows past seq_q clipped by the tensor map (no per-row test), and the store runs
// asynchronously while the warpgroup goes on. Under PERSISTENT that is the next query tile's first Q K^T.
//
// Staging buffer, per warpgroup its 64 rows in the layout of Q's tile (HEAD_DIM / 64 regions of kBlockM rows x 128 B,
// warpgroup wg's rows at wg * 8 KB inside each region, so every box starts on the 1024-byte swizzle atom):
//   - one tile per CTA: Q's own buffer. The warpgroup's last reader of its Q rows, the last S = Q K^T, completed
//     before the last softmax (wgmma_wait), and no other warpgroup reads these rows;
//   - PERSISTENT: a buffer of its own after the K/V slots (kOStageBytes more shared memory: the instantiation's
//     traits add it to kSmemBytes), since the producer loads the next tile's Q into Q's buffer under this epilogue.
//     Before the warpgroup writes it again, the previous tile's store must have read it (cp.async.bulk.wait_group.read).

// One named barrier per consumer warpgroup for the staging: ids from NamedBarrier::kEnd on.
constexpr int kOStageBarrier = static_cast<int>(NamedBarrier::kEnd);
static_assert(kOStageBarrier + 4 <= 16, "four consumer warpgroups' staging barriers must fit the CTA's 16");

__device__ __forceinline__ void o_stage_sync(int wg) {
    asm volatile("bar.sync %0, 128;\n" ::"r"(kOStageBarrier + wg) : "memory");
}

// The staging rows of warpgroup `wg` (see above).
template <class T>
__device__ __forceinline__ u32 o_stage_addr(u32 sQ, u32 sV, int wg) {
    const u32 base = T::kPersistent ? sV + T::kStages * T::kKVBytes : sQ;
    return base + wg * (64 * 128);
}

// The epilogue of one consumer warpgroup: O / l into its staging rows, then (one thread) TMA stores to the rows
// row0_wg.. of (head, batch). Every thread of the warpgroup calls it.
template <class T>
__device__ __forceinline__ void store_out_tma(const float (&o)[T::kOAcc], const float (&l)[2], const CUtensorMap* o_map,
                                              u32 stage, int wg, int row0_wg, int head, int batch, int warp_in_wg,
                                              int lane) {
    const bool issuer = warp_in_wg == 0 && lane == 0;  // the thread that issues (and so must await) the stores
    if constexpr (T::kPersistent) {
        // The previous query tile's store has read the staging rows (then nobody writes them early).
        if (issuer) bulk_wait_read<0>();
        o_stage_sync(wg);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float inv = 1.f / sum;
        const int row = 16 * warp_in_wg + (lane >> 2) + 8 * r;  // of the warpgroup's 64
        const u32 row_addr = stage + row * 128 + 4 * (lane & 3);
#pragma unroll
        for (int j = 0; j < T::kHeadDim / 8; ++j) {
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
        for (int region = 0; region < T::kRegions; ++region)
            tma_store_4d(o_map, stage + region * (T::kBlockM * 128), 64 * region, row0_wg, head, batch);
        bulk_commit();
        // One tile per CTA: the CTA may leave (and its shared memory be given to another) only once the store has
        // read it. PERSISTENT waits at its next epilogue, or after its last tile.
        if constexpr (!T::kPersistent) bulk_wait_read<0>();
    }
}
