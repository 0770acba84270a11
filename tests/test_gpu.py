"""GPU tests: run on the H100 (`python -m pytest -m gpu`); skipped where no GPU is visible."""

from __future__ import annotations

import pytest

from evotune.records import result as R
from evotune.build.compile import compile_source
from evotune.problems.shapes import parse_shape
from evotune.build.template import instantiate

pytestmark = pytest.mark.gpu

SHAPES = ["mission", "mission:bf16", "mission:causal", "2,3,200,333,64", "1,2,1,64", "2,4,257,64:bshd",
          "1,4,1000,128:bf16:causal", "3,2,77,300,128:causal", "2,2,300,77,64:causal"]
CONFIGS = [
    dict(block_m=64, block_n=64, compute_warps=4, producer_warps=0, stages=2, smem_layout="swizzle", q_in_regs=True),
    dict(block_m=64, block_n=32, compute_warps=4, producer_warps=1, stages=3, smem_layout="pad", q_in_regs=False),
    dict(block_m=16, block_n=16, compute_warps=1, producer_warps=2, stages=4, smem_layout="plain", q_in_regs=True),
    dict(block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=1, smem_layout="swizzle", q_in_regs=False),
    # split-KV: empty splits (more splits than tiles), causal splits whose rows see no key, producers + splits
    dict(block_m=32, block_n=64, compute_warps=2, producer_warps=1, stages=2, smem_layout="swizzle", q_in_regs=True,
         kv_splits=4),
    dict(block_m=16, block_n=32, compute_warps=1, producer_warps=0, stages=3, smem_layout="pad", q_in_regs=True,
         kv_splits=8),
    # exactly 48 KB dynamic + 128 B static shared memory: failed to launch before load_kernel always opted in
    dict(block_m=128, block_n=32, compute_warps=2, producer_warps=0, stages=4, smem_layout="swizzle", q_in_regs=False,
         kv_splits=2),
    # key groups: warps splitting each tile's keys, merged in shared memory (with and without producers)
    dict(block_m=16, block_n=64, compute_warps=4, producer_warps=0, stages=2, smem_layout="swizzle", q_in_regs=True,
         warp_key_groups=4),
    dict(block_m=32, block_n=64, compute_warps=4, producer_warps=1, stages=3, smem_layout="pad", q_in_regs=False,
         warp_key_groups=2),
]

# The Hopper variant (mma = wgmma): one to three consumer warpgroups, with and without the producer
# warpgroup (and its setmaxnreg: 24/240 with two consumers, 32/160 with three), one to four stages, Q from
# registers or shared memory, ping-pong.
_W = dict(mma="wgmma", smem_layout="swizzle")
HOPPER_CONFIGS = [
    dict(_W, block_m=64, block_n=64, compute_warps=4, producer_warps=0, stages=2, q_in_regs=False),
    dict(_W, block_m=64, block_n=32, compute_warps=4, producer_warps=4, stages=1, q_in_regs=True),
    dict(_W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False),
    dict(_W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=3, q_in_regs=True, pingpong=True),
    dict(_W, block_m=128, block_n=64, compute_warps=8, producer_warps=0, stages=4, q_in_regs=True, pingpong=True),
    dict(_W, block_m=192, block_n=128, compute_warps=12, producer_warps=4, stages=2, q_in_regs=False),
    dict(_W, block_m=192, block_n=64, compute_warps=12, producer_warps=0, stages=3, q_in_regs=False),
    dict(_W, block_m=128, block_n=176, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False, pingpong=True),
]


# Persistent grids (a producer warpgroup; one to three consumer warpgroups, one to three stages, Q in shared
# memory or registers, 176-key tiles). The matrix launches them on PERSISTENT_CTAS CTAs, so that even on its small
# shapes each CTA walks several query tiles of different lengths and the K/V slots' phases carry across tiles.
PERSISTENT_CONFIGS = [
    dict(_W, block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=True, persistent=True),
    dict(_W, block_m=64, block_n=32, compute_warps=4, producer_warps=4, stages=1, q_in_regs=True, persistent=True),
    dict(_W, block_m=192, block_n=64, compute_warps=12, producer_warps=4, stages=3, q_in_regs=False, persistent=True),
    dict(_W, block_m=128, block_n=176, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False, persistent=True),
    # One stage with Q in shared memory (Q released after the last S, V slot and next K share one slot) and
    # 64-key tiles on 64 rows, so that causal first tiles have one K/V tile; four stages.
    dict(_W, block_m=64, block_n=64, compute_warps=4, producer_warps=4, stages=1, q_in_regs=False, persistent=True),
    dict(_W, block_m=128, block_n=64, compute_warps=8, producer_warps=4, stages=4, q_in_regs=False, persistent=True),
]
PERSISTENT_CTAS = 3


