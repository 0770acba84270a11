"""CPU tests of evotune.torch.decode: the SDPA route (told once, bottom-right causal), the decode table's build
rule and keys, and the op's fake implementation."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from evotune.errors import UsageError
from evotune.problems.decode import DecodeShape, reference_decode
from evotune.torch import decode as D
from evotune.torch.routing import EvotuneFallbackWarning


@pytest.fixture(autouse=True)
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv(D.TABLE_ENV, str(tmp_path / "none.json"))
    D.use_decode_table(None)
    D.clear()
    yield
    D.clear()


def test_cpu_call_runs_sdpa_with_a_bottom_right_mask_and_says_so_once():
    """A call the kernel cannot take (CPU tensors) computes the bottom-right causal answer through SDPA, told once."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 4, 64, generator=gen), torch.randn(2, 2, 37, 64, generator=gen), torch.randn(2, 2, 37, 64, generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [D.decode_attention(q, k, v, causal=True, scale=0.2) for _ in range(3)]
    told = [w for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    assert len(told) == 1 and "SDPA" in str(told[0].message)
    assert torch.allclose(outs[0], reference_decode(q, k, v, 0.2, causal=True), atol=1e-5)
    # Not top-left: the first query sees 34 keys, not one.
    assert not torch.allclose(outs[0], reference_decode(q, k, v, 0.2, causal=False)[..., :, :], atol=1e-3)


def test_uncovered_reasons_name_the_fault():
    """Each kind of call the kernel does not take has its own reason."""
    f16 = dict(dtype=torch.float16)
    assert "fp16 or bf16" in D.uncovered_reason(torch.randn(1, 8, 1, 64), torch.randn(1, 8, 9, 64), torch.randn(1, 8, 9, 64), False)
    assert "CUDA" in D.uncovered_reason(*(torch.randn(1, 8, s, 64, **f16) for s in (1, 9, 9)), False)


def _bench_record(shape: DecodeShape, ours_us, flash_us, passed=True, cc="9.0") -> dict:
    rows = [{"name": "evotune", "available": passed, "time_us": ours_us if passed else None, "passed": passed,
             "reason": "" if passed else "wrong: max_abs 3"},
            {"name": "flash", "available": True, "time_us": flash_us, "passed": True},
            {"name": "math", "available": True, "time_us": flash_us * 9, "passed": True}]
    return {"family": "attention-decode", "shape_dict": shape.as_dict(), "config": {"splits": 8, "warps": 4},
            "source_digest": "abc", "rows": rows, "raw": {"device": {"name": "NVIDIA H100 80GB HBM3", "sm": cc}}}


def test_table_routes_to_evotune_only_where_the_bench_beat_sdpa(tmp_path):
    """Faster than the fastest backend: evotune; slower, or the kernel failed the gate: SDPA, with the reason."""
    shapes = [DecodeShape(1, 32, 8, 1, 2048, 128, "bf16"), DecodeShape(1, 32, 8, 1, 16384, 128, "bf16"),
              DecodeShape(8, 32, 8, 1, 2048, 128, "bf16")]
    recs = [_bench_record(shapes[0], 5.0, 6.0), _bench_record(shapes[1], 30.0, 29.0),
            _bench_record(shapes[2], 5.0, 6.0, passed=False)]
    paths = []
    for i, rec in enumerate(recs):
        paths.append(tmp_path / f"b{i}.json")
        paths[-1].write_text(json.dumps(rec))
    table = D.build_decode_table(paths)
    routes = [(e["key"]["seq_k_bucket"], e["key"]["bkv_bucket"], e["route"]) for e in table["entries"]]
    assert routes == [(2048, 8, "evotune"), (16384, 8, "sdpa"), (2048, 64, "sdpa")]
    assert "slower" in table["entries"][1]["reason"] and "did not pass" in table["entries"][2]["reason"]
    D.use_decode_table(table)  # parses: every entry's config is read by the family's space
    D.clear()  # forgets decisions and kernels, not a table given as a dict (the GPU tests' fixture does this)
    assert sorted(key[7:9] for key in D._table()) == [(2048, 8), (2048, 64), (16384, 8)]  # seq_k, bkv buckets


def test_table_key_buckets_the_cache_length():
    """Cache lengths share a key up to the next power of two; the group, Sq and causal are exact."""
    key = lambda **kw: D.table_key("H100", "9.0", DecodeShape(**{**dict(batch=1, heads=32, kv_heads=8, seq_q=1, seq_k=2048,
                                                                         head_dim=128, dtype="bf16"), **kw}))
    assert key(seq_k=1025) == key(seq_k=2048) != key(seq_k=2049)
    assert key(kv_heads=4) != key() and key(seq_q=2, causal=True) != key(seq_q=2)
    assert key(causal=True) == key()  # one query sees every key: causal changes nothing


def test_bad_table_is_one_usage_error(tmp_path):
    """A table of another family or version is refused with one line."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"version": 1, "family": "attention", "entries": []}))
    D.use_decode_table(path)
    with pytest.raises(UsageError, match="not a version 1 attention-decode table"):
        D._table()


def test_fake_implementation_gives_the_query_metadata():
    """Under fake tensors (torch.compile's tracing) the op returns q's shape, dtype and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 4, 32, 128, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, S, D) view of (B, S, H, D)
        k = torch.empty(1, 8, 512, 128, dtype=torch.bfloat16)
        out = D.decode_op(q, k, k, False, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == q.stride()


def test_a_decision_is_not_reused_for_a_cache_of_another_dtype():
    """The decision is keyed by K's and V's dtype and device too (it checked them): a cache of another dtype in the
    same bucket decides anew, where reusing a kernel decision would read its bytes as the first dtype's."""
    q = torch.randn(1, 8, 1, 64)
    kv = torch.randn(1, 2, 300, 64)
    D.decode_attention(q, kv, kv)
    assert len(D._DECISIONS) == 1
    with pytest.raises(RuntimeError):  # the SDPA route's own refusal of mixed dtypes, after a decision of its own
        D.decode_attention(q, kv.double(), kv.double())
    assert len(D._DECISIONS) == 2


def test_one_decision_serves_a_cache_length_bucket():
    """Decode steps that grow the cache within a power-of-two bucket reuse one decision; the next bucket decides anew."""
    q = torch.randn(1, 8, 1, 64)
    for sk in (1025, 1500, 2048, 2049):
        kv = torch.randn(1, 2, sk, 64)
        D.decode_attention(q, kv, kv)
    assert len(D._DECISIONS) == 2
