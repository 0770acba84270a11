"""On the GPU: record a few decode steps, `evotune tune --shapes` them (a short search of the attention-decode family,
its best benched beside SDPA's backends), and the decode op then takes the route that bench measured: our kernel
where it was faster (numerics against the fp32 reference), SDPA told where it was not."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_a_recorded_generate_is_tuned_into_the_decode_table(tmp_path):
    import torch

    import evotune.torch as et
    from evotune.problems.decode import reference_decode
    from evotune.torch import decode as D

    torch.manual_seed(0)
    q = torch.randn(2, 16, 1, 128, device="cuda", dtype=torch.float16)
    caches = [torch.randn(2, 4, sk, 128, device="cuda", dtype=torch.float16) for sk in (1500, 1501, 1502)]
    D.use_decode_table({"version": D.TABLE_VERSION, "family": D.PROBLEM.family, "entries": []})
    try:
        with et.record_shapes() as rec, pytest.warns(Warning):
            for kv in caches:
                D.decode_attention(q, kv, kv)
    finally:
        D.use_decode_table(None)
    assert rec.specs("attention-decode") == ["2,16,4,1500,128:fp16", "2,16,4,1501,128:fp16", "2,16,4,1502,128:fp16"]
    shapes, table = tmp_path / "shapes.json", tmp_path / "decode.json"
    rec.save(shapes)
    env = {**os.environ, "EVOTUNE_RUNS": str(tmp_path / "runs"), "EVOTUNE_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "evotune", "tune", "--shapes", str(shapes), "--trials", "6",
                           "--decode-table", str(table)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [entry] = json.loads(table.read_text())["entries"]
    assert entry["shape"]["seq_k"] == 1502 and entry["route"] in ("evotune", "sdpa") and entry["sdpa"]["time_us"] > 0
    D.use_decode_table(str(table))
    try:
        kv = caches[0]
        route = D.decode_route(q, kv, kv)
        assert route == "evotune" if entry["route"] == "evotune" else route.startswith("sdpa: the decode table routes")
        out = D.decode_attention(q, kv, kv)
        ref = reference_decode(q.float(), kv.float(), kv.float(), 128 ** -0.5, False)
        assert (out.float() - ref).abs().max().item() < 2e-2
    finally:
        D.use_decode_table(None)