def _hopper_id(c: dict) -> str:
    return (f"wgmma-M{c['block_m']}N{c['block_n']}pw{c['producer_warps']}st{c['stages']}"
            f"q{int(c['q_in_regs'])}pp{int(c.get('pingpong', False))}" + ("-persistent" if c.get("persistent") else ""))


@pytest.fixture
def few_ctas(monkeypatch):
    """Persistent launches get PERSISTENT_CTAS CTAs instead of one per SM (here and in the processes started)."""
    monkeypatch.setenv("EVOTUNE_SM_COUNT", str(PERSISTENT_CTAS))


def _admitted_any_grid(attention, space, config, shape) -> bool:
    """The space's verdict but for its rule that a persistent grid needs more query tiles than SMs (a search-time
    economy, not a correctness rule: the kernel is correct on any grid, and the matrix tests it on small ones)."""
    return space.admitted(config, dict(attention.context(shape), multiprocessors=0))


def _assert_passed(res) -> None:
    """A gated candidate passed: verified within the gate with finite outputs, or pruned by the static gate."""
    assert res.status in (R.OK, R.PRUNED), res.message
    if res.status == R.OK:
        assert res.verification["nonfinite"] == 0
        assert res.verification["gate_ratio"] <= 1.0


def _gate_where_admitted(attention, space, shape_text, cfg):
    """The full gate (untimed) of `cfg` on the shape, or a skip where the space does not admit it there."""
    shape = parse_shape(shape_text)
    if not space.admitted(space.config(dict(cfg)), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    return _evaluate(attention, space, shape, cfg, time_it=False)


def _evaluate(problem, space, shape, cfg_dict, **kw):
    from evotune.gpu.evaluate import evaluate_compiled

    cfg = space.config(cfg_dict)
    src = instantiate(problem, cfg, shape)
    return evaluate_compiled(problem, shape, cfg, compile_source(src.code, src.entry), **kw)


@pytest.mark.parametrize("shape_text", SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS + HOPPER_CONFIGS,
                         ids=lambda c: _hopper_id(c) if c.get("mma") == "wgmma" else (
                             f"M{c['block_m']}N{c['block_n']}pw{c['producer_warps']}st{c['stages']}"
                             f"kv{c.get('kv_splits', 1)}kg{c.get('warp_key_groups', 1)}"))
def test_kernel_matches_reference(attention, space, shape_text, cfg):
    """Every sampled config passes the gate on ragged, causal, bf16, d128 and BSHD shapes."""
    shape = parse_shape(shape_text)
    if not space.admitted(space.config(cfg), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    res = _evaluate(attention, space, shape, cfg, time_it=False)
    _assert_passed(res)


# Grouped-query attention (kvN: N K/V heads): groups 2, 4 and 8 (one K/V head), both dtypes, causal, BSHD,
# ragged Sq != Sk both ways, d64 and d128. Every config above, split-KV and key groups included: each
# indexes K/V by head. The gate's perturbation moves one row of the last K/V head, so it checks that
# exactly that head's group of query heads changes.
GQA_SHAPES = ["2,8,257,64:kv4", "1,8,300,197,128:bf16:causal:kv2", "2,8,200,333,64:causal:bshd:kv1",
              "1,16,1000,128:bf16:kv2", "3,4,77,300,64:bf16:bshd:kv2", "1,8,512,64:causal:kv4"]


@pytest.mark.parametrize("shape_text", GQA_SHAPES)
@pytest.mark.parametrize("cfg", CONFIGS + HOPPER_CONFIGS,
                         ids=lambda c: _hopper_id(c) if c.get("mma") == "wgmma" else (
                             f"M{c['block_m']}N{c['block_n']}pw{c['producer_warps']}st{c['stages']}"
                             f"kv{c.get('kv_splits', 1)}kg{c.get('warp_key_groups', 1)}"))
def test_gqa_matches_reference(attention, space, shape_text, cfg):
    """Grouped K/V heads read through the head-group index pass the gate (perturbation included) in both variants."""
    shape = parse_shape(shape_text)
    assert shape.kv_heads < shape.heads
    if not space.admitted(space.config(cfg), attention.context(shape)):
        pytest.skip("config not admitted for this shape")
    res = _evaluate(attention, space, shape, cfg, time_it=False)
    _assert_passed(res)


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[4], CONFIGS[7], HOPPER_CONFIGS[0], HOPPER_CONFIGS[3]],
                         ids=["M64N64", "M32N64kv4", "M16N64kg4", "wgmma-pw0", "wgmma-pingpong"])
