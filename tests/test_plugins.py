"""Plugin families load only from modules the person running evotune allowed (EVOTUNE_PLUGINS), and bad
space files end as one `file:line` error with exit code 2, through the library and the command line.

Each test that loads a plugin writes a module whose import leaves a marker file, so "nothing was
imported" is checked by the marker's absence, not assumed. conftest allows the suite's own plugin
modules; the tests here remove or replace that opt-in themselves.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evotune.errors import UsageError
from evotune.problems import PLUGINS_ENV, allow_plugins, allowed_plugin_modules, get_problem
from evotune.records.runs import Run
from _paths import REPO_ROOT

MODULE = "evotune_markerfam"
FAMILY = f"{MODULE}:PROBLEM"


def module_source(family: str, marker: Path) -> str:
    """A plugin family module that writes `marker` when it is imported."""
    return textwrap.dedent(f"""\
        from pathlib import Path

        from evotune.problems.attention import AttentionProblem

        Path({str(marker)!r}).write_text("imported")


        class MarkerProblem(AttentionProblem):
            family = {family!r}


        PROBLEM = MarkerProblem()
        """)


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """The marker file of `evotune_markerfam`, written into tmp_path/plugins (not on sys.path until a test puts it
    there); the module is forgotten before and after the test so that each test imports it afresh."""
    folder = tmp_path / "plugins"
    folder.mkdir()
    path = tmp_path / "imported.txt"
    (folder / f"{MODULE}.py").write_text(module_source(FAMILY, path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    yield path
    sys.modules.pop(MODULE, None)


def assert_refused(info, module: str) -> None:
    message = str(info.value)
    assert f"is a plugin: loading it runs the Python module {module!r}" in message
    assert f"set {PLUGINS_ENV}={module} " in message
    assert "\n" not in message and info.value.exit_code == 2


# ------------------------------------------------------------------ the opt-in


def test_plugin_refused_without_opt_in(marker, monkeypatch):
    """Without EVOTUNE_PLUGINS a plugin family is one UsageError line saying how to allow it, and nothing is imported."""
    monkeypatch.syspath_prepend(str(marker.parent / "plugins"))
    with pytest.raises(UsageError) as info:
        get_problem(FAMILY)
    assert str(info.value).startswith(f"kernel family {FAMILY!r} is a plugin")
    assert_refused(info, MODULE)
    assert not marker.exists() and MODULE not in sys.modules


@pytest.mark.parametrize("allowed", ["evotune_marker", f"{MODULE}.sub", "other", "tests"])
def test_opt_in_names_modules_not_prefixes(marker, monkeypatch, allowed):
    """A name allows that module and its submodules only: not a module it is a prefix of, nor the package above it."""
    monkeypatch.syspath_prepend(str(marker.parent / "plugins"))
    monkeypatch.setenv(PLUGINS_ENV, allowed)
    with pytest.raises(UsageError) as info:
        get_problem(FAMILY)
    assert_refused(info, MODULE)
    assert not marker.exists()


def test_opt_in_loads_the_named_module(marker, monkeypatch):
    """A module named among others (spaces around commas are fine) loads."""
    monkeypatch.syspath_prepend(str(marker.parent / "plugins"))
    monkeypatch.setenv(PLUGINS_ENV, f"other.module, {MODULE} ,")
    assert get_problem(FAMILY).family == FAMILY
    assert marker.read_text() == "imported"


def test_a_package_allows_its_submodules(tmp_path, monkeypatch):
    """Allowing a package allows the families of its submodules."""
    package = tmp_path / "evotune_markerpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    marker = tmp_path / "imported.txt"
    (package / "fam.py").write_text(module_source("evotune_markerpkg.fam:PROBLEM", marker))
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("evotune_markerpkg", "evotune_markerpkg.fam"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setenv(PLUGINS_ENV, "evotune_markerpkg")
    try:
        assert get_problem("evotune_markerpkg.fam:PROBLEM").family == "evotune_markerpkg.fam:PROBLEM"
        assert marker.exists()
    finally:
        sys.modules.pop("evotune_markerpkg.fam", None)
        sys.modules.pop("evotune_markerpkg", None)


def test_current_directory_only_for_an_allowed_module(marker, monkeypatch):
    """A family module in the current directory (not on sys.path) is neither imported nor is the directory
    added to sys.path unless its module is allowed; allowed, it loads from there."""
    folder = marker.parent / "plugins"
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(folder))])
    with pytest.raises(UsageError) as info:
        get_problem(FAMILY)
    assert_refused(info, MODULE)
    assert not marker.exists() and str(folder) not in sys.path
    monkeypatch.setenv(PLUGINS_ENV, MODULE)
    assert get_problem(FAMILY).family == FAMILY and marker.exists()


def test_allow_plugins_helper(monkeypatch):
    """allow_plugins (for a --plugin flag) adds module names to the opt-in once each, and refuses a path."""
    monkeypatch.setenv(PLUGINS_ENV, "a")
    allow_plugins(["b.c", "a", " d "])
    assert allowed_plugin_modules() == ("a", "b.c", "d")
    with pytest.raises(UsageError) as info:
        allow_plugins(["e", "my/fam.py"])
    assert str(info.value) == "plugin module 'my/fam.py': write a module name, package.module"
    assert info.value.exit_code == 2 and allowed_plugin_modules() == ("a", "b.c", "d")


def test_child_processes_inherit_the_opt_in(monkeypatch):
    """The opt-in lives in the environment, so a fresh process (as a worker is) loads the family by name, and a
    process without it refuses."""
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    allow_plugins(["tests.fault_family"])
    code = "from evotune.problems import get_problem; print(get_problem('tests.fault_family:PROBLEM').family)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "tests.fault_family:PROBLEM", proc.stderr
    monkeypatch.delenv(PLUGINS_ENV)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert proc.returncode != 0 and f"{PLUGINS_ENV}=tests.fault_family " in proc.stderr


# ------------------------------------------------------------------ the command line


def one_error_line(proc, *fragments: str) -> str:
    """`proc` exited 2 with one `evotune: error:` line on stderr holding every fragment."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("evotune: error: "), proc.stderr
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def test_space_naming_a_plugin_needs_the_opt_in(marker, main_in_process, monkeypatch, tmp_path):
    """`evotune check --space` on a file naming a plugin family exits 2 saying how to allow it, importing nothing."""
    monkeypatch.syspath_prepend(str(marker.parent / "plugins"))
    space = tmp_path / "plugin.yaml"
    space.write_text(f"family: {FAMILY}\nparams:\n  block_m: {{values: [64]}}\n")
    one_error_line(main_in_process("check", "--space", str(space)), f"kernel family {FAMILY!r} is a plugin",
                   f"{PLUGINS_ENV}={MODULE}")
    assert not marker.exists()


