"""evotune's compiled launcher: evotune::attention's CUDA kernel in C++ (launcher.cpp), built on first use with the
host's C++ compiler against the installed torch and cached, as Triton builds its launchers.

On by default (EVOTUNE_CPP_LAUNCHER=0 turns it off). The op's first kernel route on a CUDA device starts the build in
a background thread (once per torch version and source: evotune's cache folder, launcher/<torch>-<digest>/; about
15-30 s of one CPU core), so no call waits for a compiler: until the library is loaded the op launches from Python,
and the first eager call after the build loads it (evotune.torch.warmup() builds and loads it at once). The library
is a Python extension module and a torch library at once:
- it registers the CUDA kernel of evotune::attention, so a compiled graph's call reaches C++ through the dispatcher;
- it gives Python `call` (CALL[0]), which the op's eager entry tries first: a plain call whose facts have a route
  allocates its output, patches the addresses (re-encoding a TMA map whose address changed) and calls cuLaunchKernel
  (or runs at::scaled_dot_product_attention for an SDPA route) without the dispatcher's schema parsing and without
  Python's route. Each kernel route the op works out registers with it (the loaded CUfunction, grid, block, shared
  memory, the packed parameters and the slots a call rewrites); so does each SDPA route.
Calls the library has no route for run the op's Python route, as without it (from the dispatcher: through
evotune::_attention_body).

Where no compiler is found ($CXX, else c++), Python's headers are missing or the build fails, the op launches from
Python, told once (EvotuneLauncherWarning, naming the compiler's log). A pdl config (cuLaunchKernelEx) and the training
variant keep the Python launch, and so does a call with a softcap, a window or sink logits: the library's call key has
none of them, so it hands such a call to the Python body unread and the op registers no route for one (their packets
carry the cap and the window's sides, and a sinks call's the logits' pointer, rewritten per call, which a key of their
own and its registration would have to add).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import threading
import warnings
from pathlib import Path

ENV = "EVOTUNE_CPP_LAUNCHER"
SOURCE = Path(__file__).with_name("launcher.cpp")
LIBRARY = "evotune_launcher.so"
_SLOTS = ("q", "k", "v", "o", "tile_counter", "ws_o", "ws_lse", "ws_count")  # launcher.cpp's address order
_SIZES = {"ptr": 8, "i64": 8, "i32": 4, "f32": 4, "u32": 4, "map": 128}
_ALIGN = {"map": 64}


class EvotuneLauncherWarning(UserWarning):
    """The compiled launcher was asked for and cannot be used: the op launches from Python."""


class LauncherBuildError(Exception):
    """No compiler, or the compiler refused the source (the message names its log)."""


_LOCK = threading.Lock()
# loaded: None = not tried, True / False after the try; build: the background build's thread, else None;
# built: its result, the library's path or the LauncherBuildError.
_STATE = {"loaded": None, "why": None, "build": None, "built": None}
ACTIVE = [False]   # whether the library is loaded and takes routes: read by the op's eager entry on every call
PENDING = [False]  # a background build finished and waits to be loaded: the op's eager entry then calls load()
CALL = [None]      # the library's Python entry (launcher.cpp's py_call) once loaded
ON_LOAD: list = []  # called once the library is loaded (the op forgets its Python routes, so they register here)


def requested() -> bool:
    """Whether the compiled launcher is wanted: yes unless EVOTUNE_CPP_LAUNCHER=0."""
    return os.environ.get(ENV, "") != "0"


def compiler() -> str | None:
    """The host C++ compiler: $CXX, else c++ on PATH (None where neither is found)."""
    return shutil.which(os.environ.get("CXX") or "c++")


def _flags(torch) -> list[str]:
    from torch.utils.cpp_extension import include_paths, library_paths

    lib = library_paths()[0]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    python = sysconfig.get_paths()["include"]  # Python.h: the library is an extension module too
    return (["-O2", "-std=c++20", "-shared", "-fPIC", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{python}"]
            + [f"-I{p}" for p in include_paths()] + [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu",
                                                     "-ltorch", "-ltorch_python", "-ldl"])


def build_dir(cache=None) -> Path:
    """Where this torch's build of this source lives: <cache>/launcher/torch-<version>-<digest of source, flags and
    compiler>."""
    import torch

    from ...paths import cache_root

    digest = hashlib.sha256(SOURCE.read_bytes() + repr((_flags(torch), compiler(), sys.version_info[:2])).encode())
    version = torch.__version__.replace("+", "_")
    return Path(cache or cache_root()) / "launcher" / f"torch-{version}-{digest.hexdigest()[:16]}"


def build(cache=None) -> Path:
    """The library's path, compiling it first where this torch has no build of this source (a temporary file,
    then a rename: two processes building at once leave one whole library). LauncherBuildError where it cannot."""
    import torch

    cxx = compiler()
    if cxx is None:
        raise LauncherBuildError(f"no C++ compiler found ({os.environ.get('CXX') or 'c++'}; set $CXX)")
    folder = build_dir(cache)
    target = folder / LIBRARY
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("tmp*.so"):  # a build whose process ended before its rename (an hour is no build's)
        if time.time() - stale.stat().st_mtime > 3600:
            stale.unlink(missing_ok=True)
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        raise LauncherBuildError(f"no Python.h in {sysconfig.get_paths()['include']} (install this Python's "
                                 f"development headers)")
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(fd)
    log = folder / "build.log"
    cmd = [cxx, str(SOURCE), "-o", tmp] + _flags(torch)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 and "-std=c++20" in done.stderr:  # a compiler before C++20's name: torch needs 17
            cmd = [a if a != "-std=c++20" else "-std=c++17" for a in cmd]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise LauncherBuildError(f"{cxx} did not run: {e}") from None
    log.write_text(" ".join(cmd) + "\n" + done.stdout + done.stderr)
    if done.returncode != 0:
        os.unlink(tmp)
        first = next((line for line in done.stderr.splitlines() if "error" in line), "exit %d" % done.returncode)
        raise LauncherBuildError(f"{cxx} failed: {first.strip()[:200]} (log: {log})")
    os.replace(tmp, target)
    return target


def load(cache=None, wait: bool = False) -> bool:
    """Whether the compiled launcher is in use: False unless requested(). The first call starts its build in a
    background thread and gives False (wait=True builds in this thread instead); a call after the build finished
    loads it (PENDING says when). A failure is told once, and the op launches from Python."""
    if _STATE["loaded"] is not None:
        return _STATE["loaded"]
    if not requested():
        return False
    with _LOCK:
        if _STATE["loaded"] is None and _STATE["build"] is None:
            if wait:
                try:
                    _STATE["built"] = build(cache)
                except LauncherBuildError as e:
                    _STATE["built"] = e
            else:
                _STATE["build"] = threading.Thread(target=_build_in_background, args=(cache,), daemon=True,
                                                   name="evotune-launcher-build")
                _STATE["build"].start()
                return False
    thread = _STATE["build"]
    if not wait and _capturing():  # loading forgets the op's routes, which are not worked out inside a capture
        return False
    if thread is not None and thread.is_alive():
        if not wait:
            return False
        thread.join()
    with _LOCK:
        if _STATE["loaded"] is None:
            _finish(_STATE["built"])
    return _STATE["loaded"]


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _build_in_background(cache) -> None:
    try:
        _STATE["built"] = build(cache)
    except LauncherBuildError as e:
        _STATE["built"] = e
    except Exception as e:  # noqa: BLE001 (an unforeseen failure of the build is told like a compiler's)
        _STATE["built"] = LauncherBuildError(f"the build failed: {type(e).__name__}: {e}")
    PENDING[0] = True


def _finish(built) -> None:
    """Import the built library (its registrations run as it loads), or tell why not; then the ON_LOAD callbacks."""
    PENDING[0] = False
    try:
        if isinstance(built, BaseException):
            raise built
        module = _import(built)
    except (LauncherBuildError, ImportError, OSError, RuntimeError) as e:
        _STATE["loaded"], _STATE["why"] = False, str(e)
        warnings.warn(f"evotune.torch: the compiled launcher cannot be used ({e}): the op launches from Python, "
                      f"a few microseconds more per call than SDPA ({ENV}=0 stops the attempt)",
                      EvotuneLauncherWarning, stacklevel=4)
        return
    CALL[0] = module.call
    _STATE["loaded"] = ACTIVE[0] = True
    for callback in ON_LOAD:
        callback()


def _import(path: Path):
    """The library as the Python module evotune_launcher (PyInit_evotune_launcher), loaded from `path`."""
    name = "evotune_launcher"
    if name in sys.modules:  # one process imports it once: a second library would register the operators again
        return sys.modules[name]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules[name] = module
    return module


def why_not() -> str | None:
    """Why load() gave False after trying (None where it was not tried or it loaded)."""
    return _STATE["why"]


def layout(params) -> tuple[list[int], int]:
    """(offset per parameter, total bytes) of the packed parameters: each at its own alignment (8 bytes, a tensor
    map 64)."""
    offsets, end = [], 0
    for _, kind in params:
        align = _ALIGN.get(kind, 8)
        end = (end + align - 1) // align * align
        offsets.append(end)
        end += _SIZES[kind]
    return offsets, end


def register(prepared, q, k, v, out, is_causal, scale, enable_gqa, fallback) -> bool:
    """Register `prepared` (a kernels.PreparedLaunch, forward variant) for the facts of this call with the library;
    False where it keeps the Python launch (a pdl config, the training variant, the library not loaded)."""
    if not _STATE["loaded"] or prepared.pdl or prepared.loaded.write_lse:
        return False
    import torch

    from ...build.tma import DATA_TYPE
    from ..kernels import PROBLEM

    workspace = PROBLEM.new_workspace(prepared.loaded.config, prepared.shape, out.device) if prepared.needs_workspace \
        else ()
    packet = prepared._new_packet(q, k, v, out, None, workspace)
    params = prepared.params
    offsets, total = layout(params)
    init = bytearray(total)
    for (name, _), offset in zip(params, offsets):
        raw = packet.as_bytes(name)
        init[offset:offset + len(raw)] = raw
    index = {name: i for i, (name, _) in enumerate(params)}
    slots = [index.get(name, -1) for name in _SLOTS]  # -1: not a parameter of this entry (wgmma: q, k, v are maps)
    maps = []
    for name, tensor, args in prepared.maps:
        maps += [index[name], tensor, DATA_TYPE[args.dtype], *args.dims, *args.strides, *args.box]
    n_o, n_lse, n_count = PROBLEM.launch_plan(prepared.loaded.config, prepared.shape).workspace
    key = torch.ops.evotune_launcher.key_of(q, k, v, bool(is_causal), scale, bool(enable_gqa), fallback)
    torch.ops.evotune_launcher.add_route(key, int(prepared.function), list(prepared.grid), list(prepared.block),
                                         int(prepared.smem), int(prepared.device_index), list(init), offsets, slots,
                                         maps, list(out.shape), list(out.stride()),
                                         [n_o, n_lse, n_count] if prepared.needs_workspace else [0, 0, 0])
    return True


def register_sdpa(q, k, v, is_causal, scale, enable_gqa, fallback, out_size, out_stride) -> bool:
    """Register an SDPA route for the facts of this call (CUDA tensors): the library runs SDPA and returns its result
    in the op's layout (out_size, out_stride), copying only where SDPA's backend chose another. False where the
    library is not loaded."""
    if not _STATE["loaded"]:
        return False
    import torch

    key = torch.ops.evotune_launcher.key_of(q, k, v, bool(is_causal), scale, bool(enable_gqa), fallback)
    torch.ops.evotune_launcher.add_sdpa_route(key, list(out_size), list(out_stride))
    return True


def clear() -> None:
    """Forget every registered route (the op's table or kernel cache changed, or a recorder must see each call)."""
    if _STATE["loaded"]:
        import torch

        torch.ops.evotune_launcher.clear_routes()


def counts() -> dict:
    """{"routes", "launches", "misses", "sdpa", "direct"} of the library (all 0 where it is not loaded): kernel
    launches it made, dispatcher calls it handed to the Python body, SDPA routes it ran, and the calls of either kind
    it served from Python's `call` (the eager entry) rather than the dispatcher."""
    if not _STATE["loaded"]:
        return {"routes": 0, "launches": 0, "misses": 0, "sdpa": 0, "direct": 0}
    import torch

    routes, launches, misses, sdpa, direct = torch.ops.evotune_launcher.counts()
    return {"routes": routes, "launches": launches, "misses": misses, "sdpa": sdpa, "direct": direct}
