"""Compile kernel sources with NVRTC (through CuPy), cache the cubins, read resources from ptxas -v.

Compiling needs no GPU: CuPy's NVRTC bindings produce a cubin for an explicit
real architecture (sm_90a by default). Only `load_kernel` touches the driver.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from .. import limits
from ..errors import EvotuneError, UsageError

DEFAULT_ARCH = "sm_90a"
# Per-block opt-in shared memory and register file of an SM on sm_90, under their old names (evotune.limits).
SMEM_LIMIT_BYTES = limits.SMEM_PER_BLOCK
REGISTERS_PER_SM = limits.REGISTERS_PER_SM
MAX_REGISTERS_PER_THREAD = limits.REGISTERS_PER_THREAD


class CompileError(EvotuneError):
    """NVRTC rejected the source; the message holds the first error line, `.log` the whole log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class Resources:
    """What ptxas reported for the entry function."""

    registers: int
    static_smem: int
    stack_frame: int
    spill_stores: int
    spill_loads: int
    barriers: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Compiled:
    key: str
    entry: str
    arch: str
    cubin_path: str
    options: tuple[str, ...]
    log: str
    resources: Resources
    compile_seconds: float
    cached: bool = field(default=False, compare=False)
    # The static gate's reasons (static_violations), None until judged. It travels with the kernel (as_dict) so
    # that the search's verdict reaches the GPU worker and the gate runs once per candidate. A verdict holds for
    # every launch of this cubin: the instantiation's static_asserts fix its threads and shared memory.
    static_verdict: tuple[str, ...] | None = field(default=None, compare=False)

    def as_dict(self) -> dict:
        """Plain data (JSON, the worker pipe); from_dict reads it back."""
        verdict = None if self.static_verdict is None else list(self.static_verdict)
        return {"key": self.key, "entry": self.entry, "arch": self.arch, "cubin_path": self.cubin_path,
                "options": list(self.options), "log": self.log, "resources": self.resources.as_dict(),
                "compile_seconds": self.compile_seconds, "cached": self.cached, "static_verdict": verdict}

    @classmethod
    def from_dict(cls, d: dict) -> "Compiled":
        """The Compiled that as_dict wrote; a payload without `cached` or `static_verdict` (an older record)
        reads as not cached and not judged."""
        verdict = d.get("static_verdict")
        return cls(key=d["key"], entry=d["entry"], arch=d["arch"], cubin_path=d["cubin_path"],
                   options=tuple(d["options"]), log=d["log"], resources=Resources(**d["resources"]),
                   compile_seconds=d["compile_seconds"], cached=d.get("cached", False),
                   static_verdict=None if verdict is None else tuple(verdict))


def cache_dir() -> Path:
    root = os.environ.get("EVOTUNE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "evotune")
    path = Path(root) / "cubin"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"compile cache {path}: cannot create it ({e.strerror}); set EVOTUNE_CACHE to a "
                         f"writable folder") from None
    return path


def cuda_roots() -> list[Path]:
    """Folders that may hold CUDA's include/ and bin/: the nvidia cu13 wheels first (nvidia-cuda-runtime,
    nvidia-cuda-cuobjdump, ...), then CUDA_PATH, CUDA_HOME and /usr/local/cuda."""
    roots = []
    try:
        import nvidia.cu13  # type: ignore

        roots += [Path(root) for root in nvidia.cu13.__path__]
    except ImportError:
        pass
    roots += [Path(os.environ[env]) for env in ("CUDA_PATH", "CUDA_HOME") if os.environ.get(env)]
    roots.append(Path("/usr/local/cuda"))
    return list(dict.fromkeys(roots))


def cuda_include_dirs() -> list[str]:
    """Headers for cuda_fp16.h and friends: the nvidia-cuda-runtime wheel first, then a system toolkit."""
    return [str(root / "include") for root in cuda_roots() if (root / "include" / "cuda_fp16.h").exists()]


def toolchain() -> dict:
    """Versions that change generated code; part of every cache key and of run metadata."""
    from cupy.cuda import nvrtc
    import cupy

    major, minor = nvrtc.getVersion()
    return {"nvrtc": f"{major}.{minor}", "cupy": cupy.__version__}


