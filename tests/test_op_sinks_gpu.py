"""GPU tests of evotune.torch.attention's attention sinks (gpt-oss's s_aux): with a tuning table that routes a sinks key
to a Hopper config, the op runs evotune's kernel (its decision, and a count of the kernel launches it made) within the
gate's tolerance of the fp32 reference (its sink column), with float32 and bf16 logits, eagerly and from its cached
route, into NaN-poisoned output, in a CUDA graph and under torch.compile; a dense entry never serves a sinks call, and
a sinks call with no entry runs the fallback, told; a call needing gradients takes the fallback; and a tiny gpt-oss-like
model whose every attention call runs the kernel once a table built from its recorded shapes covers them."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.errors import UsageError  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.attention import TOLERANCE, sink_logits, visibility_mask  # noqa: E402
from evotune.problems.shapes import Shape, parse_shape  # noqa: E402
from evotune.torch import hf, op  # noqa: E402

from _tables import table  # noqa: E402
from test_torch_gpu import gpu, make_qkv  # noqa: E402,F401 (gpu: the sm_90 fixture)
# The softcap/window op tests' table and launch fixtures (python_launches: autouse), the same for sinks calls.
from test_op_softcap_window_gpu import CONFIGS, launches, python_launches, tune_table  # noqa: E402,F401

pytestmark = pytest.mark.gpu

# The Hopper kernel's configs (the only kernel with SINKS): one tile per CTA, and the persistent grid.
CASES = [
    "2,8,300,64:bf16:sinks",                              # no mask: the sink beside every key
    "2,8,300,64:fp16:causal:sinks",
    "1,16,1000,64:bf16:causal:kv2:sinks",                 # gpt-oss's full layer (head dim 64, 8 query heads a K/V head)
    "2,16,513,64:bf16:window=127,0:kv2:sinks:bshd",       # gpt-oss's sliding layer (128 keys), a projection's layout
    "2,8,333,197,64:bf16:window=-1,32:sinks",             # Sq > Sk: leading rows see no key (0)
    "2,8,256,128:bf16:causal:softcap=50:sinks",           # the sink in capped units
    "4,64,1,1000,64:bf16:kv8:sinks",                      # a gpt-oss decode step through the op (one query)
]
# The persistent grid needs more query tiles than SMs (the space refuses it otherwise).
PERSISTENT_CASES = [
    "4,20,1000,64:bf16:window=128,0:kv4:sinks",
    "2,40,1000,64:bf16:causal:kv8:sinks",                 # causal: tiles handed out by a counter
]


def sinks_of(shape: Shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The gate's sink logits for `shape` (problems.attention.sink_logits: some heads' sinks take most of a row, some
    almost none), in `dtype` (gpt-oss keeps them in the model's)."""
    return sink_logits(shape, torch.Generator(device="cuda").manual_seed(seed), "cuda").to(dtype)


def kwargs_of(shape: Shape, sinks) -> dict:
    return {"is_causal": shape.causal, "enable_gqa": shape.kv_heads != shape.heads, "softcap": shape.softcap,
            "window": (shape.window_left, shape.window_right) if shape.has_window else None, "sinks": sinks}


def assert_close(out, q, k, v, sinks, shape: Shape) -> None:
    """The family's gate: |out - ref| <= atol * rms(V) + rtol * |ref| against its fp32 reference with the sink column
    (the logits as the kernel reads them, float32)."""
    ref = get_problem("attention").reference(shape, {"q": q, "k": k, "v": v, "scale": shape.head_dim ** -0.5,
                                                     "sinks": sinks.float()})
    atol, rtol = TOLERANCE[shape.dtype]
    bound = atol * v.float().pow(2).mean().sqrt() + rtol * ref.abs()
    err = (out.float() - ref).abs()
    assert torch.isfinite(out).all() and bool((err <= bound).all()), f"max error {err.max().item():.3g} on {shape.spec}"


