"""The 256-row tile: four consumer warpgroups (block_m 256, compute_warps 16; the Hopper traits' CONSUMER_WGS = 4,
profile attention:hopper3-wg4).

With the producer warpgroup a CTA has 640 threads, so the launch allocates 96 registers a thread (65536 / 640, rounded
down to 8) and setmaxnreg splits them 24 (producer) / 112 (consumers). setmaxnreg.inc only takes what the CTA's own
setmaxnreg.dec freed: a split above the launch's allocation (the first try, 120 a consumer) waits forever, which hung
the H100. The static gate now refuses such a kernel before it runs (LaunchGeometry.register_split).

CPU: every config of attention-hopper3-wg4 below 256 rows keeps the source attention-hopper3-skip's searches measured;
the admission (256 rows only as four warpgroups, at most 128 keys, never mma.sync); the traits' register split, and
Python's copy of every split, against the kernel's text; the static gate's split check; clean compiles. GPU (marked):
the gate passes and the output is bit for bit the 128-row twin's (same knobs, two warpgroups: each row comes out of the
same instructions) on the head-dim-64 Hopper test shapes and on ragged persistent ones, with a handful of SMs too; the
log-sum-exp; memcheck and racecheck find nothing."""

from __future__ import annotations

import re

import pytest
from _variant_pairs import (HOPPER_SHAPES, assert_compiles_clean, assert_lse_twin, assert_same_sources,
                            assert_sanitizer_clean, assert_twin_where_admitted, hopper_config_id, serialised_notes,
                            skip_unless_admitted)

from evotune.build.compile import Resources, static_violations
from evotune.build.template import instantiate
from evotune.problems.attention import SETMAXNREG_SPLIT, setmaxnreg_registers
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", rescale="lazy", softmax_overlap=True, lean_addressing=True, pingpong=False, block_m=256,
          compute_warps=16, block_n=64)
# gpt2's winner (persistent, Q in shared memory, TMA-store epilogue, 3 stages: runs/gpt2-h100-exhaustive-wg4), its
# one-tile grid, the tile without a producer (a consumer thread refills the slots; no setmaxnreg, 128 registers) with
# Q in registers, and Q in registers with P from shared memory (held in registers, P spills beside Q).
WG4_CONFIGS = [
    dict(_H, producer_warps=4, stages=3, q_in_regs=False, persistent=True, epilogue="tma"),
    dict(_H, producer_warps=4, stages=4, q_in_regs=False, persistent=False, epilogue="regs"),
    dict(_H, producer_warps=0, stages=4, q_in_regs=True, persistent=False, epilogue="tma"),
    dict(_H, producer_warps=4, stages=2, q_in_regs=True, persistent=True, epilogue="regs", p_operand="smem"),
]
# The four-warpgroup tile compiles without a spill at head dim 64 only (at 128, O's 64 accumulators spill).
D64_SHAPES = [s for s in HOPPER_SHAPES if parse_shape(s).head_dim == 64]
# Ragged shapes with more 256-row tiles than SMs (persistent CTAs walk several, the last of a head partly padding).
PERSISTENT_SHAPES = ["2,40,1000,64", "1,70,600,700,64:bf16:causal"]


def _two_warpgroups(cfg: dict) -> dict:
    """The 128-row twin: the same knobs with two consumer warpgroups."""
    return dict(cfg, block_m=128, compute_warps=8)


@pytest.fixture(scope="module")
def wg4_space():
    return load_builtin("attention-hopper3-wg4")


def test_configs_below_256_rows_keep_their_source(attention, wg4_space):
    """Each config of attention-hopper3-wg4.yaml with at most three warpgroups, on gpt2 and on a ragged causal shape,
    instantiates to the source of the same config in attention-hopper3-skip.yaml (whose test ties it to the runs)."""
    skip = load_builtin("attention-hopper3-skip")
    for shape in (parse_shape("gpt2"), parse_shape("2,16,1088,1024,64:causal")):
        admitted = wg4_space.admitted_configs(attention.context(shape))
        below = [c for c in admitted if c["block_m"] < 256]
        assert len(below) == len(skip.admitted_configs(attention.context(shape)))
        assert_same_sources(attention, below, skip, shape)