def nvrtc_options(arch: str = DEFAULT_ARCH, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--ptxas-options=-v", "-lineinfo"]
    opts += [f"-I{d}" for d in cuda_include_dirs()]
    return tuple(opts) + tuple(extra)


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_REGS_RE = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?(?:, (\d+) bytes smem)?")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_resources(log: str, entry: str) -> Resources:
    """Read the ptxas -v block of `entry` from an NVRTC program log."""
    blocks = _ENTRY_RE.split(log)
    # split gives [before, name1, body1, name2, body2, ...]
    for name, body in zip(blocks[1::2], blocks[2::2]):
        if name == entry:
            regs = _REGS_RE.search(body)
            stack = _STACK_RE.search(body)
            if not regs or not stack:
                break
            return Resources(
                registers=int(regs.group(1)),
                barriers=int(regs.group(2) or 0),
                static_smem=int(regs.group(3) or 0),
                stack_frame=int(stack.group(1)),
                spill_stores=int(stack.group(2)),
                spill_loads=int(stack.group(3)),
            )
    raise CompileError(f"no ptxas resource report for entry {entry!r} in the NVRTC log", log)


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if "error" in line:
            return line.strip()
    return log.strip().splitlines()[0] if log.strip() else "NVRTC failed with an empty log"


def complete_elf(cubin: bytes) -> bytes:
    """`cubin` padded with zero bytes to the size its ELF header declares.

    CuPy's getCUBIN returns one byte short (it strips a trailing NUL as it does for PTX; a cubin
    has none). The driver loads such a file, but cuobjdump calls it "no device code". The byte
    dropped is the last of the program-header table: the top byte of the last header's 64-bit
    p_align, which is zero."""
    import struct

    if len(cubin) < 64 or cubin[:4] != b"\x7fELF":
        return cubin
    phoff, shoff = struct.unpack_from("<QQ", cubin, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", cubin, 0x36)
    declared = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return cubin + b"\x00" * (declared - len(cubin)) if declared > len(cubin) else cubin


def _nvrtc_compile(code: str, name: str, options: tuple[str, ...]) -> tuple[str, bytes]:
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(code, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog).rstrip("\x00")
            raise CompileError(f"NVRTC: {_first_error(log)}", log) from None
        return nvrtc.getProgramLog(prog).rstrip("\x00"), complete_elf(nvrtc.getCUBIN(prog))
    finally:
        nvrtc.destroyProgram(prog)


def compile_source(code: str, entry: str, arch: str = DEFAULT_ARCH, extra_options: tuple[str, ...] = (),
                   name: str = "evotune.cu") -> Compiled:
    """Compile `code` to a cubin for `arch`, or return the cached one; raise CompileError on failure."""
    options = nvrtc_options(arch, extra_options)
    # Include dirs are install paths, not semantics: keep them out of the key.
    key_material = json.dumps({"code": code, "entry": entry, "arch": arch, "toolchain": toolchain(),
                               "options": [o for o in options if not o.startswith("-I")]}, sort_keys=True)
    key = hashlib.sha256(key_material.encode()).hexdigest()[:24]
    cached = _read_cache(key)
    if cached is not None:
        cubin_path, meta = cached
        return Compiled(key=key, entry=entry, arch=arch, cubin_path=str(cubin_path), options=options,
                        log=meta["log"], resources=Resources(**meta["resources"]),
                        compile_seconds=meta["compile_seconds"], cached=True)

    start = time.perf_counter()
    log, cubin = _nvrtc_compile(code, name, options)
    try:
        resources = parse_resources(log, entry)
    except CompileError:
        # Seen on the H100 machine's NVRTC: a second program whose PTX matches one
        # compiled earlier in the process comes back without ptxas's -v report.
        # A unique (unused, externally visible) global changes the PTX and forces ptxas.
        nonce = f"\n__device__ int evotune_resource_probe_{os.getpid()}_{time.monotonic_ns()} = 0;\n"
        log, cubin = _nvrtc_compile(code + nonce, name, options)
        resources = parse_resources(log, entry)
    seconds = time.perf_counter() - start
    cubin_path = _write_cache(key, cubin, {"log": log, "resources": resources.as_dict(), "compile_seconds": seconds})
    return Compiled(key=key, entry=entry, arch=arch, cubin_path=str(cubin_path), options=options, log=log,
                    resources=resources, compile_seconds=seconds, cached=False)


_RESOURCE_FIELDS = tuple(Resources.__dataclass_fields__)


def _read_cache(key: str) -> tuple[Path, dict] | None:
    """(cubin path, its meta) of a sound cache entry; None when there is none or it is damaged (cut short by
    a full disk or a killed copy, or edited): the caller then compiles afresh and replaces it. A damaged
    entry is overwritten rather than deleted first, so a process loading that path never finds it gone."""
    cubin_path, meta_path = cache_dir() / f"{key}.cubin", cache_dir() / f"{key}.json"
    if not (cubin_path.exists() and meta_path.exists()):
        return None
    try:
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        meta, cubin = None, b""
    return (cubin_path, meta) if _cache_entry_sound(meta, cubin) else None


def _cache_entry_sound(meta, cubin: bytes) -> bool:
    """Whether a cache entry's meta has every field compile_source reads and its cubin is whole: the
    checksum recorded beside it, or (entries written before there was one) an ELF as long as its header says."""
    if not isinstance(meta, dict) or not isinstance(meta.get("log"), str):
        return False
    if not isinstance(meta.get("compile_seconds"), (int, float)):
        return False
    res = meta.get("resources")
    if not isinstance(res, dict) or set(res) != set(_RESOURCE_FIELDS):
        return False
    if not all(isinstance(v, int) for v in res.values()):
        return False
    if "cubin_sha256" in meta:
        return hashlib.sha256(cubin).hexdigest() == meta["cubin_sha256"]
    return cubin[:4] == b"\x7fELF" and complete_elf(cubin) == cubin


def _write_cache(key: str, cubin: bytes, meta: dict) -> Path:
    """Store a cubin and its meta (with the cubin's checksum); returns the cubin's path."""
    cubin_path, meta_path = cache_dir() / f"{key}.cubin", cache_dir() / f"{key}.json"
    # Write-then-rename so a concurrent reader never sees half a file; the cubin first, so that a meta
    # file (what a reader looks for) never names a cubin not yet in place.
    meta_bytes = json.dumps({**meta, "cubin_sha256": hashlib.sha256(cubin).hexdigest()}).encode()
    for path, data in ((cubin_path, cubin), (meta_path, meta_bytes)):
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return cubin_path


# Compiles are background work: the pool has one process per CPU, and at full niceness parity they took the
# CPUs from the two processes a search waits on. Measured on the H100 host (16 CPUs, 16 compile processes): the
# GPU worker's `import torch` took 6-8 s instead of ~3, and each ask 53 ms instead of 23 (tools/loop_cost.py).
COMPILE_NICENESS = 10


def _pool_worker_init(parent_pid: int) -> None:
    """Set up a compile-pool process: lower its CPU priority (COMPILE_NICENESS), leave Ctrl-C to the search
    process (which shuts the pool down), and exit once the search process is gone, even if it was killed
    with SIGKILL (an orphaned worker would otherwise wait on its task queue forever)."""
    import signal
    import threading

    if hasattr(os, "nice"):
        os.nice(COMPILE_NICENESS)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def watch_parent() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(0)

    threading.Thread(target=watch_parent, name="evotune-parent-watch", daemon=True).start()


def compile_pool(workers: int):
    """A process pool for compile_source. Spawned, not forked: the search process may hold threads
    (a live progress display, SQLite) that a forked child would inherit in an undefined state."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_pool_worker_init, initargs=(os.getpid(),))


def static_violations(res: Resources, threads: int, dynamic_smem: int, register_split: int = 0) -> list[str]:
    """Reasons a compiled kernel must not run: spills, local memory, more than one SM can hold, or a setmaxnreg
    split (`register_split`, LaunchGeometry's) above the registers its launch allocates."""
    why = []
    if res.spill_stores or res.spill_loads:
        why.append(f"spills registers ({res.spill_stores} B stores, {res.spill_loads} B loads)")
    if res.stack_frame:
        why.append(f"uses local memory ({res.stack_frame} B stack frame)")
    # Registers are handed out per warp in units of 256, and an SM's four schedulers
    # each hold a quarter of the register file: count whole warps per scheduler.
    warps = -(-threads // 32)
    regs_per_warp = -(-res.registers * 32 // 256) * 256
    if warps > (REGISTERS_PER_SM // regs_per_warp) // 4 * 4:
        why.append(f"{res.registers} registers x {threads} threads do not fit one SM's register file")
    if register_split > warps * regs_per_warp:
        why.append(f"setmaxnreg hands the warpgroups {register_split} registers, more than the launch's "
                   f"{warps * regs_per_warp} ({res.registers} x {threads} threads): setmaxnreg.inc would wait forever")
    if res.static_smem + dynamic_smem > SMEM_LIMIT_BYTES:
        why.append(f"shared memory {res.static_smem + dynamic_smem} B exceeds {SMEM_LIMIT_BYTES} B")
    return why


def launch_violations(res: Resources, geometry) -> list[str]:
    """static_violations for a launch geometry (evotune.problems.LaunchGeometry: threads, dynamic shared memory and the
    setmaxnreg split), so that a call site passes the launch rather than its fields one by one."""
    return static_violations(res, geometry.threads, geometry.dynamic_smem, geometry.register_split)


def judged(compiled: Compiled, geometry) -> Compiled:
    """`compiled` with its static verdict for its launch `geometry` (a LaunchGeometry): the one it carries, else
    launch_violations' reasons, computed here once. The search judges a candidate before a GPU worker evaluates it;
    the worker then reads the verdict."""
    if compiled.static_verdict is not None:
        return compiled
    return replace(compiled, static_verdict=tuple(launch_violations(compiled.resources, geometry)))


def load_kernel(compiled: Compiled, dynamic_smem: int = 0):
    """Load the cubin on the current GPU and return a CuPy RawKernel ready to launch."""
    import cupy

    module = cupy.RawModule(path=compiled.cubin_path)
    kernel = module.get_function(compiled.entry)
    if dynamic_smem > 0:
        # The default cap is 48 KB of static plus dynamic shared memory: a kernel with
        # exactly 48 KB dynamic and any static bytes fails to launch without opting in
        # (seen on the H100: CUDA_ERROR_INVALID_VALUE). Opting in is harmless below the cap.
        kernel.max_dynamic_shared_size_bytes = dynamic_smem
    return kernel


_EXTERNAL_STREAMS: dict[tuple[int, int], object] = {}


def cupy_stream(handle: int, device_index: int):
    """The CuPy view of the CUDA stream `handle` on `device_index`, made once per (device, handle) for the
    process: a cupy.cuda.ExternalStream costs microseconds to make, and every launcher of every family
    launches on the same few torch streams (graph capture uses a side stream, so there are several)."""
    key = (device_index, handle)
    stream = _EXTERNAL_STREAMS.get(key)
    if stream is None:
        import warnings

        import cupy

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers Stream.from_external
            stream = _EXTERNAL_STREAMS.setdefault(key, cupy.cuda.ExternalStream(handle, device_index))
    return stream


def torch_stream_launcher(kernel, grid, block, args: tuple, shared_mem: int = 0, keep=(), pdl: bool = False):
    """A zero-argument callable that launches `kernel` on torch's current stream.

    The stream is read at every launch (graph capture runs on a side stream, so the handle can
    change between calls); its CuPy view comes from `cupy_stream`'s process-wide cache. `keep`
    (e.g. a workspace the arguments point into) lives as long as the callable, as its first
    default argument. With `pdl` (a kernel compiled with programmatic dependent launch's wait, e.g. the
    attention family's pdl knob) the launch goes through cuLaunchKernelEx with programmatic stream
    serialization (launch_ex), the arguments packed once; without, through CuPy's call as always.
    """
    import torch

    if pdl:
        return _pdl_stream_launcher(kernel, grid, block, args, shared_mem, keep)

    def launch(_keep=keep):
        stream = torch.cuda.current_stream()
        kernel(grid, block, args, shared_mem=shared_mem, stream=cupy_stream(stream.cuda_stream, stream.device_index))

    return launch


def _pdl_stream_launcher(kernel, grid, block, args: tuple, shared_mem: int, keep):
    """torch_stream_launcher's pdl launch: cuLaunchKernelEx of the kernel's CUfunction (CuPy's Function.ptr)."""
    import torch

    from .launch_ex import ArgPack, launch_config, launch_ex

    function, pack = kernel.kernel.ptr, ArgPack(args)

    def launch(_keep=keep, _pack=pack):  # `keep` first, as torch_stream_launcher's own
        stream = torch.cuda.current_stream().cuda_stream
        launch_ex(function, launch_config(grid, block, shared_mem, stream, pdl=True), pack.kernel_params)

    return launch
