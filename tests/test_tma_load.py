"""TMA loads for the mma.sync kernel (knob kv_load = tma, kernels/attention_tma_load.cuh).

CPU: the knob's sources (cp_async configs keep theirs, every one of the mission search's; tma ones inline the header
and take three tensor maps), compiles for sm_90a without spills or local memory, shared memory (the launch, the traits
and the space's smem_bytes agree), the maps' boxes, the space's constraint, the phase-trace variant. GPU (marked):
every code path passes the gate and gives bit for bit the output of the same config with kv_load = cp_async (the same
tiles in shared memory, the same math), the log-sum-exp too; the sanitizers find nothing."""

from __future__ import annotations

import re

import pytest
from _paths import load_tool
from _variant_pairs import (assert_compiles_clean, assert_gate_and_twin, assert_lse_twin, assert_sanitizer_clean,
                            compile_config, covering_sample)

from evotune.build.compile import compile_source
from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import is_tma_load, tma_load_bytes
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_T = dict(mma="sync", kv_load="tma", smem_layout="swizzle", producer_warps=0)
# One per code path: every tile in the prologue (the mission winner: 4 tiles, 4 stages), refills with one, two and
# three stages, Q from registers or shared memory, key groups (gather and split merge), split-KV (with CTAs that get
# no tile on short sequences), the smallest tile, pdl.
TMA_CONFIGS = [
    dict(_T, block_m=32, block_n=128, compute_warps=4, stages=4, q_in_regs=True, kv_splits=1, warp_key_groups=2,
         key_merge="split", pdl=True),  # the mission winner (runs/mission-h100-exhaustive-small-merge) with TMA loads
    dict(_T, block_m=64, block_n=64, compute_warps=4, stages=1, q_in_regs=False, kv_splits=1, warp_key_groups=1),
    dict(_T, block_m=128, block_n=64, compute_warps=8, stages=3, q_in_regs=True, kv_splits=1, warp_key_groups=2),
    dict(_T, block_m=64, block_n=128, compute_warps=4, stages=2, q_in_regs=True, kv_splits=4, warp_key_groups=1),
    dict(_T, block_m=16, block_n=32, compute_warps=1, stages=2, q_in_regs=True, kv_splits=1, warp_key_groups=1,
         pdl=True),
]


def _id(c: dict) -> str:
    return (f"M{c['block_m']}N{c['block_n']}cw{c['compute_warps']}kg{c['warp_key_groups']}kv{c['kv_splits']}"
            f"st{c['stages']}q{int(c['q_in_regs'])}")


def _static_smem(ptxas_log: str) -> int:
    found = re.search(r"(\d+) bytes smem", ptxas_log)
    return int(found.group(1)) if found else 0


def _cp_async(cfg: dict) -> dict:
    return dict(cfg, kv_load="cp_async", **({"kv_cluster": 1} if "kv_cluster" in cfg else {}))


def test_cp_async_configs_keep_their_source(attention, space):
    """kv_load is the traits' template parameter KV_LOAD (kKvLoad): cp_async passes 0 and is the same text as a config
    that does not name it, with null maps passed on (the entry takes none); no flag markers."""
    shape = parse_shape("mission")
    for cfg in TMA_CONFIGS:
        stated = instantiate(attention, space.config(_cp_async(cfg)), shape)
        unnamed = {k: v for k, v in cfg.items() if k != "kv_load"}
        assert instantiate(attention, space.config(unnamed), shape).code == stated.code
        assert "/* KV_LOAD = */ 0," in stated.code and "&q_map" not in stated.code
        assert "nullptr, nullptr, nullptr, kv_magic" in stated.code and "CUtensorMap q_map" not in stated.code
        assert template_flag_names(stated.code) == set()


def test_every_cp_async_config_of_the_mission_search_keeps_its_source(attention):
    """Each cp_async config of attention-small-tma.yaml instantiates to the source of the same config in
    attention-small-merge.yaml, the space of the last mission search (so that run's figures hold for them); the
    space adds 378 tma configs on the mission shape."""
    tma_space, merge = load_builtin("attention-small-tma"), load_builtin("attention-small-merge")
    shape = parse_shape("mission")
    ctx = attention.context(shape)
    oracle = set(merge.admitted_configs(ctx))
    admitted = tma_space.admitted_configs(ctx)
    copies = [c for c in admitted if c["kv_load"] == "cp_async"]
    assert len(copies) == len(oracle) == 1512
    assert len(admitted) - len(copies) == 378
    for c in covering_sample(copies):
        same = merge.config({k: v for k, v in c.as_dict().items() if k != "kv_load"})
        assert same in oracle and instantiate(attention, c, shape).digest == instantiate(attention, same, shape).digest


