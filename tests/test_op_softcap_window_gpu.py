"""GPU tests of evotune.torch.attention's softcap and window (issue 42): with a tuning table that routes a softcap /
window key to a Hopper config, the op runs evotune's kernel (its decision, and a count of the kernel launches it
made) within the gate's tolerance of the fp32 reference, eagerly, from its cached route, in a CUDA graph and under
torch.compile; a dense entry never serves such a call; the fallback on the GPU (math for a softcap, SDPA with a window
mask) and a call needing gradients; and tiny Gemma-2-like and Mistral-like models whose every attention call runs the
kernel once a table built from their recorded shapes covers them."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.gpu import packet  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.attention import TOLERANCE, visibility_mask  # noqa: E402
from evotune.problems.shapes import Shape, parse_shape  # noqa: E402
from evotune.space.searchspace import load_builtin, shape_context  # noqa: E402
from evotune.torch import hf, launcher  # noqa: E402

from _tables import entry, table  # noqa: E402
from test_torch_gpu import assert_close, gpu, make_qkv  # noqa: E402,F401 (gpu: the sm_90 fixture)

pytestmark = pytest.mark.gpu

# The Hopper kernel's configs (the only kernel with SOFTCAP / LOCAL): one tile per CTA, and the persistent grid.
HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}
CONFIGS = {"onetile": HOPPER, "persistent": {**HOPPER, "persistent": True}}
CASES = [
    "2,8,300,64:fp16:window=64,0",                       # Mistral's causal window, no causal flag
    "2,8,197,300,64:fp16:window=40,-1",                  # Sq < Sk, right side unbounded
    "2,8,333,197,64:bf16:window=-1,32",                  # Sq > Sk, left unbounded: leading rows see no key (0)
    "2,8,300,197,64:fp16:window=1,1",                    # a narrow band, rows with no key
    "2,16,513,64:bf16:window=128,0:kv4:bshd",            # GQA, a projection's layout
    "2,8,256,128:bf16:causal:softcap=50",                # Gemma-2's global layer
    "1,16,1000,128:bf16:causal:window=100,0:softcap=30:bshd:kv8",  # Gemma-2's local layer
    "2,8,333,64:fp16:softcap=30",
    "2,12,300,64:bf16:causal:window=50,0:kv4",
]
# The persistent grid needs more query tiles than SMs (the space refuses it otherwise: it would be the one-tile grid).
PERSISTENT_CASES = [
    "4,20,1000,64:bf16:window=128,0:kv4",
    "2,40,1000,64:bf16:causal:softcap=30:kv8",          # causal: tiles handed out by a counter
    "4,20,777,900,128:bf16:softcap=50:window=-1,64:bshd",
]


@pytest.fixture(autouse=True)
def python_launches(monkeypatch):
    """The op's Python launches (the compiled launcher hands these calls back anyway), no table after each test."""
    monkeypatch.delenv(launcher.ENV, raising=False)
    yield
    et.use_table(None)


