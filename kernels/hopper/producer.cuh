// evotune: the Hopper kernel's producer (a piece of attention_hopper.cuh, included inside namespace evotune::hopper,
// after the ring and the scheduler): what the loader thread issues. One tile per CTA: Q and the first STAGES K/V
// tiles before the consumers start (load_first_tiles), then, with a producer warpgroup, each later tile into the slot
// its consumers released (refill_tiles; without one, the consumer loop refills). Persistent: the loop over the
// scheduler's query tiles (produce_tiles), each tile's K/V into the ring's slots as they free, its Q after its first
// K (load_q), and with tiles handed out the consumers' stop signal after the last (hand_out_end).

// One tile per CTA, the loader: Q of tile w on q_full, K/V tiles 0 .. min(n_tiles, STAGES) - 1 of its walk (key tiles
// kv_first + t) into their slots. rows: VARLEN's packed first rows of the tile's sequence (packed_row; else unread).
template <class T>
__device__ __forceinline__ void load_first_tiles(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                                 const CUtensorMap* v_map, u32 sQ, u32 sK, u32 sV, Barriers<T>* bars,
                                                 const QTile& w, int kv_head, int n_tiles, int kv_first,
                                                 const SeqRows& rows = SeqRows{0, 0}) {
    const u32 qb = smem_addr(&bars->q_full);
    mbar_expect_tx(qb, T::kQBytes);
#pragma unroll
    for (int r = 0; r < T::kRegions; ++r)
        tma_load_4d(sQ + r * (T::kBlockM * 128), q_map, qb, 64 * r, packed_row<T>(w.row0, rows.q), w.head, w.batch);
    for (int t = 0; t < min(n_tiles, T::kStages); ++t) {
        load_kv<T, 0>(k_map, sK, bars, t, kv_first + t, kv_head, w.batch, rows.k);
        load_kv<T, 1>(v_map, sV, bars, t, kv_first + t, kv_head, w.batch, rows.k);
    }
}

// One tile per CTA with a producer warpgroup, the loader: every later K/V tile into the slot released before it.
template <class T>
__device__ __forceinline__ void refill_tiles(const CUtensorMap* k_map, const CUtensorMap* v_map, u32 sK, u32 sV,
                                             Barriers<T>* bars, int kv_head, int batch, int n_tiles, int kv_first,
                                             int kv_row0 = 0) {
    for (int t = 0; t + T::kStages < n_tiles; ++t)
        refill<T>(k_map, v_map, sK, sV, bars, t, kv_head, batch, kv_first, kv_row0);
}

// Persistent: query tile qi's Q (tile w). Q comes after the tile's first K: that K's slot was released a few K/V
// tiles back, Q's buffer only after the previous tile's last Q K^T (or once it was in registers).
template <class T>
__device__ __forceinline__ void load_q(const CUtensorMap* q_map, u32 sQ, u32 smem_base, Barriers<T>* bars, int qi,
                                       const QTile& w) {
    if constexpr (T::kStripeMirror) {
        // Into buffer qi & 1, once every consumer warp released tile qi - 2's Q there.
        if (qi > 1) mbar_wait(smem_addr(&bars->q_buf_empty[qi & 1]), ((qi - 2) >> 1) & 1);
        const u32 qb = smem_addr(&bars->q_buf_full[qi & 1]);
        mbar_expect_tx(qb, T::kQBytes);
        const u32 q_dst = q_buffer<T>(smem_base, qi);
#pragma unroll
        for (int r = 0; r < T::kRegions; ++r)
            tma_load_4d(q_dst + r * (T::kBlockM * 128), q_map, qb, 64 * r, w.row0, w.head, w.batch);
    } else {
        if (qi > 0) mbar_wait(smem_addr(&bars->q_empty), (qi - 1) & 1);
        const u32 qb = smem_addr(&bars->q_full);
        mbar_expect_tx(qb, T::kQBytes);
#pragma unroll
        for (int r = 0; r < T::kRegions; ++r)
            tma_load_4d(sQ + r * (T::kBlockM * 128), q_map, qb, 64 * r, w.row0, w.head, w.batch);
    }
}

// Persistent, tiles handed out: no tile left. Hand the consumers -1 (their signal to stop) with a bare arrival, once
// q_full's previous phase is complete (seen through q_empty), then retire from the counter.
template <class T>
__device__ __forceinline__ void hand_out_end(Barriers<T>* bars, int (&handed)[TileHandout<T>::kEntries], int qi,
                                             unsigned* tile_counter) {
    hand_tile<T>(handed, qi, -1);
    if constexpr (T::kStripeMirror) {
        if (qi > 1) mbar_wait(smem_addr(&bars->q_buf_empty[qi & 1]), ((qi - 2) >> 1) & 1);
        mbar_arrive(smem_addr(&bars->q_buf_full[qi & 1]));
    } else {
        if (qi > 0) mbar_wait(smem_addr(&bars->q_empty), (qi - 1) & 1);
        mbar_arrive(smem_addr(&bars->q_full));
    }
    retire_tile_counter(tile_counter);
}
