"""Each consumer warpgroup's causal K/V range: to its query tile's diagonal or to its own (knob causal_extent,
the traits' CAUSAL_WG: kCausalWarpgroup, profile attention:hopper3-causal).

A causal query tile of block_m rows reads the K/V tiles up to its last row's diagonal. Its first consumer warpgroup's
64 rows end block_m - 64 rows earlier, so with tile every warpgroup but the last computes K/V tiles that are masked
whole for its rows (scores -inf, P zero, O and l unchanged). With warpgroup each stops at its own diagonal and only
gives the later tiles' slots the releases a refill waits for; without a producer the loads move to the last
warpgroup's first thread, the one warpgroup that still walks every tile. A masked tile adds exactly nothing (its alpha
is 1, its P zero), so the output is bit for bit tile's.

CPU: every tile config keeps the source attention-hopper3-wg4's searches measured; warpgroup is admitted only on causal
shapes where a warpgroup's diagonal ends a K/V tile early, never with ping-pong nor where an empty last warpgroup
would leave nobody to refill; the counts of skipped tiles; warpgroup's source; clean compiles. GPU (marked): the gate
passes and the output is bit for bit tile's, on the causal Hopper test shapes and on persistent ones, with a handful
of SMs too; the log-sum-exp; memcheck and racecheck find nothing."""

from __future__ import annotations

import pytest
from _variant_pairs import (COMPILE_SHAPES, HOPPER_SHAPES, assert_compiles_clean, assert_lse_twin, assert_same_sources,
                            assert_sanitizer_clean, assert_twin_where_admitted, hopper_config_id, serialised_notes,
                            skip_unless_admitted, without_if0)

from evotune.build.template import instantiate
from evotune.problems.attention import is_causal_warpgroup
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", rescale="lazy", softmax_overlap=True, lean_addressing=True, pingpong=False,
          causal_extent="warpgroup")
# gpt2-causal's previous winner without a producer (the last warpgroup's thread now loads), and the same tile with two
# stages and Q in shared memory (each slot refilled right after its release); the 256-row persistent tile (its first
# three warpgroups skip three, two and one tiles at block_n 64); the 192-row tile with empty_warpgroups = skip and a
# producer; and 32-key tiles, where the first warpgroup skips more tiles than there are stages, so its releases of
# tiles past its diagonal are awaited by refills (one tile per CTA, no producer; persistent with Q in registers).
CAUSAL_WG_CONFIGS = [
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=4, q_in_regs=True, persistent=False,
         epilogue="tma"),
    dict(_H, block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=2, q_in_regs=False, persistent=False,
         epilogue="regs"),
    dict(_H, block_m=256, block_n=64, compute_warps=16, producer_warps=4, stages=4, q_in_regs=False, persistent=True,
         epilogue="tma"),
    dict(_H, block_m=192, block_n=64, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False, persistent=False,
         epilogue="regs", empty_warpgroups="skip"),
    dict(_H, block_m=192, block_n=32, compute_warps=12, producer_warps=0, stages=2, q_in_regs=True, persistent=False,
         epilogue="regs"),
    dict(_H, block_m=256, block_n=32, compute_warps=16, producer_warps=4, stages=2, q_in_regs=True, persistent=True,
         epilogue="regs"),
]
# The causal Hopper test shapes (warpgroup is admitted on causal shapes only; the four-warpgroup configs at head dim
# 64 only, where they compile without a spill), and ragged causal shapes with more query tiles than SMs.
CAUSAL_SHAPES = [s for s in HOPPER_SHAPES if parse_shape(s).causal]
PERSISTENT_SHAPES = ["2,16,1088,1024,64:causal", "1,70,600,700,64:bf16:causal"]


def _tile(cfg: dict) -> dict:
    """The twin that computes every K/V tile of the query tile's range in every warpgroup."""
    return dict(cfg, causal_extent="tile")


@pytest.fixture(scope="module")
def causal_space():
    return load_builtin("attention-hopper3-causal")


def test_every_tile_config_keeps_its_source(attention, causal_space):
    """Each tile config of attention-hopper3-causal.yaml on gpt2-causal and on a ragged causal shape instantiates to
    the source of the same config in attention-hopper3-wg4.yaml (whose test ties it to the recorded runs); the space
    is wg4's without the 176-key tile."""
    wg4 = load_builtin("attention-hopper3-wg4")
    for shape in (parse_shape("gpt2-causal"), parse_shape("2,16,1088,1024,64:causal")):
        admitted = causal_space.admitted_configs(attention.context(shape))
        tile = [c for c in admitted if c["causal_extent"] == "tile"]
        assert len(tile) == len([c for c in wg4.admitted_configs(attention.context(shape)) if c["block_n"] != 176])
        assert_same_sources(attention, tile, wg4, shape, drop="causal_extent")


@pytest.mark.parametrize("shape_text, count", [("gpt2-causal", 448), ("gpt2", 0), ("llama-4k-causal", 380),
                                               ("mission", 0), ("1,4,1000,64:bf16:causal", 272)])
