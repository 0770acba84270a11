"""Tests for the row softmax family (evotune/problems/softmax.py, kernels/softmax.cu, search_spaces/softmax.yaml)
on the CPU: shapes, the space, real NVRTC compiles, the search loop with an injected evaluator, the CLI,
and that the generic modules know nothing of attention."""

from __future__ import annotations

import json
import random
import re
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evotune import cli as cli_module
from evotune.records import result as R
from evotune.cli import app
from evotune.cli import common as cli_common
from evotune.build.compile import compile_source, static_violations
from evotune.errors import UsageError
from evotune.build.export import export_source
from evotune.problems import FAMILIES, get_problem
from evotune.problems.softmax import PRESETS, SoftmaxShape, parse_shape
from evotune.records.result import Result
from evotune.records.runs import Run
from evotune.search.loop import SearchOptions, run_search
from evotune.space.searchspace import load_builtin, load_space
from evotune.build.template import instantiate
from _paths import REPO_ROOT

BANNER = "// ---- evotune instantiation:"
# Ragged on purpose: cols not a multiple of any vector width, rows not a multiple of rows_per_cta.
SHAPES = ("4096,1024", "1000,1003:bf16", "33,50257")


@pytest.fixture(scope="module")
def softmax():
    return get_problem("softmax")


@pytest.fixture(scope="module")
def sspace():
    return load_builtin("softmax")


def without_banner(code: str) -> str:
    return "\n".join(line for line in code.splitlines() if not line.startswith(BANNER))


def text_section(cubin: bytes, entry: str) -> bytes:
    """The machine code of `entry` in an ELF64 cubin (section `.text.<entry>`): what a knob must change,
    beyond symbol names."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i):  # (name offset, file offset, size)
        base = shoff + i * shentsize
        name, = struct.unpack_from("<I", cubin, base)
        offset, size = struct.unpack_from("<QQ", cubin, base + 0x18)
        return name, offset, size

    _, strtab, _ = header(shstrndx)
    for i in range(shnum):
        name, offset, size = header(i)
        end = cubin.index(b"\0", strtab + name)
        if cubin[strtab + name:end].decode() == f".text.{entry}":
            return cubin[offset:offset + size]
    raise AssertionError(f"no .text.{entry} section")


# ------------------------------------------------------------------ shapes


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_parse_and_round_trip(softmax, name):
    """Each preset parses to its shape, and its spec and dict read back to the same shape."""
    shape = softmax.parse_shape(name)
    assert shape == PRESETS[name][0]
    assert softmax.parse_shape(shape.spec) == shape
    assert softmax.shape_from_dict(shape.as_dict()) == shape
    assert name in softmax.presets()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("4096,1024", SoftmaxShape(4096, 1024)),
        ("4096x1024:bf16", SoftmaxShape(4096, 1024, "bf16")),
        (" 7 , 3 :BF16", SoftmaxShape(7, 3, "bf16")),
        ("softmax-4k:bf16", SoftmaxShape(4096, 4096, "bf16")),
        ("vocab-50k", SoftmaxShape(1024, 50257)),
        ("1,1:fp16", SoftmaxShape(1, 1)),
    ],
)
def test_parse_shape(text, expected):
    """ROWS,COLS or ROWSxCOLS, a preset, and :fp16/:bf16 in any case."""
    assert parse_shape(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("nosuch", "unknown preset 'nosuch'; presets: softmax-1k"),
        ("", "shape: empty"),
        ("1,2,3", "cannot read '1,2,3'"),
        ("1,8,512,64", "cannot read"),
        ("-4,8", "cannot read"),
        ("0,8", "rows must be a positive integer, got 0"),
        ("8,0", "cols must be a positive integer, got 0"),
        ("8,3000000000", "cols must be below 2^31"),
        ("8,8:causal", "unknown flag 'causal'"),
        ("mission", "unknown preset 'mission'"),
    ],
)
def test_bad_shapes(text, fragment):
    """Unknown presets, malformed text, non-positive sizes and flags softmax lacks raise UsageError (exit 2)."""
    with pytest.raises(UsageError) as info:
        parse_shape(text)
    assert fragment in str(info.value) and info.value.exit_code == 2


def test_shape_is_frozen_and_hashable():
    """A SoftmaxShape is a frozen, hashable value with spec, as_dict and min_bytes."""
    a, b = SoftmaxShape(8, 100, "bf16"), parse_shape("8,100:bf16")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    with pytest.raises(AttributeError):
        a.rows = 9  # type: ignore[misc]
    assert a.spec == "8,100:bf16" and a.as_dict() == {"rows": 8, "cols": 100, "dtype": "bf16"}
    assert a.min_bytes() == 2 * 8 * 100 * 2


def test_families_are_registered(softmax):
    """Both built-in families load by name; the attention parser refuses a softmax spelling and vice versa."""
    assert set(FAMILIES) >= {"attention", "softmax"} and softmax.family == "softmax"
    with pytest.raises(UsageError, match="cannot read"):
        get_problem("attention").parse_shape("4096,1024")
    with pytest.raises(UsageError, match="unknown preset 'mission'"):
        softmax.parse_shape("mission")


# ------------------------------------------------------------------ the space


def test_space_loads(softmax, sspace):
    """softmax.yaml loads with its five knobs, reads only the family's context names, and admits configs on every preset."""
    assert sspace.family == "softmax"
    assert sspace.param_names() == ["threads_per_row", "rows_per_cta", "vec", "strategy", "unroll"]
    assert all(c.why for c in sspace.constraints)
    for name, (shape, _) in PRESETS.items():
        ctx = softmax.context(shape)
        assert set(ctx) == set(softmax.context_names)
        assert sspace.admitted_configs(ctx), name


