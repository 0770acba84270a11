"""CPU tests of evotune.torch: the custom op's registration (opcheck) and fake implementation, argument
errors, the kernel's coverage rules, routing through the tuning table with its notices and
fallback="error", the grad path, record_shapes on a small model, explain, and the kernel cache (real
NVRTC compiles; the device loader is the only part replaced, since loading needs a GPU)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.errors import EvotuneError, UsageError  # noqa: E402
from evotune.problems.shapes import Shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402
from evotune.torch import kernels, routing  # noqa: E402
from evotune.torch.call import Call, coverage, new_output  # noqa: E402
from evotune.records.tuning_table import save_table  # noqa: E402

from _tables import H100, entry, table  # noqa: E402
from _torch_inputs import fresh_routing, qkv, quiet  # noqa: E402,F401 (fresh_routing: autouse)

F = torch.nn.functional
OP = torch.ops.evotune.attention.default


# --------------------------------------------------------------------------- registration


def test_op_is_registered_without_mutation():
    """evotune::attention exists with the documented arguments (the score mods, then the sink logits, last and
    defaulted), none of them written."""
    schema = OP._schema
    assert schema.name == "evotune::attention"
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "is_causal", "scale", "enable_gqa", "fallback",
                                                  "softcap", "window_left", "window_right", "sinks"]
    assert [a.default_value for a in schema.arguments[-4:]] == [0.0, -1, -1, None]
    assert not any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_opcheck(layout, causal):
    """torch.library.opcheck passes: schema, autograd registration, fake vs real, AOT dispatch with dynamic shapes."""
    q, k, v = qkv(layout=layout)
    quiet(torch.library.opcheck, OP, (q, k, v, causal, None, False, "sdpa"))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fake_on_meta_tensors(layout):
    """On meta tensors the op gives (B, H, Sq, Dv) in the query's layout, and refuses mismatched sizes."""
    q, k, v = (t.to("meta") for t in qkv(layout=layout, sq=5, sk=7))
    out = torch.ops.evotune.attention(q, k, v)
    assert out.device.type == "meta" and out.shape == (2, 4, 5, 64)
    assert out.stride() == ((5 * 4 * 64, 64, 4 * 64, 1) if layout == "bshd" else (4 * 5 * 64, 5 * 64, 64, 1))
    with pytest.raises(UsageError, match="sizes do not match"):
        torch.ops.evotune.attention(q, k[:1], v)


def test_fake_under_fake_tensor_mode():
    """Under FakeTensorMode (what torch.compile traces with) the fake implementation answers, in bshd too."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        q, k, v = (mode.from_tensor(t) for t in qkv(layout="bshd"))
        out = torch.ops.evotune.attention(q, k, v, True)
    assert out.shape == (2, 4, 16, 64) and out.stride(1) < out.stride(2)


def test_torch_compile_fullgraph_on_cpu():
    """torch.compile(fullgraph=True) traces a function calling the op with no graph break, and the result is SDPA's."""
    torch._dynamo.reset()
    q, k, v = qkv(layout="bshd")
    fn = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal=True) * 2, fullgraph=True, backend="aot_eager")
    got = quiet(fn, q, k, v)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2)


