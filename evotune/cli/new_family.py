"""`evotune new-family NAME`: a working scaffold of a kernel family of your own, in a folder NAME/ (or --dir):

    NAME.cu        the kernel, a __device__ function template (z = alpha * x + y, to replace with yours)
    NAME.yaml      the family file: shape, inputs, outputs, arguments, template order, launch, tolerance, space
    reference.py   the reference (and a torch baseline)
    test_NAME.py   its CPU test: the gate on CPU tensors, a wrong launch caught, a search with an injected evaluator

The test passes as generated (`python -m pytest NAME/test_NAME.py`); docs/PLUGINS.md explains each part."""

from __future__ import annotations

import keyword
from pathlib import Path
from typing import Optional

import typer

from ..errors import UsageError
from .common import app, console

KERNEL = """\
// {name}: z = alpha * x + y over N elements, fp16/bf16 in and out, fp32 math. The knobs are template parameters:
// THREADS per CTA, ITEMS per thread. evotune writes the extern "C" entry point that calls {name}<...>(...) with
// the family file's `args`, in that order.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T, int THREADS, int ITEMS>
__device__ void {name}(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ z, int N, float alpha) {{
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "a CTA is whole warps");
    const long long first = (long long)blockIdx.x * THREADS * ITEMS + threadIdx.x;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {{
        const long long j = first + (long long)i * THREADS;  // a warp's loads stay consecutive
        if (j < N) z[j] = static_cast<T>(alpha * static_cast<float>(x[j]) + static_cast<float>(y[j]));
    }}
}}
"""

FAMILY = """\
# The {name} family (docs/PLUGINS.md): `evotune check --family {name}.yaml`, `evotune search --family {name}.yaml`.
name: {name}
description: z = alpha * x + y (a scaffold from evotune new-family)
kernel: {name}.cu
entry: {name}
shape: N=16777216:fp16            # the default shape: named integers and a dtype
dtypes: [fp16, bf16]
constants: {{alpha: 2.0}}           # numbers the reference, the arguments and the expressions may read
inputs:
  x: {{shape: [N]}}                 # drawn N(0, 1) by default (init: normal | uniform | positive | randint)
  y: {{shape: [N]}}
outputs:
  z: {{shape: [N]}}                 # dtype: the shape's unless given (fp16, bf16, fp32, int32)
args: [x, y, z, N, alpha]         # the kernel's parameters in order (optional: by default inputs, outputs, shape
                                  # names, constants, as here)
template: [ctype, threads, items] # its template arguments in order (optional: by default ctype, the dtype's C type,
                                  # then the space's params in order, as here)
launch:
  grid: ["ceil_div(N, threads * items)"]  # quoted: a comma inside [...] separates items
  block: [threads]
  smem: 0
bytes: 3 * N * dtype_bytes        # what bench's roofline reads (flops: too, where it computes)
tolerance: {{fp16: {{atol: 0.001, rtol: 0.002}}, bf16: {{atol: 0.01, rtol: 0.01}}}}
reference: reference.py:reference
baselines: {{torch: reference.py:torch_axpy}}
space:                            # a search space, as in search_spaces/*.yaml, its family this file
  params:
    threads: {{values: [64, 128, 256, 512, 1024], default: 256}}
    items: {{values: [1, 2, 4, 8], default: 4}}
  constraints:
    - expr: threads <= max_threads
      why: a CTA has at most 1024 threads
"""

REFERENCE = """\
import torch


def reference(x, y, alpha):
    \"\"\"The fp32 answer the gate compares the kernel with (arguments: inputs, shape names, constants by name).\"\"\"
    return alpha * x.float() + y.float()


def torch_axpy(x, y, alpha):
    \"\"\"What torch does in the inputs' dtype, timed beside the kernel.\"\"\"
    return torch.add(y, x, alpha=alpha)
"""

TEST = """\
\"\"\"The {name} family on the CPU: the gate passes the reference and fails a wrong launch; a search compiles
real candidates (NVRTC, no GPU) and records them, an injected evaluator standing in for the GPU.\"\"\"

from pathlib import Path

import pytest

from evotune import testing
from evotune.problems import allow_plugins, get_problem

FAMILY = Path(__file__).with_name("{name}.yaml")
SHAPE = "N=1000:fp16"


@pytest.fixture(scope="module")
def problem():
    allow_plugins([str(FAMILY)])  # loading a family file runs its reference module: allowed by name
    return testing.on_cpu(get_problem(str(FAMILY)))


def test_the_reference_passes_the_gate(problem):
    \"\"\"The reference, launched as a kernel would be, passes every check of the gate.\"\"\"
    check = testing.gate_on_cpu(problem, problem.parse_shape(SHAPE))
    assert check.passed, check


def test_a_wrong_launch_fails_the_gate(problem):
    \"\"\"A launch that leaves the last element unwritten (NaN) fails the gate.\"\"\"
    shape = problem.parse_shape(SHAPE)
    right = testing.reference_launch(problem, shape)

    def wrong(inputs, out):
        launch = right(inputs, out)

        def run():
            launch()
            out.view(-1)[-1] = float("nan")

        return run

    check = testing.gate_on_cpu(problem, shape, wrong)
    assert not check.passed and check.nonfinite > 0


def test_a_search_compiles_and_records_trials(problem, tmp_path, monkeypatch):
    \"\"\"Three candidates compiled and recorded; the best is the one the cost model says is fastest.\"\"\"
    monkeypatch.setenv("EVOTUNE_RUNS", str(tmp_path / "runs"))
    shape = problem.parse_shape(SHAPE)
    evaluator = testing.ModelEvaluator(lambda c: 10.0 + c["items"] + 256 / c["threads"])
    summary = testing.search_on_cpu(problem, shape, evaluator, trials=3)
    assert summary["evaluated"] == len(evaluator.calls) == 3
    assert summary["best"]["result"]["time_us"] == min(evaluator.cost(c) for c in evaluator.calls)
"""


def scaffold(name: str, folder: Path) -> list[Path]:
    """Write the scaffold of family `name` into `folder` (which must not exist): the files written."""
    if not name.isidentifier() or keyword.iskeyword(name) or not name.isascii():
        raise UsageError(f"new-family {name!r}: the name must be an identifier (it names the kernel's C++ function)")
    if folder.exists():
        raise UsageError(f"new-family: {folder} already exists; choose another --dir or remove it")
    folder.mkdir(parents=True)
    files = {f"{name}.cu": KERNEL, f"{name}.yaml": FAMILY, "reference.py": REFERENCE, f"test_{name}.py": TEST}
    written = []
    for file, text in files.items():
        path = folder / file
        path.write_text(text.format(name=name))
        written.append(path)
    return written


@app.command("new-family")
def new_family(
    name: str = typer.Argument(..., help="The family's name (an identifier: it names the kernel function)."),
    directory: Optional[str] = typer.Option(None, "--dir", help="Folder to create (default: ./NAME)."),
):
    """Write a working scaffold of a kernel family of your own: kernel, family file with its space, reference, and
    its CPU test (docs/PLUGINS.md)."""
    folder = Path(directory or name)
    written = scaffold(name, folder)
    for path in written:
        console.print(f"wrote {path}", highlight=False)
    family = folder / f"{name}.yaml"
    console.print(f"next: python -m pytest -q {folder / f'test_{name}.py'}; evotune check --family {family}; "
                  f"evotune search --family {family} --trials 40", highlight=False, soft_wrap=True)
