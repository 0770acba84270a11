"""CPU tests of the op's attention sinks (gpt-oss's s_aux): the argument and its errors, the schema and the fake under
torch.compile, the fallback's numerics against a brute-force softmax with a concatenated sink column (a window row that
sees no key, GQA, bshd, bf16, softcap), its gradients (the sink logits' too), the routing decision and table key of a
sinks call (a dense entry never serves it), the kernel cache and the launch packet's sink pointer (NVRTC and the packet
on the CPU; no GPU), notices, cached routes, the compiled launcher's hand-back and record_shapes -> tune."""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.errors import EvotuneError, UsageError  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.attention import SCORE_MOD_PARAMS, SINK_PARAMS, TOLERANCE  # noqa: E402
from evotune.problems.shapes import Shape, parse_shape  # noqa: E402
from evotune.records.tuning_table import TableKey, read_shapes_file, tune_plan  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402
from evotune.torch import fallback, kernels, launcher, op, routing  # noqa: E402
from evotune.torch.call import Call, new_output  # noqa: E402

from _tables import H100, entry, table  # noqa: E402
from _torch_inputs import fresh_routing, qkv, quiet  # noqa: E402,F401 (fresh_routing: autouse)

OP = torch.ops.evotune.attention.default
PROBLEM = get_problem("attention")
# The Hopper kernel (the only one with SINKS), as tests/test_op_softcap_window.py configures it.
HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}


def hopper_config() -> dict:
    return {**load_builtin("attention").default_config().as_dict(), **HOPPER}


def logits(h: int, seed: int = 7, dtype=torch.float32) -> torch.Tensor:
    """(h,) sink logits around the log-sum-exp of a row of small scores, so some heads' sinks take much of a row's
    mass and others little (the sink's term is then visible in every comparison)."""
    return (torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2.0 + 2.0).to(dtype)


def brute(q, k, v, sinks, *, scale=None, causal=False, window=(-1, -1), softcap=0.0):
    """In float64, written out here: the scores (capped), the causal mask (top-left) and the window (bottom-right) as
    -inf, one more column per row holding the head's sink logit, the softmax over all of it, the sink's column
    dropped, @ V. K/V heads repeated for GQA."""
    q, k, v = (t.detach().double() if not t.requires_grad else t.double() for t in (q, k, v))
    b, h, sq, d = q.shape
    sk = k.shape[2]
    group = h // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * (d ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        seen &= j <= i
    left, right = window
    if left >= 0:
        seen &= j >= i + (sk - sq) - left
    if right >= 0:
        seen &= j <= i + (sk - sq) + right
    s = s.masked_fill(~seen, float("-inf"))
    column = sinks.double().view(1, h, 1, 1).expand(b, h, sq, 1)
    p = torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1]
    return p @ v


def run(q, k, v, sinks, told=False, **kw):
    """et.attention with these sinks (its notices hidden unless `told`)."""
    kw.setdefault("enable_gqa", q.shape[1] != k.shape[1])
    call = et.attention if told else (lambda *a, **x: quiet(et.attention, *a, **x))
    return call(q, k, v, sinks=sinks, **kw)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("sinks, fault", [
    (lambda: [0.0] * 4, "sinks must be None or a (heads,) tensor of per-head sink logits, got list"),
    (lambda: 1.5, "sinks must be None or a (heads,) tensor"),
    (lambda: torch.zeros(4, dtype=torch.long), "sinks must be a floating tensor (the sink logits), got torch.int64"),
    (lambda: torch.zeros(3), "one logit per query head, shape (4,), got (3,)"),
    (lambda: torch.zeros(1, 4), "one logit per query head, shape (4,), got (1, 4)"),
    (lambda: torch.zeros(()), "one logit per query head, shape (4,), got ()"),
    (lambda: torch.zeros(2), "got (2,)"),  # the K/V heads' count is not the query heads'
    (lambda: torch.zeros(4, device="meta"), "sinks is on meta and q on cpu: use one device"),
])
def test_bad_sinks_are_one_line(sinks, fault):
    """Bad sink logits are one UsageError line naming the fault, before anything runs (explain() says the same)."""
    q, k, v = qkv(dtype=torch.float32, h=4, kv_heads=2)
    for call in (et.attention, et.explain):
        with pytest.raises(UsageError) as info:
            call(q, k, v, enable_gqa=True, sinks=sinks())
        said = str(info.value)
        assert fault in said and said.startswith("evotune.torch.attention: ") and "\n" not in said