def test_compile_traces_an_sdpa_route_as_sdpa():
    """Where the route is SDPA by facts fixed at trace time (here: a CPU call), the compiled graph calls SDPA,
    not the opaque op; the notice is told once, while tracing; fallback="error" raises while tracing."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v = qkv(layout="bshd")
    fn = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal=True), fullgraph=True, backend=backend)
    with pytest.warns(et.EvotuneFallbackWarning, match="device cpu"):
        got = fn(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        fn(q, k, v)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    targets = [str(n.target) for g in graphs for n in g.graph.nodes]
    assert any("scaled_dot_product_attention" in t for t in targets)
    assert not any("evotune" in t for t in targets)
    torch._dynamo.reset()
    strict = torch.compile(lambda q, k, v: et.attention(q, k, v, fallback="error"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="device cpu"):
        strict(q, k, v)


@pytest.mark.parametrize("entry_point", ["attention", "eager_attention"])
def test_a_cached_route_is_not_taken_by_another_k_or_v_dtype(entry_point):
    """After a uniform call cached its route, a call of the same sizes and strides with K or V of another dtype is not
    served by that route (a kernel route would read the other dtype's bytes as the first's): the full path refuses it
    with its one line. The route's key holds each tensor's dtype and device."""
    from evotune.torch.op import eager_attention

    call = (lambda q, k, v: et.attention(q, k, v, is_causal=True)) if entry_point == "attention" else (
        lambda q, k, v: eager_attention(q, k, v, True, None, False))
    q, k, v = qkv(layout="bshd")
    quiet(call, q, k, v)
    assert len(routing.FAST_ROUTES) == 1
    for other in ((q, k.double(), v), (q, k, v.double())):
        with pytest.raises(UsageError, match="must share one floating dtype"):
            call(*other)
    assert len(routing.FAST_ROUTES) == 1


def test_compile_traces_a_plain_call_in_one_constant_step(monkeypatch):
    """A plain call (no softcap, window or sinks) traces through _traced_plain, not the general path's checks, whose
    inlined functions each left dynamo guards checked before every compiled call; the result is SDPA's, and a bad
    option still raises with its message (inside dynamo's error)."""
    from evotune.torch import op
    from evotune.torch.call import output_layout

    def not_traced(*args, **kwargs):
        raise AssertionError("the general path's checks were traced")

    torch._dynamo.reset()
    q, k, v = qkv(layout="bshd")
    monkeypatch.setattr(op, "score_mods", not_traced)
    monkeypatch.setattr(op, "check_sinks", not_traced)
    fn = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal=True, scale=0.25), fullgraph=True,
                       backend="eager")
    got = quiet(fn, q, k, v)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25))
    assert got.stride() == output_layout(q, v)[1] and got.stride(1) < got.stride(2)  # the query's layout: bshd
    torch._dynamo.reset()
    bad = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal="yes"), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="is_causal must be True or False"):
        bad(q, k, v)


