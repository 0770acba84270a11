"""A share of the softmax's exp2 on the FMA pipe (knob exp2_fma, kernels/attention_exp2_fma.cuh).

CPU: the header's polynomial, evaluated in fp32 as the kernel does (its coefficients read from the header), keeps the
relative error the header states on every x the softmax gives it, gives exactly 0 where ex2.approx.ftz flushes (a
masked score's -inf included) and a NaN for a NaN; the share is a traits template parameter; the SASS trades
exactly that share of MUFU instructions for the polynomial; every path compiles for sm_90a without spills; the space's constraints. GPU (marked): every path passes
the gate, is deterministic, and stays within the polynomial's error of the same config with every exp2 on the MUFU
(the log-sum-exp too)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from _variant_pairs import assert_compiles_clean, assert_sanitizer_clean, compile_config, run_configs

from evotune.build.template import instantiate
from evotune.problems.attention import exp2_fma_eighths
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

HEADER = Path(__file__).resolve().parents[1] / "kernels" / "attention_exp2_fma.cuh"
STATED_RELATIVE_ERROR = 7.5e-5  # the header's bound, also in search_spaces/attention.yaml's doc of the knob

_W = dict(mma="sync", kv_load="tma", smem_layout="swizzle", producer_warps=0, q_in_regs=True, kv_splits=1)
# The previous mission winner (runs/mission-h100-exhaustive-small-split) at two eighths, this knob's search winner
# (runs/mission-h100-exhaustive-small-exp2), cp.async loads with gather's merge and Q from shared memory, causal key
# groups of 4, and the smallest tile (16 keys a warp: two eighths only).
EXP2_CONFIGS = [
    dict(_W, block_m=32, block_n=128, compute_warps=4, stages=4, warp_key_groups=2, key_merge="split", pdl=True,
         exp2_fma=2),
    dict(_W, block_m=32, block_n=128, compute_warps=4, stages=3, warp_key_groups=2, key_merge="split", pdl=True,
         kv_load="tma_split", exp2_fma=1),
    dict(_W, block_m=64, block_n=64, compute_warps=4, stages=2, warp_key_groups=1, kv_load="cp_async",
         q_in_regs=False, smem_layout="pad", exp2_fma=1),
    dict(_W, block_m=64, block_n=128, compute_warps=8, stages=3, warp_key_groups=4, kv_load="cp_async", exp2_fma=1),
    dict(_W, block_m=16, block_n=32, compute_warps=2, stages=2, warp_key_groups=2, kv_load="cp_async", exp2_fma=2),
]


def _id(c: dict) -> str:
    return (f"M{c['block_m']}N{c['block_n']}cw{c['compute_warps']}kg{c['warp_key_groups']}{c['kv_load']}"
            f"st{c['stages']}e{c['exp2_fma']}")


def _on_mufu(cfg: dict) -> dict:
    return dict(cfg, exp2_fma=0)


def _header_poly():
    """(clamp, magic, coefficients c3, c2, c1, c0, exponent bias bits) as the header's exp2_poly writes them (the clamp
    as max.NaN's hex operand)."""
    body = HEADER.read_text().split("float exp2_poly(float x) {", 1)[1].split("\n}", 1)[0]
    clamp = np.array([int(re.search(r"max\.NaN\.f32 %0, %0, 0f([0-9A-F]{8});", body).group(1), 16)],
                     dtype=np.uint32).view(np.float32)[0]
    magic, _neg_magic, c3, c2, c1, c0 = (np.float32(v) for v in re.findall(r"(-?\d+\.\d*)f\b", body))
    bias = np.uint32(int(re.search(r"\+ (0x[0-9A-F]+)u\)", body).group(1), 16))
    return clamp, magic, (c3, c2, c1, c0), bias


