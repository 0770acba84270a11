// evotune: row softmax, y[r, :] = softmax(x[r, :]) over the last dim of a [rows, cols] tensor.
//
// fp16 or bf16 in and out, fp32 math, exp2 with log2(e) folded into the inputs.
// A row belongs to a group of THREADS_PER_ROW threads (a slice of a warp, a warp,
// or several warps); a CTA holds ROWS_PER_CTA such groups. Each thread reads its
// share of the row in 16/8/4-byte vectors of VEC elements; a row whose start is
// not vector aligned (any cols) takes its first and last few elements one by one
// ("edges"). Row max and sum are reduced with warp shuffles, then across the
// warps of a row through shared memory.
//
// Knobs (compile time, see search_spaces/softmax.yaml):
//   THREADS_PER_ROW  threads sharing one row (power of two, at most a CTA's 1024 threads)
//   ROWS_PER_CTA     rows per CTA (block = THREADS_PER_ROW * ROWS_PER_CTA threads)
//   VEC              elements per vector load/store (2, 4 or 8: 4, 8 or 16 bytes)
//   STRATEGY         0 cached:     the row is loaded once into registers (CACHE_VECS vectors a thread),
//                                  max and sum from registers, one read of global memory
//                    1 online:     pass 1 streams the row keeping a running (max, sum), pass 2 writes
//                    2 three-pass: max, then sum, then write: three streams over the row
//   UNROLL           vectors a thread loads before it uses any of them (streaming passes)
//   CACHE_VECS       register capacity of the cached strategy, from the shape's cols
// Problem trait: IS_BF16.
//
// This file compiles standalone with NVRTC or nvcc; evotune appends one explicit
// instantiation (extern "C" entry point) per configuration.

namespace evotune {

enum RowStrategy { kCached = 0, kOnline = 1, kThreePass = 2 };

template <int BYTES> struct VecWord;
template <> struct VecWord<4> { typedef unsigned int T; };
template <> struct VecWord<8> { typedef uint2 T; };
template <> struct VecWord<16> { typedef uint4 T; };

template <int THREADS_PER_ROW_, int ROWS_PER_CTA_, int VEC_, int STRATEGY_, int UNROLL_, int CACHE_VECS_,
          bool IS_BF16_>
struct SoftmaxTraits {
    static constexpr int kThreadsPerRow = THREADS_PER_ROW_;
    static constexpr int kRowsPerCta = ROWS_PER_CTA_;
    static constexpr int kVec = VEC_;
    static constexpr int kStrategy = STRATEGY_;
    static constexpr int kUnroll = UNROLL_;
    static constexpr int kCacheVecs = CACHE_VECS_;
    static constexpr bool kIsBf16 = IS_BF16_;

    static constexpr int kThreads = kThreadsPerRow * kRowsPerCta;
    static constexpr int kShuffleWidth = kThreadsPerRow < 32 ? kThreadsPerRow : 32;  // lanes reduced by shuffles
    static constexpr int kWarpsPerRow = kThreadsPerRow > 32 ? kThreadsPerRow / 32 : 1;
    static constexpr bool kCrossWarp = kWarpsPerRow > 1;  // the row's partials meet in shared memory
    static constexpr int kVecBytes = 2 * kVec;
    // Dynamic shared memory of a launch: none (the cross-warp partials are a static __shared__ array).
    static constexpr int kSmemBytes = 0;
    typedef typename VecWord<kVecBytes>::T Word;

