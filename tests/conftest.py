"""Shared fixtures, and the rule that skips `gpu` tests where no CUDA GPU is visible.

The `gpu` and `slow` markers are registered in pyproject.toml.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from evotune import cli
from evotune.problems import get_problem
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import load_builtin

# evotune loads a plugin family only from a module EVOTUNE_PLUGINS allows. The suite allows the modules its
# tests load families from (`tests` covers tests.fault_family), at import so that the CLI and worker
# processes the tests start inherit it; tests of the refusal remove or replace the variable themselves.
TEST_PLUGIN_MODULES = ("tests", "nosuchpackage_xyz", "evotune_brokenfam", "evotune_cwdfam")
os.environ["EVOTUNE_PLUGINS"] = ",".join(
    m for m in (os.environ.get("EVOTUNE_PLUGINS", ""), *TEST_PLUGIN_MODULES) if m)


def _torch_sees_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install must not break collection
        return False


def _cupy_device_count() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # ImportError, or CUDARuntimeError where there is no driver or device
        return 0


def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here, or None when both torch and CuPy see a CUDA device."""
    torch_ok = _torch_sees_gpu()
    cupy_count = _cupy_device_count()
    if torch_ok and cupy_count > 0:
        return None
    return f"no CUDA GPU visible (torch.cuda.is_available()={torch_ok}, CuPy device count={cupy_count})"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return  # do not touch the CUDA runtime when nothing needs it
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory):
    """EVOTUNE_CACHE points at one temporary folder for the whole session: tests never touch ~/.cache,
    and a cubin compiled by one test is reused by the next."""
    path = tmp_path_factory.mktemp("evotune-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EVOTUNE_CACHE", str(path))
        yield path


@pytest.fixture(scope="session")
def attention():
    return get_problem("attention")


@pytest.fixture(scope="session")
def space():
    return load_builtin("attention")


@pytest.fixture(scope="session")
def mission():
    return parse_shape("mission")


@pytest.fixture(scope="session")
def decode():
    return get_problem("attention-decode")


@pytest.fixture(scope="session")
def dspace():
    return load_builtin("attention-decode")


def require_or_skip(why, env: str) -> None:
    """Skip the test for the reason `why` (None: nothing missing), unless `env`=1 (CI), where that fails."""
    import os

    if why is not None:
        if os.environ.get(env) == "1":
            pytest.fail(f"{env}=1 but {why}")
        pytest.skip(why)


@pytest.fixture(scope="session")
def cuobjdump():
    """The cuobjdump `evotune sass` uses; skipped where none is installed, unless EVOTUNE_REQUIRE_CUOBJDUMP=1 (CI)."""
    from evotune.errors import EvotuneError
    from evotune.build.sass import cuobjdump_path

    try:
        return cuobjdump_path()
    except EvotuneError as e:
        require_or_skip(str(e), "EVOTUNE_REQUIRE_CUOBJDUMP")


@pytest.fixture(scope="session")
def postgres_url():
    """The URL of a PostgreSQL database on a server started for the session on loopback (tests/_postgres.py).
    Skipped where PostgreSQL is not installed, unless EVOTUNE_REQUIRE_POSTGRES=1 (CI), where that fails."""
    import _postgres

    require_or_skip(_postgres.missing(), "EVOTUNE_REQUIRE_POSTGRES")
    server = _postgres.PostgresServer().start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def runs_root(tmp_path, monkeypatch):
    """EVOTUNE_RUNS points at a temporary folder for the test (spawned processes inherit it)."""
    root = tmp_path / "runs"
    monkeypatch.setenv("EVOTUNE_RUNS", str(root))
    return root


@pytest.fixture
def main_in_process(runs_root, monkeypatch, capsys):
    """Run `evotune.cli.main()` (what the console script calls) in this process: (exit code, stdout, stderr).

    Quicker than a subprocess, for the error paths beyond the ones checked through the real script."""

    def run(*args: str) -> subprocess.CompletedProcess:
        monkeypatch.setattr(sys, "argv", ["evotune", *args])
        capsys.readouterr()
        try:
            cli.main()
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["evotune", *args], code, out, err)

    return run
