"""GPU tests of the op's training path and its eager fast path: the log-sum-exp each kernel variant writes
against an fp32 reference; dQ, dK, dV through evotune::attention_lse (our O and LSE into PyTorch's flash or
efficient backward) against SDPA's, both measured against fp32 gradients, across variants, dtypes, head
dims, masks, layouts, Sq != Sk and grouped K/V heads; torch.compile(fullgraph=True) with a backward; and
the eager fast path (repeated calls, new buffers, graph capture). Fixture tables route each key to the
variant named, and explain() checks the kernel ran."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.problems.shapes import Shape  # noqa: E402
from evotune.torch import autograd, routing  # noqa: E402

from test_torch_gpu import assert_close, gpu, make_qkv, use_variant  # noqa: E402,F401  (gpu: a fixture)

pytestmark = pytest.mark.gpu
F = torch.nn.functional

LSE_VARIANTS = ["sync", "split", "wgmma"]


@pytest.fixture(autouse=True)
def default_table():
    yield
    et.use_table(None)


def reference_lse(q, k, shape: Shape, scale: float) -> torch.Tensor:
    """log(sum_j exp(scale q_i . k_j)) over the keys row i sees, in fp32 (K/V heads expanded per query head)."""
    kf = k.float().repeat_interleave(shape.kv_group, dim=1) if shape.kv_group > 1 else k.float()
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if shape.causal:
        mask = torch.ones(shape.seq_q, shape.seq_k, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.logsumexp(s, dim=-1)


def tuned_lse(q, k, v, causal, gqa=False):
    assert et.explain(q, k, v, is_causal=causal, enable_gqa=gqa).kind == "tuned"
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        return torch.ops.evotune.attention_lse(q, k, v, causal, None, gqa, "error")


@pytest.mark.parametrize("variant", LSE_VARIANTS)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_matches_reference(gpu, variant, dtype, causal):
    """Every variant's log-sum-exp (including split-KV's merged one) equals the fp32 reference, in the layout
    its backward reads (padded to 32 rows for the efficient backward), with O still passing the gate."""
    shapes = [Shape(2, 4, sq, sk, d, dtype, causal, layout)
              for sq, sk, d, layout in ((197, 300, 64, "bhsd"), (300, 197, 128, "bshd"), (256, 256, 64, "bshd"))]
    use_variant(gpu, variant, shapes)
    for shape in shapes:
        q, k, v = make_qkv(shape)
        out, lse = tuned_lse(q, k, v, causal)
        backend = autograd.lse_backend(q, k, causal)
        assert lse.shape == autograd.new_lse(q, backend).shape and lse.is_contiguous()
        want = reference_lse(q, k, shape, shape.head_dim ** -0.5)
        got = lse[..., :shape.seq_q]
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-4, msg=f"{variant} {shape.spec}")
        assert_close(out, q, k, v, shape)


GRAD_CASES = [  # (variant, shape, gqa K/V heads)
    ("sync", Shape(2, 4, 256, 256, 64, "fp16", True), None),
    ("sync", Shape(1, 8, 200, 333, 128, "bf16", False, "bshd"), None),
    ("sync", Shape(1, 8, 200, 333, 64, "fp16", True, "bshd"), None),       # causal Sq != Sk: efficient backward
    ("sync", Shape(1, 8, 200, 333, 64, "fp16", True, "bhsd"), None),       # ... with O in (B, H, S, D) memory
    ("split", Shape(1, 8, 512, 512, 64, "fp16", True), None),
    ("wgmma", Shape(2, 4, 384, 384, 128, "bf16", True, "bshd"), None),
    ("wgmma", Shape(1, 8, 256, 512, 64, "fp16", False), None),
    ("wgmma", Shape(1, 32, 256, 256, 128, "bf16", True, "bshd", 8), 8),   # Llama-like grouped heads, flash
    ("sync", Shape(1, 8, 100, 160, 64, "fp16", True, "bhsd", 2), 2),       # grouped + efficient (expanded)
]


@pytest.mark.parametrize("variant,shape,kv_heads", GRAD_CASES, ids=lambda c: getattr(c, "spec", c))
def test_gradients_match_sdpa(gpu, variant, shape, kv_heads):
    """dQ, dK, dV through the op (the tuned kernel's O and LSE into PyTorch's backward) are as close to the
    fp32 gradients as SDPA's own (within 2x its error plus a small floor), and so is O."""
    use_variant(gpu, variant, [shape])
    q, k, v = make_qkv(shape, kv_heads=kv_heads)
    gqa = kv_heads is not None
    grad = torch.randn(q.shape[:3] + (v.shape[-1],), device="cuda", dtype=q.dtype)

    def grads(fn, dtype=None):
        leaves = [t.detach().clone().to(dtype or t.dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad.to(out.dtype))
        return [out.detach().float()] + [t.grad.float() for t in leaves]

    assert et.explain(q.detach().requires_grad_(), k, v, is_causal=shape.causal, enable_gqa=gqa).kind == "tuned"
    ours = grads(lambda a, b, c: et.attention(a, b, c, is_causal=shape.causal, enable_gqa=gqa, fallback="error"))
    sdpa = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=shape.causal, enable_gqa=gqa))
    with _math_only():
        exact = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=shape.causal, enable_gqa=gqa),
                      torch.float32)
    for name, got, theirs, want in zip(("O", "dQ", "dK", "dV"), ours, sdpa, exact):
        err, their_err = (got - want).abs().max().item(), (theirs - want).abs().max().item()
        floor = 2e-3 * want.abs().max().item()
        assert torch.isfinite(got).all() and err <= 2 * their_err + floor, \
            f"{name}: ours {err:.3g} vs SDPA {their_err:.3g} from fp32 ({variant} {shape.spec})"


