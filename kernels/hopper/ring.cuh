// evotune: the Hopper kernel's K/V ring (a piece of attention_hopper.cuh, included inside namespace evotune::hopper):
// STAGES slots of a K and a V tile, each with full and empty mbarriers (Barriers; Q's own), the TMA loads into a
// slot (load_kv) and its refill once the consumers released it (refill), and the walks that only release slots:
// an empty warpgroup's (drain_tile, empty_warpgroups = skip) and a warpgroup's tiles past its diagonal
// (pass_masked_tiles, causal_extent = warpgroup).

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

// stripe_order = mirrored (hopper/scheduler.cuh's mirrored_stripe): query tile qi's Q buffer in shared memory, the
// first at sQ, the second at the traits' kQ1Offset.
template <class T>
__device__ __forceinline__ u32 q_buffer(u32 smem_base, int qi) {
    static_assert(T::kQ1Offset % 1024 == 0, "Q's second buffer keeps the 1024-byte swizzle alignment");
    return smem_base + ((qi & 1) ? T::kQ1Offset : 0);
}

// Issue the TMA loads of K (WHICH = 0) or V (1) tile `t` into slot `slot` (one thread). kv_row0: VARLEN's packed row
// of the sequence's first key (packed_row; else unread). A V tile has V's regions (kRegionsV: MLA's V is narrower).
template <class T, int WHICH>
__device__ __forceinline__ void load_kv(const CUtensorMap* map, u32 sKV, Barriers<T>* bars, int slot, int t, int head, int batch,
                                        int kv_row0 = 0) {
    constexpr int kBytes = WHICH == 0 ? T::kKBytes : T::kVBytes;
    const u32 bar = smem_addr(WHICH == 0 ? &bars->k_full[slot] : &bars->v_full[slot]);
    mbar_expect_tx(bar, kBytes);
#pragma unroll
    for (int r = 0; r < (WHICH == 0 ? T::kRegions : T::kRegionsV); ++r)
        tma_load_4d(sKV + slot * kBytes + r * (T::kBlockN * 128), map, bar, 64 * r,
                    packed_row<T>(t * T::kBlockN, kv_row0), head, batch);
}

// Load tile t + STAGES of the walk (key tile kv_first + t + STAGES: a window's walk starts at kv_first) into tile t's slot: K once every consumer warp released tile t's K,
// V once they released its V. K and V are released at different points of the consumer
// loop (K after S, V after the next tile's S), so they are refilled separately: waiting
// for both before loading K would deadlock a one-stage pipeline.
template <class T>
__device__ __forceinline__ void refill(const CUtensorMap* k_map, const CUtensorMap* v_map, u32 sK, u32 sV, Barriers<T>* bars,
                                       int t, int head, int batch, int kv_first = 0, int kv_row0 = 0) {
    // lean_addressing: t is never negative; unsigned, % and / by STAGES need no sign fix-up (at 2 and 4: a mask, a
    // shift).
    const int slot = static_cast<typename T::SlotUse>(t) % T::kStages;
    const u32 parity = (static_cast<typename T::SlotUse>(t) / T::kStages) & 1;
    // Without a window the tile is t + STAGES, written where it was before kLocal existed: a zero kv_first added, or
    // the sum taken above the waits, moved ptxas's choice of uniform registers for the no-producer refill (11 of 63
    // sampled configs' SASS differed).
    mbar_wait(smem_addr(&bars->k_empty[slot]), parity);
    load_kv<T, 0>(k_map, sK, bars, slot, T::kLocal ? kv_first + t + T::kStages : t + T::kStages, head, batch, kv_row0);
    mbar_wait(smem_addr(&bars->v_empty[slot]), parity);
    load_kv<T, 1>(v_map, sV, bars, slot, T::kLocal ? kv_first + t + T::kStages : t + T::kStages, head, batch, kv_row0);
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
