"""Which 64-row stripe of a query tile each consumer warpgroup computes in the persistent causal kernel: fixed, or
mirrored on every other query tile with a second Q buffer (knob stripe_order, the Hopper traits' STRIPE_MIRROR:
kStripeMirror, profile attention:hopper3-mirror).

With causal_extent = warpgroup the warpgroup on a query tile's last 64 rows walks W - 1 more K/V tiles than the one on
its first. fixed: warpgroup wg always takes stripe wg, so the last one is always the longest, and with Q's one buffer
the others wait for it at every tile. mirrored: stripe wg on the CTA's even query tiles, W - 1 - wg on its odd ones;
Q goes to buffer qi & 1, so a warpgroup done with one tile starts the next. Each stripe's rows are computed by the
same arithmetic whichever warpgroup runs them, so the output is bit for bit fixed's.

CPU: every fixed config keeps the source attention-hopper3-causal's searches measured; mirrored is admitted only with
persistent and causal_extent = warpgroup; the stripes even out over two tiles; the second Q buffer's shared memory and
the four-warpgroup producer's registers agree between host and traits; mirrored is a traits parameter; clean
compiles. GPU (marked):
the gate passes and the output is bit for bit fixed's, on persistent causal shapes and on 5 SMs (dozens of query
tiles per CTA, both parities); the log-sum-exp; memcheck and racecheck find nothing."""

from __future__ import annotations

import pytest
from _variant_pairs import (assert_compiles_clean, assert_lse_twin, assert_same_sources, assert_sanitizer_clean,
                            assert_twin_where_admitted, hopper_config_id, serialised_notes, skip_unless_admitted)

from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import (MIRRORED_WG4_PRODUCER_REGS, is_stripe_mirror, q_buffer_bytes,
                                        setmaxnreg_registers)
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", rescale="lazy", softmax_overlap=True, lean_addressing=True, pingpong=False, persistent=True,
          producer_warps=4, causal_extent="warpgroup", stripe_order="mirrored")
# The causal winner's tile (256 rows, Q in shared memory, TMA store: the second Q buffer after O's staging tile); the
# 192-row tile with empty_warpgroups = skip (an empty stripe lands on a different warpgroup on odd tiles); the 256-row
# tile with 32 keys and Q in registers (Q released at once, more masked tiles than stages); the 192-row 128-key tile.
MIRROR_CONFIGS = [
    dict(_H, block_m=256, block_n=64, compute_warps=16, stages=4, q_in_regs=False, epilogue="tma"),
    dict(_H, block_m=192, block_n=64, compute_warps=12, stages=2, q_in_regs=False, epilogue="regs",
         empty_warpgroups="skip"),
    dict(_H, block_m=256, block_n=32, compute_warps=16, stages=2, q_in_regs=True, epilogue="regs"),
    dict(_H, block_m=192, block_n=128, compute_warps=12, stages=2, q_in_regs=False, epilogue="tma"),
]
# Causal shapes with more query tiles than SMs (persistent is admitted only there): ragged, Sq != Sk, bf16, grouped
# K/V heads, head dim 128 (where it compiles clean).
PERSISTENT_SHAPES = ["2,16,1088,1024,64:causal", "1,70,600,700,64:bf16:causal", "4,16,777,64:causal:kv4",
                     "2,40,500,128:causal"]


def _fixed(cfg: dict) -> dict:
    """The twin whose warpgroup wg always computes stripe wg, with Q's one buffer."""
    return dict(cfg, stripe_order="fixed")


@pytest.fixture(scope="module")
def mirror_space():
    return load_builtin("attention-hopper3-mirror")


def test_every_fixed_config_keeps_its_source(attention, mirror_space):
    """Each fixed config of attention-hopper3-mirror.yaml with at most 4 stages (the deep ring's 5 to 8 are
    tests/test_deep_ring.py's) on gpt2-causal and on a ragged causal shape instantiates to the source of the same config
    in attention-hopper3-causal.yaml (whose test ties it to the recorded runs)."""
    causal = load_builtin("attention-hopper3-causal")
    for shape in (parse_shape("gpt2-causal"), parse_shape("2,16,1088,1024,64:causal")):
        admitted = mirror_space.admitted_configs(attention.context(shape))
        fixed = [c for c in admitted if c["stripe_order"] == "fixed" and c["stages"] <= 4]
        assert len(fixed) == len(causal.admitted_configs(attention.context(shape)))
        assert_same_sources(attention, fixed, causal, shape, drop="stripe_order")


