"""Tests for tools/kt_compare.py: the exhaustive run as a Kernel Tuner cache file (keys, failure markers) and its
restrictions admitting exactly the space's admitted set; skipped when kernel_tuner is not installed."""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("kernel_tuner")

from evotune.records import result as R  # noqa: E402
from _paths import REPO_ROOT  # noqa: E402

_spec = importlib.util.spec_from_file_location("kt_compare", REPO_ROOT / "tools" / "kt_compare.py")
K = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(K)

RUN = REPO_ROOT / "runs" / "mission-h100-exhaustive-small"


@pytest.fixture(scope="module")
def ex():
    return K.E.Exhaustive(RUN)


def test_cache_keys_and_failure_markers(ex, tmp_path):
    """One entry per admitted config, keyed by its comma-joined values in tune_params order; passing configs carry
    their time in ms, pruned ones CompilationFailedConfig, and Kernel Tuner's reader flags those as errors."""
    from kernel_tuner import util

    data = K.build_cache(ex)
    tp = K.tune_params(ex.space)
    assert data["tune_params_keys"] == ex.space.param_names() == list(tp)
    assert len(data["cache"]) == ex.size
    for c in ex.admitted:
        d = c.as_dict()
        key = ",".join(str(d[k]) for k in tp)
        entry = data["cache"][key]
        assert all(entry[k] == d[k] for k in tp)
        res = ex.records[c.digest()]["result"]
        if res["status"] == R.OK:
            assert entry["time"] == pytest.approx(res["time_us"] / 1000.0)
        else:
            assert entry["time"] == ("CompilationFailedConfig" if res["status"] in (R.PRUNED, R.COMPILE_ERROR)
                                     else "RuntimeFailedConfig")
    path = K.write_cache(ex, tmp_path / "cache.json")
    read = util.read_cache(str(path), open_cache=False)
    errors = [e for e in read["cache"].values() if "__error__" in e]
    assert len(errors) == ex.size - ex.statuses.get(R.OK, 0)
    assert all(isinstance(e["__error__"], util.CompilationFailedConfig) for e in errors)
    assert min(e["time"] for e in read["cache"].values() if "__error__" not in e) == pytest.approx(ex.optimum / 1000)
    json.loads(path.read_text())  # a closed, valid JSON file


def test_restrictions_admit_the_same_configs(ex):
    """Kernel Tuner's searchspace from tune_params and restrictions holds exactly the admitted configs, and its
    per-config restriction check (what its simulation runner uses) agrees with the space on all 972 configs."""
    from kernel_tuner import util

    context = dict(ex.problem.context(ex.shape))
    tp = K.tune_params(ex.space)
    ss = K.kt_searchspace(ex.space, context)
    assert {K.config_key(c) for c in ss.list} == {K.config_key(c.as_dict()[k] for k in tp) for c in ex.admitted}
    rs = K.restrictions(ex.space, context)
    for c in ex.space.all_configs():
        params = {k: c.as_dict()[k] for k in tp}
        assert bool(util.check_restrictions(rs, params, False)) == ex.space.admitted(c, context), c.key()


def test_kt_run_is_repeatable_and_counts_failures(ex, tmp_path):
    """A seeded Kernel Tuner run over the cache repeats exactly, spends at most its budget, and its curve counts
    failed configs as evaluations (a run that visits a pruned config still has one point per evaluation)."""
    cache = K.write_cache(ex, tmp_path / "cache.json")
    tp = K.tune_params(ex.space)
    times = {K.config_key(c.as_dict()[k] for k in tp): (ex.records[c.digest()]["result"]["time_us"]
             if ex.records[c.digest()]["result"]["status"] == R.OK else None) for c in ex.admitted}
    for strategy in ("random_sample", "diff_evo"):
        a = K.kt_run(ex, cache, strategy, 1, 23, times)
        b = K.kt_run(ex, cache, strategy, 1, 23, times)
        assert a["curve"] == b["curve"] and len(a["curve"]) == 23 and a["evaluated"] <= 23 and a["outside"] == 0
        assert a["curve"] == sorted(a["curve"], reverse=True)
