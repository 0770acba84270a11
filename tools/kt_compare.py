"""evotune's search strategies against Kernel Tuner's, replayed over one recorded exhaustive run (issue 14).

    python tools/kt_compare.py runs/mission-h100-exhaustive-small \
        --out docs/data/kt_compare.json --md docs/EFFICIENCY.md
    python tools/kt_compare.py runs/gpt2-h100-exhaustive-hopper \
        --out docs/data/kt_compare_gpt2-hopper.json --md docs/EFFICIENCY.md

needs `pip install kernel_tuner` (tested with 1.5.0) and runs on a CPU in ~10-20 minutes (no GPU, nothing compiled).

One section per exhaustive oracle in the --md file, between `<!-- kt_compare:begin RUN_ID ... -->` and
`<!-- kt_compare:end RUN_ID -->`: a run replaces its own section and keeps the others' (an older unnamed section is
taken as the run it says it was answered from, and gets named markers). After the last section comes the verdict
across the oracles (ORACLES and any other section's), read back from the sections' tables: whether evotune's default
needs no more median evaluations to within 3% than every Kernel Tuner strategy on each.

What it does:
  1. Turns the exhaustive run into a Kernel Tuner cache file (--cache-out keeps it): one entry per admitted
     config, keyed by the comma-joined tunable values in the space file's parameter order, with "time" in ms
     (the recorded median), or "CompilationFailedConfig" for a config the static gate pruned (spills: known
     once compiled, never launched), "RuntimeFailedConfig" for one that failed on the GPU (compile errors are
     also "CompilationFailedConfig"). The space's knobs become tune_params and its constraints become string
     restrictions (derived quantities, pinned knobs and the shape's context inlined, constant-folded), checked to
     admit exactly evotune's set.
  2. Runs each Kernel Tuner strategy in simulation mode over that cache, once per budget (5/10/15/30% of the
     admitted configs rounded up, max_fevals; a budget two shares round to runs once) and seed (random.seed,
     numpy.random.seed and tune_kernel(seed=) before each). A run that raises is recorded (it found nothing) and
     named in the table's notes, as are budgets a strategy's opening draws (a population, initial samples) fill.
  3. Replays evotune's strategies with tools/efficiency_report.py's replay() (the real search loop answered from
     the same records) at the same budgets and seeds.

Counting evaluations, both sides: an evaluation is the first measurement of a distinct admitted config. A config
the static gate pruned or that failed counts as a (failed) evaluation: evotune records it as counted, and Kernel
Tuner's simulation runner counts every first visit of a cache entry, error or not, against max_fevals. A config
outside the admitted set is never evaluated on either side and is not counted (evotune: a constraint-pruned
proposal; Kernel Tuner: a restriction violation, InvalidConfig, rejected before the runner). Repeats are not counted.
Best at a budget: best passing time within the first N evaluations of the run given budget N. Evaluations to
within 3% of the exhaustive optimum: read off the largest budget's run (None: not within it).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import importlib.util
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_spec = importlib.util.spec_from_file_location("efficiency_report", ROOT / "tools" / "efficiency_report.py")
E = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(E)

from evotune.records import result as R  # noqa: E402
from evotune.search import loop as L  # noqa: E402

KT_STRATEGIES = ("genetic_algorithm", "bayes_opt", "random_sample", "simulated_annealing", "diff_evo", "pso",
                 "basinhopping", "greedy_ils", "mls")
EVOTUNE_STRATEGIES = ("surrogate", "nsga2", "nsga2-plain", "tpe", "random")
BUDGETS_PCT = (5, 10, 15, 30)
KERNEL_NAME = "attention_fwd"
FAILED_MARKER = {R.PRUNED: "CompilationFailedConfig", R.COMPILE_ERROR: "CompilationFailedConfig"}


# --------------------------------------------------------------------------- the space as Kernel Tuner sees it


def tune_params(space) -> dict:
    """The space's knobs in its file order (the order of the cache keys)."""
    return {p.name: list(p.values) for p in space.params}


def config_key(values) -> str:
    """Kernel Tuner's cache key: str() of each value, comma-joined (True -> 'True')."""
    return ",".join(str(v) for v in values)


class _Inline(ast.NodeTransformer):
    def __init__(self, names: dict):
        self.names = names

    def visit_Name(self, node):
        if node.id in self.names:  # a copy: _Fold changes the trees it folds in place
            return ast.copy_location(copy.deepcopy(self.names[node.id]), node)
        return node


_CALLS = {"max": max, "min": min}
_IDENTITY = {ast.FloorDiv: (None, 1), ast.Mult: (1, 1), ast.Add: (0, 0), ast.Sub: (None, 0)}  # (left, right) units


def _free_names(node) -> set:
    """Names in `node` other than the max/min it calls."""
    calls = {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and not (id(n) in calls and n.id in _CALLS)}


