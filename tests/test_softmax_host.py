"""The row softmax kernel's own code run on the CPU: kernels/softmax.cu compiled by the host C++ compiler with
one std::thread per CUDA thread (warp shuffles and __syncthreads emulated with barriers), so its index
arithmetic (unaligned row starts, scalar edges, the register cache, cross-warp reductions, rows past the
end) is checked against an fp64 softmax without a GPU. The PTX helpers (ex2.approx, cvt) get host twins.
The gate and the real launches are tests/test_gpu_softmax.py's.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest

from evotune.build.template import read_template
from evotune.problems import get_problem
from evotune.space.searchspace import load_builtin
from _paths import REPO_ROOT

pytestmark = pytest.mark.slow

PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <algorithm>
#include <thread>
#include <vector>
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static  // one CTA runs at a time
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
thread_local Dim3 threadIdx, blockIdx;
struct uint2 { unsigned int x, y; };
struct uint4 { unsigned int x, y, z, w; };
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
using std::min;
std::barrier<>* g_block;
std::vector<std::unique_ptr<std::barrier<>>> g_warps;
std::vector<float> g_lanes;
inline void __syncthreads() { g_block->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int off) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    g_lanes[threadIdx.x] = v;
    g_warps[warp]->arrive_and_wait();
    const float r = g_lanes[warp * 32 + (lane ^ off)];
    g_warps[warp]->arrive_and_wait();
    return r;
}
"""

HOST_HELPERS = {
    r"__device__ __forceinline__ float fast_exp2\(float x\) \{.*?\n\}":
        "inline float fast_exp2(float x) { return std::exp2(x); }",
    r"template <bool IS_BF16>\n__device__ __forceinline__ float to_float\(unsigned short bits\) \{.*?\n\}":
        """template <bool IS_BF16> inline float to_float(unsigned short bits) {
    if constexpr (IS_BF16) { return __uint_as_float(static_cast<unsigned int>(bits) << 16); }
    else { _Float16 h; std::memcpy(&h, &bits, 2); return (float)h; }
}""",
    r"template <bool IS_BF16>\n__device__ __forceinline__ unsigned short from_float\(float f\) \{.*?\n\}":
        """template <bool IS_BF16> inline unsigned short from_float(float f) {
    if constexpr (IS_BF16) {  // round to nearest even
        unsigned u; std::memcpy(&u, &f, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
        return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    } else { _Float16 h = (_Float16)f; unsigned short b; std::memcpy(&b, &h, 2); return b; }
}""",
}

# One program for every instantiation under test: `prog INDEX ROWS COLS IN OUT` runs instantiation INDEX.
RUNNER = r"""
template <class Tr>
void run(int rows, int cols, const unsigned short* x, unsigned short* y) {
    g_lanes.assign(Tr::kThreads, 0.f);
    g_warps.clear();
    for (int w = 0; w < Tr::kThreads / 32; ++w) g_warps.emplace_back(new std::barrier<>(32));
    std::barrier<> block(Tr::kThreads);
    g_block = &block;
    for (int b = 0; b < (rows + Tr::kRowsPerCta - 1) / Tr::kRowsPerCta; ++b) {
        std::vector<std::thread> threads;
        for (int t = 0; t < Tr::kThreads; ++t) threads.emplace_back([=] {
            blockIdx.x = b; threadIdx.x = t;
            evotune::softmax_rows<Tr>(x, y, rows, cols, cols);
        });
        for (auto& th : threads) th.join();
    }
}
typedef void (*Runner)(int, int, const unsigned short*, unsigned short*);
Runner runners[] = {%s};
int main(int argc, char** argv) {
    const int index = atoi(argv[1]), rows = atoi(argv[2]), cols = atoi(argv[3]);
    std::vector<unsigned short> x((size_t)rows * cols), y((size_t)rows * cols, 0x7e00);  // NaN poison
    FILE* f = fopen(argv[4], "rb");
    if (fread(x.data(), 2, x.size(), f) != x.size()) return 3;
    fclose(f);
    runners[index](rows, cols, x.data(), y.data());
    f = fopen(argv[5], "wb");
    fwrite(y.data(), 2, y.size(), f);
    fclose(f);
}
"""