@pytest.mark.parametrize("how", ["automatic", "dynamic", "bounded"])
@pytest.mark.parametrize("mods", [{}, {"softcap": 30.0}, {"window": (4, 0), "softcap": 5.0}])
def test_compile_with_symbolic_sizes(how, mods):
    """Sizes a trace keeps symbolic (automatic dynamic shapes from a second length on, dynamic=True, a dimension
    marked dynamic with bounds) keep the op in the graph, which decides at run time; sizes the trace fixed call the
    fallback. Before, the second length failed: the route check took a symbolic size for an int."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal=not mods, **mods), fullgraph=True,
                       backend=backend, dynamic=True if how == "dynamic" else None)
    for s in (16, 24, 40):
        q, k, v = qkv(h=2, sq=s, sk=s, layout="bshd")
        if how == "bounded":
            for t in (q, k, v):
                torch._dynamo.mark_dynamic(t, 2, min=2, max=64)
        torch.testing.assert_close(quiet(fn, q, k, v), quiet(et.attention, q, k, v, is_causal=not mods, **mods))
    has_op = [any("evotune" in str(n.target) for n in g.graph.nodes) for g in graphs]
    # Automatic dynamic shapes first trace S = 16 as a constant (the fallback itself), then S symbolic (the op).
    assert has_op == ([False, True] if how == "automatic" else [True])


def test_compile_while_recording():
    """A compiled call made while record_shapes() is active traces with no graph break (the op then stays in the graph,
    so every call is recorded), at a fixed and at a symbolic length; each call is recorded with its route."""
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal=True), fullgraph=True, backend="aot_eager")
    with et.record_shapes() as rec:
        for s in (16, 24):
            q, k, v = qkv(h=2, sq=s, sk=s)
            torch.testing.assert_close(quiet(fn, q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert [(r["seq_q"], r["route"], r["calls"]) for r in rec.shapes] == [(16, "sdpa", 1), (24, "sdpa", 1)]


def test_output_matches_sdpa_and_takes_the_query_layout():
    """Through the fallback the op returns SDPA's values, dense in the query's layout, for Sq != Sk and causal."""
    for layout, heads in (("bhsd", 4), ("bshd", 4), ("bshd", 1)):  # one head: SDPA's strides differ from ours there
        q, k, v = qkv(h=heads, layout=layout, sq=9, sk=13)
        out = quiet(et.attention, q, k, v, is_causal=True, scale=0.3)
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))
        assert out.stride() == new_output(q, v).stride()


def test_sdpa_gets_aligned_copies_of_views_off_a_16_byte_boundary(monkeypatch):
    """SDPA does not check alignment, and on the H200 (torch 2.11) its cuDNN backend returned wrong values for a
    query view 8 bytes past a boundary: the fallback hands SDPA an aligned copy of such a view, first call and
    cached route alike, and only of that tensor; the answer and the output layout are those of the aligned call."""
    from evotune.torch.call import aligned_for_sdpa

    q, k, v = qkv(h=2, layout="bshd", sq=16, sk=16)
    base = torch.empty(q.numel() + 4, dtype=q.dtype)
    odd = base[4:].view(q.shape[0], q.shape[2], q.shape[1], q.shape[3]).transpose(1, 2)  # bshd memory, 8 bytes off
    odd.copy_(q)
    assert odd.data_ptr() % 16 == 8 and odd.stride() == q.stride()
    fixed = aligned_for_sdpa(odd, k, v)
    assert fixed[0].data_ptr() % 16 == 0 and fixed[0].stride() == q.stride() and torch.equal(fixed[0], q)
    assert fixed[1] is k and fixed[2] is v and aligned_for_sdpa(q, k, v)[0] is q
    seen = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q.data_ptr() % 16)
        return real(q, k, v, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    want = real(q, k, v, is_causal=True)
    for _ in range(3):  # the first call decides; later ones take the cached route
        out = quiet(et.attention, odd, k, v, is_causal=True)
        torch.testing.assert_close(out, want)
        assert out.stride() == new_output(q, v).stride()
    assert seen == [0, 0, 0]


# --------------------------------------------------------------------------- argument errors and coverage


@pytest.mark.parametrize("args, kwargs, fault", [
    (lambda q, k, v: (q[0], k, v), {}, "q must be 4-D"),
    (lambda q, k, v: (q, k.half(), v), {}, "share one floating dtype"),
    (lambda q, k, v: (q, k[:1], v[:1]), {}, "sizes do not match"),
    (lambda q, k, v: (q, k[:, :2], v[:, :2]), {}, "or pass enable_gqa=True"),
    (lambda q, k, v: (q, k[:, :3], v[:, :3]), {"enable_gqa": True}, "must be a divisor"),
    (lambda q, k, v: (q, k, v), {"fallback": "cudnn"}, "fallback='cudnn'"),
    (lambda q, k, v: (q, k, v), {"is_causal": 1}, "is_causal must be True or False"),
    (lambda q, k, v: (q, k, v), {"scale": "0.1"}, "scale must be a number"),
    (lambda q, k, v: (q.numpy(), k, v), {}, "q must be a tensor"),
])
def test_bad_arguments_are_one_line(args, kwargs, fault):
    """Arguments SDPA would refuse are one UsageError line naming the fault."""
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(UsageError, match=fault) as info:
        et.attention(*args(q, k, v), **kwargs)
    assert "\n" not in str(info.value)


def cuda_call(**changes) -> Call:
    """A Call as a CUDA tensor on an H100 would give (calls are plain data: no GPU needed)."""
    b, h, s, d = 2, 8, 1000, 64
    strides = (h * s * d, s * d, d, 1)
    base = Call(b, h, h, s, s, d, d, "fp16", False, "bhsd", "cuda:0", (strides, strides, strides))
    return dataclasses.replace(base, **changes)


@pytest.mark.parametrize("changes, cc, fault", [
    ({"device": "cpu"}, None, "device cpu"),
    ({}, (8, 0), "compute capability 8.0"),
    ({"dtype": "float32"}, (9, 0), "dtype float32"),
    ({"head_dim": 80, "v_head_dim": 80}, (9, 0), "head dim 80"),
    ({"v_head_dim": 128}, (9, 0), "value head dim 128"),
    ({"kv_heads": 3}, (9, 0), "3 K/V heads for 8 query heads"),
    ({"seq_k": 0}, (9, 0), "empty tensor"),
    ({"strides": ((1, 1, 1, 2),) * 3}, (9, 0), "unit head-dim stride"),
    ({"strides": ((8, 8, 68, 1),) * 3}, (9, 0), "multiples of 8"),
    ({"batch": 70000}, (9, 0), "batch 70000 is too large"),
])
def test_coverage_names_what_the_kernel_cannot_do(changes, cc, fault):
    """Each reason the kernel cannot compute a call is named; a plain fp16 d64 call on sm 9.0 is covered."""
    assert coverage(cuda_call(), (9, 0)) is None
    assert fault in coverage(cuda_call(**changes), cc)


def test_grouped_calls_are_covered_with_their_kv_heads():
    """A grouped call (kv heads dividing the query heads) is covered, and its Shape and spelling carry the K/V heads."""
    for kv in (1, 2, 4):
        call = cuda_call(kv_heads=kv)
        assert coverage(call, (9, 0)) is None
        assert call.shape().kv_heads == kv and call.shape().kv_group == 8 // kv
        assert call.as_dict()["shape"] == f"2,8,1000,64:fp16:kv{kv}"
    assert "kv" not in cuda_call().as_dict()["shape"]


def test_kernel_features():
    """The kernel reads grouped K/V heads and writes the log-sum-exp when asked; unknown features are refused."""
    assert et.supports("gqa") and et.supports("lse")
    assert kernels.unsupported("gqa") == kernels.unsupported("lse") == "" and not kernels.MISSING_FEATURES
    with pytest.raises(UsageError, match="unknown kernel feature"):
        et.supports("fp8")


# --------------------------------------------------------------------------- routing through the table


@pytest.fixture
def on_h100(monkeypatch):
    """Device queries answer as an H100 would (the routing logic under test is unchanged)."""
    monkeypatch.setattr(routing, "gpu_identity", lambda index: (H100[0], H100[1], (9, 0)))


def shape_of(call: Call) -> Shape:
    return call.shape()


def test_decisions_through_the_table(on_h100, tmp_path):
    """No table: missing. An evotune entry: tuned. An SDPA entry: the table's choice. Another GPU's table: missing, named."""
    call = cuda_call()
    assert routing.decide(call).kind == "missing" and "no tuning table at" in routing.decide(call).reason
    et.use_table(table(entry(shape_of(call))))
    tuned = routing.decide(call)
    assert (tuned.route, tuned.kind, tuned.match) == ("evotune", "tuned", "exact")
    et.use_table(table(entry(shape_of(call), route="sdpa", evotune_us=3.0)))
    assert (routing.decide(call).route, routing.decide(call).kind) == ("sdpa", "table")
    path = save_table(table(entry(shape_of(call), gpu=("NVIDIA A100-SXM4-80GB", "8.0"))), tmp_path / "a100.json")
    et.use_table(path)
    foreign = routing.decide(call)
    assert foreign.kind == "missing" and f"{path} has entries for NVIDIA A100-SXM4-80GB (sm 8.0) only" in foreign.reason


def test_grouped_calls_route_by_their_group_size(on_h100):
    """A grouped call takes only an entry of its own group size; ungrouped entries do not serve it, and a
    nearest entry of its group is named but not run (unverified at the call's key)."""
    ungrouped, grouped = cuda_call(), cuda_call(kv_heads=2)  # group 4
    et.use_table(table(entry(shape_of(ungrouped))))
    miss = routing.decide(grouped)
    assert (miss.route, miss.kind, miss.key.kv_group) == ("sdpa", "missing", 4)
    assert "kv-group 4" in miss.notice() and "--shape 2,8,1000,64:fp16:kv2" in miss.notice()
    # 1 x 16 heads in groups of 4 (4 K/V heads) at 1024 rows: the grouped call's key (BH 16, Sq/Sk 1024, group 4)
    et.use_table(table(entry(shape_of(ungrouped)), entry(Shape(1, 16, 1024, 1024, 64, kv_heads=4))))
    tuned = routing.decide(grouped)
    assert (tuned.route, tuned.kind, tuned.match) == ("evotune", "tuned", "exact")
    assert tuned.shape.kv_heads == 2 and tuned.entry.key.kv_group == 4
    et.use_table(table(entry(shape_of(ungrouped)), entry(Shape(1, 32, 1024, 1024, 64, kv_heads=8))))  # BH 32: nearest
    near = routing.decide(grouped)
    assert (near.route, near.match, near.entry.key.kv_group) == ("sdpa", "nearest", 4)
    assert routing.decide(ungrouped).match == "exact" and routing.decide(ungrouped).entry.key.kv_group == 1
    assert routing.decide(cuda_call(kv_heads=4)).kind == "missing"  # group 2: no entry of that group


def test_nearest_entry_is_unverified_unless_opted_in(on_h100, monkeypatch):
    """A call whose key has only a nearer key's entry (batch 16 where batch 1 was tuned: the H100 case where
    that config ran 0.94x SDPA) runs SDPA, told with the nearest entry and the tune command; fallback="error"
    refuses it; EVOTUNE_NEAREST=1 runs the nearest entry's config."""
    call = cuda_call(batch=16, seq_q=1024, seq_k=1024)
    et.use_table(table(entry(Shape(8, 8, 1024, 1024, 64))))  # BH 64 against the call's 128
    near = routing.decide(call)
    assert (near.route, near.kind, near.match) == ("sdpa", "unverified", "nearest")
    assert near.refused_by_error_fallback and near.notice().count("evotune tune --shape 16,8,1024,64") == 1
    assert "BH<=64" in near.notice() and "BH<=128" in near.notice()
    monkeypatch.setenv("EVOTUNE_NEAREST", "1")
    et.use_table(table(entry(Shape(8, 8, 1024, 1024, 64))))
    opted = routing.decide(call)
    assert (opted.route, opted.kind, opted.match) == ("evotune", "tuned", "nearest")


def test_explain_grouped_call_on_meta():
    """explain() on meta tensors with enable_gqa names the K/V heads and the reason it is not the kernel (device), not GQA."""
    q, k, v = qkv(b=1, h=8, sq=64, sk=64, dtype=torch.float16, device="meta", kv_heads=2)
    info = et.explain(q, k, v, enable_gqa=True)
    assert info.call["kv_heads"] == 2 and info.call["shape"] == "1,8,64,64:fp16:kv2"
    assert info.kind == "uncovered" and "device meta" in info.reason and "grouped" not in info.reason
    out = OP(q, k, v, False, None, True, "sdpa")  # the fake on meta: query heads, query layout
    assert out.shape == (1, 8, 64, 64) and out.device.type == "meta"


def test_grouped_call_on_cpu_matches_sdpa_enable_gqa():
    """On the CPU a grouped call runs SDPA with enable_gqa and gives its answer."""
    q, k, v = qkv(h=8, kv_heads=2, dtype=torch.float32)
    got = quiet(et.attention, q, k, v, enable_gqa=True, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    assert torch.equal(got, want)


def test_missing_key_notice_warns_once_and_error_refuses(on_h100):
    """A missing key warns once per key with the key and the tune command; fallback='error' raises; the table's own SDPA choice does not."""
    et.use_table(table(entry(Shape(2, 8, 4096, 4096, 128))))
    miss = routing.decide(cuda_call())
    with pytest.warns(et.EvotuneFallbackWarning) as got:
        routing.notify(miss, "sdpa")
        routing.notify(miss, "sdpa")
        routing.notify(routing.decide(cuda_call(seq_q=900, seq_k=900)), "sdpa")  # same bucket: same key
    assert len(got) == 1
    text = str(got[0].message)
    assert "no tuned kernel for NVIDIA H100 80GB HBM3 (sm 9.0) fp16 d64 non-causal bhsd Sq<=1024 Sk<=1024" in text
    assert "evotune tune --shape 2,8,1000,64:fp16 --table" in text
    with pytest.raises(UsageError, match=r"no tuned kernel .*\[fallback='error'\]"):
        routing.notify(miss, "error")
    et.use_table(table(entry(Shape(2, 8, 1024, 1024, 64), route="sdpa", evotune_us=3.0)))
    with pytest.warns(et.EvotuneFallbackWarning, match="routes .* to PyTorch SDPA"):
        routing.notify(routing.decide(cuda_call()), "error")


def test_bad_table_in_env_is_never_used_silently(on_h100, tmp_path, monkeypatch):
    """EVOTUNE_TABLE naming a corrupt or absent file fails every routed call with one line naming it."""
    bad = tmp_path / "t.json"
    bad.write_text("{not json")
    monkeypatch.setenv("EVOTUNE_TABLE", str(bad))
    et.use_table(None)
    for _ in range(2):
        with pytest.raises(UsageError, match=f"{bad}: not valid JSON"):
            routing.decide(cuda_call())
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "absent.json"))
    et.use_table(None)
    with pytest.raises(UsageError, match="absent.json: no such tuning table"):
        routing.decide(cuda_call())
    with pytest.raises(UsageError, match="not valid JSON"):
        et.use_table(bad)


