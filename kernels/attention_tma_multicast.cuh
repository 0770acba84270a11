// kv_cluster = 2 or 4 (evotune/problems/attention.py): kv_load = tma with every K/V tile shared by a cluster of
// kv_cluster CTAs, consecutive query tiles of one head. Always included; its templates are instantiated only by the
// `if constexpr (T::kTmaMulticast)` branches of attention.cu (the traits' KV_CLUSTER), which stand in for the plain
// TMA loads' init, first fill and refill (attention_tma_load.cuh, whose barriers, boxes and waits this builds on).
//
// Why: every CTA of a head reads the head's whole K and V. On the mission shape (16 query tiles of 32 rows per head)
// that is 16 MB out of L2 per call for 1 MB of distinct data, and the phase trace of the kv_load = tma winner put
// the later tiles' arrival at ~7.8 TB/s: the copies are bound by L2 bandwidth (docs/TRACE.md). A multicast TMA box
// is read from L2 once and written into the shared memory of every CTA of the cluster, so each CTA loads
// BLOCK_N / kv_cluster rows of every tile, into its own part of the slot, for all of them: L2 traffic for K and V
// divides by kv_cluster.
//
// The pipeline is the plain TMA one (one full mbarrier per slot, armed by each CTA for the whole tile's bytes, since
// every part lands on every CTA's barrier at the same offset), with what sharing slots across CTAs needs:
// - init: the cluster synchronises after its barriers are initialised, before any CTA's multicast can signal a
//   peer's barrier (fence.mbarrier_init.release.cluster, then barrier.cluster arrive.release / wait.acquire);
// - refill: a peer may write slot i % STAGES only after every warp of every CTA of the cluster has read it, so the
//   refill's __syncthreads becomes a cluster barrier. The condition (tile i + STAGES exists) is the cluster's: the
//   CTAs of a cluster have the same tiles (kv_splits = 1). Causal, a CTA's loop runs to the cluster's last row's
//   tile (attention.cu): past its own last row it waits for each tile and takes its part in the refills, but skips
//   the math, so its output is bit for bit that of kv_cluster = 1 (a wholly masked tile would still rescale O by
//   an alpha of ex2(m * s - m * s) that rounds to 1 + ulp);
// - exit: a CTA arrives on the cluster barrier once its loop has waited for every tile (every part destined to it
//   has landed) and waits on it before it exits, so no CTA leaves while a copy it issued is still being written into
//   a peer.
// The grid's x is padded to a multiple of kv_cluster (the launch geometry): a CTA past the last query tile loads its
// parts for the others, computes on Q's zero fill and stores nothing (rows past seq_q are never stored).

template <class T>
struct TmaMulticast {
    static constexpr int kCluster = T::kKVCluster;
    static constexpr int kPartRows = T::kBlockN / kCluster;  // each CTA's box of a K or V tile
    static constexpr u32 kPartBytes = TmaLoad<T>::kKVBytes / kCluster;
    static_assert(kCluster == 2 || kCluster == 4, "kv_cluster: 2 or 4 CTAs share each K/V tile");
    static_assert(kPartBytes % 1024 == 0, "each CTA's part of a tile starts on the 1024-byte swizzle atom");
    static_assert(T::kKVSplits == 1, "kv_cluster: the CTAs of a cluster load the same tiles (no K/V split)");
};

// The first key row past the last query row of this CTA's cluster: a causal cluster's CTAs take its tile count.
template <class T>
__device__ __forceinline__ int tma_cluster_row_end(int q_row0) {
    constexpr int kClusterRows = T::kBlockM * TmaMulticast<T>::kCluster;
    return (q_row0 / kClusterRows + 1) * kClusterRows;
}

