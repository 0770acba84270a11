// evotune: device helpers shared by the mma.sync kernel (attention.cu) and the Hopper kernel
// (attention_hopper.cuh): integer types, named-barrier ids, fp conversions (their PTX wrappers: ptx.cuh).
// Included by attention.cu inside namespace evotune, before either kernel.

typedef unsigned int u32;
typedef unsigned long long u64;

// -inf without <math.h>'s INFINITY, which NVRTC does not provide.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}


// Named barrier ids (bar.sync / bar.arrive; a CTA has 16, id 0 is __syncthreads). One table for both
// kernels, as FlashAttention-3's FwdNamedBarriers, so an id is never spelled as a number at a call site.
enum class NamedBarrier : int {
    kSlotFull = 1,       // mma.sync with producer warps: K/V ring slot s was filled (id + s, s < 4 stages)
    kSlotEmpty = 5,      // ... and slot s may be refilled (id + s)
    kComputeWarps = 9,   // the compute warps alone (producer warps may have exited)
    kWarpgroupTurn = 10, // Hopper ping-pong: consumer warpgroup w's turn at the tensor cores (id + w, w < 2)
    kEnd = 12,           // one past the last id used
};
static_assert(static_cast<int>(NamedBarrier::kEnd) <= 16, "a CTA has 16 named barriers");

// Named barriers let producer and consumer warps hand tiles over without stopping the whole CTA. Both
// order prior memory accesses for participants. `index` selects within a family (a slot, a warpgroup).
__device__ __forceinline__ int named_bar_id(NamedBarrier bar, int index) { return static_cast<int>(bar) + index; }
__device__ __forceinline__ void named_bar_sync(NamedBarrier bar, int index, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(named_bar_id(bar, index)), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(NamedBarrier bar, int index, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(named_bar_id(bar, index)), "r"(threads) : "memory");
}

// The thread and lane index (threadIdx.x, threadIdx.x % 32 in these 1-D blocks), read
// through volatile asm: the compiler may not hoist them, or the per-thread addresses
// computed from them, out of the K/V loop. Loop-invariant addresses are what it kept
// live across the whole loop and then spilled first (see the loop).
__device__ __forceinline__ int thread_id() {
    u32 tid;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
    return static_cast<int>(tid);
}
__device__ __forceinline__ int lane_id() {
    u32 lane;
    asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lane));
    return static_cast<int>(lane);
}

__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ln(2^max_log2 * sum): a row's log-sum-exp from its running max (already in log2 units) and its
// sum of 2^(x - max); +inf for a row that saw no key, as PyTorch's kernels write it.
__device__ __forceinline__ float lse_from_log2(float max_log2, float sum) {
    return sum > 0.f ? (max_log2 + log2f(sum)) * 0.69314718055994531f : __int_as_float(0x7f800000);
}

