"""Verify and time given configs beside the SDPA backends, in one process (developer tool, GPU).

    python3 tools/time_configs.py mission '{"block_m":16,"warp_key_groups":4}' '{...}'
    python3 tools/time_configs.py --with-flag no_wg_overlap gpt2 '{"mma":"wgmma",...}'
    python3 tools/time_configs.py --space attention-hopper3-rescale gpt2 '{"mma":"wgmma","rescale":"lazy",...}'

--space NAME reads the configs over that built-in space (default attention), for a knob only a narrower space lists.

--with-flag FLAG also times each config compiled with the template's `//[FLAG]` lines kept (evotune/build/template.py),
a variant no search proposes: e.g. no_wg_overlap, the Hopper kernel without its intra-warpgroup overlap (issue 13
item 1's baseline). Such a variant is measured to explain a technique's effect, never recorded as a config.

Each config passes the gate and is timed alone (evaluate_compiled, as the search does); then every
config that passed, SDPA flash and SDPA cudnn are timed again interleaved in one pool
(evotune.gpu.interleave: rounds in a varied order, so no contender carries the drift of what ran
before it). The table shows the interleaved figures and, per config, cudnn's time over the config's
per round (>1: the config is faster), median and min-max. Configs that fail the gate are reported
and not timed; $OUT/time_configs.json keeps everything.
"""

import copy
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from evotune.build.compile import compile_source, load_kernel  # noqa: E402
from evotune.build.template import instantiate  # noqa: E402
from evotune.gpu.evaluate import bind_kernel, evaluate_compiled, measure_baselines  # noqa: E402
from evotune.gpu.interleave import DEFAULT_ROUNDS, head_to_head, split_reps  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.shapes import parse_shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402

BASELINES = ["flash", "cudnn"]
REPS = 100  # interleaved: DEFAULT_ROUNDS rounds of REPS // DEFAULT_ROUNDS replays, as evotune bench's default


def gate_line(res) -> str:
    """A config's gate and solo timing on one line (the tool's line before interleaving existed)."""
    return (f"{res.status:<7} {res.time_us or 0:8.2f} us  regs {res.resources['registers']}  "
            f"gate {((res.verification or {}).get('gate_ratio') or 0):.3f} {res.message[:60]}")


def table_lines(rows: list[dict], interleaved: dict | None, failures: dict[str, str]) -> list[str]:
    """The printed table: the baselines' and each config's interleaved median, p10-p90, solo time and
    cudnn's time over the config per round (median, min-max); `interleaved` is Interleaved.as_dict()
    with "vs_cudnn" (label -> paired_ratios) added, or None when nothing was timed."""
    timings = (interleaved or {}).get("timings", {})
    vs = (interleaved or {}).get("vs_cudnn", {})
    lines = []
    if interleaved:
        lines.append(f"interleaved: {interleaved['rounds']} rounds x {interleaved['reps_per_round']} replays "
                     f"per contender, each round in a new order; medians")
    for name in BASELINES:
        t = timings.get(name)
        lines.append(f"SDPA {name:<8} {t['median_us']:8.2f} us  ({t['p10_us']:.2f}-{t['p90_us']:.2f})"
                     if t else f"SDPA {name:<8} {'n/a':>8}")
    for row in rows:
        label, t = row.get("label"), timings.get(row.get("label"))
        if label in failures:
            lines.append(f"wrong   after the interleaved timing: {failures[label][:80]}   {row['config']}")
        elif t:
            r = vs.get(label)
            ratio = f"cudnn/this {r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" if r else "cudnn/this -"
            lines.append(f"{t['median_us']:8.2f} us  ({t['p10_us']:.2f}-{t['p90_us']:.2f})  {ratio}  "
                         f"solo {row['line']}   {row['config']}")
        else:
            lines.append(f"{row['line']}   {row['config']}")
    return lines


def with_flags(problem, flags):
    """`problem` whose instantiations also keep the template lines of `flags` (for a measured variant only)."""
    flagged = copy.copy(problem)
    flagged.template_flags = lambda config: problem.template_flags(config) | frozenset(flags)
    return flagged


def parse_args(argv: list[str]) -> tuple[str | None, str, list[str]]:
    """(--with-flag's FLAG or None, the shape, the config JSONs)."""
    flag = None
    if argv[:1] == ["--with-flag"]:
        if len(argv) < 2:
            raise SystemExit("time_configs: --with-flag needs a flag name")
        flag, argv = argv[1], argv[2:]
    if not argv:
        raise SystemExit("time_configs: give a shape and config JSONs")
    return flag, argv[0], argv[1:]


def split_space(argv: list[str]) -> tuple[str, list[str]]:
    """(--space's built-in space name, default attention; the other arguments)."""
    if argv[:1] != ["--space"]:
        return "attention", argv
    if len(argv) < 2:
        raise SystemExit("time_configs: --space needs a built-in space name")
    return argv[1], argv[2:]


def main() -> None:
    space_name, argv = split_space(sys.argv[1:])
    problem, space = get_problem("attention"), load_builtin(space_name)
    flag, shape_text, texts = parse_args(argv)
    shape = parse_shape(shape_text)
    variants = [(problem, "")] + ([(with_flags(problem, {flag}), f" +{flag}")] if flag else [])
    rows, kernels = [], {}
    for i, text in enumerate(texts, 1):
        cfg = space.config(json.loads(text))
        why = space.violations(cfg, problem.context(shape))
        if why:
            rows.append({"config": text, "line": "not admitted: " + "; ".join(why)})
            continue
        for source_problem, suffix in variants:
            src = instantiate(source_problem, cfg, shape)
            compiled = compile_source(src.code, src.entry)
            res = evaluate_compiled(problem, shape, cfg, compiled)
            rows.append({"config": text + suffix, "line": gate_line(res)})
            # As each config is done, so that a kernel that hangs the process leaves the ones before it on record.
            print(f"config {i}{suffix}: {rows[-1]['line']}", file=sys.stderr, flush=True)
            if res.ok:
                rows[-1]["label"] = f"config {i}{suffix}"
                kernel = load_kernel(compiled, problem.geometry(cfg, shape).dynamic_smem)
                kernels[rows[-1]["label"]] = bind_kernel(problem, shape, cfg, kernel)
    base = measure_baselines(problem, shape, names=BASELINES)
    available = [n for n, b in base.items() if b.get("available")]
    result, violations = head_to_head(problem, shape, kernels, available, DEFAULT_ROUNDS, split_reps(REPS))
    failures = {label: str(v) for label, v in violations.items()}
    interleaved = result.as_dict() if result else None
    if result and "cudnn" in result.timings:
        interleaved["vs_cudnn"] = {k: result.ratios(k, "cudnn") for k in kernels if k in result.timings
                                   and k not in failures}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "time_configs.json"), "w") as f:
        json.dump({"shape": shape.spec, "configs": [(r["config"], r["line"]) for r in rows], "baselines": base,
                   "labels": {r["label"]: r["config"] for r in rows if "label" in r},
                   "interleaved": interleaved, "interleaved_failures": failures}, f, indent=1)
    print("\n".join(table_lines(rows, interleaved, failures)))


if __name__ == "__main__":
    main()