class _Fold(ast.NodeTransformer):
    """Constant folding after inlining, so that what is left reads as a plain restriction over the tunables:
    subexpressions without tunables are evaluated ('swizzle' == 'swizzle' -> True, 4 * (1 - 1) -> 0), x // 1,
    x * 1, x + 0 become x, a conditional with a known test becomes its branch, max(c, x) / min(c, x) become x
    where x's values all lie on that side of c, and an and/or whose value only counts as true/false drops its
    constant operands (or becomes the constant that decides it)."""

    def __init__(self, domains: dict):
        self.domains = domains

    def fold(self, tree: ast.Expression) -> ast.Expression:
        self.truth = {id(tree.body)}
        return ast.fix_missing_locations(self.visit(tree))

    def visit(self, node):
        # Operands whose value only counts as true/false: a condition's test, not's operand, and the operands of
        # an and/or that itself only counts as true/false (the whole constraint does).
        if isinstance(node, ast.IfExp):
            self.truth.add(id(node.test))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            self.truth.add(id(node.operand))
        elif isinstance(node, ast.BoolOp) and id(node) in self.truth:
            self.truth.update(id(v) for v in node.values)
        node = self.generic_visit(node)
        if isinstance(node, ast.expr) and not isinstance(node, (ast.Name, ast.Constant)) and not _free_names(node):
            try:
                value = eval(compile(ast.Expression(ast.fix_missing_locations(node)), "<fold>", "eval"), dict(_CALLS))
            except Exception:  # noqa: BLE001 - left for the check to evaluate (and fail) as written
                value = None
            if isinstance(value, (bool, int, float, str, tuple)):
                return ast.copy_location(ast.Constant(value), node)
        return self._simplify(node)

    def _simplify(self, node):
        const = lambda n: isinstance(n, ast.Constant)  # noqa: E731
        if isinstance(node, ast.BinOp) and type(node.op) in _IDENTITY:
            left_unit, right_unit = _IDENTITY[type(node.op)]
            if const(node.right) and right_unit is not None and node.right.value == right_unit:
                return node.left
            if const(node.left) and left_unit is not None and node.left.value == left_unit:
                return node.right
        if isinstance(node, ast.IfExp) and const(node.test):
            return node.body if node.test.value else node.orelse
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS
                and len(node.args) == 2 and not node.keywords):
            a, b = node.args
            c, x = (a, b) if const(a) else (b, a)
            values = self.domains.get(x.id, ()) if const(c) and isinstance(x, ast.Name) else ()
            numbers = lambda vs: all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs)  # noqa: E731
            if values and numbers(values) and numbers([c.value]):
                if min(values) >= c.value if node.func.id == "max" else max(values) <= c.value:
                    return x
        if isinstance(node, ast.BoolOp) and id(node) in self.truth:
            decisive = isinstance(node.op, ast.Or)   # a true constant decides an or, a false one an and
            if any(const(v) and bool(v.value) == decisive for v in node.values):
                return ast.copy_location(ast.Constant(decisive), node)
            rest = [v for v in node.values if not const(v)]
            if not rest:
                return ast.copy_location(ast.Constant(not decisive), node)
            if len(rest) == 1:
                self.truth.add(id(rest[0]))
                return rest[0]
            node.values = rest
        return node


_PARSED_RIGHT: dict = {}


def _parsed_right(src: str, used: list, tp: dict) -> bool:
    """Whether Kernel Tuner (python-constraint2's string parser) reads the restriction `src` as Python does: the
    configs its Searchspace admits over the knobs `src` uses equal those for which `src` evaluates true. (The
    parser misreads some forms: `block_n // 1 % 16 == 0` became an ExactSumConstraint and failed.)"""
    import itertools

    from kernel_tuner.searchspace import Searchspace

    sub = {k: tp[k] for k in used}
    key = (src, repr(sub))
    if key not in _PARSED_RIGHT:
        want = {v for v in itertools.product(*sub.values()) if eval(src, dict(_CALLS), dict(zip(sub, v)))}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = set(map(tuple, Searchspace(sub, [src], 1 << 30).list))
        except Exception:  # noqa: BLE001 - whatever the parser made of it, it is not this restriction
            got = None
        _PARSED_RIGHT[key] = got == want
    return _PARSED_RIGHT[key]


def restrictions(space, context: dict) -> list:
    """The space's constraints as Kernel Tuner restrictions over the tunables only: derived quantities inlined
    (in file order), the shape's context (head_dim, smem_limit, ...) and knobs with a single value (a space's
    pinned knobs, e.g. attention-hopper's mma = wgmma) as constants, then constant-folded (_Fold). A constraint
    that Kernel Tuner's string parser (python-constraint2) reads right (checked: _parsed_right) stays a string;
    one with a conditional expression, a call (max/min), a string literal (which it rejects or misreads) or that
    it misreads becomes a python-constraint FunctionConstraint over all tunables in order (Kernel Tuner's other
    native form; it calls it positionally). A constraint that folds to a constant is decided here (one that
    excludes every config raises)."""
    tp = tune_params(space)
    fixed = {k: v[0] for k, v in tp.items() if len(v) == 1}
    names = {k: ast.Constant(v) for k, v in {**context, **fixed}.items()}
    for name, expr, *_ in space.derived:
        names[name] = _Inline(dict(names)).visit(ast.parse(expr, mode="eval").body)
    tunables = space.param_names()
    out = []
    for c in space.constraints:
        tree = _Fold(tp).fold(_Inline(names).visit(ast.parse(c.expr, mode="eval")))
        used = [t for t in tunables if t in _free_names(tree)]
        src = ast.unparse(tree.body)
        if not used:
            if not eval(compile(tree, "<constraint>", "eval"), dict(_CALLS)):
                raise ValueError(f"constraint {c.expr!r} excludes every config on this shape")
            continue
        if (any(isinstance(n, (ast.IfExp, ast.Call)) or (isinstance(n, ast.Constant) and isinstance(n.value, str))
                for n in ast.walk(tree)) or not _parsed_right(src, used, tp)):
            from constraint import FunctionConstraint

            func = eval(f"lambda {', '.join(tunables)}: {src}", dict(_CALLS))
            fc = FunctionConstraint(func)
            fc.source = src
            out.append(fc)
        else:
            out.append(src)
    return out


def describe_restrictions(items: list) -> list[str]:
    return [r if isinstance(r, str) else f"FunctionConstraint: {r.source}" for r in items]


def kt_searchspace(space, context: dict):
    """Kernel Tuner's own Searchspace built from tune_params and restrictions (for checking agreement)."""
    from kernel_tuner.searchspace import Searchspace

    return Searchspace(tune_params(space), restrictions(space, context), context.get("max_threads", 1024))


