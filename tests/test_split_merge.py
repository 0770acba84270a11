"""The key groups' split merge (knob key_merge = split, kernels/attention_split_merge.cuh).

CPU: the knob's sources (gather configs keep theirs, split ones inline the header), compiles for sm_90a without
spills or local memory, shared memory (the launch, the traits and the space's smem_bytes agree), the space's
constraint, the phase-trace variant. GPU (marked): every code path passes the gate and agrees with the same config
with key_merge = gather to the rounding of the merge (see _assert_agree), with the log-sum-exp too; the sanitizers
find nothing."""

from __future__ import annotations


import pytest
from _paths import load_tool
from _variant_pairs import assert_sanitizer_clean, compile_config, covering_sample, run_configs

from evotune.build.compile import compile_source, static_violations
from evotune.build.template import instantiate, template_flag_names
from evotune.problems.attention import merge_bytes
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

_S = dict(mma="sync", kv_splits=1, key_merge="split")
# One per code path: two and four key groups, one and two 16-row tiles per warp, a producer warp or not, swizzled and
# padded tiles, Q in registers or shared memory, one stage, pdl.
SPLIT_CONFIGS = [
    dict(_S, block_m=32, block_n=128, compute_warps=4, producer_warps=0, stages=4, smem_layout="swizzle",
         q_in_regs=True, warp_key_groups=2, pdl=True),  # the mission winner's tiling (runs/mission-h100-exhaustive-small-pdl)
    dict(_S, block_m=32, block_n=128, compute_warps=8, producer_warps=0, stages=3, smem_layout="swizzle",
         q_in_regs=True, warp_key_groups=4),
    dict(_S, block_m=64, block_n=64, compute_warps=4, producer_warps=2, stages=2, smem_layout="pad",
         q_in_regs=False, warp_key_groups=2),
    dict(_S, block_m=64, block_n=128, compute_warps=8, producer_warps=0, stages=1, smem_layout="plain",
         q_in_regs=True, warp_key_groups=4),
    dict(_S, block_m=128, block_n=64, compute_warps=8, producer_warps=1, stages=2, smem_layout="swizzle",
         q_in_regs=False, warp_key_groups=2),
]


def _id(c: dict) -> str:
    return (f"M{c['block_m']}N{c['block_n']}cw{c['compute_warps']}kg{c['warp_key_groups']}pw{c['producer_warps']}"
            f"st{c['stages']}{c['smem_layout']}q{int(c['q_in_regs'])}")


def _gather(cfg: dict) -> dict:
    return dict(cfg, key_merge="gather")


def test_key_merge_is_a_traits_parameter(attention, space):
    """key_merge is the traits' template parameter SPLIT_MERGE (kSplitMerge): gather passes false and is the same text
    as a config that does not name it, split passes true; no flag markers in either."""
    shape = parse_shape("mission")
    for cfg in SPLIT_CONFIGS:
        stated = instantiate(attention, space.config(_gather(cfg)), shape)
        unnamed = {k: v for k, v in cfg.items() if k != "key_merge"}
        assert instantiate(attention, space.config(unnamed), shape).code == stated.code
        assert "/* SPLIT_MERGE = */ false," in stated.code
        assert template_flag_names(stated.code) == set()
        split = instantiate(attention, space.config(cfg), shape).code
        assert "/* SPLIT_MERGE = */ true," in split and template_flag_names(split) == set()


def test_every_gather_config_of_the_mission_search_keeps_its_source(attention):
    """Each gather config of attention-small-merge.yaml instantiates to the source of the same config in
    attention-small-pdl.yaml, the space its oracle measured (so that run's figures hold for them)."""
    merge, pdl = load_builtin("attention-small-merge"), load_builtin("attention-small-pdl")
    shape = parse_shape("mission")
    ctx = attention.context(shape)
    oracle = set(pdl.admitted_configs(ctx))
    gathered = [c for c in merge.admitted_configs(ctx) if c["key_merge"] == "gather"]
    assert len(gathered) == len(oracle) == 912
    for c in covering_sample(gathered):
        same = pdl.config({k: v for k, v in c.as_dict().items() if k != "key_merge"})
        assert same in oracle and instantiate(attention, c, shape).digest == instantiate(attention, same, shape).digest


