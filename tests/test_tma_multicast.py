"""TMA multicast of the K/V tiles across a cluster of query tiles (knob kv_cluster, kernels/attention_tma_multicast.cuh).

CPU: the knob's sources (kv_cluster = 1 configs keep theirs, every one of the last mission search's; 2 and 4 inline the
header, take compile-time cluster dims and the cluster's trait), compiles for sm_90a without spills or local memory,
the grid padded to whole clusters, the maps' boxes (each CTA's part of a tile), shared memory (unchanged), the space's
constraint, the export's launch notes. GPU (marked): every code path passes the gate and gives bit for bit the output
of the same config with kv_cluster = 1 (the same tiles land in shared memory, the same math), with query tiles that
do not fill the last cluster, causal clusters whose CTAs share the last CTA's tile count, the log-sum-exp too; the
sanitizers find nothing."""

from __future__ import annotations

import pytest
from _variant_pairs import (assert_compiles_clean, assert_gate_and_twin, assert_lse_twin, assert_sanitizer_clean,
                            covering_sample)

from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import is_tma_multicast, kv_cluster
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_T = dict(mma="sync", kv_load="tma", smem_layout="swizzle", producer_warps=0, kv_splits=1)
# One per code path: the kv_load = tma mission winner (4 tiles, 3 stages: one refill behind a cluster barrier) in
# clusters of 2 and 4, every tile in the prologue (4 stages), a refill every step (1 stage, Q from shared memory),
# gather's merge (whose other key groups return before the exit wait), the smallest parts (16-row CTAs, 8-row parts).
MC_CONFIGS = [
    dict(_T, block_m=32, block_n=128, compute_warps=4, stages=3, q_in_regs=True, warp_key_groups=2, key_merge="split",
         pdl=True, kv_cluster=2),
    dict(_T, block_m=32, block_n=128, compute_warps=4, stages=3, q_in_regs=True, warp_key_groups=2, key_merge="split",
         pdl=True, kv_cluster=4),
    dict(_T, block_m=32, block_n=128, compute_warps=4, stages=4, q_in_regs=True, warp_key_groups=2, key_merge="split",
         kv_cluster=2),
    dict(_T, block_m=64, block_n=64, compute_warps=4, stages=1, q_in_regs=False, warp_key_groups=1, kv_cluster=2),
    dict(_T, block_m=128, block_n=64, compute_warps=8, stages=3, q_in_regs=True, warp_key_groups=2, kv_cluster=4),
    dict(_T, block_m=16, block_n=32, compute_warps=1, stages=2, q_in_regs=True, warp_key_groups=1, pdl=True,
         kv_cluster=4),
]


def _id(c: dict) -> str:
    return (f"M{c['block_m']}N{c['block_n']}cw{c['compute_warps']}kg{c['warp_key_groups']}st{c['stages']}"
            f"q{int(c['q_in_regs'])}c{c['kv_cluster']}")


def _alone(cfg: dict) -> dict:
    return dict(cfg, kv_cluster=1)


def test_kv_cluster_1_keeps_the_source(attention, space):
    """kv_cluster is the traits' template parameter KV_CLUSTER (kKVCluster): 1 is the same text as a config that does
    not name it, with no cluster declared on the entry."""
    shape = parse_shape("mission")
    for cfg in MC_CONFIGS:
        stated = instantiate(attention, space.config(_alone(cfg)), shape)
        unnamed = {k: v for k, v in cfg.items() if k != "kv_cluster"}
        assert instantiate(attention, space.config(unnamed), shape).code == stated.code
        assert "/* KV_CLUSTER = */ 1," in stated.code and "__cluster_dims__" not in stated.code


