// evotune: the decode kernel's variants, for configs with a knob of DecodeVariantTraits off its default (kv_load bulk,
// combine acq_rel, split_chunks even) and for shapes with attention sinks or a paged KV cache (problem traits SINKS and
// PAGE_SIZE). DecodeProblem.instantiation appends this header (inlined) after attention_decode.cu for those only, so
// a config at the defaults on a dense shape without sinks instantiates that file's decode_attention and its source,
// which every recorded decode run and tuning-table entry names by digest, stays what it was.
//
// decode_attention_variant is attention_decode.cu's decode_attention composed of pieces, with its tile algebra reused
// (load_q, issue_tile, consume_tile, store_o):
//   chunk of keys   split_keys          ceil | even                                   (decode/combine.cuh)
//   K/V ring        cp_async_ring       cp_async | bulk: BulkRing, a producer warp     (decode/ring.cuh)
//   group merge     stash_group, merged_element                                       (decode/combine.cuh)
//   split combine   combine_fenced      fenced | acq_rel: last_to_publish, combine_splits (decode/combine.cuh)
//   row finish      row_scale           1 / sum | the sink's term in the denominator, once (decode/combine.cuh)
//   key addressing  issue_kv_tile       dense rows | PagedCache, TilePages: the block_table (decode/paged.cuh)
// Variant pairs are tied by the traits' static_asserts; the space (search_spaces/attention-decode.yaml) admits a knob
// off its default only where it changes something.

