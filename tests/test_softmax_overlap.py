"""The Hopper kernel's consumer loop rotated (knob softmax_overlap, the traits' SOFTMAX_OVERLAP: kSoftmaxOverlap, profile
attention:hopper3-overlap).

Written as one iteration, ptxas schedules the wait for P(t-1) V(t-1) above tile t's softmax, so the softmax never ran
under the warpgroup's own P V; rotated, the wait opens the next iteration.

CPU: every softmax_overlap = false config keeps its source (attention-hopper3-rescale's, whose own test ties it to the
recorded runs); the knob is a traits template parameter and the rotated loop its `if constexpr` branches, no flag
left; in the SASS of false configs no
MUFU.EX2 lies between the wait for S and the wait for P V, in true configs the whole tile's exp2 do; the rotated
paths compile clean (no spill, no stack frame, wgmma not serialised). GPU (marked): the gate passes and the output is
bit for bit the false twin's (the same instructions in the same order), the log-sum-exp too; memcheck and racecheck
find nothing."""

from __future__ import annotations

import pytest
from _variant_pairs import (COMPILE_SHAPES, HOPPER_SHAPES, assert_compiles_clean, assert_gate_and_twin, assert_lse_twin,
                            assert_same_sources, assert_sanitizer_clean, compile_config, hopper_config_id,
                            serialised_notes, skip_unless_admitted)

from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import is_softmax_overlap
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", softmax_overlap=True)
# The exhaustive winners of gpt2 (one warpgroup, no producer, TMA store), llama-4k (two consumers, persistent, Q in
# registers) and long-8k (three consumers, persistent, Q in shared memory, lazy rescaling), and a ping-pong pair with
# 64-key tiles.
ROTATED_CONFIGS = [
    dict(_H, block_m=64, block_n=128, compute_warps=4, producer_warps=0, stages=2, q_in_regs=False, pingpong=False,
         persistent=False, epilogue="tma"),
    dict(_H, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=True, pingpong=False,
         persistent=True, epilogue="tma"),
    dict(_H, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False,
         pingpong=False, persistent=True, epilogue="regs", rescale="lazy"),
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=4, stages=3, q_in_regs=True, pingpong=True,
         persistent=False, epilogue="regs"),
]


def _written(cfg: dict) -> dict:
    """The twin with the loop as written before the knob."""
    return dict(cfg, softmax_overlap=False)


@pytest.fixture(scope="module")
def overlap_space():
    return load_builtin("attention-hopper3-overlap")


def test_every_written_config_keeps_its_source(attention, overlap_space):
    """Each softmax_overlap = false config of attention-hopper3-overlap.yaml on gpt2 instantiates to the source of the
    same config in attention-hopper3-rescale.yaml (tests/test_rescale.py ties those to the recorded runs); the space
    admits twice that space's 1920 configs there."""
    rescale_space = load_builtin("attention-hopper3-rescale")
    shape = parse_shape("gpt2")
    admitted = overlap_space.admitted_configs(attention.context(shape))
    written = [c for c in admitted if not c["softmax_overlap"]]
    assert len(written) == 1920 and len(admitted) == 3840
    assert_same_sources(attention, written, rescale_space, shape, drop="softmax_overlap")


def test_rotated_source(attention, overlap_space):
    """The knob is the traits' template parameter SOFTMAX_OVERLAP (kSoftmaxOverlap): the source defines finish_tile,
    calls it at the top of the loop and once after it under `if constexpr`, and keeps no flag; the false twin passes
    false. On mma.sync the knob selects nothing."""
    shape = parse_shape("gpt2")
    code = instantiate(attention, overlap_space.config(ROTATED_CONFIGS[0]), shape).code
    assert "auto finish_tile = [&](int u) {" in code and "/* SOFTMAX_OVERLAP = */ true," in code
    assert code.count("if constexpr (T::kSoftmaxOverlap) finish_tile(t - 1);") == 1
    assert code.count("if constexpr (T::kSoftmaxOverlap) finish_tile(n_tiles - 1);") == 1
    assert template_flag_names(code) == set()
    plain = instantiate(attention, overlap_space.config(_written(ROTATED_CONFIGS[0])), shape).code
    assert "/* SOFTMAX_OVERLAP = */ false," in plain
    assert is_softmax_overlap(overlap_space.config(ROTATED_CONFIGS[0]))
    assert not is_softmax_overlap(dict(mma="sync", softmax_overlap=True))


@pytest.mark.parametrize("cfg", ROTATED_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", ["gpt2", "llama-4k:bf16:causal"])
def test_sass_puts_the_softmax_under_p_v(attention, overlap_space, cfg, shape_text):
    """The measurable claim of the knob, read in the SASS: with the loop as written, no MUFU.EX2 lies between the wait
    for S (WARPGROUP.DEPBAR.LE gsb0, 0x1) and the next warpgroup wait, because ptxas moved the wait for P V up there;
    rotated, every exp2 of the tile's scores does (block_n per row pair, a thread's two rows)."""
    from evotune.build.sass import disassemble, exp2_under_wgmma

    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, overlap_space, shape, cfg, _written(cfg))
    counts = {}
    for c in (cfg, _written(cfg)):
        counts[c["softmax_overlap"]] = exp2_under_wgmma(disassemble(compile_config(attention, overlap_space, shape,
                                                                                    c)[2].cubin_path))
    assert counts[False] and set(counts[False]) == {0}, counts
    assert counts[True] and min(counts[True]) >= cfg["block_n"] // 2, counts


@pytest.mark.parametrize("cfg", ROTATED_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", COMPILE_SHAPES)
def test_rotated_configs_compile_clean(attention, overlap_space, cfg, shape_text):
    """Every rotated path compiles for sm_90a with no stack frame, no spill, within the static gate, and without ptxas
    serialising the wgmma."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, overlap_space, shape, cfg, _written(cfg))
    _, compiled, _ = assert_compiles_clean(attention, overlap_space, shape, cfg)
    assert not serialised_notes(compiled)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ROTATED_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", HOPPER_SHAPES)
def test_rotated_passes_the_gate_bit_for_bit(attention, overlap_space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit the false twin's: the rotation moves the loop's back edge,
    not an instruction's place in the order they run (one K/V tile, n_tiles = 1, included: 1,2,1,64)."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, overlap_space, shape, cfg, _written(cfg))
    assert_gate_and_twin(attention, overlap_space, shape, cfg, _written(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [ROTATED_CONFIGS[0], ROTATED_CONFIGS[2]], ids=hopper_config_id)
def test_rotated_with_log_sum_exp(attention, overlap_space, cfg):
    """The training variant (write_lse): O and the log-sum-exp bit for bit the false twin's."""
    shape = parse_shape("4,16,1333,1257,64:bf16:causal")  # 448 query tiles of 192 rows: the persistent grid too
    assert overlap_space.admitted(overlap_space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, overlap_space, shape, cfg, _written(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cfg", [ROTATED_CONFIGS[0], ROTATED_CONFIGS[1]], ids=hopper_config_id)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, overlap_space, cfg, tool):
    """memcheck and racecheck find nothing in the rotated loop on a ragged causal shape: the one-warpgroup config whose
    consumer thread refills the slots, and a persistent one with a producer warpgroup."""
    assert_sanitizer_clean(attention, overlap_space, parse_shape("2,3,197,300,64:causal"), cfg, tool)
