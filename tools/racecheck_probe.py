"""Does compute-sanitizer's racecheck model `bar.arrive`? (developer tool, GPU)

Two minimal kernels hand one shared-memory tile from a producer warp to a consumer warp:
  arrive: producer st.shared; bar.arrive 1, 64   consumer bar.sync 1, 64; ld.shared
  sync:   producer st.shared; bar.sync 1, 64     consumer bar.sync 1, 64; ld.shared
Both are race-free by the PTX ISA (bar.arrive orders the arriving thread's prior accesses
for all participants once the barrier completes). Run each under racecheck:

    python3 tools/racecheck_probe.py            # runs both under compute-sanitizer
"""

import os
import subprocess
import sys

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

    mod = cp.RawModule(code=SRC.replace("BARRIER_OP", op))
    out = cp.zeros(32, dtype=cp.float32)
    mod.get_function("probe")((1,), (64,), (out,))
    cp.cuda.runtime.deviceSynchronize()
    assert float(out[0]) == 2.0, out
    print("probe launched", op)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        target(sys.argv[1])
        sys.exit(0)
    for op in ("bar.arrive", "bar.sync"):
        res = subprocess.run(["compute-sanitizer", "--tool", "racecheck", sys.executable, os.path.abspath(__file__), op],
                             capture_output=True, text=True)
        summary = [l for l in (res.stdout + res.stderr).splitlines() if "SUMMARY" in l or "probe launched" in l]
        print(f"producer {op:<10} -> racecheck rc={res.returncode}: {' | '.join(summary)}")
