"""The gate's fp32 references are kept per (family, shape, seed, pattern) within a process (evaluate.case_reference):
computed once for a shape's candidates, from inputs no kernel has touched, and never for the perturbed inputs."""

from __future__ import annotations

import sys

import pytest
from _planted import CORRECT, Planted, on_cpu

from evotune.gpu import evaluate as E
from evotune.problems import get_problem

SHAPE = "1,2,40,56,64:bshd"


@pytest.fixture()
def counted(monkeypatch):
    """A CPU attention problem whose reference calls by the gate are counted (the planted correct kernel computes the
    reference too, as its answer: those calls are not the gate's), with an empty cache."""
    monkeypatch.setattr(E, "_REFERENCES", {})
    problem = on_cpu(get_problem("attention"))
    calls = []
    original = type(problem).reference

    def reference(self, shape, inputs):
        if sys._getframe(1).f_globals.get("__name__") == E.__name__:
            calls.append(inputs)
        return original(self, shape, inputs)

    monkeypatch.setattr(type(problem), "reference", reference)
    return problem, problem.parse_shape(SHAPE), calls


def test_second_candidate_pays_only_the_perturbed_reference(counted):
    problem, shape, calls = counted
    first = E.verify(problem, shape, Planted(problem, shape, CORRECT).run_into)
    n_first = len(calls)
    second = E.verify(problem, shape, Planted(problem, shape, CORRECT).run_into)
    assert first.passed and second.passed
    cases = len(E.gate_cases(problem))
    assert n_first == cases + 2  # every case, and the dependency check's two
    assert len(calls) - n_first == 1  # only the perturbed inputs' reference again: its position is drawn afresh
    assert (first.max_abs, first.gate_ratio) == (second.max_abs, second.gate_ratio)


def test_a_kernel_that_changes_its_inputs_cannot_change_the_kept_reference(counted):
    """input_mutation writes into its inputs: the gate catches it, and the next candidate is judged against the
    reference of the untouched inputs (it was computed before the first launch)."""
    problem, shape, _ = counted
    bad = E.verify(problem, shape, Planted(problem, shape, "input_mutation").run_into)
    assert not bad.passed
    fresh = {k: v for k, v in E._REFERENCES.items()}
    assert fresh, "the references of the cases drawn before the violation are kept"
    for key, ref in fresh.items():
        seed, pattern = key[-2], key[-1]
        inputs = problem.make_inputs(shape, seed, pattern=pattern)
        assert (type(problem).reference(problem, shape, inputs) == ref).all()
    assert E.verify(problem, shape, Planted(problem, shape, CORRECT).run_into).passed


def test_a_new_shape_drops_the_last_shapes_references(counted):
    problem, shape, _ = counted
    E.verify(problem, shape, Planted(problem, shape, CORRECT).run_into, dependency=False)
    other = problem.parse_shape("1,2,24,40,64:bshd")
    E.verify(problem, other, Planted(problem, other, CORRECT).run_into, dependency=False)
    assert {k[3] for k in E._REFERENCES} == {other}


def test_the_bound_keeps_nothing_past_it(counted, monkeypatch):
    problem, shape, calls = counted
    monkeypatch.setattr(E, "REFERENCE_CACHE_BYTES", 0)
    E.verify(problem, shape, Planted(problem, shape, CORRECT).run_into, dependency=False)
    n = len(calls)
    E.verify(problem, shape, Planted(problem, shape, CORRECT).run_into, dependency=False)
    assert len(calls) == 2 * n and not E._REFERENCES
