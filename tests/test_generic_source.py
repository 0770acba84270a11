"""A family file's instantiated source: the same in any folder (one digest, one cached cubin for two checkouts), and
its local headers found beside its kernel before the kernels folder."""

from __future__ import annotations

import shutil

import pytest

from evotune.build.compile import compile_source
from evotune.build.template import instantiate
from evotune.errors import UsageError
from evotune.problems import allow_plugins, get_problem
from _paths import REPO_ROOT
from _generic_family import FAMILY as GENERIC_FAMILY

FAMILY = GENERIC_FAMILY
KERNEL = """\
#include <cuda_fp16.h>
#include "twice_op.cuh"
template <typename T, int THREADS>
__device__ void twice(const T* x, T* y, int n) {
    int i = blockIdx.x * THREADS + threadIdx.x;
    if (i < n) y[i] = twice_op(x[i]);
}
"""
HEADER = "// beside the kernel\ntemplate <typename T> __device__ T twice_op(T v) { return v + v; }\n"


def _load(path):
    allow_plugins([str(path)])
    return get_problem(str(path))


def _source(problem, threads=64):
    shape = problem.parse_shape(problem.default_shape)
    return instantiate(problem, problem.space.config({"threads": threads}), shape)


def _family(folder, header=HEADER):
    folder.mkdir(parents=True)
    (folder / "fam.yaml").write_text(FAMILY)
    (folder / "k.cu").write_text(KERNEL)
    (folder / "ref.py").write_text("def ref(x):\n    return 2 * x.float()\n")
    if header is not None:
        (folder / "twice_op.cuh").write_text(header)
    return folder


def test_two_checkouts_compile_one_source(tmp_path):
    """The same example family copied into two folders instantiates to identical bytes: its banner names the file,
    not the folder the checkout lives in."""
    sources = []
    for where in ("one/checkout", "another"):
        folder = tmp_path / where / "rmsnorm"
        shutil.copytree(REPO_ROOT / "examples" / "rmsnorm", folder)
        problem = _load(folder / "rmsnorm.yaml")
        cfg = problem.space.config({"threads_per_row": 64, "rows_per_block": 2, "vec": 4})
        sources.append(instantiate(problem, cfg, problem.parse_shape("M=64,N=256")))
    a, b = sources
    assert a.family != b.family  # two families by their paths (what a worker loads) ...
    assert a.digest == b.digest and a.code == b.code  # ... one kernel
    assert str(tmp_path) not in a.code and "evotune instantiation: rmsnorm.yaml " in a.code


def test_a_local_header_beside_the_kernel(tmp_path):
    """`#include "twice_op.cuh"` in a family's kernel is the header beside it (inlined, so the source stays one
    text), compiles with NVRTC, and a missing one is a one-line error naming it."""
    problem = _load(_family(tmp_path / "fam") / "fam.yaml")
    src = _source(problem)
    assert "// ---- begin twice_op.cuh\n// beside the kernel" in src.code and '#include "twice_op.cuh"' not in src.code
    assert compile_source(src.code, src.entry).resources.registers > 0
    bare = _load(_family(tmp_path / "bare", header=None) / "fam.yaml")
    with pytest.raises(UsageError, match=r"twice_op\.cuh: kernel template not found \(included from .*k\.cu\)"):
        _source(bare)


def test_defaults_for_args_and_template_and_torch_baselines(tmp_path):
    """Without `args` and `template` the entry passes the inputs, outputs, shape names and constants and calls
    entry<ctype, knobs...>; `template: []` calls a plain function; a torch function is a baseline by its dotted name,
    and one whose parameter is none of the family's names is an error at its line."""
    folder = _family(tmp_path / "d")
    text = FAMILY.replace("args: [x, y, N]\n", "").replace("template: [ctype, threads]\n", "")
    (folder / "fam.yaml").write_text(text.replace("space:", "baselines: {neg: torch.neg}\nspace:"))
    problem = _load(folder / "fam.yaml")
    assert "twice<__half, 64>(x, y, N);" in _source(problem).code and problem.baselines() == ["neg"]
    (folder / "none.yaml").write_text(FAMILY.replace("template: [ctype, threads]", "template: []"))
    assert "    twice(x, y, N);" in _source(_load(folder / "none.yaml")).code
    (folder / "bad.yaml").write_text(text.replace("space:", "baselines: {silu: torch.nn.functional.silu}\nspace:"))
    with pytest.raises(UsageError, match=r"bad\.yaml:\d+: baseline 'silu' torch\.nn\.functional\.silu: its parameter "
                                         r"'input' is none of N, x"):
        _load(folder / "bad.yaml")
