"""The compiled launcher's CPU side: the opt-in switch, the Python launch where no compiler is found or the build
fails (told once), the parameter layout, and a real build on this machine (in a subprocess, so the library's CUDA
kernel is not registered in this test process) that loads, builds the call key and takes a route's registration."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from evotune.torch import launcher  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The launcher as in a new process (not tried yet), its builds under tmp_path."""
    monkeypatch.setattr(launcher, "_STATE", {"loaded": None, "why": None})
    monkeypatch.setattr(launcher, "ACTIVE", [False])
    monkeypatch.setenv("EVOTUNE_CACHE", str(tmp_path))
    return tmp_path


def test_off_unless_asked(fresh, monkeypatch):
    """Without EVOTUNE_CPP_LAUNCHER=1 nothing is built or loaded, and the op's routes stay Python."""
    monkeypatch.delenv(launcher.ENV, raising=False)
    monkeypatch.setattr(launcher, "build", lambda cache=None: pytest.fail("built without being asked"))
    assert launcher.requested() is False and launcher.load() is False
    monkeypatch.setenv(launcher.ENV, "0")
    assert launcher.load() is False and launcher._STATE["loaded"] is None
    assert launcher.counts() == {"routes": 0, "launches": 0, "misses": 0, "sdpa": 0} and launcher.ACTIVE == [False]


def test_no_compiler_is_told_once(fresh, monkeypatch):
    """No compiler: load() is False, one EvotuneLauncherWarning names $CXX, and the op still computes (Python)."""
    monkeypatch.setenv(launcher.ENV, "1")
    monkeypatch.setenv("CXX", str(fresh / "no-such-compiler"))
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        assert launcher.load() is False and launcher.load() is False
    said = [str(w.message) for w in told if issubclass(w.category, launcher.EvotuneLauncherWarning)]
    assert len(said) == 1 and "no C++ compiler found" in said[0] and "launches from Python" in said[0]
    assert "no-such-compiler" in launcher.why_not()
    import evotune.torch as et

    q = torch.randn(1, 2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = et.attention(q, q, q)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_failed_build_names_its_log(fresh, monkeypatch):
    """A source the compiler refuses: LauncherBuildError with the log's path, no library left behind."""
    if launcher.compiler() is None:
        pytest.skip("no C++ compiler on this machine")
    bad = fresh / "bad.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(launcher, "SOURCE", bad)
    monkeypatch.setattr(launcher, "_flags", lambda torch: ["-shared", "-fPIC"])
    with pytest.raises(launcher.LauncherBuildError, match="build.log"):
        launcher.build()
    folder = launcher.build_dir()
    assert (folder / "build.log").is_file() and not list(folder.glob("*.so"))
    monkeypatch.setenv(launcher.ENV, "1")
    with pytest.warns(launcher.EvotuneLauncherWarning, match="failed"):
        assert launcher.load() is False


def test_layout_aligns_maps():
    """Scalars and pointers at 8-byte steps, a tensor map at a 64-byte boundary, sized 128."""
    offsets, total = launcher.layout((("a", "i32"), ("m", "map"), ("p", "ptr"), ("f", "f32")))
    assert offsets == [0, 64, 192, 200] and total == 204


def test_build_dir_follows_the_source(fresh, monkeypatch):
    """The build folder is keyed by torch's version and the source: a changed source builds anew."""
    one = launcher.build_dir()
    assert torch.__version__.replace("+", "_") in one.name and one.parent == fresh / "launcher"
    changed = fresh / "changed.cpp"
    changed.write_text(launcher.SOURCE.read_text() + "\n// changed\n")
    monkeypatch.setattr(launcher, "SOURCE", changed)
    assert launcher.build_dir() != one


_BUILD_AND_REGISTER = textwrap.dedent("""
    import sys, types
    import torch
    import evotune.torch as et
    from evotune.torch import launcher, kernels
    from evotune.problems.shapes import Shape
    from evotune.space.searchspace import load_builtin

    assert launcher.load(), launcher.why_not()
    assert launcher.ACTIVE == [True]
    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16).transpose(1, 2)     # bshd
    key = torch.ops.evotune_launcher.key_of(q, q, q, True, 0.125, False, "error")
    sizes, strides = [1, 2, 64, 64] * 3, [8192, 64, 128, 1] * 3
    assert key[:24] == sizes + strides, key
    assert key[25:] == [-1, 1, 0, 1, key[29], 1] and key[29] != 0, key  # CPU index -1, causal, no gqa, scale, error
    assert torch.ops.evotune_launcher.key_of(q, q, q, False, None, False, "other")[-1] == -1
    # A route registers from a PreparedLaunch of the plain mma.sync config (no tensor maps: nothing needs libcuda).
    shape = Shape(1, 2, 64, 64, 64, "fp16", True, "bshd")
    config = load_builtin("attention").default_config()
    fake = kernels.LoadedKernel(types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=4096)), config, 0, "d", "p")
    out = q.new_empty_strided((1, 2, 64, 64), (8192, 64, 128, 1))
    prepared = kernels.PreparedLaunch(fake, shape, (q.stride(),) * 3, 0.125, out.stride())
    assert launcher.register(prepared, q, q, q, out, True, 0.125, False, "error")
    assert launcher.counts() == {"routes": 1, "launches": 0, "misses": 0, "sdpa": 0}
    assert launcher.register_sdpa(q, q, q, False, None, False, "sdpa", (1, 2, 64, 64), (8192, 64, 128, 1))
    assert launcher.counts()["routes"] == 2
    launcher.clear()
    assert launcher.counts()["routes"] == 0
    print("ok")
""")


@pytest.mark.slow
def test_builds_loads_and_registers(tmp_path):
    """The real source builds with this machine's compiler against this torch, loads, and takes a route."""
    if launcher.compiler() is None:
        pytest.skip("no C++ compiler on this machine (the launcher's build needs one)")
    env = {**__import__("os").environ, "EVOTUNE_CPP_LAUNCHER": "1", "EVOTUNE_CACHE": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _BUILD_AND_REGISTER], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
    assert list((tmp_path / "launcher").glob("torch-*/evotune_launcher.so"))