def build_cache(ex) -> dict:
    """Kernel Tuner cache-file contents for the exhaustive run `ex` (an efficiency_report.Exhaustive)."""
    tp = tune_params(ex.space)
    cache = {}
    for c in ex.admitted:
        d = c.as_dict()
        values = [d[k] for k in tp]
        res = ex.records[c.digest()]["result"]
        entry = dict(zip(tp, values))
        evals = (res.get("extra") or {}).get("eval_seconds") or {}
        entry["compile_time"] = 1000.0 * (res.get("compile_seconds") or 0.0)
        entry["verification_time"] = 1000.0 * (evals.get("verify") or 0.0)
        entry["benchmark_time"] = 1000.0 * (evals.get("time") or 0.0)
        if res["status"] == R.OK:
            entry["time"] = res["time_us"] / 1000.0          # Kernel Tuner's unit is ms
            timing = res.get("timing") or {}
            entry["times"] = [timing.get("p10_us", res["time_us"]) / 1000.0, res["time_us"] / 1000.0,
                              timing.get("p90_us", res["time_us"]) / 1000.0]
        else:
            entry["time"] = FAILED_MARKER.get(res["status"], "RuntimeFailedConfig")
        entry["evotune_status"] = res["status"]
        cache[config_key(values)] = entry
    return {"device_name": (ex.meta.get("device") or {}).get("name", "unknown"), "kernel_name": KERNEL_NAME,
            "problem_size": list(_problem_size(ex)), "tune_params_keys": list(tp), "tune_params": tp,
            "objective": "time", "cache": cache}


def _problem_size(ex) -> tuple:
    s = ex.meta["shape"]
    return (s["batch"], s["heads"], s["seq_q"], s["head_dim"])


def write_cache(ex, path: Path) -> Path:
    path.write_text(json.dumps(build_cache(ex), indent=1) + "\n")
    return path


# --------------------------------------------------------------------------- Kernel Tuner runs


def kt_run(ex, cache_file: Path, strategy: str, seed: int, budget: int, times_us: dict) -> dict:
    """One Kernel Tuner strategy in simulation mode over the cache; the best-so-far curve over its evaluations."""
    import numpy as np
    from kernel_tuner import tune_kernel

    random.seed(seed)
    np.random.seed(seed)
    tp = tune_params(ex.space)
    started = time.time()
    error = None
    try:
        with warnings.catch_warnings(), _seeded_lhs():
            warnings.simplefilter("ignore")
            results, _env = tune_kernel(KERNEL_NAME, "__global__ void attention_fwd() {}", list(_problem_size(ex)), [],
                                        tp, restrictions=restrictions(ex.space, ex.problem.context(ex.shape)),
                                        lang="CUDA", strategy=strategy, strategy_options={"max_fevals": budget},
                                        cache=str(cache_file), simulation_mode=True, quiet=True, verbose=False,
                                        seed=seed)
    except Exception as e:  # noqa: BLE001 - a strategy that cannot run at this budget: recorded, not fatal
        results, error = [], f"{type(e).__name__}: {e}".splitlines()[0][:200]
    seen, curve, best, outside = set(), [], math.inf, 0
    for r in results:
        key = config_key(r[k] for k in tp)
        if key in seen:
            continue
        seen.add(key)
        if key not in times_us:
            outside += 1   # cannot happen: simulation mode raises on a legal config missing from the cache
            continue
        t = times_us[key]
        if t is not None and t < best:
            best = t
        curve.append(best)
    evaluated = len(curve)
    curve = curve[:budget] + [curve[-1] if curve else math.inf] * max(0, budget - len(curve))
    out = {"tool": "kernel_tuner", "strategy": strategy, "seed": seed, "budget": budget, "curve": curve,
           "evaluated": evaluated, "outside": outside, "seconds": round(time.time() - started, 2)}
    if error:
        out["error"] = error
    return out


@contextlib.contextmanager
def _seeded_lhs():
    """Kernel Tuner's Searchspace.get_LHS_sample (diff_evo's and bayes_opt's initial samples, by default) builds
    scipy's LatinHypercube without a seed, i.e. from OS entropy: a run could not be repeated. Within this block
    an unseeded LatinHypercube takes a generator drawn from numpy's global state, which kt_run has seeded."""
    import numpy as np
    import scipy.stats.qmc as qmc

    original = qmc.LatinHypercube

    class SeededLatinHypercube(original):
        def __init__(self, *args, **kwargs):
            if kwargs.get("rng") is None and kwargs.get("seed") is None:
                kwargs.pop("seed", None)
                kwargs["rng"] = np.random.default_rng(np.random.randint(2**31 - 1))
            super().__init__(*args, **kwargs)

    qmc.LatinHypercube = SeededLatinHypercube
    try:
        yield
    finally:
        qmc.LatinHypercube = original


# --------------------------------------------------------------------------- evotune runs


def evotune_run(ex, strategy: str, seed: int, budget: int, scratch: Path, lookahead: int | None = None) -> dict:
    """One evotune strategy through efficiency_report's replay; `lookahead` None: what a live search on the
    H100 machine (16 CPUs) asks ahead of the GPU."""
    r = E.replay(ex, strategy, seed, budget, scratch, lookahead=lookahead)
    return {"tool": "evotune", "strategy": strategy, "seed": seed, "budget": budget, "curve": r["curve"],
            "evaluated": r["evaluated"], "proposals": r["proposals"], "mismatched": r["mismatched"],
            "seconds": r["seconds"], "lookahead": r["lookahead"]}


# --------------------------------------------------------------------------- summary and tables