def test_direct_op_call_checks_the_sinks():
    """The op's schema argument is checked too: wrong-sized sinks through torch.ops are the same one line, real or
    fake (meta)."""
    q, k, v = qkv(dtype=torch.float32)
    for device in ("cpu", "meta"):
        t = tuple(x.to(device) for x in (q, k, v))
        with pytest.raises(UsageError, match=r"one logit per query head, shape \(4,\), got \(5,\)"):
            OP(*t, False, None, False, "sdpa", 0.0, -1, -1, torch.zeros(5, device=device))


def test_schema_keeps_positional_callers():
    """sinks is the schema's last argument, an optional tensor defaulting to None: a positional call of the first ten
    arguments computes as before, and None is a call without sinks."""
    (arg,) = [a for a in OP._schema.arguments if a.name == "sinks"]
    assert OP._schema.arguments[-1] is not None and OP._schema.arguments[-1].name == "sinks"
    assert str(arg.type) == "Optional[Tensor]" and arg.default_value is None and not arg.kwarg_only
    q, k, v = qkv(dtype=torch.float32)
    dense = quiet(OP, q, k, v, False, None, False, "sdpa", 0.0, -1, -1)
    assert torch.equal(quiet(OP, q, k, v, False, None, False, "sdpa", 0.0, -1, -1, None), dense)
    assert torch.equal(quiet(et.attention, q, k, v, sinks=None), dense)


@pytest.mark.parametrize("mods", [(0.0, -1, -1), (5.0, -1, -1), (0.0, 3, 2), (2.5, 4, 0)])
def test_opcheck_with_sinks(mods):
    """torch.library.opcheck passes with sink logits (schema, fake vs real, AOT dispatch)."""
    q, k, v = qkv(dtype=torch.float32, h=4, kv_heads=2)
    quiet(torch.library.opcheck, OP, (q, k, v, False, None, True, "sdpa", *mods, logits(4)))


def test_fake_gives_the_query_layout_with_sinks():
    """The fake implementation gives (B, H, Sq, Dv) in the query's layout for a sinks call (meta tensors)."""
    q, k, v = (t.to("meta") for t in qkv(layout="bshd", sq=5, sk=7))
    out = OP(q, k, v, False, None, False, "sdpa", 0.0, 2, 0, torch.zeros(4, device="meta"))
    assert out.shape == (2, 4, 5, 64) and out.stride() == new_output(q, v).stride()