@pytest.mark.parametrize("shape_text, count", [("gpt2-causal", 310), ("gpt2", 0), ("mission", 0),
                                               ("llama-4k-causal", 164)])
def test_mirrored_is_admitted_with_persistent_warpgroup_extents(attention, mirror_space, shape_text, count):
    """mirrored only on causal shapes, with persistent and causal_extent = warpgroup (the stripes' ranges differ only
    there, and only a persistent CTA has a next query tile to start)."""
    shape = parse_shape(shape_text)
    mirrored = [c for c in mirror_space.admitted_configs(attention.context(shape)) if c["stripe_order"] == "mirrored"]
    assert len(mirrored) == count
    assert all(c["persistent"] and c["causal_extent"] == "warpgroup" for c in mirrored)


def _stripe_tiles(row0: int, stripe: int, seq: int, block_n: int) -> int:
    """K/V tiles stripe `stripe` of the query tile at row0 walks with causal_extent = warpgroup (seq_q = seq_k)."""
    return (min(seq, row0 + 64 * (stripe + 1)) + block_n - 1) // block_n


@pytest.mark.parametrize("warpgroups", [2, 3, 4])
def test_mirrored_stripes_even_out_over_two_tiles(warpgroups):
    """The mirror's arithmetic: over any two consecutive query tiles of the same K/V range offset, every warpgroup walks
    the same number of K/V tiles (fixed: the last one W - 1 per tile more than the first); over any two, the spread
    is at most W - 1 tiles, the same as one fixed tile's."""
    def stripe(wg, qi):  # kernels/attention_hopper.cuh, mirrored_stripe
        return warpgroups - 1 - wg if qi & 1 else wg

    seq, block_n, block_m = 4096, 64, 64 * warpgroups
    for row0 in range(0, seq - 2 * block_m, block_m):
        mirrored = [_stripe_tiles(row0, stripe(wg, 0), seq, block_n) + _stripe_tiles(row0, stripe(wg, 1), seq, block_n)
                    for wg in range(warpgroups)]
        fixed = [2 * _stripe_tiles(row0, wg, seq, block_n) for wg in range(warpgroups)]
        assert len(set(mirrored)) == 1
        assert max(fixed) - min(fixed) == 2 * (warpgroups - 1)


def test_host_and_traits_agree_on_the_second_buffer(attention, mirror_space):
    """mirrored adds one Q tile of shared memory (after O's staging tile, before P's) and, at four consumer
    warpgroups, gives the producer 32 registers: 32 x 128 + 112 x 512 = 61440, the launch's whole allocation; the
    instantiation's static_asserts tie the traits' shared memory and setmaxnreg split to the host's, and its source
    says so (the compiles below hold the traits to them)."""
    shape = parse_shape("gpt2-causal")
    cfg = mirror_space.config(MIRROR_CONFIGS[0])
    geo = attention.geometry(cfg, shape)
    fixed_geo = attention.geometry(mirror_space.config(_fixed(MIRROR_CONFIGS[0])), shape)
    assert q_buffer_bytes(cfg, shape) == 256 * 64 * 2
    assert geo.dynamic_smem - fixed_geo.dynamic_smem == 256 * 64 * 2
    assert setmaxnreg_registers(cfg) == 128 * MIRRORED_WG4_PRODUCER_REGS + 512 * 112 == 61440 == 96 * 640
    assert fixed_geo.register_split == 128 * 24 + 512 * 112
    code = instantiate(attention, cfg, shape).code
    split = "128 * EvotuneTraits::kProducerRegs + EvotuneTraits::kConsumerThreads * EvotuneTraits::kConsumerRegs"
    assert f"static_assert(EvotuneTraits::kSetMaxNReg && {split} == 61440," in code
    assert f"{split} == {fixed_geo.register_split}," in instantiate(
        attention, mirror_space.config(_fixed(MIRROR_CONFIGS[0])), shape).code
    assert "static constexpr int kQ1Offset = kQBytes + kStages * (kKBytes + kVBytes) + kOStageBytes;" in code
    three = mirror_space.config(MIRROR_CONFIGS[1])
    assert setmaxnreg_registers(three) == 128 * 32 + 384 * 160
    assert f"{split} == {128 * 32 + 384 * 160}," in instantiate(attention, three, shape).code