def test_cpu_calls_warn_once_and_error_fallback_raises():
    """On the CPU the op runs SDPA, telling once (not per call); fallback='error' refuses with the reason."""
    q, k, v = qkv()
    with pytest.warns(et.EvotuneFallbackWarning, match="device cpu: the kernel runs on CUDA GPUs"):
        et.attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        et.attention(q, k, v)
        et.attention(*qkv(sq=33))
    with pytest.raises(UsageError, match=r"device cpu.*\[fallback='error'\]"):
        et.attention(q, k, v, fallback="error")


def test_grad_inputs_run_the_training_op_with_pytorchs_backward(monkeypatch):
    """Inputs that require grad run evotune::attention_lse (on the CPU: PyTorch's CPU flash forward with its
    log-sum-exp, told once) and backpropagate through PyTorch's attention backward to SDPA's gradients."""
    from evotune.torch import autograd

    backwards = []
    real_backward = autograd.attention_backward
    monkeypatch.setattr(autograd, "attention_backward", lambda *a: backwards.append(1) or real_backward(*a))
    q, k, v = (t.float().requires_grad_() for t in qkv())
    with pytest.warns(et.EvotuneFallbackWarning, match="device cpu"):
        out = et.attention(q, k, v, is_causal=True)
    out.sum().backward()
    assert backwards == [1]
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True).sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want)
    with pytest.raises(UsageError, match="device cpu"):
        et.attention(q, k, v, fallback="error")


