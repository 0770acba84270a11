"""Warm start: the best configurations of earlier runs, asked first by a new search.

`evotune search --warm-start RUN[,RUN...]` names the runs; `--warm-start auto` takes every recorded
run of the same family whose shape is the same or similar (`similar`). From each run come its
Pareto front and its `per_run` fastest passing configs; those admitted on the new shape are
enqueued once, when the study is created (search.run_search), ahead of anything the sampler
proposes. For NSGA-II they make up the first generation, from which the elites of the next are
chosen; TPE and random search take them as their first observations.

Ahead of them, by default (`--no-priors` turns it off), come the shipped priors (records/priors.py,
`prior_configs`): configs of evotune's own runs that the space admits here, nearest shape class first.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from ..errors import EvotuneError, UsageError
from ..records.runs import Run, ok_records, pareto_front, runs_dir

PER_RUN = 8  # fastest passing configs taken from each run, besides its Pareto front
NEW_KNOB_TOP = 4  # the fastest warm configs also asked at each other value of a knob their runs did not have
NEW_KNOB_JOINT = 8  # the fastest one also at up to this many combinations of two or more such knobs

@dataclass(frozen=True)
class Source:
    run: Run
    same_shape: bool   # else similar
    best_us: float


def similar(problem, a: dict, b: dict) -> bool:
    """Whether configs tuned on shape `a` are worth trying first on `b` (shape dicts): the family's
    `similar_shapes` (by default, equal in every field but its `size_fields`)."""
    return bool(problem.similar_shapes(a, b))


def pick_runs(spec: str, problem, shape, exclude=None) -> list[Source]:
    """The runs `--warm-start` names: "auto", or comma-separated run names (a run with no passing
    trial is an error when named, skipped by auto). Same-shape runs first, then similar ones, each
    fastest first. `exclude`: a run name, or a collection of them, that auto leaves out (the run itself;
    the runs the shipped priors were built from, already asked as priors)."""
    exclude = {exclude} if isinstance(exclude, str) else set(exclude or ())
    want = shape.as_dict()
    if spec.strip() == "auto":
        root = runs_dir()
        runs = [Run(p.parent) for p in sorted(root.glob("*/meta.json"))] if root.exists() else []
        named = False
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
        if not names:
            raise UsageError("--warm-start takes 'auto' or run names separated by commas")
        runs = [Run.open(n) for n in names]
        named = True
    out = []
    for run in runs:
        if run.run_id in exclude and not named:
            continue
        try:
            meta = run.meta()
        except EvotuneError:
            if named:
                raise
            continue
        if meta.get("family", "attention") != problem.family:
            if named:
                raise UsageError(f"--warm-start: run {run.run_id!r} is of family {meta.get('family')!r}, "
                                 f"not {problem.family!r}")
            continue
        theirs = meta.get("shape") or {}
        same = theirs == want
        if not named and not (same or similar(problem, theirs, want)):
            continue  # before its records are read: a checkout's runs/ holds exhaustive runs of 100k records
        try:
            records = run.trials()
        except EvotuneError:
            if named:
                raise
            continue
        ok = ok_records(records)
        if not ok:
            if named:
                raise UsageError(f"--warm-start: run {run.run_id!r} has no trial that passed the gate")
            continue
        out.append(Source(run, same, min(r["result"]["time_us"] for r in ok)))
    if named:
        return out
    return sorted(out, key=lambda s: (not s.same_shape, s.best_us))


def configs_from(sources: list[Source], per_run: int = PER_RUN, limit: int | None = None) -> list[dict]:
    """Config dicts from the runs, in order: each run's Pareto front and `per_run` fastest passing
    configs, fastest first; each config once; at most `limit`."""
    seen, out = set(), []
    for src in sources:
        records = src.run.trials()
        ok = sorted(ok_records(records), key=lambda r: (r["result"]["time_us"], r["number"]))
        picked = {r["digest"]: r for r in pareto_front(records) + ok[:per_run]}
        for r in sorted(picked.values(), key=lambda r: (r["result"]["time_us"], r["number"])):
            if r["digest"] not in seen:
                seen.add(r["digest"])
                out.append(dict(r["config"]))
    return out[:limit] if limit is not None else out


def with_new_knobs(space, context, dicts: list[dict], top: int = NEW_KNOB_TOP) -> list[dict]:
    """`dicts` with, after each of the first `top`, its variants at each other value of every knob of `space` that it
    does not name (a knob the space gained after the run that measured it), one knob at a time and only those `space`
    admits under `context`. So a new knob is measured on the configs it is most likely to improve, rather than left to
    the sampler's chance of proposing it on a tile that runs near the best. The fastest config is also asked at the
    combinations of two or more new knobs off their defaults (at most NEW_KNOB_JOINT of them): knobs can pay only
    together (on the H100, llama-4k's lazy rescaling and softmax overlap: -9% together, -1% and -2% apart)."""
    out = []
    for i, d in enumerate(dicts):
        out.append(d)
        if i >= top:
            continue
        new = [param for param in space.params if param.name not in d]
        alone = [{**d, param.name: value} for param in new for value in param.values if value != param.default]
        joint = [] if i else _joint_variants(d, new)[:NEW_KNOB_JOINT]
        for variant in alone + joint:
            try:
                if space.admitted(space.config(variant), context):
                    out.append(variant)
            except UsageError:
                continue
    return out


def _joint_variants(d: dict, new: list) -> list[dict]:
    """`d` at every combination of the `new` knobs' values with two or more of them off their defaults."""
    out = []
    for values in product(*(param.values for param in new)):
        off = sum(value != param.default for param, value in zip(new, values))
        if off >= 2:
            out.append({**d, **{param.name: value for param, value in zip(new, values)}})
    return out


def admitted(space, context, dicts) -> tuple[list, list[str]]:
    """The configs among `dicts` that `space` admits under `context` (each once, in order), and a note
    for each one dropped: a knob or value the space lacks, or a violated constraint."""
    keep, notes, seen = [], [], set()
    for d in dicts:
        try:
            config = space.config(d)
        except UsageError as e:
            notes.append(f"{_short(d)}: not in this space ({e})")
            continue
        if config.digest() in seen:
            continue
        seen.add(config.digest())
        why = space.violations(config, context)
        if why:
            notes.append(f"{_short(d)}: not admitted here ({'; '.join(why)})")
            continue
        keep.append(config)
    return keep, notes


def _short(d: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(d.items()))


PRIORS = 8  # shipped priors asked first, at most (records/priors.py), before the user's own runs


def prior_configs(problem, shape, space, context, limit: int = PRIORS, path=None,
                  gpu: str | None = None) -> tuple[list[dict], list[dict]]:
    """(config dicts, where each came from) of the shipped priors (records/priors.py; `path`: another priors file)
    that `space` admits under `context` on `shape`, nearest shape class first, and among equals those measured on
    GPU model `gpu` first (None: any GPU alike), at most `limit`. A prior is only a proposal: measured like any
    candidate, a stale one (its kernel source changed since) included."""
    from ..records.priors import class_of_shape, load_priors, nearest_configs

    doc = load_priors(path)
    found = nearest_configs(doc, class_of_shape(shape, problem.family, None), gpu=gpu)
    keep, origin = [], []
    for distance, entry, winner in found:
        if len(keep) == limit:
            break
        configs, _ = admitted(space, context, [winner["config"]])
        changed = {}
        if not configs:
            configs, changed = nearest_admitted(space, context, winner["config"])
        if not configs:
            continue
        d = configs[0].as_dict()
        if d in keep:
            continue
        keep.append(d)
        origin.append({"run": entry["run"], "distance": distance, "ratio_to_sdpa": winner.get("ratio_to_sdpa"),
                       **({"adapted": changed} if changed else {})})
    return keep, origin


REPAIR_KNOBS = 2  # a prior the shape does not admit is adapted by changing at most this many knobs


def nearest_admitted(space, context, d: dict, most: int = REPAIR_KNOBS) -> tuple[list, dict]:
    """([the admitted config nearest `d`], {knob: [its value in `d`, the value taken]}), or ([], {}) where no config
    within `most` changed knobs is admitted. A prior is knowledge of where to look: a winner of a larger grid
    (persistent, a mirrored stripe order) or of a profile with values the space lacks (stages 5-8 before the root
    listed them) still points at the tile and warp split that won; its nearest admitted neighbour keeps them.
    Nearest: fewest changed knobs, then the smallest moves along each knob's list of values (a value the space
    lacks counts as beyond the nearest end), then the space's knob order."""
    base = {p.name: d.get(p.name, p.default) for p in space.params}
    candidates = [(p, [v for v in p.values if v != base[p.name]]) for p in space.params]
    off_list = {p.name for p in space.params if base[p.name] not in p.values}  # each must move onto the list
    for count in range(max(1, len(off_list)), most + 1):
        found = []
        for knobs in _combinations(candidates, count):
            if not off_list <= {p.name for p, _ in knobs}:
                continue
            for values in product(*(vs for _, vs in knobs)):
                moved = {p.name: v for (p, _), v in zip(knobs, values)}
                config = space.config({**base, **moved})
                if space.admitted(config, context):
                    found.append((sum(_move(p, base[p.name], moved[p.name]) for p, _ in knobs), config, moved))
        if found:
            _, config, moved = min(found, key=lambda t: t[0])
            return [config], {k: [base[k], v] for k, v in moved.items()}
    return [], {}


def _combinations(candidates, count):
    from itertools import combinations

    return combinations([c for c in candidates if c[1]], count)


def _move(param, old, new) -> int:
    """How far `new` is from `old` along `param`'s values (a value off the list: one past the nearest end, or past
    the end nearest it in number)."""
    values = list(param.values)
    if old in values:
        return abs(values.index(new) - values.index(old))
    if isinstance(old, (int, float)) and not isinstance(old, bool) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        ends = sorted(values, key=lambda v: abs(v - old))
        return 1 + abs(values.index(new) - values.index(ends[0]))
    return 1 + len(values)


# log-time: a knob value every nearby winner chose starts about 10% faster than its knob's average. Chosen, not
# fitted (to keep the priors from being tuned to any shape list): of the order of one knob's effect on these kernels
# (wgmma's exp2_fma lost 6-16%, search_spaces/attention.yaml), so a few results on the shape outweigh it.
TRANSFER_SCALE = 0.1


def knob_prior(problem, shape, space, path=None, gpu: str | None = None) -> dict:
    """{(knob, value): prior mean of its weight in the surrogate (strategies.SurrogateSampler's prior_mean)} from
    the shipped priors (records/priors.py; `path`: another file) of shape classes comparable with `shape`: for each
    varying knob of `space`, -TRANSFER_SCALE x w / (w + 1) x (the share of those priors that chose the value - 1 /
    its number of values), each prior counted with weight 2^-distance (one size bucket or K/V-group doubling away:
    half), halved again where it was measured on another GPU than `gpu` (None: any counts in full), w their sum.
    w / (w + 1) is the evidence: one prior of the same class gives half the scale, a lone prior three buckets away
    a ninth (at full scale, in a CPU replay over the committed exhaustive runs with their shapes held out of the
    priors, such a lone d64 causal prior pinned every knob and the default search's median best after 60 went from
    +0.1% to +8.7% of the optimum on gpt2-causal bf16; +4.3% with this factor, still behind no transfer there:
    docs/data/heldout/transfer_replay.py). Only which configs won is
    read, never their recorded times: a prior is knowledge of where to look, not a measurement on this machine (a
    stale one, whose kernel source changed since, included)."""
    from ..records.priors import class_of_shape, load_priors, nearest_configs

    doc = load_priors(path)
    target = class_of_shape(shape, problem.family, None)
    share: dict = {}
    total: dict = {}
    for distance, entry, winner in nearest_configs(doc, target):
        weight = 2.0 ** -distance
        if gpu is not None and entry["class"].get("gpu") != gpu:
            weight /= 2
        for param in space.params:
            value = winner["config"].get(param.name)
            if len(param.values) < 2 or value not in param.values:
                continue
            share[(param.name, value)] = share.get((param.name, value), 0.0) + weight
            total[param.name] = total.get(param.name, 0.0) + weight
    out = {}
    for param in space.params:
        if param.name not in total:
            continue
        w = total[param.name]
        for value in param.values:
            out[(param.name, value)] = -TRANSFER_SCALE * w / (w + 1.0) * (share.get((param.name, value), 0.0) / w
                                                                          - 1.0 / len(param.values))
    return out


def search_prior_mean(spec, priors: bool, problem, shape, space, gpu: str | None = None) -> dict:
    """The surrogate's prior mean for a search (knob_prior), or {} where the priors are off (--no-priors, or
    --warm-start none: nothing known is used)."""
    if not priors or (spec and spec.strip() == "none"):
        return {}
    return knob_prior(problem, shape, space, gpu=gpu)


def gpu_name(index: int) -> str | None:
    """The name of CUDA device `index` as the driver reports it (what a run's meta.json records), None where no
    such device is visible: which GPU's priors rank first (a property query; nothing runs on the device)."""
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(int(index))["name"]
    except Exception:  # noqa: BLE001 - no driver, no device: any GPU's priors count alike
        return None
    return name.decode() if isinstance(name, bytes) else str(name)
