// exp2_fma (evotune/problems/attention.py): a share of the softmax's exp2 computed by a polynomial on the FMA and
// integer pipes instead of the MUFU's ex2.approx: both kernels' score loops call exp2_mixed. The traits carry the
// share (template parameter EXP2_FMA): kExp2FmaEighths of every eight scores of a row, 0 for none (exp2_mixed is then
// fast_exp2). A thread's k-th score of a row goes to the FMA pipe iff (k * share) mod 8 < share, which spreads them
// evenly through the loop.
//
// Why: the MUFU does 4 ex2 per cycle per SM sub-partition, so one warp's 32 scores per thread per 64-key step take
// 256 cycles of it; the mission's mma.sync tiles run one warp per sub-partition. The polynomial below issues 9
// instructions on pipes the softmax leaves mostly idle. Measured on the H100 (docs/PERFORMANCE.md, "A share of the
// softmax's exp2 on the FMA pipe"): one eighth pays 0-3% on the mission tiles, more eighths are slower, and the
// Hopper kernel (four warps a sub-partition, issue-bound) loses 6-16%; the softmax waits on its dependent chain more
// than on the MUFU's rate (docs/TRACE.md).
//
// 2^x from x = j + f with j = rint(x) and f in [-1/2, 1/2]:
//  - j by the round-to-nearest add of 1.5 * 2^23, whose low bits then hold j (two's complement);
//  - 2^f by a degree-3 polynomial, minimax in relative error on [-1/2, 1/2] (fitted for evotune with numpy by
//    Lawson's iteration; coefficients rounded to fp32): at most 7.5e-5 relative, evaluated in fp32. That is 1/6 of
//    fp16's rounding of P (2^-11) and 1/50 of bf16's; the row sum and P V see the same value, so the softmax's
//    weights stay normalized;
//  - 2^j as a float built from its exponent bits ((j + 127) << 23, one IMAD on the add's bits), times 2^f.
// As ex2.approx.ftz: x is first clamped to -127 by max.NaN, which keeps a NaN (a NaN score gives a NaN, as the MUFU's
// does); below x = -126.5 (x = -inf: a masked score) j = -127 makes 2^j's bits 0, so the result is exactly 0; from
// there up every 2^j is a normal float (the product is subnormal in [-126.5, -126)).

template <class T>
struct Exp2Fma {
    static constexpr int kEighths = T::kExp2FmaEighths;
    static_assert(kEighths >= 0 && kEighths <= 8, "exp2_fma: 0..8 eighths of the scores on the FMA pipe");
    // Whether a thread's k-th score of a row (k from 0 in the loop's order) takes the polynomial.
    __host__ __device__ static constexpr bool on_fma(int k) { return (k * kEighths) % 8 < kEighths; }
};

__device__ __forceinline__ float exp2_poly(float x) {
    asm("max.NaN.f32 %0, %0, 0fC2FE0000;" : "+f"(x));    // x = max(x, -127), NaN kept
    const float rounded = __fadd_rn(x, 12582912.f);    // 1.5 * 2^23 + rint(x): rint(x) in the low mantissa bits
    const float j = __fadd_rn(rounded, -12582912.f);   // rint(x), exactly
    const float f = __fadd_rn(x, -j);                  // in [-1/2, 1/2], exactly
    float p = fmaf(0.05517134442925453f, f, 0.24261033535003662f);
    p = fmaf(p, f, 0.6932609677314758f);
    p = fmaf(p, f, 0.9999281167984009f);               // 2^f, relative error <= 7.5e-5
    // (j + 127) << 23 from rounded's bits (0x4B400000 + j): unsigned, so a negative j wraps; j = -127 gives +0.
    const float two_j = __uint_as_float((__float_as_uint(rounded) << 23) + 0x3F800000u);
    return p * two_j;
}

// 2^x for a thread's k-th score of a row: the polynomial for the configured share, ex2.approx for the rest.
template <class T>
__device__ __forceinline__ float exp2_mixed(int k, float x) {
    if constexpr (T::kExp2FmaEighths == 0) {
        return fast_exp2(x);
    } else {
        return Exp2Fma<T>::on_fma(k) ? exp2_poly(x) : fast_exp2(x);
    }
}
