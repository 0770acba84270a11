"""Kernel Tuner tunes evotune's attention template live on the GPU, and one harness re-times both winners.

    python tools/kt_live.py --shape mission --space attention:small \
        --strategy genetic_algorithm --budget 60 --seed 0 --out OUT [--evotune-run runs/RUN]
    python tools/kt_live.py --shape mission --space attention:small --dry-run   # no GPU

needs `pip install kernel_tuner` (tested with 1.5.0) beside evotune's own CuPy and torch.

What it does (live):
  1. Kernel Tuner's `tune_kernel(lang="cupy", strategy=..., strategy_options={"max_fevals": budget})` over the
     tune_params and restrictions that tools/kt_compare.py builds from the space (Kernel Tuner's searchspace holds
     exactly evotune's admitted configs; checked before tuning), seeded as kt_compare seeds it (random.seed,
     numpy.random.seed, tune_kernel(seed=)). The wall time is taken from the call to its return.
  2. The harness: evotune's winner (`--evotune-run`: best_record of its trials.jsonl, what `evotune replay best`
     takes) and Kernel Tuner's winner, each compiled by evotune (compile_source, sm_90a) and put through
     gpu/evaluate.py's evaluate_compiled, the function `evotune bench` runs (the full gate, then CUDA-graph
     timing on the same TIMING_SEED inputs, BENCH_REPS repetitions), in this process, interleaved over --rounds
     rounds (the order alternates each round). JSON under --out; a short table last on stdout.

How Kernel Tuner is called, and what it took:
  * The code: `kernel_source` is a Python function of the tunable values (Kernel Tuner 1.5 calls a callable
    kernel_source with the config's params) returning evotune's own instantiate(problem, config, shape).code: the
    template with its headers inlined and the config baked into the traits' template arguments, with the extern
    "C" entry `evotune_attention`. `defines={}` keeps Kernel Tuner from prepending its `#define block_m 64 ...`
    lines (it would prepend one per knob, grid and block dimension, then `#line 1`): the string it compiles is
    byte for byte the one evotune compiles.
  * Compiling: Kernel Tuner's CuPy backend builds `cupy.RawModule(code=..., options=compiler_options,
    name_expressions=[kernel_name])`. compiler_options = evotune's nvrtc_options() (--gpu-architecture=sm_90a,
    -std=c++17, --ptxas-options=-v, -lineinfo, -I of the CUDA headers); with a -std= option Kernel Tuner adds no
    --std=c++11 of its own. CuPy then adds its CCCL and header include dirs, -ftz=true, -arch=sm_<cc> (sm_90 on
    an H100; given both, NVRTC 13 compiles for sm_90a: checked with cuobjdump on the cubin) and
    --device-as-default-execution-space. The one codegen difference from evotune's own compile is -ftz=true
    (denormals flushed), which CuPy appends after the user's options, so it cannot be turned off from here; the
    harness re-compiles both winners with evotune's options, so the re-timed comparison does not carry it.
  * More than 48 KB of dynamic shared memory (348 of the 456 admitted configs on the mission shape, up to
    207,360 B): Kernel Tuner's CuPy backend passes `shared_mem=` at the launch (smem_args={"size": f(params)})
    but never raises the kernel's cudaFuncAttributeMaxDynamicSharedMemorySize, so every such launch fails with
    CUDA_ERROR_INVALID_VALUE. That error is not among the launch errors Kernel Tuner skips ("too many resources
    requested for launch", "OUT_OF_RESOURCES", ...), so the first such config aborts the whole tune. The fix here
    is a subclass of kernel_tuner.backends.cupy.CupyFunctions, installed as that module attribute for the
    duration of the tune (DeviceInterface imports it at construction): its copy_shared_memory_args, which Kernel
    Tuner calls right after compiling each config, also sets `self.func.max_dynamic_shared_size_bytes = size`,
    as evotune's load_kernel does. `--no-smem-optin` leaves it out, to show the failure.
  * Launch geometry: the grid is Kernel Tuner's problem_size, given as a function of the params returning
    evotune's geometry grid, with grid_div_x/y/z = 1. The block (32 x (compute_warps + producer_warps) threads)
    is not a tunable, and Kernel Tuner 1.5 reads block dimensions only from tunables named in block_size_names;
    so kernel_tuner.util.get_thread_block_dimensions is replaced for the duration of the tune by one returning
    evotune's geometry block (Kernel Tuner's max-threads check and its launches then see the real block).
  * Arguments (the entry's parameters, problem.entry_params, in order; values from problem.launch_values on
    the CPU tensors of problem.make_inputs(shape, seed 1), the gate's first case): q, k, v as uint16 arrays of
    their fp16/bf16 bits (the entry takes `unsigned short*`), o as a uint16 array of NaN bits (Kernel Tuner
    copies it back to the GPU before its checked launch: the output is NaN-poisoned as in evotune's gate),
    q/k/v/o strides as numpy.int64 (elements), seq_q and seq_k numpy.int32, scale_log2 numpy.float32,
    ws_o/ws_lse (float32) and ws_count (int32) arrays (zero-size, i.e. null pointers, where no admitted config
    splits K/V, as evotune passes null), kv_magic numpy.uint32. The values do not depend on the config (checked
    over every admitted config). The Hopper (wgmma) variant is refused: its CUtensorMap arguments encode device
    addresses that Kernel Tuner's argument list cannot carry (it allocates the arrays itself).
  * Verification: `answer` is None but for o, which holds evotune's fp32 reference (problem.reference) on the
    same inputs; `verify` applies evotune's elementwise gate, |o - ref| <= atol * rms(V) + rtol * |ref| with
    problem.tolerance (fp16: atol 1e-3, rtol 4e-3), no non-finite output; `atol` is that atol. Kernel Tuner's
    default check (numpy.allclose, rtol 1e-5) would reject correct fp16 kernels. This is one launch on one input:
    evotune's gate (7 input cases, repeats, guards, the dependency and timed-output checks) runs on the winners
    in the harness. In stock Kernel Tuner 1.5 a failed verification raises out of tune_kernel and ends the whole
    tune; here (unless --stock-verify) a config that fails the gate is recorded and its benchmark launch raises
    an error carrying Kernel Tuner's skippable text "too many resources requested for launch", so Kernel Tuner
    records it as RuntimeFailedConfig: counted against max_fevals and never best, as evotune counts a wrong
    config. (On the mission shape none failed evotune's gate in the exhaustive run.)
  * Counting against max_fevals (Kernel Tuner 1.5, sequential runner): every config the strategy hands the
    runner costs one evaluation before anything runs, whatever happens next: a compile that fails on shared
    memory (CompilationFailedConfig), a launch it skips (RuntimeFailedConfig), and a repeat of a config already
    measured in this tune (answered from its in-memory cache, not re-measured). Restriction violations never
    reach the runner (InvalidConfig) and cost nothing. So the number of distinct configs measured can be below
    the budget (genetic_algorithm, seed 0, budget 60, answered with the exhaustive run's times through a CPU
    stand-in for the backend: 45 distinct configs for 60 evaluations; tools/kt_compare.py's simulation mode
    charges only first visits, so its replay measured 60). The first config is compiled and benchmarked twice
    (Kernel Tuner's warm-up, not counted).
    Unlike evotune's static gate, Kernel Tuner has no register-spill rule: the 54 configs the exhaustive run
    pruned (spills) are measured and can win (the harness then times such a winner anyway and says so).

Dry run (--dry-run, no GPU): builds tune_params and restrictions (kt_compare's), checks Kernel Tuner's searchspace
holds the admitted set; for a few configs (least, median and most shared memory) takes the code through Kernel
Tuner's own KernelSource.prepare_list_of_files as the tune would, checks it equals evotune's instantiation, that
Kernel Tuner's block/grid/shared memory (under the patch) equal evotune's geometry, and NVRTC-compiles it with the
options CuPy would use on an H100 (cupy._core.core.assemble_cupy_compiler_options, then -ftz=true, -arch=sm_90,
--device-as-default-execution-space) and the entry as a name expression; and checks the argument list against
entry_params and the C signature in the code (Kernel Tuner's own check_argument_list is run too; its warnings are
reported, not fatal: it does not know `unsigned` or `long long`).

Exit codes: 0 done; 1 a check failed, the tune or the harness failed, or no GPU (one line); 2 bad arguments, or
kernel_tuner missing (one line).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import random
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_spec = importlib.util.spec_from_file_location("kt_compare", ROOT / "tools" / "kt_compare.py")
K = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(K)

from evotune.errors import EvotuneError, NoGPUError, UsageError  # noqa: E402
from evotune.records import result as R  # noqa: E402

DEFAULT_SPACE = "attention:small"
INPUT_SEED = 1            # the gate's first case (evaluate.DEFAULT_SEEDS[0], pattern normal)
CUPY_CC = "90"            # the -arch=sm_<cc> CuPy adds on an H100 (the dry run assumes it)
GATE_FAILED = ("evotune gate failed: too many resources requested for launch (reported to Kernel Tuner in its "
               "skippable wording so that the config counts as RuntimeFailedConfig instead of ending the tune)")


# --------------------------------------------------------------------------- the space and the code


class Setup:
    """The problem, shape and space, with Kernel Tuner's view of them (kt_compare's tune_params/restrictions)."""

    def __init__(self, shape_text: str, space_path: str):
        from evotune.cli.common import load_problem
        from evotune.problems.attention import is_wgmma

        path = Path(space_path)
        if not path.exists() and (ROOT / path).exists():
            path = ROOT / path
        self.space_path = str(path)
        self.problem, self.shape, self.space = load_problem(shape_text, str(path))
        if self.problem.family != "attention":
            raise UsageError(f"kt_live: family {self.problem.family!r}; only attention's entry is mapped")
        self.context = dict(self.problem.context(self.shape))
        self.admitted = self.space.admitted_configs(self.context)
        hopper = [c for c in self.admitted if is_wgmma(c)]
        if hopper:
            raise UsageError(f"kt_live: {len(hopper)} admitted configs are the wgmma variant, whose CUtensorMap "
                             "arguments encode device addresses that Kernel Tuner's argument list cannot carry; "
                             "use an mma.sync space (e.g. attention:small)")
        self.tune_params = K.tune_params(self.space)
        self.restrictions = K.restrictions(self.space, self.context)
        self.entry = self.problem.entry_name
        self._codes: dict = {}

    def key(self, params: dict) -> str:
        return K.config_key(params[k] for k in self.tune_params)

    def config(self, params: dict):
        """evotune's Config of Kernel Tuner's params (the tunables, in any dict)."""
        return self.space.config({k: params[k] for k in self.tune_params})

    def params(self, config) -> dict:
        d = config.as_dict()
        return {k: d[k] for k in self.tune_params}

    def geometry(self, params: dict):
        return self.problem.geometry(self.config(params), self.shape)

    def code(self, params: dict) -> str:
        """Kernel Tuner's kernel_source: evotune's instantiation of the config, unchanged."""
        from evotune.build.template import instantiate

        key = self.key(params)
        if key not in self._codes:
            self._codes[key] = instantiate(self.problem, self.config(params), self.shape).code
        return self._codes[key]

    def grid(self, params: dict) -> tuple:
        """Kernel Tuner's problem_size (with grid divisors 1): evotune's grid."""
        return tuple(self.geometry(params).grid)

    def smem(self, params: dict) -> int:
        return int(self.geometry(params).dynamic_smem)

    def kt_admits_the_same(self) -> str | None:
        """None when Kernel Tuner's searchspace holds exactly the admitted configs, else why not."""
        kt = {K.config_key(c) for c in K.kt_searchspace(self.space, self.context).list}
        ev = {self.key(self.params(c)) for c in self.admitted}
        if kt == ev:
            return None
        return (f"Kernel Tuner's restrictions admit {len(kt)} configs, evotune's space {len(ev)} "
                f"({len(kt - ev)} only in Kernel Tuner's, {len(ev - kt)} only in evotune's)")


