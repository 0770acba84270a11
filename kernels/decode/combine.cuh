// evotune: the decode kernel's split-KV pieces (a piece of decode/variants.cuh, inside namespace evotune): which keys a
// split takes (knob split_chunks), the merge of a CTA's key groups, the combine of the splits (knob combine), and a
// row's final normalization, where attention sinks join it (problem trait SINKS).

// ---------------------------------------------------------------- a row's normalization (SINKS, PAGE_SIZE)

// The factor that turns a row's unnormalized O into O, once every group and split of the row is merged: its keys'
// (max mx, sum) are in log2 units (Q carries scale * log2 e) and x, sum are relative to mx. With sinks the row's head's
// sink logit (`sinks`: the CTA's GROUP heads' logits, row r's head r / SEQ_Q) joins the denominator here, once per row,
// not per split: O = x / (sum + exp2(sink * log2 e - mx)), both terms shifted by the larger exponent (kernels/hopper/
// epilogue.cuh's row_total), so a sink far above the scores cannot overflow and a row that saw no key (mx = -inf: a
// paged sequence shorter than the queries, or of length 0) is 0. Without either trait: 1 / sum, as before them.
template <class T>
__device__ __forceinline__ float row_scale(float mx, float sum, const float* sinks, int r) {
    if constexpr (T::kSinks) {
        const float sink = __ldg(sinks + r / T::kSeqQ) * 1.4426950408889634f;  // log2(e)
        const float top = fmaxf(mx, sink);
        if (top == neg_inf()) return 0.f;  // no key and a -inf sink
        const float w = fast_exp2(mx - top);
        return w / (sum * w + fast_exp2(sink - top));
    } else if constexpr (T::kPaged) {
        return sum > 0.f ? 1.f / sum : 0.f;  // a sequence with no key for this row: O = 0
    } else {
        return 1.f / sum;
    }
}

// O's element from its unnormalized x: x / sum at the defaults (the text of the kernel before sinks and pages), else
// x times row_scale.
template <class T>
__device__ __forceinline__ float finish_element(float x, float mx, float sum, const float* sinks, int r) {
    if constexpr (T::kSinks || T::kPaged) {
        return x * row_scale<T>(mx, sum, sinks, r);
    } else {
        return x / sum;
    }
}

// ---------------------------------------------------------------- split_chunks

// The keys of CTA `split`, in whole tiles.
//   ceil  attention_decode.cu's: chunks of ceil(Sk / SPLITS) keys rounded up to whole tiles, so the last splits may be
//         short or empty (the space then admits only split counts that leave none empty: at Sk 2080 with 32-key tiles,
//         16 splits of 160 keys would leave the 16th empty, so 8 splits, 64 CTAs on 132 SMs, was the most admitted).
//   even  the ceil(Sk / BLOCK_N) tiles dealt evenly, the first (tiles % SPLITS) splits one more: every split has a
//         tile while SPLITS <= tiles (2080 keys: 65 tiles over 16 splits, 128 CTAs).
template <class T>
__device__ __forceinline__ KeyRange split_keys(int seq_k, int split) {
    if constexpr (T::kChunks == kChunksEven) {
        const int tiles = (seq_k + T::kBlockN - 1) / T::kBlockN;
        const int base = tiles / T::kSplits, extra = tiles % T::kSplits;
        const int first = split * base + min(split, extra);
        const int count = base + (split < extra ? 1 : 0);
        return {min(seq_k, first * T::kBlockN), min(seq_k, (first + count) * T::kBlockN)};
    } else {
        const int per_split = (((seq_k + T::kSplits - 1) / T::kSplits + T::kBlockN - 1) / T::kBlockN) * T::kBlockN;
        const int begin = min(seq_k, split * per_split);
        return {begin, min(seq_k, begin + per_split)};
    }
}

// ---------------------------------------------------------------- the CTA's key groups (attention_decode.cu's merge)

// A consumer thread's share of the merge buffer (the ring's memory, free once the ring is drained): its group's row
// max and sum, then its O slice of every row.
template <class T>
__device__ __forceinline__ void stash_group(float* red, const RowState<T>& st, int group, int d0) {
    float* red_m = red;
    float* red_l = red_m + T::kGroups * T::kRows;
    float* red_o = red_l + T::kGroups * T::kRows;
#pragma unroll
    for (int r = 0; r < T::kRows; ++r) {
        if (d0 == 0) {
            red_m[group * T::kRows + r] = st.m[r];
            red_l[group * T::kRows + r] = st.l[r];
        }
        if (active_lane<T>(d0)) {  // an idle padding lane (head dim 96) has no columns
#pragma unroll
            for (int i = 0; i < T::kVec; ++i) red_o[(group * T::kRows + r) * T::kHeadDim + d0 + i] = st.acc[r][i];
        }
    }
}

