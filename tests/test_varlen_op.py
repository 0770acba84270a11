"""evotune.torch.varlen.attention_varlen: its argument checks, its fallback against attention by the definition, the
custom op's registration, its routing by the tuning table (CPU), and on a GPU the tuned kernel's route."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")

from _tables import entry, table  # noqa: E402

from evotune.errors import UsageError  # noqa: E402
from evotune.problems.shapes import parse_shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402
from evotune.torch import routing  # noqa: E402
from evotune.torch import varlen as VL  # noqa: E402
from evotune.torch.routing import EvotuneFallbackWarning  # noqa: E402

HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}


@pytest.fixture(autouse=True)
def fresh_routes():
    """Each test starts with no table, no cached route and no notice told."""
    routing.use_table(None)
    yield
    routing.use_table(None)


def packed(lengths_q, lengths_k=None, heads=4, kv_heads=4, dim=64, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v packed from these lengths, and the offsets (int32)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    lengths_k = lengths_q if lengths_k is None else lengths_k
    q = torch.randn(sum(lengths_q), heads, dim, generator=gen).to(dtype).to(device)
    k = torch.randn(sum(lengths_k), kv_heads, dim, generator=gen).to(dtype).to(device)
    v = torch.randn(sum(lengths_k), kv_heads, dim, generator=gen).to(dtype).to(device)

    def offsets(lengths):
        return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device=device)

    return q, k, v, offsets(lengths_q), offsets(lengths_k)


def brute_force(q, k, v, cu_q, cu_k, causal, scale=None):
    """Attention by the definition, one query row at a time, in float64."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        for i in range(cu_q[b + 1] - cu_q[b]):
            hi = min(i, cu_k[b + 1] - cu_k[b] - 1) if causal else cu_k[b + 1] - cu_k[b] - 1
            if hi < 0:
                continue
            for h in range(q.shape[1]):
                keys = k[cu_k[b]:cu_k[b] + hi + 1, h // group].double()
                p = torch.softmax(keys @ q[cu_q[b] + i, h].double() * scale, 0)
                out[cu_q[b] + i, h] = p @ v[cu_k[b]:cu_k[b] + hi + 1, h // group].double()
    return out


def quiet_call(*args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EvotuneFallbackWarning)
        return VL.attention_varlen(*args, **kw)


# ------------------------------------------------------------------ the argument checks


def _bad_cases():
    q, k, v, cu, _ = packed([5, 1, 17])
    return [
        ((q[None], k, v, cu, cu, 17, 17), {}, "must be 3-D"),
        ((q, k.half(), v, cu, cu, 17, 17), {}, "one floating dtype"),
        ((q, k[:, :3], v[:, :3], cu, cu, 17, 17), {}, "must divide"),
        ((q, k, v[:-1], cu, cu, 17, 17), {}, "sizes do not match"),
        ((q, k, v, cu.long(), cu, 17, 17), {}, "int32"),
        ((q, k, v, cu, cu[:-1], 17, 17), {}, "one per sequence boundary"),
        ((q, k, v, cu, cu, 4, 17), {}, "max_seqlen_q is too small"),
        ((q, k, v, cu, cu, 17, -1), {}, "max_seqlen_k must be an integer"),
        ((q, k, v, cu, cu, 17.0, 17), {}, "max_seqlen_q must be an integer"),
        ((q, k, v, [0, 5], cu, 17, 17), {}, "cu_seqlens_q must be a tensor"),
        ((q, k, v, cu, cu, 17, 17), {"is_causal": 1}, "is_causal must be True or False"),
        ((q, k, v, cu, cu, 17, 17), {"scale": "x"}, "scale must be a number"),
        ((q, k[:-1], v[:-1], cu, cu, 17, 17), {"is_causal": True}, "query and key lengths equal"),
    ]


@pytest.mark.parametrize("args, kw, fragment", _bad_cases())
def test_bad_arguments_are_one_usage_error_line(args, kw, fragment):
    """Arguments flash_attn_varlen_func would refuse raise one UsageError line, before anything runs."""
    with pytest.raises(UsageError, match=fragment) as info:
        VL.attention_varlen(*args, **kw)
    assert "\n" not in str(info.value)


def test_causal_needs_one_offsets_tensor_or_equal_ones():
    """is_causal: the same offsets tensor (or equal ones) runs; differing ones are refused with the reason."""
    q, k, v, cu, _ = packed([5, 1, 17])
    other = torch.tensor([0, 4, 6, 23], dtype=torch.int32)
    out = quiet_call(q, k, v, cu, cu, 17, 17, is_causal=True)
    assert torch.equal(out, quiet_call(q, k, v, cu, cu.clone(), 17, 17, is_causal=True))
    with pytest.raises(UsageError, match="cu_seqlens_q != cu_seqlens_k"):
        VL.attention_varlen(q, k, v, cu, other, 17, 17, is_causal=True)


# ------------------------------------------------------------------ the fallback against the definition


@pytest.mark.parametrize("lengths_q, lengths_k, heads, kv_heads, causal, dtype", [
    ([1, 1, 1, 1], None, 4, 4, False, torch.float32),            # sequences of one token
    ([1, 1, 1, 1], None, 4, 4, True, torch.float32),
    ([64] + [3] * 9, None, 4, 4, True, torch.float32),          # one long, many short
    ([40, 7, 1], None, 8, 2, False, torch.float32),               # GQA
    ([40, 7, 1], [9, 30, 2], 8, 2, False, torch.float32),         # keys of other lengths
    ([33, 5, 12], None, 4, 1, True, torch.bfloat16),              # MQA, bf16
    ([6, 0, 4], [0, 3, 5], 4, 4, False, torch.float32),           # a sequence with no keys, one with no queries
])
def test_fallback_is_attention_per_sequence(lengths_q, lengths_k, heads, kv_heads, causal, dtype):
    """Off the kernel (CPU tensors) the op is SDPA once per sequence: attention by the definition, nothing crossing
    a sequence; rows of a sequence without keys are 0."""
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, heads, kv_heads, dtype=dtype)
    if causal:
        cu_k = cu_q
    out = quiet_call(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k or lengths_q), is_causal=causal, scale=0.2)
    assert out.shape == (q.shape[0], heads, 64) and out.dtype == dtype and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert float((out.double() - brute_force(q, k, v, cu_q, cu_k, causal, 0.2)).abs().max()) < tol