def compiler_options() -> list[str]:
    """What Kernel Tuner's CuPy backend is given: evotune's own NVRTC options."""
    from evotune.build.compile import nvrtc_options

    return list(nvrtc_options())


def cupy_nvrtc_options(options: list[str], cc: str = CUPY_CC) -> list[str]:
    """The options CuPy's RawModule hands NVRTC for `options` on a device of compute capability `cc`
    (CuPy 14: assemble_cupy_compiler_options, then _compile_with_cache_cuda's -ftz=true, then the arch and
    --device-as-default-execution-space; --pch only with CUPY_NVRTC_USE_PCH=1)."""
    import cupy._core.core as core

    out = list(core.assemble_cupy_compiler_options(tuple(options))) + ["-ftz=true", f"-arch=sm_{cc}",
                                                                       "--device-as-default-execution-space"]
    if os.environ.get("CUPY_NVRTC_USE_PCH") == "1":
        out.append("--pch")
    return out


def nvrtc_compile(code: str, entry: str, options: list[str]) -> dict:
    """Compile as CuPy's _NVRTCProgram does (the entry as a name expression); its lowered name, cubin size and
    ptxas's resources. Raises EvotuneError with NVRTC's first error line."""
    from cupy.cuda import nvrtc

    from evotune.build.compile import parse_resources

    started = time.perf_counter()
    prog = nvrtc.createProgram(code, "kern.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, entry)
        try:
            nvrtc.compileProgram(prog, options)
        except nvrtc.NVRTCError:
            log = nvrtc.getProgramLog(prog)
            log = log.decode() if isinstance(log, bytes) else log
            first = next((ln for ln in log.splitlines() if "error" in ln), log.strip()[:200])
            raise EvotuneError(f"kt_live: NVRTC (CuPy's options) failed: {first.strip()}") from None
        lowered = nvrtc.getLoweredName(prog, entry)
        log = nvrtc.getProgramLog(prog)
        log = log.decode() if isinstance(log, bytes) else log
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    res = parse_resources(log.rstrip("\x00"), entry)
    return {"lowered_name": lowered.decode() if isinstance(lowered, bytes) else lowered, "cubin_bytes": len(cubin),
            "resources": res.as_dict(), "seconds": round(time.perf_counter() - started, 2)}


# --------------------------------------------------------------------------- the argument list


def _dense(t):
    """`t` with its dimensions ordered by decreasing stride (its memory as one contiguous tensor)."""
    perm = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    d = t.permute(perm)
    if not d.is_contiguous():
        raise UsageError("kt_live: an input tensor is not dense in memory")
    return d


def _bits(t):
    """The uint16 numpy array of a fp16/bf16 tensor's bits, in its memory order."""
    import numpy as np
    import torch

    return _dense(t).contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def _workspace(setup) -> tuple:
    """(ws_o, ws_lse, ws_count) numpy arrays for every admitted config: the largest any needs (zero-size, a null
    pointer, where none splits K/V)."""
    import numpy as np

    sizes = [setup.problem.workspace_elems(c, setup.shape) for c in setup.admitted]
    n_o, n_lse, n_count = (max(s[i] for s in sizes) for i in range(3))
    return (np.zeros(n_o, np.float32), np.zeros(n_lse, np.float32), np.zeros(n_count, np.int32))


def launch_values(setup, config, inputs: dict, out) -> dict:
    """problem.launch_values on the CPU tensors, but for the pointers (which Kernel Tuner supplies)."""
    values = setup.problem.launch_values(config, setup.shape, inputs["q"], inputs["k"], inputs["v"], out,
                                         inputs["scale"])
    return {name: values[name] for name, kind in setup.problem.entry_params(config) if kind != "ptr"}


def kt_arguments(setup, seed: int = INPUT_SEED) -> dict:
    """Kernel Tuner's `arguments` (in the entry's parameter order), `answer` and the gate's terms, for every
    admitted config (the values are checked to be the same for all of them)."""
    import torch

    from evotune.problems.attention import as_kernel_arg

    problem, shape = setup.problem, setup.shape
    config = setup.admitted[0]
    inputs = problem.make_inputs(shape, seed, device="cpu")
    out = problem.new_output(inputs)
    values = launch_values(setup, config, inputs, out)
    poison = torch.full_like(out, float("nan"))
    arrays = {"q": _bits(inputs["q"]), "k": _bits(inputs["k"]), "v": _bits(inputs["v"]), "o": _bits(poison)}
    arrays.update(zip(("ws_o", "ws_lse", "ws_count"), _workspace(setup)))
    params = problem.entry_params(config)
    arguments = [arrays[n] if kind == "ptr" else as_kernel_arg(kind, values[n]) for n, kind in params]
    names = [n for n, _ in params]
    o_index = names.index("o")
    ref = _dense(problem.reference(shape, inputs)).contiguous().numpy().copy()
    answer = [None] * len(arguments)
    answer[o_index] = ref
    atol, rtol = problem.tolerance(shape)
    return {"arguments": arguments, "names": names, "kinds": [k for _, k in params], "answer": answer,
            "o_index": o_index, "ref": ref, "atol": atol, "rtol": rtol,
            "atol_scaled": atol * problem.error_scale(inputs), "dtype": shape.dtype,
            "values": values, "inputs": inputs, "out": out}


def config_independent(setup, built: dict) -> list[str]:
    """Admitted configs whose entry parameters or non-pointer values differ from those the arguments were built
    with (empty: one argument list serves every config)."""
    bad = []
    for c in setup.admitted:
        params = setup.problem.entry_params(c)
        if [n for n, _ in params] != built["names"] or [k for _, k in params] != built["kinds"]:
            bad.append(f"{c.key()}: other entry parameters")
        elif launch_values(setup, c, built["inputs"], built["out"]) != built["values"]:
            bad.append(f"{c.key()}: other launch values")
    return bad


_C_SCALARS = {"long long": "int64", "unsigned": "uint32", "int": "int32", "float": "float32"}
_C_POINTEES = {"unsigned short": "uint16", "float": "float32", "int": "int32"}


def entry_signature(code: str, entry: str) -> list[tuple[str, str, str]]:
    """(name, 'ptr'|'scalar', numpy dtype) of each parameter of the last `extern "C" ... entry(` in `code`."""
    starts = [m.end() for m in re.finditer(r'extern "C"[^;{]*?\b' + re.escape(entry) + r"\s*\(", code)]
    if not starts:
        raise EvotuneError(f"kt_live: no extern \"C\" {entry}( in the code")
    start = starts[-1]
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(code[end], 0)
        end += 1
    out = []
    for raw in code[start:end - 1].split(","):
        decl = " ".join(raw.replace("__restrict__", " ").replace("const ", " ").split())
        name = re.findall(r"[A-Za-z_]\w*", decl)[-1]
        ctype = decl[: decl.rindex(name)].strip()
        if "*" in ctype:
            out.append((name, "ptr", _C_POINTEES.get(ctype.replace("*", "").strip(), "?")))
        else:
            out.append((name, "scalar", _C_SCALARS.get(ctype, "?")))
    return out


def check_arguments(setup, built: dict, code: str) -> list[str]:
    """Mismatches between the argument list and the entry (entry_params, and the C signature in `code`)."""
    import numpy as np

    sig = entry_signature(code, setup.entry)
    problems = []
    if [n for n, _, _ in sig] != built["names"]:
        problems.append(f"parameter names: code {[n for n, _, _ in sig]} vs entry_params {built['names']}")
    if len(sig) != len(built["arguments"]):
        return problems + [f"{len(sig)} parameters in the code, {len(built['arguments'])} arguments"]
    for i, ((name, what, dtype), arg) in enumerate(zip(sig, built["arguments"])):
        is_array = isinstance(arg, np.ndarray)
        ok = (is_array if what == "ptr" else isinstance(arg, np.generic)) and str(arg.dtype) == dtype
        if not ok:
            problems.append(f"argument {i} ({name}): {type(arg).__name__} {arg.dtype}, the entry takes "
                            f"{'a pointer to ' if what == 'ptr' else ''}{dtype}")
    return problems


def kt_signature_warnings(setup, built: dict, code: str) -> list[str]:
    """What Kernel Tuner's own check_argument_list says of the list (warnings; it knows no `unsigned`)."""
    from kernel_tuner import util

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        util.check_argument_list(setup.entry, code, built["arguments"], lang="CUPY")
    return [str(w.message) for w in caught]


def gate_ratio(built: dict, out_bits) -> float:
    """evotune's gate ratio of an output (uint16 bits, o's memory order) against the reference: inf if any
    element is not finite."""
    import numpy as np
    import torch

    dt = torch.float16 if built["dtype"] == "fp16" else torch.bfloat16
    out = torch.from_numpy(np.ascontiguousarray(out_bits).view(np.int16)).view(dt).float().numpy().ravel()
    if not np.isfinite(out).all():
        return math.inf
    ref = built["ref"].ravel()
    return float(np.max(np.abs(out - ref) / (built["atol_scaled"] + built["rtol"] * np.abs(ref))))


# --------------------------------------------------------------------------- Kernel Tuner, patched


class LiveState:
    """What the patched backend sees during the tune: compiles, gate checks, failures bridged, opt-ins."""

    def __init__(self, setup, built: dict, smem_optin: bool = True, bridge: bool = True):
        self.setup, self.built = setup, built
        self.smem_optin, self.bridge = smem_optin, bridge
        self.current = None
        self.failing = False
        self.compiles = 0
        self.optins = 0
        self.checks: dict = {}

    def begin(self, params: dict) -> None:
        self.current = self.setup.key(params)
        self.failing = False
        self.compiles += 1

    def verify(self, answer, result_host, atol=None) -> bool:
        ratio = gate_ratio(self.built, result_host[self.built["o_index"]])
        passed = ratio <= 1.0
        self.checks[self.current] = {"gate_ratio": ratio, "passed": passed}
        if passed or not self.bridge:
            return passed
        self.failing = True
        return True


def backend_class(state: LiveState):
    """Kernel Tuner's CuPy backend with evotune's shared-memory opt-in and the gate-failure bridge."""
    from kernel_tuner.backends.cupy import CupyFunctions

    class EvotuneCupyFunctions(CupyFunctions):
        def compile(self, kernel_instance):
            state.begin(kernel_instance.params)
            return super().compile(kernel_instance)

        def copy_shared_memory_args(self, smem_args):
            super().copy_shared_memory_args(smem_args)
            if state.smem_optin and self.smem_size > 0:
                # What evotune's load_kernel does: opt in to the kernel's dynamic shared memory (above 48 KB a
                # launch fails with CUDA_ERROR_INVALID_VALUE without it).
                self.func.max_dynamic_shared_size_bytes = self.smem_size
                state.optins += self.smem_size > 48 * 1024

        def run_kernel(self, func, gpu_args, threads, grid, stream=None):
            if state.failing:
                raise RuntimeError(GATE_FAILED)
            return super().run_kernel(func, gpu_args, threads, grid, stream)

    return EvotuneCupyFunctions


@contextlib.contextmanager
def kt_patches(setup, state: LiveState | None = None):
    """For the tune: evotune's block dimensions in kernel_tuner.util, and (given `state`) the backend subclass
    as kernel_tuner.backends.cupy.CupyFunctions. Both restored on exit."""
    import kernel_tuner.backends.cupy as kt_cupy
    import kernel_tuner.util as kt_util

    original_block, original_backend = kt_util.get_thread_block_dimensions, kt_cupy.CupyFunctions

    def block(params, block_size_names=None):
        if all(k in params for k in setup.tune_params):
            return tuple(int(x) for x in setup.geometry(params).block)
        return original_block(params, block_size_names)

    kt_util.get_thread_block_dimensions = block
    if state is not None:
        kt_cupy.CupyFunctions = backend_class(state)
    try:
        yield
    finally:
        kt_util.get_thread_block_dimensions = original_block
        kt_cupy.CupyFunctions = original_backend


def tune_kwargs(setup, built: dict, state: LiveState | None, strategy: str, budget: int, seed: int,
                iterations: int) -> dict:
    """tune_kernel's arguments (but the kernel name and source)."""
    return dict(problem_size=setup.grid, arguments=built["arguments"], tune_params=setup.tune_params,
                grid_div_x=1, grid_div_y=1, grid_div_z=1, restrictions=setup.restrictions,
                answer=built["answer"], atol=built["atol"], verify=state.verify if state else None,
                lang="cupy", smem_args={"size": setup.smem}, compiler_options=compiler_options(), defines={},
                iterations=iterations, strategy=strategy, strategy_options={"max_fevals": budget},
                quiet=True, verbose=False, seed=seed)


def _jsonable(r: dict) -> dict:
    return {k: (str(v) if k == "__error__" else v) for k, v in r.items()}


def run_kt(setup, built: dict, strategy: str, budget: int, seed: int, iterations: int, workdir: Path,
           smem_optin: bool = True, bridge: bool = True) -> dict:
    """The live tune: its results, wall time, counts and winner."""
    import numpy as np
    from kernel_tuner import tune_kernel

    state = LiveState(setup, built, smem_optin=smem_optin, bridge=bridge)
    kwargs = tune_kwargs(setup, built, state, strategy, budget, seed, iterations)
    random.seed(seed)
    np.random.seed(seed)
    error, results, env = None, [], {}
    with kt_patches(setup, state), warnings.catch_warnings(), contextlib.chdir(workdir):
        warnings.simplefilter("ignore")  # "None of the tunable parameters specify thread block dimensions!"
        started = time.perf_counter()
        try:
            results, env = tune_kernel(setup.entry, setup.code, **kwargs)
        except Exception as e:  # noqa: BLE001 - recorded: a stock verify failure, or a launch error ends it
            error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        wall = time.perf_counter() - started
    return summarize_kt(setup, state, results, env, wall, error)


def summarize_kt(setup, state: LiveState, results: list, env: dict, wall: float, error: str | None) -> dict:
    keys = [setup.key(r) for r in results]
    ok = [r for r in results if "__error__" not in r and isinstance(r.get("time"), (int, float))]
    ok_ids = {id(r) for r in ok}
    best = min(ok, key=lambda r: r["time"]) if ok else None
    errors: dict = {}
    for r in results:
        if "__error__" in r:
            errors[type(r["__error__"]).__name__] = errors.get(type(r["__error__"]).__name__, 0) + 1
    seen, curve, top = set(), [], math.inf
    for r, k in zip(results, keys):
        if k in seen:
            continue
        seen.add(k)
        if id(r) in ok_ids:
            top = min(top, r["time"] * 1000.0)
        curve.append(top)
    keep = ("device_name", "cuda_version", "compute_capability", "iterations", "compiler_options",
            "total_framework_time", "total_strategy_time", "total_compile_time", "total_verification_time",
            "total_benchmark_time", "overhead_time")
    return {"wall_seconds": round(wall, 2), "error": error, "runner_visits": len(results),
            "distinct_configs": len(seen), "compiles": state.compiles, "errors": errors,
            "gate_failures": {k: v for k, v in state.checks.items() if not v["passed"]},
            "gate_checks": len(state.checks), "smem_optins_over_48k": state.optins,
            "best": None if best is None else {"params": {k: best[k] for k in setup.tune_params},
                                              "time_us": best["time"] * 1000.0,
                                              "times_us": [t * 1000.0 for t in best.get("times", [])]},
            "best_so_far_us": curve, "env": {k: env.get(k) for k in keep if k in env},
            "results": [_jsonable(r) for r in results]}


# --------------------------------------------------------------------------- the dry run


def dry_configs(setup, n: int) -> list:
    """`n` admitted configs spread over their dynamic shared memory (least, most, then evenly between)."""
    ranked = sorted(setup.admitted, key=lambda c: (setup.problem.geometry(c, setup.shape).dynamic_smem, c.key()))
    if n <= 1:
        return ranked[-1:]
    picks = sorted({round(i * (len(ranked) - 1) / (n - 1)) for i in range(n)})
    return [ranked[i] for i in picks]


def dry_one(setup, config, options: list[str]) -> tuple[dict, str]:
    """One config as the tune would hand it to Kernel Tuner and CuPy: the code, geometry and compile."""
    from kernel_tuner import core, util

    from evotune.build.template import instantiate

    params = setup.params(config)
    geo = setup.problem.geometry(config, setup.shape)
    with kt_patches(setup):
        threads, grid = util.setup_block_and_grid(setup.grid, (1, 1, 1), params, list(util.default_block_size_names))
    source = core.KernelSource(setup.entry, setup.code, "cupy", {})
    name, code, _ = source.prepare_list_of_files(setup.entry, params, grid, threads,
                                                 list(util.default_block_size_names))
    smem = util.get_smem_args({"size": setup.smem}, params)["size"]
    row = {"config": config.key(), "threads": list(threads), "grid": list(grid), "dynamic_smem": smem,
           "over_48k": smem > 48 * 1024, "kernel_name": name,
           "code_is_evotunes": code == instantiate(setup.problem, config, setup.shape).code,
           "geometry_matches": (tuple(threads) == tuple(geo.block) and tuple(grid) == tuple(geo.grid)
                                and smem == geo.dynamic_smem)}
    row["compile"] = nvrtc_compile(code, name, options)
    row["ok"] = (row["code_is_evotunes"] and row["geometry_matches"] and name == setup.entry
                 and row["compile"]["lowered_name"] == setup.entry)
    return row, code


def dry_run(setup, n_configs: int) -> dict:
    """The checks of the dry run (module docstring); `ok` is all of them."""
    why = setup.kt_admits_the_same()
    built = kt_arguments(setup)
    options = cupy_nvrtc_options(compiler_options())
    rows, code = [], None
    for c in dry_configs(setup, n_configs):
        row, code = dry_one(setup, c, options)
        rows.append(row)
        print(f"kt_live: dry run {c.key()}: {row['compile']['seconds']} s, smem {row['dynamic_smem']} B, "
              f"{'ok' if row['ok'] else 'MISMATCH'}", file=sys.stderr, flush=True)
    mismatches = check_arguments(setup, built, code)
    varying = config_independent(setup, built)
    out = {"shape": setup.shape.spec, "space": setup.space_path, "admitted": len(setup.admitted),
           "tune_params": setup.tune_params, "restrictions": K.describe_restrictions(setup.restrictions),
           "same_admitted_set": why is None, "admitted_set_note": why, "cupy_nvrtc_options": options,
           "configs": rows, "arguments": [f"{n}: {_describe_arg(a)}" for n, a in zip(built["names"],
                                                                                      built["arguments"])],
           "argument_mismatches": mismatches, "config_dependent_arguments": varying[:5],
           "kernel_tuner_signature_warnings": kt_signature_warnings(setup, built, code),
           "gate": {"atol": built["atol"], "rtol": built["rtol"], "atol_scaled": built["atol_scaled"]}}
    out["ok"] = why is None and all(r["ok"] for r in rows) and not mismatches and not varying
    return out


def _describe_arg(a) -> str:
    import numpy as np

    if isinstance(a, np.ndarray):
        return f"ndarray {a.dtype} {list(a.shape)}"
    return f"{type(a).__name__} {a}"


# --------------------------------------------------------------------------- the harness


def evotune_side(run_dir: str, setup) -> dict:
    """evotune's run: its winner (best_record), evaluations, wall time (timeline.jsonl) and whether it searched
    the same shape and space."""
    from evotune.records.runs import Run

    path = Path(run_dir)
    if not (path / "meta.json").exists() and (ROOT / "runs" / run_dir / "meta.json").exists():
        path = ROOT / "runs" / run_dir
    if not (path / "meta.json").exists():
        raise UsageError(f"kt_live: --evotune-run {run_dir}: no meta.json there")
    run = Run(path)
    meta, trials = run.meta(), run.trials()
    best = run.best()
    notes = []
    if meta.get("shape_spec") != setup.shape.spec:
        notes.append(f"the run searched shape {meta.get('shape_spec')}, this tune {setup.shape.spec}")
    if Path(str(meta.get("space"))).name != Path(setup.space_path).name:
        notes.append(f"the run searched space {meta.get('space')}, this tune {setup.space_path}")
    wall = search_wall = None
    tl = path / "timeline.jsonl"
    if tl.exists():
        lines = [json.loads(x) for x in tl.read_text().splitlines() if x.strip()]
        wall = round(sum(d.get("wall_s", 0.0) for d in lines), 2)
        closing = ("the best beside the baselines", "the finalists beside the baselines")  # the phase's old and new name
        after = sum(((d.get("phases") or {}).get(name) or {}).get("s", 0.0) for d in lines for name in closing)
        search_wall = round(wall - after, 2)
    else:
        notes.append("no timeline.jsonl: no wall time recorded")
    return {"run": str(path), "command": meta.get("command_line"), "config": best["config"], "trial": best["number"],
            "time_us": best["result"]["time_us"], "evaluated": sum(1 for t in trials if t.get("counted")),
            "wall_seconds": wall, "search_wall_seconds": search_wall, "notes": notes}


def harness(setup, entries: list[tuple[str, dict]], rounds: int, reps: int) -> list[dict]:
    """Each (label, params) through evaluate_compiled (what `evotune bench` runs), interleaved over `rounds`."""
    from evotune.build.compile import compile_source, load_kernel
    from evotune.build.template import instantiate
    from evotune.gpu.evaluate import bind_kernel, evaluate_compiled, evaluate_launches

    prepared = []
    for label, params in entries:
        config = setup.config(params)
        src = instantiate(setup.problem, config, setup.shape)
        prepared.append((label, config, compile_source(src.code, src.entry)))
    rows = {label: {"label": label, "config": config.key(), "times_us": [], "statuses": [], "notes": []}
            for label, config, _ in prepared}
    for r in range(rounds):
        for label, config, compiled in (prepared if r % 2 == 0 else prepared[::-1]):
            res = evaluate_compiled(setup.problem, setup.shape, config, compiled, reps=reps)
            if res.status == R.PRUNED:  # evotune's static gate (spills): timed anyway, said so
                if not rows[label]["notes"]:
                    rows[label]["notes"].append(f"evotune's static gate prunes it ({res.message}); timed anyway")
                geo = setup.problem.geometry(config, setup.shape)
                kernel = load_kernel(compiled, geo.dynamic_smem)
                res = evaluate_launches(setup.problem, setup.shape,
                                        bind_kernel(setup.problem, setup.shape, config, kernel), reps=reps)
            row = rows[label]
            row["statuses"].append(res.status)
            row["gate_ratio"] = (res.verification or {}).get("gate_ratio")
            if res.status == R.OK:
                row["times_us"].append(res.time_us)
            elif res.message and res.message not in row["notes"]:
                row["notes"].append(res.message)
    for row in rows.values():
        t = row["times_us"]
        row.update(median_us=statistics.median(t) if t else None, min_us=min(t) if t else None,
                   max_us=max(t) if t else None)
    return list(rows.values())


# --------------------------------------------------------------------------- main


def gpu_missing() -> str | None:
    """Why the live tune cannot run here (None: CuPy and torch both see a CUDA GPU)."""
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - no driver, no device
        return f"no CUDA GPU visible to CuPy ({type(e).__name__}); the live tune needs one (--dry-run does not)"
    if count < 1:
        return "no CUDA GPU visible to CuPy; the live tune needs one (--dry-run does not)"
    try:
        import torch

        if not torch.cuda.is_available():
            return "torch sees no CUDA GPU; evotune's timing path (the harness) needs torch with CUDA"
    except ImportError:
        return "torch is not installed; evotune's timing path (the harness) needs it"
    return None


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mission")
    ap.add_argument("--space", default=DEFAULT_SPACE)
    ap.add_argument("--strategy", default="genetic_algorithm")
    ap.add_argument("--budget", type=int, default=60, help="max_fevals (evotune's default search: --trials 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=7, help="Kernel Tuner's launches per benchmark (its default 7)")
    ap.add_argument("--out", default=None, help="folder for kt_live.json (required for the live run)")
    ap.add_argument("--evotune-run", default=None, help="evotune's run folder (or name under runs/) to re-time beside")
    ap.add_argument("--reference-run", default=None, help="another run whose best is re-timed too (e.g. the "
                    "exhaustive optimum, runs/mission-h100-exhaustive-small)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved harness rounds")
    ap.add_argument("--reps", type=int, default=None, help="timing repetitions per round (default: evotune bench's)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: build, compile and check a few configs")
    ap.add_argument("--dry-run-configs", type=int, default=3)
    ap.add_argument("--no-smem-optin", action="store_true",
                    help="stock Kernel Tuner launches (shows the >48 KB failure)")
    ap.add_argument("--stock-verify", action="store_true",
                    help="a gate failure ends the tune, as in stock Kernel Tuner")
    args = ap.parse_args(argv)
    if args.budget < 1 or args.rounds < 1 or args.iterations < 1 or args.dry_run_configs < 1:
        ap.error("--budget, --rounds, --iterations and --dry-run-configs must be at least 1")
    if not args.dry_run and not args.out:
        ap.error("--out DIR is required for the live run")
    return args


def print_table(kt: dict, ev: dict | None, rows: list[dict]) -> None:
    by = {r["label"]: r for r in rows}
    print(f"{'tool':<14}{'wall s':>9}{'evals':>12}{'own us':>9}{'harness us (median [min, max])':>34}  winner")
    for label, wall, evals, own in (("kernel_tuner", kt["wall_seconds"],
                                     f"{kt['distinct_configs']}/{kt['runner_visits']}",
                                     (kt["best"] or {}).get("time_us")),
                                    ("evotune", ev and ev["search_wall_seconds"], ev and str(ev["evaluated"]),
                                     ev and ev["time_us"]),
                                    ("reference", None, None, None)):
        row = by.get(label)
        if row is None:
            continue
        h = (f"{row['median_us']:.3f} [{row['min_us']:.3f}, {row['max_us']:.3f}]" if row["median_us"] is not None
             else "/".join(sorted(set(row["statuses"]))))
        cells = [f"{wall:.1f}" if wall is not None else "-", evals or "-", f"{own:.3f}" if own else "-"]
        print(f"{label:<14}{cells[0]:>9}{cells[1]:>12}{cells[2]:>9}{h:>34}  {row['config']}")
    print("(evals: kernel_tuner distinct configs / evaluations charged to max_fevals; evotune counted trials. own: the "
          "winner's time as its tuner measured it. harness: evaluate_compiled, same process and inputs)")


def live(args, setup) -> int:
    from importlib.metadata import version

    from evotune.gpu.bench import BENCH_REPS

    why = setup.kt_admits_the_same()
    if why:
        print(f"kt_live: {why}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ev = evotune_side(args.evotune_run, setup) if args.evotune_run else None
    ref = evotune_side(args.reference_run, setup) if args.reference_run else None
    built = kt_arguments(setup)
    print(f"kt_live: Kernel Tuner {version('kernel_tuner')} {args.strategy}, max_fevals {args.budget}, seed "
          f"{args.seed}, {len(setup.admitted)} admitted configs ...", file=sys.stderr, flush=True)
    kt = run_kt(setup, built, args.strategy, args.budget, args.seed, args.iterations, out,
                smem_optin=not args.no_smem_optin, bridge=not args.stock_verify)
    print(f"kt_live: tune {kt['wall_seconds']} s, {kt['distinct_configs']} distinct configs, {kt['runner_visits']} "
          f"evaluations charged, errors {kt['errors']}" + (f"; ended by {kt['error']}" if kt["error"] else ""),
          file=sys.stderr, flush=True)
    entries = [("kernel_tuner", kt["best"]["params"])] if kt["best"] else []
    entries += [(label, side["config"]) for label, side in (("evotune", ev), ("reference", ref)) if side]
    rows = harness(setup, entries, args.rounds, args.reps or BENCH_REPS) if entries else []
    record = {"command": "python tools/kt_live.py " + " ".join(sys.argv[1:]), "kernel_tuner": version("kernel_tuner"),
              "shape": setup.shape.spec, "space": setup.space_path, "admitted": len(setup.admitted),
              "strategy": args.strategy, "budget": args.budget, "seed": args.seed, "iterations": args.iterations,
              "smem_optin": not args.no_smem_optin, "bridged_gate_failures": not args.stock_verify,
              "compiler_options": compiler_options(), "kernel_tuner_run": kt, "evotune_run": ev,
              "reference_run": ref, "harness": {"rounds": args.rounds, "reps": args.reps or BENCH_REPS,
                                                "rows": rows}}
    (out / "kt_live.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    print_table(kt, ev, rows)
    return 0 if kt["best"] and not kt["error"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import kernel_tuner
    except ImportError:
        print("kt_live: needs Kernel Tuner: pip install kernel_tuner", file=sys.stderr)
        return 2
    del kernel_tuner
    try:
        setup = Setup(args.shape, args.space)
        if args.dry_run:
            report = dry_run(setup, args.dry_run_configs)
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / "kt_live_dry_run.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
            print(json.dumps({k: report[k] for k in ("ok", "admitted", "same_admitted_set", "argument_mismatches")}))
            return 0 if report["ok"] else 1
        missing = gpu_missing()
        if missing:
            raise NoGPUError(f"kt_live: {missing}")
        return live(args, setup)
    except EvotuneError as e:
        print(str(e) if str(e).startswith("kt_live") else f"kt_live: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