def test_tma_source_inlines_its_header_and_takes_maps(attention, space):
    """A tma config's source has the header inlined (no include left), the cp.async prologue and waits compiled out,
    traits with the extra shared memory, an entry that takes the three maps by value, and no flag markers."""
    src = instantiate(attention, space.config(TMA_CONFIGS[0]), parse_shape("mission"))
    assert "// ---- begin attention_tma_load.cuh" in src.code and '#include "' not in src.code
    assert "kSmemBytes = EvotuneBaseTraits::kSmemBytes - kMergeBytes + evotune::SplitMerge<EvotuneBaseTraits>::kBytes" \
           " + evotune::TmaLoad<EvotuneBaseTraits>::kExtraBytes" in src.code
    assert "const __grid_constant__ CUtensorMap q_map" in src.code and "&q_map, &k_map, &v_map, kv_magic" in src.code
    assert "/* KV_LOAD = */ 1," in src.code and "if constexpr (T::kTmaLoad) {" in src.code
    assert template_flag_names(src.code) == set()


def test_entry_parameters(attention, space):
    """The entry's parameter list (both launch paths read it) appends the maps after kv_magic, before the
    log-sum-exp's; a cp_async config's is unchanged."""
    tma, copies = space.config(TMA_CONFIGS[0]), space.config(_cp_async(TMA_CONFIGS[0]))
    assert attention.entry_params(tma)[:-3] == attention.entry_params(copies)
    assert attention.entry_params(tma)[-4:] == (("kv_magic", "u32"), ("q_map", "map"), ("k_map", "map"),
                                                ("v_map", "map"))
    assert attention.entry_params(tma, write_lse=True)[-3:] == (("lse", "ptr"), ("lse_sb", "i64"), ("lse_sh", "i64"))
    assert is_tma_load(tma) and not is_tma_load(copies)


def test_tensor_map_boxes(attention, space):
    """Q's box is BLOCK_M rows, K's and V's BLOCK_N, each 64 columns; K and V span the K/V heads (grouped-query)."""
    shape = parse_shape("2,8,300,200,64:kv2:bshd")
    for cfg in TMA_CONFIGS:
        config = space.config(cfg)
        strides = {"q": (300 * 8 * 64, 64, 8 * 64, 1), "k": (200 * 2 * 64, 64, 2 * 64, 1), "v": (200 * 2 * 64, 64, 2 * 64, 1)}
        maps = attention.tensor_map_args(config, shape, strides)
        assert list(maps) == ["q", "k", "v"]
        assert maps["q"].box == (64, cfg["block_m"], 1, 1) and maps["q"].dims == (64, 300, 8, 2)
        assert maps["k"].box == maps["v"].box == (64, cfg["block_n"], 1, 1) and maps["k"].dims == (64, 200, 2, 2)
        assert maps["k"].strides == (2 * 64 * 2, 64 * 2, 200 * 2 * 64 * 2)


