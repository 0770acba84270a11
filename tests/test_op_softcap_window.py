"""CPU tests of the op's softcap and window (issue 42): the arguments and their errors, the schema and the fake under
torch.compile, the fallback's numerics against the fp32 reference (softcap, windows with unbounded sides, rows that
see no key, GQA, bshd), its gradients, the routing decision and table key of such a call (a dense entry never serves
it), the kernel cache and launch packet of a Hopper config (NVRTC and the packet on the CPU; no GPU), notices,
cached routes and record_shapes -> tune."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.errors import UsageError  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.attention import SCORE_MOD_PARAMS, TOLERANCE, visibility_mask  # noqa: E402
from evotune.problems.shapes import Shape, parse_shape  # noqa: E402
from evotune.records.tuning_table import read_shapes_file, tune_plan  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402
from evotune.torch import fallback, kernels, routing  # noqa: E402
from evotune.torch.call import Call, new_output  # noqa: E402

from _tables import H100, entry, table  # noqa: E402
from _torch_inputs import fresh_routing, qkv, quiet  # noqa: E402,F401 (fresh_routing: autouse)

F = torch.nn.functional
OP = torch.ops.evotune.attention.default
PROBLEM = get_problem("attention")
# The Hopper kernel (the only one with SOFTCAP / LOCAL), as tests/test_softcap_window.py runs it.
HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}


def hopper_config() -> dict:
    return {**load_builtin("attention").default_config().as_dict(), **HOPPER}


def inputs_of(spec: str, dtype=torch.float32, seed: int = 0, grad: bool = False) -> tuple[Shape, dict]:
    """The gate's inputs of `spec` on the CPU (its layout), cast to `dtype`."""
    shape = parse_shape(spec)
    made = PROBLEM.make_inputs(shape, seed, device="cpu")
    cast = {n: made[n].to(dtype).requires_grad_(grad) for n in "qkv"}
    return shape, {**cast, "scale": made["scale"]}


def call_of(shape: Shape, inputs: dict, told: bool = False):
    """et.attention on the inputs with the shape's mask, cap and window (its notices hidden unless `told`)."""
    window = (shape.window_left, shape.window_right) if shape.has_window else None
    run = et.attention if told else (lambda *a, **kw: quiet(et.attention, *a, **kw))
    return run(inputs["q"], inputs["k"], inputs["v"], is_causal=shape.causal, scale=inputs["scale"],
               enable_gqa=shape.kv_heads != shape.heads, softcap=shape.softcap, window=window)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("kwargs, fault", [
    ({"softcap": -1.0}, "softcap must be a finite number >= 0"),
    ({"softcap": float("nan")}, "softcap must be a finite number >= 0"),
    ({"softcap": "30"}, "softcap must be a number >= 0"),
    ({"softcap": True}, "softcap must be a number >= 0"),
    ({"window": 4}, "window must be None or a pair"),
    ({"window": (4,)}, "window must be None or a pair"),
    ({"window": (4, 0, 1)}, "window must be None or a pair"),
    ({"window": (4.5, 0)}, "window must be None or a pair"),
    ({"window": "40"}, "window must be None or a pair"),
    ({"window": (True, 0)}, "window must be None or a pair"),
    ({"window": (-2, 0)}, "window[0] must be an integer from -1"),
    ({"window": (3, -5)}, "window[1] must be an integer from -1"),
    ({"window": (3, 0), "is_causal": True}, "is_causal with a window needs as many queries as keys (got 16 and 24)"),
])
def test_bad_softcap_or_window_is_one_line(kwargs, fault):
    """A bad softcap or window is one UsageError line naming the fault (the causal rule is the Shape's: Sq == Sk)."""
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(UsageError) as info:
        et.attention(q, k, v, **kwargs)
    assert fault in str(info.value) and str(info.value).startswith("evotune.torch.attention: ")
    assert "\n" not in str(info.value)


