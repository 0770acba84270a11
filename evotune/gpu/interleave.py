"""Time several contenders (our kernel, the SDPA backends, several configs) interleaved, so that their
ratios carry no order bias.

Why: on the H100, two timings of one and the same config taken one after the other in one process
differ by 3-6% (1857 us, then 1949 us), with the clocks and power state left by whatever ran just
before. Timed one after the other (ours, then each baseline), a ratio such as "ours vs CUDNN"
carries a bias of that size, as large as the effects it is meant to show.

How: each contender is prepared once, the way evaluate.time_launches prepares one (warm-up on a side
stream, launches per replay for about TARGET_REPLAY_US, a captured CUDA graph or back-to-back
launches), then `rounds` rounds run; in each round every contender has one turn: one untimed replay
(so the first timed one does not pay for the switch from another contender's graph and L2 lines; more
can be asked, see SETTLE_US), then `reps_per_round` timed replays. The whole pool is queued on the stream and synchronized once,
so the GPU runs it back to back with no idle gaps between turns. A slow drift then reaches every
contender alike, and the per-round ratio of two contenders compares turns a few milliseconds apart.

The order within a round is a Williams design (`round_order`): round r starts with contender r mod n,
and over n rounds (2n for an odd n) each contender follows each other one equally often inside the
rounds (the one step across each round boundary is not balanced). A plain rotation would not do that:
with rotation, B follows A in every round but the one B opens, so a contender that heats the GPU would
always slow the same neighbour. head_to_head rounds its rounds up to whole cycles (whole_cycles: the
default 10 stays 10 for 2 or 5 contenders and becomes 12 for 4, which 10 rounds covered 2.5 times).

Everything but the GPU's clock and the graph capture is plain bookkeeping, tested on the CPU with a
stand-in clock and stand-in `prepare` (tests/test_interleave.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable

from ..records.result import Timing
from .evaluate import (CUDA_EVENTS, GateViolation, GuardedOutput, InputSnapshot, Prepared, Rotation,
                       check_after_timing, enqueue_replays, expect_untimed, forget_timing_inputs, per_call_us,
                       prepare_launches, timing_inputs, timing_of)

# A 2 ms kernel with 4 baselines: 12 rounds x (10 + 1) replays of ~2 ms each is about 0.3 s of GPU per
# contender, well under 10 s in all; a 5 us kernel's replays hold ~80 launches, still 100 samples each.
DEFAULT_ROUNDS = 10   # at least; head_to_head rounds it up to whole Williams cycles (whole_cycles)
MIN_REPS_PER_ROUND = 3
SETTLE_REPLAYS = 1    # untimed replays that open each turn, at least
# ... and at least SETTLE_US of them. The large shapes run at the H100's 700 W power limit, so a turn's clock depends
# on how much power the contender before it drew: with one ~2 ms settling replay (2026-11-23, the closing jobs of the
# gpt2, llama-4k and long-8k searches; docs/experiments/CHANGELOG.md: *-h100-persistent) a turn that followed the
# EFFICIENT backend (slow, low power) ran 4-7% faster than its contender's median. Settling longer does not remove
# that and costs pairing: with 20 and 50 ms of a contender's own launches before its timed replays
# (tools/settle_probe.py, docs/data/settle/), every contender ran slower (the power state settled lower), the effect
# after EFFICIENT still read 2-8%, the CUDNN/ours median moved within the run-to-run noise (llama-4k 0.97/0.97 at one
# replay, 0.97/0.93 at 20 ms, 0.95/0.95 at 50 ms) and the per-round spread widened (gpt2: 0.93-0.95 at one replay,
# 0.87-0.99 at 20 ms), since the two turns a ratio pairs lie further apart. So one replay it stays; what balances the
# predecessors is whole Williams cycles (whole_cycles), and each record carries the effect (predecessor_effect).
SETTLE_US = 0.0


def split_reps(reps: int, rounds: int = DEFAULT_ROUNDS) -> int:
    """Timed replays per contender and round for about `reps` in all (at least MIN_REPS_PER_ROUND)."""
    return max(MIN_REPS_PER_ROUND, reps // rounds)


def _williams_row(n: int) -> list[int]:
    """0, 1, n-1, 2, n-2, ...: added to r mod n, the rows of a Williams Latin square."""
    return [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]


def round_order(n: int, r: int) -> list[int]:
    """The contenders' order (indices 0..n-1) in round r: a permutation that starts with r mod n.

    Rows r = 0..n-1 are the Williams square's rows (row 0 shifted by r). For an odd n the next n rounds
    take the rows reversed, each picked so that it still starts with r mod n; together they balance
    the predecessors (for an even n the first n rows alone do)."""
    row = _williams_row(n)
    if n % 2 and (r // n) % 2:
        shift = (r - row[-1]) % n
        return [(shift + w) % n for w in reversed(row)]
    return [(r + w) % n for w in row]


def whole_cycles(n: int, rounds: int) -> int:
    """`rounds` rounded up to whole cycles of round_order (n rounds, 2n for an odd n): only over whole cycles
    does each contender follow each other equally often; with 10 rounds of 4 contenders, one followed the
    EFFICIENT backend 3 times and another 2 (what the previous contender leaves moves a turn by up to 7%)."""
    cycle = n if n % 2 == 0 or n == 1 else 2 * n
    return max(cycle, -(-rounds // cycle) * cycle)


def settle_replays(replay_us: float, settle_us: float = SETTLE_US) -> int:
    """Untimed replays that open a turn: at least SETTLE_REPLAYS, and at least `settle_us` of them."""
    if replay_us <= 0:
        return SETTLE_REPLAYS
    return max(SETTLE_REPLAYS, math.ceil(settle_us / replay_us))


def predecessor_effect(orders: list[list[str]], round_medians: dict[str, list[float]]) -> dict[str, float]:
    """Per contender P: the median over the turns that came right after one of P's of (the turn's median over
    its contender's median over all rounds). Far from 1, what ran before moves the timings (see SETTLE_US)."""
    overall = {n: statistics.median(v) for n, v in round_medians.items()}
    ratios: dict[str, list[float]] = {}
    previous = None
    for r, order in enumerate(orders):
        for name in order:
            if previous is not None:
                ratios.setdefault(previous, []).append(round_medians[name][r] / overall[name])
            previous = name
    return {n: statistics.median(v) for n, v in ratios.items()}


