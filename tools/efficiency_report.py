"""Search-efficiency report: how fast each strategy closes in on the exhaustive optimum of a small space.

Input: a run recorded with `--sampler exhaustive` (every admitted config of its space measured once).
Each strategy (several seeds) is replayed through the real search loop (evotune.search.loop.run_search)
with an evaluator and a compiler that answer from the exhaustive run's records: a strategy only
ever sees results, so this is exactly what it would have been told on the GPU, less re-measurement
noise (a live search re-measures, and its timings scatter by a few tenths of a percent to a few
percent). Nothing is compiled or launched: it runs on a CPU in a minute or two.

    python tools/efficiency_report.py runs/mission-h100-exhaustive-small
    python tools/efficiency_report.py RUN --seeds 5 --budget-pct 30 --out-dir docs

Writes OUT_DIR/EFFICIENCY.md (tables), OUT_DIR/efficiency.png (best-so-far curves; needs matplotlib:
pip install -e '.[report]') and OUT_DIR/data/efficiency.json (every curve); --md, --plot and --json name other
files (a second exhaustive oracle's report). Rewriting a report keeps the sections tools/kt_compare.py wrote into
the file (one per oracle, and the verdict across them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from evotune.records import result as R  # noqa: E402
from evotune.build.compile import CompileError, Compiled, Resources  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.records.result import Result  # noqa: E402
from evotune.records.runs import Run, runs_dir  # noqa: E402
from evotune.search.loop import SearchOptions, run_search  # noqa: E402
from evotune.space.searchspace import Config, load_space  # noqa: E402
from evotune.build.template import REPO_ROOT  # noqa: E402

DEFAULT_STRATEGIES = ("surrogate", "nsga2", "nsga2-plain", "tpe", "random")  # nsga2-plain: Optuna's NSGA-II, unsteered
CHECKPOINTS_PCT = (5, 10, 15, 30)
WITHIN = 0.03            # "within 3% of the exhaustive optimum"
TARGET_PCT = 15          # the default strategy should get there within this share of the space (median)
DEFAULT_STRATEGY = SearchOptions.sampler  # the search's default, whatever it is
# A live search on the H100 machine (16 CPUs) asks this many proposals ahead of the GPU by default.
H100_COMPILE_WORKERS = 16


class ReplayError(Exception):
    pass


# --------------------------------------------------------------------------- the exhaustive record


class Exhaustive:
    """The exhaustive run: its problem, shape and space, and the first record of every admitted config."""

    def __init__(self, path: Path):
        self.run = Run(Path(path))
        self.meta = self.run.meta()
        self.problem = get_problem(self.meta.get("family", "attention"))
        self.shape = self.problem.shape_from_dict(self.meta["shape"])
        context = self.problem.context(self.shape)
        space_path = Path(self.meta["space"])
        self.space = load_space(space_path if space_path.is_absolute() else REPO_ROOT / space_path, tuple(context))
        self.admitted = self.space.admitted_configs(context)
        firsts = {}
        for r in self.run.trials():
            if r.get("duplicate_of") is None and r.get("counted"):
                firsts.setdefault(r["digest"], r)
        self.records = firsts
        missing = [c for c in self.admitted if c.digest() not in firsts]
        if missing:
            raise ReplayError(f"{path}: {len(missing)} of {len(self.admitted)} admitted configs have no record "
                              f"(first: {missing[0].key()}); finish it with `evotune search --resume "
                              f"--sampler exhaustive --trials {len(self.admitted)} ...`")
        ok = [r["result"]["time_us"] for d, r in firsts.items() if r["result"]["status"] == R.OK]
        if not ok:
            raise ReplayError(f"{path}: no admitted config passed the gate")
        self.optimum = min(ok)
        digests = {c.digest() for c in self.admitted}
        self.best = min((r for d, r in firsts.items() if d in digests and r["result"]["status"] == R.OK),
                        key=lambda r: r["result"]["time_us"])
        self.statuses = {}
        for c in self.admitted:
            s = firsts[c.digest()]["result"]["status"]
            self.statuses[s] = self.statuses.get(s, 0) + 1

    @property
    def size(self) -> int:
        return len(self.admitted)

    def record(self, config: Config) -> dict:
        try:
            return self.records[config.digest()]
        except KeyError:
            raise ReplayError(f"no record of {config.key()} in {self.run.path}") from None

    def compiler(self, config: Config, source) -> Compiled:
        """What compiling told the loop: the recorded compile error, or the recorded resources (which the
        loop's static gate judges again, as it did in the exhaustive run)."""
        res = self.record(config)["result"]
        if res["status"] == R.COMPILE_ERROR:
            raise CompileError(res["message"])
        resources = Resources(**res["resources"]) if res.get("resources") else Resources(0, 0, 0, 0, 0, 0)
        return Compiled(key=config.digest(), entry=source.entry, arch="recorded", cubin_path="", options=(), log="",
                        resources=resources, compile_seconds=res.get("compile_seconds") or 0.0, cached=True)

    def evaluate(self, config: Config, compiled) -> Result:
        return Result.from_dict(self.record(config)["result"])


class _Started:
    """The exhaustive run as a starting evaluator (evotune.search.loop.StartsEvaluations), as a live search's is:
    the candidate is handed over, the loop asks its next proposals, then takes the Result, so a replay's proposals
    see the results a live search's see."""

    def __init__(self, ex: Exhaustive):
        self.ex = ex

    def __call__(self, config: Config, compiled) -> Result:
        return self.ex.evaluate(config, compiled)

    def start(self, config: Config, compiled):
        return lambda: self.ex.evaluate(config, compiled)


# --------------------------------------------------------------------------- curves


def best_so_far(records: list[dict], budget: int) -> list[float]:
    """Best passing time after each of the first `budget` counted evaluations (inf before the first pass);
    a run that stopped early (space exhausted) keeps its last value."""
    curve, best = [], math.inf
    for r in records:
        if not r.get("counted"):
            continue
        if r["result"]["status"] == R.OK and r["result"]["time_us"] < best:
            best = r["result"]["time_us"]
        curve.append(best)
        if len(curve) == budget:
            break
    while curve and len(curve) < budget:
        curve.append(curve[-1])
    return curve or [math.inf] * budget


def evals_to_within(curve: list[float], optimum: float, within: float = WITHIN) -> int | None:
    """Counted evaluations until the best so far is within `within` of the optimum; None if never within the curve."""
    for k, best in enumerate(curve, start=1):
        if best <= optimum * (1 + within):
            return k
    return None


def checkpoint(size: int, pct: float) -> int:
    """Evaluations that make up `pct` percent of a space of `size` admitted configs (at least 1)."""
    return max(1, math.ceil(size * pct / 100.0))


def median_curve(curves: list[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*curves)]


# --------------------------------------------------------------------------- replay


def parse_strategy(name: str) -> tuple[str, bool]:
    """'nsga2' -> (nsga2, steered); 'nsga2-plain' -> (nsga2, unsteered: Optuna's samplers as they are)."""
    if name.endswith("-plain"):
        return name[: -len("-plain")], False
    return name, True


class _ScratchRun(Run):
    """A run whose study lives in memory: a replay's study is thrown away, and SQLite's per-trial
    round trips made each replayed proposal ~20x slower than the loop itself."""

    def storage(self):
        import optuna

        if not hasattr(self, "_memory"):
            self._memory = optuna.storages.InMemoryStorage()
        return self._memory


def replay(ex: Exhaustive, strategy: str, seed: int, budget: int, root: Path, population: int = 16,
           lookahead: int | None = None, **options) -> dict:
    """One strategy and seed through run_search, answered from the exhaustive records (`options`: more
    SearchOptions fields, e.g. mutation_prob)."""
    sampler, steer = parse_strategy(strategy)
    os.environ["EVOTUNE_RUNS"] = str(root)
    run = _ScratchRun(Run.create(f"{strategy}-s{seed}", {"shape_spec": ex.shape.spec, "family": ex.problem.family}).path)
    options = SearchOptions(trials=budget, sampler=sampler, population=population, seed=seed, steer=steer,
                            compile_workers=H100_COMPILE_WORKERS, lookahead=lookahead, **options)
    started = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Optuna's experimental-feature warnings
        summary = run_search(ex.problem, ex.space, ex.shape, run, _Started(ex), options, compiler=ex.compiler)
    records = run.trials()
    curve = best_so_far(records, budget)
    mismatched = sum(1 for r in records if r.get("counted")
                     and r["result"]["status"] != ex.records[r["digest"]]["result"]["status"])
    return {"strategy": strategy, "seed": seed, "curve": curve, "evaluated": summary["evaluated"],
            "proposals": summary["proposals"],
            "constraint_pruned": sum(1 for r in records if (r["result"].get("message") or "").startswith("constraint")),
            "duplicates": sum(1 for r in records if r.get("duplicate_of") is not None),
            "mismatched": mismatched, "seconds": round(time.time() - started, 1),
            "lookahead": summary["lookahead"], "precompiled": summary["precompiled"]}


def summarize(ex: Exhaustive, runs: list[dict], budget: int) -> dict:
    by_strategy: dict[str, list[dict]] = {}
    for r in runs:
        by_strategy.setdefault(r["strategy"], []).append(r)
    marks = {pct: checkpoint(ex.size, pct) for pct in CHECKPOINTS_PCT if checkpoint(ex.size, pct) <= budget}
    table = {}
    for strategy, rs in by_strategy.items():
        hits = [evals_to_within(r["curve"], ex.optimum) for r in rs]
        # A run that never got within is counted as needing more than the budget (median of "> budget").
        ranked = sorted(h if h is not None else math.inf for h in hits)
        med = statistics.median(ranked)
        table[strategy] = {
            "seeds": len(rs),
            "evals_to_within": hits,
            "median_evals_to_within": None if math.isinf(med) else med,
            "min_evals_to_within": None if math.isinf(ranked[0]) else ranked[0],
            "max_evals_to_within": None if math.isinf(ranked[-1]) else ranked[-1],
            "reached": sum(h is not None for h in hits),
            "at": {pct: {"median": statistics.median(r["curve"][k - 1] for r in rs),
                         "min": min(r["curve"][k - 1] for r in rs), "max": max(r["curve"][k - 1] for r in rs)}
                   for pct, k in marks.items()},
            "proposals": statistics.median(r["proposals"] for r in rs),
            "evaluated": statistics.median(r["evaluated"] for r in rs),
            "constraint_pruned": statistics.median(r["constraint_pruned"] for r in rs),
            "duplicates": statistics.median(r["duplicates"] for r in rs),
            "mismatched": sum(r["mismatched"] for r in rs),
        }
    verdict = {}
    if DEFAULT_STRATEGY in table:
        d = table[DEFAULT_STRATEGY]
        target = checkpoint(ex.size, TARGET_PCT)
        verdict["target_evals"] = target
        verdict["meets_target"] = (d["median_evals_to_within"] is not None and d["median_evals_to_within"] <= target)
        if "random" in table:
            dm = median_curve([r["curve"] for r in by_strategy[DEFAULT_STRATEGY]])
            rm = median_curve([r["curve"] for r in by_strategy["random"]])
            verdict["beats_random_at"] = {pct: dm[k - 1] < rm[k - 1] for pct, k in marks.items()}
            verdict["ties_random_at"] = {pct: dm[k - 1] == rm[k - 1] for pct, k in marks.items()}
            # At equal budget: a median best-so-far no worse at every checkpoint, and better at one at least.
            verdict["beats_random"] = (all(dm[k - 1] <= rm[k - 1] for k in marks.values())
                                       and any(verdict["beats_random_at"].values()))
            # How much of the budget the default spends ahead of random (median curves), for the record.
            verdict["ahead_of_random_share"] = sum(a < b for a, b in zip(dm, rm)) / len(dm)
            verdict["behind_random_share"] = sum(a > b for a, b in zip(dm, rm)) / len(dm)
    return {"table": table, "marks": marks, "verdict": verdict}


# --------------------------------------------------------------------------- outputs


def _pct_over(t: float, optimum: float) -> str:
    return "none" if math.isinf(t) else f"{t:.2f} (+{100 * (t / optimum - 1):.1f}%)"


def _evals(n, size: int) -> str:
    return "not within budget" if n is None else f"{n:g} ({100 * n / size:.1f}%)"


def write_markdown(path: Path, ex: Exhaustive, summary: dict, runs: list[dict], budget: int, command: str,
                   png_name: str | None) -> None:
    t, marks, v = summary["table"], summary["marks"], summary["verdict"]
    seeds = sorted({r["seed"] for r in runs})
    lookaheads = ", ".join(f"{s} {n}" for s, n in dict((r["strategy"], r["lookahead"]) for r in runs).items())
    lines = [
        "# Search efficiency",
        "",
        "<!-- Generated by tools/efficiency_report.py; rerun it rather than editing this file. -->",
        "",
        f"How quickly each search strategy gets close to the best config of a space small enough to measure "
        f"exhaustively. Every strategy is replayed through the real search loop on `{ex.meta.get('space')}` "
        f"(shape {ex.shape.spec}, {ex.size} admitted configs), with seeds {', '.join(map(str, seeds))} and "
        f"a budget of {budget} counted evaluations ({100 * budget / ex.size:.0f}% of the space).",
        "",
        f"- Data: run `{ex.run.run_id}` (`{ex.meta.get('command_line', '?')}`), device "
        f"{(ex.meta.get('device') or {}).get('name', 'unknown')}, git {ex.meta.get('git_sha', '?')}. Its statuses: "
        + ", ".join(f"{k} {n}" for k, n in sorted(ex.statuses.items())) + ".",
        f"- Optimum: {ex.optimum:.3f} us ({_cfg(ex.best['config'])}); within 3%: "
        f"{sum(1 for c in ex.admitted if ex.records[c.digest()]['result']['status'] == R.OK and ex.records[c.digest()]['result']['time_us'] <= ex.optimum * (1 + WITHIN))} configs.",
        f"- Command: `{command}`",
        "- Replay: the evaluator and the compiler answer from the exhaustive run's records, so each strategy is "
        "told exactly what the GPU told the exhaustive run, and nothing is compiled or launched. A live search "
        "would re-measure each config, and its times would scatter around these by the measurement noise "
        "(the p10-p90 spread recorded with each result).",
        f"- Proposals are asked ahead of the GPU as a live search on a 16-CPU machine asks them "
        f"(lookahead: {lookaheads}).",
        "",
        f"## Evaluations to get within {100 * WITHIN:.0f}% of the optimum",
        "",
        "| strategy | median | min | max | runs within budget | evaluated | proposals | constraint-pruned | duplicates |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s, row in t.items():
        lines.append(f"| {s} | {_evals(row['median_evals_to_within'], ex.size)} | {_evals(row['min_evals_to_within'], ex.size)} "
                     f"| {_evals(row['max_evals_to_within'], ex.size)} | {row['reached']}/{row['seeds']} | {row['evaluated']:g} "
                     f"| {row['proposals']:g} "
                     f"| {row['constraint_pruned']:g} | {row['duplicates']:g} |")
    lines += ["", "Evaluated, proposals, constraint-pruned and duplicates are medians over seeds. Only evaluations "
              "count against the budget; a search that stops at the proposal cap (30 x the budget) with fewer "
              "evaluations keeps its last best.", "", "## Best so far (us) after a share of the space", "",
              "| strategy | " + " | ".join(f"{pct}% ({k} evals): median [min, max]" for pct, k in marks.items()) + " |",
              "|---|" + "---|" * len(marks)]
    for s, row in t.items():
        cells = [f"{_pct_over(row['at'][pct]['median'], ex.optimum)} [{row['at'][pct]['min']:.2f}, {row['at'][pct]['max']:.2f}]"
                 for pct in marks]
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if v:
        lines += ["", "## Verdict", ""]
        med = t[DEFAULT_STRATEGY]["median_evals_to_within"]
        lines.append(f"- Target: the default strategy ({DEFAULT_STRATEGY}) within {100 * WITHIN:.0f}% of the optimum in at most "
                     f"{TARGET_PCT}% of the space ({v['target_evals']} evaluations), median over seeds: "
                     f"{'**met**' if v['meets_target'] else '**not met**'} (median {_evals(med, ex.size)}).")
        if "beats_random" in v:
            at = ", ".join(f"{pct}%: {'better' if v['beats_random_at'][pct] else ('tie' if v['ties_random_at'][pct] else 'worse')}"
                           for pct in marks)
            lines.append(f"- Against random sampling at equal budget (median best so far at each checkpoint): "
                         f"{'**beats it**' if v['beats_random'] else '**does not beat it**'} ({at}). Over the whole "
                         f"budget its median curve is below random's for {100 * v['ahead_of_random_share']:.0f}% of "
                         f"the evaluations and above it for {100 * v['behind_random_share']:.0f}%.")
    mism = sum(row["mismatched"] for row in t.values())
    if mism:
        lines += ["", f"Warning: {mism} replayed results differ in status from the record (the static gate changed "
                      "since the exhaustive run?)."]
    if png_name:
        lines += ["", f"![best so far vs share of the space]({png_name})", "",
                  "Median best-so-far per strategy (band: min to max over seeds) against the share of the space "
                  "evaluated; the lines mark the optimum and optimum + 3%."]
    path.write_text("\n".join(lines) + "\n" + _kept_blocks(path))


def _kept_blocks(path: Path) -> str:
    """Sections other tools generate into the same file (tools/kt_compare.py's: one per exhaustive oracle and its
    cross-oracle verdict; tools/heldout_tuner.py's pointer to its page; each between its markers): kept, from the
    first begin marker to the last end marker, so rerunning this report deletes none of them."""
    try:
        old = path.read_text()
    except OSError:
        return ""
    begin = re.search(r"<!-- (?:kt_compare:(?:verdict )?|heldout:)begin\b", old)
    ends = list(re.finditer(r"<!-- (?:kt_compare:(?:verdict )?|heldout:)end\b[^>]*-->", old))
    if not begin or not ends or ends[-1].end() <= begin.start():
        return ""
    return "\n" + old[begin.start():ends[-1].end()] + "\n"


def _cfg(c: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in c.items())


def write_plot(path: Path, ex: Exhaustive, runs: list[dict], budget: int) -> bool:
    """The best-so-far plot; False (and no file) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    x = [100.0 * k / ex.size for k in range(1, budget + 1)]
    by_strategy: dict[str, list[list[float]]] = {}
    for r in runs:
        by_strategy.setdefault(r["strategy"], []).append(r["curve"])
    finite_max = max((v for cs in by_strategy.values() for c in cs for v in c if not math.isinf(v)), default=ex.optimum)
    for strategy, curves in by_strategy.items():
        clip = [[min(v, finite_max) for v in c] for c in curves]
        med = median_curve(clip)
        lo = [min(col) for col in zip(*clip)]
        hi = [max(col) for col in zip(*clip)]
        line, = ax.plot(x, med, label=f"{strategy} (median of {len(curves)})", linewidth=1.8)
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    ax.axhline(ex.optimum, color="black", linewidth=1, label=f"exhaustive optimum {ex.optimum:.2f} us")
    ax.axhline(ex.optimum * (1 + WITHIN), color="black", linewidth=1, linestyle="--", label="optimum + 3%")
    ax.axvline(TARGET_PCT, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel(f"counted evaluations, % of the {ex.size} admitted configs")
    ax.set_ylabel("best so far (us)")
    ax.set_ylim(ex.optimum * 0.97, min(finite_max, ex.optimum * 1.6))
    ax.set_title(f"{ex.problem.family} on {ex.shape.spec}: best so far vs evaluations")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="folder of a run recorded with --sampler exhaustive (or its name under runs/)")
    ap.add_argument("--strategies", default=",".join(DEFAULT_STRATEGIES),
                    help="comma-separated; a '-plain' suffix (nsga2-plain) turns constraint steering off")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--budget-pct", type=float, default=30.0, help="counted evaluations per replay, %% of the space")
    ap.add_argument("--population", type=int, default=16)
    ap.add_argument("--lookahead", type=int, default=None,
                    help="proposals asked ahead (default: what a live search on a 16-CPU machine uses)")
    ap.add_argument("--out-dir", default=str(REPO_ROOT / "docs"))
    ap.add_argument("--md", default=None, help="the report (default OUT_DIR/EFFICIENCY.md; another exhaustive "
                    "oracle's report goes to a file of its own, e.g. OUT_DIR/EFFICIENCY-gpt2-hopper.md)")
    ap.add_argument("--plot", default=None, help="the plot (default OUT_DIR/efficiency.png)")
    ap.add_argument("--json", default=None, help="every curve (default OUT_DIR/data/efficiency.json)")
    args = ap.parse_args(argv)

    path = Path(args.run)
    if not (path / "meta.json").exists() and (runs_dir() / args.run / "meta.json").exists():
        path = runs_dir() / args.run
    try:
        ex = Exhaustive(path)
    except ReplayError as e:
        print(f"efficiency_report: {e}", file=sys.stderr)
        return 2
    budget = min(ex.size, checkpoint(ex.size, args.budget_pct))
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    out = Path(args.out_dir)
    md = Path(args.md) if args.md else out / "EFFICIENCY.md"
    png = Path(args.plot) if args.plot else out / "efficiency.png"
    data_path = Path(args.json) if args.json else out / "data" / "efficiency.json"
    for p in (md, png, data_path):
        p.parent.mkdir(parents=True, exist_ok=True)
    # The replays' own run folders (SQLite studies) are scratch: on tmpfs where there is one.
    scratch = Path(tempfile.mkdtemp(prefix="evotune-efficiency-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    saved_runs = os.environ.get("EVOTUNE_RUNS")
    runs = []
    try:
        for strategy in strategies:
            for seed in range(args.seeds):
                r = replay(ex, strategy, seed, budget, scratch, args.population, args.lookahead)
                hit = evals_to_within(r["curve"], ex.optimum)
                print(f"{strategy:>12} seed {seed}: within 3% after {hit if hit else '-'} evals, best "
                      f"{r['curve'][-1]:.3f} us ({r['proposals']} proposals, {r['seconds']} s)", file=sys.stderr)
                runs.append(r)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if saved_runs is None:
            os.environ.pop("EVOTUNE_RUNS", None)
        else:
            os.environ["EVOTUNE_RUNS"] = saved_runs
    summary = summarize(ex, runs, budget)
    command = "python tools/efficiency_report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    plotted = write_plot(png, ex, runs, budget)
    link = Path(os.path.relpath(png.resolve(), md.resolve().parent)).as_posix()
    write_markdown(md, ex, summary, runs, budget, command, link if plotted else None)
    data = {"run": ex.run.run_id, "space": ex.meta.get("space"), "shape": ex.shape.spec, "size": ex.size,
            "optimum_us": ex.optimum, "budget": budget, "command": command, "summary": summary, "runs": runs}
    data_path.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    print(f"wrote {md}" + (f", {png}" if plotted else " (no plot: pip install matplotlib)") + f", {data_path}",
          file=sys.stderr)
    return 0


def _json_default(o):
    return str(o)


if __name__ == "__main__":
    sys.exit(main())