def test_explain():
    """explain() names the route, the reason and whether fallback='error' would refuse, without warning."""
    q, k, v = qkv(layout="bshd")
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        info = et.explain(q, k, v, is_causal=True)
    assert (info.route, info.kind, info.raises_with_error_fallback) == ("sdpa", "uncovered", True)
    assert info.call["shape"] == "2,4,16,24,64:bf16:causal:bshd"
    assert "PyTorch SDPA" in str(info) and "device cpu" in str(info)


# --------------------------------------------------------------------------- record_shapes


class TinyModel(torch.nn.Module):
    """Two attention layers on (B, S, H·D) activations: self-attention (causal), then cross-attention to a memory."""

    def __init__(self, heads=2, head_dim=64):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim)

    def split(self, x):
        b, s, _ = x.shape
        return x.view(b, s, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x, memory):
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))
        x = et.attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        mq, mk, mv = (self.split(t) for t in self.qkv(memory).chunk(3, dim=-1))
        return et.attention(self.split(x), mk, mv).transpose(1, 2).flatten(2)


def test_record_shapes_on_a_cpu_model(tmp_path):
    """record_shapes collects each distinct call with its count, key, route and --shape spelling; save() writes JSON."""
    model = TinyModel()
    with torch.no_grad(), et.record_shapes() as rec:
        quiet(model, torch.randn(3, 10, 128), torch.randn(3, 7, 128))
        quiet(model, torch.randn(3, 10, 128), torch.randn(3, 7, 128))
    quiet(model, torch.randn(1, 5, 128), torch.randn(1, 5, 128))  # after the block: not recorded
    rows = rec.shapes
    assert [(r["seq_q"], r["seq_k"], r["causal"], r["calls"]) for r in rows] == [(10, 10, True, 2), (10, 7, False, 2)]
    assert all(r["dtype"] == "float32" and r["shape"] is None and r["route"] == "sdpa" and r["layout"] == "bshd"
               for r in rows)
    path = rec.save(tmp_path / "shapes.json")
    saved = json.loads(path.read_text())
    assert saved["version"] == 2 and saved["kind"] == "evotune-attention-shapes" and saved["shapes"] == rows


