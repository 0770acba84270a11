"""Tests for tools/kt_live.py: the dry run (code, geometry, NVRTC compile with CuPy's options), the argument list
against evotune's entry, the space as kt_compare maps it, and the live tune's Kernel Tuner path driven through a
CPU stand-in for its CuPy backend; one GPU test runs a 5-evaluation live tune. Skipped without kernel_tuner."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("kernel_tuner")

from _paths import REPO_ROOT, load_tool  # noqa: E402

L = load_tool("kt_live")
K = L.K

SPACE = str(REPO_ROOT / "search_spaces" / "attention-small.yaml")
EXHAUSTIVE = REPO_ROOT / "runs" / "mission-h100-exhaustive-small"


@pytest.fixture(scope="module")
def setup():
    return L.Setup("mission", SPACE)


@pytest.fixture(scope="module")
def built(setup):
    return L.kt_arguments(setup)


def test_dry_run_builds_and_compiles(tmp_path, capsys):
    """--dry-run takes a few configs (one over 48 KB of shared memory) through Kernel Tuner's KernelSource, gets
    evotune's code and geometry, compiles each with CuPy's NVRTC options and finds the entry by name expression."""
    assert L.main(["--shape", "mission", "--space", SPACE, "--dry-run", "--out", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ok"] is True
    report = json.loads((tmp_path / "kt_live_dry_run.json").read_text())
    assert report["admitted"] == 456 and report["same_admitted_set"] and len(report["configs"]) == 3
    assert any(r["over_48k"] for r in report["configs"]) and any(not r["over_48k"] for r in report["configs"])
    for row in report["configs"]:
        assert row["ok"] and row["code_is_evotunes"] and row["geometry_matches"]
        assert row["compile"]["lowered_name"] == "evotune_attention" and row["compile"]["cubin_bytes"] > 0
    opts = report["cupy_nvrtc_options"]
    assert "--gpu-architecture=sm_90a" in opts and "-std=c++17" in opts and opts[-3:] == [
        "-ftz=true", "-arch=sm_90", "--device-as-default-execution-space"]


def test_arguments_match_the_entry(setup, built):
    """The argument list follows the mission entry's parameters in order, with the numpy type of each (uint16
    bits for the tensors, int64 strides, int32 lengths, float32 scale, null workspace, uint32 kv_magic), the same
    for every admitted config, and the answer holds only o's fp32 reference."""
    params = setup.problem.entry_params(setup.admitted[0])
    assert built["names"] == [n for n, _ in params]
    kinds = {"i64": np.int64, "i32": np.int32, "f32": np.float32, "u32": np.uint32}
    for (name, kind), arg in zip(params, built["arguments"]):
        if kind == "ptr":
            assert isinstance(arg, np.ndarray)
        else:
            assert type(arg) is kinds[kind], name
    args = dict(zip(built["names"], built["arguments"]))
    shape = (1, 8, 512, 64)
    for name in "qkvo":
        assert args[name].dtype == np.uint16 and args[name].shape == shape
    assert np.isnan(args["o"].view(np.float16)).all()                 # the output starts NaN-poisoned
    assert [args[f"q_s{d}"] for d in "bhs"] == [8 * 512 * 64, 512 * 64, 64]
    assert args["seq_q"] == 512 and args["kv_magic"] == 0
    assert args["scale_log2"] == pytest.approx(math.log2(math.e) / 8)
    assert all(args[n].size == 0 for n in ("ws_o", "ws_lse", "ws_count"))
    code = setup.code(setup.params(setup.admitted[0]))
    assert L.check_arguments(setup, built, code) == []
    assert L.config_independent(setup, built) == []
    assert [a is None for a in built["answer"]] == [n != "o" for n in built["names"]]
    assert built["answer"][built["o_index"]].dtype == np.float32
    assert (built["atol"], built["rtol"]) == setup.problem.tolerance(setup.shape) == (1e-3, 4e-3)


def test_tune_params_and_restrictions_are_kt_compares(setup):
    """tune_params and restrictions are kt_compare's for this space and shape, and Kernel Tuner's searchspace
    built from them holds exactly evotune's 456 admitted configs."""
    context = setup.problem.context(setup.shape)
    assert setup.tune_params == K.tune_params(setup.space)
    assert K.describe_restrictions(setup.restrictions) == K.describe_restrictions(K.restrictions(setup.space, context))
    assert setup.kt_admits_the_same() is None and len(setup.admitted) == 456