@pytest.fixture
def launches(monkeypatch):
    """A count of the kernel launches the op makes (kernels.PreparedLaunch looks packet.launch_packet up per call)."""
    real = packet.launch_packet
    count = [0]

    def counting(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(packet, "launch_packet", counting)
    return count


def hopper(knobs: dict) -> dict:
    return {**load_builtin("attention").default_config().as_dict(), **knobs}


def tune_table(gpu, shapes, knobs=HOPPER) -> None:
    """A table routing each shape's key on this GPU to the Hopper config `knobs` (skipped where the space refuses it)."""
    space = load_builtin("attention")
    for shape in shapes:
        why = space.violations(space.config(hopper(knobs)), shape_context(shape))
        if why:
            pytest.skip(f"{shape.spec}: not admitted: {why[0]}")
    et.use_table(table(*{entry(s, hopper(knobs), gpu=gpu).key: entry(s, hopper(knobs), gpu=gpu) for s in shapes}
                       .values()))


def mods_of(shape: Shape) -> dict:
    return {"is_causal": shape.causal, "enable_gqa": shape.kv_heads != shape.heads, "softcap": shape.softcap,
            "window": (shape.window_left, shape.window_right) if shape.has_window else None}


def run_on_kernel(q, k, v, shape: Shape, launches) -> torch.Tensor:
    """The op on our kernel: explain says tuned, no fallback notice, fallback='error', exactly one kernel launch."""
    info = et.explain(q, k, v, **mods_of(shape))
    assert (info.route, info.kind, info.runs) == ("evotune", "tuned", "evotune kernel"), str(info)
    before = launches[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        out = et.attention(q, k, v, fallback="error", **mods_of(shape))
    assert launches[0] == before + 1
    return out


@pytest.mark.parametrize("spec, config", [(s, "onetile") for s in CASES] + [(s, "persistent") for s in PERSISTENT_CASES])
def test_kernel_runs_softcap_and_window_calls(gpu, launches, spec, config):
    """A key the table routes to a Hopper config runs our kernel (a launch per call, first and cached) and passes the
    gate against the fp32 reference, rows that see no key 0, in the query's layout."""
    shape = parse_shape(spec)
    tune_table(gpu, [shape], CONFIGS[config])
    for seed in (0, 1):
        q, k, v = make_qkv(shape, seed=seed, kv_heads=shape.kv_heads)
        out = run_on_kernel(q, k, v, shape, launches)
        torch.cuda.synchronize()
        assert_close(out, q, k, v, shape)
        assert (out.stride(1) < out.stride(2)) == (shape.layout == "bshd")
        if shape.has_window:
            empty = ~visibility_mask(shape, out.device).any(dim=1)
            assert (out[:, :, empty] == 0).all()


def test_dense_entry_does_not_run_a_softcap_or_window_call(gpu, launches):
    """With only the dense key's entry, a softcap + window call of the same sizes misses (told, naming the key and the
    tune command with the cap and window) and runs the fallback: no kernel launch; the dense call launches."""
    dense = Shape(2, 8, 512, 512, 64, "bf16", True)
    tune_table(gpu, [dense])
    capped = Shape(2, 8, 512, 512, 64, "bf16", True, softcap=30.0, window_left=63, window_right=0)
    q, k, v = make_qkv(capped)
    assert et.explain(q, k, v, **mods_of(capped)).kind == "missing"
    with pytest.warns(et.EvotuneFallbackWarning, match="softcap=30:window=63,0.*running PyTorch math attention"):
        out = et.attention(q, k, v, **mods_of(capped))
    torch.cuda.synchronize()
    assert launches[0] == 0
    assert_close(out, q, k, v, capped)
    run_on_kernel(q, k, v, dense, launches)


@pytest.mark.parametrize("spec", ["2,8,300,197,64:fp16:window=1,1", "2,16,513,64:bf16:window=128,0:kv4:bshd",
                                  "2,8,256,128:bf16:causal:softcap=50", "1,16,1000,128:bf16:window=100,0:softcap=30"])
def test_fallback_on_the_gpu_passes_the_gate(gpu, launches, spec):
    """With no table, the fallback (SDPA with a window mask on the GPU's backends, or fp32 math) passes the gate."""
    shape = parse_shape(spec)
    et.use_table(table())  # no entry: whatever $EVOTUNE_TABLE holds
    q, k, v = make_qkv(shape, kv_heads=shape.kv_heads)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)
        out = et.attention(q, k, v, **mods_of(shape))
    torch.cuda.synchronize()
    assert launches[0] == 0 and torch.isfinite(out).all()
    assert_close(out, q, k, v, shape)


def test_graph_capture_and_compile(gpu, launches):
    """After warmup() a softcap + window call captures into a CUDA graph (its cap and window in the packet) and replays
    on new inputs; torch.compile(fullgraph=True) calls the op, whose body launches the kernel."""
    shape = Shape(2, 8, 384, 384, 64, "bf16", False, "bshd", softcap=30.0, window_left=100, window_right=0)
    tune_table(gpu, [shape])
    assert all(r["status"] == "loaded" for r in et.warmup())
    q, k, v = make_qkv(shape, seed=2)
    run_on_kernel(q, k, v, shape, launches)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = et.attention(q, k, v, fallback="error", **mods_of(shape))
    for seed in (3, 4):
        for dst, src in zip((q, k, v), make_qkv(shape, seed=seed)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, q, k, v, shape)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: et.attention(q, k, v, fallback="error", **mods_of(shape)) * 1,
                             fullgraph=True)
    before = launches[0]
    got = compiled(q, k, v)
    torch.cuda.synchronize()
    assert launches[0] > before
    assert_close(got, q, k, v, shape)
    torch._dynamo.reset()


def test_grad_call_takes_the_fallback_with_the_references_gradients(gpu, launches):
    """A tuned softcap + window key, inputs needing grad: the fallback runs (told: the op's backward takes neither), no
    kernel launch, and its gradients are the fp32 reference's."""
    shape = Shape(1, 8, 200, 200, 64, "bf16", softcap=30.0, window_left=31, window_right=0)
    tune_table(gpu, [shape])
    leaves = [t.detach().float().requires_grad_(True) for t in make_qkv(shape, seed=5)]
    halves = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in leaves]
    with pytest.warns(et.EvotuneFallbackWarning, match="needs gradients"):
        out = et.attention(*halves, **mods_of(shape))
    grads = torch.autograd.grad(out.float().square().sum(), halves)
    ref = get_problem("attention").reference(shape, {"q": leaves[0], "k": leaves[1], "v": leaves[2],
                                                     "scale": shape.head_dim ** -0.5})
    want = torch.autograd.grad(ref.square().sum(), leaves)
    assert launches[0] == 0
    atol, rtol = TOLERANCE["bf16"]
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got.float(), expected, atol=atol * 10, rtol=rtol)


# --------------------------------------------------------------------------- tiny models through the adapter


def tiny_gemma2_like():
    """Gemma-2's pattern (sliding / full layers, a softcap) at the kernel's head dim 64, bf16 on the GPU."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                       sliding_window=64, query_pre_attn_scalar=64, attn_logit_softcapping=50.0)
    return Gemma2ForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


def tiny_mistral_like():
    """Mistral's pattern (every layer slides) at head dim 128 with one K/V head, bf16 on the GPU."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=512, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=128, max_position_embeddings=1024,
                        sliding_window=64)
    return MistralForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


@pytest.mark.parametrize("make, reference", [(tiny_gemma2_like, "eager"), (tiny_mistral_like, "sdpa")],
                         ids=["gemma2", "mistral"])
def test_tiny_model_every_call_on_the_kernel(gpu, launches, make, reference):
    """Record the model's attention calls (no table: all fall back), build a table of Hopper entries for their shapes
    (softcap, window), and run again: every attention call runs the kernel (routes, the adapter's count, the launch
    count), no notice, and the logits stay within bf16 noise of transformers' own attention."""
    pytest.importorskip("transformers")
    hf.reset_stats()
    hf.register()
    model = make()
    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(1)).cuda()
    model.set_attn_implementation(reference)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.float()
    model.set_attn_implementation("evotune")
    et.use_table(table())  # no entry: every call falls back, and is recorded
    with warnings.catch_warnings(), et.record_shapes() as rec, torch.no_grad():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)
        model(input_ids=ids, use_cache=False)
    specs = rec.specs()
    assert all("window=63,0" in s or "softcap=50" in s for s in specs), specs
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