# Each strategy with sub-warp, whole-warp and multi-warp rows and each vector width; unroll 4 on the streams.
CONFIGS = [
    {"strategy": "cached", "vec": 8, "threads_per_row": 32, "rows_per_cta": 4},
    {"strategy": "cached", "vec": 4, "threads_per_row": 64, "rows_per_cta": 2},
    {"strategy": "cached", "vec": 2, "threads_per_row": 8, "rows_per_cta": 8},
    {"strategy": "online", "vec": 8, "threads_per_row": 4, "rows_per_cta": 16, "unroll": 2},
    {"strategy": "online", "vec": 4, "threads_per_row": 128, "rows_per_cta": 1, "unroll": 4},
    {"strategy": "online", "vec": 2, "threads_per_row": 32, "rows_per_cta": 2, "unroll": 1},
    {"strategy": "three_pass", "vec": 8, "threads_per_row": 64, "rows_per_cta": 2, "unroll": 2},
    {"strategy": "three_pass", "vec": 2, "threads_per_row": 16, "rows_per_cta": 2, "unroll": 4},
]
# Ragged: one column, fewer columns than a vector, odd widths (no row start aligned), rows past the last CTA's end.
SHAPES = ["5,1", "3,7:bf16", "7,33", "11,301:bf16", "6,1003", "3,1024:bf16"]
PATTERNS = ("normal", "large", "very_negative", "masked")


@pytest.fixture(scope="module")
def host_source():
    """The kernel template with host twins of its PTX helpers, or a skip where no C++20 compiler with _Float16 is found."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    # With its local headers inlined (kernels/elementwise.cuh holds exp2 and the conversions), as NVRTC gets it.
    _, text = read_template("softmax.cu", search=(REPO_ROOT / "kernels",))
    for pattern, replacement in HOST_HELPERS.items():
        text, count = re.subn(pattern, lambda _: replacement, text, flags=re.S)
        assert count == 1, f"kernel helper not found for its host twin: {pattern[:60]}"
    assert "asm(" not in text, "a PTX helper has no host twin"
    return cxx, PRELUDE + text


def _quantize(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(bit patterns, the values they hold as fp32) of x in fp16 or bf16 (round to nearest even)."""
    if dtype == "fp16":
        h = x.astype(np.float16)
        return h.view(np.uint16), h.astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    bits = np.where(np.isinf(x), u >> 16, (u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32)


def _inputs(rows: int, cols: int, pattern: str, rng) -> np.ndarray:
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if pattern == "large":
        x *= 30
    elif pattern == "very_negative":
        x -= 200
    elif pattern == "masked":
        drop = rng.random(x.shape) < 0.5
        drop[:, rng.integers(cols)] = False
        x[drop] = -np.inf
    return x


def _build(host_source, softmax, work, folder):
    """One executable holding the instantiation of every (config, shape) in `work`, in order."""
    cxx, text = host_source
    instantiations = [", ".join(str(v) for _, v in softmax.template_args(cfg, shape)) for cfg, shape in work]
    code = text + RUNNER % ", ".join(f"run<evotune::SoftmaxTraits<{targs}>>" for targs in instantiations)
    src, exe = folder / "softmax_host.cpp", folder / "softmax_host"
    src.write_text(code)
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-pthread", "-w", str(src), "-o", str(exe)],
                          capture_output=True, text=True)
    if proc.returncode and "_Float16" in proc.stderr:
        pytest.skip("the host compiler has no _Float16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


def test_kernel_code_matches_fp64_softmax_on_the_host(host_source, tmp_path):
    """Every config below, on ragged shapes and stress inputs, writes every element within the gate of an fp64 softmax."""
    softmax, space = get_problem("softmax"), load_builtin("softmax")
    work = []
    for overrides in CONFIGS:
        cfg = space.config(overrides)
        for text in SHAPES:
            shape = softmax.parse_shape(text)
            if space.admitted(cfg, softmax.context(shape)):
                work.append((cfg, shape))
    assert len(work) >= 30
    exe = _build(host_source, softmax, work, tmp_path)
    rng = np.random.default_rng(2026)
    for index, (cfg, shape) in enumerate(work):
        atol, rtol = softmax.tolerance(shape)
        for pattern in PATTERNS:
            bits, x = _quantize(_inputs(shape.rows, shape.cols, pattern, rng), shape.dtype)
            bits.tofile(tmp_path / "x.bin")
            subprocess.run([str(exe), str(index), str(shape.rows), str(shape.cols), str(tmp_path / "x.bin"),
                            str(tmp_path / "y.bin")], check=True, timeout=60)
            out = np.fromfile(tmp_path / "y.bin", dtype=np.uint16).reshape(shape.rows, shape.cols)
            y = out.view(np.float16).astype(np.float64) if shape.dtype == "fp16" else \
                (out.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
            e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
            ref = e / e.sum(axis=1, keepdims=True)
            assert np.isfinite(y).all(), (cfg.key(), shape.spec, pattern, "unwritten or non-finite outputs")
            ratio = float(np.max(np.abs(y - ref) / (atol + rtol * np.abs(ref))))
            assert ratio <= 1.0, (cfg.key(), shape.spec, pattern, ratio)
