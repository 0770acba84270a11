"""GPU tests of evotune.torch.attention: the tuned kernel against an fp32 reference across dtype, head
dim, causal, layout and Sq != Sk; CUDA-graph capture and replay; torch.compile(fullgraph=True); side
streams; grouped-query attention (enable_gqa) against SDPA; and the SDPA routes (missing keys) on a real GPU. The tables are fixtures that
route this GPU's keys to a chosen config, so every test runs the kernel it names (checked with explain)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.errors import UsageError  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.problems.attention import TOLERANCE  # noqa: E402
from evotune.problems.shapes import Shape  # noqa: E402

from _tables import entry, table  # noqa: E402

pytestmark = pytest.mark.gpu

# name -> (space, config overrides of its default)
VARIANTS = {"sync": ("attention", {}), "split": ("attention", {"kv_splits": 2}), "wgmma": ("attention-hopper", {}),
            "persistent": ("attention", {"mma": "wgmma", "smem_layout": "swizzle", "block_m": 128, "block_n": 128,
                                         "compute_warps": 8, "producer_warps": 4, "stages": 2, "q_in_regs": False,
                                         "pingpong": False, "persistent": True})}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def gpu():
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        pytest.skip(f"the kernels are compiled for sm_90a; this GPU is {name} ({major}.{minor})")
    return name, f"{major}.{minor}"


@pytest.fixture(autouse=True)
def default_table():
    yield
    et.use_table(None)


def variant_config(variant: str) -> tuple[str, dict]:
    from evotune.space.searchspace import load_builtin

    space, overrides = VARIANTS[variant]
    return space, {**load_builtin(space).default_config().as_dict(), **overrides}


def use_variant(gpu, variant: str, shapes) -> None:
    """Route every shape's key on this GPU to `variant`'s config."""
    space, config = variant_config(variant)
    et.use_table(table(*{entry(s, config, space, gpu=gpu).key: entry(s, config, space, gpu=gpu) for s in shapes}.values()))


def make_qkv(shape: Shape, seed: int = 0, kv_heads: int | None = None):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = DTYPES[shape.dtype]

    def one(seq, heads):
        if shape.layout == "bshd":  # (B, S, H, D) memory seen as (B, H, S, D)
            return torch.randn(shape.batch, seq, heads, shape.head_dim, generator=gen, device="cuda").to(dt).transpose(1, 2)
        return torch.randn(shape.batch, heads, seq, shape.head_dim, generator=gen, device="cuda").to(dt)

    return one(shape.seq_q, shape.heads), one(shape.seq_k, kv_heads or shape.heads), one(shape.seq_k, kv_heads or shape.heads)


def assert_close(out, q, k, v, shape: Shape) -> None:
    """The family's gate: |out - ref| <= atol * rms(V) + rtol * |ref| against its fp32 reference."""
    problem = get_problem("attention")
    ref = problem.reference(shape, {"q": q, "k": k, "v": v, "scale": shape.head_dim ** -0.5})
    atol, rtol = TOLERANCE[shape.dtype]
    bound = atol * v.float().pow(2).mean().sqrt() + rtol * ref.abs()
    err = (out.float() - ref).abs()
    assert torch.isfinite(out).all() and bool((err <= bound).all()), f"max error {err.max().item():.3g} on {shape.spec}"


