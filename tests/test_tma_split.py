"""TMA loads with K and V on mbarriers of their own (knob value kv_load = tma_split, kernels/attention_tma_split.cuh).

CPU: the value's sources (cp_async and tma configs keep theirs, every one of the last mission search's; tma_split ones
inline the header and wait for K before Q K^T and for V before P V), compiles for sm_90a without spills or local
memory, shared memory (two barriers a stage: the launch, the traits and the space's smem_bytes agree), the space's
constraints. GPU (marked): every code path passes the gate and gives bit for bit the output of the same config with
kv_load = tma (the same tiles land in shared memory, the same math), the log-sum-exp too; the sanitizers find
nothing."""

from __future__ import annotations

import pytest
from _variant_pairs import (assert_compiles_clean, assert_gate_and_twin, assert_lse_twin, assert_sanitizer_clean,
                            covering_sample)

from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import is_tma_load, is_tma_split, kv_cluster, tma_load_bytes
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_T = dict(mma="sync", kv_load="tma_split", smem_layout="swizzle", producer_warps=0)
# One per code path: the TMA mission winner (4 tiles, 3 stages: one refill), every tile in the prologue (4 stages), a
# refill every step (1 stage, Q from shared memory), gather's merge, split-KV (CTAs with no tile), the smallest tile.
SPLIT_CONFIGS = [
    dict(_T, block_m=32, block_n=128, compute_warps=4, stages=3, q_in_regs=True, kv_splits=1, warp_key_groups=2,
         key_merge="split", pdl=True),
    dict(_T, block_m=32, block_n=128, compute_warps=4, stages=4, q_in_regs=True, kv_splits=1, warp_key_groups=2,
         key_merge="split", pdl=True),
    dict(_T, block_m=64, block_n=64, compute_warps=4, stages=1, q_in_regs=False, kv_splits=1, warp_key_groups=1),
    dict(_T, block_m=128, block_n=64, compute_warps=8, stages=3, q_in_regs=True, kv_splits=1, warp_key_groups=2),
    dict(_T, block_m=64, block_n=128, compute_warps=4, stages=2, q_in_regs=True, kv_splits=4, warp_key_groups=1),
    dict(_T, block_m=16, block_n=32, compute_warps=1, stages=2, q_in_regs=True, kv_splits=1, warp_key_groups=1,
         pdl=True),
]


def _id(c: dict) -> str:
    return (f"M{c['block_m']}N{c['block_n']}cw{c['compute_warps']}kg{c['warp_key_groups']}kv{c['kv_splits']}"
            f"st{c['stages']}q{int(c['q_in_regs'])}")


def _joint(cfg: dict) -> dict:
    return dict(cfg, kv_load="tma")


def test_every_config_of_the_last_mission_search_keeps_its_source(attention):
    """Each cp_async and tma config of attention-small-split.yaml instantiates to the source of the same config in
    attention-small-tma.yaml, the space of the last mission search of those values (so that run's figures hold for
    them); the space adds 378 tma_split configs on the mission shape."""
    split_space, tma_space = load_builtin("attention-small-split"), load_builtin("attention-small-tma")
    shape = parse_shape("mission")
    ctx = attention.context(shape)
    oracle = set(tma_space.admitted_configs(ctx))
    admitted = split_space.admitted_configs(ctx)
    before = [c for c in admitted if c["kv_load"] != "tma_split"]
    assert len(before) == len(oracle) == 1890 and len(admitted) - len(before) == 378
    for c in covering_sample(before):
        same = tma_space.config(c.as_dict())
        assert same in oracle and instantiate(attention, c, shape).digest == instantiate(attention, same, shape).digest


