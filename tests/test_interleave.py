"""Interleaved timing (evotune/gpu/interleave.py) on the CPU: the round order, the paired ratios, the
bookkeeping of time_interleaved under a stand-in clock that drifts, and head_to_head's timed-output
check with Python stand-in kernels (tests/_planted.py); the GPU's own clock and graphs are not used."""

from __future__ import annotations

from collections import Counter

import pytest
from _fake_gpu import LAUNCHES_PER_REP, FakeClock, FakeGPU, cpu_interleaved, cpu_prepare
from _planted import CORRECT, Planted, on_cpu

from evotune.gpu import evaluate as E
from evotune.gpu import interleave as I
from evotune.problems import get_problem
from evotune.records import result as R

ATTENTION_SHAPE = "1,2,40,56,64:bshd"


# ------------------------------------------------------------------ the order of each round


@pytest.mark.parametrize("n", range(1, 8))
def test_each_round_is_a_permutation_that_starts_with_r_mod_n(n):
    """Round r runs every contender once and starts with contender r mod n."""
    for r in range(3 * n):
        order = I.round_order(n, r)
        assert sorted(order) == list(range(n)) and order[0] == r % n


@pytest.mark.parametrize("n", range(2, 8))
def test_inside_the_rounds_each_contender_follows_each_other_equally_often(n):
    """Over n rounds (2n for an odd n) every ordered pair of distinct contenders is adjacent equally often
    inside the rounds; a plain rotation would put each contender after the same one every time."""
    cycle = n if n % 2 == 0 else 2 * n
    pairs = Counter(p for r in range(cycle) for p in zip(I.round_order(n, r), I.round_order(n, r)[1:]))
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1


def test_split_reps_keeps_a_floor():
    """About reps / rounds replays per round, never fewer than MIN_REPS_PER_ROUND."""
    assert I.split_reps(100) == 10 and I.split_reps(100, rounds=4) == 25
    assert I.split_reps(5) == I.MIN_REPS_PER_ROUND == 3


def test_paired_ratios_are_b_over_a_per_round():
    """Per round b/a, and its median, min and max."""
    r = I.paired_ratios([10.0, 20.0, 10.0], [11.0, 20.0, 9.0])
    assert r["per_round"] == pytest.approx([1.1, 1.0, 0.9])
    assert (r["median"], r["min"], r["max"]) == pytest.approx((1.0, 0.9, 1.1))


# ------------------------------------------------------------------ time_interleaved


def _interleave(gpu: FakeGPU, names, **kw):
    kw.setdefault("settle_us", 0.0)
    return I.time_interleaved({n: gpu.launcher(n) for n in names}, prepare=cpu_prepare, clock=FakeClock(gpu), **kw)


def test_bookkeeping_of_rounds_samples_and_timings():
    """Each contender gets rounds x reps_per_round per-launch samples (its Timing's reps), one median per
    round, its prepare's launches and method; after one replay that measures its length, each turn is one
    untimed replay (settle_us 0) and the timed ones, in round_order's order; the events are read after one
    sync per pass."""
    gpu = FakeGPU({"a": 10.0, "b": 20.0, "c": 5.0})
    res = _interleave(gpu, ["a", "b", "c"], rounds=4, reps_per_round=3, warmup=2)
    assert res.rounds == 4 and res.orders == [[["a", "b", "c"][i] for i in I.round_order(3, r)] for r in range(4)]
    for name, cost in (("a", 10.0), ("b", 20.0), ("c", 5.0)):
        t = res.timings[name]
        assert (t.reps, t.launches_per_rep, t.method) == (12, LAUNCHES_PER_REP, "cpu-stand-in")
        assert t.median_us == pytest.approx(cost) and res.round_medians[name] == pytest.approx([cost] * 4)
        assert gpu.launches[name] == 2 + (1 + 4 * (I.SETTLE_REPLAYS + 3)) * LAUNCHES_PER_REP
    turns = [n for i, n in enumerate(gpu.sequence) if i == 0 or gpu.sequence[i - 1] != n]
    assert turns[6:] == [n for order in res.orders for n in order]  # after the warm-ups and length probes
    assert res.ratios("a", "b")["per_round"] == pytest.approx([2.0] * 4)
    d = res.as_dict()
    assert set(d) == {"rounds", "reps_per_round", "orders", "timings", "round_medians", "settle_replays",
                      "predecessor_effect"}
    assert d["settle_replays"] == {"a": 1, "b": 1, "c": 1} and d["predecessor_effect"] == pytest.approx(
        {"a": 1.0, "b": 1.0, "c": 1.0})
    assert d["timings"]["c"]["median_us"] == pytest.approx(5.0)