def paired_ratios(a: list[float], b: list[float]) -> dict:
    """Per-round ratio b/a of two contenders' round medians, and its median, min and max."""
    per_round = [y / x for x, y in zip(a, b)]
    return {"per_round": per_round, "median": statistics.median(per_round), "min": min(per_round),
            "max": max(per_round)}


@dataclass(frozen=True)
class Interleaved:
    """The outcome of time_interleaved: each contender's Timing over all its samples, its median per
    round, and the order each round ran in. `replays` (not recorded) runs a contender's timed launch
    sequence once more, for the audit."""

    timings: dict[str, Timing]
    round_medians: dict[str, list[float]]
    orders: list[list[str]]
    reps_per_round: int
    replays: dict[str, Callable[[], None]] = field(default_factory=dict, compare=False, repr=False)
    settle: dict[str, int] = field(default_factory=dict)  # untimed replays that opened each of its turns

    @property
    def rounds(self) -> int:
        return len(self.orders)

    def ratios(self, a: str, b: str) -> dict:
        """paired_ratios of contenders a and b: per round, b's time over a's."""
        return paired_ratios(self.round_medians[a], self.round_medians[b])

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "reps_per_round": self.reps_per_round, "orders": self.orders,
                "timings": {n: t.as_dict() for n, t in self.timings.items()},
                "round_medians": self.round_medians, "settle_replays": self.settle,
                "predecessor_effect": predecessor_effect(self.orders, self.round_medians)}


def interleaved_result(samples: dict[str, list[list[float]]], prepared: dict[str, Prepared],
                       orders: list[list[str]], reps: int, settle: dict[str, int] | None = None) -> Interleaved:
    """Interleaved from each contender's per-call samples, one list per round."""
    timings = {n: timing_of([x for rnd in rounds for x in rnd], prepared[n].launches_per_rep, prepared[n].method)
               for n, rounds in samples.items()}
    medians = {n: [statistics.median(rnd) for rnd in rounds] for n, rounds in samples.items()}
    return Interleaved(timings, medians, orders, reps, {n: p.replay for n, p in prepared.items()}, settle or {})


