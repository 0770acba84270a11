// exp2_fma (evotune/problems/attention.py): a share of the softmax's exp2 computed by a polynomial on the FMA and
// integer pipes instead of the MUFU's ex2.approx. Included (and its code compiled) only by those configs, through
// `//[exp2_fma]` lines of attention.cu and attention_hopper.cuh, which stand in for the score loops' fast_exp2 calls;
// every other config's source is what it was before the knob. The traits carry the share: kExp2FmaEighths of every
// eight scores of a row (a thread's k-th score of a row goes to the FMA pipe iff (k * share) mod 8 < share, which
// spreads them evenly through the loop).
//
// Why: the MUFU does 4 ex2 per cycle per SM sub-partition, so one warp's 32 scores per thread per 64-key step take
// 256 cycles of it, about half of the softmax that each mission tile step waits for (docs/TRACE.md); at head dim 64
// the tile's exp2 take as long on the MUFU as its two products on the tensor cores. The polynomial below issues 8
// instructions on pipes the softmax leaves mostly idle, so moving a quarter to three eighths of the scores there
// shortens the MUFU's share more than it lengthens the issue (FlashAttention-4 does this on Blackwell).
//
// 2^x for x <= 0, from x = j + f with j = rint(x) and f in [-1/2, 1/2]:
//  - j by the round-to-nearest add of 1.5 * 2^23, whose low bits then hold j (two's complement);
//  - 2^f by a degree-3 polynomial, minimax in relative error on [-1/2, 1/2] (fitted for evotune with numpy by
//    Lawson's iteration; coefficients rounded to fp32): at most 7.5e-5 relative, evaluated in fp32. That is 1/6 of
//    fp16's rounding of P (2^-11) and 1/50 of bf16's; the row sum and P V see the same value, so the softmax's
//    weights stay normalized;
//  - 2^j by adding j to the exponent field (j << 23 onto the polynomial's bits, one LEA).
// x is clamped to -125 first, so that j >= -125 keeps the result a normal number (~2^-125 at least) and x = -inf (a
// masked score) gives ~2^-125 where ex2.approx.ftz gives 0: below fp16's and bf16's smallest subnormal, so P's
// 16-bit value is the same 0, and the row sum gains at most 256 x 2^-125 (a row with any unmasked key sums >= 1).

template <class T>
struct Exp2Fma {
    static constexpr int kEighths = T::kExp2FmaEighths;
    static_assert(kEighths >= 1 && kEighths <= 8, "exp2_fma: 1..8 eighths of the scores on the FMA pipe");
    // Whether a thread's k-th score of a row (k from 0 in the loop's order) takes the polynomial.
    __host__ __device__ static constexpr bool on_fma(int k) { return (k * kEighths) % 8 < kEighths; }
};

__device__ __forceinline__ float exp2_poly(float x) {
    x = fmaxf(x, -125.f);
    const float rounded = __fadd_rn(x, 12582912.f);    // 1.5 * 2^23 + rint(x): rint(x) in the low mantissa bits
    const float j = __fadd_rn(rounded, -12582912.f);   // rint(x), exactly
    const float f = __fadd_rn(x, -j);                  // in [-1/2, 1/2], exactly
    float p = fmaf(0.05517134442925453f, f, 0.24261033535003662f);
    p = fmaf(p, f, 0.6932609677314758f);
    p = fmaf(p, f, 0.9999281167984009f);               // 2^f, relative error <= 7.5e-5
    return __uint_as_float(__float_as_uint(p) + (__float_as_uint(rounded) << 23));  // unsigned: j < 0 wraps
}

// 2^x for a thread's k-th score of a row: the polynomial for the configured share, ex2.approx for the rest.
template <class T>
__device__ __forceinline__ float exp2_mixed(int k, float x) {
    return Exp2Fma<T>::on_fma(k) ? exp2_poly(x) : fast_exp2(x);
}
