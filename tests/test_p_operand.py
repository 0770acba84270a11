"""P V's P operand from registers or shared memory (knob p_operand, the traits' P_SMEM: kPSmem,
profile attention:hopper3-ss), and the 192-key tile it allows (FlashAttention-3's d64 tile).

With p_operand = regs the packed scores stay in registers as P V's A operand until that P V completes; with smem each
consumer warpgroup stores them (stmatrix) to a P tile of its own at the end of the dynamic shared memory and P V reads
them through descriptors. P is the same fp16/bf16 numbers either way, so at the same tile the output is the same.

CPU: every regs config keeps its source (attention-hopper3-tiles's, whose own test ties it to the recorded runs); a
smem config's source issues P V from shared memory only, keeps P's registers unfenced and no flag, and takes the lean
descriptors where lean_addressing says; the N = 192 wrappers come with smem only; the launch's shared memory counts the
P tiles (the instantiation's static asserts check the traits agree); the smem paths compile clean, and the 192-key tile
with Q in shared memory fits three consumer warpgroups' 160 registers without a spill. GPU (marked): the gate passes
and the output is bit for bit the regs twin's (so every element of P reaches P V where it was stored); the 192-key
tile passes the gate; the log-sum-exp; memcheck and racecheck find nothing."""

from __future__ import annotations

import pytest
from _variant_pairs import (COMPILE_SHAPES, HOPPER_SHAPES, assert_compiles_clean, assert_lse_twin, assert_same_sources,
                            assert_sanitizer_clean, assert_twin_where_admitted, compile_config, hopper_config_id,
                            serialised_notes, without_if0)

from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import is_p_smem
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", rescale="lazy", softmax_overlap=True, lean_addressing=True, p_operand="smem")
# The gpt2 winner's tile (two consumers, no producer, Q in registers, 64 keys, TMA-store epilogue), llama-4k's
# (persistent, a producer, 128 keys), a three-consumer 128-key tile with Q in shared memory and three stages (d64), the
# same with two stages (the three-consumer d128 tile that only smem compiles without spills), a ping-pong pair with the
# loop as written (softmax_overlap false: P stored at the loop's end and after tile 0), and FlashAttention-3's d64 tile:
# 192 x 192, three consumers, Q in shared memory, one-tile grid and persistent.
SMEM_CONFIGS = [
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=4, q_in_regs=True, pingpong=False,
         persistent=False, epilogue="tma"),
    dict(_H, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=True, pingpong=False,
         persistent=True, epilogue="tma"),
    dict(_H, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=3, q_in_regs=False,
         pingpong=False, persistent=False, epilogue="regs"),
    dict(_H, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False,
         pingpong=False, persistent=False, epilogue="regs"),
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=4, stages=3, q_in_regs=True, pingpong=True,
         persistent=False, epilogue="regs", softmax_overlap=False),
]
FA3_D64 = [
    dict(_H, block_m=192, block_n=192, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False,
         pingpong=False, persistent=False, epilogue="tma"),
    dict(_H, block_m=192, block_n=192, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False,
         pingpong=False, persistent=True, epilogue="regs"),
]


def _regs(cfg: dict) -> dict:
    """The twin with P in registers."""
    return dict(cfg, p_operand="regs")


@pytest.fixture(scope="module")
def ss_space():
    return load_builtin("attention-hopper3-ss")



def test_every_regs_config_keeps_its_source(attention, ss_space):
    """Each p_operand = regs config of attention-hopper3-ss.yaml on gpt2 instantiates to the source of the same config
    in attention-hopper3-tiles.yaml (its 640); the space adds 434 smem configs there, 114 of them 192-key tiles."""
    tiles = load_builtin("attention-hopper3-tiles")
    shape = parse_shape("gpt2")
    admitted = ss_space.admitted_configs(attention.context(shape))
    regs = [c for c in admitted if c["p_operand"] == "regs"]
    smem = [c for c in admitted if c["p_operand"] == "smem"]
    assert len(regs) == 640 and len(smem) == 434
    assert not [c for c in regs if c["block_n"] == 192]
    assert len([c for c in smem if c["block_n"] == 192]) == 114 and not [c for c in smem if c["block_n"] % 64]
    assert_same_sources(attention, regs, tiles, shape, drop="p_operand")