def test_each_turn_settles_for_settle_us_of_its_own_launches():
    """A turn opens with enough untimed replays to cover settle_us (at least one), counted from one replay's
    measured length: a contender 4x slower settles with a quarter of the replays."""
    gpu = FakeGPU({"fast": 5.0, "slow": 20.0})
    replay_us = {n: c * LAUNCHES_PER_REP for n, c in gpu.costs.items()}
    res = _interleave(gpu, ["fast", "slow"], rounds=2, reps_per_round=3, warmup=1, settle_us=8 * replay_us["fast"])
    assert res.settle == {"fast": 8, "slow": 2}
    for name in ("fast", "slow"):
        assert gpu.launches[name] == 1 + (1 + 2 * (res.settle[name] + 3)) * LAUNCHES_PER_REP
    assert I.settle_replays(0.0) == I.SETTLE_REPLAYS and I.settle_replays(1e9) == I.SETTLE_REPLAYS


@pytest.mark.parametrize("n, rounds, whole", [(1, 10, 10), (2, 10, 10), (4, 10, 12), (5, 10, 10), (3, 10, 12),
                                              (10, 10, 10), (9, 10, 18), (4, 1, 4)])
def test_head_to_head_takes_whole_cycles(n, rounds, whole):
    """Rounds rounded up to whole Williams cycles (n, or 2n for an odd n), so that over them each contender
    follows each other equally often."""
    assert I.whole_cycles(n, rounds) == whole


def test_predecessor_effect_names_the_contender_that_speeds_up_the_next():
    """b runs 9.5 where it follows "cool" (rounds 0 and 2) and 10 elsewhere (median 9.75): cool's effect is the
    median of 9.5/9.75, 1 (cool after itself across rounds 1-2) and 9.5/9.75; a's is 1."""
    orders = [["a", "cool", "b"], ["b", "a", "cool"], ["cool", "b", "a"], ["a", "b", "cool"]]
    medians = {"a": [10.0] * 4, "b": [9.5, 10.0, 9.5, 10.0], "cool": [10.0] * 4}
    effect = I.predecessor_effect(orders, medians)
    assert effect["cool"] == pytest.approx(9.5 / 9.75) and effect["a"] == pytest.approx(1.0)


def test_interleaving_cancels_a_drift_that_timing_one_after_the_other_carries():
    """Two identical contenders on a GPU that slows by 10% over the run: timed one after the other (one
    round) their ratio is off by several percent; interleaved in ten rounds it is 1 within 1%."""
    costs = {"a": 10.0, "b": 10.0}
    total_us = 2 * 10 * (100 + 10) * LAUNCHES_PER_REP
    one_after = _interleave(FakeGPU(costs, drift=0.1 / total_us), ["a", "b"], rounds=1, reps_per_round=100)
    assert one_after.ratios("a", "b")["median"] > 1.03
    inter = _interleave(FakeGPU(costs, drift=0.1 / total_us), ["a", "b"], rounds=10, reps_per_round=10)
    assert inter.ratios("a", "b")["median"] == pytest.approx(1.0, abs=0.01)
    assert inter.timings["b"].median_us / inter.timings["a"].median_us == pytest.approx(1.0, abs=0.01)


def test_no_contenders_is_an_error():
    with pytest.raises(ValueError):
        I.time_interleaved({}, prepare=cpu_prepare)


# ------------------------------------------------------------------ head_to_head


