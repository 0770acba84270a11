"""Tuning from Python (a notebook, a script): `evotune.tune_kernel`, the search `evotune search` runs, without the CLI.

    import evotune
    best = evotune.tune_kernel(
        open("gemm.cu").read(), "gemm",
        knobs={"block_m": [64, 128], "block_n": [64, 128], "block_k": [32, 64], "warps_m": [2], "warps_n": [2],
               "stages": [2, 3]},
        constraints=["M % block_m == 0 and N % block_n == 0 and K % block_k == 0"],
        inputs={"A": ["M", "K"], "B": ["K", "N"]}, outputs={"C": ["M", "N"]},
        reference=lambda A, B: A.float() @ B.float(),
        grid=["N // block_n", "M // block_m"], block=["warps_m * warps_n * 32"],
        smem="stages * (block_m * (block_k + 8) + block_k * (block_n + 8)) * 2 + warps_m * warps_n * 1024",
        template=["ctype", "block_m", "block_n", "block_k", "warps_m", "warps_n", "stages"],
        shape="M=4096,N=4096,K=4096:fp16", trials=40, baseline=torch.matmul)
    best.config, best.time_us, best.run

It writes a family file (evotune.problems.generic: the kernel, the family YAML with its space, the reference
module) into `family_dir` (default: a new temporary folder), and searches it exactly as `evotune search --family
<that file>` does: compiles ahead in a process pool, each candidate gated and timed in a GPU worker process (a
fault, hang or wrong answer is a recorded trial), every trial recorded in a run folder under runs/, the finalists
timed beside the baselines at the end.

The reference and baselines go to the family's reference module by their source text (inspect.getsource), since
the GPU worker is another process: each must be a self-contained function (a def or a one-line lambda) that reads
only its arguments, torch (imported as torch), torch.nn.functional (as F) and math, or a torch function itself:
one whose signature Python can read (F.silu, F.softmax) is called by its parameters' names, each one without a
default being an input, a shape name or a constant (else a one-line error asks for a lambda: F.rms_norm's
`normalized_shape` is none of them); a builtin without one (torch.matmul) is called with the inputs in order. A
reference returns the outputs: one tensor for one output, else a tuple in `outputs` order or a dict.
"""

from __future__ import annotations

import ast
import inspect
import shutil
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

import yaml

from .errors import UsageError

_PRELUDE = "import math\n\nimport torch\nimport torch.nn.functional as F\n\n\n"


@dataclass(frozen=True)
class TuneResult:
    """What tune_kernel found: the best config (None where no candidate passed the gate), its time, the run folder,
    the family file it searched (pass it to `evotune replay/bench --family`), and the search's summary."""

    config: dict | None
    time_us: float | None
    run: str
    family: str
    summary: dict


def tune_kernel(source: str, entry: str, knobs: Mapping[str, Sequence], *, inputs: Mapping, outputs: Mapping,
                reference: Callable, grid: Sequence, block: Sequence, shape: str, smem: str | int = 0,
                constraints: Sequence = (), template: Sequence[str] | None = None, args: Sequence[str] | None = None,
                tolerance: Mapping | None = None, baseline: Callable | Mapping[str, Callable] | None = None,
                trials: int = 40, constants: Mapping[str, float] | None = None,
                derived: Mapping[str, str] | None = None,
                flops: str | None = None, nbytes: str | None = None, name: str | None = None,
                family_dir: str | None = None, run: str | None = None, gpu: int = 0, timeout_s: float = 60.0,
                sampler: str = "surrogate", seed: int = 0, evaluate=None, lookahead: int | None = None) -> TuneResult:
    """Search `knobs` of the kernel `source` (CUDA text, or a path to a .cu file) on `shape` with the gate against
    `reference`; the module docstring has an example. `entry` is the __device__ function template evotune's entry
    point calls with `args` (default: the inputs, the outputs, the shape's names, then the constants) and `template`
    (default: "ctype", the dtype's C type, then the knobs in order). `inputs` / `outputs`: name -> shape (a list of
    expressions of the shape's names) or a mapping with shape, dtype, init, scale. `grid`, `block`, `smem`, `flops`, `nbytes` and
    `derived` are expressions of the knobs and the shape; `constraints` are expressions or (expr, why) pairs.
    `evaluate` and `lookahead`: as search_family's (an injected evaluator runs the whole search without a GPU)."""
    folder = Path(family_dir) if family_dir else Path(tempfile.mkdtemp(prefix="evotune-family-"))
    family_file = write_family(folder, source, entry, knobs, inputs=inputs, outputs=outputs, reference=reference,
                               grid=grid, block=block, shape=shape, smem=smem, constraints=constraints,
                               template=template, args=args, tolerance=tolerance, baseline=baseline,
                               constants=constants, derived=derived, flops=flops, nbytes=nbytes, name=name)
    return search_family(family_file, shape=shape, trials=trials, run=run, gpu=gpu, timeout_s=timeout_s,
                         sampler=sampler, seed=seed, evaluate=evaluate, lookahead=lookahead)