// tma_load_init's work, with a cluster barrier for the CTA's: every CTA's barriers are initialised before any
// multicast may signal them.
template <class T>
__device__ __forceinline__ void tma_mc_init(u32 bars, const CUtensorMap* q_map, const CUtensorMap* k_map,
                                            const CUtensorMap* v_map) {
    (void)TmaLoad<T>{};
    (void)TmaMulticast<T>{};
    if (thread_id() == 0) {
#pragma unroll
        for (int s = 0; s < T::kStages; ++s) mbar_init(bars + 8 * s, 1);
        mbar_init_fence();
        tma_prefetch_map(q_map);
        tma_prefetch_map(k_map);
        tma_prefetch_map(v_map);
    }
    cluster_sync();
}

// This CTA's part (rows rank * kPartRows ...) of K and V tile `t`, into the same part of slot `slot` of every CTA of
// the cluster, on each one's barrier of that slot (each CTA armed its own for the whole tile).
template <class T>
__device__ __forceinline__ void tma_mc_load_kv(u32 bars, u32 sK, u32 sV, const CUtensorMap* k_map,
                                               const CUtensorMap* v_map, int slot, int t, int kv_head, int batch) {
    using M = TmaMulticast<T>;
    const u32 rank = cluster_rank();
    const u32 bar = bars + 8 * slot;
    const u32 part = slot * TmaLoad<T>::kKVBytes + rank * M::kPartBytes;
    const unsigned short mask = (1u << M::kCluster) - 1;
    const int row = t * T::kBlockN + static_cast<int>(rank) * M::kPartRows;
    tma_load_4d_multicast(sK + part, k_map, bar, mask, 0, row, kv_head, batch);
    tma_load_4d_multicast(sV + part, v_map, bar, mask, 0, row, kv_head, batch);
}

// tma_load_first with multicast K/V parts; Q stays the CTA's own.
template <class T>
__device__ __forceinline__ void tma_mc_first(u32 bars, u32 sQ, u32 sK, u32 sV, const CUtensorMap* q_map,
                                             const CUtensorMap* k_map, const CUtensorMap* v_map, int q_row0, int head,
                                             int kv_head, int batch, int t_begin, int n_tiles) {
    if (thread_id() != 0 || n_tiles == 0) return;
    mbar_expect_tx(bars, TmaLoad<T>::kQBytes + 2 * TmaLoad<T>::kKVBytes);
    tma_load_4d(sQ, q_map, bars, 0, q_row0, head, batch);
    tma_mc_load_kv<T>(bars, sK, sV, k_map, v_map, 0, t_begin, kv_head, batch);
#pragma unroll
    for (int s = 1; s < T::kStages; ++s) {
        if (s < n_tiles) {
            mbar_expect_tx(bars + 8 * s, 2 * TmaLoad<T>::kKVBytes);
            tma_mc_load_kv<T>(bars, sK, sV, k_map, v_map, s, t_begin + s, kv_head, batch);
        }
    }
}

// tma_refill across the cluster: once every warp of every CTA has read slot i % STAGES, each CTA's thread 0 arms its
// barrier and multicasts its part of tile i + STAGES.
template <class T>
__device__ __forceinline__ void tma_mc_refill(u32 bars, u32 sK, u32 sV, const CUtensorMap* k_map,
                                              const CUtensorMap* v_map, int i, int t_begin, int n_tiles, int kv_head,
                                              int batch) {
    if (i + T::kStages < n_tiles) {
        cluster_sync();
        if (thread_id() == 0) {
            const int slot = i % T::kStages;
            mbar_expect_tx(bars + 8 * slot, 2 * TmaLoad<T>::kKVBytes);
            tma_mc_load_kv<T>(bars, sK, sV, k_map, v_map, slot, t_begin + i + T::kStages, kv_head, batch);
        }
    }
}

// After the loop (every tile this CTA waits for has landed): arrive; before the CTA exits: wait for the cluster.
__device__ __forceinline__ void tma_mc_loads_landed() {
    cluster_arrive_relaxed();
}
__device__ __forceinline__ void tma_mc_exit_wait() {
    cluster_wait();
}
