old_fn = """__device__ __forceinline__ u64 smem_desc(u32 addr, u32 lbo, u32 sbo) {"""
assert old_fn in code
code = code.replace(old_fn, """__device__ __forceinline__ u64 smem_desc_lo(u32 addr16, u32 lbo, u32 sbo) {
    const u32 lo = addr16 + ((lbo >> 4) << 16);
    const u32 hi = (sbo >> 4) | (1u << 30);
    u64 d; asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(hi)); return d;
}
""" + old_fn)
a = "const u64 desc_k = smem_desc(sK + k_off, 16, 1024);"
assert a in code
code = code.replace(a, "const u64 desc_k = smem_desc_lo((sK >> 4) + (k_off >> 4), 16, 1024);")
b = "smem_desc(sQ_wg + q_off, 16, 1024)"
assert b in code
code = code.replace(b, "smem_desc_lo((sQ_wg >> 4) + (q_off >> 4), 16, 1024)")
c = "smem_desc(sV + kk * 2048, T::kBlockN * 128, 1024)"
assert c in code
code = code.replace(c, "smem_desc_lo((sV >> 4) + kk * 128, T::kBlockN * 128, 1024)")