def write_family(folder: Path, source: str, entry: str, knobs: Mapping[str, Sequence], *, inputs, outputs, reference,
                 grid, block, shape, smem=0, constraints=(), template=None, args=None, tolerance=None, baseline=None,
                 constants=None, derived=None, flops=None, nbytes=None, name=None) -> Path:
    """The family file tune_kernel searches, written into `folder` with its kernel and reference module; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    name = name or entry
    kernel = Path(source) if "\n" not in source and source.endswith((".cu", ".cuh")) else None
    if kernel is not None:
        if not kernel.is_file():
            raise UsageError(f"tune_kernel: kernel source {source!r}: no such file")
        shutil.copyfile(kernel, folder / f"{name}.cu")
    else:
        (folder / f"{name}.cu").write_text(source)
    dims = [part.partition("=")[0].strip() for part in shape.partition(":")[0].split(",")]
    functions = {"reference": reference}
    baselines = {}
    for label, fn in (baseline.items() if isinstance(baseline, Mapping) else
                      [(getattr(baseline, "__name__", "baseline"), baseline)] if baseline is not None else []):
        baselines[label] = f"reference.py:baseline_{len(baselines)}"
        functions[f"baseline_{len(baselines) - 1}"] = fn
    # What the family calls a function with by name (not `dtype`, which is text here and a torch.dtype to torch).
    given = [*inputs, *dims, *(constants or {})]
    (folder / "reference.py").write_text(_PRELUDE + "\n\n".join(_function_source(n, f, inputs, given)
                                                                 for n, f in functions.items()))
    doc = {
        "name": name, "kernel": f"{name}.cu", "entry": entry, "shape": shape,
        "dtypes": [shape.partition(":")[2] or "fp16"],
        **({"constants": dict(constants)} if constants else {}),
        "inputs": {k: _tensor(v) for k, v in inputs.items()}, "outputs": {k: _tensor(v) for k, v in outputs.items()},
        # Left out, the family file's defaults: inputs, outputs, shape names, constants; ctype, then the knobs.
        **({"args": list(args)} if args is not None else {}),
        **({"template": [str(t) for t in template]} if template is not None else {}),
        "launch": {"grid": [str(g) for g in grid], "block": [str(b) for b in block], "smem": str(smem)},
        **({"flops": flops} if flops else {}), **({"bytes": nbytes} if nbytes else {}),
        "tolerance": dict(tolerance or {"atol": 1e-2, "rtol": 1e-2}),
        "reference": "reference.py:reference", **({"baselines": baselines} if baselines else {}),
        "space": {"params": {k: {"values": list(v)} for k, v in knobs.items()},
                  **({"derived": dict(derived)} if derived else {}),
                  **({"constraints": [_constraint(c) for c in constraints]} if constraints else {})},
    }
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, default_flow_style=None, width=120))
    return path


def _tensor(spec) -> dict:
    return dict(spec) if isinstance(spec, Mapping) else {"shape": [str(s) for s in spec]}


def _constraint(c) -> dict:
    if isinstance(c, str):
        return {"expr": c, "why": "given to tune_kernel"}
    expr, why = c
    return {"expr": expr, "why": why}


def _function_source(name: str, fn: Callable, inputs, given) -> str:
    """`fn` as the source of a module-level function `name`: a torch function by its module and name, a def or a
    lambda by its source text."""
    module = getattr(fn, "__module__", None) or ""
    short = getattr(fn, "__name__", "")
    if module.startswith("torch") and short.isidentifier():
        return _torch_call(name, fn, f"{module}.{short}", module, inputs, given)
    try:
        text = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        raise UsageError(f"tune_kernel: the source of {name} ({fn!r}) cannot be read: define it with def or "
                         f"lambda in a file or notebook cell") from None
    if getattr(fn, "__name__", "") == "<lambda>":
        lam = _lambda_in(text)
        return f"{name} = {lam}\n"
    tree = ast.parse(text)
    fdef = next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    fdef.name, fdef.decorator_list = name, []
    return ast.unparse(fdef) + "\n"


def _torch_call(name: str, fn: Callable, spelled: str, module: str, inputs, given) -> str:
    """A torch function called by its parameters' names where its signature is readable (F.silu(input)): each
    parameter without a default must be an input, a shape name or a constant, the others are passed where one is.
    A builtin without a readable signature (torch.matmul) is called with the inputs in order."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        names = ", ".join(inputs)
        return f"def {name}({names}):\n    import {module}\n    return {spelled}({names})\n"
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        raise UsageError(f"tune_kernel: {spelled} takes *args: pass a lambda that calls it")
    missing = [p.name for p in params if p.default is p.empty and p.kind is not p.VAR_KEYWORD and p.name not in given]
    if missing:
        # F.rms_norm(input, normalized_shape, weight, eps): normalized_shape is no tensor or number of the family
        these = "parameter " + repr(missing[0]) + " is" if len(missing) == 1 else \
            "parameters " + ", ".join(map(repr, missing)) + " are"
        raise UsageError(f"tune_kernel: {spelled} cannot be called by the family's names: its {these} none of "
                         f"{', '.join(given)}; pass a lambda that "
                         f"calls it, e.g. lambda {', '.join(inputs)}: {spelled}(...)")
    used = [p for p in params if p.name in given and p.kind is not p.VAR_KEYWORD]
    call = ", ".join(p.name if p.kind is p.POSITIONAL_ONLY else f"{p.name}={p.name}" for p in used)
    return f"def {name}({', '.join(p.name for p in used)}):\n    import {module}\n    return {spelled}({call})\n"


