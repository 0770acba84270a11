// evotune: the Hopper kernel's tile scheduler (a piece of attention_hopper.cuh, included inside namespace
// evotune::hopper): which query tiles a CTA computes, and in which order.
//   - one tile: without PERSISTENT the grid is (query tile, head, batch) and a CTA computes the tile of its blockIdx
//     (grid_tile);
//   - strided persistent: a grid of at most one CTA per SM; CTA b takes tile b of persistent_tile's order, then
//     b + gridDim.x, ... (non-causal: the tiles are all alike);
//   - counter: causal tiles differ up to seq_k / BLOCK_N-fold, and a fixed share ran 10% slower than one tile per CTA
//     on the H100 (llama-4k and long-16k causal), so each CTA's producer asks a global counter for its next tile
//     (FlashAttention-3's dynamic scheduler for causal) and hands it to its consumers with the Q load (also with
//     empty_warpgroups = skip, see TileHandout::kDynamic);
//   - stripe order: which 64-row stripe of its tile each consumer warpgroup computes (mirrored_stripe).

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
    const long long kv_bytes = 2ll * (T::kHeadDim + T::kHeadDimV) * seq_k;  // K and V of one K/V head, 2 bytes an element
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

// ---- window tile range (plain C++: tests/test_softcap_window.py compiles it with the host compiler)
// A query tile's K/V tiles (FlashAttention-3's n_block_min / n_block_max). Without a window: 0 to kv_tile_count. With one:
// only those some row of the tile sees, so the tiles wholly outside the window are never loaded nor computed (masking
// them instead only adds work: no knob). A tile none of whose rows sees a key (a window ending before key 0, or rows
// past the keys) still walks one tile, masked whole, so the producer/consumer protocol keeps its one-tile minimum and
// the rows come out 0 (their sum is 0: the epilogue writes 0, as flash-attention does).
template <class T>
__device__ __forceinline__ KvRange kv_tile_range(int q_row0, int seq_k, const KvWindow& win) {
    if constexpr (!T::kLocal) {
        return {0, kv_tile_count<T>(q_row0, seq_k)};
    } else {
        const int lo = max(0, q_row0 + win.diag - win.left);  // the first row's first key
        // Past the last row's last key. A ragged last tile's padding rows widen nothing: bottom-right aligned, the
        // last real row's window already reaches key seq_k - 1.
        int end = min(seq_k, q_row0 + T::kBlockM + win.diag + win.right);
        if constexpr (T::kIsCausal) end = min(end, q_row0 + T::kBlockM);
        const int first = lo / T::kBlockN;
        const int last = (end + T::kBlockN - 1) / T::kBlockN;  // one past
        if (last > first) return {first, last - first};
        return {min(first, max(0, (seq_k - 1) / T::kBlockN)), 1};
    }
}
// ---- end of the window tile range

// One tile per CTA: the grid's (x, y, z) = (query tile, head, batch).
template <class T>
__device__ __forceinline__ QTile grid_tile() {
    return {static_cast<int>(blockIdx.x) * T::kBlockM, static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.z)};
}

// A persistent CTA walks persistent_tile's order. Its producer starts at blockIdx.x, loads each tile and asks for
// the next (next_tile); with kDynamic it hands each tile to the consumers first (hand_tile), and after the last one
// hands them -1 and retires (retire_tile_counter). The consumers walk the same sequence: computed (strided) or read
// with each Q (handed_tile). (Free functions over the kernel's own locals: a scheduler object holding the order's
// sizes compiled to different SASS, its loads and compares reordered.)
template <class T>
struct TileHandout {
    // empty_warpgroups = skip: the non-causal tiles are handed out too. A head's last query tile, whose empty
    // warpgroups skip it, costs less than a full one; with the fixed stride every CTA would take tiles of one
    // row block only (132 SMs and 6 row blocks on gpt2), so some CTAs would get only the cheap ones and the
    // launch would last as long as the full ones. Handed out in persistent_tile's order, each head's tiles
    // stay together (its K/V in L2); an order with every thin tile last measured 2.5-4% slower on gpt2.
    static constexpr bool kDynamic = T::kIsCausal || T::kSkipEmpty;
    // kDynamic: per Q load, its query tile (or -1: none left) in the CTA's shared entries, query tile qi's at
    // qi % kEntries. stripe_order = mirrored: four entries. The producer writes tile qi's at the top of tile qi,
    // before it awaits anything there. Its last reader was tile qi - 4's: each consumer warp reads before it
    // releases that tile's Q, and the producer awaited the release (q_buf_empty) at tile qi - 2's Q load. With two
    // entries the last reader would be tile qi - 2's, whose release is awaited only at tile qi's Q load.
    static constexpr int kEntries = T::kStripeMirror ? 4 : 2;
};

// Producer, at the top of query tile qi (before it awaits anything there): the tile (or -1) for the consumers.
// Both sides use atomics: the mbarriers order them, but compute-sanitizer's racecheck does not model mbarrier
// waits and reports plain accesses here as a race (measured); it leaves atomic ones alone.
template <class T>
__device__ __forceinline__ void hand_tile(int (&entries)[TileHandout<T>::kEntries], int qi, int work) {
    if constexpr (TileHandout<T>::kDynamic) atomicExch(&entries[qi & (TileHandout<T>::kEntries - 1)], work);
}
// Producer, after loading a tile's K/V: the next tile. Counter: asked for only now, when this CTA is about to run
// out of queued work (one tile asked for earlier could sit here while another CTA idles at the end of the
// launch); the answer's latency hides under the wait for the next free slot.
template <class T>
__device__ __forceinline__ int next_tile(unsigned* tile_counter, int work) {
    if constexpr (TileHandout<T>::kDynamic) return static_cast<int>(atomicAdd(tile_counter, 1u) + gridDim.x);
    else return work + gridDim.x;
}
// Producer, kDynamic, once refused: every CTA asks until it is refused, then counts itself done; the last one done
// knows no CTA of this launch will ask again and zeroes both counters for the next launch.
__device__ __forceinline__ void retire_tile_counter(unsigned* tile_counter) {
    __threadfence();
    if (atomicAdd(tile_counter + 1, 1u) == gridDim.x - 1) {
        atomicExch(tile_counter, 0u);
        atomicExch(tile_counter + 1, 0u);
    }
}
// Consumers, kDynamic, once tile qi's Q load completed: its tile, one read per warp, broadcast.
template <class T>
__device__ __forceinline__ int handed_tile(int (&entries)[TileHandout<T>::kEntries], int qi, int tid) {
    int entry = 0;
    if ((tid & 31) == 0) entry = atomicAdd(&entries[qi & (TileHandout<T>::kEntries - 1)], 0);
    return __shfl_sync(0xffffffffu, entry, 0);
}

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
