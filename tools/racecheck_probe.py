"""Does compute-sanitizer's racecheck model `bar.arrive`? (developer tool, GPU)

Two minimal kernels hand one shared-memory tile from a producer warp to a consumer warp:
  arrive: producer st.shared; bar.arrive 1, 64   consumer bar.sync 1, 64; ld.shared
  sync:   producer st.shared; bar.sync 1, 64     consumer bar.sync 1, 64; ld.shared
  cp.async: producer cp.async global->shared; cp.async.wait_all; bar.arrive 1, 64
  cp.async-war: consumer reads, bar.arrive 2, 64; producer bar.sync 2, 64, then cp.async overwrites
All are race-free by the PTX ISA (bar.arrive orders the arriving thread's prior accesses
for all participants once the barrier completes). Run each under racecheck:

    python3 tools/racecheck_probe.py            # runs both under compute-sanitizer
"""

import os
import subprocess
import sys

SRC_CP_ASYNC = r'''
extern "C" __global__ void probe(float* out, const float4* src) {
    __shared__ __align__(16) float4 tile[32];
    const int lane = threadIdx.x & 31;
    const unsigned dst = (unsigned)__cvta_generic_to_shared(&tile[lane]);
    if (threadIdx.x < 32) {                  // producer warp
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src + lane));
        asm volatile("cp.async.wait_all;" ::: "memory");
        asm volatile("bar.arrive 1, 64;" ::: "memory");
        WAR_PRODUCER
    } else {                                 // consumer warp
        asm volatile("bar.sync 1, 64;" ::: "memory");
        out[lane] = tile[(lane + 1) & 31].x;
        WAR_CONSUMER
    }
}
'''
WAR_P = """asm volatile("bar.sync 2, 64;" ::: "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src + 32 + lane));
        asm volatile("cp.async.wait_all;" ::: "memory");"""
WAR_C = """asm volatile("bar.arrive 2, 64;" ::: "memory");"""

SRC = r'''
extern "C" __global__ void probe(float* out) {
    __shared__ float tile[32];
    const int lane = threadIdx.x & 31;
    if (threadIdx.x < 32) {                  // producer warp
        tile[lane] = lane * 2.0f;
        asm volatile("BARRIER_OP 1, 64;" ::: "memory");
    } else {                                 // consumer warp
        asm volatile("bar.sync 1, 64;" ::: "memory");
        out[lane] = tile[(lane + 1) & 31];
    }
}
'''


def target(op: str) -> None:
    import cupy as cp

    out = cp.zeros(32, dtype=cp.float32)
    if op.startswith("cp.async"):
        war = op == "cp.async-war"
        code = SRC_CP_ASYNC.replace("WAR_PRODUCER", WAR_P if war else "").replace("WAR_CONSUMER", WAR_C if war else "")
        src = cp.arange(64 * 4, dtype=cp.float32)
        cp.RawModule(code=code).get_function("probe")((1,), (64,), (out, src))
        expected = 4.0
    else:
        cp.RawModule(code=SRC.replace("BARRIER_OP", op)).get_function("probe")((1,), (64,), (out,))
        expected = 2.0
    cp.cuda.runtime.deviceSynchronize()
    assert float(out[0]) == expected, out
    print("probe launched", op)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        target(sys.argv[1])
        sys.exit(0)
    for op in ("bar.arrive", "bar.sync", "cp.async", "cp.async-war"):
        res = subprocess.run(["compute-sanitizer", "--tool", "racecheck", sys.executable, os.path.abspath(__file__), op],
                             capture_output=True, text=True)
        summary = [l for l in (res.stdout + res.stderr).splitlines() if "SUMMARY" in l or "probe launched" in l]
        print(f"producer {op:<10} -> racecheck rc={res.returncode}: {' | '.join(summary)}")
