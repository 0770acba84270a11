// key_merge = split (evotune/problems/attention.py; the traits' SPLIT_MERGE, kSplitMerge): the key groups' merge and
// O's store divided between the warps of a row group. Always included; its templates are instantiated only by an
// `if constexpr (T::kSplitMerge)` branch of attention.cu.
//
// With key_merge = gather, the first warp of a row group folds in the other groups' whole partials and stores all
// of O alone while they exit: after the loop it runs every column's merge and store as one dependent chain (on the
// mission shape the merge and store took 0.8 us of a 4.9 us CTA, docs/TRACE.md). Here each of the G key groups owns
// 1/G of the head dim: a warp publishes the columns it does not own (plus its row max and sum), and after the
// barrier merges and stores only its own, so the G warps of a row group share that chain.
//
// The arithmetic is gather's, term for term and in the same order (group 0's partial times its weight, then each
// further group's added; the same sums and the same 1 / l). It is not bitwise gather's: in `a * w0 + w1 * b` ptxas
// picks which product goes into the FMA element by element (gather's own SASS does both within a row), so a merged
// value may differ by an fp32 rounding (tests/test_split_merge.py bounds it on the GPU).

template <class T>
struct SplitMerge {
    static constexpr int kGroups = T::kKeyGroups;
    static constexpr int kOwnFrags = T::kDFrags / kGroups;  // 8-column blocks of O each key group merges and stores
    // Floats per row of a published partial: 8 more than the head dim shift consecutive rows by 8 banks, so a float2
    // store or load of 8 rows x 4 lanes takes the minimum two wavefronts (at a pitch of head_dim they all met the
    // same 8 banks).
    static constexpr int kPitch = T::kHeadDim + 8;
    static constexpr int kSlotFloats = T::kBlockM * kPitch;
    // G - 1 slots of O: writer g puts owner c's columns in slot g - (g > c), so that the columns one owner reads
    // come from G - 1 distinct slots. Then every group's row max, then every group's row sum.
    static constexpr int kMaxOffset = (kGroups - 1) * kSlotFloats;
    static constexpr int kSumOffset = kMaxOffset + kGroups * T::kBlockM;
    static constexpr int kBytes = 4 * (kSumOffset + kGroups * T::kBlockM);
    static_assert(kGroups > 1 && T::kDFrags % kGroups == 0, "split merge: two or more key groups dividing the head dim");

    __device__ static __forceinline__ int slot(int writer, int owner) { return writer - (writer > owner ? 1 : 0); }
    __device__ static __forceinline__ bool owns(int key_group, int df) { return df / kOwnFrags == key_group; }
};

// Publish this warp's row maxima and quad-reduced row sums, and its O for the columns other key groups own.
template <class T>
__device__ __forceinline__ void write_split_partial(const float (&o)[T::kMFrags][T::kDFrags][4], const float (&m)[T::kMFrags][2],
                                                    const float (&l)[T::kMFrags][2], float* merge, int key_group,
                                                    int warp_row0, int lane) {
    using S = SplitMerge<T>;
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row0 + mf * 16 + (lane >> 2) + 8 * r;
            const float sum = quad_sum<T>(l[mf][r]);
            if ((lane & 3) == 0) {
                merge[S::kMaxOffset + key_group * T::kBlockM + row] = m[mf][r];
                merge[S::kSumOffset + key_group * T::kBlockM + row] = sum;
            }
#pragma unroll
            for (int df = 0; df < T::kDFrags; ++df) {
                const int owner = df / S::kOwnFrags;
                if (owner == key_group) continue;  // warp-uniform
                const int col = df * 8 + 2 * (lane & 3);
                *reinterpret_cast<float2*>(merge + S::slot(key_group, owner) * S::kSlotFloats + row * S::kPitch + col) =
                    make_float2(o[mf][df][2 * r], o[mf][df][2 * r + 1]);
            }
        }
}

