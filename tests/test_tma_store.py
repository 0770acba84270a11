"""The Hopper variant's TMA-store epilogue (knob epilogue = tma, kernels/hopper/epilogue.cuh).

CPU: the knob's sources, compiles for sm_90a (no spills, wgmma kept asynchronous, TMA stores in the SASS), shared
memory, entry parameters and O's tensor map, and the knob as a traits parameter. GPU (marked): every
code path passes the gate and writes bit for bit the output of the same config with epilogue = regs, eager, through
the op's prepared launch and with the log-sum-exp; the sanitizers find nothing."""

from __future__ import annotations

import math

import pytest
from _variant_pairs import assert_sanitizer_clean, compile_config, run_configs, serialised_notes

from evotune.build.compile import compile_source, static_violations
from evotune.build.template import instantiate, template_flag_names
from evotune.problems.shapes import parse_shape

_W = dict(mma="wgmma", smem_layout="swizzle", epilogue="tma")
# One per code path: one to three consumer warpgroups, producer warpgroup or not, ping-pong, Q in registers or
# shared memory, persistent (own staging tile) or not (Q's buffer), 176-key tiles, d64 and d128.
TMA_CONFIGS = [
    dict(_W, block_m=64, block_n=64, compute_warps=4, producer_warps=0, stages=2, q_in_regs=False),
    dict(_W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False),
    dict(_W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=3, q_in_regs=True, pingpong=True),
    dict(_W, block_m=192, block_n=64, compute_warps=12, producer_warps=4, stages=2, q_in_regs=True),
    dict(_W, block_m=128, block_n=176, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False),
    dict(_W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False, persistent=True),
    dict(_W, block_m=192, block_n=64, compute_warps=12, producer_warps=4, stages=3, q_in_regs=False, persistent=True),
    dict(_W, block_m=64, block_n=64, compute_warps=4, producer_warps=4, stages=1, q_in_regs=False, persistent=True),
]


def _id(c: dict) -> str:
    return (f"M{c['block_m']}N{c['block_n']}pw{c['producer_warps']}st{c['stages']}q{int(c['q_in_regs'])}"
            + ("pp" if c.get("pingpong") else "") + ("-persistent" if c.get("persistent") else ""))


def _regs(cfg: dict) -> dict:
    return dict(cfg, epilogue="regs")


def test_epilogue_is_a_traits_parameter(attention, space):
    """epilogue is the Hopper traits' template parameter TMA_STORE (kTmaStore, read by `if constexpr`): regs is the same
    source as a config that does not name it, passes a null o_map and takes no o_map parameter."""
    shape = parse_shape("gpt2")
    for cfg in TMA_CONFIGS:
        stated = instantiate(attention, space.config(_regs(cfg)), shape)
        unnamed = {k: v for k, v in _regs(cfg).items() if k != "epilogue"}
        assert instantiate(attention, space.config(unnamed), shape).code == stated.code
        assert "/* TMA_STORE = */ false," in stated.code and "tile_counter, nullptr)" in stated.code
        assert "CUtensorMap o_map" not in stated.code
        assert template_flag_names(stated.code) == set()


def test_tma_source_inlines_its_header(attention, space):
    """A tma config's source has the epilogue's header inlined (no include left), O's map as a by-value parameter
    passed on to the kernel, and no flag markers."""
    src = instantiate(attention, space.config(TMA_CONFIGS[1]), parse_shape("gpt2"))
    assert "// ---- begin hopper/epilogue.cuh" in src.code and '#include "' not in src.code
    assert "const __grid_constant__ CUtensorMap o_map" in src.code and "tile_counter, &o_map)" in src.code
    assert "/* TMA_STORE = */ true," in src.code
    assert template_flag_names(src.code) == set()
    assert "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group" in src.code


@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", ["16,12,1024,64", "2,3,300,333,128:bf16:causal:bshd"])
def test_tma_configs_compile_clean(attention, space, cfg, shape_text):
    """Every path compiles for sm_90a with wgmma still asynchronous, and within the static gate (no spills) wherever
    the same config with epilogue = regs is (three d128 warpgroups with Q in registers spill either way)."""
    shape = parse_shape(shape_text)
    config, _, compiled = compile_config(attention, space, shape, cfg)
    geo = attention.geometry(config, shape)
    regs_config, _, regs = compile_config(attention, space, shape, _regs(cfg))
    if not static_violations(regs.resources, geo.threads, attention.geometry(regs_config, shape).dynamic_smem):
        assert static_violations(compiled.resources, geo.threads, geo.dynamic_smem) == []
    assert not serialised_notes(compiled)


def test_sass_has_tma_stores(attention, space, cuobjdump):
    """The tma config's SASS stores through TMA (UTMASTG) and waits for it; the regs config's has none."""
    from evotune.build.sass import disassemble, summary

    shape = parse_shape("gpt2")
    for cfg, stores in ((TMA_CONFIGS[5], True), (_regs(TMA_CONFIGS[5]), False)):
        *_, compiled = compile_config(attention, space, shape, cfg)
        info = summary(disassemble(compiled.cubin_path))
        assert (info["classes"].get("UTMASTG", 0) > 0) == stores, info["classes"]
        assert info["local_memory"] == 0


