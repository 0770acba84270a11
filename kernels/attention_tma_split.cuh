// kv_load = tma_split (evotune/problems/attention.py): kv_load = tma with K and V of each slot on mbarriers of their
// own, so that a step's Q K^T starts once K (and at step 0 Q) has landed while V is still on its way; P V waits for V.
// Always included; its templates are instantiated only by the `if constexpr (T::kTmaSplit)` branches of attention.cu
// (the traits' KV_LOAD = 2), which stand in for the plain TMA loads' init, first fill, wait and refill
// (attention_tma_load.cuh, whose boxes and waits this builds on).
//
// Why: the TMA winner's phase trace (docs/TRACE.md) spends ~0.6 us of each CTA's chain between the end of its
// prologue and Q with tile 0 resident, and then waits 100-170 ns for each later tile. Every CTA issues Q and its
// first STAGES tiles at once, and they share the SM's inbound bandwidth; one barrier per slot makes Q K^T wait for
// V as well, though V is read only after the softmax. With K first in issue order and on its own barrier, Q K^T and
// the softmax (~450 ns a step) overlap V's arrival.
//
// Barriers: K's of slot s at + 8 s, V's at + 8 (STAGES + s); both armed by thread 0 for their tile's bytes (K's of
// slot 0 also for Q's), both waited on with the step's parity. A refill is issued where kv_load = tma issues it: at
// the end of step i, after the __syncthreads that says every warp has read slot i % STAGES (K and V).

template <class T>
struct TmaSplit {
    static constexpr int kBarrierBytes = 16 * T::kStages;
    static constexpr int kExtraBytes = 1024 + kBarrierBytes;
};

// The first 1024-byte boundary after the 2 STAGES barriers at the start of the dynamic shared memory.
template <class T>
__device__ __forceinline__ unsigned short* tma_split_aligned_tiles(unsigned char* smem) {
    unsigned char* after = smem + TmaSplit<T>::kBarrierBytes;
    return reinterpret_cast<unsigned short*>(after + ((1024u - (smem_addr(after) & 1023u)) & 1023u));
}

// tma_load_init's work for 2 STAGES barriers.
template <class T>
__device__ __forceinline__ void tma_split_init(u32 bars, const CUtensorMap* q_map, const CUtensorMap* k_map,
                                               const CUtensorMap* v_map) {
    (void)TmaLoad<T>{};
    if (thread_id() == 0) {
#pragma unroll
        for (int s = 0; s < 2 * T::kStages; ++s) mbar_init(bars + 8 * s, 1);
        mbar_init_fence();
        tma_prefetch_map(q_map);
        tma_prefetch_map(k_map);
        tma_prefetch_map(v_map);
    }
    __syncthreads();
}

// Thread 0: K tile `t` into slot `slot` on K's barrier, then V on V's (K first: it is read first). `extra` bytes ride
// on K's barrier (Q's, at step 0), whose box the caller issued.
template <class T>
__device__ __forceinline__ void tma_split_load_kv(u32 bars, u32 sK, u32 sV, const CUtensorMap* k_map,
                                                  const CUtensorMap* v_map, int slot, int t, int kv_head, int batch,
                                                  u32 extra = 0) {
    const u32 k_bar = bars + 8 * slot, v_bar = bars + 8 * (T::kStages + slot);
    mbar_expect_tx(k_bar, TmaLoad<T>::kKVBytes + extra);
    mbar_expect_tx(v_bar, TmaLoad<T>::kKVBytes);
    tma_load_4d(sK + slot * TmaLoad<T>::kKVBytes, k_map, k_bar, 0, t * T::kBlockN, kv_head, batch);
    tma_load_4d(sV + slot * TmaLoad<T>::kKVBytes, v_map, v_bar, 0, t * T::kBlockN, kv_head, batch);
}

// tma_load_first with K and V on their own barriers: Q, then K0, V0, K1, V1, ... (Q on K0's barrier).
template <class T>
__device__ __forceinline__ void tma_split_first(u32 bars, u32 sQ, u32 sK, u32 sV, const CUtensorMap* q_map,
                                                const CUtensorMap* k_map, const CUtensorMap* v_map, int q_row0,
                                                int head, int kv_head, int batch, int t_begin, int n_tiles) {
    if (thread_id() != 0 || n_tiles == 0) return;
    tma_load_4d(sQ, q_map, bars, 0, q_row0, head, batch);
    tma_split_load_kv<T>(bars, sK, sV, k_map, v_map, 0, t_begin, kv_head, batch, TmaLoad<T>::kQBytes);
#pragma unroll
    for (int s = 1; s < T::kStages; ++s)
        if (s < n_tiles) tma_split_load_kv<T>(bars, sK, sV, k_map, v_map, s, t_begin + s, kv_head, batch);
}

// Step i's K (and at i = 0 Q) has landed; then, before P V, its V.
template <class T>
__device__ __forceinline__ void tma_split_wait_k(u32 bars, int i) {
    mbar_wait(bars + 8 * (i % T::kStages), (i / T::kStages) & 1);
}
template <class T>
__device__ __forceinline__ void tma_split_wait_v(u32 bars, int i) {
    mbar_wait(bars + 8 * (T::kStages + i % T::kStages), (i / T::kStages) & 1);
}

// tma_refill with both barriers of the slot.
template <class T>
__device__ __forceinline__ void tma_split_refill(u32 bars, u32 sK, u32 sV, const CUtensorMap* k_map,
                                                 const CUtensorMap* v_map, int i, int t_begin, int n_tiles,
                                                 int kv_head, int batch) {
    if (i + T::kStages < n_tiles) {
        __syncthreads();
        if (thread_id() == 0)
            tma_split_load_kv<T>(bars, sK, sV, k_map, v_map, i % T::kStages, t_begin + i + T::kStages, kv_head, batch);
    }
}
