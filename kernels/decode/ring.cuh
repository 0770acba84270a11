// evotune: the decode kernel's K/V rings (a piece of decode/variants.cuh, inside namespace evotune), knob kv_load.
// A ring slot holds one tile's K rows, then its V rows (attention_decode.cu's layout): row r of a slot is key
// tile_start + r, which consume_tile reads as key group g's key u at row u * GROUPS + g.
//
//   cp_async  attention_decode.cu's ring: every consumer lane copies the 16 (or 8) bytes it later reads and waits
//             for its own copies (cp.async.wait_group), no barrier; STAGES - 1 tiles in flight while one is
//             computed, refilled by the consumers between tiles (4 + 4 LDGSTS a lane per 64-key d128 tile).
//   bulk      a producer warp, the CTA's last, issues cp.async.bulk copies: one per tile of K and one of V where the
//             cache is dense along the keys (sequence stride = head dim, a (B, H, S, D) cache), else one per row
//             (its lanes take a row each). A slot completes on its `full` mbarrier (expect_tx: both tiles' bytes)
//             and comes back on its `empty` mbarrier, to which every consumer thread arrives once it has read the
//             tile. So all STAGES tiles are in flight from the kernel's first instructions, ahead of Q's loads, and
//             the consumers issue no copies: STAGES x 2 x BLOCK_N x HEAD_DIM x 2 bytes per CTA in flight (4 x 32 KB
//             at 64-key d128 tiles) where cp_async keeps (STAGES - 1) of them.
// A paged cache (PAGE_SIZE > 0, decode/paged.cuh) reads each row through the page table, cp_async's lanes by
// issue_tile_paged at page ids read a tile ahead; bulk is not paged (decode/paged.cuh says why).
// Rows past the cache's end (the last split's last tile) are not left stale in the bulk ring: they copy the cache's
// last row, whose score the consumer masks, so its V meets a zero probability as a finite value (0 x a stale NaN
// would be NaN; cp_async zero-fills them instead).

// ---------------------------------------------------------------- cp_async

// One tile's copies into ring slot `stage`: attention_decode.cu's issue_tile on a dense cache, issue_tile_paged
// (decode/paged.cuh) through the page table at the tile's page ids.
template <class T>
__device__ __forceinline__ void issue_kv_tile(unsigned int ring, int stage, const unsigned short* kb,
                                              const unsigned short* vb, long long k_ss, long long v_ss,
                                              const PagedCache<T>& pc, const TilePages<T>& pages, int tile_start,
                                              int key_end, int group, int d0) {
    if constexpr (T::kPaged) {
        issue_tile_paged<T>(ring, stage, kb, vb, pc, pages, tile_start, key_end, group, d0);
    } else {
        issue_tile<T>(ring, stage, kb, vb, k_ss, v_ss, tile_start, key_end, group, d0);
    }
}

// attention_decode.cu's loop over the chunk's tiles: each lane issues its copies STAGES - 1 tiles ahead and consumes
// tile t once its own copies of it have landed. A paged cache's page ids of the next tile to issue are read as the
// tile before it is issued, so their loads fly under a tile's math (decode/paged.cuh); a dense cache reads none.
template <class T>
__device__ __forceinline__ void cp_async_ring(unsigned char* smem, const unsigned short* kb, const unsigned short* vb,
                                              long long k_ss, long long v_ss, const PagedCache<T>& pc, KeyRange keys,
                                              int causal_edge, int group, int d0, RowState<T>& st) {
    const unsigned int ring = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
    const unsigned short* ring_ptr = reinterpret_cast<const unsigned short*>(smem);
    const int tiles = (keys.end - keys.begin + T::kBlockN - 1) / T::kBlockN;
    TilePages<T> next;  // the page ids of the next tile to issue
    load_tile_pages<T>(pc, keys.begin, keys.end, group, next);
#pragma unroll
    for (int s = 0; s < T::kStages - 1; ++s) {
        if (s < tiles) {
            issue_kv_tile<T>(ring, s, kb, vb, k_ss, v_ss, pc, next, keys.begin + s * T::kBlockN, keys.end, group, d0);
            load_tile_pages<T>(pc, keys.begin + (s + 1) * T::kBlockN, keys.end, group, next);
        }
        cp_async_commit();  // empty groups too: wait_group counts groups, one per tile
    }
    for (int t = 0; t < tiles; ++t) {
        const int ahead = t + T::kStages - 1;
        if (ahead < tiles) {
            issue_kv_tile<T>(ring, ahead % T::kStages, kb, vb, k_ss, v_ss, pc, next, keys.begin + ahead * T::kBlockN,
                             keys.end, group, d0);
            load_tile_pages<T>(pc, keys.begin + (ahead + 1) * T::kBlockN, keys.end, group, next);
        }
        cp_async_commit();
        cp_async_wait<T::kStages - 1>();
        consume_tile<T>(ring_ptr + (t % T::kStages) * T::kTileBytes, keys.begin + t * T::kBlockN, keys.end,
                        causal_edge, group, d0, st.qf, st.m, st.l, st.acc);
    }
    cp_async_wait<0>();
}