def test_staging_shared_memory(attention, space):
    """One tile per CTA stages O in Q's buffer (no more shared memory); a persistent CTA in a tile of its own
    (kQBytes more), which the space's smem_bytes counts as well, and the instantiation asserts."""
    shape = parse_shape("gpt2")
    ctx = attention.context(shape)
    for cfg in (TMA_CONFIGS[1], TMA_CONFIGS[5]):
        tma, regs = space.config(cfg), space.config(_regs(cfg))
        extra = 2 * 64 * 128 if cfg.get("persistent") else 0
        assert attention.geometry(tma, shape).dynamic_smem == attention.geometry(regs, shape).dynamic_smem + extra
        assert space.derive(tma, ctx)["smem_bytes"] == attention.geometry(tma, shape).dynamic_smem
    src = instantiate(attention, space.config(TMA_CONFIGS[5]), shape)
    assert "struct EvotuneTraits : EvotuneBaseTraits" in src.code


def test_space_admits_tma_only_for_wgmma(attention, space):
    """The mma.sync variant has no TMA-store epilogue; a persistent tma config whose staging tile overflows shared
    memory is not admitted (and fails to compile: the instantiation asserts the limit)."""
    ctx = attention.context(parse_shape("llama-4k-causal"))
    assert space.violations(space.config(dict(epilogue="tma")), ctx)
    big = dict(_W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=3, q_in_regs=False,
               persistent=True)
    assert not space.violations(space.config(_regs(big)), ctx)
    assert any("shared-memory" in v or "smem" in v for v in space.violations(space.config(big), ctx))


def test_entry_params_and_maps(attention, space, monkeypatch):
    """A tma launch passes O's tensor map after tile_counter: rank 4 over the output's own strides (BSHD here), a
    box of 64 columns by 64 rows (one warpgroup's), seq_q rows (the tail past them is clipped, not written)."""
    import numpy as np

    import evotune.build.compile
    import evotune.build.tma as tma

    shape = parse_shape("1,2,197,300,64:causal:bshd")
    config = space.config(TMA_CONFIGS[1])
    params = attention.entry_params(config)
    assert [n for n, _ in params][-2:] == ["tile_counter", "o_map"] and params[-1][1] == "map"
    assert [n for n, _ in attention.entry_params(config, write_lse=True)][-4:] == ["o_map", "lse", "lse_sb", "lse_sh"]
    assert "o_map" not in [n for n, _ in attention.entry_params(space.config(_regs(TMA_CONFIGS[1])))]

    encoded = []
    monkeypatch.setattr(tma, "encode_tiled", lambda address, args: encoded.append((address, args)) or bytes(128))
    tma.map_param.cache_clear()
    launched = []
    monkeypatch.setattr(evotune.build.compile, "torch_stream_launcher",
                        lambda kernel, grid, block, args, smem, keep=(), pdl=False: launched.append(args))
    inputs = attention.make_inputs(shape, 0, device="cpu")
    out = attention.new_output(inputs)
    attention.launcher(None, config, shape, inputs, out)
    assert len(encoded) == 4 and encoded[3][0] == out.data_ptr()
    o_args = encoded[3][1]
    assert o_args.dims == (64, 197, 2, 1) and o_args.box == (64, 64, 1, 1)
    assert o_args.strides == tuple(2 * s for s in (out.stride(2), out.stride(1), out.stride(0)))
    args = launched[-1]
    assert len(args) == 15 and isinstance(args[14], np.ndarray) and args[14].itemsize == 128
    tma.map_param.cache_clear()


def test_export_names_the_o_map(attention, space):
    """An exported tma config's header names O's map among the ones to build, and its signature."""
    from evotune.build.export import export_source

    text = export_source(attention, parse_shape("gpt2"), space.config(TMA_CONFIGS[5]))
    header = [line for line in text.splitlines() if line.startswith("// ")][:14]
    assert any("64 x 64 (O: epilogue = tma" in line for line in header)
    assert any("CUtensorMap o_map" in line for line in header)


def test_table_entry_recorded_before_the_knob_stays_usable(attention):
    """A tuning-table entry whose config predates the knob (no epilogue named) is the regs kernel: it is not
    refused for naming fewer parameters than its space now has, while one that lacks a knob which is not late,
    or names a digest of another source, still is."""
    from _tables import entry
    from evotune.records import tuning_table as T

    shape = parse_shape("gpt2")
    space = "search_spaces/attention-hopper3.yaml"
    recorded = dict(mma="wgmma", block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=4,
                    q_in_regs=False, pingpong=False, persistent=True)  # runs/gpt2-h100-persistent's best
    T.clear_caches()
    assert T.unusable_reason(entry(shape, recorded, space=space), shape) is None
    assert "not the parameters of space" in T.unusable_reason(
        entry(shape, {k: v for k, v in recorded.items() if k != "stages"}, space=space), shape)
    assert "stale" in T.unusable_reason(entry(shape, recorded, space=space, digest="0" * 16), shape)
    assert T._default_is(T._space(space), "epilogue", "regs") and not T._default_is(T._space(space), "epilogue", "tma")