def summarize(ex, runs: list[dict], budgets: dict) -> dict:
    """Per tool/strategy: median/min/max best at each budget (from that budget's runs) and evaluations to within
    3% of the optimum (from the largest budget's runs); runs that raised are listed under errors."""
    top = max(budgets.values())
    rows = {}
    for r in runs:
        rows.setdefault((r["tool"], r["strategy"]), []).append(r)
    out = []
    for (tool, strategy), rs in rows.items():
        at = {}
        for pct, n in budgets.items():
            bests = [r["curve"][n - 1] for r in rs if r["budget"] == n]
            if bests:
                at[pct] = {"evals": n, "median": statistics.median(bests), "min": min(bests), "max": max(bests),
                           "seeds": len(bests)}
        tops = [r for r in rs if r["budget"] == top]
        hits = [E.evals_to_within(r["curve"], ex.optimum, E.WITHIN) for r in tops]
        ranked = sorted(h if h is not None else math.inf for h in hits)
        med = statistics.median(ranked) if ranked else math.inf
        out.append({"tool": tool, "strategy": strategy, "at": at, "evals_to_within": hits,
                    "median_evals_to_within": None if math.isinf(med) else med,
                    "reached": sum(h is not None for h in hits), "seeds": len(tops),
                    "evaluated_at_top": statistics.median(r["evaluated"] for r in tops) if tops else None,
                    "seconds_total": round(sum(r["seconds"] for r in rs), 1),
                    "seconds_per_run_top": round(statistics.median(r["seconds"] for r in tops), 2) if tops else None,
                    "errors": [{"budget": r["budget"], "seed": r["seed"], "error": r["error"]}
                               for r in rs if r.get("error")]})
    return {"rows": out, "budgets": budgets, "top": top}


def first_population(tool: str, strategy: str, size: int, true_tunables: int, population: int = 16):
    """(evaluations, what they are): the opening draws a strategy at its default options makes before its search
    acts on any result, by the rules of Kernel Tuner 1.5 (its _options defaults, read from the installed
    version) and of evotune's samplers; None for strategies without one (random_sample, greedy_ils, mls, ...,
    evotune random). A budget at or below it measures that sampling only."""
    if tool == "evotune":
        import inspect

        sampler, _ = E.parse_strategy(strategy)
        if sampler == "nsga2":
            return population, "first population, random admissible configs"
        if sampler == "surrogate":
            from evotune.search.strategies import SurrogateSampler

            first = inspect.signature(SurrogateSampler).parameters["min_results"].default
            return first, "random admissible configs until that many have passed"
        if sampler == "tpe":
            import optuna

            startup = inspect.signature(optuna.samplers.TPESampler).parameters["n_startup_trials"].default
            return startup, "random startup trials"
        return None
    try:
        opts = importlib.import_module(f"kernel_tuner.strategies.{strategy}")._options
    except (ImportError, AttributeError):
        return None
    default = lambda k: opts[k][1]  # noqa: E731
    if strategy == "genetic_algorithm":  # its tune() shrinks a population larger than half the space
        pop, gens = default("popsize"), default("maxiter")
        if pop < 2 or pop > size // 2:
            pop = min(max(round(size / gens * 3), 2), pop)
        return pop, "first generation, random"
    if strategy == "pso":
        return min(round(size / 2), default("popsize")), "first swarm, random"
    if strategy == "diff_evo":
        pop = default("popsize") * (min(true_tunables, size) if default("popsize_times_dimensions") else 1)
        return pop, f"initial population, a Latin hypercube sample ({default('popsize')} x {true_tunables} knobs)"
    if strategy == "bayes_opt":
        return default("popsize"), "initial samples, Latin hypercube"
    return None


def table_notes(ex, summary: dict, meta: dict) -> list[str]:
    """Computed notes on what the budgets mean on this space: their rounding, the strategies whose opening draws
    fill a budget, evotune's lookahead, and runs that raised."""
    budgets, rows = summary["budgets"], summary["rows"]
    notes = ["Budgets: each share of the " f"{ex.size} admitted configs rounded up to whole evaluations ("
             + ", ".join(f"{pct}% = {n}" for pct, n in budgets.items()) + ")."]
    sampling = []
    for r in rows:
        fp = (meta.get("first_population") or {}).get(f"{r['tool']} {r['strategy']}")
        if not fp:
            continue
        n, what = fp
        under = [pct for pct, b in budgets.items() if b <= n]
        if under:
            sampling.append(f"{r['tool']} {r['strategy']} ({n}: {what}) at " + ", ".join(f"{p}%" for p in under))
    if sampling:
        notes.append("Opening draws at least as large as the budget: the column then measures the strategy's "
                     "sampling, not its search (default options, sizes as the strategy computes them on this "
                     "space): " + "; ".join(sampling) + ".")
    de = (meta.get("first_population") or {}).get("kernel_tuner diff_evo")
    if de and meta.get("kt_order_first_within") and any(b <= de[0] for b in budgets.values()):
        notes.append("Kernel Tuner's diff_evo evaluates its start position, then its Latin hypercube sample in Kernel "
                     "Tuner's searchspace order (Searchspace.get_LHS_sample_indices deduplicates the sample through a "
                     f"set of indices): with its population ({de[0]}) at least the budget it walks the space close to "
                     "that order, which lists the configs the constraint solver's way; the first config within 3% of "
                     f"the optimum is #{meta['kt_order_first_within']} of {ex.size} in it.")
    ahead = meta.get("lookahead") or {}
    if ahead:
        blind = [f"{s} ({la} ahead) at " + ", ".join(f"{p}%" for p, b in budgets.items() if b <= la + 1)
                 for s, la in ahead.items() if any(b <= la + 1 for b in budgets.values())]
        notes.append("evotune asks proposals ahead of the GPU as a live search does ("
                     + ", ".join(f"{s} {la}" for s, la in ahead.items()) + "; never more than the evaluations left), "
                     "so the first lookahead + 1 proposals of a run are asked before any result is back (a live search "
                     f"compiles the whole admitted space at the start, and asks {L.PRECOMPILED_LOOKAHEAD} ahead, where "
                     f"that takes at most {L.PRECOMPILE_BUDGET_S:g} s on its compile workers at {L.COMPILE_SECONDS:g} s "
                     "a config: evotune.search.loop.PRECOMPILE_BUDGET_S)"
                     + (": every proposal of " + "; ".join(blind) if blind else "") + ".")
    for r in rows:
        if r["errors"]:
            first = r["errors"][0]
            notes.append(f"{r['tool']} {r['strategy']} raised on {len(r['errors'])} run(s) (first: budget "
                         f"{first['budget']}, seed {first['seed']}: `{first['error']}`); such a run counts as "
                         f"finding nothing.")
    return notes