def test_good_spellings_are_taken():
    """None and 0 mean no cap, a list or numpy-like integers spell a window; (-1, -1) is no window."""
    q, k, v = qkv(dtype=torch.float32, sq=16, sk=16)
    dense = quiet(et.attention, q, k, v)
    assert torch.equal(quiet(et.attention, q, k, v, softcap=None), dense)
    assert torch.equal(quiet(et.attention, q, k, v, softcap=0, window=(-1, -1)), dense)
    listed = quiet(et.attention, q, k, v, window=[3, 0], is_causal=True)
    assert torch.equal(listed, quiet(et.attention, q, k, v, window=(3, 0)))


def test_direct_op_call_checks_the_mods():
    """The op's schema values are checked too: a negative cap through torch.ops is the same one line, real or fake."""
    q, k, v = qkv(dtype=torch.float32)
    for t in ((q, k, v), tuple(x.to("meta") for x in (q, k, v))):
        with pytest.raises(UsageError, match="softcap must be a finite number"):
            OP(*t, False, None, False, "sdpa", -1.0, -1, -1)
        with pytest.raises(UsageError, match="needs as many queries as keys"):
            OP(*t, True, None, False, "sdpa", 0.0, 4, 0)


@pytest.mark.parametrize("mods", [(5.0, -1, -1), (0.0, 3, 2), (2.5, 4, -1)])
def test_opcheck_with_mods(mods):
    """torch.library.opcheck passes with score mods (schema, fake vs real, AOT dispatch)."""
    q, k, v = qkv(dtype=torch.float32, h=4, kv_heads=2)
    quiet(torch.library.opcheck, OP, (q, k, v, False, None, True, "sdpa", *mods))


def test_fake_gives_the_query_layout_with_mods():
    """The fake implementation gives (B, H, Sq, Dv) in the query's layout for a softcap + window call."""
    q, k, v = (t.to("meta") for t in qkv(layout="bshd", sq=5, sk=7))
    out = OP(q, k, v, False, None, False, "sdpa", 30.0, 2, 0)
    assert out.shape == (2, 4, 5, 64) and out.stride() == new_output(q, v).stride()