def test_space_names_come_from_the_family(tmp_path):
    """A softmax space may not read attention's names, nor shadow its own context: file:line errors."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("family: softmax\nparams:\n  vec: {values: [8]}\nconstraints:\n  - {expr: vec <= head_dim, why: w}\n")
    with pytest.raises(UsageError, match=rf"^{re.escape(str(bad))}:5: constraint: unknown name 'head_dim'"):
        load_space(bad)
    shadow = tmp_path / "shadow.yaml"
    shadow.write_text("family: softmax\nparams:\n  cols: {values: [8]}\n")
    with pytest.raises(UsageError, match=rf"^{re.escape(str(shadow))}:3: parameter 'cols' shadows a context name"):
        load_space(shadow)
    # The attention space read with the softmax context fails at its first attention name.
    with pytest.raises(UsageError, match=r"attention\.yaml:\d+: .*unknown name 'head_dim'"):
        load_space(REPO_ROOT / "search_spaces" / "attention.yaml", get_problem("softmax").context_names)


def test_space_names_of_a_family_outside_evotune(tmp_path):
    """A plugin family's space reads names its Problem gives (the CLI passes them); told none, any name
    loads and fails when evaluated, with file and line."""
    from evotune.space.searchspace import space_family

    path = tmp_path / "plugin.yaml"
    path.write_text("family: mypkg.gemm:PROBLEM\nparams:\n  tile: {values: [64]}\n"
                    "constraints:\n  - {expr: tile <= m, why: w}\n")
    assert space_family(path) == "mypkg.gemm:PROBLEM"
    space = load_space(path)
    assert space.admitted(space.default_config(), {"m": 128})
    with pytest.raises(UsageError, match=rf"^{re.escape(str(path))}:5: constraint: tile <= m: unknown name 'm'$"):
        space.violations(space.default_config(), {})
    assert load_space(path, ("m", "n", "k")).family == "mypkg.gemm:PROBLEM"
    with pytest.raises(UsageError, match=rf"^{re.escape(str(path))}:5: constraint: unknown name 'm'"):
        load_space(path, ("rows", "cols"))


@pytest.mark.parametrize("shape_text", SHAPES)
def test_every_admitted_config_instantiates(softmax, sspace, shape_text):
    """Each admitted config gives one extern "C" entry whose launch is whole warps, at most 1024 threads."""
    shape = softmax.parse_shape(shape_text)
    ctx = softmax.context(shape)
    admitted = sspace.admitted_configs(ctx)
    assert len(admitted) > 50
    for cfg in admitted:
        src = instantiate(softmax, cfg, shape)
        assert src.entry == "evotune_softmax" and src.code.count('extern "C" __global__') == 1
        geo = softmax.geometry(cfg, shape)
        env = sspace.derive(cfg, ctx)
        assert geo.threads == env["threads"] and geo.threads % 32 == 0 and geo.threads <= 1024
        assert geo.grid[0] * cfg["rows_per_cta"] >= shape.rows and geo.dynamic_smem == 0
        if cfg["strategy"] == "cached":
            assert softmax.cache_vecs(cfg, shape) * cfg["vec"] == env["cache_floats"] <= 64


def test_template_args_match_traits_parameters(softmax, sspace):
    """The names of template_args() are, in order, the template parameters of evotune::SoftmaxTraits."""
    template = (REPO_ROOT / "kernels" / "softmax.cu").read_text()
    decl = re.search(r"template\s*<([^>]*)>\s*struct\s+SoftmaxTraits\b", template)
    cuda_names = [part.split()[-1].rstrip("_") for part in decl.group(1).split(",")]
    python_names = [n for n, _ in softmax.template_args(sspace.default_config(), parse_shape("64,1024"))]
    assert python_names == cuda_names


def test_code_depends_on_cols_only_when_cached(softmax, sspace):
    """Rows never change the code; cols change it only through the cached strategy's register capacity."""
    online = sspace.config({"strategy": "online", "unroll": 2})
    cached = sspace.config({"strategy": "cached", "threads_per_row": 128})
    a, b, c = parse_shape("64,1024"), parse_shape("7,1024"), parse_shape("64,3000")
    assert instantiate(softmax, online, a).code == instantiate(softmax, online, b).code == instantiate(softmax, online, c).code
    assert instantiate(softmax, cached, a).code == instantiate(softmax, cached, b).code
    assert instantiate(softmax, cached, a).code != instantiate(softmax, cached, c).code
    assert "/* CACHE_VECS = */ 1" in instantiate(softmax, cached, a).code
    assert "/* CACHE_VECS = */ 3" in instantiate(softmax, cached, c).code
    bf16 = instantiate(softmax, online, parse_shape("64,1024:bf16")).code
    assert "/* IS_BF16 = */ true" in bf16 and bf16 != instantiate(softmax, online, a).code