def test_gate_ratio_is_evotunes_gate(built):
    """The verify function's ratio passes the reference rounded to fp16, fails an output 5% off, and is infinite
    with a NaN left in the output."""
    ref = built["ref"]
    assert L.gate_ratio(built, ref.astype(np.float16).view(np.uint16)) < 0.5
    assert L.gate_ratio(built, (ref * 1.05).astype(np.float16).view(np.uint16)) > 1.0
    out = ref.astype(np.float16)
    out.flat[7] = np.nan
    assert math.isinf(L.gate_ratio(built, out.view(np.uint16)))


# --------------------------------------------------------------------------- Kernel Tuner's path on the CPU


def _recorded_times() -> dict:
    """Config key -> recorded time (us) of the exhaustive run (10 us for a config that did not pass there)."""
    ex = K.E.Exhaustive(EXHAUSTIVE)
    tp = K.tune_params(ex.space)
    out = {}
    for c in ex.admitted:
        res = ex.records[c.digest()]["result"]
        out[K.config_key(c.as_dict()[k] for k in tp)] = res["time_us"] if res["status"] == "ok" else 10.0
    return out


def fake_backend(setup, built, wrong=lambda params: False, times=None):
    """A stand-in for kernel_tuner.backends.cupy.CupyFunctions that runs on the CPU: a launch writes the
    reference (or, for `wrong` configs, an output 5% off) into o, refuses more than 48 KB of dynamic shared
    memory without the kernel's opt-in as CUDA does, and its observer reports the exhaustive run's time."""
    from kernel_tuner.backends.backend import GPUBackend
    from kernel_tuner.observers.observer import BenchmarkObserver

    good = built["ref"].astype(np.float16).view(np.uint16)
    bad = (built["ref"] * 1.05).astype(np.float16).view(np.uint16)
    times = times or {}

    class Func:
        max_dynamic_shared_size_bytes = 0

        def __init__(self, params):
            self.params = params

    class Timer(BenchmarkObserver):
        def register_configuration(self, params):
            self.key = setup.key(params)

        def get_results(self):
            t = times.get(self.key, 5.0) / 1000.0
            return {"time": t, "times": [t]}

    class Fake(GPUBackend):
        launches: list = []
        compiled: list = []

        def __init__(self, device=0, iterations=7, compiler_options=None, observers=None):
            self.max_threads, self.name, self.units = 1024, "fake", {"time": "ms"}
            self.env = {"device_name": "fake", "compiler_options": compiler_options}
            self.observers = (observers or []) + [Timer()]
            self.smem_size, self.func = 0, None

        def ready_argument_list(self, arguments):
            return [a.copy() if isinstance(a, np.ndarray) else a for a in arguments]

        def compile(self, kernel_instance):
            assert kernel_instance.kernel_string == setup.code(kernel_instance.params)
            Fake.compiled.append(setup.key(kernel_instance.params))
            self.func = Func(dict(kernel_instance.params))
            return self.func

        def copy_shared_memory_args(self, smem_args):
            self.smem_size = smem_args["size"]

        def run_kernel(self, func, gpu_args, threads, grid, stream=None):
            if self.smem_size > 48 * 1024 and func.max_dynamic_shared_size_bytes < self.smem_size:
                raise RuntimeError("CUDA_ERROR_INVALID_VALUE: invalid argument")
            Fake.launches.append((func.params, tuple(threads), tuple(grid), self.smem_size))
            gpu_args[built["o_index"]][...] = bad if wrong(func.params) else good

        def start_event(self): pass
        def stop_event(self): pass
        def kernel_finished(self): return True
        def synchronize(self): pass
        def memset(self, allocation, value, size): allocation[...] = value
        def memcpy_dtoh(self, dest, src): np.copyto(dest, src)
        def memcpy_htod(self, dest, src): np.copyto(dest, src)
        def copy_constant_memory_args(self, cmem_args): raise NotImplementedError
        def copy_texture_memory_args(self, texmem_args): raise NotImplementedError

    return Fake


