"""Conditional rescaling of O in the Hopper kernel (knob rescale = new_max or lazy, kernels/attention_hopper.cuh's
traits' RESCALE_SLACK, kRescaleSlackLog2, profile attention:hopper3-rescale).

CPU: the knob is a traits template parameter (-1 at always); a conditional config's source has its slack and the warp
vote under `if constexpr` and no flag left; its SASS branches around
exactly O's head_dim / 2 multiplies per thread behind a VOTE.ANY; the conditional paths compile clean for sm_90a (no
spill, no stack frame, wgmma not serialised). GPU (marked): every path passes the gate (whose large-score and
dominant-key inputs make rows take new maxima tile after tile); new_max's output is bit for bit always's, lazy's
close to it and yet not equal, the log-sum-exp too; memcheck and racecheck find nothing."""

from __future__ import annotations

import re

import pytest
from _variant_pairs import (COMPILE_SHAPES, HOPPER_SHAPES, assert_compiles_clean, assert_sanitizer_clean,
                            compile_config, hopper_config_id, run_configs, serialised_notes, skip_unless_admitted)

from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import rescale_slack_log2
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", rescale="lazy")
# The exhaustive winners of gpt2 (one warpgroup, no producer, TMA store), llama-4k (two consumers, persistent, Q in
# registers) and long-8k (three consumers, persistent, Q in shared memory), and a ping-pong pair with 64-key tiles.
LAZY_CONFIGS = [
    dict(_H, block_m=64, block_n=128, compute_warps=4, producer_warps=0, stages=2, q_in_regs=False, pingpong=False,
         persistent=False, epilogue="tma"),
    dict(_H, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=True, pingpong=False,
         persistent=True, epilogue="tma"),
    dict(_H, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False,
         pingpong=False, persistent=True, epilogue="regs"),
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=4, stages=3, q_in_regs=True, pingpong=True,
         persistent=False, epilogue="regs"),
]


def _eager(cfg: dict) -> dict:
    return dict(cfg, rescale="always")


def _new_max(cfg: dict) -> dict:
    return dict(cfg, rescale="new_max")


@pytest.fixture(scope="module")
def lazy_space():
    return load_builtin("attention-hopper3-rescale")


def test_rescale_is_a_traits_parameter(attention, lazy_space):
    """rescale is the traits' template parameter RESCALE_SLACK (kRescaleSlackLog2): -1 at always, 0 at new_max, 8 at
    lazy, so the three are three sources; the space admits 640 configs per value on gpt2."""
    shape = parse_shape("gpt2")
    admitted = lazy_space.admitted_configs(attention.context(shape))
    assert len(admitted) == 1920 and sum(c["rescale"] == "always" for c in admitted) == 640
    codes = [instantiate(attention, lazy_space.config(c), shape).code
             for c in (_eager(LAZY_CONFIGS[0]), _new_max(LAZY_CONFIGS[0]), LAZY_CONFIGS[0])]
    for code, slack in zip(codes, (-1, 0, 8)):
        assert f"/* RESCALE_SLACK = */ {slack}," in code
    assert len(set(codes)) == 3


def test_conditional_source(attention, lazy_space):
    """A lazy or new_max config's source keeps a row's max unless it grew by more than its slack (2^8 or 2^0), the
    traits' parameter, and puts O's rescaling behind a warp vote (both under kLazyRescale); no flag is left. The always
    twin passes -1."""
    shape = parse_shape("gpt2")
    for cfg, slack in ((LAZY_CONFIGS[0], 8), (_new_max(LAZY_CONFIGS[0]), 0)):
        code = instantiate(attention, lazy_space.config(cfg), shape).code
        assert f"/* RESCALE_SLACK = */ {slack}," in code
        assert "if constexpr (T::kLazyRescale) {" in code
        assert "const bool grown = (mx - m[r]) * scale_log2 > static_cast<float>(T::kRescaleSlackLog2);" in code
        assert "alpha[r] = grown ? fast_exp2((m[r] - mx) * scale_log2) : 1.f;" in code
        assert "if (!T::kLazyRescale || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {" in code
        assert template_flag_names(code) == set()
        assert rescale_slack_log2(lazy_space.config(cfg)) == slack
    plain = instantiate(attention, lazy_space.config(_eager(LAZY_CONFIGS[0])), shape).code
    assert "/* RESCALE_SLACK = */ -1," in plain
    assert rescale_slack_log2(lazy_space.config(_eager(LAZY_CONFIGS[0]))) is None
    # The knob is the Hopper kernel's: on mma.sync it selects nothing.
    assert rescale_slack_log2(dict(mma="sync", rescale="lazy")) is None