# ------------------------------------------------------------------ NVRTC


# (shape, config): each code path at least once (sub-warp, warp and multi-warp rows; each strategy; each vector width).
COMPILE_CASES = [
    ("4096,1024", {}),
    ("64,16384", {"threads_per_row": 1024, "strategy": "cached"}),
    ("1000,1003:bf16", {"threads_per_row": 8, "rows_per_cta": 16, "vec": 2, "strategy": "three_pass", "unroll": 4}),
    ("1000,1003:bf16", {"threads_per_row": 32, "rows_per_cta": 8, "vec": 4, "strategy": "online", "unroll": 4}),
    ("33,50257", {"threads_per_row": 512, "rows_per_cta": 2, "vec": 8, "strategy": "online", "unroll": 2}),
    ("65536,128", {"threads_per_row": 4, "rows_per_cta": 32, "vec": 8, "strategy": "cached"}),
    ("1,1:bf16", {"threads_per_row": 32, "rows_per_cta": 1, "vec": 8, "strategy": "cached"}),
]


def _check_clean(softmax, sspace, shape, cfg):
    ctx = softmax.context(shape)
    assert sspace.admitted(cfg, ctx), sspace.violations(cfg, ctx)
    src = instantiate(softmax, cfg, shape)
    compiled = compile_source(src.code, src.entry)
    res = compiled.resources
    assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (cfg.key(), res)
    geo = softmax.geometry(cfg, shape)
    assert static_violations(res, geo.threads, geo.dynamic_smem) == [], cfg.key()
    return compiled


@pytest.mark.parametrize("shape_text, overrides", COMPILE_CASES, ids=[f"{s}-{i}" for i, (s, _) in enumerate(COMPILE_CASES)])
def test_compiles_clean(softmax, sspace, shape_text, overrides):
    """Each code path compiles for sm_90a with no spills and no local memory, and passes the static gate."""
    compiled = _check_clean(softmax, sspace, softmax.parse_shape(shape_text), sspace.config(overrides))
    assert f"Compiling entry function 'evotune_softmax' for 'sm_90a'" in compiled.log


def test_random_sample_compiles_clean(softmax, sspace):
    """A seeded sample of the configs admitted on a ragged bf16 shape compiles with no spills."""
    shape = softmax.parse_shape("1000,1003:bf16")
    for cfg in random.Random(7).sample(sspace.admitted_configs(softmax.context(shape)), 5):
        _check_clean(softmax, sspace, shape, cfg)


def knob_pair(sspace, ctx, name):
    """Two admitted configs that differ only in `name`: the default moved, else the first admitted config that can be."""
    param = next(p for p in sspace.params if p.name == name)
    for base in [sspace.default_config()] + sspace.admitted_configs(ctx):
        if not sspace.admitted(base, ctx):
            continue
        for value in param.values:
            if value != base[name]:
                other = sspace.config({**base.as_dict(), name: value})
                if sspace.admitted(other, ctx):
                    return base, other
    return None


