"""CPU tests of the one source of launch geometry: each instantiation asserts that the host's geometry is what
its traits derive and that both fit evotune.limits, so a disagreement fails to compile; and the static gate's
verdict travels with the compiled kernel, so it is judged once per candidate."""

from __future__ import annotations

from dataclasses import replace

import pytest

from evotune import limits
from evotune.build.compile import CompileError, Compiled, Resources, compile_source, judged, static_violations
from evotune.problems import attention as attention_module
from evotune.problems import LaunchGeometry, get_problem
from evotune.problems.softmax import parse_shape as parse_softmax_shape
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import device_context, load_builtin
from evotune.build.template import instantiate

SYNC = dict(mma="sync", block_m=64, block_n=64, compute_warps=4, producer_warps=0, stages=2)
WGMMA = dict(mma="wgmma", smem_layout="swizzle", block_m=64, block_n=128, compute_warps=4, producer_warps=0,
             stages=2, q_in_regs=False)
SOFTMAX = dict(threads_per_row=128, rows_per_cta=2, vec=8, strategy="online", unroll=1)


def _attention_case(cfg):
    return get_problem("attention"), load_builtin("attention"), parse_shape("16,12,1024,64")


def _softmax_case(cfg):
    return get_problem("softmax"), load_builtin("softmax"), parse_softmax_shape("4096,1024")


CASES = [("mma.sync", _attention_case, SYNC, "kBlockM"), ("wgmma", _attention_case, WGMMA, "kBlockM"),
         ("softmax", _softmax_case, SOFTMAX, "kRowsPerCta")]


@pytest.mark.parametrize("name,case,cfg,rows", CASES, ids=[c[0] for c in CASES])
def test_each_variant_asserts_its_geometry_and_compiles(name, case, cfg, rows):
    """The instantiation asserts threads, dynamic shared memory and rows per CTA against the traits, and compiles."""
    problem, space, shape = case(cfg)
    config = space.config(cfg)
    assert not space.violations(config, problem.context(shape))
    geo = problem.geometry(config, shape)
    src = instantiate(problem, config, shape)
    assert f"static_assert(EvotuneTraits::kThreads == {geo.threads}," in src.code
    assert f"static_assert(EvotuneTraits::kSmemBytes == {geo.dynamic_smem}," in src.code
    assert f"static_assert(EvotuneTraits::{rows} == " in src.code
    assert f"EvotuneTraits::kSmemBytes <= {limits.SMEM_PER_BLOCK}," in src.code
    compiled = compile_source(src.code, src.entry)
    assert static_violations(compiled.resources, geo.threads, geo.dynamic_smem) == []


def _expect_compile_error(problem, space, shape, cfg, message: str) -> None:
    config = space.config(cfg)
    src = instantiate(problem, config, shape)
    with pytest.raises(CompileError) as info:
        compile_source(src.code, src.entry)
    assert message in info.value.log


@pytest.mark.parametrize("name,case,cfg,rows", CASES, ids=[c[0] for c in CASES])
def test_wrong_host_threads_fail_to_compile(monkeypatch, name, case, cfg, rows):
    """A geometry one thread off what the traits derive is a compile error naming the block threads."""
    problem, space, shape = case(cfg)
    right = type(problem).geometry

    def one_more_thread(self, config, shape):
        geo = right(self, config, shape)
        return replace(geo, block=(geo.block[0] + 1, 1, 1))

    monkeypatch.setattr(type(problem), "geometry", one_more_thread)
    threads = one_more_thread(problem, space.config(cfg), shape).threads
    _expect_compile_error(problem, space, shape, cfg, f"host geometry: block threads {threads} != EvotuneTraits::kThreads")


@pytest.mark.parametrize("name,case,cfg,rows", CASES, ids=[c[0] for c in CASES])
def test_wrong_host_shared_memory_fails_to_compile(monkeypatch, name, case, cfg, rows):
    """A geometry 16 B of dynamic shared memory off the traits' kSmemBytes is a compile error naming it."""
    problem, space, shape = case(cfg)
    right = type(problem).geometry

    def sixteen_more_bytes(self, config, shape):
        geo = right(self, config, shape)
        return replace(geo, dynamic_smem=geo.dynamic_smem + 16)

    monkeypatch.setattr(type(problem), "geometry", sixteen_more_bytes)
    smem = sixteen_more_bytes(problem, space.config(cfg), shape).dynamic_smem
    _expect_compile_error(problem, space, shape, cfg,
                          f"host geometry: dynamic shared memory {smem} B != EvotuneTraits::kSmemBytes")


@pytest.mark.parametrize("cfg", [SYNC, WGMMA], ids=["mma.sync", "wgmma"])
def test_wrong_host_rows_per_cta_fail_to_compile(monkeypatch, cfg):
    """Attention's rows per CTA (the grid's query tiles) 16 off the traits' kBlockM is a compile error naming them."""
    problem, space, shape = _attention_case(cfg)
    right = attention_module.rows_per_cta
    monkeypatch.setattr(attention_module, "rows_per_cta", lambda config: right(config) + 16)
    rows = right(space.config(cfg)) + 16
    _expect_compile_error(problem, space, shape, cfg, f"host geometry: {rows} rows per CTA != EvotuneTraits::kBlockM")


def test_device_limits_have_one_table():
    """The search spaces' device context and the static gate read the numbers of evotune.limits."""
    import evotune.build.compile as C

    assert device_context() == limits.DEVICE_LIMITS
    assert (C.SMEM_LIMIT_BYTES, C.REGISTERS_PER_SM) == (limits.SMEM_PER_BLOCK, limits.REGISTERS_PER_SM)
    assert limits.SMEM_PER_BLOCK == 227 * 1024


def _compiled(**resources) -> Compiled:
    res = Resources(**{"registers": 64, "static_smem": 0, "stack_frame": 0, "spill_stores": 0, "spill_loads": 0,
                       "barriers": 1, **resources})
    return Compiled(key="k", entry="e", arch="sm_90a", cubin_path="/nowhere", options=(), log="", resources=res,
                    compile_seconds=0.0)


def test_static_verdict_is_judged_once_and_travels(monkeypatch):
    """judged computes the gate's verdict once; it survives as_dict/from_dict (the worker pipe), and a judged
    kernel is not judged again."""
    import evotune.build.compile as C

    launch = LaunchGeometry(grid=(1, 1, 1), block=(128, 1, 1), dynamic_smem=0)
    spilling = _compiled(spill_stores=8, spill_loads=8)
    first = judged(spilling, launch)
    assert first.static_verdict == tuple(static_violations(spilling.resources, 128, 0)) and first.static_verdict
    assert Compiled.from_dict(first.as_dict()).static_verdict == first.static_verdict
    clean = judged(_compiled(), launch)
    assert clean.static_verdict == () and Compiled.from_dict(clean.as_dict()).static_verdict == ()
    legacy = {k: v for k, v in _compiled().as_dict().items() if k != "static_verdict"}
    assert Compiled.from_dict(legacy).static_verdict is None
    monkeypatch.setattr(C, "static_violations", lambda *a: pytest.fail("judged twice"))
    assert judged(Compiled.from_dict(first.as_dict()), launch).static_verdict == first.static_verdict
    assert judged(Compiled.from_dict(clean.as_dict()), launch).static_verdict == ()