def test_admission(attention, space, wg4_space):
    """256 rows only as four warpgroups and at most 128 keys (a 176-key S tile does not fit 112 registers: ptxas C7602);
    132 configs on gpt2; mma.sync never."""
    ctx = attention.context(parse_shape("gpt2"))
    wg4 = [c for c in wg4_space.admitted_configs(ctx) if c["block_m"] == 256]
    assert len(wg4) == 132
    assert {c["compute_warps"] for c in wg4} == {16} and {c["block_n"] for c in wg4} == {32, 64, 128}
    assert space.violations(space.config(dict(WG4_CONFIGS[0], block_n=176)), ctx)
    assert space.violations(space.config(dict(WG4_CONFIGS[0], compute_warps=12)), ctx)
    assert space.violations(space.config({"mma": "sync", "block_m": 256, "compute_warps": 16}), ctx)
    assert not space.violations(space.config(WG4_CONFIGS[0]), ctx)


def _c_value(text: str, names: dict) -> int:
    """A traits expression over the traits' own parameters (`kConsumerWGs == 3 || (kStripeMirror && ...) ? 32 : 24`),
    evaluated: C's right-associative `c ? a : b`, `||`, `&&` and `==` over the parameters' values in `names`."""
    text = text.strip()
    if text.startswith("(") and _closing(text) == len(text) - 1:
        return _c_value(text[1:-1], names)
    depth = 0
    for i, ch in enumerate(text):  # the first top-level `?` splits the condition from its branches
        depth += ch == "("
        depth -= ch == ")"
        if ch == "?" and depth == 0:
            cond, rest = text[:i], text[i + 1:]
            parens = pending = 0
            for j, c2 in enumerate(rest):  # its `:` is the first top-level one not owed to a nested `?`
                parens += (c2 == "(") - (c2 == ")")
                if parens == 0 and c2 == "?":
                    pending += 1
                elif parens == 0 and c2 == ":":
                    if pending == 0:
                        a, b = rest[:j], rest[j + 1:]
                        break
                    pending -= 1
            else:
                raise ValueError(f"no ':' for the '?' in {text!r}")
            return _c_value(a, names) if _c_value(cond, names) else _c_value(b, names)
    python = text.replace("||", " or ").replace("&&", " and ").replace("true", "True").replace("false", "False")
    return int(eval(python, {"__builtins__": {}}, names))  # noqa: S307 (the kernel's own traits text, in a test)