def test_record_shapes_spells_tunable_shapes():
    """Calls in a dtype the kernel takes get their `--shape` spelling, ready for `evotune tune`."""
    with et.record_shapes() as rec:
        quiet(et.attention, *qkv(b=1, h=4, sq=100, sk=300, dtype=torch.float16), is_causal=True)
        quiet(et.attention, *qkv(b=1, h=4, sq=100, sk=300, dtype=torch.float16, layout="bshd"))
    assert rec.specs() == ["1,4,100,300,64:fp16:causal", "1,4,100,300,64:fp16:bshd"]


# --------------------------------------------------------------------------- the kernel cache


def test_kernel_cache_compiles_once_and_loads_once_per_device():
    """The cache compiles a config with NVRTC once and loads it once per device; the shape class shares kernels."""
    loads = []

    def loader(compiled, smem, device):
        loads.append((compiled.cubin_path, device))
        return f"kernel@{device}"

    cache = kernels.KernelCache(loader)
    config = load_builtin("attention").default_config()
    a, b = Shape(1, 8, 512, 512, 64), Shape(4, 2, 100, 700, 64)  # same class: fp16 d64 non-causal
    first = cache.get(config, a, 0)
    assert cache.get(config, b, 0) is first and cache.loaded(config, b, 0) is first and len(loads) == 1
    cache.get(config, a, 1)
    cache.get(config, Shape(1, 8, 512, 512, 64, causal=True), 0)
    assert [d for _, d in loads] == [0, 1, 0] and len(cache) == 3
    assert first.kernel == "kernel@0" and first.cubin_path.endswith(".cubin")