def test_torch_compile_fullgraph_traces_the_fallback():
    """torch.compile(fullgraph=True) traces a sinks call (bf16 logits, as gpt-oss keeps them) on the CPU with no
    break; the graph calls plain PyTorch (the fallback, decided while tracing), not the opaque op, and gives the eager
    fallback's values."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v = qkv(layout="bshd", dtype=torch.float32, sq=24, sk=24, h=4, kv_heads=2)
    sinks = logits(4, dtype=torch.bfloat16)
    try:
        fn = torch.compile(lambda q, k, v, s: et.attention(q, k, v, enable_gqa=True, window=(6, 0), sinks=s) * 2,
                           fullgraph=True, backend=backend)
        got = quiet(fn, q, k, v, sinks)
        assert not any("evotune" in str(n.target) for g in graphs for n in g.graph.nodes)
        torch.testing.assert_close(got, fallback.math_attention(q, k, v, window=(6, 0), sinks=sinks) * 2)
        torch.testing.assert_close(got, brute(q, k, v, sinks, window=(6, 0)).float() * 2, atol=2e-5, rtol=1e-4)
        torch._dynamo.reset()
        aot = torch.compile(lambda q, k, v, s: et.attention(q, k, v, enable_gqa=True, is_causal=True, sinks=s),
                            fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(quiet(aot, q, k, v, sinks), brute(q, k, v, sinks, causal=True).float(),
                                   atol=2e-5, rtol=1e-4)
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------- the fallback's numerics


FALLBACK_CASES = [
    # (b, h, kv_heads, sq, sk, d, layout, kwargs)
    (2, 4, 4, 16, 24, 64, "bhsd", {}),
    (1, 4, 4, 33, 33, 64, "bhsd", {"is_causal": True}),
    (1, 4, 2, 37, 53, 64, "bhsd", {"window": (5, 3)}),              # two-sided band, Sq < Sk (bottom-right)
    (1, 2, 2, 30, 20, 64, "bhsd", {"window": (3, 0)}),              # Sq > Sk: the first rows see no key (0)
    (1, 2, 1, 20, 31, 64, "bshd", {"window": (-1, 2)}),             # MQA, a projection's layout
    (2, 8, 2, 40, 40, 64, "bshd", {"is_causal": True, "window": (7, 0)}),  # GQA beside a window
    (1, 4, 2, 29, 29, 128, "bhsd", {"softcap": 4.0, "is_causal": True}),   # the sink beside a cap (capped units)
    (1, 2, 2, 19, 23, 64, "bshd", {"softcap": 5.0, "window": (-1, 4), "scale": 0.3}),
]


@pytest.mark.parametrize("b, h, kv, sq, sk, d, layout, kw", FALLBACK_CASES)
def test_fallback_matches_a_brute_force_sink_column(b, h, kv, sq, sk, d, layout, kw):
    """In fp32 on the CPU the fallback is softmax([scores, sink]) without the sink's column, @ V (brute force, in
    float64), in the query's layout; rows that see no key are 0, and every row's weights sum to less than 1."""
    q, k, v = qkv(b=b, h=h, kv_heads=kv, sq=sq, sk=sk, d=d, layout=layout, dtype=torch.float32)
    sinks = logits(h)
    out = run(q, k, v, sinks, **kw)
    window = kw.get("window", (-1, -1))
    want = brute(q, k, v, sinks, scale=kw.get("scale"), causal=kw.get("is_causal", False), window=window,
                 softcap=kw.get("softcap", 0.0))
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
    assert out.stride() == new_output(q, v).stride() and torch.isfinite(out).all()
    # The sink changes the answer: the same call without it is SDPA's normalisation, a different result.
    assert (quiet(et.attention, q, k, v, **{**kw, "enable_gqa": h != kv}) - out).abs().max() > 1e-3
    empty = sq - sk - window[1] if window[1] >= 0 else 0
    if empty > 0:
        assert (out[:, :, :empty] == 0).all() and (out[:, :, empty:].abs().sum(-1) > 0).all()


def test_the_reference_and_the_fallback_agree():
    """The gate's fp32 reference (problems.attention's sink column) and the op's fallback compute the same thing on
    the gate's own inputs and sink logits (make_inputs), including a window whose first rows see no key."""
    for spec in ("1,4,30,20,64:window=3,0:kv2:sinks", "2,4,48,64:causal:softcap=30:sinks:bshd"):
        shape = parse_shape(spec)
        made = PROBLEM.make_inputs(shape, 0, device="cpu")
        q, k, v = (made[n].float() for n in "qkv")
        window = (shape.window_left, shape.window_right) if shape.has_window else None
        out = quiet(et.attention, q, k, v, is_causal=shape.causal, scale=made["scale"], softcap=shape.softcap,
                    window=window, enable_gqa=shape.kv_heads != shape.heads, sinks=made["sinks"])
        ref = PROBLEM.reference(shape, {"q": q, "k": k, "v": v, "scale": made["scale"], "sinks": made["sinks"]})
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sink_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["2,4,40,64:window=7,0:kv2:sinks", "1,2,30,20,64:window=3,1:sinks",
                                  "1,4,33,64:causal:softcap=30:kv2:sinks:bshd"])