# ------------------------------------------------------------------------------------------------ GPU

SHAPES = ["16,12,1024,64", "2,3,200,333,64", "2,4,257,64:bshd", "1,4,1000,128:bf16:causal",
          "3,2,77,300,128:causal", "2,2,300,77,64:causal:bshd", "1,8,512,64:causal:kv4", "1,2,1,64"]


@pytest.fixture
def few_ctas(monkeypatch):
    """Persistent launches get 3 CTAs, so that each walks several query tiles and reuses its staging tile."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "3")


def _run_pair(attention, space, shape, cfg, seed=5, lse=False):
    """([tma output, regs output], [tma lse, regs lse] or Nones, inputs): _variant_pairs.run_configs of the config
    and its regs twin."""
    return run_configs(attention, space, shape, (cfg, _regs(cfg)), seed, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=_id)
@pytest.mark.parametrize("shape_text", SHAPES)
def test_tma_epilogue_passes_the_gate_and_matches_regs(attention, space, few_ctas, cfg, shape_text):
    """The full gate (stray writes, unwritten output, perturbations) passes, and the output is bit for bit the
    regs epilogue's (the same rounding of O / l): ragged tails clipped by TMA, BSHD, causal, grouped heads, S=1."""
    import torch

    from evotune.gpu.evaluate import evaluate_compiled
    from evotune.records import result as R

    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    if not space.admitted(config, dict(attention.context(shape), multiprocessors=0)):
        pytest.skip("config not admitted for this shape")
    *_, compiled = compile_config(attention, space, shape, cfg)
    res = evaluate_compiled(attention, shape, config, compiled, time_it=False)
    if res.status == R.PRUNED:  # three d128 warpgroups with Q in registers spill with either epilogue
        regs_config, _, regs = compile_config(attention, space, shape, _regs(cfg))
        assert evaluate_compiled(attention, shape, regs_config, regs, time_it=False).status == R.PRUNED, res.message
        pytest.skip(f"pruned by the static gate with either epilogue: {res.message}")
    assert res.status == R.OK, res.message
    (tma, regs), _, _ = _run_pair(attention, space, shape, cfg)
    assert torch.equal(tma.view(torch.int16), regs.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [TMA_CONFIGS[1], TMA_CONFIGS[5]], ids=_id)
def test_tma_epilogue_with_log_sum_exp(attention, space, few_ctas, cfg):
    """The training variant (write_lse) with the TMA epilogue: O and the log-sum-exp equal the regs kernel's."""
    import torch

    shape = parse_shape("2,3,333,257,128:bf16:causal")
    (tma, regs), (lse_tma, lse_regs), _ = _run_pair(attention, space, shape, cfg, lse=True)
    assert torch.equal(tma.view(torch.int16), regs.view(torch.int16))
    assert torch.equal(lse_tma, lse_regs) and torch.isfinite(lse_tma).all()


@pytest.mark.gpu
def test_prepared_launch_re_maps_a_new_output(attention, space):
    """The op's prepared launch (ParamPacket) re-encodes O's map when the output's address changes: outputs taken
    in turn each get the O of the plain launch, bit for bit."""
    import torch

    import evotune.torch.kernels as K
    from evotune.build.compile import load_kernel

    shape = parse_shape("2,4,257,64")
    config = space.config(TMA_CONFIGS[1])
    inputs = attention.make_inputs(shape, 3)
    src = instantiate(attention, config, shape)
    compiled = compile_source(src.code, src.entry)
    kernel = load_kernel(compiled, attention.launch_plan(config, shape).dynamic_smem)
    ref = attention.new_output(inputs).fill_(math.nan)
    attention.launcher(kernel, config, shape, inputs, ref)()
    loaded = K.LoadedKernel(kernel, config, torch.cuda.current_device(), src.digest, compiled.cubin_path)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    prepared = K.PreparedLaunch(loaded, shape, (q.stride(), k.stride(), v.stride()), inputs["scale"], ref.stride())
    outs = [torch.full_like(ref, math.nan) for _ in range(2)]
    for _ in range(2):
        for out in outs:
            out.fill_(math.nan)
            prepared(q, k, v, out)
            torch.cuda.synchronize()
            assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "synccheck", "racecheck"])
@pytest.mark.parametrize("cfg", [TMA_CONFIGS[2], TMA_CONFIGS[6]], ids=_id)
def test_sanitizers_clean(attention, space, few_ctas, tool, cfg):
    """memcheck, synccheck and racecheck find nothing with the TMA epilogue, one tile per CTA (Q's buffer reused,
    ping-pong) and persistent (each CTA's staging tile reused across its tiles), on a ragged causal bf16 d128 shape."""
    assert_sanitizer_clean(attention, space, parse_shape("2,3,197,300,128:bf16:causal"), cfg, tool)
