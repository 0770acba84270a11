"""Empty consumer warpgroups of a ragged last query tile computed or skipped (knob empty_warpgroups,
the traits' SKIP_EMPTY: kSkipEmpty, profile attention:hopper3-skip).

At seq_q 1024 a 192-row tile leaves the last query tile of every head 64 rows and 128 rows of padding: with compute,
two of its three consumer warpgroups run the whole K/V loop on zero rows whose output is discarded (12.5% more tensor
work over the launch). With skip such a warpgroup only gives the Q and K/V barriers their arrivals, and a persistent
grid hands its tiles out from tile_counter (in the same order), so that CTAs that draw cheap tiles take more. Rows past
seq_q are never written either way and each tile's rows come out of the same instructions, so the output is bit for bit
compute's.

CPU: every compute config keeps the source attention-hopper3-tiles's searches measured; skip is admitted exactly where
a warpgroup is empty, never with ping-pong; skip's source walks the barriers for such a warpgroup and hands persistent
tiles out; the non-causal persistent skip grid takes the two tile counters; clean compiles. GPU (marked): the gate passes and
the output is bit for bit compute's, on the Hopper test shapes and on shapes where persistent CTAs walk several tiles,
thin ones among them, with a handful of SMs; the log-sum-exp; memcheck and racecheck find nothing."""

from __future__ import annotations

import pytest
from _variant_pairs import (COMPILE_SHAPES, HOPPER_SHAPES, assert_compiles_clean, assert_lse_twin, assert_same_sources,
                            assert_sanitizer_clean, assert_twin_where_admitted, hopper_config_id, serialised_notes,
                            skip_unless_admitted, without_if0)

from evotune.build.template import instantiate
from evotune.problems.attention import is_skip_empty, uses_tile_counter
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", rescale="lazy", softmax_overlap=True, lean_addressing=True, pingpong=False,
          empty_warpgroups="skip")
# The 192-row tiles gpt2's searches found (three consumers, Q in shared memory, persistent with the TMA-store epilogue;
# one-tile with the register epilogue), the gpt2 winner's two-consumer tile without a producer (its consumer thread
# refills the slots) and llama-4k's persistent two-consumer tile with Q in registers.
SKIP_CONFIGS = [
    dict(_H, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=3, q_in_regs=False, persistent=True,
         epilogue="tma"),
    dict(_H, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False, persistent=False,
         epilogue="regs"),
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=4, q_in_regs=True, persistent=False,
         epilogue="tma"),
    dict(_H, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=True, persistent=True,
         epilogue="regs"),
]
# Shapes whose persistent grids get thin tiles: 1000 rows (192-row tiles: 40 rows in the last), 1088 (128-row tiles:
# 64 in the last; 192-row: 128), causal and not, with more query tiles than the H100's SMs.
PERSISTENT_SHAPES = ["2,12,1000,64", "2,16,1088,1024,64:causal", "1,16,1088,128:bf16"]


def _compute(cfg: dict) -> dict:
    """The twin that computes the padding rows."""
    return dict(cfg, empty_warpgroups="compute")


@pytest.fixture(scope="module")
def skip_space():
    return load_builtin("attention-hopper3-skip")



def test_every_compute_config_keeps_its_source(attention, skip_space):
    """Each compute config of attention-hopper3-skip.yaml on gpt2 and on a ragged causal shape instantiates to the
    source of the same config in attention-hopper3-tiles.yaml, whose own test ties it to the recorded runs."""
    tiles = load_builtin("attention-hopper3-tiles")
    for shape in (parse_shape("gpt2"), parse_shape("2,16,1088,1024,64:causal")):
        admitted = skip_space.admitted_configs(attention.context(shape))
        compute = [c for c in admitted if c["empty_warpgroups"] == "compute"]
        assert len(compute) == len(tiles.admitted_configs(attention.context(shape)))
        assert_same_sources(attention, compute, tiles, shape, drop="empty_warpgroups")


@pytest.mark.parametrize("shape_text, block_ms", [("gpt2", {192}), ("mission", {192}), ("2,16,1088,1024,64:causal", {128, 192}),
                                                  ("2,3,1152,64", set()), ("1,2,1,64", {128, 192})])
def test_skip_is_admitted_where_a_warpgroup_is_empty(attention, skip_space, shape_text, block_ms):
    """skip only where the last query tile leaves a consumer warpgroup no row (seq_q's remainder at least 64 rows
    short of block_m: at 1024 rows the 192-row tiles, at 1152 none), never with ping-pong; on gpt2 176 configs."""
    shape = parse_shape(shape_text)
    skip = [c for c in skip_space.admitted_configs(attention.context(shape)) if c["empty_warpgroups"] == "skip"]
    assert {c["block_m"] for c in skip} == block_ms
    assert not [c for c in skip if c["pingpong"]]
    if shape_text == "gpt2":
        assert len(skip) == 176 and len([c for c in skip if c["persistent"]]) == 64


