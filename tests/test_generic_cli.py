"""The command line with a family of your own: a plugin named once by `--family package.module:ATTR` (no --plugin
beside it), a resumed run's family loaded only where allowed, and the live search display spelling the configs in
the searched family's words."""

from __future__ import annotations

import io
import textwrap

from rich.console import Console

from evotune.cli.display import SearchDisplay
from evotune.cli.search import resume_command
from evotune.problems import PLUGINS_ENV


def test_family_module_attr_needs_no_plugin_flag(tmp_path, monkeypatch, main_in_process):
    """`shapes --family evotune_oncefam:PROBLEM` loads the plugin (naming it is the consent); a malformed name is one
    line, exit 2."""
    (tmp_path / "evotune_oncefam.py").write_text(textwrap.dedent("""\
        from evotune.problems.softmax import SoftmaxProblem

        class Once(SoftmaxProblem):
            family = "evotune_oncefam:PROBLEM"

        PROBLEM = Once()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    done = main_in_process("shapes", "--family", "evotune_oncefam:PROBLEM", "--json")
    assert done.returncode == 0, done.stderr
    assert '"spec"' in done.stdout
    bad = main_in_process("shapes", "--family", "not a module:X")
    assert bad.returncode == 2 and "is written package.module:ATTR" in bad.stderr


class _Run:
    run_id = "r1"


def test_search_display_and_resume_hint_speak_the_family():
    """A family file whose knobs are all attention's names (block_m, stages) is shown by those names in the live
    display's trial lines, attention's by its abbreviations; the resume hint names a family of your own."""
    record = {"number": 3, "counted": True, "config": {"block_m": 128, "stages": 3},
              "result": {"status": "ok", "time_us": 12.5, "message": "", "max_abs": 0.0}}
    lines = {}
    for family in ("/x/mine.yaml", "attention"):
        out = io.StringIO()
        with SearchDisplay("run", 4, [], False, Console(file=out, width=200), family) as display:
            display.show(record, record)
        lines[family] = out.getvalue()
    assert "block_m=128 stages=3" in lines["/x/mine.yaml"] and "M128" not in lines["/x/mine.yaml"]
    assert "M128 st3" in lines["attention"]
    assert resume_command(_Run(), "M=64", 8, None, None, "/x/mine.yaml").endswith("--family /x/mine.yaml`")
    assert "--family" not in resume_command(_Run(), "M=64", 8, None, None, "attention")


def test_a_resumed_runs_family_file_loads_only_where_allowed(tmp_path, monkeypatch):
    """The family a run records (what `search --run R --resume` reads) is not allowed by being recorded: loading it
    runs its reference module, so it needs --family FILE or EVOTUNE_PLUGINS; named with --family it loads."""
    import pytest

    from evotune.cli.common import load_problem
    from evotune.errors import UsageError

    from _paths import REPO_ROOT

    family = str(REPO_ROOT / "examples" / "rmsnorm" / "rmsnorm.yaml")
    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    with pytest.raises(UsageError, match="is a family file: loading it runs its reference module"):
        load_problem(None, None, None, family)
    problem, _, _ = load_problem("M=8,N=64", None, family, family)
    assert problem.family == family