def _math_only():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def test_torch_compile_fullgraph_training_step(gpu):
    """torch.compile(fullgraph=True) (inductor) of a forward and backward through the op runs the kernel and
    gives SDPA's gradients."""
    torch._dynamo.reset()
    shape = Shape(2, 8, 256, 256, 64, "bf16", True, "bshd")
    use_variant(gpu, "wgmma", [shape])
    q, k, v = make_qkv(shape)

    def loss(a, b, c):
        return et.attention(a, b, c, is_causal=True, fallback="error").float().square().mean()

    compiled = torch.compile(loss, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward()
    ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).float().square().mean().backward()
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad, want.grad, atol=2e-2, rtol=5e-2)


def test_eager_fast_path_repeats_and_follows_new_buffers(gpu):
    """A repeated eager call takes the cached route (FAST_ROUTES), stays right on new buffers and on a
    misaligned view (which goes back through the full path to SDPA, told once), and captures in a graph."""
    shape = Shape(1, 8, 512, 512, 64, "fp16", False)
    use_variant(gpu, "sync", [shape])
    q, k, v = make_qkv(shape)
    with torch.no_grad():
        assert_close(et.attention(q, k, v, fallback="error"), q, k, v, shape)
        assert len(routing.FAST_ROUTES) == 1
        for seed in (1, 2):
            q2, k2, v2 = make_qkv(shape, seed=seed)
            assert_close(et.attention(q2, k2, v2, fallback="error"), q2, k2, v2, shape)
        assert len(routing.FAST_ROUTES) == 1
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = et.attention(q, k, v, fallback="error")
        for dst, src in zip((q, k, v), make_qkv(shape, seed=3)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, q, k, v, shape)
        base = torch.empty(q.numel() + 4, dtype=q.dtype, device="cuda")
        odd = base[4:].view_as(q).copy_(q)  # 8 bytes off a 16-byte boundary
        with pytest.warns(et.EvotuneFallbackWarning, match="16-byte aligned"):
            got = et.attention(odd, k, v)
        # Against SDPA on the aligned tensor of the same values: SDPA on the view itself is wrong (torch 2.11's cuDNN
        # backend misreads a query 8 bytes off a 16-byte boundary; the fallback hands it an aligned copy).
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v))
        assert_close(got, q, k, v, shape)
    assert math.isfinite(float(out.float().sum()))