def test_every_single_cta_config_of_the_mission_search_keeps_its_source(attention):
    """Each kv_cluster = 1 config of attention-small-mc.yaml instantiates to the source of the same config in
    attention-small-tma.yaml, the space of the last mission search (so that run's figures hold for them); the space
    adds 378 configs each of clusters of 2 and 4 on the mission shape."""
    mc_space, tma_space = load_builtin("attention-small-mc"), load_builtin("attention-small-tma")
    shape = parse_shape("mission")
    ctx = attention.context(shape)
    oracle = set(tma_space.admitted_configs(ctx))
    admitted = mc_space.admitted_configs(ctx)
    alone = [c for c in admitted if c["kv_cluster"] == 1]
    assert len(alone) == len(oracle) == 1890
    assert [sum(c["kv_cluster"] == n for c in admitted) for n in (2, 4)] == [378, 378]
    for c in covering_sample(alone):
        same = tma_space.config({k: v for k, v in c.as_dict().items() if k != "kv_cluster"})
        assert same in oracle and instantiate(attention, c, shape).digest == instantiate(attention, same, shape).digest


def test_multicast_source(attention, space):
    """A kv_cluster config's source inlines the header (no include left), declares its cluster at compile time and in
    its traits, and calls the multicast init, first fill, refill and exit in place of the plain TMA ones."""
    src = instantiate(attention, space.config(MC_CONFIGS[1]), parse_shape("mission"))
    assert "// ---- begin attention_tma_multicast.cuh" in src.code and '#include "' not in src.code
    assert "__launch_bounds__(EvotuneTraits::kThreads) __cluster_dims__(4, 1, 1)" in src.code
    assert "/* KV_CLUSTER = */ 4," in src.code
    for call in ("tma_mc_init<T>(tma_bars", "tma_mc_first<T>(tma_bars", "tma_mc_refill<T>(tma_bars",
                 "tma_mc_loads_landed();", "tma_mc_exit_wait();", "kv_end = min(seq_k, tma_cluster_row_end<T>(q_row0));"):
        assert call in src.code, call
    assert src.code.count("if constexpr (T::kTmaMulticast)") >= 4  # ahead of the plain TMA ones at each step
    assert template_flag_names(src.code) == set()
    assert is_tma_multicast(space.config(MC_CONFIGS[1])) and kv_cluster(space.config(MC_CONFIGS[1])) == 4
    # kv_cluster means nothing without kv_load = tma
    assert kv_cluster(space.config(dict(MC_CONFIGS[1], kv_load="cp_async"))) == 1


@pytest.mark.parametrize("shape_text, clusters", [("mission", (16, 16, 16)), ("2,3,300,333,64:bshd", (10, 10, 12)),
                                                  ("1,2,1,64", (1, 2, 4))])
def test_grid_padded_to_whole_clusters(attention, space, shape_text, clusters):
    """The grid's x is the query tiles rounded up to whole clusters (32-row tiles: kv_cluster 1, 2, 4); y and z and
    the shared memory are kv_cluster = 1's."""
    shape = parse_shape(shape_text)
    base = space.config(_alone(MC_CONFIGS[0]))
    for n, x in zip((1, 2, 4), clusters):
        geo = attention.geometry(space.config(dict(MC_CONFIGS[0], kv_cluster=n)), shape)
        assert geo.grid == (x,) + attention.geometry(base, shape).grid[1:]
        assert geo.dynamic_smem == attention.geometry(base, shape).dynamic_smem