def test_split_source(attention, space):
    """A tma_split config's source inlines the header (no include left), waits for K where tma waits for the slot
    and for V before P V, and uses the split init, first fill, refill and tile alignment; no flag is left."""
    src = instantiate(attention, space.config(SPLIT_CONFIGS[0]), parse_shape("mission"))
    assert "// ---- begin attention_tma_split.cuh" in src.code and '#include "' not in src.code
    for call in ("tma_split_init<T>(tma_bars", "tma_split_first<T>(tma_bars", "tma_split_wait_k<T>(tma_bars, i);",
                 "tma_split_wait_v<T>(tma_bars, i);\n        pv_tile<T>", "tma_split_refill<T>(tma_bars",
                 "sQ = tma_split_aligned_tiles<T>(smem_raw);", "evotune::TmaSplit<EvotuneBaseTraits>::kExtraBytes"):
        assert call in src.code, call
    assert "/* KV_LOAD = */ 2," in src.code and "/* KV_CLUSTER = */ 1," in src.code
    assert "__cluster_dims__" not in src.code
    assert template_flag_names(src.code) == set()
    config = space.config(SPLIT_CONFIGS[0])
    assert is_tma_load(config) and is_tma_split(config) and kv_cluster(config) == 1


@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", ["mission", "2,3,300,333,64:bf16:causal:bshd"])
def test_split_configs_compile_clean(attention, space, cfg, shape_text):
    """Every path compiles for sm_90a with no stack frame, no spill and within the static gate."""
    shape = parse_shape(shape_text)
    if not space.admitted(space.config(cfg), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    assert_compiles_clean(attention, space, shape, cfg)


def test_shared_memory_and_constraints(attention, space):
    """Two mbarriers a stage: 8 bytes a stage more than tma, in the launch and in the space's smem_bytes; the grid is
    tma's. tma_split is admitted where tma is, and never with clusters."""
    shape = parse_shape("mission")
    ctx = attention.context(shape)
    for cfg in SPLIT_CONFIGS:
        split, joint = space.config(cfg), space.config(_joint(cfg))
        assert tma_load_bytes(split) == 1024 + 16 * cfg["stages"] == tma_load_bytes(joint) + 8 * cfg["stages"]
        assert attention.geometry(split, shape).grid == attention.geometry(joint, shape).grid
        assert space.derive(split, ctx)["smem_bytes"] == attention.geometry(split, shape).dynamic_smem
        assert bool(space.violations(split, ctx)) == bool(space.violations(joint, ctx))
    assert space.violations(space.config(dict(SPLIT_CONFIGS[0], kv_cluster=2)), ctx)
    admitted = space.admitted_configs(ctx)
    assert sum(c["kv_load"] == "tma_split" and c["exp2_fma"] == 0 for c in admitted) == 2688


# --------------------------------------------------------------------------- GPU

SHAPES = ["mission", "2,3,200,333,64", "2,4,257,64:bshd", "1,4,1000,64:bf16:causal", "3,2,77,300,64:causal",
          "2,2,300,77,64:causal:bshd", "1,8,512,64:causal:kv4", "1,2,1,64"]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", SHAPES)
def test_split_loads_pass_the_gate_and_match_tma(attention, space, cfg, shape_text):
    """The full gate passes, and the output is bit for bit the kv_load = tma twin's."""
    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    if not space.admitted(config, attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    assert_gate_and_twin(attention, space, shape, cfg, _joint(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [SPLIT_CONFIGS[3], SPLIT_CONFIGS[4]], ids=_id)
def test_split_loads_with_log_sum_exp(attention, space, cfg):
    """The training variant (write_lse): O and the log-sum-exp are bit for bit the kv_load = tma kernel's."""
    shape = parse_shape("2,3,333,257,64:bf16:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, space, shape, cfg, _joint(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool, cfg", [(tool, cfg) for cfg in (SPLIT_CONFIGS[0], SPLIT_CONFIGS[2])
                                       for tool in ("memcheck", "synccheck", "racecheck")],
                         ids=lambda x: x if isinstance(x, str) else _id(x))
def test_sanitizers_clean(attention, space, tool, cfg):
    """memcheck, synccheck and racecheck find nothing in the split loads (K and V on their own barriers, slots
    refilled after the barrier) on a ragged causal shape."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,197,300,64:causal"), cfg, tool)
