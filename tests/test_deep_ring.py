"""The Hopper kernel's deep K/V ring: stages 5 to 8 (the traits' kBarrierSlots, derived from STAGES, listed by
search_spaces/attention-hopper3-mirror.yaml).

Every config up to 4 stages has barriers for four slots; the deep ring's configs get eight. The slot of K/V tile t is
t % STAGES whatever the depth, so a deeper ring changes when a slot is refilled, never what is computed: the output
is bit for bit the 4-stage twin's. With stripe_order = mirrored the warpgroups of a persistent CTA work on different
K/V tiles (one runs ahead into the next query tile while the longest finishes the last), and the ring bounds how far
apart they may be.

CPU: admitted only for the Hopper kernel (mma.sync's slots are named barriers, four at most); the traits' source;
clean compiles within the shared-memory limit. GPU (marked): the gate passes and the output is bit for bit the
4-stage twin's, on persistent causal shapes and on 5 SMs; memcheck and racecheck find nothing."""

from __future__ import annotations

import pytest
from _variant_pairs import (assert_compiles_clean, assert_sanitizer_clean, assert_twin_where_admitted,
                            hopper_config_id, skip_unless_admitted)

from evotune.build.template import instantiate
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_H = dict(mma="wgmma", rescale="lazy", softmax_overlap=True, lean_addressing=True, pingpong=False, persistent=True,
          producer_warps=4, causal_extent="warpgroup", q_in_regs=False, epilogue="tma")
# The 256-row tile mirrored at 6 and 8 stages (8: 225 KB of the 227 KB per CTA), fixed at 5, and the 192-row tile
# with empty_warpgroups = skip at 7.
DEEP_CONFIGS = [
    dict(_H, block_m=256, block_n=64, compute_warps=16, stages=6, stripe_order="mirrored"),
    dict(_H, block_m=256, block_n=64, compute_warps=16, stages=8, stripe_order="mirrored"),
    dict(_H, block_m=256, block_n=64, compute_warps=16, stages=5, stripe_order="fixed"),
    dict(_H, block_m=192, block_n=64, compute_warps=12, stages=7, stripe_order="mirrored", empty_warpgroups="skip"),
]
PERSISTENT_SHAPES = ["2,16,1088,1024,64:causal", "1,70,600,700,64:bf16:causal"]


def _four(cfg: dict) -> dict:
    """The twin with the four-slot ring."""
    return dict(cfg, stages=4)


@pytest.fixture(scope="module")
def mirror_space():
    return load_builtin("attention-hopper3-mirror")


def test_deep_ring_is_the_hopper_kernels(attention, tmp_path):
    """stages 5 to 8 only with mma = wgmma: the mma.sync kernel's slots are named barriers, four at most (a space that
    lists them for both kernels admits them for wgmma only)."""
    from evotune.problems.attention import CONTEXT_NAMES
    from evotune.space.searchspace import load_space

    path = tmp_path / "deep.yaml"
    path.write_text("family: attention\nextends: attention\nparams:\n  stages: {values: [4, 6], default: 4}\n")
    space = load_space(str(path), CONTEXT_NAMES)
    ctx = attention.context(parse_shape("gpt2-causal"))
    assert any("deep ring" in why for why in space.violations(space.config(dict(mma="sync", stages=6)), ctx))
    hopper = space.config(dict(mma="wgmma", block_m=128, compute_warps=8, producer_warps=4, stages=6))
    assert space.violations(hopper, ctx) == []


def test_deep_ring_source(attention, mirror_space):
    """The deep ring is the traits' kBarrierSlots, derived from STAGES: eight barrier slots for 5 to 8 stages, four up
    to 4; Barriers<T> sizes its arrays by it, and no flag is left."""
    shape = parse_shape("gpt2-causal")
    deep = instantiate(attention, mirror_space.config(DEEP_CONFIGS[0]), shape).code
    four = instantiate(attention, mirror_space.config(_four(DEEP_CONFIGS[0])), shape).code
    assert "static constexpr int kBarrierSlots = kStages > 4 ? 8 : 4;" in deep
    assert "unsigned long long k_full[T::kBarrierSlots];" in deep
    assert "/* STAGES = */ 6," in deep and "/* STAGES = */ 4," in four
    assert "//[deep_ring]" not in deep and "//[deep_ring]" not in four


@pytest.mark.parametrize("cfg", DEEP_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", ["gpt2-causal"] + PERSISTENT_SHAPES)
def test_deep_ring_compiles_clean(attention, mirror_space, cfg, shape_text):
    """Where admitted: sm_90a, no spill, within the static gate (the shared memory of 8 stages included)."""
    shape = parse_shape(shape_text)
    skip_unless_admitted(attention, mirror_space, shape, cfg, _four(cfg))
    _, _, geo = assert_compiles_clean(attention, mirror_space, shape, cfg)
    assert geo.dynamic_smem <= 227 * 1024


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", DEEP_CONFIGS, ids=hopper_config_id)
@pytest.mark.parametrize("shape_text", PERSISTENT_SHAPES)
def test_deep_ring_passes_the_gate_bit_for_bit(attention, mirror_space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit the 4-stage twin's."""
    assert_twin_where_admitted(attention, mirror_space, shape_text, cfg, _four(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", DEEP_CONFIGS[:2], ids=hopper_config_id)
def test_deep_ring_on_few_sms(attention, mirror_space, cfg, monkeypatch):
    """5 CTAs: each walks dozens of query tiles, the ring's slots reused across them at every phase."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "5")
    assert_twin_where_admitted(attention, mirror_space, PERSISTENT_SHAPES[0], cfg, _four(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizers_clean(attention, mirror_space, tool, monkeypatch):
    """memcheck and racecheck find nothing: the mirrored 6-stage tile on 3 CTAs of a ragged causal shape."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "3")
    assert_sanitizer_clean(attention, mirror_space, parse_shape("2,3,1030,900,64:causal"), DEEP_CONFIGS[0], tool)