def test_torch_compile_fullgraph_traces_the_fallback():
    """torch.compile(fullgraph=True) traces a softcap + window call on the CPU with no break; the graph calls plain
    PyTorch (the fallback, decided while tracing), not the opaque op, and gives the eager fallback's values."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    q, k, v = qkv(layout="bshd", dtype=torch.float32, sq=24, sk=24, h=4, kv_heads=2)
    fn = torch.compile(lambda q, k, v: et.attention(q, k, v, enable_gqa=True, softcap=5.0, window=(6, 0)) * 2,
                       fullgraph=True, backend=backend)
    got = quiet(fn, q, k, v)
    want = fallback.math_attention(q, k, v, softcap=5.0, window=(6, 0)) * 2
    torch.testing.assert_close(got, want)
    assert not any("evotune" in str(n.target) for g in graphs for n in g.graph.nodes)
    torch._dynamo.reset()
    windowed = torch.compile(lambda q, k, v: et.attention(q, k, v, enable_gqa=True, window=(3, 2)), fullgraph=True,
                             backend="aot_eager")
    torch.testing.assert_close(quiet(windowed, q, k, v), fallback.window_sdpa(q, k, v, False, None, True, (3, 2)))


# --------------------------------------------------------------------------- the fallback's numerics


FALLBACK_CASES = [
    "1,4,37,53,64:window=5,3",              # two-sided band, Sq < Sk (bottom-right)
    "1,2,30,20,64:window=3,0",              # Sq > Sk: the first rows see no key (0)
    "1,2,30,20,64:window=-1,2",             # left unbounded; still rows with none
    "1,2,20,31,64:window=4,-1",             # right unbounded
    "2,4,40,64:causal:window=7,0:kv2",      # causal beside a window (Sq == Sk), GQA
    "1,4,33,64:softcap=2.5:kv2",            # a small cap bends the scores
    "1,2,20,31,64:softcap=5:window=-1,4",
    "1,2,24,64:bshd:softcap=30:window=6,-1",
    "1,4,29,64:causal:softcap=4:bshd:kv1",  # MQA
    "1,2,19,23,128:softcap=50",
]


@pytest.mark.parametrize("spec", FALLBACK_CASES)
def test_fallback_matches_the_reference_in_fp32(spec):
    """In fp32 on the CPU the fallback (math for a softcap, SDPA with a window mask otherwise) gives the fp32
    reference's values, rows that see no key 0, in the query's layout."""
    shape, inputs = inputs_of(spec)
    out = call_of(shape, inputs)
    ref = PROBLEM.reference(shape, inputs)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert out.stride() == new_output(inputs["q"], inputs["v"]).stride()
    empty = ~visibility_mask(shape).any(dim=1) if shape.has_window else torch.zeros(shape.seq_q, dtype=torch.bool)
    assert (out[:, :, empty] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("spec", ["2,4,40,64:window=7,0:kv2", "1,2,30,20,64:window=3,1", "1,4,33,64:softcap=30:kv2",
                                  "1,2,24,64:causal:softcap=50:window=9,0:bshd"])
def test_fallback_in_half_precision_passes_the_gate(dtype, spec):
    """In bf16 and fp16 on the CPU the fallback is within the gate's tolerance of the fp32 reference."""
    shape, inputs = inputs_of(spec, dtype)
    out = call_of(shape, inputs)
    assert out.dtype == dtype
    ref = PROBLEM.reference(shape, inputs)
    atol, rtol = TOLERANCE["bf16" if dtype == torch.bfloat16 else "fp16"]
    bound = atol * inputs["v"].float().pow(2).mean().sqrt() + rtol * ref.abs()
    assert bool(((out.float() - ref).abs() <= bound).all()), float((out.float() - ref).abs().max())


@pytest.mark.parametrize("spec", ["1,2,30,20,64:window=3,1", "2,4,24,64:causal:softcap=3:window=5,0:kv2",
                                  "1,2,17,25,64:softcap=4:bshd"])
def test_gradients_are_the_references(spec):
    """Inputs that need grad take the fallback (told), whose gradients are those of the fp32 reference (rows that see
    no key give none and take no NaN into the others)."""
    shape, leaves = inputs_of(spec, grad=True)
    with pytest.warns(et.EvotuneFallbackWarning, match="running PyTorch"):
        out = call_of(shape, leaves, told=True)
    grads = torch.autograd.grad(out.square().sum(), [leaves[n] for n in "qkv"])
    _, twins = inputs_of(spec, grad=True)
    ref = PROBLEM.reference(shape, twins)
    want = torch.autograd.grad(ref.square().sum(), [twins[n] for n in "qkv"])
    for got, expected in zip(grads, want):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_grad_call_with_error_fallback_raises():
    """fallback='error' refuses a softcap call that needs gradients (it cannot run the kernel)."""
    q, k, v = qkv(dtype=torch.float32, grad=True)
    with pytest.raises(UsageError, match="fallback='error'"):
        et.attention(q, k, v, softcap=30.0, fallback="error")


@pytest.mark.parametrize("sq, sk, causal, window", [(6, 6, False, (2, 0)), (9, 13, False, (2, 1)),
                                                    (13, 9, False, (0, 0)), (11, 11, True, (3, 5)),
                                                    (7, 7, True, (-1, -1)), (5, 12, False, (-1, 3))])
def test_window_mask_is_the_references(sq, sk, causal, window):
    """The fallback's mask is the reference's visibility_mask, except rows that see no key, which it lets see every key
    and names as leading rows to zero; a small mask is built once."""
    shape = Shape(1, 1, sq, sk, 64, causal=causal, window_left=window[0], window_right=window[1])
    mask, empty = fallback.window_mask(sq, sk, causal, window, "cpu")
    want = visibility_mask(shape)
    rows = ~want.any(dim=1)
    assert empty == int(rows.sum()) and bool(rows[:empty].all())
    assert torch.equal(mask[~rows], want[~rows]) and bool(mask[rows].all())
    assert fallback.window_mask(sq, sk, causal, window, torch.device("cpu"))[0] is mask


