"""CPU tests of the launch geometry a KernelSource carries: instantiate asks the family once (Problem.geometry), a
persistent grid keeps its rule for the device (grid_for), and the consumers (export's header, the static check,
the search's static gate, attention's launch plan) read the source's geometry instead of asking the family again."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from evotune.build.export import export_source
from evotune.build.template import KernelSource, LaunchGeometry, geometry_of, instantiate
from evotune.problems import PLUGINS_ENV, get_problem
from evotune.problems.attention import is_persistent, is_wgmma, query_tiles
from evotune.problems.shapes import parse_shape
from evotune.problems.softmax import parse_shape as parse_softmax_shape
from evotune.space.searchspace import load_builtin
from _paths import REPO_ROOT

GEMM = REPO_ROOT / "examples" / "gemm" / "gemm.yaml"
WGMMA = dict(mma="wgmma", smem_layout="swizzle", block_m=64, block_n=128, compute_warps=4, producer_warps=0,
             stages=2, q_in_regs=False)
# The three launch classes of attention: mma.sync (fixed grid), wgmma (fixed grid), wgmma persistent (grid_for).
CLASSES = {"sync": ({}, (False, False)), "wgmma": (WGMMA, (True, False)),
           "persistent": (dict(WGMMA, persistent=True), (True, True))}
SHAPE = "2,8,1000,64:causal"  # 16 heads x 16 query tiles of 64 rows: more tiles than the SMs told below


def _sampled(space, problem, shape, base: dict, kind: tuple, n: int, seed: int) -> list:
    """`n` admitted configs of launch class `kind` ((wgmma, persistent)): `base` with three knobs drawn at random."""
    rng, found, ctx = random.Random(seed), [], problem.context(shape)
    for _ in range(5000):
        d = {**space.default_config().as_dict(), **base}
        for p in rng.sample(space.params, 3):
            d[p.name] = rng.choice(p.values)
        d.update({k: base[k] for k in ("mma", "persistent") if k in base})
        cfg = space.config(d)
        if space.admitted(cfg, ctx) and (is_wgmma(cfg), is_persistent(cfg)) == kind and cfg not in found:
            found.append(cfg)
            if len(found) == n:
                return found
    raise AssertionError(f"fewer than {n} admitted configs of class {kind}")


@pytest.fixture(scope="module")
def attention_sources():
    """class -> [(config, KernelSource)] on SHAPE: three sampled configs of each launch class."""
    problem, space, shape = get_problem("attention"), load_builtin("attention"), parse_shape(SHAPE)
    return {name: [(c, instantiate(problem, c, shape)) for c in _sampled(space, problem, shape, base, kind, 3, i)]
            for i, (name, (base, kind)) in enumerate(CLASSES.items())}


@pytest.mark.parametrize("name", list(CLASSES))
def test_attention_source_carries_the_family_geometry(attention_sources, name):
    """Each sampled attention config's source carries Problem.geometry's launch, and its launch plan is that geometry
    sized for the device: a persistent grid keeps its tiles and becomes min(tiles, SMs), a fixed one stays."""
    problem, shape = get_problem("attention"), parse_shape(SHAPE)
    for cfg, src in attention_sources[name]:
        geo = src.geometry
        assert geo == problem.geometry(cfg, shape)
        plan = problem.launch_plan(cfg, shape)
        assert (plan.grid, plan.block, plan.dynamic_smem) == (geo.grid_for(132), geo.block, geo.dynamic_smem)
        for sms in (7, 114):
            assert geo.on(sms) == problem.geometry(cfg, shape, multiprocessors=sms)
        if name == "persistent":
            assert geo.tiles == query_tiles(cfg, shape) == 256 and geo.grid_for(7) == (7, 1, 1)
        else:
            assert geo.tiles == 0 and geo.grid_for(7) == geo.grid


def test_launch_plan_sizes_a_persistent_source_grid_for_the_device(attention_sources, monkeypatch):
    """With EVOTUNE_SM_COUNT set, attention's launch plan takes the persistent source geometry's grid for that many
    SMs (grid_for), and leaves a fixed grid as the source carries it."""
    problem, shape = get_problem("attention"), parse_shape(SHAPE)
    monkeypatch.setenv("EVOTUNE_SM_COUNT", "5")
    for name in CLASSES:
        for cfg, src in attention_sources[name]:
            assert problem.launch_plan(cfg, shape).grid == src.geometry.grid_for(5)
            assert (src.geometry.grid_for(5) == (5, 1, 1)) == (name == "persistent")


def test_softmax_and_a_family_file_carry_their_geometry(monkeypatch):
    """The softmax family's and a family file's (examples/gemm) sources carry their Problem.geometry, fixed grids."""
    monkeypatch.setenv(PLUGINS_ENV, str(GEMM.parent))
    softmax, gemm = get_problem("softmax"), get_problem(str(GEMM))
    cases = [(softmax, load_builtin("softmax"), parse_softmax_shape("4096,1024")),
             (gemm, gemm.load_space(tuple(gemm.context(gemm.parse_shape(gemm.default_shape)))),
              gemm.parse_shape(gemm.default_shape))]
    for problem, space, shape in cases:
        ctx, rng = problem.context(shape), random.Random(3)
        drawn = (space.config({p.name: rng.choice(p.values) for p in space.params}) for _ in range(400))
        configs = [c for c in drawn if space.admitted(c, ctx)][:3]
        assert configs, problem.family
        for cfg in configs:
            geo = instantiate(problem, cfg, shape).geometry
            assert geo == problem.geometry(cfg, shape) and geo.tiles == 0 and geo.grid_for(1) == geo.grid


def _odd(geo: LaunchGeometry) -> LaunchGeometry:
    """A geometry no family gives: what a consumer shows only if it reads the source's."""
    return replace(geo, grid=(3, 5, 7), dynamic_smem=geo.dynamic_smem + 4096)