_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _rescale_branches(sass: str) -> list[int]:
    """The length of each run of code that a predicated forward branch skips when that code is FMULs only (O's
    rescaling; ptxas may hoist the vote that sets the predicate well above the branch, into the softmax)."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in _LINE.finditer(sass)]
    skipped = []
    for addr, text in lines:
        branch = re.match(r"@!?P\d+ BRA (?:`\()?\S*?0x([0-9a-f]+)", text)
        if not branch or int(branch.group(1), 16) <= addr:
            continue
        body = [t for a, t in lines if addr < a < int(branch.group(1), 16)]
        if body and all(t.startswith("FMUL ") for t in body):
            skipped.append(len(body))
    return skipped


@pytest.mark.parametrize("cfg,shape_text", [(LAZY_CONFIGS[0], "gpt2"), (LAZY_CONFIGS[1], "llama-4k")],
                         ids=["d64", "d128"])
def test_sass_branches_around_the_rescale(attention, lazy_space, cfg, shape_text):
    """The lazy and new_max SASS have a VOTE.ANY and a branch over exactly O's head_dim / 2 FMULs per thread in the loop
    (the peeled first tile's O is zero: ptxas selects there instead); the always SASS branches over no run of
    multiplies."""
    from evotune.build.sass import disassemble

    shape = parse_shape(shape_text)
    found = {}
    for c in (cfg, _new_max(cfg), _eager(cfg)):
        _, _, compiled = compile_config(attention, lazy_space, shape, c)
        sass = disassemble(compiled.cubin_path)
        found[c["rescale"]] = _rescale_branches(sass)
        assert ("VOTE.ANY" in sass) == (c["rescale"] != "always")
    for conditional in ("lazy", "new_max"):
        assert found[conditional] and set(found[conditional]) == {shape.head_dim // 2}, found
    assert not found["always"], found


@pytest.mark.parametrize("cfg", LAZY_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", COMPILE_SHAPES)
def test_lazy_configs_compile_clean(attention, lazy_space, cfg, shape_text):
    """Every lazy path compiles for sm_90a with no stack frame, no spill, within the static gate, and without ptxas
    serialising the wgmma (the branch sits between the products' wait and their next issue)."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, lazy_space, shape, cfg, _eager(cfg))
    _, compiled, _ = assert_compiles_clean(attention, lazy_space, shape, cfg)
    assert not serialised_notes(compiled)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", LAZY_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", HOPPER_SHAPES)
def test_lazy_passes_the_gate_near_its_eager_twin(attention, lazy_space, cfg, shape_text):
    """The full gate passes for lazy and new_max (its large-score and dominant-key inputs move rows' maxima by far more
    than 2^8 between tiles, so the rescaling branch runs too). On normal inputs new_max's output is bit for bit the
    always twin's, and lazy's within a few 16-bit units of it: P differs from the twin's by a factor of at most 2^8 per
    row, so its 16-bit rounding differs by one unit of each weight and O's by one. On the longer shapes lazy's output
    differs (a knob that changed nothing would leave them equal)."""
    import torch

    from evotune.gpu.evaluate import evaluate_compiled
    from evotune.records import result as R

    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, lazy_space, shape, cfg, _eager(cfg))
    for c in (cfg, _new_max(cfg)):
        _, _, compiled = compile_config(attention, lazy_space, shape, c)
        res = evaluate_compiled(attention, shape, lazy_space.config(dict(c)), compiled, time_it=False)
        assert res.status == R.OK, res.message
    (out, twin, new_max), _, inputs = run_configs(attention, lazy_space, shape, (cfg, _eager(cfg), _new_max(cfg)))
    assert torch.equal(new_max, twin)
    assert torch.isfinite(out.float()).all()
    unit = 2.0 ** (-8 if shape.dtype == "bf16" else -11)
    bound = 4 * unit * float(inputs["v"].float().abs().max()) + 2 * unit * twin.float().abs() + 1e-6
    diff = (out.float() - twin.float()).abs()
    assert bool(diff.le(bound).all()), f"max difference {float(diff.max()):.3g}"
    if shape.seq_k >= 1000:
        assert not torch.equal(out, twin)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [LAZY_CONFIGS[0], LAZY_CONFIGS[2]], ids=hopper_config_id)
def test_lazy_with_log_sum_exp(attention, lazy_space, cfg):
    """The training variant (write_lse): m and l stay relative to the same (stale) max, so the log-sum-exp is the
    always twin's within fp32 rounding of the row sum, and finite; new_max's is the twin's bit for bit."""
    import torch

    shape = parse_shape("4,16,1333,1257,64:bf16:causal")  # 448 query tiles of 192 rows: the persistent grid too
    assert lazy_space.admitted(lazy_space.config(cfg), attention.context(shape))
    _, (lse, twin_lse, new_max_lse), _ = run_configs(attention, lazy_space, shape,
                                                     (cfg, _eager(cfg), _new_max(cfg)), lse=True)
    assert torch.isfinite(lse).all() and torch.equal(new_max_lse, twin_lse)
    assert float((lse - twin_lse).abs().max()) <= 1e-5


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, lazy_space, tool):
    """memcheck and racecheck find nothing in a lazy persistent config on a ragged causal shape."""
    assert_sanitizer_clean(attention, lazy_space, parse_shape("2,3,197,300,64:causal"), LAZY_CONFIGS[1], tool)