def _fmt_best(cell: dict, opt: float) -> str:
    if math.isinf(cell["median"]):
        return "none passed"
    return f"{cell['median']:.2f} (+{100 * (cell['median'] / opt - 1):.1f}%)"


def _fmt_evals(n, size: int) -> str:
    return "not within" if n is None else f"{n:g} ({100 * n / size:.1f}%)"


def mark_begin(run_id: str) -> str:
    return f"<!-- kt_compare:begin {run_id} (generated by tools/kt_compare.py; rerun it rather than editing) -->"


def mark_end(run_id: str) -> str:
    return f"<!-- kt_compare:end {run_id} -->"


def markdown(ex, summary: dict, meta: dict) -> str:
    budgets, rows, opt = summary["budgets"], summary["rows"], ex.optimum
    best_at = {pct: min(r["at"][pct]["median"] for r in rows if pct in r["at"]) for pct in budgets}
    fewest = min((r["median_evals_to_within"] for r in rows if r["median_evals_to_within"] is not None), default=None)
    seeds = meta["seeds"]
    top_pct = summary_top_pct(budgets)
    lines = [
        mark_begin(ex.run.run_id),
        f"## evotune against Kernel Tuner on `{ex.meta.get('space')}`, shape {ex.shape.spec} (replay over "
        f"`{ex.run.run_id}`)",
        "",
        f"Both tools search the same {ex.size} admitted configs of `{ex.meta.get('space')}` on shape {ex.shape.spec}, "
        f"answered from run `{ex.run.run_id}` ({(ex.meta.get('device') or {}).get('name', '?')}): "
        f"optimum {opt:.3f} us, {sum(1 for v in meta['times_us'].values() if v is not None and v <= opt * (1 + E.WITHIN))} "
        f"configs within 3%.",
        "",
        f"- Date: {meta['date']}. Command: `{meta['command']}` ({meta['wall_seconds']:.0f} s on a "
        f"{os.cpu_count()}-CPU machine, no GPU).",
        f"- Kernel Tuner {meta['kernel_tuner']} in simulation mode over a cache file made from the run (tune_params = "
        f"the space's knobs, restrictions = its constraints with derived values, pinned knobs and the shape inlined; "
        f"Kernel Tuner's searchspace holds exactly evotune's {ex.size} admitted configs). Strategies at their default "
        f"options, `max_fevals` = the budget; evotune's through `tools/efficiency_report.py`'s replay (the real search "
        f"loop, {meta.get('lookahead_source', '16-CPU lookahead')}).",
        f"- Seeds {seeds[0]}..{seeds[-1]} ({len(seeds)}) on both sides; Kernel Tuner's: `random.seed`, "
        f"`numpy.random.seed` and `tune_kernel(seed=)` before each run, and scipy's LatinHypercube (which Kernel "
        f"Tuner builds unseeded for diff_evo's and bayes_opt's initial samples) gets a generator drawn from the "
        f"seeded numpy state. Each budget is its own run on both sides "
        f"(Kernel Tuner's strategies adapt to max_fevals).",
        "- Counting: an evaluation is the first measurement of a distinct admitted config. The configs the static "
        f"gate pruned (spills; {meta['statuses'].get(R.PRUNED, 0)} here) count as failed evaluations on both sides "
        "(evotune records them counted; in the cache they are `CompilationFailedConfig`, which Kernel Tuner counts "
        "against max_fevals on first visit). Configs outside the admitted set (constraint-pruned proposals; "
        "restriction violations) and repeats count on neither side.",
        f"- Best at a budget: median over seeds of the best time within that many evaluations (us, and % over the "
        f"optimum); bold: the best median at that budget. Evaluations to within 3%: median over the {summary['top']}-"
        f"evaluation runs, a seed that never got there counting as more than the budget; `reached` = seeds that got "
        f"there. Evals used: median evaluations a {summary['top']}-evaluation run made (fewer: the strategy "
        f"stopped on its own and keeps its last best). s/run: median wall seconds of one {summary['top']}-evaluation "
        f"run.",
    ] + [f"- {n}" for n in meta.get("notes", [])] + [
        "",
        "| tool | strategy | " + " | ".join(f"best at {pct}% ({n} evals)" for pct, n in budgets.items())
        + " | evals to within 3% | reached | evals used | s/run |",
        "|---|---|" + "---|" * len(budgets) + "---|---|---|---|",
    ]
    order = sorted(rows, key=lambda r: (r["median_evals_to_within"] is None, r["median_evals_to_within"] or 0,
                                        r["at"].get(top_pct, {"median": math.inf})["median"]))
    for r in order:
        cells = []
        for pct in budgets:
            c = r["at"].get(pct)
            s = "-" if c is None else _fmt_best(c, opt)
            cells.append(f"**{s}**" if c is not None and c["median"] == best_at[pct] else s)
        ev = _fmt_evals(r["median_evals_to_within"], ex.size)
        if fewest is not None and r["median_evals_to_within"] == fewest:
            ev = f"**{ev}**"
        used = "-" if r["evaluated_at_top"] is None else f"{r['evaluated_at_top']:g}"
        lines.append(f"| {r['tool']} | {r['strategy']} | " + " | ".join(cells)
                     + f" | {ev} | {r['reached']}/{r['seeds']} | {used} | {r['seconds_per_run_top']} |")
    lines += ["", "Verdict (computed from the table):", ""] + [f"- {v}" for v in verdict(ex, summary)]
    lines += ["", mark_end(ex.run.run_id)]
    return "\n".join(lines) + "\n"