// The CTA's element `idx` (row idx / HEAD_DIM, column idx % HEAD_DIM) over every group: unnormalized x, the row's max
// and sum (max -inf and sum 0 where the CTA saw no key of the row).
template <class T>
__device__ __forceinline__ void merged_element(const float* red, int idx, float& mx, float& sum, float& x) {
    const float* red_m = red;
    const float* red_l = red_m + T::kGroups * T::kRows;
    const float* red_o = red_l + T::kGroups * T::kRows;
    const int r = idx / T::kHeadDim, d = idx % T::kHeadDim;
    mx = neg_inf();
    for (int g = 0; g < T::kGroups; ++g) mx = fmaxf(mx, red_m[g * T::kRows + r]);
    const float base = mx == neg_inf() ? 0.f : mx;
    sum = 0.f;
    x = 0.f;
    for (int g = 0; g < T::kGroups; ++g) {
        const float w = fast_exp2(red_m[g * T::kRows + r] - base);
        sum += red_l[g * T::kRows + r] * w;
        x += red_o[(g * T::kRows + r) * T::kHeadDim + d] * w;
    }
}

// This CTA's partial into its workspace slice: unnormalized O (ROWS x HEAD_DIM fp32) and each row's (max, sum).
template <class T>
__device__ __forceinline__ void publish_partial(const float* red, float* ws_o, float* ws_ml, long long slice) {
    for (int idx = threadIdx.x; idx < T::kRows * T::kHeadDim; idx += T::kThreads) {
        float mx, sum, x;
        merged_element<T>(red, idx, mx, sum, x);
        ws_o[slice * T::kRows * T::kHeadDim + idx] = x;
        if (idx % T::kHeadDim == 0) {
            ws_ml[(slice * T::kRows + idx / T::kHeadDim) * 2] = mx;
            ws_ml[(slice * T::kRows + idx / T::kHeadDim) * 2 + 1] = sum;
        }
    }
}

// ---------------------------------------------------------------- combine = fenced (attention_decode.cu's)

// Every thread fences (fence.sc.gpu) after its partial stores, thread 0 counts the CTA in, and the last CTA fences
// again and combines each element with two loops over the splits (max, then the weighted sums).
template <class T>
__device__ __forceinline__ void combine_fenced(const float* ws_o, const float* ws_ml, int* count, long long first,
                                               int* is_last, unsigned short* o, long long o_sh, long long o_ss,
                                               const float* sinks) {
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *is_last = atomicAdd(count, 1) == T::kSplits - 1;
    __syncthreads();
    if (!*is_last) return;
    __threadfence();
    for (int idx = threadIdx.x; idx < T::kRows * T::kHeadDim; idx += T::kThreads) {
        const int r = idx / T::kHeadDim, d = idx % T::kHeadDim;
        float mx = neg_inf();
        for (int s = 0; s < T::kSplits; ++s) mx = fmaxf(mx, __ldcg(ws_ml + ((first + s) * T::kRows + r) * 2));
        float sum = 0.f, x = 0.f;
        // A row no split saw a key of (a short paged sequence): weights exp2(-inf - 0) = 0, not NaN.
        const float base = (T::kSinks || T::kPaged) && mx == neg_inf() ? 0.f : mx;
        for (int s = 0; s < T::kSplits; ++s) {
            const float w = fast_exp2(__ldcg(ws_ml + ((first + s) * T::kRows + r) * 2) - base);
            sum += __ldcg(ws_ml + ((first + s) * T::kRows + r) * 2 + 1) * w;
            x += __ldcg(ws_o + (first + s) * T::kRows * T::kHeadDim + idx) * w;
        }
        store_o<T>(o, o_sh, o_ss, r, d, finish_element<T>(x, mx, sum, sinks, r));
    }
    if (threadIdx.x == 0) *count = 0;  // left zero for the next launch (and a graph replay)
}

// ---------------------------------------------------------------- combine = acq_rel

