"""The correctness gate's launch-integrity checks (evotune/gpu/evaluate.py) on the CPU: guarded output,
unchanged inputs, repeated launches, and the timed-output check with its audit replay, against
launches written in Python that cheat each check (tests/_planted.py). The real planted CUDA
kernels go through the same checks on the GPU in tests/test_gpu_faults.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from _planted import (CORRECT, MEMO_FAULTS, REPLAY_LAUNCHES, REPLAYS, STATEFUL_LAUNCHES, WARMUP_LAUNCHES, Planted,
                      cpu_timer, on_cpu)

from evotune.gpu import evaluate as E
from evotune.records import result as R
from evotune.problems import get_problem
from evotune.records.result import Verification
from _paths import REPO_ROOT

ATTENTION_SHAPE = "1,2,40,56,64:bshd"  # (B, S, H, D) memory viewed as (B, H, S, D): O keeps those strides
SOFTMAX_SHAPE = "37,200"


@pytest.fixture(scope="module")
def cpu_attention():
    problem = on_cpu(get_problem("attention"))
    return problem, problem.parse_shape(ATTENTION_SHAPE)


@pytest.fixture(scope="module")
def cpu_softmax():
    problem = on_cpu(get_problem("softmax"))
    return problem, problem.parse_shape(SOFTMAX_SHAPE)


@pytest.fixture(params=["attention", "softmax"])
def family(request, cpu_attention, cpu_softmax):
    return cpu_attention if request.param == "attention" else cpu_softmax


def evaluate(problem, shape, fault: str, **kw):
    """evaluate_launches on the stand-in for `fault`, timed by the CPU stand-in timer: (Result, Planted)."""
    planted = Planted(problem, shape, fault)
    res = E.evaluate_launches(problem, shape, planted.launch_for, timer=cpu_timer(planted), **kw)
    return res, planted


# ------------------------------------------------------------------ the guarded output


def test_guarded_output_is_new_output_inside_sentinel_bands(cpu_attention):
    """O has new_output's shape, strides and dtype, starts GUARD_BYTES (>= 64 KiB) into its allocation with
    as many bytes after it, and the bands report nothing until a byte in either changes."""
    problem, shape = cpu_attention
    like = problem.new_output(problem.make_inputs(shape, 1))
    g = E.GuardedOutput(like)
    assert (g.out.shape, g.out.stride(), g.out.dtype) == (like.shape, like.stride(), like.dtype)
    assert not like.is_contiguous() and E.GUARD_BYTES >= 64 * 1024
    item = like.element_size()
    assert g.out.storage_offset() * item == E.GUARD_BYTES
    assert g.flat.numel() * item == 2 * E.GUARD_BYTES + like.numel() * item
    g.fill(E.NAN)
    g.out.fill_(3.0)  # writing every element of O is allowed
    assert g.stray_writes() is None
    raw = g.flat.view(torch.uint8)
    for index, where in ((0, "before O"), (raw.numel() - 1, "after O")):
        saved = raw[index].clone()
        raw[index] ^= 0xFF
        assert g.stray_writes().startswith(where)
        raw[index] = saved
    assert g.stray_writes() is None


def test_garbage_is_finite_and_not_constant(cpu_attention):
    """The refill that catches "compute only into NaN" is finite, varied, and differs per seed."""
    problem, shape = cpu_attention
    g = E.GuardedOutput(problem.new_output(problem.make_inputs(shape, 1)))
    g.fill(E.GARBAGE, seed=1)
    first = g.out.clone()
    assert bool(torch.isfinite(first).all()) and float(first.float().std()) > 0.1
    g.fill(E.GARBAGE, seed=2)
    assert E.differing_elements(g.out, first) > first.numel() // 2
    g.fill(E.NAN)
    assert bool(torch.isnan(g.out).all())


def test_bitwise_comparison_sees_nan_and_signed_zero():
    """differing_elements compares bits: the same NaN is equal, NaN vs a number and -0.0 vs 0.0 differ."""
    a = torch.tensor([float("nan"), 0.0, 1.0], dtype=torch.float16)
    assert E.differing_elements(a, a.clone()) == 0
    assert E.differing_elements(a, torch.tensor([1.0, -0.0, 1.0], dtype=torch.float16)) == 2


# ------------------------------------------------------------------ the gate and the timed check


def test_a_correct_launch_passes_every_check(family):
    """A correct launch is OK, timed, and every new check says what it saw; eval_seconds has each phase."""
    problem, shape = family
    res, planted = evaluate(problem, shape, CORRECT)
    assert res.status == R.OK, res.message
    v = res.verification
    assert v["passed"] and v["failed_check"] == ""
    assert v["guards"].startswith("nothing written in the 256 KiB before or after O in ")
    assert v["inputs_intact"].startswith("every input bitwise unchanged by ")
    assert v["repeat"].startswith(f"{E.REPEAT_LAUNCHES} launches on seed 1 normal bitwise identical")
    assert v["timed_output"].startswith(f"O after timing over {E.ROTATION_SETS} rotating input sets bitwise equal")
    assert res.time_us == pytest.approx(0.3 + 10.0)
    assert set(res.extra["eval_seconds"]) == {"verify", "timed_check", "time"}
    cases = len(E.gate_cases(problem))
    # gate cases, the repeats, the dependency pair; then one untimed launch, the timer's, one audit replay
    assert planted.launches == cases + (E.REPEAT_LAUNCHES - 1) + 2 + 1 + \
        WARMUP_LAUNCHES + REPLAYS * REPLAY_LAUNCHES + REPLAY_LAUNCHES


# (fault, the check that catches it, the start of its message)
CAUGHT = [
    ("skip_on_repeat", R.REPEAT, "repeat: 1 of 2 repeated launches on seed 1 normal differ from the first "
                                 "(launch 2, into finite garbage: "),
    # Which timed check sees it depends on how many launches the family's gate made before (attention's stop
    # within the timer's warm-up, softmax's one cycle later).
    ("stateful_counter", (R.TIMED_OUTPUT, R.CHANGED_INPUT), ("timed output: after timing over 2 rotating input sets, "
                                                             "O differs from an untimed launch on the last set",
                                                             "changed input: after one ")),
    ("wrong_when_timed", R.TIMED_OUTPUT, "timed output: after timing over 2 rotating input sets, O differs"),
    ("input_mutation", R.INPUT_MUTATED, "input mutated: {last} changed in 1 of "),
    ("write_past_o", R.WRITE_OUTSIDE, "write outside O: after O ("),
    ("write_before_o", R.WRITE_OUTSIDE, "write outside O: before O ("),
    ("write_nan_past_o", R.WRITE_OUTSIDE, "write outside O: after O ("),
]
FIELD = {R.REPEAT: "repeat", R.TIMED_OUTPUT: "timed_output", R.INPUT_MUTATED: "inputs_intact",
         R.WRITE_OUTSIDE: "guards", R.CHANGED_INPUT: "timed_output"}


@pytest.mark.parametrize("fault, check, start", CAUGHT, ids=[c[0] for c in CAUGHT])
def test_each_cheat_is_wrong_naming_its_check(family, fault, check, start):
    """Each cheating launch is WRONG, untimed, with a one-line message naming the check that caught it,
    and its Verification says which check failed and how."""
    problem, shape = family
    res, _ = evaluate(problem, shape, fault)
    last = [n for n, t in problem.make_inputs(shape, 1).items() if isinstance(t, torch.Tensor)][-1]
    v = res.verification
    checks, starts = (check, start) if isinstance(check, tuple) else ((check,), (start,))
    assert res.status == R.WRONG and v["failed_check"] in checks, res.message
    start = starts[checks.index(v["failed_check"])]
    assert res.message.startswith(start.format(last=last)), res.message
    assert "\n" not in res.message and res.time_us is None and res.timing is None
    assert not v["passed"] and v[FIELD[v["failed_check"]]].startswith("FAILED: ") and v["failed_check"] in R.CHECKS


def test_stray_writes_are_caught_on_their_first_launch(cpu_attention):
    """A store just past O is found after the first checked launch, and the message says where and in which case."""
    problem, shape = cpu_attention
    res, planted = evaluate(problem, shape, "write_past_o")
    assert planted.launches == 1
    assert "the nearest 1 bytes past O's last byte) in seed 1 normal" in res.message or \
        "the nearest 2 bytes past O's last byte) in seed 1 normal" in res.message, res.message


def test_the_cheats_pass_the_old_gate(cpu_attention):
    """Without the new checks each cheat would have passed: every gate case into NaN is right (the issue's exploit)."""
    problem, shape = cpu_attention
    atol, rtol = problem.tolerance(shape)
    for fault in ("skip_on_repeat", "stateful_counter", "wrong_when_timed", "input_mutation", "write_past_o"):
        planted = Planted(problem, shape, fault)
        for seed, pattern in E.gate_cases(problem):
            inputs = problem.make_inputs(shape, seed, pattern=pattern)
            out = E.GuardedOutput(problem.new_output(inputs)).out.fill_(float("nan"))  # room for the stray store
            planted.run_into(inputs, out)
            ref = problem.reference(shape, problem.make_inputs(shape, seed, pattern=pattern))
            assert E.output_errors(out, ref, atol * E._error_scale(problem, inputs), rtol)[3] <= 1.0, fault


def test_stateful_counter_passes_the_gate_and_fails_the_timed_checks(cpu_attention):
    """A kernel whose launches after the first STATEFUL_LAUNCHES do nothing passes verify (its checked launches are
    fewer); timed over rotating input sets, or replayed on a changed one, it leaves an earlier answer in O."""
    problem, shape = cpu_attention
    planted = Planted(problem, shape, "stateful_counter")
    check = E.verify(problem, shape, planted.run_into)
    assert check.passed and planted.launches < STATEFUL_LAUNCHES
    with pytest.raises(E.GateViolation) as info:
        E.check_timed(problem, shape, planted.launch_for, timer=cpu_timer(planted))
    assert info.value.check in (R.TIMED_OUTPUT, R.CHANGED_INPUT)


def test_rotation_defeats_computing_only_into_nan(cpu_attention):
    """Alone, the timed-output check catches the issue-11 exploit (compute only into NaN): the warm-up's first launch
    leaves an answer in O, and every later launch, on the other set, keeps it."""
    problem, shape = cpu_attention
    planted = Planted(problem, shape, "skip_on_repeat")
    with pytest.raises(E.GateViolation) as info:
        E.check_timed(problem, shape, planted.launch_for, timer=cpu_timer(planted))
    assert info.value.check == R.TIMED_OUTPUT and "rotating input sets" in info.value.detail
    assert planted.worked == 2  # the untimed launch and the first warm-up launch: each into NaN


def test_untimed_launch_must_pass_the_error_gate(cpu_attention):
    """The timed-output check's own untimed launch is held to the gate's error check."""
    problem, shape = cpu_attention

    class Late(Planted):  # right for its first 12 launches (as many as verify makes), then 2x off
        def run_into(self, inputs, out):
            self.launches += 1
            self._compute(inputs, out, 1.0 if self.launches <= 12 else 2.0)

    planted = Late(problem, shape)
    planted.launches = 12
    with pytest.raises(E.GateViolation) as info:
        E.check_timed(problem, shape, planted.launch_for, timer=cpu_timer(planted))
    assert info.value.check == R.TIMED_OUTPUT
    assert str(info.value).startswith("timed output: the untimed launch on the timing inputs fails the gate")


def test_determinism_check_uses_the_guarded_buffers(cpu_attention):
    """check_determinism (evotune verify's 100 launches) passes a correct launch, and catches a stateful one,
    a changed input and a stray write, naming each."""
    problem, shape = cpu_attention
    assert E.check_determinism(problem, shape, Planted(problem, shape).run_into, launches=20) == \
        (True, "20 launches on seed 12 bitwise identical (O refilled with NaN and finite garbage between)")
    ok, detail = E.check_determinism(problem, shape, Planted(problem, shape, "stateful_counter").run_into, launches=20)
    assert not ok and detail.startswith(f"{20 - STATEFUL_LAUNCHES} of 19 repeated launches on seed 12 differ")
    for fault, start in (("input_mutation", "input mutated: v changed"),
                         ("write_before_o", "write outside O: before O")):
        ok, detail = E.check_determinism(problem, shape, Planted(problem, shape, fault).run_into, launches=5)
        assert not ok and detail.startswith(start) and detail.endswith("in launch 1 of 5"), detail


def test_verify_without_timing_leaves_the_timed_check_unchecked(cpu_attention):
    """time_it=False (the GPU tests' gate-only runs) passes without a timing and says the timed output was not checked."""
    problem, shape = cpu_attention
    res, _ = evaluate(problem, shape, CORRECT, time_it=False)
    assert res.status == R.OK and res.time_us is None and res.verification["timed_output"] == "not checked"
    assert set(res.extra["eval_seconds"]) == {"verify"}


def test_wrong_values_keep_their_message_and_skip_the_repeats(cpu_attention):
    """A launch that is simply wrong fails as before ("x the gate"), and the repeat and dependency checks are not run."""
    problem, shape = cpu_attention

    class Off(Planted):
        def run_into(self, inputs, out):
            self.launches += 1
            self._compute(inputs, out, 1.25)

    planted = Off(problem, shape)
    res = E.evaluate_launches(problem, shape, planted.launch_for, timer=cpu_timer(planted))
    assert res.status == R.WRONG and res.message.startswith("error ") and "x the gate in" in res.message
    assert res.verification["failed_check"] == R.ERROR
    assert res.verification["repeat"].startswith("not checked") and res.verification["dependency"] == "not checked"
    assert planted.launches == len(E.gate_cases(problem))


# ------------------------------------------------------------------ records


def test_old_verification_records_load_with_the_new_checks_unchecked():
    """A verification recorded before these checks existed (a committed run) loads; the new fields say "not checked"."""
    lines = (REPO_ROOT / "runs" / "d64-fp16" / "trials.jsonl").read_text().splitlines()
    recorded = next(r["result"]["verification"] for r in map(json.loads, lines)
                    if (r.get("result") or {}).get("verification"))
    assert "guards" not in recorded
    v = Verification.from_dict(recorded)
    assert (v.guards, v.inputs_intact, v.repeat, v.timed_output, v.failed_check) == \
        ("not checked", "not checked", "not checked", "not checked", "")
    assert v.passed == recorded["passed"] and v.seeds == tuple(recorded["seeds"])
    assert Verification.from_dict(v.as_dict()) == v


def test_failure_messages_name_every_check():
    """failure_message starts with each check's name (the words the issue asks for)."""
    base = Verification(max_abs=0.1, max_rel=0.1, nonfinite=0, gate_ratio=2.0, seeds=(1,), atol=1e-3, rtol=4e-3,
                        passed=False, worst_case="seed 1 normal")
    assert E.failure_message(E.with_violation(base, E.GateViolation(R.REPEAT, "x"))) == "repeat: x"
    for check in (R.INPUT_MUTATED, R.WRITE_OUTSIDE, R.TIMED_OUTPUT):
        v = E.with_violation(base, E.GateViolation(check, "detail"))
        assert E.failure_message(v) == f"{check}: detail" and v.failed_check == check
    from dataclasses import replace

    assert E.failure_message(replace(base, failed_check=R.ERROR)).startswith("error 2x the gate in seed 1 normal")