// ---------------------------------------------------------------- bulk

// One contiguous run of global memory (16-byte aligned, a multiple of 16 bytes) into this CTA's shared memory at
// `dst`, completing its bytes on the mbarrier at `bar`: the non-tensor bulk copy, which needs no tensor map. Not in
// ptx.cuh, whose text the attention kernels' recorded sources inline and whose kernels copy by tensor maps.
__device__ __forceinline__ void bulk_copy(unsigned int dst, const void* src, unsigned int bytes, unsigned int bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}

// The bulk ring's mbarriers: `full` (one arrival, the producer's expect_tx, plus the slot's bytes) and `empty` (one
// arrival per consumer thread) per slot, 8 bytes each in static shared memory; constructing it initialises them.
template <class T>
struct BulkRing {
    unsigned int ring, full, empty;
    const unsigned short* ring_ptr;

    __device__ __forceinline__ BulkRing(unsigned char* smem, unsigned long long* bars)
        : ring(static_cast<unsigned int>(__cvta_generic_to_shared(smem))),
          full(static_cast<unsigned int>(__cvta_generic_to_shared(bars))), empty(full + 8 * T::kStages),
          ring_ptr(reinterpret_cast<const unsigned short*>(smem)) {
        if (threadIdx.x == 0) {
#pragma unroll
            for (int s = 0; s < T::kStages; ++s) {
                ptx::mbar_init(full + 8 * s, 1);
                ptx::mbar_init(empty + 8 * s, T::kConsumerThreads);
            }
            ptx::mbar_init_fence();  // the initialised barriers visible to the copy engine
        }
        __syncthreads();
    }

    // The producer warp: every tile of the chunk into slot t % STAGES once the consumers have handed it back.
    // k and v are this K/V head's cache (row 0, column 0), seq_k its keys.
    __device__ __forceinline__ void produce(const unsigned short* k, const unsigned short* v, long long k_ss,
                                            long long v_ss, KeyRange keys, int seq_k, int lane) const {
        const bool dense = k_ss == T::kHeadDim && v_ss == T::kHeadDim;
        const int tiles = (keys.end - keys.begin + T::kBlockN - 1) / T::kBlockN;
        for (int t = 0; t < tiles; ++t) {
            const int slot = t % T::kStages;
            const unsigned int bar = full + 8 * slot;
            // The slot's previous tile (t - STAGES) has been read by every consumer thread.
            if (t >= T::kStages) ptx::mbar_wait(empty + 8 * slot, (t / T::kStages - 1) & 1);
            if (lane == 0) ptx::mbar_expect_tx(bar, 2 * T::kTileBytes);
            __syncwarp();  // the slot's bytes are expected before any lane's copy of it can complete
            const int start = keys.begin + t * T::kBlockN;
            const unsigned int dst = ring + slot * 2 * T::kTileBytes;
            if (dense && start + T::kBlockN <= seq_k) {
                if (lane == 0) {
                    bulk_copy(dst, k + static_cast<long long>(start) * T::kHeadDim, T::kTileBytes, bar);
                    bulk_copy(dst + T::kTileBytes, v + static_cast<long long>(start) * T::kHeadDim, T::kTileBytes, bar);
                }
            } else {
                for (int r = lane; r < T::kBlockN; r += 32) {
                    const long long row = min(start + r, seq_k - 1);
                    bulk_copy(dst + r * T::kRowBytes, k + row * k_ss, T::kRowBytes, bar);
                    bulk_copy(dst + T::kTileBytes + r * T::kRowBytes, v + row * v_ss, T::kRowBytes, bar);
                }
            }
        }
    }

    // A consumer thread: each tile once its slot is full, then the slot handed back (this thread's reads of it are
    // done: mbarrier.arrive releases them).
    __device__ __forceinline__ void consume(KeyRange keys, int causal_edge, int group, int d0, RowState<T>& st) const {
        const int tiles = (keys.end - keys.begin + T::kBlockN - 1) / T::kBlockN;
        for (int t = 0; t < tiles; ++t) {
            const int slot = t % T::kStages;
            ptx::mbar_wait(full + 8 * slot, (t / T::kStages) & 1);
            consume_tile<T>(ring_ptr + slot * T::kTileBytes, keys.begin + t * T::kBlockN, keys.end, causal_edge, group,
                            d0, st.qf, st.m, st.l, st.acc);
            ptx::mbar_arrive(empty + 8 * slot);
        }
    }
};