@pytest.mark.parametrize("name", load_builtin("softmax").param_names())
def test_every_knob_changes_the_machine_code(softmax, sspace, name):
    """Moving one knob changes the source beyond the banner and the entry's SASS in the cubin."""
    shape = softmax.parse_shape("4096,1024")
    pair = knob_pair(sspace, softmax.context(shape), name)
    assert pair is not None, f"no two admitted configs differ only in {name}"
    sources = [instantiate(softmax, cfg, shape) for cfg in pair]
    assert without_banner(sources[0].code) != without_banner(sources[1].code)
    texts = [text_section(Path(compile_source(s.code, s.entry).cubin_path).read_bytes(), s.entry) for s in sources]
    assert texts[0] != texts[1]


# ------------------------------------------------------------------ the search loop, a run, export


REDUCED_SPACE = """\
family: softmax
params:
  threads_per_row: {values: [32, 128]}
  rows_per_cta: {values: [1, 4]}
  vec: {values: [8, 4]}
  strategy: {values: [cached, online]}
  unroll: {values: [1, 2]}
derived:
  threads: threads_per_row * rows_per_cta
  cache_floats: max(1, ceil_div(cols // vec, threads_per_row)) * vec
constraints:
  - {expr: "strategy != 'cached' or unroll == 1", why: unroll is for streaming}
  - {expr: "strategy != 'cached' or cache_floats <= 64", why: registers}
"""


class FakeEvaluator:
    """Answers OK with a time made from the config, as a GPU worker would after the gate passed."""

    def __init__(self, space, context):
        self.space, self.context, self.calls = space, context, []

    def __call__(self, config, compiled) -> Result:
        assert self.space.admitted(config, self.context)
        assert compiled.entry == "evotune_softmax" and Path(compiled.cubin_path).is_file()
        self.calls.append(config.digest())
        t = round(10.0 + 8 / config["vec"] + config["rows_per_cta"] / 4 + (config["strategy"] == "online")
                  + compiled.resources.registers / 1000, 6)
        return Result(status=R.OK, time_us=t, max_abs=1e-4,
                      timing={"median_us": t, "p10_us": t, "p90_us": t, "reps": 5, "launches_per_rep": 10,
                              "method": "fake"},
                      verification={"max_abs": 1e-4, "gate_ratio": 0.2, "atol": 1e-6, "rtol": 1e-3, "seeds": [1]})