def test_fallback_is_told_once_naming_what_runs():
    """The first call off the kernel warns (EvotuneFallbackWarning: why, and that SDPA runs per sequence); a repeat
    does not."""
    q, k, v, cu, _ = packed([5, 1, 17])
    with pytest.warns(EvotuneFallbackWarning, match=r"device cpu.*running PyTorch SDPA per sequence"):
        VL.attention_varlen(q, k, v, cu, cu, 17, 17)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvotuneFallbackWarning)
        VL.attention_varlen(q, k, v, cu, cu, 17, 17)


def test_gradients_flow_through_the_fallback():
    """A call that needs gradients runs the fallback (told), and its gradients are attention's."""
    q, k, v, cu, _ = packed([9, 1, 6], heads=4, kv_heads=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with pytest.warns(EvotuneFallbackWarning, match="needs gradients"):
        out = VL.attention_varlen(*leaves, cu, cu, 9, 9, is_causal=True)
    out.square().sum().backward()
    ref_leaves = [t.clone().double().requires_grad_() for t in (q, k, v)]
    ref = torch.zeros(q.shape, dtype=torch.float64)
    cu_l = cu.tolist()
    for b in range(3):
        s0, s1 = cu_l[b], cu_l[b + 1]
        qs, ks, vs = (t[s0:s1].transpose(0, 1) for t in ref_leaves)
        ks, vs = ks.repeat_interleave(2, 0), vs.repeat_interleave(2, 0)
        ref[s0:s1] = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
    ref.square().sum().backward()
    for a, r in zip(leaves, ref_leaves):
        assert float((a.grad.double() - r.grad).abs().max()) < 1e-5


# ------------------------------------------------------------------ the custom op


def test_custom_op_registration():
    """torch.library.opcheck passes (schema, fake implementation, dispatch); the fake output is (total_q, H, Dv)."""
    q, k, v, cu, _ = packed([5, 1, 17], heads=4, kv_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EvotuneFallbackWarning)
        torch.library.opcheck(VL.attention_varlen_op, (q, k, v, cu, cu, 17, 17, True, None))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fq, fk, fv, fc = (mode.from_tensor(t) for t in (q, k, v, cu))
        out = torch.ops.evotune.attention_varlen(fq, fk, fv, fc, fc, 17, 17, True, None)
        assert tuple(out.shape) == (23, 4, 64)
        with pytest.raises(UsageError, match="max_seqlen_q is too small"):
            torch.ops.evotune.attention_varlen(fq, fk, fv, fc, fc, 2, 17, True, None)


def test_compiles_without_a_graph_break():
    """torch.compile(fullgraph=True) traces a model that calls the op (one opaque node) and gives eager's output."""
    q, k, v, cu, _ = packed([5, 1, 17])

    def layer(q, k, v, cu):
        return VL.attention_varlen(q * 2, k, v, cu, cu, 17, 17, is_causal=True) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
        assert torch.allclose(compiled(q, k, v, cu), layer(q, k, v, cu))


# ------------------------------------------------------------------ routing by the tuning table (CPU)

H100 = ("NVIDIA H100 80GB HBM3", "9.0")
TUNED = "8,16,1024,128:bf16:causal:kv4:varlen=1024/512*6/100"


def _call(total=4096, batch=8, max_len=1024, causal=True, heads=16, kv_heads=4, dim=128, dtype="bf16"):
    strides = ((heads * dim, dim, 1), (kv_heads * dim, dim, 1), (kv_heads * dim, dim, 1))
    return VL.VarlenCall(batch, heads, kv_heads, total, total, max_len, max_len, dim, dim, dtype, causal, "cuda:0",
                         strides)


@pytest.fixture
def on_h100(monkeypatch):
    monkeypatch.setattr(routing, "gpu_identity", lambda index: H100 + ((9, 0),))


def test_a_tuned_varlen_key_routes_to_the_kernel(on_h100):
    """A varlen entry serves varlen calls of its key (any lengths with the same buckets), never a dense entry; a key
    without an entry is missing, and says how to tune it."""
    space = load_builtin("attention")
    cfg = space.config(HOPPER).as_dict()
    routing.use_table(table(entry(parse_shape(TUNED), cfg, gpu=H100)))
    decision = VL.decide(_call())
    assert decision.route == "evotune" and decision.kind == "tuned" and decision.key.varlen
    assert decision.shape.total_q == 4096 and decision.shape.seq_q == 1024
    assert VL.decide(_call(total=3000)).route == "evotune"  # other lengths, the same key
    missing = VL.decide(_call(batch=64, total=20000))  # sequences x heads 8 times the tuned key's: no candidate
    assert missing.route == "fallback" and missing.kind == "missing"
    assert "varlen" in missing.notice() and "evotune tune --shape" in missing.notice()
    nearest = VL.decide(_call(batch=16, total=8000))  # one doubling away: named, not used (EVOTUNE_NEAREST unset)
    assert nearest.route == "fallback" and nearest.kind == "unverified"
    dense = parse_shape("8,16,1024,128:bf16:causal:kv4:bshd")
    routing.use_table(table(entry(dense, cfg, gpu=H100)))
    assert VL.decide(_call()).kind == "missing"


def test_uncovered_calls(on_h100):
    """fp32, a head dim the kernel lacks, a strided head dim: the fallback, with the reason."""
    assert "dtype" in VL.decide(_call(dtype="float32")).reason
    assert "head dim" in VL.decide(_call(dim=80)).reason
    bad = VL.VarlenCall(8, 16, 4, 4096, 4096, 1024, 1024, 128, 128, "bf16", True, "cuda:0",
                        ((16 * 128, 128, 2), (4 * 128, 128, 1), (4 * 128, 128, 1)))
    assert "strides" in VL.decide(bad).reason


# ------------------------------------------------------------------ GPU


def _gpu_table(shape_text, knobs=None):
    name = torch.cuda.get_device_name()
    major, minor = torch.cuda.get_device_capability()
    cfg = load_builtin("attention").config({**HOPPER, **(knobs or {})}).as_dict()
    return table(entry(parse_shape(shape_text), cfg, gpu=(name, f"{major}.{minor}")))


@pytest.mark.gpu
@pytest.mark.parametrize("lengths, causal, heads, kv_heads, dtype", [
    ([1024, 512, 512, 512, 512, 512, 512, 100], True, 16, 4, torch.bfloat16),
    ([1000, 1, 129, 64, 700, 3, 17, 1024], False, 16, 16, torch.float16),
])
def test_tuned_route_runs_the_kernel(lengths, causal, heads, kv_heads, dtype):
    """With a table entry for the call's key, the op runs the kernel (no notice) and matches the fallback within the
    gate's tolerance; every row is written (the output starts as torch.empty, and no row may be left NaN-free by
    chance: the fallback's comparison covers each); a CUDA graph captured after the first call replays it."""
    q, k, v, cu, _ = packed(lengths, heads=heads, kv_heads=kv_heads, dim=128, dtype=dtype, device="cuda")
    spec = f"8,{heads},1024,128:{'bf16' if dtype == torch.bfloat16 else 'fp16'}{':causal' if causal else ''}" + \
           (f":kv{kv_heads}" if kv_heads != heads else "") + ":varlen=1024/512*6/100"
    routing.use_table(_gpu_table(spec))
    assert VL.explain_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=causal).route == "evotune"
    with warnings.catch_warnings():
        warnings.simplefilter("error", EvotuneFallbackWarning)
        out = VL.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=causal)
    torch.cuda.synchronize()
    ref = VL.fallback(q.float(), k.float(), v.float(), cu, cu, causal, None)
    atol, rtol = (1e-3, 4e-3) if dtype == torch.float16 else (8e-3, 3e-2)
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).abs() <= atol + rtol * ref.abs()).all(), float((out.float() - ref).abs().max())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = VL.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=causal)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.gpu
def test_untuned_gpu_call_runs_the_fallback():
    """No table: SDPA per sequence on the GPU, told once, equal to attention by the definition."""
    q, k, v, cu, _ = packed([40, 1, 17], heads=8, kv_heads=2, dim=64, dtype=torch.float16, device="cuda")
    with pytest.warns(EvotuneFallbackWarning, match="PyTorch SDPA per sequence"):
        out = VL.attention_varlen(q, k, v, cu, cu, 40, 40, is_causal=True)
    ref = brute_force(q.cpu().float(), k.cpu().float(), v.cpu().float(), cu.cpu(), cu.cpu(), True)
    assert float((out.cpu().double() - ref).abs().max()) < 5e-3
    assert math.isfinite(float(out.float().abs().max()))