def test_skip_source(attention, skip_space):
    """empty_warpgroups is the traits' template parameter SKIP_EMPTY (kSkipEmpty): under `if constexpr` an empty
    warpgroup walks drain_tile instead of the loop, and a persistent grid hands its tiles out (kDynamic: persistent_tile's
    order, from tile_counter); compute passes false, and no flag is left in either."""
    shape = parse_shape("gpt2")
    skip = instantiate(attention, skip_space.config(SKIP_CONFIGS[0]), shape).code
    compute = instantiate(attention, skip_space.config(_compute(SKIP_CONFIGS[0])), shape).code
    live = without_if0(skip)
    assert "drain_tile<T>(&bars, n_tiles, it0, q_phase, lane);" in live and "if constexpr (T::kSkipEmpty) {" in live
    assert "constexpr bool kDynamic = T::kIsCausal || T::kSkipEmpty;" in live
    assert live.count("= persistent_tile<T>(work,") == 2
    assert "/* SKIP_EMPTY = */ true," in skip and "/* SKIP_EMPTY = */ false," in compute
    assert "//[skip_empty]" not in skip and "//[skip_empty]" not in compute
    assert is_skip_empty(skip_space.config(SKIP_CONFIGS[0])) and not is_skip_empty(skip_space.config(_compute(SKIP_CONFIGS[0])))


def test_the_skipping_persistent_grid_takes_tile_counters(attention, space):
    """The non-causal persistent grid hands tiles out from the two counters only with skip; the one-tile grid never."""
    gpt2, causal = parse_shape("gpt2"), parse_shape("2,16,1088,1024,64:causal")
    persistent, one_tile = space.config(SKIP_CONFIGS[0]), space.config(SKIP_CONFIGS[1])
    assert uses_tile_counter(persistent, gpt2) and attention.workspace_elems(persistent, gpt2) == (0, 0, 2)
    assert attention.workspace_elems(space.config(_compute(SKIP_CONFIGS[0])), gpt2) == (0, 0, 0)
    assert attention.workspace_elems(space.config(_compute(SKIP_CONFIGS[0])), causal) == (0, 0, 2)
    assert attention.workspace_elems(one_tile, gpt2) == (0, 0, 0)
    assert "tile_counter 2 uint32 zeroed once" in "\n".join(attention.launch_notes(persistent, gpt2))
    assert "empty_warpgroups = skip: the non-causal PERSISTENT grid takes tile_counter" in instantiate(
        attention, persistent, gpt2).code


@pytest.mark.parametrize("cfg", SKIP_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", COMPILE_SHAPES + PERSISTENT_SHAPES)
def test_skip_configs_compile_clean(attention, space, cfg, shape_text):
    """Where admitted: sm_90a, no spill, within the static gate, and no wgmma serialised by ptxas."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, space, shape, cfg, _compute(cfg))
    _, compiled, _ = assert_compiles_clean(attention, space, shape, cfg)
    assert not serialised_notes(compiled)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SKIP_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", HOPPER_SHAPES + PERSISTENT_SHAPES)
def test_skip_passes_the_gate_bit_for_bit(attention, space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit compute's: the rows that exist come out of the same
    instructions, whichever CTA and in whichever order."""
    assert_twin_where_admitted(attention, space, shape_text, cfg, _compute(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [SKIP_CONFIGS[0], SKIP_CONFIGS[3]], ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", PERSISTENT_SHAPES)
def test_skip_on_few_sms(attention, space, cfg, shape_text, monkeypatch):
    """A persistent grid of 5 CTAs (EVOTUNE_SM_COUNT): each CTA takes dozens of tiles from the counter, thin ones
    among them, with launch after launch reusing the counters the last CTA zeroes."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "5")
    assert_twin_where_admitted(attention, space, shape_text, cfg, _compute(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [SKIP_CONFIGS[0], SKIP_CONFIGS[2]], ids=hopper_config_id)
def test_skip_with_log_sum_exp(attention, space, cfg):
    """The training variant (write_lse): O and the log-sum-exp bit for bit compute's."""
    shape = parse_shape("2,16,1088,1024,64:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, space, shape, cfg, _compute(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SKIP_CONFIGS[1], SKIP_CONFIGS[2]], ids=hopper_config_id)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, space, cfg, tool):
    """memcheck and racecheck find nothing on a ragged causal shape whose last tiles have an empty warpgroup: the
    three-consumer tile with a producer, and the two-consumer tile whose consumer thread refills the slots."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,65,300,64:causal"), cfg, tool)
