"""Kernels that remember their own answers (issue 38) against the gate, on the CPU: their Python twins
(tests/_planted.py) through the real evaluate.evaluate_launches, the timing input rotation, the audit on a
changed input, and the physical floor (gpu/plausibility.py). The CUDA twins (tests/fault_family.py) go
through the same gate on the GPU in tests/test_gpu_faults.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from _planted import MEMO_FAULTS, Planted, cpu_timer, on_cpu

from evotune.gpu import evaluate as E
from evotune.gpu.plausibility import ROOF_HEADROOM, Floors, floor_analysis, implausible_reason
from evotune.problems import get_problem
from evotune.records import result as R
from evotune.records.result import Result

SHAPES = {"attention": "1,2,40,56,64:bshd", "attention-gqa-causal": "1,4,40,56,64:kv2:causal", "softmax": "37,200"}
# The named check that catches each memo fault, per family (which timed check sees a launch-count cheat first
# depends on how many launches the family's gate makes before timing).
CAUGHT = {
    "memo_o": {"*": R.TIMED_OUTPUT},
    "memo_fingerprint": {"*": R.DEPENDENCY},
    "memo_late": {"attention": R.CHANGED_INPUT, "attention-gqa-causal": R.CHANGED_INPUT, "softmax": R.TIMED_OUTPUT},
    "memo_cache": {"*": R.CHANGED_INPUT},
}


@pytest.fixture(scope="module", params=list(SHAPES))
def family(request):
    problem = on_cpu(get_problem(request.param.split("-")[0]))
    return request.param, problem, problem.parse_shape(SHAPES[request.param])


def evaluate(problem, shape, fault: str):
    planted = Planted(problem, shape, fault)
    return E.evaluate_launches(problem, shape, planted.launch_for, timer=cpu_timer(planted)), planted


@pytest.mark.parametrize("fault", MEMO_FAULTS)
def test_each_memo_kernel_is_wrong_naming_its_check(family, fault):
    """Every kernel that remembers its answer (in O, by an input fingerprint, after N launches, in a two-slot cache)
    is WRONG with no time, and the check that caught it is named in the message and the verification."""
    name, problem, shape = family
    res, _ = evaluate(problem, shape, fault)
    expected = CAUGHT[fault].get(name, CAUGHT[fault].get("*"))
    assert res.status == R.WRONG and res.time_us is None and res.timing is None, res.message
    assert res.verification["failed_check"] == expected and res.message.startswith(expected), res.message


def test_a_correct_kernel_passes_the_same_gate(family):
    """The honest stand-in passes every check of the same gate, so the checks above can tell the two apart."""
    _, problem, shape = family
    res, _ = evaluate(problem, shape, "none")
    assert res.status == R.OK and res.verification["timed_output"] == E.TIMED_OUTPUT_PASSED


def test_memo_o_passes_timing_on_one_input_set(monkeypatch, family):
    """The issue's exploit, kept as the control: timed on a single input set (the gate before issue 38), the kernel
    that returns when O still holds its last answer passes the timed checks; the rotation is what catches it."""
    _, problem, shape = family
    monkeypatch.setattr(E, "ROTATION_SETS", 1)
    monkeypatch.setattr(E.timing_sets, "__defaults__", (1,))
    E.forget_timing_inputs()  # the kept sets are the rotation's
    planted = Planted(problem, shape, "memo_o")
    timing = E.check_timed(problem, shape, planted.launch_for, timer=cpu_timer(planted))
    assert timing.median_us < 1.0  # it skipped nearly every timed launch
    monkeypatch.undo()
    E.forget_timing_inputs()
    planted = Planted(problem, shape, "memo_o")
    with pytest.raises(E.GateViolation) as info:
        E.check_timed(problem, shape, planted.launch_for, timer=cpu_timer(planted))
    assert info.value.check == R.TIMED_OUTPUT


def test_timing_sets_differ_in_every_element(family):
    """Every floating input element of each timing set differs bitwise from that element in every other set (so no
    fingerprint of any elements repeats), the sets are the same on every call, and each keeps the layout."""
    _, problem, shape = family
    sets = E.timing_sets(problem, shape, n=3)
    again = E.timing_sets(problem, shape, n=3)
    for name, t in sets[0].items():
        if not isinstance(t, torch.Tensor):
            continue
        for i in range(3):
            assert E.differing_elements(sets[i][name], again[i][name]) == 0
            assert sets[i][name].stride() == t.stride()
            for j in range(i):
                assert E.differing_elements(sets[i][name], sets[j][name]) == t.numel(), (name, i, j)


def test_timing_inputs_are_kept_per_shape_until_a_check_fails(family):
    """The timing sets are made once per (family, shape) in a process, replaced for another shape, and dropped
    when a timed check fails (the failing kernel may have changed them)."""
    _, problem, shape = family
    E.forget_timing_inputs()
    first, _ = E.timing_inputs(problem, shape)
    assert E.timing_inputs(problem, shape)[0] is first
    planted = Planted(problem, shape, "memo_o")
    with pytest.raises(E.GateViolation):
        E.check_timed(problem, shape, planted.launch_for, timer=cpu_timer(planted))
    assert E.timing_inputs(problem, shape)[0] is not first


def test_timing_sets_break_ties_with_an_earlier_set():
    """A family whose seeds can repeat an element (two-valued inputs here) still gets sets that differ everywhere."""

    class Coarse:
        def make_inputs(self, shape, seed, device="cpu", pattern="normal"):
            gen = torch.Generator().manual_seed(seed)
            return {"x": torch.randint(0, 2, (64,), generator=gen).to(torch.float16), "n": 64}

    sets = E.timing_sets(Coarse(), None, n=3)
    for i in range(3):
        for j in range(i):
            assert E.differing_elements(sets[i]["x"], sets[j]["x"]) == 64


def test_rotation_takes_turns_in_whole_cycles():
    """A Rotation launches its sets in turn; every count prepare_launches uses is rounded up to whole cycles."""
    calls = []
    rot = E.Rotation([lambda i=i: calls.append(i) for i in range(3)])
    for _ in range(7):
        rot()
    assert calls == [0, 1, 2, 0, 1, 2, 0] and len(rot) == 3
    assert [E._whole_cycles(n, 2) for n in (1, 2, 3, 10, 21)] == [2, 2, 4, 10, 22]


def test_the_perturbed_position_is_drawn_afresh(family):
    """problem.perturb at positions drawn from two generators changes different places, and its mask still marks
    exactly the rows that can see the change (checked by the dependency check passing a correct kernel)."""
    _, problem, shape = family
    inputs = problem.make_inputs(shape, 5)
    where = set()
    for seed in range(8):
        changed, must = E.perturbed(problem, shape, inputs, random.Random(seed))
        diff = tuple(tuple(int(i) for i in (changed[name] != inputs[name]).nonzero()[0][:3])
                     for name in changed if isinstance(changed[name], torch.Tensor)
                     and bool((changed[name] != inputs[name]).any()))
        where.add(diff)
        assert bool(must.any())
    assert len(where) > 1
    ok, detail = E.check_dependency(problem, shape, Planted(problem, shape).run_into, rng=random.Random(3))
    assert ok, detail


def test_the_audit_restores_the_last_set():
    """After the audit replay on a changed input, the last timing set is bitwise what it was (other contenders
    read it next)."""
    problem = on_cpu(get_problem("attention"))
    shape = problem.parse_shape(SHAPES["attention"])
    planted = Planted(problem, shape)
    sets = E.timing_sets(problem, shape)
    copies = [E.InputSnapshot(s) for s in sets]
    guarded = E.GuardedOutput(problem.new_output(sets[-1]))
    rotation = E.Rotation(planted.launch_for(s, guarded.out) for s in sets)
    E.audit_changed_input(problem, shape, guarded, sets, lambda: [rotation() for _ in sets], random.Random(1))
    assert all(c.changed(s) is None for c, s in zip(copies, sets))


# ------------------------------------------------------------------ the physical floor

CEIL = {"copy": {"gb_s": 3000.0}, "matmul": {"tflop_s": 700.0}, "empty_kernel": {"time_us": 1.6}}


def test_floor_is_launch_plus_the_larger_of_bytes_and_flops():
    """The mission shape's floor: 1.6 us of launch plus max(2 MiB at 3000 GB/s, 0.54 GFLOP at 700 TFLOP/s); the
    plausibility threshold gives the work ROOF_HEADROOM."""
    mission = get_problem("attention").parse_shape("mission")
    floor = floor_analysis(mission.flops(), mission.min_bytes(), CEIL)
    assert floor["bound"] == "compute" and floor["floor_us"] == pytest.approx(1.6 + mission.flops() / 700e6)
    assert 2.3 < floor["floor_us"] < 2.4
    assert floor["plausible_us"] == pytest.approx(1.6 + mission.flops() / 700e6 / ROOF_HEADROOM)


def test_judge_marks_a_time_below_the_floor_implausible():
    """An OK result timed below the floor becomes IMPLAUSIBLE with the numbers and no time; one at or above it
    stays OK and carries the floor; a result that is not OK is left as it is; the ceilings are measured once."""
    mission = get_problem("attention").parse_shape("mission")
    measured = []
    floors = Floors(lambda dtype: measured.append(dtype) or CEIL)
    fast = floors.judge(mission, Result(status=R.OK, time_us=1.76, timing={"median_us": 1.76}))
    assert fast.status == R.IMPLAUSIBLE and fast.time_us is None and not fast.ok
    assert fast.message.startswith("timed 1.76 us, below this shape's floor of 2.21 us on this GPU (an empty "
                                   "kernel's 1.6 us; compulsory bytes at 3000 GB/s 0.699 us; FLOPs at 700 TFLOP/s")
    assert fast.extra["implausible_time_us"] == 1.76
    real = floors.judge(mission, Result(status=R.OK, time_us=4.4))
    assert real.ok and real.extra["floor_us"] == pytest.approx(2.214, abs=1e-3)
    wrong = Result(status=R.WRONG, message="repeat: ...")
    assert floors.judge(mission, wrong) is wrong
    assert measured == ["fp16"]
    floors.judge(get_problem("attention").parse_shape("mission:bf16"), Result(status=R.OK, time_us=4.4))
    assert measured == ["fp16", "bf16"]


def test_implausible_is_a_status_never_best():
    """IMPLAUSIBLE is one of the recorded statuses and is not ok (only ok results can be best)."""
    assert R.IMPLAUSIBLE in R.STATUSES and not Result(status=R.IMPLAUSIBLE).ok
    assert implausible_reason(None, {"floor_us": 2.0}, CEIL) is None