    // The device's thread limit (no more than a CTA's threads, so none for THREADS_PER_ROW either) is asserted
    // by the instantiation against evotune/limits.py, the one place it is written.
    static_assert(kThreadsPerRow >= 1 && (kThreadsPerRow & (kThreadsPerRow - 1)) == 0,
                  "THREADS_PER_ROW must be a power of two (rows split evenly over lanes and warps)");
    static_assert(kRowsPerCta >= 1, "at least one row per CTA");
    static_assert(kThreads % 32 == 0, "a CTA is whole warps");
    static_assert(kVec == 2 || kVec == 4 || kVec == 8, "VEC is 2, 4 or 8 elements (one 4, 8 or 16-byte access)");
    static_assert(kStrategy >= kCached && kStrategy <= kThreePass, "STRATEGY is 0 cached, 1 online or 2 three-pass");
    static_assert(kUnroll >= 1 && kUnroll <= 8, "UNROLL is 1 to 8 vectors in flight");
    static_assert(kStrategy != kCached || kUnroll == 1, "a cached row loads all its vectors at once: UNROLL must be 1");
    static_assert(kCacheVecs >= 1 && kCacheVecs * kVec <= 128, "a cached row holds 1 to 128 fp32 values a thread");
};

#include "elementwise.cuh"

constexpr float kLog2e = 1.4426950408889634f;

// A vector access as 32-bit words, two elements each (low half first).
__device__ __forceinline__ void to_words(unsigned int v, unsigned int (&w)[1]) { w[0] = v; }
__device__ __forceinline__ void to_words(uint2 v, unsigned int (&w)[2]) { w[0] = v.x; w[1] = v.y; }
__device__ __forceinline__ void to_words(uint4 v, unsigned int (&w)[4]) { w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w; }
__device__ __forceinline__ unsigned int from_words(const unsigned int (&w)[1]) { return w[0]; }
__device__ __forceinline__ uint2 from_words(const unsigned int (&w)[2]) { return make_uint2(w[0], w[1]); }
__device__ __forceinline__ uint4 from_words(const unsigned int (&w)[4]) { return make_uint4(w[0], w[1], w[2], w[3]); }

// One aligned vector of VEC elements, as fp32 multiplied by log2(e).
template <class T>
__device__ __forceinline__ void load_vec(const unsigned short* p, float (&v)[T::kVec]) {
    unsigned int w[T::kVec / 2];
    to_words(*reinterpret_cast<const typename T::Word*>(p), w);
#pragma unroll
    for (int i = 0; i < T::kVec / 2; ++i) {
        v[2 * i] = to_float<T::kIsBf16>(static_cast<unsigned short>(w[i] & 0xffffu)) * kLog2e;
        v[2 * i + 1] = to_float<T::kIsBf16>(static_cast<unsigned short>(w[i] >> 16)) * kLog2e;
    }
}

template <class T>
__device__ __forceinline__ void store_vec(unsigned short* p, const float (&v)[T::kVec]) {
    unsigned int w[T::kVec / 2];
#pragma unroll
    for (int i = 0; i < T::kVec / 2; ++i) {
        w[i] = from_float<T::kIsBf16>(v[2 * i]) | (static_cast<unsigned int>(from_float<T::kIsBf16>(v[2 * i + 1])) << 16);
    }
    *reinterpret_cast<typename T::Word*>(p) = from_words(w);
}

// ---------------------------------------------------------------- (max, sum) algebra, log2 domain

// Fold values into a running (max m, sum s of 2^(x - m)). Nothing changes while every value is -inf.
template <int N>
__device__ __forceinline__ void online_add(float& m, float& s, const float (&x)[N]) {
    float mx = m;
#pragma unroll
    for (int i = 0; i < N; ++i) mx = fmaxf(mx, x[i]);
    if (mx == neg_inf()) return;
    float acc = s * fast_exp2(m - mx);
#pragma unroll
    for (int i = 0; i < N; ++i) acc += fast_exp2(x[i] - mx);
    m = mx;
    s = acc;
}

__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {
    const float mx = fmaxf(m, m2);
    if (mx == neg_inf()) return;
    s = s * fast_exp2(m - mx) + s2 * fast_exp2(m2 - mx);
    m = mx;
}

// ---------------------------------------------------------------- row reductions

// Reduce over the THREADS_PER_ROW threads of a row: shuffles inside the warp (xor offsets below the
// row's lane count stay inside its aligned lane group), then shared memory across the row's warps.
// `slot` is a per-row buffer of kWarpsPerRow floats used by this reduction only.
template <class T>
__device__ __forceinline__ float row_max(float v, float* slot) {
#pragma unroll
    for (int off = T::kShuffleWidth / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    if constexpr (T::kCrossWarp) {
        const int warp = (threadIdx.x % T::kThreadsPerRow) / 32;
        if (threadIdx.x % 32 == 0) slot[warp] = v;
        __syncthreads();
        v = slot[0];
#pragma unroll
        for (int w = 1; w < T::kWarpsPerRow; ++w) v = fmaxf(v, slot[w]);
    }
    return v;
}

template <class T>
__device__ __forceinline__ float row_sum(float v, float* slot) {
#pragma unroll
    for (int off = T::kShuffleWidth / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    if constexpr (T::kCrossWarp) {
        const int warp = (threadIdx.x % T::kThreadsPerRow) / 32;
        if (threadIdx.x % 32 == 0) slot[warp] = v;
        __syncthreads();
        v = slot[0];
#pragma unroll
        for (int w = 1; w < T::kWarpsPerRow; ++w) v += slot[w];
    }
    return v;
}

template <class T>
__device__ __forceinline__ void row_max_sum(float& m, float& s, float* slot_m, float* slot_s) {
#pragma unroll
    for (int off = T::kShuffleWidth / 2; off > 0; off /= 2) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        combine(m, s, m2, s2);
    }
    if constexpr (T::kCrossWarp) {
        const int warp = (threadIdx.x % T::kThreadsPerRow) / 32;
        if (threadIdx.x % 32 == 0) {
            slot_m[warp] = m;
            slot_s[warp] = s;
        }
        __syncthreads();
        m = slot_m[0];
        s = slot_s[0];
#pragma unroll
        for (int w = 1; w < T::kWarpsPerRow; ++w) combine(m, s, slot_m[w], slot_s[w]);
    }
}

// ---------------------------------------------------------------- one row

// Where a row's aligned vectors lie: `head` scalar elements before them, `nvec` vectors, then a scalar tail.
struct RowSplit {
    int head, nvec, tail_start;
};

template <class T>
__device__ __forceinline__ RowSplit split_row(long long row_offset, int cols) {
    RowSplit r;
    const int mis = static_cast<int>(row_offset % T::kVec);  // the base pointer is 16-byte aligned
    r.head = min(cols, mis ? T::kVec - mis : 0);
    r.nvec = (cols - r.head) / T::kVec;
    r.tail_start = r.head + r.nvec * T::kVec;
    return r;
}

// Scalar elements outside the vectors (fewer than 2*VEC a row), spread over the row's threads.
template <class T, class F>
__device__ __forceinline__ void for_edges(const RowSplit& r, int cols, int t, F f) {
    for (int i = t; i < r.head; i += T::kThreadsPerRow) f(i);
    for (int i = r.tail_start + t; i < cols; i += T::kThreadsPerRow) f(i);
}

template <class T>
__device__ __forceinline__ void edge_stats(const unsigned short* x, const RowSplit& r, int cols, int t, float& m,
                                           float& s) {
    for_edges<T>(r, cols, t, [&](int i) {
        const float v[1] = {to_float<T::kIsBf16>(x[i]) * kLog2e};
        online_add(m, s, v);
    });
}

template <class T>
__device__ __forceinline__ void edge_write(const unsigned short* x, unsigned short* y, const RowSplit& r, int cols,
                                           int t, float m, float inv_s) {
    for_edges<T>(r, cols, t, [&](int i) {
        y[i] = from_float<T::kIsBf16>(fast_exp2(to_float<T::kIsBf16>(x[i]) * kLog2e - m) * inv_s);
    });
}

// Stream this thread's vectors (t, t + THREADS_PER_ROW, ...), UNROLL loads in flight, calling f(i, v).
template <class T, class F>
__device__ __forceinline__ void stream_vecs(const unsigned short* xv, int nvec, int t, F f) {
    for (int base = t; base < nvec; base += T::kThreadsPerRow * T::kUnroll) {
        float v[T::kUnroll][T::kVec];
#pragma unroll
        for (int u = 0; u < T::kUnroll; ++u) {
            const int i = base + u * T::kThreadsPerRow;
            if (i < nvec) {
                load_vec<T>(xv + static_cast<long long>(i) * T::kVec, v[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < T::kUnroll; ++u) {
            const int i = base + u * T::kThreadsPerRow;
            if (i < nvec) f(i, v[u]);
        }
    }
}

template <class T>
__device__ __forceinline__ void write_vec(unsigned short* yv, int i, const float (&v)[T::kVec], float m, float inv_s) {
    float o[T::kVec];
#pragma unroll
    for (int k = 0; k < T::kVec; ++k) o[k] = fast_exp2(v[k] - m) * inv_s;
    store_vec<T>(yv + static_cast<long long>(i) * T::kVec, o);
}

// The whole kernel body; the extern "C" entry point of an instantiation calls it.
template <class T>
__device__ __forceinline__ void softmax_rows(const unsigned short* __restrict__ x, unsigned short* __restrict__ y, int rows, int cols,
             long long row_stride) {
    // Two reduction buffers per row, each written once: no barrier is needed between reductions.
    __shared__ float red[2][T::kRowsPerCta][T::kWarpsPerRow];
    const int row_in_cta = threadIdx.x / T::kThreadsPerRow;
    const int t = threadIdx.x % T::kThreadsPerRow;
    const int row = blockIdx.x * T::kRowsPerCta + row_in_cta;
    // Threads of rows past the end still take part in the shuffles and barriers, over an empty row.
    const int n = row < rows ? cols : 0;
    const long long offset = static_cast<long long>(row < rows ? row : 0) * row_stride;
    x += offset;
    y += offset;
    const RowSplit r = split_row<T>(offset, n);
    const unsigned short* xv = x + r.head;
    unsigned short* yv = y + r.head;
    float* slot_m = red[0][row_in_cta];
    float* slot_s = red[1][row_in_cta];

    float m = neg_inf(), s = 0.f;
    if constexpr (T::kStrategy == kCached) {
        float c[T::kCacheVecs][T::kVec];
#pragma unroll
        for (int j = 0; j < T::kCacheVecs; ++j) {
            const int i = t + j * T::kThreadsPerRow;
            if (i < r.nvec) {
                load_vec<T>(xv + static_cast<long long>(i) * T::kVec, c[j]);
            } else {
#pragma unroll
                for (int k = 0; k < T::kVec; ++k) c[j][k] = neg_inf();
            }
        }
        edge_stats<T>(x, r, n, t, m, s);
        float mx = m;
#pragma unroll
        for (int j = 0; j < T::kCacheVecs; ++j)
#pragma unroll
            for (int k = 0; k < T::kVec; ++k) mx = fmaxf(mx, c[j][k]);
        mx = row_max<T>(mx, slot_m);
        // The edges' sum was taken against their own max: rescale it to the row's.
        float acc = (m == neg_inf()) ? 0.f : s * fast_exp2(m - mx);
#pragma unroll
        for (int j = 0; j < T::kCacheVecs; ++j)
#pragma unroll
            for (int k = 0; k < T::kVec; ++k) {
                c[j][k] = fast_exp2(c[j][k] - mx);
                acc += c[j][k];
            }
        const float inv_s = 1.f / row_sum<T>(acc, slot_s);
#pragma unroll
        for (int j = 0; j < T::kCacheVecs; ++j) {
            const int i = t + j * T::kThreadsPerRow;
            if (i < r.nvec) {
                float o[T::kVec];
#pragma unroll
                for (int k = 0; k < T::kVec; ++k) o[k] = c[j][k] * inv_s;
                store_vec<T>(yv + static_cast<long long>(i) * T::kVec, o);
            }
        }
        edge_write<T>(x, y, r, n, t, mx, inv_s);
    } else if constexpr (T::kStrategy == kOnline) {
        stream_vecs<T>(xv, r.nvec, t, [&](int, const float (&v)[T::kVec]) { online_add(m, s, v); });
        edge_stats<T>(x, r, n, t, m, s);
        row_max_sum<T>(m, s, slot_m, slot_s);
        const float inv_s = 1.f / s;
        stream_vecs<T>(xv, r.nvec, t, [&](int i, const float (&v)[T::kVec]) { write_vec<T>(yv, i, v, m, inv_s); });
        edge_write<T>(x, y, r, n, t, m, inv_s);
    } else {  // three passes: max, sum against the final max, write
        stream_vecs<T>(xv, r.nvec, t, [&](int, const float (&v)[T::kVec]) {
#pragma unroll
            for (int k = 0; k < T::kVec; ++k) m = fmaxf(m, v[k]);
        });
        for_edges<T>(r, n, t, [&](int i) { m = fmaxf(m, to_float<T::kIsBf16>(x[i]) * kLog2e); });
        m = row_max<T>(m, slot_m);
        stream_vecs<T>(xv, r.nvec, t, [&](int, const float (&v)[T::kVec]) {
#pragma unroll
            for (int k = 0; k < T::kVec; ++k) s += fast_exp2(v[k] - m);
        });
        for_edges<T>(r, n, t, [&](int i) { s += fast_exp2(to_float<T::kIsBf16>(x[i]) * kLog2e - m); });
        const float inv_s = 1.f / row_sum<T>(s, slot_s);
        stream_vecs<T>(xv, r.nvec, t, [&](int i, const float (&v)[T::kVec]) { write_vec<T>(yv, i, v, m, inv_s); });
        edge_write<T>(x, y, r, n, t, m, inv_s);
    }
}

}  // namespace evotune