def summary_top_pct(budgets: dict):
    return max(budgets, key=lambda p: budgets[p])


def verdict(ex, summary: dict) -> list[str]:
    rows, budgets = summary["rows"], summary["budgets"]
    name = lambda r: f"{r['tool']} {r['strategy']}"  # noqa: E731
    out = []
    default = next((r for r in rows if r["tool"] == "evotune" and r["strategy"] == E.DEFAULT_STRATEGY), None)
    for pct, n in budgets.items():
        best = min(r["at"][pct]["median"] for r in rows if pct in r["at"])
        winners = [name(r) for r in rows if pct in r["at"] and r["at"][pct]["median"] == best]
        line = f"{pct}% ({n} evals): best median {best:.3f} us by {', '.join(winners)}"
        if default and pct in default["at"]:
            d = default["at"][pct]["median"]
            beat = [name(r) for r in rows if r["tool"] == "kernel_tuner" and pct in r["at"] and r["at"][pct]["median"] < d]
            line += (f"; Kernel Tuner strategies with a lower median than evotune {E.DEFAULT_STRATEGY} ({d:.3f} us): "
                     + (", ".join(beat) if beat else "none"))
        out.append(line + ".")
    fin = [r for r in rows if r["median_evals_to_within"] is not None]
    if fin:
        m = min(r["median_evals_to_within"] for r in fin)
        out.append(f"Fewest median evaluations to within 3%: {m:g} by "
                   + ", ".join(name(r) for r in fin if r["median_evals_to_within"] == m) + ".")
    if default:
        dm = default["median_evals_to_within"]
        better = [name(r) for r in rows if r["tool"] == "kernel_tuner" and r["median_evals_to_within"] is not None
                  and (dm is None or r["median_evals_to_within"] < dm)]
        out.append(f"Kernel Tuner strategies needing fewer median evaluations to within 3% than evotune "
                   f"{E.DEFAULT_STRATEGY} ({_fmt_evals(dm, ex.size)}): " + (", ".join(better) if better else "none") + ".")
    return out


# --------------------------------------------------------------------------- the markdown file: sections per oracle

# The exhaustive oracles: the done-criterion asks for evotune's default to match every Kernel Tuner strategy
# on each of them. An unnamed (pre-oracle) section that names no run is the first's.
ORACLES = ("mission-h100-exhaustive-small", "gpt2-h100-exhaustive-hopper")
LEGACY_RUN = ORACLES[0]
SECTION_RE = re.compile(r"<!-- kt_compare:begin(?: (?P<run>[^\s()]+))? \(generated by tools/kt_compare\.py[^\n]*?-->"
                        r"\n?(?P<body>.*?)<!-- kt_compare:end(?: \S+)? -->", re.S)
VERDICT_BEGIN = ("<!-- kt_compare:verdict begin (generated by tools/kt_compare.py from the kt_compare sections; "
                 "rerun it rather than editing) -->")
VERDICT_END = "<!-- kt_compare:verdict end -->"
VERDICT_RE = re.compile(r"\n*<!-- kt_compare:verdict begin.*?<!-- kt_compare:verdict end -->", re.S)


def _section_run(m) -> str:
    """The run a section is for: its begin marker's name; for an unnamed (older) section, the run its text says
    it was answered from, else LEGACY_RUN."""
    if m.group("run"):
        return m.group("run")
    named = re.search(r"answered from run `([^`]+)`", m.group("body"))
    return named.group(1) if named else LEGACY_RUN


def oracle_table(body: str) -> dict:
    """What a section says, read back from its text: space, shape, size and each row's median evaluations to
    within 3% (None: not within), {(tool, strategy): value}."""
    head = re.search(r"the same (\d+) admitted configs of `([^`]+)` on shape (\S+), answered", body)
    rows, col = {}, None
    for line in body.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["tool", "strategy"]:
            col = cells.index("evals to within 3%") if "evals to within 3%" in cells else None
        elif col is not None and len(cells) > col and not set(line.strip()) <= set("|-: "):
            ev = cells[col].strip("*").strip()
            rows[(cells[0], cells[1])] = None if ev.startswith("not within") else float(ev.split()[0])
    return {"size": int(head.group(1)) if head else None, "space": head.group(2) if head else "?",
            "shape": head.group(3) if head else "?", "rows": rows}


def oracle_verdict(table: dict) -> tuple[bool | None, str, str]:
    """(met, evotune's cell, Kernel Tuner's best cell): whether evotune's default needs no more median evaluations
    to within 3% than every Kernel Tuner strategy (a strategy not within counting as more than any number; the
    default itself not within: not met); None when the section has no row for one side."""
    rows, size = table["rows"], table["size"] or 1
    dm = rows.get(("evotune", E.DEFAULT_STRATEGY), "missing")
    kt = {s: v for (tool, s), v in rows.items() if tool == "kernel_tuner"}
    if dm == "missing" or not kt:
        return None, "-" if dm == "missing" else _fmt_evals(dm, size), "-"
    inf = lambda v: math.inf if v is None else v  # noqa: E731
    least = min(inf(v) for v in kt.values())
    best = ("none within" if math.isinf(least) else
            f"{_fmt_evals(least, size)}: " + ", ".join(s for s, v in kt.items() if inf(v) == least))
    return dm is not None and all(dm <= inf(v) for v in kt.values()), _fmt_evals(dm, size), best