def run_on_kernel(q, k, v, sinks, shape: Shape, launches) -> torch.Tensor:
    """The op on our kernel: explain says tuned, no fallback notice, fallback='error', exactly one kernel launch."""
    info = et.explain(q, k, v, **kwargs_of(shape, sinks))
    assert (info.route, info.kind, info.runs) == ("evotune", "tuned", "evotune kernel"), str(info)
    before = launches[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        out = et.attention(q, k, v, fallback="error", **kwargs_of(shape, sinks))
    assert launches[0] == before + 1
    return out


@pytest.mark.parametrize("spec, config", [(s, "onetile") for s in CASES] + [(s, "persistent") for s in PERSISTENT_CASES])
def test_kernel_runs_sinks_calls(gpu, launches, spec, config):
    """A sinks key the table routes to a Hopper config runs our kernel (a launch per call, first and cached, with float32
    logits and with bf16 ones converted per call) and passes the gate against the fp32 reference, rows that see no key 0, in the query's layout."""
    shape = parse_shape(spec)
    tune_table(gpu, [shape], CONFIGS[config])
    for seed, dtype in ((0, torch.float32), (1, torch.float32), (2, torch.bfloat16), (3, torch.bfloat16)):
        q, k, v = make_qkv(shape, seed=seed, kv_heads=shape.kv_heads)
        sinks = sinks_of(shape, seed, dtype)
        out = run_on_kernel(q, k, v, sinks, shape, launches)
        torch.cuda.synchronize()
        assert_close(out, q, k, v, sinks, shape)
        assert (out.stride(1) < out.stride(2)) == (shape.layout == "bshd")
        if shape.has_window:
            empty = ~visibility_mask(shape, out.device).any(dim=1)
            assert (out[:, :, empty] == 0).all()


def test_poisoned_output_is_written_whole(gpu, launches, monkeypatch):
    """The kernel writes every element of the output: a first call into a NaN-filled output (the op's allocation
    poisoned) and a cached call whose allocation reuses a freed NaN-filled block both pass the gate, finite."""
    shape = parse_shape("2,16,513,64:bf16:window=127,0:kv2:sinks")
    tune_table(gpu, [shape])
    q, k, v = make_qkv(shape, seed=3, kv_heads=shape.kv_heads)
    sinks = sinks_of(shape, 3)
    real = op.new_output
    monkeypatch.setattr(op, "new_output", lambda q, v: real(q, v).fill_(float("nan")))
    first = run_on_kernel(q, k, v, sinks, shape, launches)
    monkeypatch.setattr(op, "new_output", real)  # not undo(): that would take the launch count's patch too
    torch.cuda.synchronize()
    assert_close(first, q, k, v, sinks, shape)
    size = first.shape
    del first
    poison = torch.full(size, float("nan"), dtype=q.dtype, device="cuda")
    del poison  # the caching allocator hands this block to the next allocation of its size on this stream
    again = run_on_kernel(q, k, v, sinks, shape, launches)
    torch.cuda.synchronize()
    assert_close(again, q, k, v, sinks, shape)


def test_dense_and_window_entries_do_not_run_a_sinks_call(gpu, launches):
    """With only the dense and the window keys' entries, the sinks calls of those sizes miss (told, naming the key and
    the tune command with :sinks) and run the fallback: no kernel launch, within the gate; the calls without sinks
    launch."""
    dense = Shape(2, 8, 512, 512, 64, "bf16", True)
    window = Shape(2, 8, 512, 512, 64, "bf16", window_left=127, window_right=0)
    tune_table(gpu, [dense, window])
    for plain in (dense, window):
        sunk = Shape.from_dict({**plain.as_dict(), "sinks": True})
        q, k, v = make_qkv(sunk)
        sinks = sinks_of(sunk, 4)
        assert et.explain(q, k, v, **kwargs_of(sunk, sinks)).kind == "missing"
        with pytest.warns(et.EvotuneFallbackWarning, match=r":sinks.*running PyTorch math attention in fp32 with a "
                                                           r"sink column"):
            out = et.attention(q, k, v, **kwargs_of(sunk, sinks))
        torch.cuda.synchronize()
        assert launches[0] == 0
        assert_close(out, q, k, v, sinks, sunk)
    for plain in (dense, window):
        q, k, v = make_qkv(plain)
        info = et.explain(q, k, v, **kwargs_of(plain, None))
        assert info.kind == "tuned", str(info)


@pytest.mark.parametrize("spec", ["1,16,1000,64:bf16:causal:kv2:sinks", "2,8,333,197,64:fp16:window=-1,32:sinks"])
def test_no_entry_runs_the_fallback_told(gpu, launches, spec):
    """With no table entry a sinks call runs the fallback (fp32 math with the sink column, on the GPU), told once with
    the key and the tune command, never as evotune's kernel; no launch; within the gate; fallback='error' refuses it."""
    shape = parse_shape(spec)
    et.use_table(table())
    q, k, v = make_qkv(shape, kv_heads=shape.kv_heads)
    sinks = sinks_of(shape, 5, torch.bfloat16)
    info = et.explain(q, k, v, **kwargs_of(shape, sinks))
    assert info.route == "sdpa" and info.runs.startswith("PyTorch math attention in fp32 with a sink column")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = et.attention(q, k, v, **kwargs_of(shape, sinks))
        et.attention(q, k, v, **kwargs_of(shape, sinks))
    told = [str(w.message) for w in caught if issubclass(w.category, et.EvotuneFallbackWarning)]
    assert len(told) == 1 and f"evotune tune --shape {shape.spec}" in told[0] and "sink column" in told[0]
    torch.cuda.synchronize()
    assert launches[0] == 0
    assert_close(out, q, k, v, sinks, shape)
    with pytest.raises(UsageError, match="fallback='error'"):
        et.attention(q, k, v, fallback="error", **kwargs_of(shape, sinks))


def test_graph_capture_and_compile(gpu, launches):
    """After warmup() a sinks call with bf16 logits (their float32 conversion captured with the launch) captures into a
    CUDA graph and replays on new inputs and new logit values; torch.compile(fullgraph=True) calls the op, whose body
    launches the kernel."""
    shape = Shape(2, 8, 384, 384, 64, "bf16", False, "bshd", window_left=127, window_right=0, sinks=True)
    tune_table(gpu, [shape])
    assert all(r["status"] == "loaded" for r in et.warmup())
    q, k, v = make_qkv(shape, seed=6)
    sinks = sinks_of(shape, 6, torch.bfloat16)
    run_on_kernel(q, k, v, sinks, shape, launches)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = et.attention(q, k, v, fallback="error", **kwargs_of(shape, sinks))
    for seed in (7, 8):
        for dst, src in zip((q, k, v), make_qkv(shape, seed=seed)):
            dst.copy_(src)
        sinks.copy_(sinks_of(shape, seed, torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, q, k, v, sinks, shape)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, s: et.attention(q, k, v, fallback="error", **kwargs_of(shape, s)) * 1,
                             fullgraph=True)
    before = launches[0]
    got = compiled(q, k, v, sinks)
    torch.cuda.synchronize()
    assert launches[0] > before
    assert_close(got, q, k, v, sinks, shape)
    torch._dynamo.reset()


def test_grad_call_takes_the_fallback_with_the_references_gradients(gpu, launches):
    """A tuned sinks key, inputs and logits needing grad: the fallback runs (told: the op's backward takes no sinks),
    no kernel launch, and its gradients (the sinks' too) are the fp32 reference's."""
    shape = Shape(1, 8, 200, 200, 64, "bf16", window_left=31, window_right=0, sinks=True)
    tune_table(gpu, [shape])
    leaves = [t.detach().float().requires_grad_(True) for t in make_qkv(shape, seed=9)]
    sink_leaf = sinks_of(shape, 9).requires_grad_(True)
    halves = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in leaves]
    sinks = sink_leaf.detach().clone().requires_grad_(True)
    with pytest.warns(et.EvotuneFallbackWarning, match="needs gradients"):
        out = et.attention(*halves, **kwargs_of(shape, sinks))
    grads = torch.autograd.grad(out.float().square().sum(), [*halves, sinks])
    ref = get_problem("attention").reference(shape, {"q": leaves[0], "k": leaves[1], "v": leaves[2],
                                                     "scale": shape.head_dim ** -0.5, "sinks": sink_leaf})
    want = torch.autograd.grad(ref.square().sum(), [*leaves, sink_leaf])
    assert launches[0] == 0
    atol, rtol = TOLERANCE["bf16"]
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got.float(), expected, atol=atol * 10, rtol=rtol)