def test_fallback_in_half_precision_passes_the_gate(dtype, sink_dtype, spec):
    """In bf16 and fp16 on the CPU, with float32 or bf16 (gpt-oss's) sink logits, the fallback is within the gate's
    tolerance of the fp32 reference, in q's dtype."""
    shape = parse_shape(spec)
    made = PROBLEM.make_inputs(shape, 1, device="cpu")
    q, k, v = (made[n].to(dtype) for n in "qkv")
    sinks = made["sinks"].to(sink_dtype)
    window = (shape.window_left, shape.window_right) if shape.has_window else None
    out = quiet(et.attention, q, k, v, is_causal=shape.causal, softcap=shape.softcap, window=window,
                enable_gqa=shape.kv_heads != shape.heads, sinks=sinks)
    assert out.dtype == dtype
    ref = PROBLEM.reference(shape, {"q": q.float(), "k": k.float(), "v": v.float(), "scale": made["scale"],
                                    "sinks": sinks.float()})
    atol, rtol = TOLERANCE["bf16" if dtype == torch.bfloat16 else "fp16"]
    bound = atol * v.float().pow(2).mean().sqrt() + rtol * ref.abs()
    assert bool(((out.float() - ref).abs() <= bound).all()), float((out.float() - ref).abs().max())


def test_a_masked_row_is_zero_beside_a_sink():
    """math_attention with a caller's mask that hides every key of a row gives 0 there with sinks (the sink takes the
    whole row), the other rows the brute force's, in boolean and additive spellings of the mask."""
    q, k, v = qkv(b=1, h=2, sq=6, sk=6, dtype=torch.float32)
    sinks = logits(2)
    seen = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    seen[..., 2, :] = False
    for mask in (seen, torch.zeros(seen.shape).masked_fill(~seen, torch.finfo(torch.float32).min)):
        out = fallback.math_attention(q, k, v, mask=mask, sinks=sinks)
        assert (out[:, :, 2] == 0).all()
        want = brute(q, k, v, sinks, causal=True)
        rows = [0, 1, 3, 4, 5]
        torch.testing.assert_close(out[:, :, rows].double(), want[:, :, rows], atol=2e-5, rtol=1e-4)