def test_search_end_to_end_writes_a_run_that_exports(softmax, runs_root, tmp_path):
    """The generic search loop runs the softmax family with real compiles, records a run, and `export` reads it back."""
    path = tmp_path / "softmax-reduced.yaml"
    path.write_text(REDUCED_SPACE)
    shape = softmax.parse_shape("1000,1003:bf16")
    space = load_space(path)
    ctx = softmax.context(shape)
    run = Run.create("softmax-e2e", {"family": softmax.family, "shape": shape.as_dict(), "shape_spec": shape.spec,
                                     "space": str(path)})
    ev = FakeEvaluator(space, ctx)
    options = SearchOptions(trials=6, sampler="random", population=4, seed=0, compile_workers=2)
    summary = run_search(softmax, space, shape, run, ev, options)

    records = run.trials()
    counted = [r for r in records if r["counted"]]
    assert summary["evaluated"] == len(counted) == len(ev.calls) == 6 == len(set(ev.calls))
    assert all(r["result"]["status"] == R.OK and r["result"]["resources"]["registers"] > 0 for r in counted)
    for r in records:
        if not r["counted"] and r.get("duplicate_of") is None:
            assert r["result"]["status"] == R.PRUNED
    best = json.loads((run.path / "best.json").read_text())
    assert best == summary["best"] and best["result"]["time_us"] == min(r["result"]["time_us"] for r in counted)

    out = tmp_path / "best.cu"
    result = CliRunner().invoke(app, ["export", "best", "--run", "softmax-e2e", "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith("// evotune export: row softmax kernel, configuration baked in\n")
    assert "// shape        1000,1003:bf16  (rows=1000 cols=1003)" in text
    from evotune.records.sources import read_source

    archived = read_source(run.path, best["source_digest"], softmax.entry_name)  # the search archived what it measured
    assert text == export_source(softmax, shape, space.config(best["config"]), best, run.meta(), source=archived)
    assert 'extern "C" __global__' in text and "/* IS_BF16 = */ true" in text


# ------------------------------------------------------------------ the CLI


def test_shapes_command(monkeypatch):
    """`shapes --family softmax` lists the softmax presets (table and JSON); attention stays the default."""
    monkeypatch.setattr(cli_common.console, "width", 200)
    table = CliRunner().invoke(app, ["shapes", "--family", "softmax"])
    assert table.exit_code == 0 and all(name in table.stdout for name in PRESETS)
    assert "rows" in table.stdout and "cols" in table.stdout and "mission" not in table.stdout
    out = json.loads(CliRunner().invoke(app, ["shapes", "--family", "softmax", "--json"]).stdout)
    assert out["vocab-50k"] == {"rows": 1024, "cols": 50257, "dtype": "fp16", "spec": "1024,50257:fp16",
                                "about": PRESETS["vocab-50k"][1]}
    assert "mission" in json.loads(CliRunner().invoke(app, ["shapes", "--json"]).stdout)


@pytest.mark.parametrize("args", [["--family", "softmax"], ["--space", str(REPO_ROOT / "search_spaces" / "softmax.yaml")]],
                         ids=["family", "space"])
def test_check_compiles_softmax(runs_root, args):
    """`check` on a softmax shape compiles real kernels with NVRTC; the family comes from --family or the space file."""
    result = CliRunner().invoke(app, ["check", *args, "--shape", "4096,1024", "--sample", "2", "--jobs", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["summary"]["shape"] == "4096,1024:fp16" and out["summary"]["compiled"] == 2
    assert out["summary"]["compile_errors"] == 0
    assert all(row["resources"]["registers"] > 0 and row["resources"]["spill_stores"] == 0 for row in out["configs"])


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["check", "--family", "softmax", "--shape", "1,2,3"], "cannot read '1,2,3'"),
        (["check", "--family", "softmax", "--shape", "mission"], "unknown preset 'mission'"),
        (["check", "--family", "nosuch"], "unknown kernel family 'nosuch'"),
        (["shapes", "--family", "nosuch"], "unknown kernel family 'nosuch'"),
        (["check", "--family", "softmax", "--space", str(REPO_ROOT / "search_spaces" / "attention.yaml")],
         "space is for family 'attention', not 'softmax'"),
        (["search", "--family", "softmax", "--shape", "4,32,4096,128"], "cannot read '4,32,4096,128'"),
    ],
    ids=["malformed", "attention-preset", "unknown-family", "shapes-unknown-family", "space-of-other-family",
         "search-attention-shape"],
)
def test_usage_errors(runs_root, monkeypatch, capsys, args, fragment):
    """Bad softmax input exits 2 with one `evotune: error:` line and no run folder."""
    monkeypatch.setattr("sys.argv", ["evotune", *args])
    with pytest.raises(SystemExit) as info:
        cli_module.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and err[0].startswith("evotune: error: ") and fragment in err[0]
    assert not runs_root.exists()


# ------------------------------------------------------------------ generality


GENERIC_MODULES = ("build/compile.py", "gpu/evaluate.py", "search/loop.py", "records/runs.py", "gpu/workers.py",
                   "build/template.py", "build/export.py", "gpu/sanitize.py")


def code_words(source: str) -> set[str]:
    """Every identifier, attribute and string constant of a module's code, lower-cased: what it can branch on.
    Comments and docstrings are prose (a measured fact may name the space it was measured on)."""
    import ast

    tree = ast.parse(source)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.arg):
            words.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            words.add(node.name)
        elif isinstance(node, ast.alias):
            words.add(node.name)
        elif isinstance(node, ast.ImportFrom):
            words.add(node.module or "")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.add(node.value)
    return {w.lower() for w in words}


@pytest.mark.parametrize("module", GENERIC_MODULES)
def test_generic_modules_know_no_family(module):
    """The family-independent modules' code names no attention concept and does not import the attention shapes."""
    source = (REPO_ROOT / "evotune" / module).read_text()
    words = code_words(source)
    for word in ("attention", "head_dim", "seq_q", "seq_k", "causal", "sdpa"):
        assert not [w for w in words if word in w], f"evotune/{module} uses {word!r}: {[w for w in words if word in w]}"
    assert not re.search(r"^\s*(from \.+(problems\.)?shapes import|from evotune\.problems\.shapes import|"
                         r"import evotune\.problems\.shapes)", source, re.M)


def test_code_words_sees_code_not_prose():
    """The check above reads identifiers and string constants, not comments or docstrings."""
    words = code_words('"""attention doc"""\nimport x  # causal\nfrom .shapes import Shape\n'
                       'def f(seq_q):\n    """head_dim doc"""\n    return y.head_dim + g("sdpa")\n')
    assert {"seq_q", "head_dim", "sdpa", "shapes", "shape", "f", "y", "g"} <= words
    assert "attention doc" not in words and "head_dim doc" not in words and "causal" not in " ".join(words)
