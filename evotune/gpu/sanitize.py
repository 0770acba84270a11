"""Run one compiled candidate under NVIDIA compute-sanitizer (memcheck, racecheck, synccheck).

The parent process compiles and builds a job; compute-sanitizer starts a fresh Python
(`python -m evotune.gpu.sanitize JOB.json`) that loads the cubin, launches the kernel once
on fresh inputs and synchronises. The tool's summary line decides clean or not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from ..errors import EvotuneError

TOOLS = ("memcheck", "racecheck", "synccheck")
# memcheck/synccheck: "ERROR SUMMARY: 0 errors"; racecheck: "RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)".
_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error|SUMMARY: \d+ hazards? displayed \((\d+) errors?, (\d+) warnings?")


def sanitizer_path() -> str:
    for cand in (shutil.which("compute-sanitizer"), "/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if cand and os.path.exists(cand):
            return cand
    raise EvotuneError("compute-sanitizer not found (it ships with the CUDA toolkit); put it on PATH")


def run_tool(tool: str, job: dict, timeout_s: float = 900.0) -> dict:
    """Run `tool` on the job; return {tool, clean, errors, summary, output_tail, returncode}."""
    if tool not in TOOLS:
        raise EvotuneError(f"unknown sanitizer tool {tool!r}; tools: {', '.join(TOOLS)}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
        job_path = f.name
    # Only our kernel is checked: torch's own kernels (randn, fill) are not the subject.
    cmd = [sanitizer_path(), "--tool", tool, "--error-exitcode", "99", "--print-limit", "20",
           "--kernel-name", f"kns={job['compiled']['entry']}", sys.executable, "-m", "evotune.gpu.sanitize", job_path]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"tool": tool, "clean": False, "errors": None, "summary": f"timed out after {timeout_s:.0f} s",
                "output_tail": "", "returncode": None}
    finally:
        os.unlink(job_path)
    out = proc.stdout + proc.stderr
    match = _SUMMARY.search(out)
    errors = int(match.group(1) or match.group(2)) if match else None
    warnings = int(match.group(3)) if match and match.group(3) else 0  # racecheck's possible hazards
    target_ok = "evotune-sanitize-target: launched" in out
    clean = proc.returncode == 0 and errors == 0 and warnings == 0 and target_ok
    if clean:
        summary = "clean (0 errors)"
    elif errors or warnings:
        summary = f"{errors} error(s), {warnings} warning(s)"
    elif not target_ok:
        summary = "the target did not run to its launch (see output)"
    else:
        summary = f"exit code {proc.returncode}"
    return {"tool": tool, "clean": clean, "errors": errors, "warnings": warnings, "summary": summary,
            "output_tail": "\n".join(out.strip().splitlines()[-40:]), "returncode": proc.returncode}


def _target(job_path: str) -> None:
    """Inside compute-sanitizer: load the cubin, launch once on fresh inputs, synchronise."""
    import torch

    from ..problems import get_problem
    from ..space.searchspace import Config
    from .workers import _compiled_from_dict
    from ..build.compile import load_kernel

    job = json.load(open(job_path))
    problem = get_problem(job["family"])
    shape = problem.shape_from_dict(job["shape"])
    config = Config.from_dict(job["config"])
    compiled = _compiled_from_dict(job["compiled"])
    kernel = load_kernel(compiled, problem.geometry(config, shape).dynamic_smem)
    inputs = problem.make_inputs(shape, 1)
    out = problem.new_output(inputs)
    for t in out.values() if isinstance(out, dict) else (out,):  # a family may write several outputs
        t.fill_(float("nan"))
    problem.launcher(kernel, config, shape, inputs, out)()
    torch.cuda.synchronize()
    print("evotune-sanitize-target: launched", flush=True)


if __name__ == "__main__":
    _target(sys.argv[1])