def test_gate_catches_a_wrong_head_group(attention, space, cfg):
    """A kernel that maps query head h to K/V head h % kv_heads (repeat, not repeat_interleave) fails the gate. The
    map is planted in kv_head_of, which both variants call on every path (the Hopper kernel's one-tile and persistent
    loops too): a plant in one call site reached only the mma.sync kernel, and the wgmma cases passed the gate with
    it (they ran the unplanted Hopper code; found on the H100 at 03e924c)."""
    from evotune.build.compile import load_kernel
    from evotune.gpu.evaluate import kernel_runner, verify

    shape = parse_shape("1,8,256,64:kv2")
    config = space.config(dict(cfg))
    src = instantiate(attention, config, shape)
    # 2 K/V heads: the right map is h // 4 (0,0,0,0,1,1,1,1), the wrong one h % 2 (0,1,0,1,...), still in bounds.
    right_map = "return kv_magic ? static_cast<int>(__umulhi(static_cast<unsigned>(head), kv_magic)) : head;"
    assert src.code.count(right_map) == 1
    wrong = src.code.replace(right_map, "return kv_magic ? head % 2 : head;")
    smem = attention.geometry(config, shape).dynamic_smem
    good = kernel_runner(attention, shape, config, load_kernel(compile_source(src.code, src.entry), smem))
    bad = kernel_runner(attention, shape, config, load_kernel(compile_source(wrong, src.entry), smem))
    assert verify(attention, shape, good).passed
    assert not verify(attention, shape, bad).passed


def _random_shapes(n: int, seed: int = 2026) -> list[str]:
    """A fixed, seeded list of ragged shapes across head dim, dtype, mask and layout (S=1 and Sq != Sk included)."""
    import random

    rng = random.Random(seed)
    shapes = []
    for i in range(n):
        sq = rng.choice([1, 2, 15, 17, 63, 65, 127, 129, 200, 333, 511, 700])
        sk = sq if rng.random() < 0.4 else rng.choice([1, 3, 31, 33, 64, 100, 255, 257, 513, 999])
        flags = [rng.choice(["fp16", "bf16"])] + (["causal"] if rng.random() < 0.5 else []) \
            + (["bshd"] if rng.random() < 0.3 else [])
        d = rng.choice([64, 128])
        shapes.append(f"{rng.choice([1, 2, 3])},{rng.choice([1, 2, 5])},{sq},{sk},{d}:" + ":".join(flags))
    return shapes


RAGGED = _random_shapes(16)


@pytest.mark.parametrize("shape_text", RAGGED)
@pytest.mark.parametrize("cfg", CONFIGS[:2] + CONFIGS[4:6] + CONFIGS[7:9] + HOPPER_CONFIGS[1:3] + HOPPER_CONFIGS[4:],
                         ids=lambda c: _hopper_id(c) if c.get("mma") == "wgmma" else
                         f"M{c['block_m']}N{c['block_n']}kv{c.get('kv_splits', 1)}kg{c.get('warp_key_groups', 1)}")
def test_ragged_matrix(attention, space, shape_text, cfg):
    """A seeded matrix of ragged shapes (S=1, Sq != Sk, both masks, dtypes, head dims, layouts) passes the full gate."""
    res = _gate_where_admitted(attention, space, shape_text, cfg)
    assert res.status in (R.OK, R.PRUNED), res.message


@pytest.mark.parametrize("shape_text", SHAPES + GQA_SHAPES + RAGGED[:8])
@pytest.mark.parametrize("cfg", PERSISTENT_CONFIGS, ids=_hopper_id)
def test_persistent_matches_reference(attention, space, few_ctas, shape_text, cfg):
    """A persistent grid of PERSISTENT_CTAS CTAs, each walking several query tiles (ragged, causal, grouped K/V
    heads, Sq != Sk, BSHD, both dtypes and head dims), passes the full gate."""
    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    if not _admitted_any_grid(attention, space, config, shape):
        pytest.skip("config not admitted for this shape")
    assert attention.launch_plan(config, shape).grid[0] == min(PERSISTENT_CTAS, attention.geometry(config, shape).grid[0])
    res = _evaluate(attention, space, shape, cfg, time_it=False)
    _assert_passed(res)