def assert_graph_replays_follow_inputs(shape: Shape, q, k, v, seeds) -> None:
    """Capture the op on q, k, v into a CUDA graph; per seed, copy new inputs into them, replay, check the output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = et.attention(q, k, v, is_causal=shape.causal, fallback="error")
    for seed in seeds:
        for dst, src in zip((q, k, v), make_qkv(shape, seed=seed)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, q, k, v, shape)


def run_tuned(q, k, v, causal, enable_gqa=False):
    """The op, refusing any SDPA route (so a pass is the kernel's)."""
    assert et.explain(q, k, v, is_causal=causal, enable_gqa=enable_gqa).kind == "tuned"
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        return et.attention(q, k, v, is_causal=causal, enable_gqa=enable_gqa, fallback="error")


@pytest.mark.parametrize("variant", ["sync", "wgmma"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_reference(gpu, variant, dtype, head_dim, causal):
    """The tuned kernel passes the gate on ragged Sq != Sk (both ways) in both layouts, and writes the query's layout."""
    shapes = [Shape(2, 4, sq, sk, head_dim, dtype, causal, layout)
              for sq, sk in ((197, 300), (300, 197)) for layout in ("bhsd", "bshd")]
    use_variant(gpu, variant, shapes)
    for shape in shapes:
        q, k, v = make_qkv(shape)
        out = run_tuned(q, k, v, causal)
        assert out.shape == (2, 4, shape.seq_q, head_dim)
        assert (out.stride(1) < out.stride(2)) == (shape.layout == "bshd")
        assert_close(out, q, k, v, shape)


def test_split_kv_matches_reference(gpu):
    """A split-KV config (a workspace per launch) passes the gate too."""
    shape = Shape(1, 8, 512, 512, 64, "fp16", True)
    use_variant(gpu, "split", [shape])
    q, k, v = make_qkv(shape)
    assert_close(run_tuned(q, k, v, True), q, k, v, shape)


@pytest.mark.parametrize("causal", [False, True])
def test_persistent_grid_matches_reference(gpu, causal):
    """The persistent Hopper grid through the op (causal: its tile counters, a fresh zeroed pair per call), eager
    and replayed from a CUDA graph on new inputs."""
    shape = Shape(2, 16, 1024, 1024, 64, "bf16", causal)
    use_variant(gpu, "persistent", [shape])
    q, k, v = make_qkv(shape, seed=4)
    assert_close(run_tuned(q, k, v, causal), q, k, v, shape)
    assert_graph_replays_follow_inputs(shape, q, k, v, seeds=(5, 6))


@pytest.mark.parametrize("variant,layout", [("sync", "bhsd"), ("split", "bhsd"), ("wgmma", "bhsd"), ("wgmma", "bshd")])
def test_graph_capture_and_replay(gpu, variant, layout):
    """After warmup(), the op captures into a CUDA graph (the Hopper variant too: its tensor maps are kernel
    parameters), and replays follow new inputs copied into the captured ones."""
    shape = Shape(2, 4, 256, 384, 64, "bf16", True, layout)
    use_variant(gpu, variant, [shape])
    rows = et.warmup()  # one row per visible device
    assert [(r["device"], r["status"]) for r in rows] == [(i, "loaded") for i in range(torch.cuda.device_count())]
    q, k, v = make_qkv(shape, seed=1)
    run_tuned(q, k, v, True)
    assert_graph_replays_follow_inputs(shape, q, k, v, seeds=(2, 3))


def test_pdl_config_through_the_op(gpu):
    """A pdl config (the mission winner with pdl, attention-small-pdl.yaml) through the op: its PreparedLaunch
    launches with programmatic stream serialization, eagerly and replayed from a CUDA graph right after the copies
    of new inputs into the captured buffers (torch kernels its griddepcontrol.wait must wait for)."""
    from evotune.torch.kernels import PREPARED

    shape = Shape(1, 8, 512, 512, 64, "fp16", False)
    config = dict(block_m=32, block_n=128, compute_warps=4, kv_splits=1, producer_warps=0, q_in_regs=True,
                  smem_layout="swizzle", stages=4, warp_key_groups=2, pdl=True)
    et.use_table(table(entry(shape, config, "attention-small-pdl", gpu=gpu)))
    q, k, v = make_qkv(shape, seed=7)
    assert_close(run_tuned(q, k, v, False), q, k, v, shape)
    assert any(p.pdl for p in PREPARED._prepared.values())
    assert all(p.pdl == bool(p.loaded.config.get("pdl")) for p in PREPARED._prepared.values())
    assert_graph_replays_follow_inputs(shape, q, k, v, seeds=(8, 9))


@pytest.mark.parametrize("layout, cluster", [("bhsd", 1), ("bshd", 1), ("bhsd", 2), ("bshd", 4)])
def test_tma_load_config_through_the_op(gpu, layout, cluster):
    """An mma.sync config with TMA loads (the mission winner, attention-small-tma.yaml; and with its K/V tiles
    multicast in clusters of 2 or 4, attention-small-mc.yaml) through the op: its PreparedLaunch carries Q's, K's and
    V's tensor maps, patches them when the buffers change, and its graph replays follow new inputs copied into the
    captured ones."""
    from evotune.torch.kernels import PREPARED

    shape = Shape(1, 8, 512, 512, 64, "fp16", False, layout)
    config = dict(block_m=32, block_n=128, compute_warps=4, kv_splits=1, producer_warps=0, q_in_regs=True,
                  smem_layout="swizzle", stages=3, warp_key_groups=2, pdl=True, key_merge="split", kv_load="tma")
    if cluster > 1:
        config["kv_cluster"] = cluster
    et.use_table(table(entry(shape, config, "attention-small-mc" if cluster > 1 else "attention-small-tma", gpu=gpu)))
    q, k, v = make_qkv(shape, seed=7)
    assert_close(run_tuned(q, k, v, False), q, k, v, shape)
    tma = [p for p in PREPARED._prepared.values() if p.loaded.config.get("kv_load") == "tma"]
    assert tma and all([name for name, _, _ in p.maps] == ["q_map", "k_map", "v_map"] for p in tma)
    q2, k2, v2 = make_qkv(shape, seed=8)
    assert_close(run_tuned(q2, k2, v2, False), q2, k2, v2, shape)
    assert_graph_replays_follow_inputs(shape, q, k, v, seeds=(9, 10))


def test_capture_refuses_a_kernel_not_loaded(gpu):
    """Capturing a kernel not loaded yet is one clear UsageError; after warmup() the same call captures."""
    from evotune.torch.kernels import CACHE

    shape = Shape(1, 4, 256, 256, 64, "fp16", False)
    use_variant(gpu, "wgmma", [shape])
    q, k, v = make_qkv(shape)
    CACHE.clear()  # earlier tests loaded this kernel
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(UsageError, match="not loaded yet"):
        with torch.cuda.graph(graph):
            et.attention(q, k, v)
    et.warmup()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = et.attention(q, k, v, fallback="error")
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, q, k, v, shape)


def test_wgmma_eager_calls_reuse_plan_and_maps(gpu):
    """Repeated eager calls of the Hopper variant on the same buffers reuse the launch plan and the encoded
    tensor maps (no per-call encode or upload), and stay correct when the buffers change."""
    from evotune.problems.attention import _launch_plan
    from evotune.build.tma import map_param

    shape = Shape(1, 8, 512, 512, 64, "fp16", False)
    use_variant(gpu, "wgmma", [shape])
    q, k, v = make_qkv(shape)
    run_tuned(q, k, v, False)
    plans, maps = _launch_plan.cache_info(), map_param.cache_info()
    for _ in range(3):
        out = run_tuned(q, k, v, False)
    assert _launch_plan.cache_info().misses == plans.misses and map_param.cache_info().misses == maps.misses
    assert_close(out, q, k, v, shape)
    q2, k2, v2 = make_qkv(shape, seed=5)
    assert_close(run_tuned(q2, k2, v2, False), q2, k2, v2, shape)


def test_side_stream(gpu):
    """A call on a side stream runs there: its result is right once that stream is synchronised."""
    shape = Shape(2, 4, 1024, 1024, 128, "fp16", False)
    use_variant(gpu, "sync", [shape])
    q, k, v = make_qkv(shape)
    run_tuned(q, k, v, False)
    said = str(et.explain(q, k, v))
    assert said.startswith("route: evotune kernel (tuned)") and "exact match; run fixture trial 0" in said
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = et.attention(q, k, v, fallback="error")
    stream.synchronize()
    assert_close(out, q, k, v, shape)


class Block(torch.nn.Module):
    """A transformer attention block: one projection to q, k, v in (B, S, H, D) memory, attention, output projection."""

    def __init__(self, heads: int, head_dim: int, attend):
        super().__init__()
        self.heads, self.head_dim, self.attend = heads, head_dim, attend
        self.qkv = torch.nn.Linear(heads * head_dim, 3 * heads * head_dim)
        self.proj = torch.nn.Linear(heads * head_dim, heads * head_dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        o = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(o.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_torch_compile_fullgraph(gpu, mode):
    """torch.compile(fullgraph=True) traces the op with no graph break (also with CUDA graphs) and matches eager SDPA."""
    torch._dynamo.reset()
    shape = Shape(2, 8, 512, 512, 64, "fp16", True, "bshd")
    use_variant(gpu, "sync", [shape])
    torch.manual_seed(0)
    model = Block(8, 64, lambda q, k, v: et.attention(q, k, v, is_causal=True, fallback="error")).cuda().half()
    ref_model = Block(8, 64, lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    ref_model.load_state_dict(model.state_dict())
    ref_model = ref_model.cuda().half()
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(2, 512, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)).half()
            got, want = compiled(x).clone(), ref_model(x)
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dynamic", [None, True])
def test_torch_compile_over_sequence_lengths(gpu, dynamic):
    """A compiled function called at several sequence lengths (automatic dynamic shapes make S symbolic from the
    second; dynamic=True from the first) keeps the op, which runs the kernel on each tuned length and SDPA on the
    untuned one (700: its power-of-two bucket, 1024, has no entry): each result passes the gate, and the recorded
    routes say which ran."""
    torch._dynamo.reset()
    tuned = [Shape(1, 8, s, s, 64, "fp16", True, "bshd") for s in (256, 384)]
    use_variant(gpu, "sync", tuned)
    fn = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal=True), fullgraph=True, dynamic=dynamic)
    with et.record_shapes() as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)  # the untuned length's notice
        for shape in tuned + [Shape(1, 8, 700, 700, 64, "fp16", True, "bshd")]:
            q, k, v = make_qkv(shape)
            assert_close(fn(q, k, v), q, k, v, shape)
    routes = {(c["seq_q"], c["route"]) for c in calls.shapes}
    assert {(256, "evotune"), (384, "evotune"), (700, "sdpa")} <= routes


@pytest.mark.parametrize("variant", ["sync", "split", "wgmma"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True])
def test_gqa_runs_the_kernel_and_matches_sdpa(gpu, variant, dtype, causal):
    """Grouped K/V heads (enable_gqa; groups 2, 4, 8; both layouts; ragged) run the kernel on un-repeated K/V,
    pass the gate against the fp32 reference and agree with SDPA's enable_gqa."""
    shapes = [Shape(2, 8, 197, 300, 64, dtype, causal, "bhsd", kv_heads=4),
              Shape(1, 8, 300, 197, 128, dtype, causal, "bshd", kv_heads=2),
              Shape(2, 8, 257, 257, 64, dtype, causal, "bshd", kv_heads=1)]
    use_variant(gpu, variant, shapes)
    for shape in shapes:
        q, k, v = make_qkv(shape, kv_heads=shape.kv_heads)
        assert k.shape[1] == shape.kv_heads
        out = run_tuned(q, k, v, causal, enable_gqa=True)
        assert out.shape == (shape.batch, 8, shape.seq_q, shape.head_dim)
        assert_close(out, q, k, v, shape)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        atol, rtol = TOLERANCE[dtype]
        torch.testing.assert_close(out, want, atol=2 * atol, rtol=2 * rtol)


def test_gqa_key_needs_its_group_size(gpu):
    """A table tuned for the ungrouped shape does not serve a grouped call (the key holds the group size): SDPA, told once."""
    shape = Shape(1, 8, 256, 256, 64, "fp16", False)
    use_variant(gpu, "sync", [shape])
    q, k, v = make_qkv(shape, kv_heads=2)
    with pytest.warns(et.EvotuneFallbackWarning, match="kv-group 4"):
        out = et.attention(q, k, v, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, want)
    with pytest.raises(UsageError, match="no tuned kernel"):
        et.attention(q, k, v, enable_gqa=True, fallback="error")


def test_missing_key_warns_once_with_the_tune_command(gpu):
    """A key the table lacks runs SDPA, warning once with the key and the command that would tune it."""
    tuned = Shape(1, 8, 256, 256, 64, "fp16", False)
    use_variant(gpu, "sync", [tuned])
    q, k, v = make_qkv(Shape(1, 8, 256, 256, 128, "fp16", False))
    with pytest.warns(et.EvotuneFallbackWarning, match=r"d128 .*evotune tune --shape 1,8,256,128:fp16"):
        et.attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error", et.EvotuneFallbackWarning)
        out = et.attention(q, k, v)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device(gpu):
    """A call on cuda:1 loads the kernel there and computes there."""
    shape = Shape(1, 4, 256, 256, 64, "fp16", False)
    use_variant(gpu, "sync", [shape])
    q, k, v = (t.to("cuda:1") for t in make_qkv(shape))
    assert torch.cuda.current_device() == 0
    out = run_tuned(q, k, v, False)
    assert out.device == torch.device("cuda:1")
    assert_close(out, q, k, v, shape)
