"""`evotune tune --shapes` on a recording of generate()'s decode calls, on the CPU: the recorder's decode rows, the
plan (one search per decode-table key, the longest cache of its bucket), and the decode table written from the
benches, with the per-key search and bench (which need a GPU) replaced by ones that write their records."""

from __future__ import annotations

import json

import pytest
import torch

from evotune.cli import common as cli_common
from evotune.cli import table as cli_table
from evotune.cli import tune_decode
from evotune.errors import EvotuneError
from evotune.records.decode_table import KEY_FIELDS, PROBLEM, decode_tune_plan, read_decode_table

GPU = {"name": "NVIDIA H100 80GB HBM3", "sm": "9.0"}
CONFIG = {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 2}


def generate_steps(batch=1, heads=32, kv_heads=8, prompt=2048, new=32, dim=128) -> list[str]:
    """The decode shapes a generate() of `new` tokens after a `prompt`-token prompt calls, one per step."""
    return [f"{batch},{heads},{kv_heads},{prompt + i},{dim}:fp16" for i in range(1, new + 1)]


def test_plan_tunes_one_shape_per_key_the_longest_cache_of_its_bucket():
    steps = generate_steps() + generate_steps(batch=8)
    shapes, notes = decode_tune_plan(steps)
    assert [s.spec for s in shapes] == ["1,32,8,2080,128:fp16", "8,32,8,2080,128:fp16"]
    assert len(notes) == 2 and "32 recorded decode shapes of one key (cache 2049-2080 keys)" in notes[0]
    # A cache past the next power of two is another key: 4095 and 4097 keys are searched apart.
    far, _ = decode_tune_plan(["1,32,8,4095,128:fp16", "1,32,8,4097,128:fp16", "1,32,8,4000,128:fp16"])
    assert [s.seq_k for s in far] == [4095, 4097]


def test_the_recorder_sees_each_decode_call_with_its_family_and_spelling():
    """On the CPU the call runs SDPA (told), and the recorder still has the decode family's spelling for it: one
    row per cache length, counted, with no table key (there is no GPU to key it by)."""
    import evotune.torch as et
    from evotune.torch.decode import decode_attention

    q = torch.randn(1, 4, 1, 64, dtype=torch.float16)
    with et.record_shapes() as rec, pytest.warns(Warning):
        for sk in (17, 18, 18):
            kv = torch.randn(1, 2, sk, 64, dtype=torch.float16)
            decode_attention(q, kv, kv)
    rows = rec.shapes
    assert [(r["family"], r["shape"], r["calls"], r["route"], r["key"]) for r in rows] == [
        ("attention-decode", "1,4,2,17,64:fp16", 1, "sdpa", None), ("attention-decode", "1,4,2,18,64:fp16", 2, "sdpa", None)]
    assert rec.specs() == [] and rec.specs("attention-decode") == ["1,4,2,17,64:fp16", "1,4,2,18,64:fp16"]
    assert "CUDA" in rows[0]["reason"]


def bench_record(path, shape, ours_us, cudnn_us):
    """An `evotune bench --out` record of the decode family as build_decode_table reads it."""
    rec = {"family": PROBLEM.family, "shape": shape.spec, "shape_dict": shape.as_dict(), "config": CONFIG,
           "source_digest": "0123456789abcdef", "raw": {"device": GPU},
           "rows": [{"name": "evotune", "available": True, "time_us": ours_us},
                    {"name": "cudnn", "available": True, "time_us": cudnn_us, "passed": True}]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec))
    return path


@pytest.fixture
def fake_decode(runs_root, monkeypatch):
    """A GPU is 'visible'; a decode key's search returns a run name, its bench writes a record where our kernel
    takes TIMES[seq_k] against cuDNN's 10 us."""
    calls = []
    times = {2080: 8.0, 16416: 12.0}

    def search_key(shape, trials, timeout, gpu, json_out, **options):
        calls.append((shape.spec, options.get("family")))
        if shape.seq_k not in times:
            raise EvotuneError("no candidate passed the correctness gate")
        return f"d{len(calls)}"

    def bench_best(run_id, out, json_out):
        spec = next(s for s, _ in calls if run_id == f"d{[c[0] for c in calls].index(s) + 1}")
        shape = PROBLEM.parse_shape(spec)
        return bench_record(out, shape, times[shape.seq_k], 10.0)

    monkeypatch.setattr(cli_common, "gpu_count", lambda: 1)
    monkeypatch.setattr(cli_table, "_search_key", search_key)
    monkeypatch.setattr(tune_decode, "_bench_best", bench_best)
    return calls


def recording(tmp_path, decode_specs, attention_specs=()):
    rows = [{"shape": s, "calls": 1} for s in attention_specs]
    rows += [{"family": "attention-decode", "shape": s, "calls": 1} for s in decode_specs]
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"version": 2, "kind": "evotune-attention-shapes", "shapes": rows}))
    return str(path)


def test_tune_writes_the_decode_table_from_the_benches(fake_decode, main_in_process, tmp_path):
    """Each key searched once (the decode family), benched, and routed by that bench: ours where faster than the
    fastest SDPA backend beside it, SDPA where slower; an entry of another key already in the table stays."""
    table = tmp_path / "decode.json"
    other = bench_record(tmp_path / "old.json", PROBLEM.parse_shape("8,32,8,100,128:fp16"), 5.0, 10.0)
    from evotune.records.decode_table import build_decode_table

    table.write_text(json.dumps(build_decode_table([other])))
    specs = generate_steps() + generate_steps(prompt=16384)
    proc = main_in_process("tune", "--shapes", recording(tmp_path, specs), "--decode-table", str(table),
                           "--trials", "4")
    assert proc.returncode == 0, proc.stderr
    assert fake_decode == [("1,32,8,2080,128:fp16", "attention-decode"), ("1,32,8,16416,128:fp16", "attention-decode")]
    doc = read_decode_table(table)
    routes = {(e["key"]["seq_k_bucket"], e["key"]["bkv_bucket"]): e["route"] for e in doc["entries"]}
    assert routes == {(128, 64): "evotune", (4096, 8): "evotune", (32768, 8): "sdpa"}
    assert all(set(e["key"]) == set(KEY_FIELDS) and e["key"]["gpu"] == GPU["name"] for e in doc["entries"])
    assert (tmp_path / "decode.bench" / "d1.json").is_file()  # the measurement each route rests on, beside the table
    assert "decode table" in proc.stdout and "-> sdpa: slower: 12.00 us vs cudnn 10.00 us" in proc.stdout


def test_a_decode_key_that_fails_leaves_the_others_and_exits_non_zero(fake_decode, main_in_process, tmp_path):
    table = tmp_path / "decode.json"
    proc = main_in_process("tune", "--shapes", recording(tmp_path, ["1,32,8,2080,128:fp16", "1,32,8,300,128:fp16"]),
                           "--decode-table", str(table))
    assert proc.returncode == 1 and "1 of 2 keys not tuned (1,32,8,300,128:fp16)" in proc.stderr
    assert [e["route"] for e in read_decode_table(table)["entries"]] == ["evotune"]


def test_a_bad_decode_row_is_exit_2_before_any_search(fake_decode, main_in_process, tmp_path):
    proc = main_in_process("tune", "--shapes", recording(tmp_path, ["1,32,8,2080,80:fp16"]),
                           "--decode-table", str(tmp_path / "d.json"))
    assert proc.returncode == 2 and "head_dim 80" in proc.stderr and not fake_decode
    assert not (tmp_path / "d.json").exists()