def test_mirrored_is_a_traits_parameter(attention, mirror_space):
    """stripe_order is the traits' template parameter STRIPE_MIRROR (kStripeMirror): mirrored passes true, its fixed
    twin false, and neither keeps a flag (the template text is one); the traits tie mirrored to a persistent CTA with
    causal_extent = warpgroup, as the space's constraint does, and Q's two buffers' barriers exist only with it."""
    shape = parse_shape("gpt2-causal")
    mirrored = instantiate(attention, mirror_space.config(MIRROR_CONFIGS[0]), shape).code
    fixed = instantiate(attention, mirror_space.config(_fixed(MIRROR_CONFIGS[0])), shape).code
    assert "/* STRIPE_MIRROR = */ true," in mirrored and "/* STRIPE_MIRROR = */ false," in fixed
    assert template_flag_names(mirrored) == template_flag_names(fixed) == set()
    assert mirrored.split("evotune instantiation")[0] == fixed.split("evotune instantiation")[0]
    assert "static_assert(!kStripeMirror || (kPersistent && kCausalWarpgroup)," in fixed
    assert "struct Barriers<T, true> : BarriersBase<T> {" in fixed
    assert is_stripe_mirror(mirror_space.config(MIRROR_CONFIGS[0]))
    assert not is_stripe_mirror(mirror_space.config(_fixed(MIRROR_CONFIGS[0])))
    assert not is_stripe_mirror(dict(mma="wgmma", persistent=False, stripe_order="mirrored"))


@pytest.mark.parametrize("cfg", MIRROR_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", ["gpt2-causal"] + PERSISTENT_SHAPES)
def test_mirrored_configs_compile_clean(attention, space, cfg, shape_text):
    """Where admitted: sm_90a, no spill, within the static gate, and no wgmma serialised by ptxas."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, space, shape, cfg, _fixed(cfg))
    _, compiled, _ = assert_compiles_clean(attention, space, shape, cfg)
    assert not serialised_notes(compiled)


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", MIRROR_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", PERSISTENT_SHAPES)
def test_mirrored_passes_the_gate_bit_for_bit(attention, space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit fixed's: each stripe's rows computed as before, by
    another warpgroup on odd tiles."""
    assert_twin_where_admitted(attention, space, shape_text, cfg, _fixed(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", MIRROR_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", PERSISTENT_SHAPES[:2])
def test_mirrored_on_few_sms(attention, space, cfg, shape_text, monkeypatch):
    """A persistent grid of 5 CTAs (EVOTUNE_SM_COUNT): each CTA walks dozens of query tiles, both Q buffers and both
    stripe orders in turn, its early warpgroups starting tiles while the longest finishes the one before."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "5")
    assert_twin_where_admitted(attention, space, shape_text, cfg, _fixed(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", MIRROR_CONFIGS[:2], ids=hopper_config_id)
def test_mirrored_with_log_sum_exp(attention, space, cfg, monkeypatch):
    """The training variant (write_lse) on 7 CTAs: O and the log-sum-exp bit for bit fixed's."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "7")
    shape = parse_shape("2,16,1088,1024,64:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, space, shape, cfg, _fixed(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("cfg", MIRROR_CONFIGS[:3], ids=hopper_config_id)
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, space, cfg, tool, monkeypatch):
    """memcheck and racecheck find nothing on a ragged causal shape run by 3 CTAs (several query tiles each, both
    buffers in use)."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "3")
    assert_sanitizer_clean(attention, space, parse_shape("2,3,1030,900,64:causal"), cfg, tool)