# --------------------------------------------------------------------------- routing and the table


@pytest.fixture
def on_h100(monkeypatch):
    """Device queries answer as an H100 would (the routing logic under test is unchanged)."""
    monkeypatch.setattr(routing, "gpu_identity", lambda index: (H100[0], H100[1], (9, 0)))


def cuda_call(softcap=0.0, window=(-1, -1), causal=False, seq=1000, kv_heads=8) -> Call:
    """A CUDA call on an H100 with these score mods (calls are plain data: no GPU needed)."""
    b, h, d = 2, 8, 64
    strides = (h * seq * d, seq * d, d, 1)
    kv = (kv_heads * seq * d, seq * d, d, 1)
    return Call(b, h, kv_heads, seq, seq, d, d, "bf16", causal, "bhsd", "cuda:0", (strides, kv, kv), softcap, window)


def test_the_key_carries_softcap_and_window_bucket(on_h100):
    """A softcap / window call's decision has a Shape with its cap and window and a key with softcap and its window's
    bucket (the notice names them, and the tune command spells them)."""
    decision = routing.decide(cuda_call(50.0, (255, 0), kv_heads=2))
    assert decision.kind == "missing" and decision.key.softcap and decision.key.window_bucket == 256
    assert (decision.shape.softcap, decision.shape.window_left, decision.shape.window_right) == (50.0, 255, 0)
    assert "softcap window<=256" in decision.notice()
    assert "--shape 2,8,1000,64:bf16:kv2:softcap=50:window=255,0" in decision.notice()
    dense = routing.decide(cuda_call())
    assert not dense.key.softcap and dense.key.window_bucket == 0


def test_a_dense_entry_never_serves_a_softcap_or_window_call(on_h100):
    """With only the dense key's entry (even a Hopper config), softcap, window and both miss; the dense call is tuned."""
    dense = cuda_call()
    et.use_table(table(entry(dense.shape(), hopper_config())))
    assert routing.decide(dense).kind == "tuned"
    for mods in ((30.0, (-1, -1)), (0.0, (127, 0)), (30.0, (127, 0))):
        miss = routing.decide(cuda_call(*mods))
        assert (miss.route, miss.kind, miss.entry) == ("sdpa", "missing", None), mods


def test_an_entry_of_its_key_routes_it_to_the_kernel(on_h100):
    """An entry measured on a softcap + window shape of the call's key routes it to the kernel, with the call's own cap
    and window in the decision's Shape (another cap and window side in the same bucket share the key)."""
    measured = Shape(2, 8, 1000, 1000, 64, "bf16", softcap=30.0, window_left=120, window_right=0)
    et.use_table(table(entry(measured, hopper_config())))
    tuned = routing.decide(cuda_call(50.0, (100, 20)))
    assert (tuned.route, tuned.kind, tuned.match) == ("evotune", "tuned", "exact")
    assert (tuned.shape.softcap, tuned.shape.window_left, tuned.shape.window_right) == (50.0, 100, 20)
    assert routing.decide(cuda_call(50.0, (300, 0))).kind == "missing"  # another window bucket: another key
    assert routing.decide(cuda_call(0.0, (100, 20))).kind == "missing"  # no cap: another key