def cross_verdict(text: str) -> str:
    """The verdict over every oracle whose section is in `text` and the issue's ORACLES, computed from the tables."""
    found = {}
    for m in SECTION_RE.finditer(text):
        found[_section_run(m)] = oracle_table(m.group("body"))
    runs = list(found) + [r for r in ORACLES if r not in found]
    lines = [VERDICT_BEGIN, "## evotune against Kernel Tuner across the oracles", "",
             f"Done-criterion: evotune's default ({E.DEFAULT_STRATEGY}) reaches the optimum's 3% in no more "
             "evaluations (median over seeds) than any Kernel Tuner strategy, on every exhaustive oracle. Computed "
             "from the tables of the sections above (a strategy not within 3% counts as needing more than its "
             "budget).", "",
             f"| oracle (run) | space, shape | configs | evotune {E.DEFAULT_STRATEGY} | fewest among Kernel Tuner's "
             f"| {E.DEFAULT_STRATEGY} <= every Kernel Tuner strategy |", "|---|---|---|---|---|---|"]
    met, missing, failed = [], [], []
    for run in runs:
        t = found.get(run)
        if t is None:
            missing.append(run)
            lines.append(f"| `{run}` | - | - | - | - | no section yet (run tools/kt_compare.py on it) |")
            continue
        ok, mine, best = oracle_verdict(t)
        (met if ok else failed).append(run)
        lines.append(f"| `{run}` | `{t['space']}`, {t['shape']} | {t['size']} | {mine} | {best} | "
                     + ("yes" if ok else "cannot tell (a side has no row)" if ok is None else "**no**") + " |")
    if failed:
        state = "**not met** (" + ", ".join(f"`{r}`" for r in failed) + ")"
    elif missing:
        state = "**not decided yet** (no section for " + ", ".join(f"`{r}`" for r in missing) + ")"
    else:
        state = "**met**"
    lines += ["", f"Verdict: {state}; met on {len(met)} of {len(runs)} oracles.", "", VERDICT_END]
    return "\n".join(lines) + "\n"


def write_md(path: Path, text: str, run_id: str | None = None) -> None:
    """Write one oracle's section (`text`, from markdown()) into `path`: it replaces the section of the same run
    (an unnamed older section counts as the run _section_run says), goes after the last kt_compare section when
    there is none (at the end of the file when there is no section at all); every other section is kept, an
    unnamed one under named markers; the cross-oracle verdict is rewritten after the last section."""
    if run_id is None:
        run_id = _section_run(SECTION_RE.search(text))
    old = VERDICT_RE.sub("", path.read_text() if path.exists() else "")
    out, pos, found = [], 0, False
    for m in SECTION_RE.finditer(old):
        rid = _section_run(m)
        out.append(old[pos:m.start()])
        found = found or rid == run_id
        out.append(text.rstrip("\n") if rid == run_id else f"{mark_begin(rid)}\n{m.group('body')}{mark_end(rid)}")
        pos = m.end()
    if not found:
        if out:
            out.append("\n\n" + text.rstrip("\n"))
        else:
            out.append((old.rstrip("\n") + "\n\n" if old.strip() else "") + text.rstrip("\n"))
            pos = len(old)
    head, tail = "".join(out), old[pos:]
    path.write_text(head + "\n\n" + cross_verdict(head).rstrip("\n") + (tail if tail.strip() else "\n"))


def short_table(ex, summary: dict) -> str:
    budgets = summary["budgets"]
    head = f"{'tool':<13}{'strategy':<20}" + "".join(f"{str(p) + '%':>9}" for p in budgets) + f"{'to 3%':>9}{'reached':>9}{'s/run':>8}"
    out = [head]
    for r in sorted(summary["rows"], key=lambda r: (r["tool"], r["strategy"])):
        cells = "".join(f"{r['at'][p]['median']:>9.3f}" if p in r["at"] else f"{'-':>9}" for p in budgets)
        ev = "-" if r["median_evals_to_within"] is None else f"{r['median_evals_to_within']:g}"
        out.append(f"{r['tool']:<13}{r['strategy']:<20}{cells}{ev:>9}{str(r['reached']) + '/' + str(r['seeds']):>9}"
                   f"{r['seconds_per_run_top']:>8}")
    out.append(f"(median best us at each budget; optimum {ex.optimum:.3f} us; to 3%: median evaluations)")
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def _same_admitted_set(ex, kt_space) -> str | None:
    """None when Kernel Tuner's searchspace holds exactly evotune's admitted configs, else why not."""
    tp = tune_params(ex.space)
    kt_keys = {config_key(c) for c in kt_space.list}
    ev_keys = {config_key(c.as_dict()[k] for k in tp) for c in ex.admitted}
    if kt_keys == ev_keys:
        return None
    return (f"Kernel Tuner's restrictions admit {len(kt_keys)} configs, evotune's space {len(ev_keys)} "
            f"({len(kt_keys - ev_keys)} only in Kernel Tuner's, {len(ev_keys - kt_keys)} only in evotune's)")


def _run_all(ex, cache_file: Path, kt_strategies, ev_strategies, seeds, budgets: dict, times_us: dict,
             scratch: Path, lookahead: int | None) -> list[dict]:
    """Every strategy, distinct budget and seed, Kernel Tuner's first (a budget two shares round to runs once)."""
    runs = []
    sizes = sorted(set(budgets.values()))
    for tool, strategies in (("kernel_tuner", kt_strategies), ("evotune", ev_strategies)):
        for strategy in strategies:
            for n in sizes:
                for seed in seeds:
                    r = (kt_run(ex, cache_file, strategy, seed, n, times_us) if tool == "kernel_tuner" else
                         evotune_run(ex, strategy, seed, n, scratch / f"runs-{n}", lookahead))
                    runs.append(r)
                    print(f"{tool:<12} {strategy:>20} budget {n:>3} seed {seed}: best {r['curve'][-1]:.3f} us, "
                          f"{r['evaluated']} evals, {r['seconds']} s" + (f" ({r['error']})" if r.get("error") else ""),
                          file=sys.stderr, flush=True)
    return runs


