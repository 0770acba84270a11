"""What a softcap or window shape's kernel is timed beside (so what the tuning table routes it by): SDPA's backends
where SDPA can compute the semantics (a window, as a boolean attn_mask: what the op's fallback passes), and
FlexAttention (compiled, the same mask and score_mod), issue 42's anchor. CPU: the names, the skips and the masked
launch's numerics; GPU (marked): every available baseline passes the gate beside the fp32 reference."""

from __future__ import annotations

import pytest
import torch

from evotune.problems import get_problem
from evotune.problems.shapes import parse_shape

A = get_problem("attention")


@pytest.mark.parametrize("text, flex", [("1,4,256,64:causal", False), ("1,4,256,64:softcap=30", True),
                                        ("1,4,256,64:window=63,0", True), ("1,4,256,64:causal:softcap=50", True)])
def test_flex_is_timed_only_beside_softcap_and_window(text, flex):
    shape = parse_shape(text)
    assert A.baselines_for(shape) == A.baselines() + (["flex"] if flex else [])
    assert (A.baseline_skip_reason("flex", shape) is None) == flex


def test_softcap_skips_sdpa_and_a_window_skips_only_flash():
    cap, window = parse_shape("1,4,256,64:softcap=30"), parse_shape("1,4,256,64:window=63,0")
    assert all(A.baseline_skip_reason(n, cap) == "skipped: SDPA has no softcap" for n in A.baselines())
    assert "takes no mask" in A.baseline_skip_reason("flash", window)
    assert all(A.baseline_skip_reason(n, window) is None for n in ("cudnn", "efficient", "math"))


@pytest.mark.parametrize("text", ["1,4,200,64:window=31,0", "2,4,96,160,64:window=40,16:kv2",
                                  "1,4,128,64:causal:window=20,-1"])
def test_the_masked_sdpa_baseline_computes_the_window(text):
    """SDPA's math backend with the window as a boolean mask equals the fp32 reference (CPU, float32 inputs)."""
    shape = parse_shape(text)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(shape.batch, shape.heads, shape.seq_q, shape.head_dim, generator=g)
    k = torch.randn(shape.batch, shape.kv_heads, shape.seq_k, shape.head_dim, generator=g)
    v = torch.randn(shape.batch, shape.kv_heads, shape.seq_k, shape.head_dim, generator=g)
    inputs = {"q": q, "k": k, "v": v, "scale": shape.head_dim ** -0.5}
    out = A.baseline_launcher("math", shape, inputs, probe=False)()
    assert torch.allclose(out, A.reference(shape, inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("text", ["1,8,1024,64:bf16:window=255,0", "1,8,1024,128:bf16:causal:softcap=50:kv2",
                                  "2,8,512,64:window=127,0:softcap=30"])
def test_the_baselines_pass_the_gate_on_the_gpu(text):
    from evotune.gpu.evaluate import measure_baselines

    shape = parse_shape(text)
    report = measure_baselines(A, shape, reps=5)
    assert report["flex"]["available"] and report["flex"]["verification"]["passed"], report["flex"]
    for name, row in report.items():
        assert not row["available"] or row["verification"]["passed"], (name, row)
    if not shape.has_softcap:
        assert any(row["available"] for name, row in report.items() if name != "flex"), report