// After the barrier: every warp merges its own columns of every group's partial; afterwards `l` holds the full row
// sums and `m` the row maxima (the same in every warp of the row group), and o's own columns the merged O.
template <class T>
__device__ __forceinline__ void merge_split(float (&o)[T::kMFrags][T::kDFrags][4], float (&m)[T::kMFrags][2],
                                            float (&l)[T::kMFrags][2], const float* merge, int key_group, int warp_row0,
                                            float scale_log2, int lane) {
    using S = SplitMerge<T>;
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = warp_row0 + mf * 16 + (lane >> 2) + 8 * r;
            const float* maxima = merge + S::kMaxOffset + row;
            const float* sums = merge + S::kSumOffset + row;
            // Row max over all groups; group 0 always holds key 0, so it is finite.
            float mx = maxima[0];
#pragma unroll
            for (int g = 1; g < S::kGroups; ++g) mx = fmaxf(mx, maxima[g * T::kBlockM]);
            float w[S::kGroups];
#pragma unroll
            for (int g = 0; g < S::kGroups; ++g) w[g] = fast_exp2((maxima[g * T::kBlockM] - mx) * scale_log2);  // 0 if that group saw no key
            float sum = sums[0] * w[0];
#pragma unroll
            for (int g = 1; g < S::kGroups; ++g) sum += w[g] * sums[g * T::kBlockM];
#pragma unroll
            for (int df = 0; df < T::kDFrags; ++df) {
                if (!S::owns(key_group, df)) continue;  // warp-uniform
                const int col = df * 8 + 2 * (lane & 3);
                const float2 own = make_float2(o[mf][df][2 * r], o[mf][df][2 * r + 1]);
                const float* column = merge + row * S::kPitch + col;
                float2 p = key_group == 0 ? own : *reinterpret_cast<const float2*>(column + S::slot(0, key_group) * S::kSlotFloats);
                float x = p.x * w[0], y = p.y * w[0];
#pragma unroll
                for (int g = 1; g < S::kGroups; ++g) {
                    p = key_group == g ? own : *reinterpret_cast<const float2*>(column + S::slot(g, key_group) * S::kSlotFloats);
                    x += w[g] * p.x;
                    y += w[g] * p.y;
                }
                o[mf][df][2 * r] = x;
                o[mf][df][2 * r + 1] = y;
            }
            l[mf][r] = sum;
            m[mf][r] = mx;
        }
}

// Normalise this warp's own columns by the (reduced) row sums, stage them in the rows' Q tile (every compute warp
// is past its last Q read: the caller's barrier), then write them to global memory with 16-byte stores.
template <class T>
__device__ __forceinline__ void store_o_split(const float (&o)[T::kMFrags][T::kDFrags][4], const float (&l)[T::kMFrags][2],
                                              unsigned short* sO, unsigned short* gO, long long row_stride, int q_row0,
                                              int warp_row0, int seq_q, int key_group, int lane) {
    using S = SplitMerge<T>;
#pragma unroll
    for (int mf = 0; mf < T::kMFrags; ++mf)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const float inv = 1.f / l[mf][r];
            const int row = warp_row0 + mf * 16 + (lane >> 2) + 8 * r;
#pragma unroll
            for (int df = 0; df < T::kDFrags; ++df) {
                if (!S::owns(key_group, df)) continue;
                const int col = df * 8 + 2 * (lane & 3);
                *reinterpret_cast<u32*>(sO + tile_offset<T>(row, col >> 3) + (col & 7)) =
                    pack2<T::kIsBf16>(o[mf][df][2 * r] * inv, o[mf][df][2 * r + 1] * inv);
            }
        }
    __syncwarp();
    constexpr int kChunks = T::kRowsPerWarp * S::kOwnFrags;
#pragma unroll
    for (int i = 0; i < (kChunks + 31) / 32; ++i) {
        const int c = lane + 32 * i;
        if (kChunks % 32 == 0 || c < kChunks) {
            const int row = c / S::kOwnFrags;
            const int chunk = key_group * S::kOwnFrags + c % S::kOwnFrags;
            const int q = q_row0 + warp_row0 + row;
            if (q < seq_q) {
                const uint4 v = *reinterpret_cast<const uint4*>(sO + tile_offset<T>(warp_row0 + row, chunk));
                *reinterpret_cast<uint4*>(gO + (long long)q * row_stride + chunk * 8) = v;
            }
        }
    }
}

// The phase trace's "merge done" value (tools/phase_trace.py): the last O element this warp merged, picked by
// selects rather than a runtime index, which would move o to local memory.
template <class T>
__device__ __forceinline__ float split_last_merged(const float (&o)[T::kMFrags][T::kDFrags][4], int key_group) {
    using S = SplitMerge<T>;
    float last = 0.f;
#pragma unroll
    for (int df = S::kOwnFrags - 1; df < T::kDFrags; df += S::kOwnFrags)
        if (df / S::kOwnFrags == key_group) last = o[T::kMFrags - 1][df][3];
    return last;
}