def test_an_mma_sync_entry_is_not_admitted(on_h100):
    """An entry whose config is the mma.sync kernel's (which has no SOFTCAP) is skipped, named in the reason."""
    measured = Shape(2, 8, 1000, 1000, 64, "bf16", softcap=30.0)
    sync = load_builtin("attention").default_config().as_dict()
    wrong = entry(Shape(2, 8, 1000, 1000, 64, "bf16"), sync)
    from dataclasses import replace

    from evotune.records.tuning_table import TableKey

    et.use_table(table(replace(wrong, key=TableKey.for_shape(measured, *H100), shape=measured.as_dict())))
    miss = routing.decide(cuda_call(30.0))
    assert miss.kind == "missing" and "not admitted" in miss.reason and "Hopper kernel" in miss.reason


def test_explain_names_the_fallback_not_sdpa():
    """explain() of a CPU softcap call says the math fallback runs, and of a window call SDPA with a window mask."""
    q, k, v = qkv(sq=16, sk=16)
    capped = et.explain(q, k, v, softcap=30.0, window=(4, 0))
    assert capped.runs.startswith("PyTorch math attention") and "math attention" in str(capped)
    assert capped.call["softcap"] == 30.0 and capped.call["window"] == [4, 0]
    assert capped.call["shape"] == "2,4,16,64:bf16:softcap=30:window=4,0"
    assert "window mask" in et.explain(q, k, v, window=(4, 0)).runs
    assert et.explain(q, k, v).runs == "PyTorch SDPA"


def test_notice_names_the_fallback_once_per_reason_and_fallback():
    """A CPU softcap call is told once, naming the math fallback (never SDPA, never evotune's kernel), even after a
    dense call told the same reason; fallback='error' refuses it."""
    q, k, v = qkv(sq=16, sk=16)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        et.attention(q, k, v)
        et.attention(q, k, v, softcap=30.0)
        et.attention(q, k, v, softcap=30.0)
        et.attention(q, k, v, softcap=20.0, window=(3, 0))
    said = [str(w.message) for w in told if issubclass(w.category, et.EvotuneFallbackWarning)]
    assert len(said) == 2 and said[0].endswith("running PyTorch SDPA")
    assert "running PyTorch math attention in fp32 (SDPA has no softcap)" in said[1] and "device cpu" in said[1]
    with pytest.raises(UsageError, match="device cpu"):
        et.attention(q, k, v, softcap=30.0, fallback="error")


def test_cached_routes_keep_mods_apart(monkeypatch):
    """A softcap call's second call takes its cached route (one math run, no decision); the dense call of the same
    tensors has a route of its own, and the two answers differ."""
    q, k, v = qkv(dtype=torch.float32, sq=16, sk=16)
    runs = []
    real = fallback.attention
    monkeypatch.setattr(fallback, "attention", lambda *a: runs.append(a[6]) or real(*a))  # a[6]: the mods
    first = quiet(et.attention, q, k, v, softcap=2.0)
    monkeypatch.setattr(routing, "decide", lambda call: pytest.fail("decided again"))
    again = et.attention(q, k, v, softcap=2.0)
    assert torch.equal(first, again) and runs == [(2.0, -1, -1)] * 2
    monkeypatch.undo()
    dense = quiet(et.attention, q, k, v)
    assert len(routing.FAST_ROUTES) == 2 and not torch.allclose(dense, first)
    assert {key[-3:] for key in routing.FAST_ROUTES} == {(2.0, -1, -1), (0.0, -1, -1)}


# --------------------------------------------------------------------------- the kernel: cache and launch packet


def test_kernel_cache_keeps_softcap_and_window_kernels_apart():
    """The SOFTCAP and LOCAL traits change the compiled code (and the entry's parameters): the cache loads a kernel per
    (config, softcap?, window?), and shapes differing only in the cap's value, the window's sides or sizes share one."""
    loads = []

    def loader(compiled, smem, device):
        loads.append(compiled.cubin_path)
        return object()

    cache = kernels.KernelCache(loader)
    config = load_builtin("attention").config(hopper_config())

    def shape(**mods):
        return Shape(1, 8, 512, 512, 64, "bf16", **mods)

    kinds = [cache.get(config, shape(**m), 0) for m in ({}, {"softcap": 30.0}, {"window_left": 64, "window_right": 0},
                                                         {"softcap": 30.0, "window_left": 64, "window_right": 0})]
    assert len({id(k) for k in kinds}) == 4 and len(set(loads)) == 4
    assert cache.get(config, shape(softcap=50.0), 0) is kinds[1]
    assert cache.get(config, Shape(2, 4, 300, 700, 64, "bf16", window_left=-1, window_right=9), 0) is kinds[2]
    assert len(loads) == 4


