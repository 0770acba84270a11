// evotune: the decode kernel's paged KV cache (a piece of decode/variants.cuh, inside namespace evotune), traits
// parameter PAGE_SIZE (0: a dense cache; problem trait, not a knob: a shape's `:paged=P`).
//
// The cache is vLLM's / FlashAttention's `flash_attn_with_kvcache` layout: K and V of shape (num_pages, PAGE_SIZE,
// Hkv, D), block_table (B, max_pages_per_seq) int32 and cache_seqlens (B,) int32. Key j of sequence b lives in row
// j % PAGE_SIZE of page block_table[b][j / PAGE_SIZE]; the entry passes the caches viewed as (num_pages, Hkv,
// PAGE_SIZE, D), so its (b, h, s) strides are (page, head, row). Any page size works: a key's row is looked up on its
// own, and where PAGE_SIZE is a multiple of the tile (BLOCK_N keys; tiles start at multiples of it) the whole tile lies
// in one page and a lane looks its page up once per tile, not once per key.
//
// Table entries are read through the read-only path (__ldg): a CTA's lanes read the same few entries, which stay in
// L1. Keys at or past the sequence's length are never looked up: their page may be any number (vLLM pads with 0 or
// garbage), and their rows may hold anything, NaN included (cp_async zero-fills them).
//
// A tile's page ids are read a tile ahead of the copies that need them (TilePages, cp_async_ring): a table load
// issued right before its cp.asyncs put an L1 (at best) or L2 round trip on every tile's issue path, once per key
// where a page is shorter than the tile -- in SASS an LDG, then the offset IMADs, then the LDGSTS, four times over
// per 64-key tile at page 16, with the CTA's 8 warps (1 CTA an SM at 4 stages) all waiting on it. Read while the
// previous tile is computed, the ids have landed when the copies are issued; they cost a register a key (one a tile
// where a tile lies in one page).
//
// kv_load = bulk is not paged (DecodeVariantTraits' static_assert): a head's rows are Hkv * D apart even inside a
// page, so a non-tensor bulk copy moves one 256-byte row (d128), and cp.async.bulk takes its addresses in uniform
// registers: a warp's 32 lanes' copies are issued one lane at a time (a loop over the lanes in SASS), 2 x BLOCK_N
// copies a tile from one producer warp. Measured on the H200: 278 us against cp_async's 94 at B=8 8k page 16, 72 us
// against 22 (dense, whole-tile copies) at B=1 16k. Whole-page-run copies need a TMA tensor map over the
// (num_pages * PAGE_SIZE, Hkv, D) cache (one box of up to PAGE_SIZE rows of one head a copy), which this piece does
// not build.

template <class T>
struct PagedCache {
    const int* table;             // this sequence's row of block_table
    long long k_sp, v_sp;         // page strides of K and V (elements)
    long long k_ss, v_ss;         // row strides inside a page (Hkv * D for a contiguous cache)

    __device__ __forceinline__ int page_of(int key) const { return __ldg(table + key / T::kPageSize); }

    // Offsets (elements) of key's K and V rows in `page` from this K/V head's base.
    __device__ __forceinline__ long long k_off(int page, int key) const {
        return page * k_sp + (key % T::kPageSize) * k_ss;
    }
    __device__ __forceinline__ long long v_off(int page, int key) const {
        return page * v_sp + (key % T::kPageSize) * v_ss;
    }
};

// The page ids of the keys one lane copies in one tile: one where PAGE_SIZE is a multiple of the tile (BLOCK_N keys;
// tiles start at multiples of it, so the tile lies in one page), else one per key of its group (UNROLL).
template <class T>
struct TilePages {
    static constexpr bool kOnePage = T::kPageSize % T::kBlockN == 0;
    int id[kOnePage ? 1 : T::kUnroll];
};

// This lane's page ids of the tile at tile_start, as loads in flight: nothing waits on them until issue_tile_paged.
// A key at or past key_end gets page 0, unread (its copy zero-fills). No-op on a dense cache.
template <class T>
__device__ __forceinline__ void load_tile_pages(const PagedCache<T>& pc, int tile_start, int key_end, int group,
                                                TilePages<T>& pages) {
    if constexpr (T::kPaged) {
        if constexpr (TilePages<T>::kOnePage) {
            pages.id[0] = tile_start < key_end ? pc.page_of(tile_start) : 0;
        } else {
#pragma unroll
            for (int u = 0; u < T::kUnroll; ++u) {
                const int key = tile_start + u * T::kGroups + group;
                pages.id[u] = key < key_end ? pc.page_of(key) : 0;
            }
        }
    }
}

// issue_tile (attention_decode.cu) through the page table: this lane's cp.asyncs of one tile's K and V rows into ring
// slot `stage`, at the page ids load_tile_pages read for this tile. k and v are this K/V head's base plus the lane's
// column d0.
template <class T>
__device__ __forceinline__ void issue_tile_paged(unsigned int ring, int stage, const unsigned short* k,
                                                 const unsigned short* v, const PagedCache<T>& pc,
                                                 const TilePages<T>& pages, int tile_start, int key_end, int group,
                                                 int d0) {
    if (!active_lane<T>(d0)) return;  // idle padding: its columns are not in the rows
#pragma unroll
    for (int u = 0; u < T::kUnroll; ++u) {
        const int slot = u * T::kGroups + group;
        const int key = tile_start + slot;
        const bool valid = key < key_end;
        long long ko = 0, vo = 0;
        if (valid) {
            const int p = pages.id[TilePages<T>::kOnePage ? 0 : u];
            ko = pc.k_off(p, key);
            vo = pc.v_off(p, key);
        }
        const unsigned int dst = ring + (stage * 2 * T::kTileBytes) + (slot * T::kHeadDim + d0) * 2;
        cp_async_vec<T::kVecBytes>(dst, k + ko, valid);
        cp_async_vec<T::kVecBytes>(dst + T::kTileBytes, v + vo, valid);
    }
}