def test_export_header_reads_the_source_geometry():
    """export's header states the grid and shared memory the source carries; a source that carries none (a run's
    archived code) gets today's family's."""
    problem, shape = get_problem("softmax"), parse_softmax_shape("4096,1024")
    cfg = load_builtin("softmax").default_config()
    src = instantiate(problem, cfg, shape)
    odd = _odd(src.geometry)
    header = export_source(problem, shape, cfg, source=replace(src, geometry=odd))
    assert f"grid         (3, 5, 7)   block {odd.block}   dynamic shared memory {odd.dynamic_smem} B" in header
    archived = KernelSource(family=src.family, entry=src.entry, code=src.code, template_path=src.template_path)
    assert archived == src and geometry_of(archived, problem, cfg, shape) == problem.geometry(cfg, shape)
    assert f"grid         {src.geometry.grid}   block" in export_source(problem, shape, cfg, source=archived)


def test_static_check_and_search_gate_judge_the_source_geometry(monkeypatch):
    """The static check reports the source's threads and shared memory and prunes by them, and the search's static
    gate judges the compiled kernel against the source's geometry: a source whose launch asks for more shared memory
    than an SM has is pruned by both, though the family's own geometry fits."""
    import evotune.build.template as template
    from evotune.build.compile import compile_source
    from evotune.search import loop
    from evotune.search.static_check import check_one
    from evotune.timeline import Timeline

    problem, shape = get_problem("softmax"), parse_softmax_shape("4096,1024")
    space = load_builtin("softmax")
    cfg = space.default_config()
    real = instantiate(problem, cfg, shape)
    huge = replace(real.geometry, dynamic_smem=10 ** 6)
    monkeypatch.setattr(template, "instantiate", lambda *a, **k: replace(real, geometry=huge))
    row = check_one((problem.family, shape.as_dict(), space.path, cfg.as_dict()))
    assert (row["threads"], row["dynamic_smem"], row["status"]) == (huge.threads, 10 ** 6, "pruned")
    assert "shared memory" in row["message"]

    compiled = compile_source(real.code, real.entry)
    item = loop._Pending(trial=None, config=cfg, asked=0.0, why=[], source=real)
    fits = loop._compile_and_judge(problem, shape, item, lambda c, s: compiled, Timeline())
    assert fits.static_verdict == ()
    item = loop._Pending(trial=None, config=cfg, asked=0.0, why=[], source=replace(real, geometry=huge))
    pruned = loop._compile_and_judge(problem, shape, item, lambda c, s: compiled, Timeline())
    assert pruned.status == "pruned" and "shared memory" in pruned.message