def _tune(monkeypatch, tmp_path, setup, built, budget=24, **kw):
    import kernel_tuner.backends.cupy as kt_cupy

    fake = fake_backend(setup, built, kw.pop("wrong", lambda p: False), kw.pop("times", None))
    monkeypatch.setattr(kt_cupy, "CupyFunctions", fake)
    return L.run_kt(setup, built, "genetic_algorithm", budget, 0, 7, tmp_path, **kw), fake


def test_live_path_through_kernel_tuner(monkeypatch, tmp_path, setup, built):
    """Through Kernel Tuner's genetic_algorithm and sequential runner, every launch gets evotune's block, grid and
    shared memory (opted in above 48 KB), a config failing the gate is recorded and counted as RuntimeFailedConfig
    without ending the tune, every evaluation is charged to max_fevals, and the winner is the fastest passing one."""
    times = _recorded_times()
    wrong = lambda p: p["block_n"] == 32 and p["stages"] == 2  # noqa: E731
    kt, fake = _tune(monkeypatch, tmp_path, setup, built, times=times, wrong=wrong)
    assert kt["error"] is None and kt["runner_visits"] == 24 and kt["distinct_configs"] <= 24
    assert fake.launches and kt["compiles"] == len(fake.compiled)
    for params, threads, grid, smem in fake.launches:
        geo = setup.geometry(params)
        assert (threads, grid, smem) == (tuple(geo.block), tuple(geo.grid), geo.dynamic_smem)
    assert kt["smem_optins_over_48k"] > 0
    failed = {setup.key(r) for r in kt["results"] if r.get("__error__") == "RuntimeFailedConfig"}
    visited_wrong = {setup.key(r) for r in kt["results"] if wrong(r)}
    assert visited_wrong and failed == visited_wrong == set(kt["gate_failures"])
    passing = [times[setup.key(r)] for r in kt["results"] if "__error__" not in r]
    assert kt["best"]["time_us"] == pytest.approx(min(passing)) and not wrong(kt["best"]["params"])
    assert kt["best_so_far_us"][-1] == pytest.approx(min(passing))
    assert len(kt["best_so_far_us"]) == kt["distinct_configs"]


def test_without_the_opt_in_the_tune_ends(monkeypatch, tmp_path, setup, built):
    """Stock launches (no shared-memory opt-in) end the tune at the first config over 48 KB: CUDA's invalid-value
    error is not one Kernel Tuner skips."""
    kt, _ = _tune(monkeypatch, tmp_path, setup, built, smem_optin=False)
    assert kt["error"] and "CUDA_ERROR_INVALID_VALUE" in kt["error"]


def test_stock_verify_ends_the_tune_on_a_wrong_config(monkeypatch, tmp_path, setup, built):
    """With --stock-verify a config failing the gate ends the tune, as Kernel Tuner 1.5 does on a failed check."""
    kt, _ = _tune(monkeypatch, tmp_path, setup, built, wrong=lambda p: True, bridge=False)
    assert kt["error"] and "verification failed" in kt["error"]


def test_usage_and_missing_gpu(capsys):
    """A live run without --out is a usage error (exit 2); without a GPU the live run stops with one line."""
    with pytest.raises(SystemExit) as e:
        L.main(["--shape", "mission", "--space", SPACE])
    assert e.value.code == 2
    if L.gpu_missing() is None:
        pytest.skip("a GPU is visible")
    capsys.readouterr()
    assert L.main(["--shape", "mission", "--space", SPACE, "--out", "/nonexistent-kt-live"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kt_live: ") and "GPU" in err[0]


@pytest.mark.gpu
def test_live_tune_on_the_gpu(tmp_path, capsys):
    """A 5-evaluation live tune compiles and measures through Kernel Tuner's CuPy backend, then the harness re-times
    its winner with evotune's timing path; the record lands under --out."""
    assert L.main(["--shape", "mission", "--space", SPACE, "--budget", "5", "--out", str(tmp_path), "--rounds", "1",
                   "--reps", "10"]) == 0
    record = json.loads((tmp_path / "kt_live.json").read_text())
    kt = record["kernel_tuner_run"]
    assert kt["error"] is None and 1 <= kt["distinct_configs"] <= kt["runner_visits"] <= 5
    row = record["harness"]["rows"][0]
    assert row["label"] == "kernel_tuner" and row["median_us"] > 0
