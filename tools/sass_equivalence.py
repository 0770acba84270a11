"""Compile a sample of admitted attention configs from two source trees and require identical SASS and resources.

A kernel change that must not change the code of any config (a searched variant moved from `//[flag]` lines to a
traits member and `if constexpr`, issue 39) is checked here without a GPU: each sampled config is instantiated by each
tree's own evotune package from its own kernels folder, compiled by NVRTC for sm_90a, disassembled (cuobjdump -sass,
addresses and encodings stripped), and the two instruction listings and ptxas resources (registers, shared memory,
stack, spills, barriers) compared. Identical SASS means identical behaviour and speed: the GPU verdicts (bitwise twins,
timings) measured on the old tree still hold for the new.

The sample: for each space and shape, the admitted configs grouped by the values of the --knob knobs (each group drawn
from in turn, so both values of a knob and its neighbours appear), `-n` configs per (space, shape), seeded. Sources
that two configs share are compiled once (the compile cache).

    python tools/sass_equivalence.py --old 2e31c24 --knob exp2_fma --space attention-small-exp2 -n 12
    python tools/sass_equivalence.py --old /tmp/old-tree --knob stages --space attention-hopper3-mirror \\
        --shape gpt2-causal --shape llama-4k:bf16 -n 20
    python tools/sass_equivalence.py --old HEAD --old-kernels /tmp/kernels-before   # two kernels folders, one evotune

--old: a git revision (its evotune, kernels and search_spaces, by git archive) or a folder holding such a tree; --new:
a folder (default: this working tree). --old-kernels / --new-kernels: a kernels folder instead of the tree's own
(EVOTUNE_KERNELS). Exit status: 0 when every config compiles to the same SASS and resources in both (or fails to compile
in both), 1 when any differs (the first differing instruction is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

DEFAULT_SHAPES = ["mission", "gpt2", "gpt2-causal", "llama-4k", "llama-4k-causal", "gpt2:bf16:kv4",
                  "llama-4k:bf16:causal:bshd"]

# One SASS instruction line: /*0040*/ OPCODE operands ; /* 0x... */  -> the "OPCODE operands" part.
_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")

# Run inside a tree (its own evotune package and kernels/): compile each (shape, config) of stdin with `jobs`
# processes (instantiated with stdin's options: write_lse for the training variant), print {index: {"sass":
# [instructions], "resources": {...}} or {"error": first line}}.
_DUMP = r"""
import json, re, sys
from concurrent.futures import ProcessPoolExecutor
LINE = re.compile(%r)

def one(item):
    family, shape, cfg, options = item
    from evotune.build.compile import compile_source
    from evotune.build.sass import disassemble
    from evotune.build.template import instantiate
    from evotune.problems import get_problem
    from evotune.space.searchspace import Config
    try:
        problem = get_problem(family)
        src = instantiate(problem, Config.from_dict(cfg), problem.parse_shape(shape), **options)
        compiled = compile_source(src.code, src.entry)
    except Exception as e:  # a compile failure is a value: both trees must fail alike
        return {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:200]}
    return {"sass": [m.group(1) for m in LINE.finditer(disassemble(compiled.cubin_path))],
            "resources": compiled.resources.as_dict()}

if __name__ == "__main__":
    family, jobs, items, options = json.loads(sys.stdin.read())
    with ProcessPoolExecutor(jobs) as pool:
        print(json.dumps(dict(enumerate(pool.map(one, [(family, s, c, options) for s, c in items], chunksize=1)))))
""" % _LINE.pattern


def dump(tree: Path, kernels: Path | None, items: list, jobs: int, options: dict | None = None,
         family: str = "attention") -> dict:
    """Each item's listing and resources as `tree`'s evotune compiles it (from `kernels` if given), instantiated with
    `options` by `family`'s problem."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("EVOTUNE_KERNELS", None)
    if kernels:
        env["EVOTUNE_KERNELS"] = str(kernels.resolve())
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(_DUMP)
    try:
        proc = subprocess.run([sys.executable, script.name], input=json.dumps([family, jobs, items, options or {}]),
                              capture_output=True, text=True, cwd=tree, env=env)
    finally:
        os.unlink(script.name)
    if proc.returncode != 0:
        sys.exit(f"sass_equivalence: compiling in {tree} failed:\n{proc.stderr.strip()[-3000:]}")
    return {int(k): v for k, v in json.loads(proc.stdout).items()}