// Whether this CTA is the last of its (batch, K/V head) to publish: after a CTA barrier (which orders every thread's
// partial stores before it), thread 0 adds to the counter with acquire-release semantics at GPU scope; in the last
// CTA that acquire, and the barrier after it, order every other CTA's partial before this CTA's reads (CUTLASS's
// split-K semaphore: one thread's release after __syncthreads, one thread's acquire before it). combine = fenced
// runs fence.sc.gpu (MEMBAR.SC.GPU) in every thread of every CTA, and again in the last. The last CTA zeroes the
// counter at once: every other CTA has counted itself in.
template <class T>
__device__ __forceinline__ bool last_to_publish(int* count, int* is_last) {
    __syncthreads();
    if (threadIdx.x == 0) {
        int before;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(before) : "l"(count) : "memory");
        *is_last = before == T::kSplits - 1;
        if (*is_last) *count = 0;  // left zero for the next launch (and a graph replay)
    }
    __syncthreads();
    return *is_last;
}

// Four consecutive elements of O's row r from column d (8 bytes; O's rows are 16-byte aligned).
template <class T>
__device__ __forceinline__ void store_o4(unsigned short* o, long long o_sh, long long o_ss, int r, int d, float4 x) {
    uint2 w;
    w.x = from_float<T::kIsBf16>(x.x) | (static_cast<unsigned int>(from_float<T::kIsBf16>(x.y)) << 16);
    w.y = from_float<T::kIsBf16>(x.z) | (static_cast<unsigned int>(from_float<T::kIsBf16>(x.w)) << 16);
    *reinterpret_cast<uint2*>(o + (r / T::kSeqQ) * o_sh + (r % T::kSeqQ) * o_ss + d) = w;
}

// The last CTA's combine in one pass over the splits: thread i takes columns 4i.. of O (one row, four columns), loads
// kChunk splits' (max, sum) pairs and O quads at a time (independent L2 loads: a chunk is one round trip, and the
// unrolled chunks' loads need nothing of the one before) and merges them online. attention_decode.cu's loops load
// each split's max twice and its sum and O element one at a time, after a first pass for the max.
template <class T>
__device__ __forceinline__ void combine_splits(const float* ws_o, const float* ws_ml, long long first,
                                               unsigned short* o, long long o_sh, long long o_ss, const float* sinks) {
    constexpr int kChunk = T::kSplits < 8 ? T::kSplits : 8;
    const float2* ml = reinterpret_cast<const float2*>(ws_ml) + first * T::kRows;
    const float4* po = reinterpret_cast<const float4*>(ws_o + first * T::kRows * T::kHeadDim);
    for (int i = threadIdx.x; i < T::kRows * T::kHeadDim / 4; i += T::kThreads) {
        const int r = 4 * i / T::kHeadDim;
        float mx = neg_inf(), sum = 0.f;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int s0 = 0; s0 < T::kSplits; s0 += kChunk) {
            float2 part_ml[kChunk];
            float4 part_o[kChunk];
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                if (s0 + j < T::kSplits) {
                    part_ml[j] = __ldcg(ml + (s0 + j) * T::kRows + r);
                    part_o[j] = __ldcg(po + (s0 + j) * (T::kRows * T::kHeadDim / 4) + i);
                }
            }
            float next = mx;
#pragma unroll
            for (int j = 0; j < kChunk; ++j) if (s0 + j < T::kSplits) next = fmaxf(next, part_ml[j].x);
            // Splits without a key of the row (max -inf, sum 0) weigh 0; until a chunk has one, keep the state.
            const float base = next == neg_inf() ? 0.f : next;
            const float rescale = fast_exp2(mx - base);
            sum *= rescale;
            x.x *= rescale, x.y *= rescale, x.z *= rescale, x.w *= rescale;
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
                if (s0 + j < T::kSplits) {
                    const float w = fast_exp2(part_ml[j].x - base);
                    sum += part_ml[j].y * w;
                    x.x += part_o[j].x * w, x.y += part_o[j].y * w, x.z += part_o[j].z * w, x.w += part_o[j].w * w;
                }
            }
            mx = next;
        }
        const float inv = row_scale<T>(mx, sum, sinks, r);  // 1 / sum: a dense row sees a key in some split
        store_o4<T>(o, o_sh, o_ss, r, 4 * i % T::kHeadDim, make_float4(x.x * inv, x.y * inv, x.z * inv, x.w * inv));
    }
}
