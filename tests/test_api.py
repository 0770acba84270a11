"""evotune.tune_kernel's pieces on the CPU: the family it writes from Python values (a lambda reference, a torch
baseline) loads and passes the gate, and search_family runs the search with real compiles and an injected evaluator;
`import evotune` stays cheap."""

from __future__ import annotations

import subprocess
import sys

import torch

import evotune
from evotune import testing
from evotune.api import tune_kernel
from evotune.problems import allow_plugins, get_problem
from _paths import REPO_ROOT

KERNEL = """\
#include <cuda_fp16.h>
template <typename T, int THREADS, int ITEMS>
__device__ void scale(const T* __restrict__ x, T* __restrict__ y, float* __restrict__ s, int rows, int cols) {
    int r = blockIdx.x, c0 = threadIdx.x * ITEMS;
    for (int c = c0; c < cols; c += THREADS * ITEMS)
        for (int i = 0; i < ITEMS && c + i < cols; ++i)
            y[r * cols + c + i] = __float2half(3.0f * __half2float(x[r * cols + c + i]));
    if (threadIdx.x == 0) s[r] = 3.0f;
}
"""


def _reference(x):
    return 3 * x.float(), torch.full((x.shape[0],), 3.0)


def test_tune_kernel_writes_a_family_that_passes_the_gate_and_searches(tmp_path, runs_root):
    """tune_kernel with an injected evaluator: a def and a lambda become the family's reference module (two outputs);
    the search compiles and records each trial and returns the config the cost model favours; the family it wrote
    passes the gate on the CPU."""
    evaluator = testing.ModelEvaluator(lambda c: 100.0 / (c["threads"] * c["items"]))
    found = tune_kernel(KERNEL, "scale", {"threads": [32, 64], "items": [1, 2]},
                        inputs={"x": ["rows", "cols"]}, outputs={"y": ["rows", "cols"], "s": {"shape": ["rows"],
                                                                                              "dtype": "fp32"}},
                        reference=_reference, baseline={"mul": lambda x: (x * 3, torch.full((x.shape[0],), 3.0))},
                        grid=["rows"], block=["threads"], shape="rows=6,cols=40:fp16",
                        template=["ctype", "threads", "items"], constraints=[("threads * items <= 128", "a test")],
                        tolerance={"atol": 1e-3, "rtol": 1e-3}, family_dir=str(tmp_path / "fam"), trials=3,
                        sampler="random", evaluate=evaluator, lookahead=0)
    assert found.summary["evaluated"] == len(evaluator.calls) == 3
    assert found.time_us == min(evaluator.cost(c) for c in evaluator.calls) and found.config in evaluator.calls
    path = tmp_path / "fam" / "scale.yaml"
    assert found.family == str(path.resolve()) and (runs_root / found.run.split("/")[-1] / "trials.jsonl").is_file()
    assert (path.parent / "scale.cu").read_text() == KERNEL
    allow_plugins([str(path)])
    problem = testing.on_cpu(get_problem(str(path)))
    shape = problem.parse_shape(problem.default_shape)
    assert testing.gate_on_cpu(problem, shape).passed
    inputs = problem.make_inputs(shape, 1, device="cpu")
    y, s = problem.baseline_launcher("mul", shape, inputs, probe=False)().values()
    assert torch.equal(y, inputs["x"] * 3) and torch.equal(s, torch.full((6,), 3.0))


def test_import_evotune_stays_cheap():
    """`import evotune` imports neither torch nor the search; evotune.tune_kernel is there on first use."""
    code = ("import sys, evotune; assert 'torch' not in sys.modules and 'evotune.api' not in sys.modules; "
            "evotune.tune_kernel; assert 'evotune.api' in sys.modules and 'optuna' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert evotune.tune_kernel.__module__ == "evotune.api"


def test_a_torch_function_as_baseline_is_called_by_its_parameters_names(tmp_path):
    """F.silu as `baseline=` (no lambda) is called by its parameter's name, the family's input `input`; F.rms_norm,
    whose `normalized_shape` is none of the family's names, is a one-line error asking for a lambda."""
    import pytest
    import torch.nn.functional as F

    from evotune.api import write_family
    from evotune.errors import UsageError

    kernel = "template <typename T, int THREADS>\n__device__ void act(const T* x, T* y, int n) {}\n"
    common = dict(grid=["rows"], block=["threads"], shape="rows=4,cols=32:fp32", template=["ctype", "threads"])
    path = write_family(tmp_path / "silu", kernel, "act", {"threads": [32]}, inputs={"input": ["rows", "cols"]},
                        outputs={"y": ["rows", "cols"]}, reference=lambda input: F.silu(input.float()),
                        baseline=F.silu, **common)
    allow_plugins([str(path)])
    problem = testing.on_cpu(get_problem(str(path)))
    shape = problem.parse_shape(problem.default_shape)
    inputs = problem.make_inputs(shape, 3, device="cpu")
    assert problem.baselines() == ["silu"]
    assert torch.equal(problem.baseline_launcher("silu", shape, inputs, probe=False)(), F.silu(inputs["input"]))
    with pytest.raises(UsageError, match=r"rms_norm cannot be called by the family's names: its parameters 'input', "
                                         r"'normalized_shape' are none of x, w, rows, cols, eps; pass a lambda"):
        write_family(tmp_path / "rms", kernel, "act", {"threads": [32]}, inputs={"x": ["rows", "cols"], "w": ["cols"]},
                     outputs={"y": ["rows", "cols"]}, reference=lambda x, w: x, baseline=F.rms_norm,
                     constants={"eps": 1e-6}, **common)