def sample(spaces: list[str], shapes: list[str], knobs: list[str], per: int, seed: int,
           family: str = "attention") -> list[tuple[str, dict]]:
    """`per` admitted configs of each (space, shape), drawn in turn from the groups of equal --knob values."""
    sys.path.insert(0, str(REPO))
    from evotune.problems import get_problem
    from evotune.space.searchspace import load_builtin

    problem = get_problem(family)

    rng, items = random.Random(seed), []
    for name in spaces:
        space = load_builtin(name)
        for shape in shapes:
            groups: dict = {}
            for cfg in space.admitted_configs(problem.context(problem.parse_shape(shape))):
                d = cfg.as_dict()
                groups.setdefault(tuple(str(d.get(k)) for k in knobs), []).append(d)
            pools = [rng.sample(g, len(g)) for _, g in sorted(groups.items())]
            taken = 0
            while taken < per and any(pools):
                for pool in pools:
                    if pool and taken < per:
                        items.append((shape, pool.pop()))
                        taken += 1
    return items


def old_tree(spec: str, tmp: str) -> Path:
    """The old side's tree: a folder as it is, else a git revision archived into `tmp`."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    archive = subprocess.run(["git", "archive", spec, "evotune", "kernels", "search_spaces"], cwd=REPO,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
    return Path(tmp)


def label(shape: str, cfg: dict, knobs: list[str]) -> str:
    first = [k for k in knobs if k in cfg]
    return f"{shape:26s} " + ",".join(f"{k}={cfg[k]}" for k in first + sorted(set(cfg) - set(first)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", default="HEAD", help="a git revision or a tree folder (default HEAD)")
    ap.add_argument("--new", type=Path, default=REPO, help="a tree folder (default: this working tree)")
    ap.add_argument("--old-kernels", type=Path, help="compile the old side from this kernels folder")
    ap.add_argument("--new-kernels", type=Path, help="compile the new side from this kernels folder")
    ap.add_argument("--family", default="attention", help="the kernel family (default attention; attention-decode)")
    ap.add_argument("--space", action="append", help="a built-in space to sample (repeatable; default the family's)")
    ap.add_argument("--shape", action="append", help=f"a shape (repeatable; default {' '.join(DEFAULT_SHAPES)})")
    ap.add_argument("--knob", action="append", default=[], help="stratify the sample by this knob's values (repeatable)")
    ap.add_argument("--config", nargs=2, action="append", metavar=("SHAPE", "JSON"), default=[],
                    help="also compare this config (knobs over the space's defaults)")
    ap.add_argument("-n", type=int, default=12, help="configs per (space, shape) (default 12)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--quiet", action="store_true", help="print only differing configs and the summary")
    ap.add_argument("--write-lse", action="store_true",
                    help="compare the training variant (the entry that also writes the log-sum-exp)")
    args = ap.parse_args()

    if args.family != "attention" and not args.shape:
        ap.error("--shape: the default shapes are attention's; name the family's")
    items = sample(args.space or [args.family], args.shape or DEFAULT_SHAPES, args.knob, args.n, args.seed, args.family)
    items += [(shape, json.loads(text)) for shape, text in args.config]
    with tempfile.TemporaryDirectory() as tmp:
        options = {"write_lse": True} if args.write_lse else {}
        before = dump(old_tree(args.old, tmp), args.old_kernels, items, args.jobs, options, args.family)
    after = dump(args.new.resolve(), args.new_kernels, items, args.jobs, options, args.family)

    differ = failed = 0
    for i, (shape, cfg) in enumerate(items):
        a, b, name = before[i], after[i], label(shape, cfg, args.knob)
        if "error" in a or "error" in b:
            same = "error" in a and "error" in b
            failed += same
            differ += not same
            print(f"{'both fail' if same else 'DIFFERS':9s} {a.get('error', 'compiles')!r} vs "
                  f"{b.get('error', 'compiles')!r}  {name}")
            continue
        regs = f"regs {a['resources']['registers']:3d}"
        if a["sass"] == b["sass"] and a["resources"] == b["resources"]:
            if not args.quiet:
                print(f"same      {len(a['sass']):6d} instr  {regs}  {name}")
            continue
        differ += 1
        x, y = a["sass"], b["sass"]
        first = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        res = [f"{k} {a['resources'][k]} -> {b['resources'][k]}" for k in a["resources"]
               if a["resources"][k] != b["resources"].get(k)]
        print(f"DIFFERS   {len(x):6d} -> {len(y)} instr  {regs}  {name}\n          "
              + (f"resources: {', '.join(res)}; " if res else "")
              + (f"first at {first}: {x[first] if first < len(x) else '(end)'!r} vs "
                 f"{y[first] if first < len(y) else '(end)'!r}" if x != y else "same instructions"))
    print(f"{len(items) - differ} of {len(items)} configs compile to the same SASS and resources "
          f"({failed} fail to compile in both), old {args.old} vs new {args.new}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