def test_fallback_chunks_heads_with_their_own_sinks(monkeypatch):
    """With the scores' budget forcing one head per chunk, each chunk takes its own heads' sink logits: the same
    answer as one chunk."""
    q, k, v = qkv(b=1, h=4, kv_heads=2, sq=12, sk=12, dtype=torch.float32)
    sinks = logits(4)
    whole = fallback.math_attention(q, k, v, sinks=sinks)
    monkeypatch.setattr(fallback, "MAX_SCORES", 12 * 12)
    torch.testing.assert_close(fallback.math_attention(q, k, v, sinks=sinks), whole, rtol=0, atol=0)
    torch.testing.assert_close(whole.double(), brute(q, k, v, sinks), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kw", [{"window": (3, 1)}, {"is_causal": True, "softcap": 3.0}, {}])
def test_gradients_are_the_brute_forces(kw):
    """Inputs that need grad, sink logits included, take the fallback (told), whose gradients in q, k, v and the
    sinks are those of the brute force (a window's rows that see no key give none and take no NaN in)."""
    sq, sk = (30, 20) if "window" in kw else (17, 17)
    leaves = [t.requires_grad_(True) for t in qkv(b=1, h=4, kv_heads=2, sq=sq, sk=sk, dtype=torch.float32)]
    sinks = logits(4).requires_grad_(True)
    with pytest.warns(et.EvotuneFallbackWarning, match="running PyTorch math attention in fp32 with a sink column"):
        out = run(*leaves, sinks, told=True, **kw)
    got = torch.autograd.grad(out.square().sum(), [*leaves, sinks])
    twins = [t.detach().double().requires_grad_(True) for t in (*leaves, sinks)]
    ref = brute(*twins[:3], twins[3], causal=kw.get("is_causal", False), window=kw.get("window", (-1, -1)),
                softcap=kw.get("softcap", 0.0))
    want = torch.autograd.grad(ref.square().sum(), twins)
    for name, g, w in zip(("q", "k", "v", "sinks"), got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.double(), w, atol=1e-4, rtol=1e-4, msg=name)
    assert want[3].abs().max() > 1e-3  # the sinks' gradient is there to compare


def test_a_parameter_sink_needs_grad_only_in_grad_mode():
    """A module's sinks Parameter (requires_grad) with q, k, v that need none: in grad mode the call is a training
    call (the fallback, the Parameter gets its gradient); under no_grad it is an inference call whose route is then
    cached (the second call decides nothing)."""
    q, k, v = qkv(dtype=torch.float32, sq=12, sk=12)
    sinks = torch.nn.Parameter(logits(4))
    out = run(q, k, v, sinks)
    assert out.requires_grad
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().max() > 0
    with torch.no_grad():
        first = run(q, k, v, sinks)
    assert not first.requires_grad
    facts = [key for key in routing.FAST_ROUTES if len(key) == 20]
    assert facts == [op._facts(q, k, v, False, None, False, "sdpa", (0.0, -1, -1), sinks)]
    decided = routing.decide
    try:
        routing.decide = lambda call: pytest.fail("decided again")
        with torch.no_grad():
            again = et.attention(q, k, v, sinks=sinks)
    finally:
        routing.decide = decided
    assert torch.equal(first, again)


def test_grad_call_with_error_fallback_raises():
    """fallback='error' refuses a sinks call that needs gradients (it cannot run the kernel)."""
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(UsageError, match="fallback='error'"):
        et.attention(q, k, v, sinks=logits(4).requires_grad_(True), fallback="error")


# --------------------------------------------------------------------------- routing and the table


@pytest.fixture
def on_h100(monkeypatch):
    """Device queries answer as an H100 would (the routing logic under test is unchanged)."""
    monkeypatch.setattr(routing, "gpu_identity", lambda index: (H100[0], H100[1], (9, 0)))


def cuda_call(sinks=True, softcap=0.0, window=(-1, -1), causal=False, seq=1000, kv_heads=8) -> Call:
    """A CUDA call on an H100 (calls are plain data: no GPU needed)."""
    b, h, d = 2, 8, 64
    strides = (h * seq * d, seq * d, d, 1)
    kv = (kv_heads * seq * d, seq * d, d, 1)
    return Call(b, h, kv_heads, seq, seq, d, d, "bf16", causal, "bhsd", "cuda:0", (strides, kv, kv), softcap, window,
                sinks)


def test_the_key_carries_sinks(on_h100):
    """A sinks call's decision has a Shape with sinks and a key with the sinks field (the notice names it, and the
    tune command spells :sinks); a call without sinks has neither."""
    decision = routing.decide(cuda_call(kv_heads=2, window=(127, 0)))
    assert decision.kind == "missing" and decision.key.sinks and decision.shape.sinks
    assert decision.key.as_dict()["sinks"] is True and decision.key.window_bucket == 128
    assert "sinks" in decision.key.spec() and "sinks" in decision.notice()
    assert "--shape 2,8,1000,64:bf16:kv2:window=127,0:sinks" in decision.notice()
    dense = routing.decide(cuda_call(sinks=False))
    assert not dense.key.sinks and "sinks" not in dense.key.as_dict() and not dense.shape.sinks
    assert cuda_call().as_dict()["sinks"] is True and "sinks" not in cuda_call(sinks=False).as_dict()


def test_no_other_entry_serves_a_sinks_call(on_h100):
    """With the dense key's and the window key's entries (Hopper configs), the sinks calls of those sizes miss; the
    calls without sinks are tuned."""
    et.use_table(table(entry(cuda_call(sinks=False).shape(), hopper_config()),
                       entry(cuda_call(sinks=False, window=(127, 0)).shape(), hopper_config())))
    assert routing.decide(cuda_call(sinks=False)).kind == "tuned"
    assert routing.decide(cuda_call(sinks=False, window=(127, 0))).kind == "tuned"
    for call in (cuda_call(), cuda_call(window=(127, 0))):
        miss = routing.decide(call)
        assert (miss.route, miss.kind, miss.entry) == ("sdpa", "missing", None), call


def test_an_entry_of_its_key_routes_it_to_the_kernel(on_h100):
    """An entry measured on a sinks shape of the call's key routes it to the kernel, the decision's Shape with sinks
    (what the kernel cache and the launch packet read); the same sizes without sinks miss."""
    measured = Shape(2, 8, 1000, 1000, 64, "bf16", sinks=True)
    et.use_table(table(entry(measured, hopper_config())))
    tuned = routing.decide(cuda_call())
    assert (tuned.route, tuned.kind, tuned.match) == ("evotune", "tuned", "exact") and tuned.shape.sinks
    assert routing.decide(cuda_call(sinks=False)).kind == "missing"


def test_an_mma_sync_entry_is_not_admitted(on_h100):
    """An entry whose config is the mma.sync kernel's (which has no SINKS) is skipped, named in the reason."""
    measured = Shape(2, 8, 1000, 1000, 64, "bf16", sinks=True)
    sync = load_builtin("attention").default_config().as_dict()
    wrong = entry(Shape(2, 8, 1000, 1000, 64, "bf16"), sync)
    et.use_table(table(replace(wrong, key=TableKey.for_shape(measured, *H100), shape=measured.as_dict())))
    miss = routing.decide(cuda_call())
    assert miss.kind == "missing" and "not admitted" in miss.reason


def test_explain_names_the_fallback_not_sdpa():
    """explain() of a CPU sinks call says the math fallback with the sink column runs; its call and spec carry
    sinks."""
    q, k, v = qkv(sq=16, sk=16)
    info = et.explain(q, k, v, is_causal=True, sinks=logits(4))
    assert info.runs == "PyTorch math attention in fp32 with a sink column (SDPA has no attention sinks)"
    assert "sink column" in str(info) and info.call["sinks"] is True
    assert info.call["shape"] == "2,4,16,64:bf16:causal:sinks"
    assert "sinks" not in et.explain(q, k, v).call and et.explain(q, k, v).runs == "PyTorch SDPA"


def test_notice_names_the_fallback_once_per_reason_and_fallback():
    """A CPU sinks call is told once, naming the math fallback with the sink column (never SDPA, never evotune's
    kernel), apart from a dense and a softcap call of the same reason; fallback='error' refuses it."""
    q, k, v = qkv(sq=16, sk=16)
    sinks = logits(4)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        et.attention(q, k, v)
        et.attention(q, k, v, sinks=sinks)
        et.attention(q, k, v, sinks=sinks)
        et.attention(q, k, v, sinks=sinks, window=(3, 0), softcap=20.0)
        et.attention(q, k, v, softcap=20.0)
    said = [str(w.message) for w in told if issubclass(w.category, et.EvotuneFallbackWarning)]
    assert len(said) == 3 and said[0].endswith("running PyTorch SDPA")
    assert said[1].endswith("running PyTorch math attention in fp32 with a sink column (SDPA has no attention sinks)")
    assert "device cpu" in said[1] and said[2].endswith("(SDPA has no softcap)")
    with pytest.raises(UsageError, match="device cpu.*fallback='error'"):
        et.attention(q, k, v, sinks=sinks, fallback="error")


def test_cached_routes_take_each_calls_logits(monkeypatch):
    """A sinks call's second call takes its cached route (no decision), reading the logits it is given (new values
    give the new answer; another dtype is another route); the dense call of the same tensors keeps a route of its own,
    one key shorter."""
    q, k, v = qkv(dtype=torch.float32, sq=16, sk=16)
    one, two = logits(4, seed=1), logits(4, seed=2)
    first = run(q, k, v, one)
    monkeypatch.setattr(routing, "decide", lambda call: pytest.fail("decided again"))
    assert torch.equal(et.attention(q, k, v, sinks=one), first)
    again = et.attention(q, k, v, sinks=two)
    torch.testing.assert_close(again.double(), brute(q, k, v, two), atol=2e-5, rtol=1e-4)
    assert not torch.allclose(again, first)
    monkeypatch.undo()
    run(q, k, v, two.to(torch.bfloat16))
    dense = quiet(et.attention, q, k, v)
    lengths = sorted(len(key) for key in routing.FAST_ROUTES)
    assert lengths == [19, 20, 20] and not torch.allclose(dense, first)
    assert {key[-1][1] for key in routing.FAST_ROUTES if len(key) == 20} == {torch.float32, torch.bfloat16}


def test_the_compiled_launcher_never_takes_a_sinks_call(monkeypatch):
    """With the compiled launcher active, a sinks call never goes to its C++ entries (whose call key has no sinks: they
    would hand the call back anyway) and no sinks route registers with it; the call's own route runs."""
    q, k, v = qkv(dtype=torch.float32, sq=16, sk=16)
    sinks = logits(4)
    first = run(q, k, v, sinks)  # a route exists, so the fast path is taken
    monkeypatch.setattr(launcher, "ACTIVE", [True])
    monkeypatch.setattr(launcher, "CALL", [lambda *a: pytest.fail("sent to the compiled launcher")])
    monkeypatch.setattr(op, "_DISPATCH", lambda *a: pytest.fail("sent to the compiled launcher"))
    monkeypatch.setattr(launcher, "register", lambda *a: pytest.fail("registered with the launcher"))
    assert torch.equal(et.attention(q, k, v, sinks=sinks), first)
    assert torch.equal(op.eager_attention(q, k, v, False, None, False, sinks=sinks), first)


# --------------------------------------------------------------------------- the kernel: cache and launch packet


def test_kernel_cache_keeps_sinks_kernels_apart():
    """The SINKS trait changes the compiled code (and the entry's parameters): the cache loads a kernel per (config,
    sinks?), beside softcap and window; shapes differing only in sizes share one."""
    loads = []

    def loader(compiled, smem, device):
        loads.append(compiled.cubin_path)
        return object()

    cache = kernels.KernelCache(loader)
    config = load_builtin("attention").config(hopper_config())
    dense = cache.get(config, Shape(1, 8, 512, 512, 64, "bf16"), 0)
    sinks = cache.get(config, Shape(1, 8, 512, 512, 64, "bf16", sinks=True), 0)
    both = cache.get(config, Shape(1, 8, 512, 512, 64, "bf16", window_left=64, window_right=0, sinks=True), 0)
    window = cache.get(config, Shape(1, 8, 512, 512, 64, "bf16", window_left=64, window_right=0), 0)
    assert len({id(x) for x in (dense, sinks, both, window)}) == 4 and len(set(loads)) == 4
    assert cache.get(config, Shape(2, 4, 300, 700, 64, "bf16", sinks=True), 0) is sinks
    assert len(loads) == 4


@pytest.fixture
def stub_driver(monkeypatch):
    """The driver calls stubbed (no GPU): tensor maps encode to zeros, the stream is 0, and each launch records its
    packet and the float32 values its sinks pointer reads at launch time (the logits are CPU memory here)."""
    from evotune.build import tma
    from evotune.gpu import packet as gpu_packet

    monkeypatch.setattr(tma, "encode_tiled", lambda address, args: bytes(128))
    tma.map_param.cache_clear()
    monkeypatch.setattr(kernels, "_raw_stream", lambda index: 0)
    launched = []

    def record(function, grid, block, smem, stream, packet, pdl=False):
        pointer = packet.slot("sinks").value
        launched.append((packet, pointer, list((ctypes.c_float * 4).from_address(pointer))))

    monkeypatch.setattr(gpu_packet, "launch_packet", record)
    yield launched
    tma.map_param.cache_clear()


def test_launch_packet_ends_with_the_sink_pointer(stub_driver):
    """A PreparedLaunch of a Hopper config on a sinks shape ends its parameters with the score mods' values and the
    sinks pointer; each launch points at the logits it is given (a second tensor rewrites the slot), and a launch
    without them is refused (the kernel would read a null pointer)."""
    config = load_builtin("attention").config(hopper_config())
    shape = Shape(1, 4, 100, 300, 64, "bf16", window_left=31, window_right=0, sinks=True)
    q, k, v = qkv(b=1, h=4, sq=100, sk=300)
    out = new_output(q, v)
    fake = kernels.LoadedKernel(SimpleNamespace(kernel=SimpleNamespace(ptr=1)), config, 0, "digest", "cubin")
    prepared = kernels.PreparedLaunch(fake, shape, (q.stride(), k.stride(), v.stride()), 0.125, out.stride())
    assert prepared.params[-4:] == SCORE_MOD_PARAMS + SINK_PARAMS
    one, two = logits(4, seed=1), logits(4, seed=2)
    prepared(q, k, v, out, sinks=one)
    prepared(q, k, v, out, sinks=two)
    (p1, a1, v1), (p2, a2, v2) = stub_driver
    assert p1 is p2 and (a1, a2) == (one.data_ptr(), two.data_ptr())
    assert v1 == one.tolist() and v2 == two.tolist()
    assert (p1.slot("window_left").value, p1.slot("window_right").value) == (31, 0)
    with pytest.raises(EvotuneError, match="without its sink logits"):
        prepared(q, k, v, out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_route_converts_the_logits_per_call(stub_driver, monkeypatch, dtype):
    """The op's cached kernel route of a sinks call (its decision forced to a tuned Hopper entry: no GPU) launches with
    the call's logits as contiguous float32: the caller's tensor itself where it is that already, else a conversion
    made for the call (bf16, fp16, a strided view), whose values the kernel's pointer reads."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    shape = Shape(2, 4, 16, 24, 64, "bf16", sinks=True)
    q, k, v = qkv()
    call = replace(Call.of(q, k, v, False, sinks=True), device="cuda:0")
    config = load_builtin("attention").config(hopper_config())
    decision = routing.Decision("evotune", "tuned", "forced", call, TableKey.for_shape(shape, *H100), shape,
                                entry(shape, hopper_config()), "exact", config)
    fake = kernels.LoadedKernel(SimpleNamespace(kernel=SimpleNamespace(ptr=1)), config, 0, "digest", "cubin")
    monkeypatch.setattr(op, "load_for", lambda decision, write_lse=False: fake)
    route = op._kernel_route(decision, q, k, v, False, None, False, "sdpa", (0.0, -1, -1), True)
    wide = logits(8, seed=3).to(dtype)
    for sinks in (logits(4, seed=4).to(dtype), wide[::2]):
        out = route(q, k, v, sinks)
        assert out.shape == (2, 4, 16, 64) and out.stride() == new_output(q, v).stride()
        _, pointer, read = stub_driver[-1]
        assert read == sinks.float().tolist()
        plain = dtype == torch.float32 and sinks.is_contiguous()
        assert (pointer == sinks.data_ptr()) == plain
    assert len(stub_driver) == 2
    assert op.kernel_sinks(None) is None


# --------------------------------------------------------------------------- record_shapes -> tune


def test_recorded_shapes_keep_sinks(tmp_path):
    """record_shapes keeps each call's sinks: its row, its --shape spelling (:sinks), its key; the saved file reads
    back (read_shapes_file) into shapes that tune plans as sinks keys."""
    q, k, v = qkv(b=1, h=4, sq=64, sk=64, dtype=torch.float16, kv_heads=2)
    sinks = logits(4, dtype=torch.bfloat16)
    with et.record_shapes() as rec:
        run(q, k, v, sinks, window=(15, 0))
        run(q, k, v, sinks, window=(15, 0))
        run(q, k, v, sinks, is_causal=True)
        quiet(et.attention, q, k, v, enable_gqa=True, is_causal=True)
    rows = rec.shapes
    assert [(r.get("sinks"), r.get("window"), r["calls"]) for r in rows] == [(True, [15, 0], 2), (True, None, 1),
                                                                             (None, None, 1)]
    assert rows[0]["key"] is None and rows[0]["route"] == "sdpa"  # the CPU: no GPU to key by
    specs = rec.specs()
    assert specs == ["1,4,64,64:fp16:kv2:window=15,0:sinks", "1,4,64,64:fp16:causal:kv2:sinks",
                     "1,4,64,64:fp16:causal:kv2"]
    assert read_shapes_file(rec.save(tmp_path / "shapes.json")) == specs
    shapes, notes = tune_plan(specs)
    assert [s.spec for s in shapes] == specs and [s.sinks for s in shapes] == [True, True, False] and not notes