namespace evotune {

// The attention kernels' PTX wrappers (mbarriers and fences), one copy, in a namespace of their own: attention_decode.cu
// defines cp_async_commit and cp_async_wait, which ptx.cuh also does.
namespace ptx {
typedef unsigned int u32;
typedef unsigned long long u64;
#include "ptx.cuh"
}  // namespace ptx

enum DecodeLoad { kLoadCpAsync = 0, kLoadBulk = 1 };
enum DecodeCombine { kCombineFenced = 0, kCombineAcqRel = 1 };
enum DecodeChunks { kChunksCeil = 0, kChunksEven = 1 };

// SINKS and PAGE_SIZE are problem traits (the shape's :sinks and :paged=P), last and defaulted, so the variant knobs'
// instantiations without them read as before.
template <int HEAD_DIM_, int GROUP_, int SEQ_Q_, int WARPS_, int VEC_, int UNROLL_, int STAGES_, int SPLITS_,
          bool IS_BF16_, bool CAUSAL_, int KV_LOAD_, int COMBINE_, int CHUNKS_, bool SINKS_ = false,
          int PAGE_SIZE_ = 0>
struct DecodeVariantTraits
    : DecodeTraits<HEAD_DIM_, GROUP_, SEQ_Q_, WARPS_, VEC_, UNROLL_, STAGES_, SPLITS_, IS_BF16_, CAUSAL_> {
    typedef DecodeTraits<HEAD_DIM_, GROUP_, SEQ_Q_, WARPS_, VEC_, UNROLL_, STAGES_, SPLITS_, IS_BF16_, CAUSAL_> Base;
    static constexpr int kLoad = KV_LOAD_;
    static constexpr int kCombine = COMBINE_;
    static constexpr int kChunks = CHUNKS_;
    static constexpr bool kBulk = kLoad == kLoadBulk;
    // WARPS consumer warps (the key groups); kv_load = bulk adds a producer warp after them.
    static constexpr int kConsumerThreads = 32 * Base::kWarps;
    static constexpr int kThreads = kConsumerThreads + (kBulk ? 32 : 0);
    static constexpr int kRowBytes = Base::kHeadDim * 2;  // one key's K (or V) row
    // Attention sinks: a per-query-head logit joins each row's softmax denominator (row_scale).
    static constexpr bool kSinks = SINKS_;
    // A paged KV cache of PAGE_SIZE keys a page (decode/paged.cuh); 0: a dense (B, H, S, D)-viewed cache.
    static constexpr int kPageSize = PAGE_SIZE_;
    static constexpr bool kPaged = PAGE_SIZE_ > 0;

    static_assert(kLoad == kLoadCpAsync || kLoad == kLoadBulk, "KV_LOAD is 0 (cp_async) or 1 (bulk)");
    static_assert(kCombine == kCombineFenced || kCombine == kCombineAcqRel, "COMBINE is 0 (fenced) or 1 (acq_rel)");
    static_assert(kChunks == kChunksCeil || kChunks == kChunksEven, "CHUNKS is 0 (ceil) or 1 (even)");
    static_assert(kCombine == kCombineFenced || Base::kSplits > 1, "combine = acq_rel combines splits: SPLITS > 1");
    static_assert(kChunks == kChunksCeil || Base::kSplits > 1, "split_chunks = even deals tiles to splits: SPLITS > 1");
    static_assert(kRowBytes % 16 == 0 && Base::kTileBytes % 16 == 0, "bulk copies move whole 16-byte units");
    static_assert(2 * Base::kTileBytes < (1 << 20), "a slot's bytes fit an mbarrier's transaction count");
    static_assert(PAGE_SIZE_ >= 0 && PAGE_SIZE_ <= 65536, "PAGE_SIZE is 0 (dense) or 1 to 65536 keys a page");
    static_assert(!(kBulk && kPaged), "kv_load = bulk reads a dense cache: a paged one takes cp_async (decode/paged.cuh)");
};

// The runtime inputs of the problem traits, null where the traits are off: `sinks` (Hq float32 logits, SINKS), and
// the page table (PAGE_SIZE): block_table (row b at block_table + b * bt_sb) and cache_seqlens (B int32).
struct DecodeExtras {
    const float* sinks;
    const int* block_table;
    long long bt_sb;
    const int* cache_seqlens;
};

// The key range of one CTA's split: keys begin .. end - 1.
struct KeyRange {
    int begin, end;
};

// A consumer lane's registers: its VEC columns of every row's query (times scale * log2 e), and its key group's running
// row max, row sum and O slice.
template <class T>
struct RowState {
    float qf[T::kRows][T::kVec];
    float m[T::kRows], l[T::kRows], acc[T::kRows][T::kVec];
};

#include "decode/paged.cuh"
#include "decode/ring.cuh"
#include "decode/combine.cuh"

template <class T>
__device__ __forceinline__ void decode_attention_variant(
    const unsigned short* __restrict__ q, const unsigned short* __restrict__ k, const unsigned short* __restrict__ v,
    unsigned short* __restrict__ o, long long q_sb, long long q_sh, long long q_ss, long long k_sb, long long k_sh,
    long long k_ss, long long v_sb, long long v_sh, long long v_ss, long long o_sb, long long o_sh, long long o_ss,
    int seq_k, float scale_log2, float* __restrict__ ws_o, float* __restrict__ ws_ml, int* __restrict__ ws_count,
    const DecodeExtras ex = DecodeExtras()) {
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ int is_last;
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = warp * T::kGroupsPerWarp + lane / T::kLanesPerKey;  // a consumer's key group
    const int d0 = (lane % T::kLanesPerKey) * T::kVec;
    // A paged cache: this sequence's own length (cache_seqlens[b]), at most seq_k = the table's pages x PAGE_SIZE (a
    // bad length never reads past its row of the table); its page strides are k_sb and v_sb, not a batch's.
    PagedCache<T> pc = {};
    const unsigned short* kh;
    const unsigned short* vh;
    if constexpr (T::kPaged) {
        seq_k = max(0, min(seq_k, __ldg(ex.cache_seqlens + b)));
        pc = {ex.block_table + b * ex.bt_sb, k_sb, v_sb, k_ss, v_ss};
        kh = k + kvh * k_sh;  // this K/V head's rows in page 0
        vh = v + kvh * v_sh;
    } else {
        kh = k + b * k_sb + kvh * k_sh;  // this K/V head's cache
        vh = v + b * v_sb + kvh * v_sh;
    }
    const KeyRange keys = split_keys<T>(seq_k, split);
    const int causal_edge = seq_k - T::kSeqQ;  // query i sees keys <= causal_edge + i
    const unsigned short* qh = q + b * q_sb + static_cast<long long>(kvh) * T::kGroup * q_sh + d0;
    const float* sinks = T::kSinks ? ex.sinks + kvh * T::kGroup : nullptr;  // the CTA's query heads' sink logits

    RowState<T> st;
#pragma unroll
    for (int r = 0; r < T::kRows; ++r) {
        st.m[r] = neg_inf();
        st.l[r] = 0.f;
#pragma unroll
        for (int i = 0; i < T::kVec; ++i) st.acc[r][i] = 0.f;
    }
    if constexpr (T::kBulk) {
        __shared__ __align__(8) unsigned long long bars[2 * T::kStages];
        const BulkRing<T> ring(smem, bars);
        if (warp == T::kWarps) {
            ring.produce(kh, vh, k_ss, v_ss, keys, seq_k, lane);
        } else {
            load_lane_q<T>(qh, q_sh, q_ss, scale_log2, d0, st.qf);
            ring.consume(keys, causal_edge, group, d0, st);
        }
    } else {
        load_lane_q<T>(qh, q_sh, q_ss, scale_log2, d0, st.qf);
        cp_async_ring<T>(smem, kh + d0, vh + d0, k_ss, v_ss, pc, keys, causal_edge, group, d0, st);
    }
    __syncthreads();  // every tile is consumed: the ring becomes the merge buffer

    float* red = reinterpret_cast<float*>(smem);
    if (threadIdx.x < T::kConsumerThreads) stash_group<T>(red, st, group, d0);
    __syncthreads();
    o += b * o_sb + static_cast<long long>(kvh) * T::kGroup * o_sh;
    if constexpr (T::kSplits == 1) {
        for (int idx = threadIdx.x; idx < T::kRows * T::kHeadDim; idx += T::kThreads) {
            float mx, sum, x;
            merged_element<T>(red, idx, mx, sum, x);
            const int r = idx / T::kHeadDim;
            store_o<T>(o, o_sh, o_ss, r, idx % T::kHeadDim, finish_element<T>(x, mx, sum, sinks, r));
        }
    } else {
        const long long first = (static_cast<long long>(b) * gridDim.y + kvh) * T::kSplits;
        int* count = ws_count + static_cast<long long>(b) * gridDim.y + kvh;
        publish_partial<T>(red, ws_o, ws_ml, first + split);
        if constexpr (T::kCombine == kCombineFenced) {
            combine_fenced<T>(ws_o, ws_ml, count, first, &is_last, o, o_sh, o_ss, sinks);
        } else if (last_to_publish<T>(count, &is_last)) {
            combine_splits<T>(ws_o, ws_ml, first, o, o_sh, o_ss, sinks);
        }
    }
}

}  // namespace evotune