@pytest.mark.parametrize("lean", [True, False])
def test_smem_source(attention, ss_space, lean):
    """p_operand is the traits' template parameter P_SMEM (kPSmem): under `if constexpr` every P V is issued from the P
    tile (issue_pv_smem) or from registers (issue_pv), P is stored after each packing and P's registers fenced only
    with regs; issue_pv_smem takes the lean or the written descriptors as lean_addressing says; no flag is left; the
    regs twin passes false. The N = 192 wrappers are always inlined. On mma.sync the knob selects nothing."""
    shape = parse_shape("gpt2")
    full = load_builtin("attention")
    for cfg in (SMEM_CONFIGS[0], FA3_D64[0]):
        cfg = dict(cfg, lean_addressing=lean)
        code = instantiate(attention, full.config(cfg), shape).code
        live = without_if0(code)
        assert template_flag_names(code) == set()
        assert "/* P_SMEM = */ true," in code and f"/* LEAN_ADDRESSING = */ {str(lean).lower()}," in code
        assert live.count("if constexpr (T::kPSmem) issue_pv_smem<T>(o_acc, sP_wg") == 2
        assert live.count("if constexpr (T::kPSmem) store_p<T>(p, sP_wg, warp_in_wg, lane);") == 3
        assert "if constexpr (!T::kPSmem) fence_a_regs(p);" in live and "m64n192k16" in live
        assert "smem_desc16((sP_wg >> 4)" in live and "smem_desc(sP_wg + p_off" in live
        plain = instantiate(attention, full.config(_regs(cfg if cfg["block_n"] != 192 else SMEM_CONFIGS[0])),
                            shape).code
        assert "/* P_SMEM = */ false," in plain
    assert is_p_smem(ss_space.config(SMEM_CONFIGS[0]))
    assert not is_p_smem(dict(mma="sync", p_operand="smem"))


def test_launch_counts_the_p_tiles(attention, ss_space):
    """The launch's dynamic shared memory is the regs twin's plus 64 x block_n x 2 bytes per consumer warpgroup
    (the instantiation asserts the traits' kSmemBytes agree); the space's smem_bytes says the same, so the 192 x 192
    tile fits 2 stages (Q 24 KB, K/V 96 KB, P 72 KB) and not 3 (K/V 144 KB)."""
    shape = parse_shape("gpt2")
    ctx = attention.context(shape)
    for cfg in SMEM_CONFIGS[:1] + FA3_D64[:1]:
        c = ss_space.config(cfg)
        smem = attention.geometry(c, shape).dynamic_smem
        regs_twin = dict(cfg, p_operand="regs", block_n=cfg["block_n"] if cfg["block_n"] != 192 else 128)
        base = attention.geometry(ss_space.config(regs_twin), shape).dynamic_smem
        base += 2 * 2 * cfg["stages"] * 64 * (cfg["block_n"] - regs_twin["block_n"])  # K and V of the wider tile
        assert smem == base + 2 * cfg["block_m"] * cfg["block_n"]
        assert ss_space.derive(c, ctx)["smem_bytes"] == smem
    assert not ss_space.admitted(ss_space.config(dict(FA3_D64[0], stages=3)), ctx)