@pytest.mark.parametrize("shape_text", ["2,8,4096,64:causal", "1,16,2048,128:bf16", "3,5,1500,700,128:causal:bshd:kv1"])
@pytest.mark.parametrize("cfg", PERSISTENT_CONFIGS, ids=_hopper_id)
def test_persistent_on_every_sm(attention, space, shape_text, cfg):
    """At the device's own SM count, on shapes with more query tiles than SMs (as the search admits them)."""
    _assert_passed(_gate_where_admitted(attention, space, shape_text, cfg))


@pytest.mark.parametrize("shape_text", ["2,3,333,257,128:bf16:causal", "1,8,1024,64:causal:kv2", "2,4,700,64:causal"])
@pytest.mark.parametrize("cfg", [PERSISTENT_CONFIGS[0], PERSISTENT_CONFIGS[2]], ids=_hopper_id)
def test_persistent_causal_tile_counters_serve_launch_after_launch(attention, space, few_ctas, shape_text, cfg):
    """The causal persistent grid takes its tiles from two counters that its last CTA zeroes again: one launch's
    arguments replayed five times (as a CUDA graph replays them) give the same correct O each time, and the
    counters read zero after each launch."""
    import math

    import torch

    from evotune.build.compile import load_kernel, torch_stream_launcher
    from evotune.gpu.evaluate import output_errors
    from evotune.problems.attention import as_kernel_arg

    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    if not _admitted_any_grid(attention, space, config, shape):
        pytest.skip("config not admitted for this shape")
    src = instantiate(attention, config, shape)
    plan = attention.launch_plan(config, shape)
    assert plan.workspace == (0, 0, 2) and plan.grid[0] == PERSISTENT_CTAS
    kernel = load_kernel(compile_source(src.code, src.entry), plan.dynamic_smem)
    inputs = attention.make_inputs(shape, 21)
    out = attention.new_output(inputs)
    workspace = attention.new_workspace(config, shape, out.device)
    values = attention.launch_values(config, shape, inputs["q"], inputs["k"], inputs["v"], out, inputs["scale"],
                                     None, workspace)
    args = tuple(as_kernel_arg(kind, values[name]) for name, kind in attention.entry_params(config))
    launch = torch_stream_launcher(kernel, plan.grid, plan.block, args, plan.dynamic_smem, keep=workspace)
    ref = attention.reference(shape, inputs)
    atol, rtol = attention.tolerance(shape)
    first = None
    for _ in range(5):
        out.fill_(math.nan)
        launch()
        torch.cuda.synchronize()
        assert workspace[2].tolist() == [0, 0]
        if first is None:
            _, _, nonfinite, ratio = output_errors(out, ref, atol * attention.error_scale(inputs), rtol)
            assert nonfinite == 0 and ratio <= 1.0, (nonfinite, ratio)
            first = out.clone()
        else:
            assert torch.equal(out.view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[1], CONFIGS[4], CONFIGS[7], HOPPER_CONFIGS[0], HOPPER_CONFIGS[3],
                                 HOPPER_CONFIGS[5], PERSISTENT_CONFIGS[0], PERSISTENT_CONFIGS[2]],
                         ids=["M64N64", "M64N32pw1", "M32N64kv4", "M16N64kg4", "wgmma-pw0", "wgmma-pingpong", "wgmma-M192",
                              "wgmma-persistent", "wgmma-M192-persistent"])
@pytest.mark.parametrize("shape_text", ["mission", "2,3,333,257,128:bf16:causal", "1,8,333,64:bf16:causal:kv2"])
def test_bitwise_deterministic(attention, space, few_ctas, shape_text, cfg):
    """100 launches on the same inputs give bitwise identical outputs (split-KV merges in a fixed order; a
    persistent CTA, here one of PERSISTENT_CTAS, computes each of its tiles as the one-tile grid does)."""
    from evotune.build.compile import load_kernel
    from evotune.gpu.evaluate import check_determinism, kernel_runner

    shape = parse_shape(shape_text)
    config = space.config(dict(cfg))
    src = instantiate(attention, config, shape)
    kernel = load_kernel(compile_source(src.code, src.entry), attention.geometry(config, shape).dynamic_smem)
    ok, detail = check_determinism(attention, shape, kernel_runner(attention, shape, config, kernel), launches=100)
    assert ok, detail