def test_opening_a_run_folder_imports_nothing(marker, main_in_process, monkeypatch, tmp_path):
    """A run recorded with a plugin family, its module sitting in the run folder, is reported by name and not imported
    when someone exports it from inside that folder."""
    run = Run.create("foreign", {"family": FAMILY, "shape": {}, "shape_spec": "mission"})
    (run.path / f"{MODULE}.py").write_text((marker.parent / "plugins" / f"{MODULE}.py").read_text())
    monkeypatch.chdir(run.path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(run.path))])
    one_error_line(main_in_process("export", "--run", "foreign", "-o", str(tmp_path / "x.cu")),
                   f"kernel family {FAMILY!r} is a plugin", f"{PLUGINS_ENV}={MODULE}")
    assert not marker.exists() and not (tmp_path / "x.cu").exists()


BAD_SPACES = [
    # (id, file text, line, text the error line contains)
    ("string-for-int", "family: attention\nparams:\n  block_m: {values: ['64']}\n", 3,
     "'64' is not a value of knob 'block_m' that the attention template accepts"),
    ("unknown-smem-layout", "family: attention\nparams:\n  smem_layout: {values: [swizzle, banana]}\n", 3,
     "'banana' is not a value of knob 'smem_layout'"),
    ("unknown-knob", "family: softmax\nparams:\n  vec: {values: [8]}\n  unrol: {values: [1, 2]}\n", 4,
     "parameter 'unrol' is not a knob of the softmax family"),
    ("python-tag", "family: attention\nparams:\n  block_m: {values: [!!python/object/apply:os.getpid []]}\n", 3,
     "tag '!!python/object/apply:os.getpid' is not allowed"),
    ("nested-powers", "family: attention\nparams:\n  block_m: {values: [64]}\nconstraints:\n"
     "  - {expr: ((head_dim ** 64) ** 64) ** 64 > 1, why: w}\n", 5, "64 ** 64 is larger than 2**64 in magnitude"),
    ("deep-expression", "family: attention\nparams:\n  block_m: {values: [64]}\nderived:\n  x: "
     + "-" * 200 + "block_m\n", 5, "nested more than 64 deep"),
    ("deep-yaml", "family: attention\nparams:\n  block_m: {values: " + "[" * 100 + "]" * 100 + "}\n", 3,
     "nested more than 32 deep"),
]


@pytest.mark.parametrize("text, line, fragment", [c[1:] for c in BAD_SPACES], ids=[c[0] for c in BAD_SPACES])
def test_bad_space_file_exits_2_with_file_and_line(main_in_process, tmp_path, text, line, fragment):
    """`evotune check --space` on a bad file exits 2 with one `file:line` error line: no internal error, no traceback."""
    space = tmp_path / "bad.yaml"
    space.write_text(text)
    proc = main_in_process("check", "--space", str(space))
    one_error_line(proc, f"evotune: error: {space}:{line}: ", fragment)
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
