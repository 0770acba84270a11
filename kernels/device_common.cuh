// evotune: device helpers shared by the mma.sync kernel (attention.cu) and the Hopper kernel
// (attention_hopper.cuh): integer types, PTX wrappers both use, named-barrier ids, fp conversions.
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
//[pdl]
//[pdl] // Programmatic dependent launch (knob pdl, docs/PDL.md). Lines marked //[pdl] exist only in instantiations with
//[pdl] // pdl true (evotune/build/template.py), so every other config's source is what it was before the knob.
//[pdl] // pdl_wait: griddepcontrol.wait returns once every grid this one depends on in its stream has completed and its
//[pdl] // memory operations are visible to this grid (at once where the launch was not programmatic). It is per thread,
//[pdl] // so every thread that touches global memory runs it first. pdl_launch_dependents: the next grid launched with
//[pdl] // programmatic stream serialization may begin launching once every CTA of this one has run it (or exited); that
//[pdl] // grid's own pdl_wait still waits for all of this one, so where it is called is a matter of speed only.
//[pdl] __device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
//[pdl] __device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

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