template <bool IS_BF16>
__device__ __forceinline__ u32 pack2(float lo, float hi) {
    if constexpr (IS_BF16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<u32*>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<u32*>(&v);
    }
}
//[trace]
//[trace] // Phase trace (tools/phase_trace.py, docs/TRACE.md). Lines marked //[trace] exist only in the trace variant that
//[trace] // tool builds (template flag "trace", never a knob), so every searched source is what it was without them.
//[trace] // Lane 0 of every warp stamps %globaltimer (ns, one clock for all SMs) and %clock64 (its SM's cycles) where the
//[trace] // kernel passes a phase boundary, into the warp's record of evotune_trace; the host zeroes the buffer before a
//[trace] // launch and reads it back, so an event left 0 was not reached. One lane per warp, not per CTA: the warps of a
//[trace] // CTA run their tiles unsynchronised between barriers (key groups, producers), and their spread is the point.
//[trace] namespace trace {
//[trace] // Record of one warp, in 64-bit words (tools/phase_trace.py reads these constants): [0] 1 << 63 | tiles << 32 |
//[trace] // smid, [1] the sink of mark_after, then kEvents pairs {globaltimer, clock64}: the fixed events, then per K/V
//[trace] // tile i < kMaxTiles of the warp's loop the kTileEvents tile events at kTile0 + kTileEvents * i.
//[trace] enum Event : int { kEntry = 0, kStart = 1, kQ = 2, kSync = 3, kMerge = 4, kStore = 5, kExit = 6, kTile0 = 7 };
//[trace] enum TileEvent : int { kWait = 0, kReady = 1, kQK = 2, kSoftmax = 3, kPV = 4 };
//[trace] constexpr int kTileEvents = 5, kMaxTiles = 32, kEvents = kTile0 + kTileEvents * kMaxTiles;
//[trace] constexpr int kHeaderWords = 2, kRecordWords = kHeaderWords + 2 * kEvents, kRecords = 4096;
//[trace] }  // namespace trace
//[trace] // Records (CTA (z * gridDim.y + y) * gridDim.x + x) * warps per CTA + warp; warps past kRecords keep none.
//[trace] __device__ __align__(16) u64 evotune_trace[trace::kRecords * trace::kRecordWords];
//[trace] __device__ __forceinline__ u64 trace_globaltimer() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t)); return t; }
//[trace] __device__ __forceinline__ u64 trace_clock64() { u64 t; asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(t)); return t; }
//[trace] __device__ __forceinline__ u32 trace_smid() { u32 s; asm volatile("mov.u32 %0, %%smid;\n" : "=r"(s)); return s; }
//[trace] // One warp's recorder: made after the prologue (griddepcontrol.wait where pdl), since its stores are global
//[trace] // accesses (so the buffer ends up holding the last of several launches, whatever overlapped); the entry
//[trace] // stamps wait in registers until then. Its destructor stamps kExit wherever the warp returns.
//[trace] struct TraceWarp {
//[trace]     u64* rec;  // this warp's record in lane 0, else null
//[trace]     __device__ __forceinline__ TraceWarp(u64 entry_gt, u64 entry_clk, int tiles) : rec(nullptr) {
//[trace]         const u32 cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
//[trace]         const u32 index = cta * (blockDim.x / 32) + threadIdx.x / 32;
//[trace]         if (lane_id() == 0 && index < trace::kRecords) {
//[trace]             rec = evotune_trace + static_cast<u64>(index) * trace::kRecordWords;
//[trace]             rec[0] = 1ull << 63 | static_cast<u64>(tiles) << 32 | trace_smid();
//[trace]             put(trace::kEntry, entry_gt, entry_clk);
//[trace]             mark(trace::kStart);
//[trace]         }
//[trace]     }
//[trace]     __device__ __forceinline__ ~TraceWarp() { mark(trace::kExit); }
//[trace]     __device__ __forceinline__ void put(int event, u64 gt, u64 clk) const {
//[trace]         *reinterpret_cast<ulonglong2*>(rec + trace::kHeaderWords + 2 * event) = make_ulonglong2(gt, clk);
//[trace]     }
//[trace]     __device__ __forceinline__ void mark(int event) const {
//[trace]         if (rec) { const u64 gt = trace_globaltimer(); put(event, gt, trace_clock64()); }
//[trace]     }
//[trace]     // A stamp that waits for `dep`: the timers are read only after lane 0 has stored it (a volatile store, which
//[trace]     // neither compiler drops), so after the instruction that writes it (an mma's accumulator, an ldmatrix) has
//[trace]     // completed, not merely issued; mma.sync results of one warp complete in order.
//[trace]     __device__ __forceinline__ void mark_after(int event, u32 dep) const {
//[trace]         if (rec) { *reinterpret_cast<volatile u32*>(rec + 1) = dep; mark(event); }
//[trace]     }
//[trace]     __device__ __forceinline__ void mark_after(int event, float dep) const { mark_after(event, __float_as_uint(dep)); }
//[trace]     __device__ __forceinline__ void mark_tile(int tile, int event) const {
//[trace]         if (tile < trace::kMaxTiles) mark(trace::kTile0 + trace::kTileEvents * tile + event);
//[trace]     }
//[trace]     __device__ __forceinline__ void mark_tile_after(int tile, int event, float dep) const {
//[trace]         if (tile < trace::kMaxTiles) mark_after(trace::kTile0 + trace::kTileEvents * tile + event, dep);
//[trace]     }
//[trace] };