def _opening_and_lookahead(ex, kt_space, kt_strategies, ev_strategies, runs, lookahead) -> dict:
    """What table_notes needs to know of the strategies: their opening draws on this space, where the first config
    within 3% of the optimum lies in Kernel Tuner's searchspace order (1-based), evotune's lookahead."""
    true_tunables = len(kt_space.get_true_tunable_params())
    tp = tune_params(ex.space)
    times = {config_key(c.as_dict()[k] for k in tp): ex.records[c.digest()]["result"] for c in ex.admitted}
    near = [i for i, c in enumerate(kt_space.list, start=1) if times[config_key(c)]["status"] == R.OK
            and times[config_key(c)]["time_us"] <= ex.optimum * (1 + E.WITHIN)]
    return {"first_population": {f"{tool} {s}": first_population(tool, s, ex.size, true_tunables)
                                 for tool, ss in (("kernel_tuner", kt_strategies), ("evotune", ev_strategies))
                                 for s in ss},
            "kt_order_first_within": near[0] if near else None,
            "lookahead": {r["strategy"]: r["lookahead"] for r in runs if r["tool"] == "evotune"},
            "lookahead_source": "16-CPU lookahead" if lookahead is None else f"lookahead {lookahead}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", nargs="?", default="runs/mission-h100-exhaustive-small",
                    help="folder of a run recorded with --sampler exhaustive (or its name under runs/)")
    ap.add_argument("--kt-strategies", default=",".join(KT_STRATEGIES))
    ap.add_argument("--evotune-strategies", default=",".join(EVOTUNE_STRATEGIES), help="'' for none")
    ap.add_argument("--seeds", type=int, default=30,
                    help="seeds 0..N-1 on both sides (30: at 10, where 3 of 126 configs are within 3%%, the median "
                    "evaluations to get there moved by up to 5 between two random streams of one strategy)")
    ap.add_argument("--budgets-pct", default=",".join(map(str, BUDGETS_PCT)))
    ap.add_argument("--lookahead", type=int, default=None, help="proposals evotune asks ahead (default: what a live "
                    "search on a 16-CPU machine asks: surrogate 16, or 2 where it compiles the whole space at the start; nsga2 16; "
                    "tpe and random 32)")
    ap.add_argument("--cache-out", default=None, help="keep the Kernel Tuner cache file here (default: a temp dir)")
    ap.add_argument("--out", default=None, help="JSON with every run's curve and the summary")
    ap.add_argument("--md", default=None, help="markdown file to write the run's section into (replaces the run's "
                    "section, else adds one after the other runs'; keeps the others and rewrites the cross-oracle "
                    "verdict)")
    args = ap.parse_args(argv)

    try:
        import kernel_tuner
        from importlib.metadata import version
        kt_version = version("kernel_tuner")
    except ImportError:
        print("kt_compare: needs Kernel Tuner: pip install kernel_tuner", file=sys.stderr)
        return 2
    del kernel_tuner
    path = Path(args.run)
    if not (path / "meta.json").exists() and (ROOT / "runs" / args.run / "meta.json").exists():
        path = ROOT / "runs" / args.run
    try:
        ex = E.Exhaustive(path)
    except E.ReplayError as e:
        print(f"kt_compare: {e}", file=sys.stderr)
        return 2
    context = dict(ex.problem.context(ex.shape))
    budgets = {float(p) if "." in p else int(p): min(ex.size, E.checkpoint(ex.size, float(p)))
               for p in args.budgets_pct.split(",") if p.strip()}
    kt_strategies = [s.strip() for s in args.kt_strategies.split(",") if s.strip()]
    ev_strategies = [s.strip() for s in args.evotune_strategies.split(",") if s.strip()]
    seeds = list(range(args.seeds))

    # Same admitted set on both sides, or no comparison.
    kt_space = kt_searchspace(ex.space, context)
    why = _same_admitted_set(ex, kt_space)
    if why:
        print(f"kt_compare: {why}", file=sys.stderr)
        return 1

    tp = tune_params(ex.space)
    times_us = {}
    for c in ex.admitted:
        res = ex.records[c.digest()]["result"]
        times_us[config_key(c.as_dict()[k] for k in tp)] = res["time_us"] if res["status"] == R.OK else None

    tmp = Path(tempfile.mkdtemp(prefix="evotune-kt-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    cache_file = Path(args.cache_out) if args.cache_out else tmp / "kt_cache.json"
    write_cache(ex, cache_file)
    saved_runs = os.environ.get("EVOTUNE_RUNS")
    started = time.time()
    try:
        runs = _run_all(ex, cache_file, kt_strategies, ev_strategies, seeds, budgets, times_us, tmp, args.lookahead)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if saved_runs is None:
            os.environ.pop("EVOTUNE_RUNS", None)
        else:
            os.environ["EVOTUNE_RUNS"] = saved_runs
    wall = time.time() - started
    summary = summarize(ex, runs, budgets)
    command = "python tools/kt_compare.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = {"date": date.today().isoformat(), "command": command, "kernel_tuner": kt_version, "seeds": seeds,
            "wall_seconds": wall, "times_us": times_us, "statuses": ex.statuses,
            **_opening_and_lookahead(ex, kt_space, kt_strategies, ev_strategies, runs, args.lookahead)}
    meta["notes"] = table_notes(ex, summary, meta)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        data = {"run": ex.run.run_id, "space": ex.meta.get("space"), "shape": ex.shape.spec, "size": ex.size,
                "optimum_us": ex.optimum, "within": E.WITHIN, "budgets": budgets, "seeds": seeds,
                "kernel_tuner": kt_version, "date": meta["date"], "command": command, "wall_seconds": round(wall, 1),
                "restrictions": describe_restrictions(restrictions(ex.space, context)), "summary": summary,
                "verdict": verdict(ex, summary), "notes": meta["notes"], "runs": runs}
        Path(args.out).write_text(json.dumps(data, indent=1, default=str) + "\n")
    if args.md:
        write_md(Path(args.md), markdown(ex, summary, meta), ex.run.run_id)
    print(short_table(ex, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
