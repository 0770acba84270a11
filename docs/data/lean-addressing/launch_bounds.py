"""Experiment (CPU, NVRTC only): gpt2's d64 tiles compiled with the kernel's __launch_bounds__ asking for more CTAs per
SM than ptxas gives them (one CTA is the template's minimum), to see whether a third CTA of the two-consumer tile or
a fifth of the one-warpgroup tile fits in registers. Prints registers and spills per variant.

    python3 docs/data/lean-addressing/launch_bounds.py > docs/data/lean-addressing/launch-bounds.txt
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))

from evotune.build.compile import compile_source  # noqa: E402
from evotune.build.template import instantiate  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.shapes import parse_shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402

WRITTEN = 'extern "C" __global__ void __launch_bounds__(EvotuneTraits::kThreads, 1)'
KNOBS = dict(mma="wgmma", producer_warps=0, stages=4, pingpong=False, persistent=False, epilogue="tma", rescale="lazy",
             softmax_overlap=True, lean_addressing=True)
TILES = [(dict(block_m=128, block_n=64, compute_warps=8), (1, 2, 3)), (dict(block_m=64, block_n=64, compute_warps=4), (1, 4, 5, 6))]

attention, space, shape = get_problem("attention"), load_builtin("attention-hopper3-lean"), parse_shape("gpt2")
for tile, ctas in TILES:
    for q_in_regs in (True, False):
        src = instantiate(attention, space.config(dict(KNOBS, q_in_regs=q_in_regs, **tile)), shape)
        assert WRITTEN in src.code
        for n in ctas:
            code = src.code.replace(WRITTEN, WRITTEN.replace(", 1)", f", {n})"))
            res = compile_source(code, src.entry).resources
            print(f"M{tile['block_m']} N{tile['block_n']} cw{tile['compute_warps']} q_in_regs={q_in_regs} "
                  f"min CTAs/SM {n}: {res.registers} registers, {res.spill_stores} B spill stores, "
                  f"{res.spill_loads} B spill loads")