def test_tensor_map_boxes_are_each_ctas_part(attention, space):
    """Q's box is BLOCK_M rows; K's and V's are BLOCK_N / kv_cluster, the part each CTA multicasts."""
    shape = parse_shape("2,8,300,200,64:kv2:bshd")
    strides = {"q": (300 * 8 * 64, 64, 8 * 64, 1), "k": (200 * 2 * 64, 64, 2 * 64, 1), "v": (200 * 2 * 64, 64, 2 * 64, 1)}
    for cfg in MC_CONFIGS:
        maps = attention.tensor_map_args(space.config(cfg), shape, strides)
        assert maps["q"].box == (64, cfg["block_m"], 1, 1)
        assert maps["k"].box == maps["v"].box == (64, cfg["block_n"] // cfg["kv_cluster"], 1, 1)
        assert maps["k"].dims == (64, 200, 2, 2)


@pytest.mark.parametrize("cfg", MC_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", ["mission", "2,3,300,333,64:bf16:causal:bshd"])
def test_multicast_configs_compile_clean(attention, space, cfg, shape_text):
    """Every path compiles for sm_90a with no stack frame, no spill and within the static gate, and the cubin asks
    for its cluster (the entry's compile-time cluster dims)."""
    shape = parse_shape(shape_text)
    assert space.admitted(space.config(cfg), attention.context(shape))
    *_, geo = assert_compiles_clean(attention, space, shape, cfg)
    assert geo.grid[0] % cfg["kv_cluster"] == 0


def test_space_admits_clusters_only_with_tma_loads(attention, space):
    """kv_cluster 2 and 4 need kv_load = tma and no K/V split; every admitted one has an admitted kv_cluster = 1
    twin, and the full space admits 1392 + 1248 of them on the mission shape."""
    mission = attention.context(parse_shape("mission"))
    base = MC_CONFIGS[3]
    assert not space.violations(space.config(base), mission)
    for bad in (dict(kv_load="cp_async"), dict(kv_splits=2), dict(mma="wgmma", compute_warps=4)):
        assert space.violations(space.config(dict(base, **bad)), mission)
    assert space.violations(space.config(dict(base, block_n=16, kv_cluster=4)), mission)  # 4-row parts
    admitted = space.admitted_configs(mission)
    clustered = [c for c in admitted if c["kv_cluster"] > 1 and c["exp2_fma"] == 0]
    assert [sum(c["kv_cluster"] == n for c in clustered) for n in (2, 4)] == [1392, 1248]
    assert all(c["kv_load"] == "tma" and c["kv_splits"] == 1 for c in clustered)
    keys = set(admitted)
    assert all(space.config(_alone(c.as_dict())) in keys for c in clustered)


def test_export_notes_name_the_cluster(attention, space):
    """The standalone export's launch notes say the cluster is compile-time and the grid padded, and give the
    part-sized K/V boxes."""
    notes = "\n".join(attention.launch_notes(space.config(MC_CONFIGS[1]), parse_shape("2,3,300,333,64")))
    assert "__cluster_dims__(4, 1, 1)" in notes and "padded to a multiple of 4" in notes
    assert "64 x 32 (K, V)" in notes
    assert "kv_cluster" not in "\n".join(attention.launch_notes(space.config(_alone(MC_CONFIGS[1])),
                                                                  parse_shape("2,3,300,333,64")))


# --------------------------------------------------------------------------- GPU

# Ragged tails and Sq != Sk, query tiles that leave the last cluster short (300 rows: 10 tiles of 32), one query row
# (every other CTA of its cluster past the end), BSHD, causal clusters (the earlier CTAs run the last one's extra,
# wholly masked tiles), grouped K/V heads, bf16.
SHAPES = ["mission", "2,3,300,333,64", "2,4,257,64:bshd", "1,4,1000,64:bf16:causal", "3,2,77,300,64:causal",
          "2,2,300,77,64:causal:bshd", "1,8,512,64:causal:kv4", "1,2,1,64"]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", MC_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", SHAPES)
def test_multicast_passes_the_gate_and_matches_one_cta(attention, space, cfg, shape_text):
    """The full gate (stray writes, unwritten output, perturbations) passes, and the output is bit for bit the
    kv_cluster = 1 twin's."""
    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    assert space.admitted(config, attention.context(shape))
    assert_gate_and_twin(attention, space, shape, cfg, _alone(cfg))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [MC_CONFIGS[1], MC_CONFIGS[4]], ids=_id)
def test_multicast_with_log_sum_exp(attention, space, cfg):
    """The training variant (write_lse): O and the log-sum-exp are bit for bit the kv_cluster = 1 kernel's."""
    shape = parse_shape("2,3,333,257,64:bf16:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    assert_lse_twin(attention, space, shape, cfg, _alone(cfg))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool, cfg", [(tool, cfg) for cfg in (MC_CONFIGS[1], MC_CONFIGS[3])
                                       for tool in ("memcheck", "synccheck", "racecheck")],
                         ids=lambda x: x if isinstance(x, str) else _id(x))
def test_sanitizers_clean(attention, space, tool, cfg):
    """memcheck, synccheck and racecheck find nothing in the multicast loads (parts landing in peers, slots refilled
    after the cluster barrier, a padded cluster) on a ragged causal shape."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,197,300,64:causal"), cfg, tool)