def test_warpgroup_is_admitted_where_a_warpgroup_stops_early(attention, causal_space, shape_text, count):
    """warpgroup only on causal shapes, where block_n <= block_m - 64 (a warpgroup's diagonal ends a K/V tile before
    the query tile's: never the 64-row tile, nor 128 rows with 128 keys), never with ping-pong, and without a producer
    never with empty_warpgroups = skip (the last warpgroup, the loader, may be empty)."""
    shape = parse_shape(shape_text)
    wg = [c for c in causal_space.admitted_configs(attention.context(shape)) if c["causal_extent"] == "warpgroup"]
    assert len(wg) == count
    assert all(c["block_n"] <= c["block_m"] - 64 and not c["pingpong"] for c in wg)
    assert not [c for c in wg if c["producer_warps"] == 0 and c["empty_warpgroups"] == "skip"]
    if count:
        assert {(c["block_m"], c["block_n"]) for c in wg} == {(128, 32), (128, 64), (192, 32), (192, 64), (192, 128),
                                                            (256, 32), (256, 64), (256, 128)}


def _kv_tiles(row_end: int, seq_k: int, block_n: int) -> int:
    return (min(seq_k, row_end) + block_n - 1) // block_n


@pytest.mark.parametrize("block_m, block_n, saved", [(128, 64, 8 / 144), (192, 64, 15 / 151), (256, 64, 24 / 160),
                                                     (128, 128, 0.0)])
def test_the_products_warpgroup_saves_on_gpt2_causal(block_m, block_n, saved):
    """The arithmetic the docs quote, per head of gpt2-causal (1024 rows and keys): the (64-row, block_n-key) products
    the warpgroups compute with tile and with warpgroup (a warpgroup with no row past 1024 computes nothing, as
    empty_warpgroups = skip); with warpgroup every tile shape at block_n 64 computes the same 136."""
    seq = 1024
    tile = extent = 0
    for row0 in range(0, seq, block_m):
        cta = _kv_tiles(row0 + block_m, seq, block_n)
        for wg in range(block_m // 64):
            if row0 + 64 * wg >= seq:
                continue
            tile += cta
            extent += _kv_tiles(row0 + 64 * (wg + 1), seq, block_n)
    assert (tile - extent) / tile == pytest.approx(saved)
    if block_n == 64:
        assert extent == 136


def test_warpgroup_source(attention, causal_space):
    """causal_extent is the traits' template parameter CAUSAL_WG (kCausalWarpgroup): under `if constexpr` each
    warpgroup's loop ends at its own diagonal and passes the later tiles; without a producer the last warpgroup's
    first thread loads; tile passes false, and no flag is left in either."""
    shape = parse_shape("gpt2-causal")
    wg = instantiate(attention, causal_space.config(CAUSAL_WG_CONFIGS[0]), shape).code
    tile = instantiate(attention, causal_space.config(_tile(CAUSAL_WG_CONFIGS[0])), shape).code
    live = without_if0(wg)
    assert "if constexpr (T::kCausalWarpgroup) n_tiles = warpgroup_kv_tiles<T>(q_row0 + 64 * wg, seq_k);" in live
    assert "pass_masked_tiles<T>(&bars, n_tiles, cta_tiles, it0, lane);" in live
    assert ("const int loader = T::kHasProducer ? T::kConsumerThreads : T::kCausalWarpgroup ? T::kConsumerThreads - 128 "
            ": 0;") in live
    assert "/* CAUSAL_WG = */ true," in wg and "/* CAUSAL_WG = */ false," in tile
    assert "//[causal_wg]" not in wg and "//[causal_wg]" not in tile
    assert is_causal_warpgroup(causal_space.config(CAUSAL_WG_CONFIGS[0]))
    assert not is_causal_warpgroup(causal_space.config(_tile(CAUSAL_WG_CONFIGS[0])))


@pytest.mark.parametrize("cfg", CAUSAL_WG_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", [s for s in COMPILE_SHAPES if parse_shape(s).causal] + PERSISTENT_SHAPES)
def test_warpgroup_configs_compile_clean(attention, space, cfg, shape_text):
    """Where admitted: sm_90a, no spill, within the static gate, and no wgmma serialised by ptxas."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, space, shape, cfg, _tile(cfg))
    _, compiled, _ = assert_compiles_clean(attention, space, shape, cfg)
    assert not serialised_notes(compiled)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CAUSAL_WG_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", CAUSAL_SHAPES + PERSISTENT_SHAPES)
def test_warpgroup_passes_the_gate_bit_for_bit(attention, space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit tile's: the masked tiles a warpgroup no longer computes
    added nothing."""
    assert_twin_where_admitted(attention, space, shape_text, cfg, _tile(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [CAUSAL_WG_CONFIGS[2], CAUSAL_WG_CONFIGS[5]], ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", PERSISTENT_SHAPES)
def test_warpgroup_on_few_sms(attention, space, cfg, shape_text, monkeypatch):
    """A persistent grid of 5 CTAs (EVOTUNE_SM_COUNT): each CTA walks dozens of query tiles, its first warpgroups
    passing the masked K/V tiles of one while running ahead into the next."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "5")
    assert_twin_where_admitted(attention, space, shape_text, cfg, _tile(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [CAUSAL_WG_CONFIGS[0], CAUSAL_WG_CONFIGS[2]], ids=hopper_config_id)
def test_warpgroup_with_log_sum_exp(attention, space, cfg):
    """The training variant (write_lse): O and the log-sum-exp bit for bit tile's."""
    shape = parse_shape("2,16,1088,1024,64:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, space, shape, cfg, _tile(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cfg", [CAUSAL_WG_CONFIGS[1], CAUSAL_WG_CONFIGS[4], CAUSAL_WG_CONFIGS[5]],
                         ids=hopper_config_id)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, space, cfg, tool):
    """memcheck and racecheck find nothing on a ragged causal shape: the tile without a producer (the last
    warpgroup loads), the 32-key tile whose first warpgroup's releases are awaited, and the persistent 256-row one."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,330,300,64:causal"), cfg, tool)