def time_interleaved(fns: dict[str, Callable[[], object]], rounds: int = DEFAULT_ROUNDS,
                     reps_per_round: int = 10, warmup: int = 10, prepare=prepare_launches,
                     clock=CUDA_EVENTS, settle_us: float = SETTLE_US) -> Interleaved:
    """Per-call GPU time of each fn (which launches work on torch's current stream), the fns timed in
    turns, `rounds` rounds (head_to_head asks whole_cycles) of `reps_per_round` timed replays each, each turn opened
    by about `settle_us` of untimed replays (see the module's notes). `prepare(fn, warmup=...)` and `clock`
    are the GPU's (evaluate.prepare_launches, CUDA events)."""
    names = list(fns)
    if not names:
        raise ValueError("time_interleaved needs at least one contender")
    prepared = {n: prepare(fns[n], warmup=warmup) for n in names}
    probes = {n: enqueue_replays(prepared[n], 1, clock) for n in names}  # one replay's length, for the settle
    clock.sync()
    settle = {n: settle_replays(per_call_us(probes[n], 1, clock)[0], settle_us) for n in names}
    orders = [[names[i] for i in round_order(len(names), r)] for r in range(rounds)]
    pairs: dict[str, list] = {n: [] for n in names}
    for order in orders:
        for n in order:
            for _ in range(settle[n]):
                prepared[n].replay()
            pairs[n].append(enqueue_replays(prepared[n], reps_per_round, clock))
    clock.sync()
    samples = {n: [per_call_us(p, prepared[n].launches_per_rep, clock) for p in pairs[n]] for n in names}
    return interleaved_result(samples, prepared, orders, reps_per_round, settle)


# ------------------------------------------------------------------ kernels beside baselines, checked


def head_to_head(problem, shape, kernels: dict, baselines: list[str], rounds: int = DEFAULT_ROUNDS,
                 reps_per_round: int = 10,
                 timer=time_interleaved) -> tuple[Interleaved | None, dict[str, GateViolation]]:
    """Kernels (`label -> launch_for(inputs, out)`, as evaluate takes them) and the named baselines timed
    interleaved on the same rotating timing input sets (evaluate.timing_sets: the same inputs and the same L2
    traffic for every contender), each kernel held to the timed-output checks of evaluate.check_timed: an
    untimed launch on the last set into NaN that passes the gate's error check, then, after the interleaved
    timing, O bitwise equal to it, and the audit replay on a changed input.

    Returns (the Interleaved, or None when nothing was left to time; label -> GateViolation of each
    kernel that failed). A kernel that fails its untimed launch is not timed; baselines whose launcher
    refuses the inputs are left out. `timer(fns, rounds=, reps_per_round=)` is time_interleaved."""
    sets, snapshots = timing_inputs(problem, shape)
    failures: dict[str, GateViolation] = {}
    outputs, fns = {}, {}
    for label, launch_for in kernels.items():
        guarded = GuardedOutput(problem.new_output(sets[-1]))
        rotation = Rotation(launch_for(s, guarded.out) for s in sets)
        try:
            outputs[label] = (guarded, expect_untimed(problem, shape, sets[-1], rotation.launches[-1], guarded,
                                                      snapshots[-1]))
            fns[label] = rotation
        except GateViolation as v:
            failures[label] = v
            forget_timing_inputs()
    for name in baselines:
        launches = [problem.baseline_launcher(name, shape, s) for s in sets]
        if all(fn is not None for fn in launches):
            fns[name] = Rotation(launches)
    if not fns:
        return None, failures
    result = timer(fns, rounds=whole_cycles(len(fns), rounds), reps_per_round=reps_per_round)
    for label, (guarded, expected) in outputs.items():
        try:
            check_after_timing(problem, shape, guarded, sets, snapshots, expected, result.replays[label],
                               timing="the interleaved timing")
        except GateViolation as v:
            failures[label] = v
    if failures:
        forget_timing_inputs()
    return result, failures