def _lambda_in(text: str) -> str:
    """The first lambda expression of a source line (`reference=lambda A, B: A @ B,` -> `lambda A, B: A @ B`)."""
    start = text.index("lambda")
    for end in range(len(text), start, -1):
        try:
            node = ast.parse(text[start:end].strip(), mode="eval").body
        except SyntaxError:
            continue
        if isinstance(node, ast.Lambda):
            return ast.unparse(node)
    raise UsageError("tune_kernel: cannot read the lambda's source; define the function with def")


def search_family(family_file: str | Path, shape: str | None = None, trials: int = 40, run: str | None = None,
                  gpu: int = 0, timeout_s: float = 60.0, sampler: str = "surrogate", seed: int = 0,
                  evaluate=None, lookahead: int | None = None) -> TuneResult:
    """Search a family file's default space on `shape` as `evotune search --family FILE` does; `evaluate` (an
    injected evaluator, evotune.testing.ModelEvaluator) replaces the GPU worker and the finalists' re-timing;
    `lookahead` is SearchOptions' (0: compile in this process, one proposal at a time)."""
    from .problems import allow_plugins, get_problem
    from .records.runs import base_meta, new_run
    from .search.loop import SearchLoop, SearchOptions, worker_evaluator

    allow_plugins([str(family_file)])  # the caller named the file: the consent to load its reference module
    problem = get_problem(str(Path(family_file).resolve()))
    shp = problem.parse_shape(shape or problem.default_shape)
    problem.check_shape(shp)
    space = problem.load_space(tuple(problem.context(shp)))
    options = SearchOptions(trials=trials, sampler=sampler, seed=seed, lookahead=lookahead)
    meta = {**base_meta(), "family": problem.family, "shape": shp.as_dict(), "shape_spec": shp.spec,
            "space": space.path, "options": options.__dict__, "device": {}}
    rn = new_run(run, meta, None)
    if evaluate is not None:
        summary = SearchLoop(problem, space, shp, rn, evaluate, options).run().as_dict()
        best = summary.get("best")
    else:
        summary, best = _on_gpu(problem, space, shp, rn, options, gpu, timeout_s, SearchLoop, worker_evaluator)
    result = (best or {}).get("result") or {}
    return TuneResult(config=(best or {}).get("config"), time_us=result.get("time_us"), run=str(rn.path),
                      family=problem.family, summary=summary)


def _on_gpu(problem, space, shp, rn, options, gpu, timeout_s, SearchLoop, worker_evaluator):
    """The search with a GPU worker, then the finalists timed beside the baselines: (summary, best record)."""
    from .gpu.workers import GPUWorker
    from .records.best import final_best, read_beside
    from .records.runs import record_device
    from .search.finalists import measure_beside_best

    with GPUWorker(device=gpu, timeout_s=timeout_s) as worker:
        record_device(rn, worker.info())
        summary = SearchLoop(problem, space, shp, rn, worker_evaluator(worker, problem, shp), options).run().as_dict()
        beside = measure_beside_best(rn, problem, shp, worker.call)
    return {**summary, "baselines": beside}, final_best(rn.trials(), read_beside(rn.path))