@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", ["mission", "2,3,300,333,64:bf16:causal:bshd"])
def test_tma_configs_compile_clean(attention, space, cfg, shape_text):
    """Every path compiles for sm_90a with no stack frame, no spill and within the static gate, and with the static
    shared memory of its cp_async twin (the barriers are in the launch's; split-KV has a flag of its own)."""
    shape = parse_shape(shape_text)
    if not space.admitted(space.config(cfg), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    _, compiled, _ = assert_compiles_clean(attention, space, shape, cfg)
    *_, twin = compile_config(attention, space, shape, _cp_async(cfg))
    assert _static_smem(compiled.log) == _static_smem(twin.log)


def test_shared_memory(attention, space):
    """TMA loads add an mbarrier per stage and 1024 bytes of alignment slack to the launch's shared memory (the
    instantiation asserts that the traits agree), and the space's smem_bytes counts the same."""
    for shape_text in ("mission", "1,4,1000,64:bf16:causal"):
        shape = parse_shape(shape_text)
        ctx = attention.context(shape)
        for cfg in TMA_CONFIGS:
            tma, copies = space.config(cfg), space.config(_cp_async(cfg))
            assert tma_load_bytes(tma) == 1024 + 8 * cfg["stages"] and tma_load_bytes(copies) == 0
            assert (attention.geometry(tma, shape).dynamic_smem - attention.geometry(copies, shape).dynamic_smem
                    == tma_load_bytes(tma))
            for c in (tma, copies):
                assert space.derive(c, ctx)["smem_bytes"] == attention.geometry(c, shape).dynamic_smem


def test_space_admits_tma_only_where_the_layout_is_tmas(attention, space):
    """tma needs mma.sync, head dim 64, the swizzled layout and no producer warps; every admitted tma config has an
    admitted cp_async twin."""
    mission, d128 = attention.context(parse_shape("mission")), attention.context(parse_shape("1,8,512,128"))
    base = TMA_CONFIGS[1]
    assert not space.violations(space.config(base), mission)
    for bad in (dict(smem_layout="pad"), dict(smem_layout="plain"), dict(producer_warps=1)):
        assert space.violations(space.config(dict(base, **bad)), mission)
    assert space.violations(space.config(base), d128)
    assert space.violations(space.config(dict(kv_load="tma", mma="wgmma", block_m=64, compute_warps=4)), mission)
    admitted = space.admitted_configs(mission)
    tma = [c for c in admitted if c["kv_load"] == "tma"]
    assert tma and all(c["mma"] == "sync" and c["smem_layout"] == "swizzle" and c["producer_warps"] == 0 for c in tma)
    keys = set(admitted)
    assert all(space.config(_cp_async(c.as_dict())) in keys for c in tma)


def test_trace_variant_stamps_the_tma_wait(attention):
    """tools/phase_trace.py's variant of a tma config stamps the barrier wait (a `//[trace_tma]` line: both flags)
    and compiles; its cp_async twin has no such line."""
    traced, space = load_tool("phase_trace").TracedAttention(), load_builtin("attention")
    shape = parse_shape("mission")
    tma = instantiate(traced, space.config(TMA_CONFIGS[0]), shape)
    copies = instantiate(traced, space.config(_cp_async(TMA_CONFIGS[0])), shape)
    stamp = "tma_wait_tile<T>(tma_bars, i);\n            tracer.mark_tile(i, trace::kWait);"
    assert stamp in tma.code and stamp not in copies.code
    res = compile_source(tma.code, tma.entry).resources
    assert res.stack_frame == 0 and res.spill_stores == 0


# --------------------------------------------------------------------------- GPU

SHAPES = ["mission", "2,3,200,333,64", "2,4,257,64:bshd", "1,4,1000,64:bf16:causal", "3,2,77,300,64:causal",
          "2,2,300,77,64:causal:bshd", "1,8,512,64:causal:kv4", "1,2,1,64"]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", SHAPES)
def test_tma_loads_pass_the_gate_and_match_cp_async(attention, space, cfg, shape_text):
    """The full gate (stray writes, unwritten output, perturbations) passes, and the output is bit for bit the
    cp_async twin's: ragged tails (the maps' zero fill), Sq != Sk, BSHD, causal, grouped heads, bf16, split-KV CTAs
    with no tile, S = 1."""
    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    if not space.admitted(config, attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    assert_gate_and_twin(attention, space, shape, cfg, _cp_async(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [TMA_CONFIGS[2], TMA_CONFIGS[3]], ids=_id)
def test_tma_loads_with_log_sum_exp(attention, space, cfg):
    """The training variant (write_lse): O and the log-sum-exp are bit for bit the cp_async kernel's."""
    shape = parse_shape("2,3,333,257,64:bf16:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, space, shape, cfg, _cp_async(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool, cfg", [(tool, cfg) for cfg in (TMA_CONFIGS[0], TMA_CONFIGS[2])
                                       for tool in ("memcheck", "synccheck", "racecheck")],
                         ids=lambda x: x if isinstance(x, str) else _id(x))
def test_sanitizers_clean(attention, space, tool, cfg):
    """memcheck, synccheck and racecheck find nothing in the TMA loads (the maps' out-of-bounds rows, slots refilled
    after the barrier) on a ragged causal shape."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,197,300,64:causal"), cfg, tool)
