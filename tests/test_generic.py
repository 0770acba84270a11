"""A family declared by a family file (evotune/problems/generic.py) on the CPU: its shapes, code, launch geometry and
gate (several outputs per launch, each checked), its file's errors at their lines, the consent to load it, and
the command line's words for it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from evotune import testing
from evotune.errors import UsageError
from evotune.gpu import evaluate as E
from evotune.problems import PLUGINS_ENV, allow_plugins, get_problem
from evotune.records import result as R
from _paths import REPO_ROOT
from _generic_family import FAMILY as GENERIC_FAMILY

RMSNORM = REPO_ROOT / "examples" / "rmsnorm" / "rmsnorm.yaml"
GEMM = REPO_ROOT / "examples" / "gemm" / "gemm.yaml"


@pytest.fixture(scope="module")
def rmsnorm():
    allow_plugins([str(RMSNORM)])
    return testing.on_cpu(get_problem(str(RMSNORM)))


@pytest.fixture(scope="module")
def rms_shape(rmsnorm):
    return rmsnorm.parse_shape("M=37,N=64:bf16")


def test_shape_spelling(rmsnorm):
    """NAME=INT pairs keep the default's other names; positional values follow the family's order; bad ones are one
    line."""
    assert rmsnorm.parse_shape("N=128").spec == "M=16384,N=128:fp16"
    assert rmsnorm.parse_shape("5,8:bf16").spec == "M=5,N=8:bf16"
    shape = rmsnorm.parse_shape("M=5,N=8")
    assert rmsnorm.shape_from_dict(shape.as_dict()) == shape and shape.min_bytes() == (2 * 5 * 8 + 8) * 2 + 4 * 5
    for bad, said in (("Q=4", "write M=INT,N=INT"), ("M=0", r"from 1 to 2\^31-1"), ("M=4:fp8", "dtype 'fp8'")):
        with pytest.raises(UsageError, match=said):
            rmsnorm.parse_shape(bad)


def test_instantiation_calls_the_device_template(rmsnorm, rms_shape):
    """The entry point takes the tensors as typed pointers in `args` order and calls entry<template args>."""
    cfg = rmsnorm.space.config({"threads_per_row": 32, "rows_per_block": 4, "vec": 2})
    code = rmsnorm.instantiation(cfg, rms_shape)
    assert "evotune_rmsnorm(const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, " \
           "__nv_bfloat16* __restrict__ y, float* __restrict__ rstd, int M, int N, float eps)" in code
    assert "rms_norm<__nv_bfloat16, 32, 4, 2>(x, w, y, rstd, M, N, eps);" in code
    geo = rmsnorm.geometry(cfg, rms_shape)
    assert geo.grid == (10, 1, 1) and geo.block == (128, 1, 1) and geo.dynamic_smem == 0


def test_two_outputs_pass_the_gate(rmsnorm, rms_shape):
    """The reference launched into both outputs passes every check, the dependency check on each output."""
    check = testing.gate_on_cpu(rmsnorm, rms_shape)
    assert check.passed, check
    assert "rows followed the perturbed input element" in check.dependency


def _tampered(problem, shape, how):
    right = testing.reference_launch(problem, shape)

    def launch_for(inputs, out):
        launch = right(inputs, out)

        def run():
            launch()
            how(out)

        return run

    return launch_for


def test_each_output_is_checked(rmsnorm, rms_shape):
    """A wrong rstd alone, a write past y alone, or a skipped y element each fail the gate, naming the check."""
    def rstd_off(out):
        out["rstd"][3] *= 1.5

    def past_y(out):
        y = out["y"]
        y.as_strided((1,), (1,), y.storage_offset() + y.numel()).fill_(1.0)

    def skip_y(out):
        out["y"][0, 0] = float("nan")

    wrong = testing.gate_on_cpu(rmsnorm, rms_shape, _tampered(rmsnorm, rms_shape, rstd_off))
    assert not wrong.passed and wrong.failed_check == R.ERROR
    stray = testing.gate_on_cpu(rmsnorm, rms_shape, _tampered(rmsnorm, rms_shape, past_y))
    assert stray.failed_check == R.WRITE_OUTSIDE and "after output y" in stray.guards
    nan = testing.gate_on_cpu(rmsnorm, rms_shape, _tampered(rmsnorm, rms_shape, skip_y))
    assert nan.failed_check == R.NONFINITE and nan.nonfinite == 1


def test_timed_checks_and_audit_on_two_outputs(rmsnorm, rms_shape):
    """The whole evaluation (gate, timed output, audit replay) of the reference on two outputs is OK; a launch that
    keeps its first answer fails the audit on changed inputs."""
    assert testing.evaluate_on_cpu(rmsnorm, rms_shape).status == R.OK
    E.forget_timing_inputs()
    kept = {}

    def launch_for(inputs, out):
        def run():
            if "y" not in kept:
                kept.update({n: t.clone() for n, t in rmsnorm.reference(rms_shape, inputs).items()})
            E.copy_output(out, kept)

        return run

    res = testing.evaluate_on_cpu(rmsnorm, rms_shape, launch_for)
    assert res.status == R.WRONG
    E.forget_timing_inputs()


FAMILY = "name: twice\n" + GENERIC_FAMILY


def _family(tmp_path: Path, text: str) -> Path:
    (tmp_path / "k.cu").write_text("#include <cuda_fp16.h>\ntemplate <typename T, int THREADS>\n"
                                   "__device__ void twice(const T* x, T* y, int n)"
                                   " { int i = blockIdx.x * THREADS + threadIdx.x; if (i < n) y[i] = x[i] + x[i]; }\n")
    (tmp_path / "ref.py").write_text("def ref(x):\n    return 2 * x.float()\n")
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("change, said", [
    (("    threads: {values: [32, 64]}", "    threads: {values: [32, 64]}\n    thraeds: {values: [1]}"),
     "twice.yaml:15: parameter 'thraeds' is not a knob of the twice family"),
    (("entry: twice", "entry: twice\nentyr: x"), "twice.yaml:4: unknown key 'entyr' in the family file; did you mean"),
    (("[ctype, threads]", "[ctype, thread]"), "twice.yaml:8: template: unknown name 'thread'; did you mean 'threads'"),
    (("kernel: k.cu", "kernel: missing.cu"), "twice.yaml:2: kernel 'missing.cu': no such file beside the family file"),
    (("args: [x, y, N]", "args: [x, N]"), "twice.yaml:7: args: output 'y' is not passed to the kernel"),
])
def test_family_file_errors_name_their_line(tmp_path, change, said):
    """A misspelled knob, key or name, a missing file, an output the kernel never gets: one `file:line` error."""
    path = _family(tmp_path, FAMILY.replace(*change))
    allow_plugins([str(path)])
    with pytest.raises(UsageError) as info:
        get_problem(str(path))
    assert said in str(info.value) and "\n" not in str(info.value)


def test_loading_a_family_file_needs_consent(tmp_path, monkeypatch):
    """A family file loads where EVOTUNE_PLUGINS names it or its folder (--family does), not otherwise."""
    path = _family(tmp_path, FAMILY)
    monkeypatch.setenv(PLUGINS_ENV, "some.module")
    with pytest.raises(UsageError, match="is a family file: loading it runs its reference module"):
        get_problem(str(path))
    monkeypatch.setenv(PLUGINS_ENV, str(tmp_path))
    assert get_problem(str(path)).name == "twice"


def test_command_line_speaks_the_family(tmp_path, main_in_process):
    """`shapes --family FILE` loads the file named there and lists its shape in its own names; an unknown family
    hints at family files and plugins; a misspelled knob is exit 2 with its line. (`check --family FILE`, which
    compiles in a pool, is the scaffold's next step: tests/test_new_family.py runs the search path.)"""
    path = _family(tmp_path, FAMILY)
    done = main_in_process("shapes", "--family", str(path), "--json")
    assert done.returncode == 0, done.stderr
    assert '"N": 64' in done.stdout and '"spec": "N=64:fp16"' in done.stdout
    unknown = main_in_process("shapes", "--family", "byo_gemm")
    assert unknown.returncode == 2 and "a family file (path/to/family.yaml" in unknown.stderr \
        and "package.module:ATTR" in unknown.stderr
    knobs = "threads: {values: [32, 64]}"
    path.write_text(FAMILY.replace(knobs, knobs + "\n    thraeds: {values: [1]}"))
    bad = main_in_process("check", "--family", str(path))
    assert bad.returncode == 2 and "twice.yaml:15: parameter 'thraeds'" in bad.stderr


def test_config_summary_uses_the_knobs_names():
    """A family of your own's config is spelled by its knob names, not attention's abbreviations."""
    from evotune.cli.display import cfg_short

    assert cfg_short({"block_m": 128, "block_n": 64, "block_k": 32, "stages": 3}) == \
        "block_m=128 block_n=64 block_k=32 stages=3"
    assert cfg_short({"block_m": 128, "stages": 3}, family=str(GEMM)) == "block_m=128 stages=3"
    assert cfg_short({"block_m": 128, "stages": 3}, family="attention") == "M128 st3"


def test_plugin_files_resolve_beside_its_module(tmp_path, monkeypatch):
    """A plugin Problem naming its template and space relative to its module finds them there."""
    (tmp_path / "my_kernel.cu").write_text("// k\n")
    (tmp_path / "my_space.yaml").write_text("family: evotune_besidefam:PROBLEM\nparams: {a: {values: [1]}}\n")
    (tmp_path / "evotune_besidefam.py").write_text(textwrap.dedent("""\
        from evotune.problems.softmax import SoftmaxProblem

        class Beside(SoftmaxProblem):
            family = "evotune_besidefam:PROBLEM"
            kernel_file = "my_kernel.cu"
            default_space = "my_space.yaml"

        PROBLEM = Beside()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(PLUGINS_ENV, "evotune_besidefam")
    problem = get_problem("evotune_besidefam:PROBLEM")
    assert problem.kernel_file == str(tmp_path / "my_kernel.cu")
    assert problem.default_space == str(tmp_path / "my_space.yaml")


def test_a_plugin_without_knob_domains_names_a_misspelled_knob(tmp_path, monkeypatch, main_in_process):
    """A plugin that declares no knob domains and reads a knob the space misspells: one `file:line` line, exit 2,
    not an internal KeyError."""
    (tmp_path / "evotune_readsfam.py").write_text(textwrap.dedent("""\
        from evotune.problems.softmax import SoftmaxProblem

        class Reads(SoftmaxProblem):
            family = "evotune_readsfam:PROBLEM"

            def knob_domains(self):
                return None

            def instantiation(self, config, shape):
                config["threads_per_row"]
                return super().instantiation(config, shape)

        PROBLEM = Reads()
        """))
    (tmp_path / "space.yaml").write_text("family: evotune_readsfam:PROBLEM\nparams:\n"
                                         "  threads_per_rwo: {values: [32]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    done = main_in_process("--plugin", "evotune_readsfam", "check", "--space", str(tmp_path / "space.yaml"))
    assert done.returncode == 2
    assert "space.yaml:3: the evotune_readsfam:PROBLEM family reads knob 'threads_per_row', which the space does " \
           "not have; is 'threads_per_rwo' a misspelling of it?" in done.stderr