def test_kernel_cache_loads_once_under_concurrent_first_calls():
    """Threads making the first call for one kernel at once load it once, and all get that one."""
    import threading
    import time

    loads = []

    def slow_loader(compiled, smem, device):
        loads.append(device)
        time.sleep(0.2)
        return object()

    cache = kernels.KernelCache(slow_loader)
    config, shape = load_builtin("attention").default_config(), Shape(1, 8, 512, 512, 64)
    got = []
    threads = [threading.Thread(target=lambda: got.append(cache.get(config, shape, 0))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert loads == [0] and len(got) == 4 and all(g is got[0] for g in got)


def test_kernel_cache_refuses_a_source_other_than_measured():
    """A table entry's kernel source must be the one compiled: otherwise EvotuneError, and nothing is loaded."""
    cache = kernels.KernelCache(lambda *a: pytest.fail("must not load"))
    with pytest.raises(EvotuneError, match="is not the measured 0123456789abcdef"):
        cache.get(load_builtin("attention").default_config(), Shape(1, 8, 512, 512, 64), 0, "0123456789abcdef")
    assert len(cache) == 0


def test_warmup_needs_a_gpu():
    """warmup() on a machine with no CUDA GPU is one clear UsageError."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(UsageError, match="no CUDA GPU"):
        et.warmup()
