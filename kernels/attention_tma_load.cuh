// kv_load = tma (evotune/problems/attention.py): the mma.sync kernel's Q, K and V tiles arrive by TMA instead of
// cp.async. Always included; its templates are instantiated only by the `if constexpr (T::kTmaLoad)` branches of
// attention.cu (the traits' KV_LOAD: 1, or 2 for tma_split).
//
// Why: with cp.async every thread issues 16-byte copies. On the mission shape (32x128 tiles, 4 compute warps) a CTA
// copies its 4 K and 4 V tiles as 8192 of them, 64 per thread, and the phase trace put ~181 ns of issue on every
// warp's chain per 32 KB refill (docs/TRACE.md). A TMA box is one instruction of one thread for a whole tile, and the
// copy engine writes the layout the kernel's ldmatrix addressing already reads: head dim 64, smem_layout = swizzle
// (16-byte chunk c of row r at chunk c ^ (r & 7), rows of 128 bytes) is TMA's 128-byte swizzle, given tiles that
// start on the 1024-byte swizzle atom. Rows past the sequence come as zeros (the maps' out-of-bounds fill), as
// cp.async's zero-filled copies gave them.
//
// The pipeline: one "full" mbarrier per slot, armed with the transaction bytes of its tiles. Thread 0 fills every
// slot before the loop (Q joins tile 0's barrier); every warp waits on step i's barrier (phase i / STAGES); at the
// end of step i, when tile i + STAGES exists, a __syncthreads tells thread 0 that every warp has read slot
// i % STAGES, and it refills that slot. The condition is the CTA's (n_tiles), so the barrier is uniform, and a
// CTA with no more tiles than STAGES (the mission shape's) has no barrier in its loop at all.
//
// The PTX wrappers (mbarriers, TMA boxes) are ptx.cuh's, shared with the Hopper kernel.

template <class T>
struct TmaLoad {
    static constexpr u32 kQBytes = 2 * T::kQElems;
    static constexpr u32 kKVBytes = 2 * T::kKVElems;
    // The barriers lead the dynamic shared memory, then the tiles start on its next 1024-byte boundary: the
    // instantiation's kSmemBytes adds kExtraBytes to the traits' (evotune/problems/attention.py, tma_load_bytes).
    static constexpr int kBarrierBytes = 8 * T::kStages;
    static constexpr int kExtraBytes = 1024 + kBarrierBytes;
    static_assert(T::kSmemLayout == kSwizzled && T::kHeadDim == 64,
                  "kv_load = tma: rows of 128 bytes in the swizzled layout (TMA's 128-byte swizzle), i.e. head dim 64");
    static_assert(!T::kHasProducers, "kv_load = tma: thread 0 issues the loads (no producer warps)");
    static_assert(kQBytes % 1024 == 0 && kKVBytes % 1024 == 0, "tiles keep the 1024-byte swizzle atom's alignment");
};

// The first 1024-byte boundary after the barriers at the start of the dynamic shared memory: the 128-byte swizzle TMA
// writes is a function of address bits 7-9, which the ldmatrix addressing takes as the row. (In the dynamic shared
// memory, not static: a kernel's static shared memory counts against the same per-block limit, beside the launch's.)
template <class T>
__device__ __forceinline__ unsigned short* tma_aligned_tiles(unsigned char* smem) {
    unsigned char* after = smem + TmaLoad<T>::kBarrierBytes;
    return reinterpret_cast<unsigned short*>(after + ((1024u - (smem_addr(after) & 1023u)) & 1023u));
}

// Thread 0 initialises one full barrier per slot (at `bars`, 8 bytes apart), makes them visible to the copy engine
// and prefetches the three maps' descriptors; then the CTA syncs. Before the pdl wait: nothing here reads memory
// another grid writes (the maps are kernel parameters).
template <class T>
__device__ __forceinline__ void tma_load_init(u32 bars, const CUtensorMap* q_map, const CUtensorMap* k_map,
                                              const CUtensorMap* v_map) {
    (void)TmaLoad<T>{};
    if (thread_id() == 0) {
#pragma unroll
        for (int s = 0; s < T::kStages; ++s) mbar_init(bars + 8 * s, 1);
        mbar_init_fence();
        tma_prefetch_map(q_map);
        tma_prefetch_map(k_map);
        tma_prefetch_map(v_map);
    }
    __syncthreads();
}

// K and V tile `t` (keys t * BLOCK_N ...) into slot `slot`, on that slot's barrier, which the caller armed.
template <class T>
__device__ __forceinline__ void tma_load_kv(u32 bars, u32 sK, u32 sV, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                            int slot, int t, int kv_head, int batch) {
    const u32 bar = bars + 8 * slot;
    tma_load_4d(sK + slot * TmaLoad<T>::kKVBytes, k_map, bar, 0, t * T::kBlockN, kv_head, batch);
    tma_load_4d(sV + slot * TmaLoad<T>::kKVBytes, v_map, bar, 0, t * T::kBlockN, kv_head, batch);
}

// Before the loop, thread 0: Q and tiles t_begin ... into every slot the CTA's n_tiles use. Nothing when the CTA has
// no tile (an empty KV split), whose loop waits on no barrier: every load issued is one the loop waits for, so no
// copy is in flight when the CTA exits.
template <class T>
__device__ __forceinline__ void tma_load_first(u32 bars, u32 sQ, u32 sK, u32 sV, const CUtensorMap* q_map,
                                               const CUtensorMap* k_map, const CUtensorMap* v_map, int q_row0, int head,
                                               int kv_head, int batch, int t_begin, int n_tiles) {
    if (thread_id() != 0 || n_tiles == 0) return;
    mbar_expect_tx(bars, TmaLoad<T>::kQBytes + 2 * TmaLoad<T>::kKVBytes);
    tma_load_4d(sQ, q_map, bars, 0, q_row0, head, batch);
    tma_load_kv<T>(bars, sK, sV, k_map, v_map, 0, t_begin, kv_head, batch);
#pragma unroll
    for (int s = 1; s < T::kStages; ++s) {
        if (s < n_tiles) {
            mbar_expect_tx(bars + 8 * s, 2 * TmaLoad<T>::kKVBytes);
            tma_load_kv<T>(bars, sK, sV, k_map, v_map, s, t_begin + s, kv_head, batch);
        }
    }
}

// Step i's K and V (and at i = 0 Q) have arrived: phase i / STAGES of slot i % STAGES's barrier.
template <class T>
__device__ __forceinline__ void tma_wait_tile(u32 bars, int i) {
    mbar_wait(bars + 8 * (i % T::kStages), (i / T::kStages) & 1);
}

// End of step i: if tile i + STAGES exists, every warp has read slot i % STAGES once all pass the barrier, and
// thread 0 refills it.
template <class T>
__device__ __forceinline__ void tma_refill(u32 bars, u32 sK, u32 sV, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                           int i, int t_begin, int n_tiles, int kv_head, int batch) {
    if (i + T::kStages < n_tiles) {
        __syncthreads();
        if (thread_id() == 0) {
            const int slot = i % T::kStages;
            mbar_expect_tx(bars + 8 * slot, 2 * TmaLoad<T>::kKVBytes);
            tma_load_kv<T>(bars, sK, sV, k_map, v_map, slot, t_begin + i + T::kStages, kv_head, batch);
        }
    }
}