@pytest.fixture(scope="module")
def cpu_attention():
    """The attention family on CPU tensors, with Python stand-ins for its baselines ("refuses": None)."""

    class WithBaselines(type(on_cpu(get_problem("attention")))):
        def baseline_launcher(self, name, shape, inputs, probe=True):
            return None if name == "refuses" else (lambda: self.reference(shape, inputs))

    problem = WithBaselines()
    return problem, problem.parse_shape(ATTENTION_SHAPE)


def test_head_to_head_times_kernels_and_baselines_on_the_same_inputs(cpu_attention):
    """A correct kernel and the baselines that accept the inputs are timed interleaved; nothing fails."""
    problem, shape = cpu_attention
    gpu = FakeGPU({"ours": 5.0, "other": 6.0, "flash": 8.0})
    kernels = {"ours": Planted(problem, shape).launch_for, "other": Planted(problem, shape).launch_for}
    res, failures = I.head_to_head(problem, shape, kernels, ["flash", "refuses"], rounds=3, reps_per_round=3,
                                   timer=cpu_interleaved(gpu))
    assert failures == {} and set(res.timings) == {"ours", "other", "flash"}
    assert res.ratios("ours", "flash")["median"] == pytest.approx(8.0 / 5.0)


def test_head_to_head_catches_a_kernel_whose_later_launches_skip_work(cpu_attention):
    """A fresh stateful kernel (later launches return at once) leaves the answer to an earlier timing set in O
    after the interleaved timing over rotating input sets. The other kernel is unaffected."""
    problem, shape = cpu_attention
    gpu = FakeGPU({"cheat": 1.0, "ours": 5.0, "flash": 8.0})
    kernels = {"cheat": Planted(problem, shape, "stateful_counter").launch_for,
               "ours": Planted(problem, shape, CORRECT).launch_for}
    res, failures = I.head_to_head(problem, shape, kernels, ["flash"], rounds=3, reps_per_round=3,
                                   timer=cpu_interleaved(gpu))
    assert set(failures) == {"cheat"} and failures["cheat"].check == R.TIMED_OUTPUT
    assert "rotating input sets, O differs from an untimed launch on the last set" in failures["cheat"].detail


def test_head_to_head_does_not_time_a_kernel_whose_untimed_launch_fails(cpu_attention):
    """A kernel off by 25% fails the untimed launch's error check and is left out of the pool."""
    problem, shape = cpu_attention

    class Off(Planted):
        def run_into(self, inputs, out):
            self._compute(inputs, out, 1.25)

    gpu = FakeGPU({"off": 5.0, "flash": 8.0})
    res, failures = I.head_to_head(problem, shape, {"off": Off(problem, shape).launch_for}, ["flash"], rounds=2,
                                   reps_per_round=3, timer=cpu_interleaved(gpu))
    assert set(res.timings) == {"flash"} and gpu.launches["off"] == 0
    assert str(failures["off"]).startswith("timed output: the untimed launch on the timing inputs fails the gate")


def test_head_to_head_with_nothing_to_time(cpu_attention):
    """No kernel left and no baseline: no timing, the failures only."""
    problem, shape = cpu_attention
    assert I.head_to_head(problem, shape, {}, ["refuses"], timer=cpu_interleaved(FakeGPU({}))) == (None, {})


def test_the_pieces_time_launches_shares_with_time_interleaved():
    """enqueue_replays, per_call_us and timing_of (time_launches is made of them) on the stand-in clock:
    per-launch times of replays read after a sync."""
    gpu = FakeGPU({"k": 7.0})
    prepared = cpu_prepare(gpu.launcher("k"), warmup=1)
    clock = FakeClock(gpu)
    pairs = E.enqueue_replays(prepared, 5, clock)
    clock.sync()
    timing = E.timing_of(E.per_call_us(pairs, prepared.launches_per_rep, clock), prepared.launches_per_rep,
                         prepared.method)
    assert (timing.median_us, timing.p10_us, timing.p90_us, timing.reps) == pytest.approx((7.0, 7.0, 7.0, 5))
