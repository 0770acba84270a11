// evotune: variable-length packed batches in the Hopper kernel (a piece of attention_hopper.cuh, included inside
// namespace evotune::hopper, before the ring, the scheduler and the producer, which place their TMA boxes with
// packed_row): flash-attention's varlen (cu_seqlens_q / cu_seqlens_k), the traits' VARLEN (kVarlen).
//
// Q (total_q, H, D), K and V (total_k, Hkv, D) hold the batch's sequences one after another; sequence b's queries are
// the packed rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1, its keys cu_seqlens_k[b] .. cu_seqlens_k[b + 1] - 1.
// The grid is the one-tile grid with the sequence as its batch axis: (ceil(max_seqlen_q / kBlockM), heads,
// sequences). A CTA reads its sequence's rows and lengths (varlen_sequence) and from then on is a dense CTA on a
// batch of one whose seq_q and seq_k are the sequence's: the masking of keys at or past seq_k (mask_scores) and the
// row check of the register epilogue (store_out: rows at or past seq_q are not stored) are the ones every ragged
// dense tile already has. Only the TMA coordinates differ: the maps are the dense kernel's 4-D maps over the packed
// tensors seen as one batch (head_dim, total, heads, 1), and a box's first row is the sequence's first packed row plus
// the row inside the sequence (packed_row), its batch coordinate 0. So a box that runs past a sequence's end reads
// the next sequence's rows (or, past the tensor, TMA's zeros): keys there are masked (key >= seq_k), query rows there
// are computed and never stored. What the kernel must not do is write there: the TMA-store epilogue's box would
// clobber the next sequence's rows of O, so VARLEN takes the register epilogue only (a static_assert, and the space's
// constraint), and the one-tile grid only (the persistent scheduler's tile order knows no sequences).
//
// A CTA whose query tile starts at or past its sequence's length exits at once (the grid is sized by the longest
// sequence). A sequence with queries and no keys (flash-attention allows it) walks one K/V tile masked whole, and
// its rows come out 0, as a window's rows that see no key (HopperTraits::kEmptyRows).

// The sequence offsets (device pointers, B + 1 int32 prefix sums each; VARLEN only, else null and unread).
struct VarlenArgs {
    const int* __restrict__ cu_seqlens_q;
    const int* __restrict__ cu_seqlens_k;
};

// The packed rows of a sequence's first query and first key (0 and 0 in the dense kernel).
struct SeqRows {
    int q, k;
};

// The TMA row coordinate of row `row` of a sequence whose first packed row is `first`: VARLEN the packed row, else
// `row` itself (the dense maps have the batch as a coordinate of its own, and `first` is not read).
template <class T>
__device__ __forceinline__ int packed_row(int row, int first) {
    if constexpr (T::kVarlen) return first + row;
    else return row;
}

// VARLEN: the CTA's sequence (grid z) from the offsets: its first packed rows and its lengths, which replace the
// launch's seq_q and seq_k (those carry max_seqlen_q / max_seqlen_k, unread here). False where the CTA's query tile
// (its first row row0) starts at or past the sequence's last query: nothing to compute. Reads global memory: after
// the PDL wait.
template <class T>
__device__ __forceinline__ bool varlen_sequence(const VarlenArgs& args, int row0, SeqRows& rows, int& seq_q,
                                                int& seq_k) {
    static_assert(T::kVarlen, "varlen_sequence: VARLEN only");
    const int b = static_cast<int>(blockIdx.z);
    rows.q = __ldg(args.cu_seqlens_q + b);
    seq_q = __ldg(args.cu_seqlens_q + b + 1) - rows.q;
    rows.k = __ldg(args.cu_seqlens_k + b);
    seq_k = __ldg(args.cu_seqlens_k + b + 1) - rows.k;
    return row0 < seq_q;
}