# --------------------------------------------------------------------------- a tiny gpt-oss-like model


def tiny_gpt_oss_like():
    """gpt-oss's attention pattern (sliding / full layers, a sinks Parameter per layer in bf16, 8 query heads a K/V
    head) at head dim 64, bf16 on the GPU; sinks away from 0 so they matter. Every token takes both experts, so bf16
    noise cannot flip a router's top-k choice and move the logits by more than the attention's rounding."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                       sliding_window=64, num_local_experts=2, num_experts_per_tok=2,
                       layer_types=["sliding_attention", "full_attention"] * 2)
    model = GptOssForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(16, device="cuda") * 1.5 + 2.0)
    return model


def test_tiny_gpt_oss_every_call_on_the_kernel(gpu, launches):
    """Record the model's attention calls (no table: all fall back), build a table of Hopper entries for their shapes
    (sinks, the sliding layers' window), and run again: every attention call runs the kernel (routes, the adapter's
    count, the launch count), no notice, and the logits stay within bf16 noise of transformers' eager attention."""
    pytest.importorskip("transformers")
    hf.reset_stats()
    hf.register()
    model = tiny_gpt_oss_like()
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(1)).cuda()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.float()
    model.set_attn_implementation("evotune")
    et.use_table(table())  # no entry: every call falls back, and is recorded
    with warnings.catch_warnings(), et.record_shapes() as rec, torch.no_grad():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)
        model(input_ids=ids, use_cache=False)
    specs = rec.specs()
    assert specs and all(s.endswith(":sinks") for s in specs), specs
    assert any("window=63,0" in s for s in specs) and any(":causal" in s for s in specs), specs
    tune_table(gpu, [parse_shape(s) for s in specs])
    hf.reset_stats()
    layers = model.config.num_hidden_layers
    with warnings.catch_warnings(), et.record_shapes() as rec, torch.no_grad():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        out = model(input_ids=ids, use_cache=False).logits.float()
    torch.cuda.synchronize()
    assert all(r["route"] == "evotune" and r["kind"] == "tuned" for r in rec.shapes), rec.shapes
    assert sum(r["calls"] for r in rec.shapes) == layers and launches[0] == layers
    assert hf.stats() == {"evotune": layers}
    torch.testing.assert_close(out, ref, atol=6e-2, rtol=5e-2)