def test_launch_packet_carries_the_cap_and_the_window(monkeypatch):
    """A PreparedLaunch of a Hopper config on a softcap + window shape ends its parameters with softcap_scale,
    window_left and window_right, and its packet holds scale / C, the clamped sides, and C·log2(e) as scale_log2 (what
    tests/test_softcap_window.py's launches pass); the driver calls are stubbed (no GPU)."""
    from evotune.build import tma
    from evotune.gpu import packet as gpu_packet

    monkeypatch.setattr(tma, "encode_tiled", lambda address, args: bytes(128))
    tma.map_param.cache_clear()
    monkeypatch.setattr(kernels, "_raw_stream", lambda index: 0)
    launched = []
    monkeypatch.setattr(gpu_packet, "launch_packet", lambda *args: launched.append(args[5]))
    config = load_builtin("attention").config(hopper_config())
    shape = Shape(1, 4, 100, 300, 64, "bf16", softcap=30.0, window_left=-1, window_right=5000)
    q, k, v = (t.to(torch.bfloat16) for t in qkv(b=1, h=4, sq=100, sk=300, dtype=torch.float32))
    out = new_output(q, v)
    fake = kernels.LoadedKernel(SimpleNamespace(kernel=SimpleNamespace(ptr=1)), config, 0, "digest", "cubin")
    prepared = kernels.PreparedLaunch(fake, shape, (q.stride(), k.stride(), v.stride()), 0.125, out.stride())
    assert prepared.params[-3:] == SCORE_MOD_PARAMS
    prepared(q, k, v, out)
    (packet,) = launched
    assert packet.slot("softcap_scale").value == pytest.approx(0.125 / 30.0)
    assert (packet.slot("window_left").value, packet.slot("window_right").value) == (300, 100)
    assert packet.slot("scale_log2").value == pytest.approx(30.0 * math.log2(math.e))
    tma.map_param.cache_clear()


# --------------------------------------------------------------------------- record_shapes -> tune


def test_recorded_shapes_keep_softcap_and_window(tmp_path):
    """record_shapes keeps each call's cap and window: its row, its --shape spelling, its key; the saved file reads
    back (read_shapes_file) into shapes that tune plans as softcap / window keys."""
    q, k, v = qkv(b=1, h=4, sq=64, sk=64, dtype=torch.float16, kv_heads=2)
    with et.record_shapes() as rec:
        quiet(et.attention, q, k, v, enable_gqa=True, softcap=50.0, window=(15, 0))
        quiet(et.attention, q, k, v, enable_gqa=True, softcap=50.0, window=(15, 0))
        quiet(et.attention, q, k, v, enable_gqa=True, is_causal=True, softcap=50.0)
        quiet(et.attention, q, k, v, enable_gqa=True, window=(7, 7))
    rows = rec.shapes
    assert [(r.get("softcap"), r.get("window"), r["calls"]) for r in rows] == [(50.0, [15, 0], 2), (50.0, None, 1),
                                                                              (None, [7, 7], 1)]
    specs = rec.specs()
    assert specs == ["1,4,64,64:fp16:kv2:softcap=50:window=15,0", "1,4,64,64:fp16:causal:kv2:softcap=50",
                     "1,4,64,64:fp16:kv2:window=7,7"]
    assert read_shapes_file(rec.save(tmp_path / "shapes.json")) == specs
    shapes, notes = tune_plan(specs)
    assert [s.spec for s in shapes] == specs and not notes
