"""The numbers docs/PLUGINS.md states about the examples are generated: the glue counts are the files' own
(docs/data/examples/glue_lines.py), the H100 table is compare.py's from the committed records; and the issue's bar
holds: no example's evotune glue is longer than the Kernel Tuner glue of the same kernel."""

from __future__ import annotations

import importlib.util

from _paths import REPO_ROOT


def _load(name: str):
    path = REPO_ROOT / "docs" / "data" / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plugins_page_holds_the_counted_table():
    """docs/PLUGINS.md's glue table is what glue_lines.py counts today (rerun it after changing an example)."""
    assert _load("glue_lines").table() in (REPO_ROOT / "docs" / "PLUGINS.md").read_text()


def test_evotune_glue_is_no_longer_than_kernel_tuners():
    """Each example's family file and reference module together have no more code lines than its kt_ function."""
    glue = _load("glue_lines")
    for example in glue.EXAMPLES:
        assert glue.evotune_lines(example)["total"] <= glue.kernel_tuner_lines(example), example


def test_plugins_page_holds_the_measured_table():
    """docs/PLUGINS.md's H100 table is compare.py --markdown of the dated records it cites."""
    page = (REPO_ROOT / "docs" / "PLUGINS.md").read_text()
    folder = REPO_ROOT / "docs" / "data" / "examples" / "2026-11-27"
    table = _load("compare").markdown(str(folder))
    assert table in page and "| gemm, `M=4096,N=4096,K=4096:fp16` | evotune |" in table
