"""The compiled launcher's CPU side: the switch (on unless EVOTUNE_CPP_LAUNCHER=0), the background build and its
load on a later call, the Python launch where no compiler is found or the build fails (told once), the op's eager
entry trying the library's `call` first, the parameter layout, and a real build on this machine (in a subprocess, so
the library's CUDA kernel is not registered in this test process) that loads as a module, builds the call key and
takes a route's registration."""

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
    monkeypatch.setattr(launcher, "_STATE", {"loaded": None, "why": None, "build": None, "built": None})
    monkeypatch.setattr(launcher, "ACTIVE", [False])
    monkeypatch.setattr(launcher, "PENDING", [False])
    monkeypatch.setattr(launcher, "CALL", [None])
    monkeypatch.setenv("EVOTUNE_CACHE", str(tmp_path))
    return tmp_path


def test_off_when_asked(fresh, monkeypatch):
    """With EVOTUNE_CPP_LAUNCHER=0 nothing is built or loaded, and the op's routes stay Python; unset, it is wanted."""
    monkeypatch.setenv(launcher.ENV, "0")
    monkeypatch.setattr(launcher, "build", lambda cache=None: pytest.fail("built though turned off"))
    assert launcher.requested() is False and launcher.load() is False and launcher.load(wait=True) is False
    assert launcher._STATE["loaded"] is None and launcher._STATE["build"] is None
    assert launcher.counts() == {"routes": 0, "launches": 0, "misses": 0, "sdpa": 0, "direct": 0}
    assert launcher.ACTIVE == [False]
    monkeypatch.delenv(launcher.ENV)
    assert launcher.requested() is True


def test_no_compiler_is_told_once(fresh, monkeypatch):
    """No compiler: load() is False, one EvotuneLauncherWarning names $CXX, and the op still computes (Python)."""
    monkeypatch.delenv(launcher.ENV, raising=False)
    monkeypatch.setenv("CXX", str(fresh / "no-such-compiler"))
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        assert launcher.load(wait=True) is False and launcher.load() is False and launcher.load(wait=True) is False
    said = [str(w.message) for w in told if issubclass(w.category, launcher.EvotuneLauncherWarning)]
    assert len(said) == 1 and "no C++ compiler found" in said[0] and "launches from Python" in said[0]
    assert "no-such-compiler" in launcher.why_not()
    import evotune.torch as et

    q = torch.randn(1, 2, 4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = et.attention(q, q, q)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))


def test_background_build_loads_on_a_later_call(fresh, monkeypatch):
    """The first load() starts the build in a thread and gives False at once; once it finished, PENDING says so and
    the next load() loads it and runs ON_LOAD (the op forgets its Python routes)."""
    import threading

    monkeypatch.delenv(launcher.ENV, raising=False)
    gate, library = threading.Event(), fresh / "evotune_launcher.so"
    monkeypatch.setattr(launcher, "build", lambda cache=None: (gate.wait(30), library)[1])
    module = type("module", (), {"call": staticmethod(lambda *args: None)})
    monkeypatch.setattr(launcher, "_import", lambda path: module if path == library else pytest.fail(str(path)))
    loaded = []
    monkeypatch.setattr(launcher, "ON_LOAD", [lambda: loaded.append(True)])
    assert launcher.load() is False and launcher._STATE["build"].is_alive()
    assert launcher.load() is False and launcher.PENDING == [False] and not loaded  # still building: no wait
    gate.set()
    launcher._STATE["build"].join(30)
    assert launcher.PENDING == [True]
    assert launcher.load() is True and launcher.ACTIVE == [True] and launcher.CALL[0] is module.call
    assert launcher.PENDING == [False] and loaded == [True]


def test_eager_entry_tries_the_library_first(fresh, monkeypatch):
    """With the library loaded, attention() and eager_attention() hand a plain call to its `call` and return what it
    returns; where it gives None (no route there) the op's own route runs; a softcap, window or sinks call never
    reaches it."""
    import evotune.torch as et
    from evotune.torch import op, routing

    seen, served = [], torch.full((1, 2, 4, 8), 7.0)

    def call(*args):
        seen.append(args[3:])
        return served if args[3] else None

    monkeypatch.setattr(launcher, "CALL", [call])
    monkeypatch.setattr(launcher, "ACTIVE", [True])
    monkeypatch.setitem(routing.FAST_ROUTES, ("not", "this", "call"), None)  # the fast path runs where any route is
    q = torch.randn(1, 2, 4, 8)
    assert et.attention(q, q, q, is_causal=True, scale=0.5) is served
    assert op.eager_attention(q, q, q, True, None, False) is served
    assert seen == [(True, 0.5, False, "sdpa"), (True, None, False, "sdpa")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = et.attention(q, q, q)  # the library has no route: the op's own
        torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, q, q))
        assert len(seen) == 3
        et.attention(q, q, q, is_causal=True, softcap=5.0)
        et.attention(q, q, q, window=(2, 0))
        op.eager_attention(q, q, q, True, None, False, softcap=5.0)
    assert len(seen) == 3


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
    monkeypatch.delenv(launcher.ENV, raising=False)
    with pytest.warns(launcher.EvotuneLauncherWarning, match="failed"):
        assert launcher.load(wait=True) is False


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

    assert launcher.load(wait=True), launcher.why_not()
    assert launcher.ACTIVE == [True] and launcher.CALL[0].__name__ == "call"
    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16).transpose(1, 2)     # bshd
    key = torch.ops.evotune_launcher.key_of(q, q, q, True, 0.125, False, "error")
    sizes, strides = [1, 2, 64, 64] * 3, [8192, 64, 128, 1] * 3
    assert key[:24] == sizes + strides, key
    dtype_device = key[24:30]  # per tensor: dtype, then device type * 65536 + index (the CPU: type 0, index -1)
    assert dtype_device == [dtype_device[0], -1] * 3, key
    assert key[30:] == [1, 0, 1, key[33], 1] and key[33] != 0, key  # causal, no gqa, a scale, its bits, error
    assert torch.ops.evotune_launcher.key_of(q, q, q, False, None, False, "other")[-1] == -1
    # K of another dtype, same sizes and strides: another key (a route made for the uniform call is not its own)
    assert torch.ops.evotune_launcher.key_of(q, q.to(torch.bfloat16), q, True, 0.125, False, "error") != key
    # A route registers from a PreparedLaunch of the plain mma.sync config (no tensor maps: nothing needs libcuda).
    shape = Shape(1, 2, 64, 64, 64, "fp16", True, "bshd")
    config = load_builtin("attention").default_config()
    fake = kernels.LoadedKernel(types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=4096)), config, 0, "d", "p")
    out = q.new_empty_strided((1, 2, 64, 64), (8192, 64, 128, 1))
    prepared = kernels.PreparedLaunch(fake, shape, (q.stride(),) * 3, 0.125, out.stride())
    assert launcher.register(prepared, q, q, q, out, True, 0.125, False, "error")
    assert launcher.counts() == {"routes": 1, "launches": 0, "misses": 0, "sdpa": 0, "direct": 0}
    # The Python entry: CPU tensors, other types of options, and a wrong count of arguments.
    assert launcher.CALL[0](q, q, q, True, 0.125, False, "error") is None
    assert launcher.CALL[0](q, q, q, 1, 0.125, False, "error") is None
    try:
        launcher.CALL[0](q, q, q)
    except TypeError as e:
        assert "takes q, k, v" in str(e)
    else:
        raise AssertionError("three arguments taken")
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