@pytest.mark.parametrize("shape_text", ["mission", "mission:kv2"])
def test_sdpa_passes_the_gate_by_a_margin(attention, shape_text):
    """Each SDPA backend's own error is well inside the gate (ratio <= 0.5) on the mission shape (and its grouped
    form, SDPA called with enable_gqa), stress inputs included."""
    from evotune.gpu.evaluate import measure_baselines

    report = measure_baselines(attention, parse_shape(shape_text), names=["flash", "cudnn", "efficient"], reps=5)
    assert any(b.get("available") for b in report.values()), report
    for name, b in report.items():
        if b.get("available"):
            assert b["verification"]["gate_ratio"] <= 0.5, (name, b["verification"])


def test_gate_catches_a_wrong_kernel(attention, space, mission, monkeypatch):
    """A kernel launched with the wrong softmax scale fails the gate instead of passing."""
    import math

    from evotune.gpu.evaluate import kernel_runner, verify
    from evotune.build.compile import load_kernel

    cfg = space.default_config()
    src = instantiate(attention, cfg, mission)
    compiled = compile_source(src.code, src.entry)
    kernel = load_kernel(compiled, attention.geometry(cfg, mission).dynamic_smem)
    run = kernel_runner(attention, mission, cfg, kernel)

    def wrong(inputs, out):
        run({**inputs, "scale": inputs["scale"] * 1.05}, out)

    assert verify(attention, mission, run).passed
    assert not verify(attention, mission, wrong).passed
    assert math.isfinite(verify(attention, mission, wrong).max_abs)


def test_unwritten_output_is_caught(attention, mission):
    """An implementation that leaves one element unwritten fails through the NaN poison."""
    from evotune.gpu.evaluate import verify

    def partial(inputs, out):
        ref = attention.reference(mission, inputs)
        keep = out[0, 0, 0, 0].clone()
        out.copy_(ref.to(out.dtype))
        out[0, 0, 0, 0] = keep  # still NaN from the poison

    check = verify(attention, mission, partial)
    assert not check.passed and check.nonfinite == 1


def test_split_kv_counters_are_left_zero(attention, space, mission):
    """After many split-KV launches the arrival counters are back at zero and the output still passes."""
    import torch

    from evotune.build.compile import load_kernel
    from evotune.gpu.evaluate import output_errors

    cfg = space.config(dict(CONFIGS[-3]))
    src = instantiate(attention, cfg, mission)
    kernel = load_kernel(compile_source(src.code, src.entry), attention.geometry(cfg, mission).dynamic_smem)
    inputs = attention.make_inputs(mission, 7)
    out = attention.new_output(inputs)
    launch = attention.launcher(kernel, cfg, mission, inputs, out)
    for _ in range(50):
        launch()
    out.fill_(float("nan"))
    launch()
    torch.cuda.synchronize()
    counters = launch.__defaults__[0][2]
    assert int(counters.abs().sum().item()) == 0
    atol, rtol = attention.tolerance(mission)
    assert output_errors(out, attention.reference(mission, inputs), atol, rtol)[3] <= 1.0


def test_timing_is_stable(attention, space, mission):
    """Two timings of the same kernel agree within 10% and p10 <= median <= p90."""
    res1 = _evaluate(attention, space, mission, space.default_config().as_dict())
    res2 = _evaluate(attention, space, mission, space.default_config().as_dict())
    for r in (res1, res2):
        assert r.timing["p10_us"] <= r.time_us <= r.timing["p90_us"]
    assert abs(res1.time_us - res2.time_us) / res1.time_us < 0.10


def test_worker_survives_an_illegal_address(attention, space, mission, tmp_path):
    """A candidate that faults is recorded as launch_error and the next job runs in a fresh worker."""
    from evotune.search.loop import worker_evaluator
    from evotune.gpu.workers import GPUWorker

    cfg = space.default_config()
    src = instantiate(attention, cfg, mission)
    # Plant an out-of-bounds store far past the output buffer.
    bad_code = src.code.replace("evotune::attention_fwd<EvotuneTraits>(q, k, v, o,",
                                "if (threadIdx.x == 0) o[(1ll << 40)] = 1;\n    evotune::attention_fwd<EvotuneTraits>(q, k, v, o,")
    assert bad_code != src.code
    bad = compile_source(bad_code, src.entry)
    good = compile_source(src.code, src.entry)
    with GPUWorker(timeout_s=120) as worker:
        evaluate = worker_evaluator(worker, attention, mission)
        res_bad = evaluate(cfg, bad)
        res_good = evaluate(cfg, good)
    assert res_bad.status == R.LAUNCH_ERROR, res_bad
    assert res_good.status == R.OK, res_good