def test_split_source_inlines_its_header(attention, space):
    """A split config's source has the header inlined (no include left), the split merge and gather's as the two
    branches of `if constexpr (T::kSplitMerge)`, traits whose shared memory is the split slots', and no flag markers."""
    src = instantiate(attention, space.config(SPLIT_CONFIGS[0]), parse_shape("mission"))
    assert "// ---- begin attention_split_merge.cuh" in src.code and '#include "' not in src.code
    assert "struct EvotuneTraits : EvotuneBaseTraits" in src.code
    assert "write_split_partial<T>(o_acc" in src.code and "if constexpr (T::kSplitMerge) {" in src.code
    assert template_flag_names(src.code) == set()


@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", ["mission", "2,3,300,333,128:bf16:causal:bshd"])
def test_split_configs_compile_clean(attention, space, cfg, shape_text):
    """Every path compiles for sm_90a with no stack frame (a runtime index into O would put it in local memory) and
    within the static gate wherever the gather twin is."""
    shape = parse_shape(shape_text)
    if not space.admitted(space.config(cfg), attention.context(shape)):
        pytest.skip("config not admitted for this shape (shared memory, accumulator registers)")
    config, _, compiled = compile_config(attention, space, shape, cfg)
    geo = attention.geometry(config, shape)
    gather_config, _, gather = compile_config(attention, space, shape, _gather(cfg))
    if static_violations(gather.resources, geo.threads, attention.geometry(gather_config, shape).dynamic_smem):
        pytest.skip(f"the gather twin spills too: {gather.resources}")  # d128 with producer warps: 168 registers
    res = compiled.resources
    assert res.stack_frame == 0 and res.spill_stores == 0, res
    assert not static_violations(res, geo.threads, geo.dynamic_smem)


def test_shared_memory(attention, space):
    """The split slots replace gather's in the launch's shared memory (the instantiation asserts that the traits
    agree), and the space's smem_bytes counts the same."""
    for shape_text in ("mission", "1,4,1000,128:bf16:causal"):
        shape = parse_shape(shape_text)
        ctx = attention.context(shape)
        for cfg in SPLIT_CONFIGS:
            split, gather = space.config(cfg), space.config(_gather(cfg))
            g, m, d = cfg["warp_key_groups"], cfg["block_m"], shape.head_dim
            assert merge_bytes(gather, shape) == 4 * (g - 1) * m * (d + 2)
            assert merge_bytes(split, shape) == 4 * ((g - 1) * m * (d + 8) + 2 * g * m)
            assert (attention.geometry(split, shape).dynamic_smem - attention.geometry(gather, shape).dynamic_smem
                    == merge_bytes(split, shape) - merge_bytes(gather, shape))
            for c in (split, gather):
                assert space.derive(c, ctx)["smem_bytes"] == attention.geometry(c, shape).dynamic_smem


def test_space_admits_split_only_with_key_groups(attention, space):
    """split needs two or more key groups dividing the head dim's 8-column blocks (so never wgmma); every admitted
    split config has a gather twin that is admitted too; the mission search space adds 600 split configs."""
    ctx = attention.context(parse_shape("mission"))
    assert space.violations(space.config(dict(key_merge="split")), ctx)  # one key group
    assert space.violations(space.config(dict(SPLIT_CONFIGS[0], warp_key_groups=1, compute_warps=2)), ctx)
    admitted = space.admitted_configs(ctx)
    split = [c for c in admitted if c["key_merge"] == "split"]
    assert split and all(c["mma"] == "sync" and c["warp_key_groups"] > 1 for c in split)
    keys = set(admitted)
    assert all(space.config(_gather(c.as_dict())) in keys for c in split)
    merge = load_builtin("attention-small-merge")
    assert sum(c["key_merge"] == "split" for c in merge.admitted_configs(ctx)) == 600


def test_trace_variant_stamps_the_split_merge(attention):
    """tools/phase_trace.py's variant of a split config keeps the split path's stamps (`//[trace_split]` lines:
    both flags), compiles, and its gather twin has none of them."""
    traced, space = load_tool("phase_trace").TracedAttention(), load_builtin("attention")
    shape = parse_shape("mission")
    split = instantiate(traced, space.config(SPLIT_CONFIGS[0]), shape)
    gather = instantiate(traced, space.config(_gather(SPLIT_CONFIGS[0])), shape)
    assert "split_last_merged<T>(o_acc, key_group)" in split.code
    assert "split_last_merged<T>(o_acc, key_group)" not in gather.code
    res = compile_source(split.code, split.entry).resources
    assert res.stack_frame == 0 and res.spill_stores == 0