def _closing(text: str) -> int:
    """The index of the parenthesis that closes text[0]'s."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return i
    return -1


def _live_split(code: str) -> tuple[int, int]:
    """The (producer, consumer) setmaxnreg registers a HopperTraits instantiation declares, for its parameters."""
    names = {"kConsumerWGs": int(re.search(r"/\* CONSUMER_WGS = \*/ (\d+)", code).group(1)),
             "kStripeMirror": re.search(r"/\* STRIPE_MIRROR = \*/ (\w+)", code).group(1) == "true"}
    producer = re.search(r"static constexpr int kProducerRegs = (.+);", code).group(1)
    consumer = re.search(r"static constexpr int kConsumerRegs = (.+);", code).group(1)
    return _c_value(producer, names), _c_value(consumer, names)


@pytest.mark.parametrize("wgs", [2, 3, 4])
def test_the_register_split_is_the_kernels(attention, space, wgs):
    """Python's SETMAXNREG_SPLIT (the static gate's figure) is what the traits derive for two, three and four consumer
    warpgroups (one expression of CONSUMER_WGS, no flagged line)."""
    cfg = space.config(dict(WG4_CONFIGS[0], block_m=64 * wgs, compute_warps=4 * wgs))
    code = instantiate(attention, cfg, parse_shape("gpt2")).code
    assert _live_split(code) == SETMAXNREG_SPLIT[wgs]
    assert setmaxnreg_registers(cfg) == 128 * SETMAXNREG_SPLIT[wgs][0] + 128 * wgs * SETMAXNREG_SPLIT[wgs][1]
    assert "//[wg4]" not in code and "#if 0" not in code.split("struct HopperTraits")[1].split("};")[0]


def test_no_split_without_a_producer(attention, space):
    """No producer (or one consumer warpgroup, or mma.sync): no setmaxnreg, so nothing for the static gate to check."""
    assert setmaxnreg_registers(space.config(WG4_CONFIGS[2])) == 0
    assert setmaxnreg_registers(space.config(dict(WG4_CONFIGS[0], block_m=64, compute_warps=4))) == 0
    assert setmaxnreg_registers(space.config({"mma": "sync"})) == 0


def test_the_static_gate_refuses_a_split_above_the_launch():
    """640 threads at 96 registers allocate 61440: the 24/112 split (60416) passes; 24/120 (64512, the split that hung
    the H100) is refused, as is 24/112 where ptxas allocated 88."""
    res = Resources(registers=96, static_smem=0, stack_frame=0, spill_stores=0, spill_loads=0, barriers=1)
    assert static_violations(res, 640, 100_000, 128 * 24 + 512 * 112) == []
    why = static_violations(res, 640, 100_000, 128 * 24 + 512 * 120)
    assert len(why) == 1 and "setmaxnreg.inc would wait forever" in why[0] and "61440" in why[0]
    fewer = Resources(registers=88, static_smem=0, stack_frame=0, spill_stores=0, spill_loads=0, barriers=1)
    assert static_violations(fewer, 640, 100_000, 128 * 24 + 512 * 112)


@pytest.mark.parametrize("cfg", WG4_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", ["gpt2", "2,3,300,333,64:bf16:causal:bshd"] + PERSISTENT_SHAPES)
def test_wg4_configs_compile_clean(attention, space, cfg, shape_text):
    """sm_90a, no spill, within the static gate (the launch's 96 registers hold the split), no wgmma serialised."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, space, shape, cfg, _two_warpgroups(cfg))
    _, compiled, geo = assert_compiles_clean(attention, space, shape, cfg)
    assert not serialised_notes(compiled)
    assert geo.threads == 512 + 32 * cfg["producer_warps"]
    if cfg["producer_warps"]:
        assert compiled.resources.registers == 96 and geo.register_split == 60416


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", WG4_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", D64_SHAPES + PERSISTENT_SHAPES)
def test_wg4_passes_the_gate_bit_for_bit(attention, space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit the two-warpgroup twin's."""
    assert_twin_where_admitted(attention, space, shape_text, cfg, _two_warpgroups(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("shape_text", PERSISTENT_SHAPES)
def test_wg4_on_few_sms(attention, space, shape_text, monkeypatch):
    """A persistent grid of 5 CTAs (EVOTUNE_SM_COUNT): each walks a dozen or more 256-row tiles."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "5")
    cfg = WG4_CONFIGS[0]
    assert_twin_where_admitted(attention, space, shape_text, cfg, _two_warpgroups(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [WG4_CONFIGS[0], WG4_CONFIGS[2]], ids=hopper_config_id)
def test_wg4_with_log_sum_exp(attention, space, cfg):
    """The training variant (write_lse): O and the log-sum-exp bit for bit the twin's."""
    shape = parse_shape("2,16,1088,1024,64:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, space, shape, cfg, _two_warpgroups(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cfg", [WG4_CONFIGS[1], WG4_CONFIGS[2]], ids=hopper_config_id)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, space, cfg, tool):
    """memcheck and racecheck find nothing on a ragged causal shape: the tile with a producer, and the one whose
    consumer thread refills the slots."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,300,333,64:causal"), cfg, tool)