def exp2_poly_fp32(x: np.ndarray) -> np.ndarray:
    """The header's exp2_poly, step for step in fp32 (round-to-nearest adds, fused multiply-adds, the exponent add on
    the bits)."""
    clamp, magic, (c3, c2, c1, c0), bias = _header_poly()
    x = x.astype(np.float32)
    x = np.where(np.isnan(x), x, np.maximum(x, clamp))  # max.NaN
    rounded = (x + magic).astype(np.float32)
    j = (rounded - magic).astype(np.float32)
    f = (x - j).astype(np.float32)
    p = (np.float64(c3) * f + c2).astype(np.float32)  # one rounding per fmaf, as the float64 product is exact
    p = (np.float64(p) * f + c1).astype(np.float32)
    p = (np.float64(p) * f + c0).astype(np.float32)
    two_j = ((rounded.view(np.uint32) << np.uint32(23)) + bias).astype(np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        return (p * two_j).astype(np.float32)


def test_polynomial_error_is_what_the_header_states():
    """Over x in [-125, 0] (every exponent whose 2^x is a normal float on both sides of the step), 2^x to within the
    stated relative error and no better than 1e-5 (a real degree-3 polynomial, not ex2 itself); below -126.5, and
    at -inf (a masked score), exactly 0, as ex2.approx.ftz's flush; a NaN stays a NaN."""
    rng = np.random.default_rng(0)
    x = np.concatenate([-rng.random(2_000_000) * 125, -rng.random(100_000), np.arange(-125, 1), [-0.5, -1.5]])
    got = exp2_poly_fp32(x).astype(np.float64)
    rel = np.abs(got / np.exp2(x.astype(np.float32).astype(np.float64)) - 1)
    assert 1e-5 < rel.max() <= STATED_RELATIVE_ERROR, rel.max()
    assert np.all(exp2_poly_fp32(np.array([-126.51, -126.7, -127, -300, -np.inf], dtype=np.float32)) == 0)
    assert 0 < exp2_poly_fp32(np.array([-126.0], dtype=np.float32))[0] < 2.0 ** -125
    assert np.isnan(exp2_poly_fp32(np.array([np.nan], dtype=np.float32))[0])
    assert math.isclose(float(STATED_RELATIVE_ERROR), 7.5e-5) and "7.5e-5" in HEADER.read_text()


def test_share_source(attention, space):
    """The share is the traits' template parameter EXP2_FMA (kExp2FmaEighths): the source inlines the header (no include
    left) ahead of the softmax and computes both scores of each pair through exp2_mixed, which at 0 is fast_exp2; no
    flag is left."""
    shape = parse_shape("mission")
    code = instantiate(attention, space.config(EXP2_CONFIGS[0]), shape).code
    assert "// ---- begin attention_exp2_fma.cuh" in code and '#include "' not in code
    assert code.index("__device__ __forceinline__ float exp2_poly") < code.index("void online_softmax(")
    assert code.count("= exp2_mixed<T>(2 * nf") == 2
    assert "/* EXP2_FMA = */ 2," in code and not re.search(r"^\s*//\[\w+\]", code, re.M)
    plain = instantiate(attention, space.config(_on_mufu(EXP2_CONFIGS[0])), shape).code
    assert "/* EXP2_FMA = */ 0," in plain
    assert exp2_fma_eighths(space.config(EXP2_CONFIGS[1])) == 1


@pytest.mark.parametrize("cfg", EXP2_CONFIGS[:2], ids=_id)
def test_sass_moves_that_share_off_the_mufu(attention, space, cfg):
    """The loop body's 32 ex2 of a warp's 64 keys (two 16-row halves of 16 scores) lose exactly exp2_fma/8 of
    themselves to the polynomial: MUFU instructions drop by 4 per eighth, and each moved one costs three FADD, three
    FFMA and the FMUL by 2^j."""
    from evotune.build.sass import disassemble, opcode_counts

    shape = parse_shape("mission")
    counts = []
    for c in (_on_mufu(cfg), cfg):
        _, _, compiled = compile_config(attention, space, shape, c)
        counts.append(opcode_counts(disassemble(compiled.cubin_path)))
    (plain, share), moved = counts, 4 * cfg["exp2_fma"]
    assert plain["MUFU"] - share["MUFU"] == moved
    assert share["FADD"] - plain["FADD"] == 3 * moved and share["FFMA"] - plain["FFMA"] == 3 * moved
    assert share["FMUL"] - plain["FMUL"] == moved


@pytest.mark.parametrize("cfg", EXP2_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", ["mission", "2,3,300,333,64:bf16:causal:bshd", "1,2,200,128:causal"])
def test_share_configs_compile_clean(attention, space, cfg, shape_text):
    """Every path compiles for sm_90a with no stack frame, no spill and within the static gate."""
    shape = parse_shape(shape_text)
    if not space.admitted(space.config(cfg), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    assert_compiles_clean(attention, space, shape, cfg)


def test_constraints(attention, space):
    """exp2_fma is admitted on mma.sync only, and one eighth only with 32 keys or more a warp (8 scores a row and
    thread; with fewer, one eighth and two put the same scores on the FMA pipe); the Hopper kernel still compiles it
    (tools/time_configs.py measured it there: docs/PERFORMANCE.md)."""
    shape = parse_shape("mission")
    ctx = attention.context(shape)
    for cfg in EXP2_CONFIGS:
        assert not space.violations(space.config(cfg), ctx), cfg
    assert space.violations(space.config(dict(EXP2_CONFIGS[4], exp2_fma=1)), ctx)
    hopper = dict(mma="wgmma", block_m=128, block_n=64, compute_warps=8, stages=4, epilogue="tma", exp2_fma=2)
    assert space.violations(space.config(hopper), ctx) and not space.violations(space.config(_on_mufu(hopper)), ctx)
    config, src, compiled = compile_config(attention, space, parse_shape("gpt2"), hopper)
    assert src.code.count("= exp2_mixed<T>(2 * j") == 2 and "/* EXP2_FMA = */ 2," in src.code
    assert compiled.resources.spill_stores == 0


# --------------------------------------------------------------------------- GPU

SHAPES = ["mission", "2,3,200,333,64", "2,4,257,64:bshd", "1,4,1000,64:bf16:causal", "3,2,77,300,64:causal",
          "1,8,512,64:causal:kv4", "1,2,1,64", "1,2,300,128:causal"]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", EXP2_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", SHAPES)
def test_share_passes_the_gate_near_its_mufu_twin(attention, space, cfg, shape_text):
    """The full gate passes (stray writes, unwritten output, perturbations, determinism), and the output is within
    the polynomial's error of the same config with every exp2 on the MUFU: each weight of a row off by at most 7.5e-5
    of itself moves O by at most 1.5e-4 of max |V|; P's rounding to 16 bits may then differ by one unit (2^-10 or
    2^-7 of each weight), and O's by one each. On the mission shape the two outputs differ (a share that changed
    nothing would leave them equal)."""
    import torch

    from evotune.gpu.evaluate import evaluate_compiled
    from evotune.records import result as R

    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    if not space.admitted(config, attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    _, _, compiled = compile_config(attention, space, shape, cfg)
    res = evaluate_compiled(attention, shape, config, compiled, time_it=False)
    assert res.status == R.OK, res.message
    (out, twin), _, inputs = run_configs(attention, space, shape, (cfg, _on_mufu(cfg)))
    assert torch.isfinite(out.float()).all()
    unit = 2.0 ** (-8 if shape.dtype == "bf16" else -11)  # the 16-bit format's unit roundoff
    bound = (1.5e-4 + 2 * unit) * float(inputs["v"].float().abs().max()) + 2 * unit * twin.float().abs() + 1e-6
    diff = (out.float() - twin.float()).abs()
    assert bool(diff.le(bound).all()), f"max difference {float(diff.max()):.3g}"
    if shape_text == "mission":
        assert not torch.equal(out, twin)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [EXP2_CONFIGS[2], EXP2_CONFIGS[3]], ids=_id)
def test_share_with_log_sum_exp(attention, space, cfg):
    """The training variant (write_lse): the log-sum-exp within 1.5e-4 of the MUFU twin's (the row sum's relative
    error, on a natural log), finite."""
    import torch

    shape = parse_shape("2,3,333,257,64:bf16:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    _, (lse, twin_lse), _ = run_configs(attention, space, shape, (cfg, _on_mufu(cfg)), lse=True)
    assert torch.isfinite(lse).all()
    assert float((lse - twin_lse).abs().max()) <= 1.5e-4


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, space, tool):
    """memcheck and racecheck find nothing in this knob's mission winner, on a ragged causal shape."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,197,300,64:causal"), EXP2_CONFIGS[1], tool)
