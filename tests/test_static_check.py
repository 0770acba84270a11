"""Tests for evotune.search.static_check (what `evotune check` runs): enumerating a space with progress reports,
and sampling the admitted configs. The compiles themselves are covered by test_cli and test_bad_input."""

from __future__ import annotations

import pytest

from evotune.search import static_check
from evotune.space.searchspace import load_builtin, shape_context


@pytest.fixture(scope="module")
def small():
    return load_builtin("attention-small")


def test_enumeration_reports_progress_to_the_end(small, mission):
    """admitted_configs admits exactly what the space admits, in file order, and reports (size, size) at the end."""
    reports = []
    admitted, enumerated, seconds = static_check.admitted_configs(small, shape_context(mission),
                                                                 lambda done, total: reports.append((done, total)))
    assert enumerated == small.size() and seconds >= 0
    assert admitted == small.admitted_configs(shape_context(mission))
    assert reports == [(small.size(), small.size())]


def test_full_space_enumeration_takes_the_pruned_path(mission, monkeypatch):
    """`evotune check` on the full attention space enumerates through the pruned walk: neither the naive loop nor a
    per-config admitted() over its 165 billion configs runs. Its time is measured by tools/suite_timings.py."""
    from evotune.space import enumeration, searchspace

    def never(*args, **kwargs):
        raise AssertionError("enumerated config by config, not through the pruned walk")

    monkeypatch.setattr(enumeration._Enumeration, "naive", never)
    monkeypatch.setattr(searchspace.SearchSpace, "all_configs", never)
    space = load_builtin("attention")
    admitted, enumerated, seconds = static_check.admitted_configs(space, shape_context(mission))
    assert enumerated == space.size() == 165112971264 and len(admitted) == 135584
    assert seconds >= 0


def test_pick(small, mission):
    """pick: 0 or a sample at least as large as what is admitted takes all; otherwise a seeded sample."""
    admitted = small.admitted_configs(shape_context(mission))
    assert static_check.pick(admitted, 0, 0) == admitted == static_check.pick(admitted, len(admitted) + 5, 0)
    five = static_check.pick(admitted, 5, 1)
    assert len(set(c.key() for c in five)) == 5 and five == static_check.pick(admitted, 5, 1)
    with pytest.raises(ValueError):
        static_check.pick(admitted, -5, 0)


def test_compile_nothing_starts_no_pool(small, mission, attention, monkeypatch):
    """With nothing to compile, compile_all returns no rows without starting worker processes."""
    import evotune.build.compile as compile_module

    monkeypatch.setattr(compile_module, "compile_pool", lambda workers: pytest.fail("a pool was started"))
    assert static_check.compile_all(attention, mission, small, [], jobs=4) == []