# --------------------------------------------------------------------------- GPU

SHAPES = ["mission", "2,3,200,333,64", "2,4,257,64:bshd", "1,4,1000,128:bf16:causal", "3,2,77,300,128:causal",
          "2,2,300,77,64:causal:bshd", "1,8,512,64:causal:kv4", "1,2,1,64"]


def _assert_agree(split, gather, dtype: str) -> None:
    """split's O equals gather's to within two units in the last place of the output (1e-5 absolute where the groups'
    terms cancel). Not bitwise: both merges sum the same terms in the same order, but ptxas contracts a different
    product of each `a * w0 + w1 * b` into the FMA, element by element (gather's SASS does both within one row), so
    the fp32 sums can differ by a rounding. A wrong slot, weight or column would be off by O(0.1)."""
    import torch

    a, b = split.float(), gather.float()
    ulp = 2.0 ** (-10 if dtype == "fp16" else -7)  # relative spacing of the output's values
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    bad = (a - b).abs() > 2 * ulp * torch.maximum(a.abs(), b.abs()) + 1e-5
    assert not bad.any(), f"{int(bad.sum())} elements differ, max {float((a - b).abs().max()):.3g}"


def _run_pair(attention, space, shape, cfg, seed=5, lse=False):
    """([split output, gather output], [split lse, gather lse] or Nones): _variant_pairs.run_configs of the config
    and its gather twin."""
    outs, lses, _ = run_configs(attention, space, shape, (cfg, _gather(cfg)), seed, lse)
    return outs, lses


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SPLIT_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", SHAPES)
def test_split_merge_passes_the_gate_and_matches_gather(attention, space, cfg, shape_text):
    """The full gate (stray writes, unwritten output, perturbations) passes, and the output agrees with gather's to
    the merge's rounding: ragged tails, Sq != Sk, BSHD, causal (groups with no unmasked key), grouped heads, bf16,
    d128, S = 1."""
    from evotune.gpu.evaluate import evaluate_compiled
    from evotune.records import result as R

    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    if not space.admitted(config, attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    *_, compiled = compile_config(attention, space, shape, cfg)
    res = evaluate_compiled(attention, shape, config, compiled, time_it=False)
    if res.status == R.PRUNED:  # d128 with producer warps spills with either merge
        gather_config, _, gather = compile_config(attention, space, shape, _gather(cfg))
        assert evaluate_compiled(attention, shape, gather_config, gather, time_it=False).status == R.PRUNED, res.message
        pytest.skip(f"pruned by the static gate with either merge: {res.message}")
    assert res.status == R.OK, res.message
    (split, gather), _ = _run_pair(attention, space, shape, cfg)
    _assert_agree(split, gather, shape.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [SPLIT_CONFIGS[3], SPLIT_CONFIGS[4]], ids=_id)
def test_split_merge_with_log_sum_exp(attention, space, cfg):
    """The training variant (write_lse): O and the log-sum-exp agree with the gather kernel's (the row sums too
    may differ by an fp32 rounding)."""
    import torch

    shape = parse_shape("2,3,333,257,128:bf16:causal")
    assert space.admitted(space.config(cfg), attention.context(shape))
    (split, gather), (lse_split, lse_gather) = _run_pair(attention, space, shape, cfg, lse=True)
    _assert_agree(split, gather, shape.dtype)
    assert torch.isfinite(lse_split).all() and torch.allclose(lse_split, lse_gather, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool, cfg", [(tool, SPLIT_CONFIGS[0]) for tool in ("memcheck", "synccheck", "racecheck")]
                         + [(tool, SPLIT_CONFIGS[4]) for tool in ("memcheck", "synccheck")],
                         ids=lambda x: x if isinstance(x, str) else _id(x))
def test_sanitizers_clean(attention, space, tool, cfg):
    """memcheck, synccheck and racecheck find nothing in the split merge (the slots written and read across warps,
    the Q tile restaged by two warps per row) on a ragged causal shape. racecheck is not asked of the producer-warp
    config: it reports the producer's cp.async into a K/V slot the consumers released with bar.arrive, with either
    merge (docs/data/split-merge/race.txt: the same 16 reports with gather), a handoff the PTX ISA orders that
    tools/racecheck_probe.py reproduces on a race-free kernel (tests/test_gpu.py, docs/CORRECTNESS.md)."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,197,300,64:causal"), cfg, tool)
