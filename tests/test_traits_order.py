"""The order of the traits' template parameters is what AttentionProblem.template_args passes them in.

The instantiation writes positional template arguments with a comment naming each (`/* STAGES = */ 2`);
the compiler reads only the positions. Two ints swapped in template_args (say STAGES and PRODUCER_WARPS)
would still compile and run another kernel than the one the config names, so this parses the traits'
declarations from the kernel templates and compares names and order (and bool/int kinds)."""

from __future__ import annotations

import re

import pytest

from evotune.problems import get_problem
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin
from evotune.build.template import read_template

ATTENTION = get_problem("attention")


def declared_parameters(filename: str, struct: str) -> list[tuple[str, str]]:
    """(kind, NAME) of `template <...> struct <struct>` in a kernel template, the trailing underscore dropped."""
    _, text = read_template(filename)
    match = re.search(r"template\s*<([^>]*)>\s*struct\s+" + struct + r"\b", text)
    assert match, f"{struct} not declared in {filename}"
    params = [p.split("=")[0].split() for p in match.group(1).replace("\n", " ").split(",")]
    return [(kind, name.rstrip("_")) for kind, name in params]


def defaulted_parameters(filename: str, struct: str) -> set[str]:
    """The NAMEs of `struct`'s template parameters that have a default (a trailing feature that only some shapes
    pass: attention's SOFTCAP and LOCAL, so that every other shape's source stays what it was)."""
    _, text = read_template(filename)
    match = re.search(r"template\s*<([^>]*)>\s*struct\s+" + struct + r"\b", text)
    return {p.split("=")[0].split()[1].rstrip("_") for p in match.group(1).replace("\n", " ").split(",") if "=" in p}


@pytest.mark.parametrize("space, struct", [("attention", "AttnTraits"), ("attention-hopper", "HopperTraits")])
@pytest.mark.parametrize("spec", ["1,8,512,64", "2,4,300,128:bf16:causal"])
def test_template_args_follow_the_declared_order(space, struct, spec):
    declared = declared_parameters("attention.cu", struct)
    passed = ATTENTION.template_args(load_builtin(space).default_config(), parse_shape(spec))
    # Every parameter passed, in the declared order; the ones left out are trailing ones with a default.
    assert [name for _, name in declared][:len(passed)] == [name for name, _ in passed]
    assert {name for _, name in declared[len(passed):]} <= defaulted_parameters("attention.cu", struct)
    for (kind, name), (_, value) in zip(declared, passed):
        is_bool = value in ("true", "false")
        assert (kind == "bool") == is_bool, f"{struct}::{name} is {kind}, passed {value!r}"


def test_softcap_and_window_shapes_pass_every_hopper_parameter_in_order():
    """A soft-capped, windowed shape with sinks passes the trailing defaulted parameters too, in their declared places;
    without sinks it stops before SINKS (its default, false), so softcap and window kernels keep their source."""
    declared = [name for _, name in declared_parameters("attention.cu", "HopperTraits")]
    config = load_builtin("attention-hopper").default_config()
    passed = ATTENTION.template_args(config, parse_shape("2,4,300,128:bf16:softcap=30:window=64,0:sinks"))
    assert declared == [name for name, _ in passed]
    assert dict(passed)["SOFTCAP"] == "true" and dict(passed)["LOCAL"] == "true" and dict(passed)["SINKS"] == "true"
    unsunk = ATTENTION.template_args(config, parse_shape("2,4,300,128:bf16:softcap=30:window=64,0"))
    assert declared[-1] == "SINKS" and declared[:-1] == [name for name, _ in unsunk]
