"""A wheel (non-editable) install finds its shipped files: the CUDA templates and the built-in spaces inside the
package, runs under the current folder. .ci/run runs this file against the wheel it builds (EVOTUNE_WHEEL_SITE names
the folder it is installed in); in the main suite the same tests run against the checkout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import evotune
from evotune.build.template import instantiate, kernels_dir
from evotune.problems import get_problem
from evotune.records.runs import runs_dir
from evotune.space.searchspace import builtin_names, load_builtin, spaces_dir

WHEEL_SITE = os.environ.get("EVOTUNE_WHEEL_SITE")
PACKAGE = Path(evotune.__file__).resolve().parent
# What any install must carry: each family's template, the pieces it includes, and the spaces the docs name.
TEMPLATES = ("attention.cu", "softmax.cu", "attention_decode.cu", "elementwise.cuh", "device_common.cuh", "ptx.cuh",
             "wgmma.cuh", "attention_hopper.cuh", "hopper/consumer.cuh", "hopper/ring.cuh", "hopper/scheduler.cuh",
             "hopper/producer.cuh", "hopper/epilogue.cuh")
SPACES = ("attention", "attention:small", "attention:hopper3", "softmax")


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    """The packaged folders, not a test's or a user's override."""
    for name in ("EVOTUNE_KERNELS", "EVOTUNE_SPACES", "EVOTUNE_RUNS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.skipif(not WHEEL_SITE, reason="only where .ci/run installs a wheel (EVOTUNE_WHEEL_SITE)")
def test_evotune_is_imported_from_the_wheel():
    """evotune, and the kernels and spaces it reads, come from the wheel's folder, not from the repository."""
    site = Path(WHEEL_SITE).resolve()
    assert PACKAGE.is_relative_to(site), f"evotune imported from {PACKAGE}, not the wheel in {site}"
    assert kernels_dir() == PACKAGE / "kernels" and spaces_dir() == PACKAGE / "search_spaces"


def test_priors_are_shipped():
    """The packaged priors file is in the package evotune reads, and loads."""
    from evotune.records.priors import PACKAGED, load_priors

    assert PACKAGED.parent == PACKAGE / "records" and load_priors()["entries"]


def test_templates_are_shipped():
    """The templates and their pieces are in the kernels folder evotune reads."""
    assert all((kernels_dir() / name).is_file() for name in TEMPLATES), sorted(os.listdir(kernels_dir()))


def test_launcher_source_is_shipped():
    """The compiled launcher's C++ source is in the package evotune builds it from."""
    from evotune.torch import launcher

    assert launcher.SOURCE.parent == PACKAGE / "torch" / "launcher" and launcher.SOURCE.is_file()


def test_builtin_spaces_are_listed_and_named():
    """builtin_names lists the shipped spaces and their profiles (`root:profile`), each root a file of the packaged
    folder."""
    names = builtin_names()
    assert set(SPACES) <= set(names)
    assert all((spaces_dir() / f"{name.partition(':')[0]}.yaml").is_file() for name in names)


@pytest.mark.parametrize("name", SPACES)
def test_builtin_space_loads(name):
    """Each named space loads from the package with its family's knobs and constraints."""
    space = load_builtin(name)
    root, _, profile = name.partition(":")
    assert space.path == str(spaces_dir() / f"{root}.yaml") + (f"#{profile}" if profile else "")
    assert space.size() > 0 and space.params


@pytest.mark.parametrize("family,shape", [("attention", "mission"), ("softmax", "softmax-1k")])
def test_template_instantiates(family, shape):
    """The packaged template instantiates the default config of its family's space into its entry point."""
    problem = get_problem(family)
    src = instantiate(problem, load_builtin(family).default_config(), problem.parse_shape(shape))
    assert src.entry and src.entry in src.code


def test_runs_go_under_the_current_folder(tmp_path, monkeypatch):
    """Without EVOTUNE_RUNS, runs live in ./runs, never beside the installed package."""
    monkeypatch.chdir(tmp_path)
    assert runs_dir() == tmp_path / "runs"
    if WHEEL_SITE:
        assert not (PACKAGE / "runs").exists() and not (Path(WHEEL_SITE) / "runs").exists()