@pytest.mark.parametrize("cfg", SMEM_CONFIGS + FA3_D64, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", COMPILE_SHAPES)
def test_smem_configs_compile_clean(attention, space, cfg, shape_text):
    """Every smem path compiles for sm_90a with no stack frame, no spill, within the static gate, and without ptxas
    serialising the wgmma; except the three-consumer d128 tile on a causal shape, whose mask spills a few bytes (the
    static gate prunes it there, as it did on llama-4k-causal in the measurements)."""
    shape = parse_shape(shape_text)
    if not space.admitted(space.config(dict(cfg)), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    if cfg["compute_warps"] == 12 and shape.head_dim == 128 and shape.causal:
        assert compile_config(attention, space, shape, cfg)[2].resources.spill_stores > 0
        return
    _, compiled, _ = assert_compiles_clean(attention, space, shape, cfg)
    assert not serialised_notes(compiled)


def test_192_key_tile_needs_p_in_shared_memory(attention, ss_space):
    """Why the 192-key tile comes with smem only: with Q in registers as well (16 more per thread) three consumer
    warpgroups' 160 registers spill, which the static gate prunes; with Q in shared memory they do not. And the space
    refuses 192 keys with P in registers."""
    shape = parse_shape("gpt2")
    assert compile_config(attention, ss_space, shape, dict(FA3_D64[0], q_in_regs=True))[2].resources.spill_stores > 0
    assert compile_config(attention, ss_space, shape, FA3_D64[0])[2].resources.spill_stores == 0
    assert not ss_space.admitted(ss_space.config(_regs(FA3_D64[0])), attention.context(shape))


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SMEM_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", HOPPER_SHAPES)
def test_smem_passes_the_gate_bit_for_bit(attention, space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit the regs twin's: the same P through shared memory."""
    assert_twin_where_admitted(attention, space, shape_text, cfg, _regs(cfg))


def _assert_gate(attention, space, shape, cfg) -> None:
    """The full gate passes for `cfg` on `shape` (skipped where the space does not admit it or the static gate would
    prune it for a spill)."""
    from evotune.gpu.evaluate import evaluate_compiled
    from evotune.records import result as R

    if not space.admitted(space.config(dict(cfg)), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    config, _, compiled = compile_config(attention, space, shape, cfg)
    if compiled.resources.spill_stores:
        pytest.skip(f"spills {compiled.resources.spill_stores} B here: pruned by the static gate")
    res = evaluate_compiled(attention, shape, config, compiled, time_it=False)
    assert res.status == R.OK, res.message


_D64_SHAPES = [s for s in HOPPER_SHAPES if parse_shape(s).head_dim == 64]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", FA3_D64, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", _D64_SHAPES)
def test_192_key_tile_passes_the_gate(attention, ss_space, cfg, shape_text):
    """FlashAttention-3's d64 tile (no regs twin at 192 keys): the full gate passes on every d64 shape that admits it
    (the persistent form only where a shape has more query tiles than SMs)."""
    _assert_gate(attention, ss_space, parse_shape(shape_text), cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("shape_text", [s for s in HOPPER_SHAPES if s not in _D64_SHAPES])
def test_three_consumer_d128_tile_passes_the_gate(attention, space, shape_text):
    """The three-consumer d128 tile with two stages, which only smem compiles without spills (its regs twin spills,
    so the bit-for-bit test skips it): the full gate passes on the d128 shapes where it does not spill."""
    _assert_gate(attention, space, parse_shape(shape_text), SMEM_CONFIGS[3])


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [SMEM_CONFIGS[0], SMEM_CONFIGS[2]], ids=hopper_config_id)
def test_smem_with_log_sum_exp(attention, ss_space, cfg):
    """The training variant (write_lse): O and the log-sum-exp bit for bit the regs twin's."""
    shape = parse_shape("4,16,1333,1257,64:bf16:causal")
    assert ss_space.admitted(ss_space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, ss_space, shape, cfg, _regs(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cfg", [SMEM_CONFIGS[0], FA3_D64[1]], ids=hopper_config_id)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, ss_space, cfg, tool):
    """memcheck and racecheck find nothing on a ragged causal shape: the two-consumer config whose consumer thread
    refills the slots, and the persistent 192-key tile with a producer warpgroup."""
    assert_sanitizer_clean(attention, ss_space, parse_shape("2,3,197,300,64:causal"), cfg, tool)