def _sanitize_job(attention, space, shape, code_edit=None, cfg_dict=CONFIGS[1]):
    from evotune.gpu.workers import compiled_to_dict

    cfg = space.config(dict(cfg_dict))
    src = instantiate(attention, cfg, shape)
    code = code_edit(src.code) if code_edit else src.code
    return {"family": "attention", "shape": shape.as_dict(), "config": cfg.as_dict(),
            "compiled": compiled_to_dict(compile_source(code, src.entry))}


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "synccheck"])
def test_sanitizer_clean_on_a_producer_config(attention, space, tool):
    """memcheck and synccheck find nothing in a producer-warp config on a ragged causal bf16 d128 shape.

    racecheck is not asked here: it reports the producer's cp.async into a slot that the
    consumers released with bar.arrive, a handoff the PTX ISA orders; tools/racecheck_probe.py
    reproduces that report on a 20-line race-free kernel (docs/CORRECTNESS.md).
    """
    from evotune.gpu.sanitize import run_tool

    report = run_tool(tool, _sanitize_job(attention, space, parse_shape("1,2,197,300,128:bf16:causal")))
    assert report["clean"], report


@pytest.mark.slow
@pytest.mark.parametrize("shape_text", ["1,2,197,197,64:fp16:causal", "1,2,197,300,128:bf16"])
def test_racecheck_clean_without_producers(attention, space, shape_text):
    """racecheck finds no hazard in a compute-warps-only config (the __syncwarp before staging O is needed on causal)."""
    from evotune.gpu.sanitize import run_tool

    job = _sanitize_job(attention, space, parse_shape(shape_text), cfg_dict=CONFIGS[0])
    report = run_tool("racecheck", job)
    assert report["clean"], report


@pytest.mark.slow
def test_sanitizer_reports_a_planted_out_of_bounds_write(attention, space):
    """memcheck reports a kernel that writes far outside any allocation."""
    from evotune.gpu.sanitize import run_tool

    def plant(code):
        return code.replace("evotune::attention_fwd<EvotuneTraits>(q, k, v, o,",
                            "if (threadIdx.x == 0 && blockIdx.x == 0) o[1ll << 40] = 0;\n    evotune::attention_fwd<EvotuneTraits>(q, k, v, o,")

    report = run_tool("memcheck", _sanitize_job(attention, space, parse_shape("1,2,197,300,64"), plant))
    assert not report["clean"] and report["errors"], report


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "synccheck", "racecheck"])
@pytest.mark.parametrize("cfg", [PERSISTENT_CONFIGS[0], PERSISTENT_CONFIGS[2]], ids=_hopper_id)
def test_sanitizer_clean_on_persistent_configs(attention, space, few_ctas, tool, cfg):
    """memcheck, synccheck and racecheck find nothing in a persistent grid whose CTAs each walk several query tiles
    (Q reloaded over the last one's, K/V slots reused across tiles) on a ragged causal bf16 d128 shape."""
    from evotune.gpu.sanitize import run_tool

    report = run_tool(tool, _sanitize_job(attention, space, parse_shape("2,3,197,300,128:bf16:causal"), cfg_dict=cfg))
    assert report["clean"], report


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["memcheck", "synccheck", "racecheck"])
@pytest.mark.parametrize("cfg", [HOPPER_CONFIGS[3], HOPPER_CONFIGS[4]], ids=["wgmma-producer-pingpong", "wgmma-pw0-pingpong"])
def test_sanitizer_clean_on_hopper_configs(attention, space, tool, cfg):
    """memcheck, synccheck and racecheck find nothing in the Hopper variant (TMA on mbarriers, setmaxnreg,
    ping-pong named barriers) on a ragged causal bf16 d128 shape."""
    from evotune.gpu.sanitize import run_tool

    report = run_tool(tool, _sanitize_job(attention, space, parse_shape("1,2,197,300,128:bf16:causal"), cfg_dict=cfg))
    assert report["clean"], report
