"""Compile the same attention configs from two source trees and say whether their SASS is the same.

A kernel refactor that must not change the kernels it already had (e.g. a new knob threaded through
the Hopper variant, whose code paths the old configs do not take) is checked here without a GPU:
each config is instantiated and compiled by NVRTC for sm_90a in a `git archive` of REF and in the
working tree, and the two disassemblies are compared instruction by instruction (addresses and
encodings stripped). Identical SASS means the GPU verdicts measured at REF still hold.

    python tools/sass_compare.py                 # HEAD against the working tree, the built-in config spread
    python tools/sass_compare.py --ref b4d7a5b --out /tmp/sass   # also keep both listings per config
    python tools/sass_compare.py --ref da3a32d --config 2,16,8192,64 '{"mma":"wgmma","persistent":true}'
                                                 # these configs instead of the spread (repeatable)

Exit status: 0 if every config's SASS matches, 1 if any differs (the first differing lines are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The configs tests/test_hopper.py compiles, one per code path of the Hopper variant (producer or not, ping-pong,
# Q in registers, one to three consumer warpgroups, 176-key tiles, causal, bf16, ragged BSHD), plus a causal
# two-warpgroup producer config, grouped K/V heads, and two mma.sync configs.
sys.path.insert(0, str(REPO / "tests"))
from test_hopper import SPREAD, W  # noqa: E402

CONFIGS = SPREAD + [
    ("16,12,1024,64:causal", dict(W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2,
                                  q_in_regs=False)),
    ("2,32,8,1024,128:causal", dict(W, block_m=128, block_n=64, compute_warps=8, producer_warps=4, stages=2,
                                    q_in_regs=True)),
    ("1,8,512,64", dict(block_m=64, block_n=64, compute_warps=4, producer_warps=0, stages=2, smem_layout="swizzle",
                        q_in_regs=True)),
    ("16,12,1024,64:causal", dict(block_m=128, block_n=64, compute_warps=8, producer_warps=1, stages=3,
                                  smem_layout="pad", q_in_regs=False, kv_splits=1, warp_key_groups=1)),
]

# One SASS instruction line: /*0040*/ OPCODE operands ; /* 0x... */  -> the "OPCODE operands" part.
_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")

# Run inside a tree (its own evotune package and kernels/): compile each config, print {index: sass lines}.
_DUMP = r"""
import json, sys
from evotune.build.compile import compile_source
from evotune.build.sass import disassemble
from evotune.build.template import instantiate
from evotune.problems.attention import PROBLEM
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import Config
out = {}
for i, (shape, cfg) in enumerate(json.loads(sys.stdin.read())):
    src = instantiate(PROBLEM, Config.from_dict(cfg), parse_shape(shape))
    compiled = compile_source(src.code, src.entry)
    out[i] = {"sass": disassemble(compiled.cubin_path), "registers": compiled.resources.registers}
print(json.dumps(out))
"""


def instructions(sass: str) -> list[str]:
    return [m.group(1) for m in _LINE.finditer(sass)]


def dump(tree: Path, configs: list) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, "-c", _DUMP], input=json.dumps(configs), capture_output=True, text=True,
                          cwd=tree, env=env)
    if proc.returncode != 0:
        sys.exit(f"sass_compare: compiling in {tree} failed:\n{proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="HEAD", help="the git revision to compare the working tree against")
    ap.add_argument("--out", type=Path, help="write each config's two instruction listings here")
    ap.add_argument("--config", nargs=2, action="append", metavar=("SHAPE", "JSON"),
                    help="compare this config (knobs over the defaults) on this shape instead of the spread")
    args = ap.parse_args()
    configs = [(shape, json.loads(text)) for shape, text in args.config] if args.config else CONFIGS
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.ref, "evotune", "kernels", "search_spaces"], cwd=REPO,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        before = dump(Path(tmp), configs)
    after = dump(REPO, configs)
    differ = 0
    for i, (shape, cfg) in enumerate(configs):
        a, b = instructions(before[str(i)]["sass"]), instructions(after[str(i)]["sass"])
        label = f"{shape:28s} " + ",".join(f"{k}={v}" for k, v in sorted(cfg.items()) if k not in W)
        regs = f"regs {before[str(i)]['registers']} -> {after[str(i)]['registers']}"
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            for tag, lines in (("ref", a), ("tree", b)):
                (args.out / f"{i:02d}-{tag}.sass").write_text("\n".join(lines) + "\n")
        if a == b:
            print(f"same     {len(a):6d} instr  {regs}  {label}")
            continue
        differ += 1
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"DIFFERS  {len(a):6d} -> {len(b)} instr  {regs}  {label}\n"
              f"         first at {first}: {a[first] if first < len(a) else '(end)'!r} vs "
              f"{b[first] if first < len(b) else '(end)'!r}")
    print(f"{len(configs) - differ} of {len(configs)} configs compile to the same SASS at {args.ref} and in the tree")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
