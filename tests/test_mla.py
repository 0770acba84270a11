"""A value head dim of its own (DeepSeek-V2/V3 MLA prefill: q, k 192, v 128; flash-attention's hdim_v): the `dv=N`
spelling, FLOPs and bytes, the table key, the space's admission and register bound, the traits' order, clean sm_90a
compiles, the fp32 reference against brute force, and the op's checks, fake shape and fallback on CPU tensors; on a
GPU the full gate over the Hopper kernel's pieces, the op's kernel route from a hand-made table entry, its fallback
and SDPA's backends as baselines."""

from __future__ import annotations

import math
import warnings

import pytest

from evotune.errors import UsageError
from evotune.problems.attention import HEAD_DIM_V_PAIRS, _map_args, tile_dim, tile_dim_v
from evotune.problems.shapes import Shape, parse_shape
from evotune.records.tuning_table import TableKey, parse_table
from evotune.space.searchspace import shape_context

MLA = "1,16,4096,192:bf16:causal:dv=128"
# A Hopper tile that compiles clean at 192/128: two consumer warpgroups and a producer, 64-key K/V tiles.
HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 64, "stages": 2,
          "q_in_regs": False}
THREE_WGS = {**HOPPER, "block_m": 192, "compute_warps": 12}
# The Hopper kernel's pieces at V's own width: one tile, persistent, the TMA store (one tile and persistent), no
# producer, ping-pong, three consumer warpgroups, P from shared memory, Q in registers.
CONFIGS = {"onetile": {}, "persistent": {"persistent": True}, "tmastore": {"persistent": True, "epilogue": "tma"},
           "tmastore1": {"epilogue": "tma"}, "noproducer": {"producer_warps": 0, "stages": 3},
           "pingpong": {"pingpong": True}, "threewgs": THREE_WGS, "psmem": {"p_operand": "smem"},
           "qregs": {"q_in_regs": True}}


# ------------------------------------------------------------------ the shape


def test_spelling_round_trips_and_is_written_only_where_it_differs():
    """`dv=N` reads into head_dim_v and is spelled back; dv equal to the head dim is the plain shape (old specs and
    records read the same); as_dict / from_dict carry it only where set."""
    s = parse_shape(MLA)
    assert (s.head_dim, s.head_dim_v, s.dv, s.has_dv) == (192, 128, 128, True)
    assert s.spec == MLA and parse_shape(s.spec) == s
    assert s.as_dict()["head_dim_v"] == 128 and Shape.from_dict(s.as_dict()) == s
    plain = parse_shape("1,16,4096,192:bf16:causal")
    assert parse_shape("1,16,4096,192:bf16:causal:dv=192") == plain and plain.dv == 192 and not plain.has_dv
    assert "head_dim_v" not in plain.as_dict() and "dv=" not in plain.spec
    assert Shape(1, 2, 3, 3, 192, head_dim_v=192) == Shape(1, 2, 3, 3, 192)
    assert parse_shape("mission:dv=32").dv == 32  # a preset with the flag


@pytest.mark.parametrize("text, says", [
    ("1,2,64,192:dv=0", "dv=N"), ("1,2,64,192:dv=x", "dv=N"), ("1,2,64,192:dv=", "dv=N"),
    ("1,2,64,192:dv=128:dv=64", "conflicts with"), ("1,2,64,192:dv=9999999999999", "too large"),
])
def test_bad_spellings_are_one_line(text, says):
    with pytest.raises(UsageError, match=says):
        parse_shape(text)


def test_flops_and_bytes_count_each_head_dim():
    """FLOPs are 2 B H Sq Sk (D + Dv), halved for causal (FlashAttention's count); at one head dim 4 B H Sq Sk D as
    before. Bytes: Q and K at D, V and O at Dv."""
    s = parse_shape(MLA)
    assert s.flops() == 2.0 * 16 * 4096 * 4096 * (192 + 128) / 2
    assert parse_shape("2,8,300,197,128").flops() == 4.0 * 2 * 8 * 300 * 197 * 128
    g = parse_shape("2,8,300,197,128:kv2:dv=64")
    assert g.min_bytes() == 2 * (2 * 8 * 300 * (128 + 64) + 2 * 2 * 197 * (128 + 64))
    w = parse_shape("1,4,256,192:window=31,0:dv=128")
    assert w.flops() == 2.0 * 4 * (192 + 128) * w.visible_pairs()


def test_table_key_holds_head_dim_v_only_where_set():
    """The key's head_dim_v is written only for a shape that has one (dense keys read as before), keeps such keys
    apart from the same sizes at one head dim, and reads back from a table file."""
    from _tables import entry, table

    mla, plain = parse_shape(MLA), parse_shape("1,16,4096,192:bf16:causal")
    key, dense = TableKey.for_shape(mla, "H100", "9.0"), TableKey.for_shape(plain, "H100", "9.0")
    assert key.as_dict()["head_dim_v"] == 128 and "head_dim_v" not in dense.as_dict()
    assert key != dense and key.group() != dense.group() and "d192/dv128" in key.spec()
    e = entry(mla, dict(HOPPER, **{k: v for k, v in _defaults().items() if k not in HOPPER}))
    back = parse_table(table(e).as_dict())
    assert back.entries[0].key == e.key and back.entries[0].key.head_dim_v == 128
    bad = table(e).as_dict()
    bad["entries"][0]["key"]["head_dim_v"] = 192
    with pytest.raises(Exception, match="head_dim_v"):
        parse_table(bad)


def _defaults() -> dict:
    from evotune.space.searchspace import load_builtin

    return load_builtin("attention").default_config().as_dict()


# ------------------------------------------------------------------ admission and the kernel's instantiation


@pytest.mark.parametrize("d, dv", HEAD_DIM_V_PAIRS)
def test_space_admits_the_pairs_on_the_hopper_kernel_only(attention, space, d, dv):
    """192/128 and 128/64 admit Hopper configs, not the mma.sync kernel; other pairs and varlen are refused by the
    space and by check_shape, each with its reason."""
    shape = parse_shape(f"1,8,1024,{d}:causal:dv={dv}")
    attention.check_shape(shape)
    assert space.violations(space.config(HOPPER), shape_context(shape)) == []
    sync = space.violations(space.config({"mma": "sync", "block_m": 64, "block_n": 64}), shape_context(shape))
    assert any("value head dim" in why for why in sync)
    with pytest.raises(UsageError, match="Hopper kernel only"):
        attention.template_args(space.config({"mma": "sync"}), shape)


@pytest.mark.parametrize("text", ["1,8,1024,128:dv=96", "1,8,1024,256:dv=128", "1,8,1024,64:dv=128",
                                  "2,8,100,192:dv=128:varlen=100/50"])
def test_other_pairs_are_refused(attention, space, text):
    shape = parse_shape(text)
    with pytest.raises(UsageError, match="value head dim"):
        attention.check_shape(shape)
    assert any("value head dim" in why for why in space.violations(space.config(HOPPER), shape_context(shape)))


def test_register_bound_reads_v_head_dim(space):
    """O's accumulators are V's now: four consumer warpgroups (a 96-register launch bound) are admitted at 192/128
    (64 + 30 <= 96), not at 192/192 (96); whether they spill is the static gate's to prune (at block_n 64 they do)."""
    four = {**HOPPER, "block_m": 256, "compute_warps": 16}
    assert space.violations(space.config(four), shape_context(parse_shape("1,8,1024,192:dv=128"))) == []
    assert any("O in registers" in why
               for why in space.violations(space.config(four), shape_context(parse_shape("1,8,1024,192"))))


def test_tiles_maps_and_shared_memory_follow_each_head_dim(attention, space):
    """Q and K tiles are 192 wide, V and O 128: the tensor maps' extents, the K and V slots' bytes in the launch's
    shared memory (and the persistent TMA store's O staging tile at V's width)."""
    cfg = space.config({**HOPPER, "persistent": True, "epilogue": "tma"})
    shape = parse_shape("4,16,1024,192:dv=128")
    assert (tile_dim(cfg, shape), tile_dim_v(cfg, shape)) == (192, 128)
    qs, vs = (16 * 1024 * 192, 1024 * 192, 192, 1), (16 * 1024 * 128, 1024 * 128, 128, 1)
    maps = _map_args(cfg, shape, qs, qs, vs, vs)
    assert [m.dims[0] for m in maps] == [192, 192, 128, 128] and all(m.box[0] == 64 for m in maps)
    smem = 2 * (128 * 192 + 2 * 64 * 192 + 2 * 64 * 128 + 128 * 128) + 1024
    assert attention.geometry(cfg, shape).dynamic_smem == smem
    code = attention.instantiation(cfg, shape)
    assert "/* HEAD_DIM_V = */ 128" in code and "kOStageBytes = kOBytes" in code


def test_traits_order_puts_head_dim_v_last(attention, space):
    """HEAD_DIM_V follows SOFTCAP, LOCAL, SINKS and VARLEN (passed false where the shape has none); a shape without it
    passes none of them (its source is the one before HEAD_DIM_V existed)."""
    from test_traits_order import declared_parameters

    declared = [name for _, name in declared_parameters("attention.cu", "HopperTraits")]
    assert declared[-5:] == ["SOFTCAP", "LOCAL", "SINKS", "VARLEN", "HEAD_DIM_V"]
    passed = attention.template_args(space.config(HOPPER), parse_shape("1,8,512,192:dv=128"))
    assert [n for n, _ in passed] == declared and passed[-5:] == [
        ("SOFTCAP", "false"), ("LOCAL", "false"), ("SINKS", "false"), ("VARLEN", "false"), ("HEAD_DIM_V", 128)]
    plain = attention.template_args(space.config(HOPPER), parse_shape("1,8,512,192"))
    assert [n for n, _ in plain] == declared[:-5]


CLEAN = [("4,16,1024,192:causal:dv=128", name) for name in CONFIGS] + [
    ("2,16,1024,192:bf16:dv=128:kv4:bshd", "tmastore"),
    ("1,8,1024,128:causal:dv=64", "onetile"),
    ("4,16,1024,128:bf16:dv=64", "tmastore"),
    ("1,8,1024,192:bf16:window=100,0:softcap=30:sinks:dv=128", "onetile"),
]


@pytest.mark.parametrize("text, name", CLEAN)
def test_kernels_compile_clean(attention, space, text, name):
    """A sample of admitted configs compiles for sm_90a (NVRTC on the CPU) with no spill, no stack frame, within the
    static gate; the instantiation's asserts tie the host's shared memory to the traits'."""
    from _variant_pairs import assert_compiles_clean

    shape = parse_shape(text)
    cfg = {**HOPPER, **CONFIGS[name]}
    assert space.violations(space.config(cfg), shape_context(shape)) == []
    assert_compiles_clean(attention, space, shape, cfg)


# ------------------------------------------------------------------ the reference


def _brute(q, k, v, scale, causal, group):
    """Attention by its definition in float64, one (batch, head, row) at a time."""
    import torch

    b, h, sq, _ = q.shape
    out = torch.zeros(b, h, sq, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                s = (k[bi, hi // group].double() @ q[bi, hi, i].double()) * scale
                if causal:
                    s[i + 1:] = -math.inf
                out[bi, hi, i] = torch.softmax(s, 0) @ v[bi, hi // group].double()
    return out


@pytest.mark.parametrize("text", ["1,2,37,53,192:dv=128", "1,4,40,192:causal:kv2:dv=128:bshd",
                                  "2,2,33,128:bf16:dv=64"])
def test_reference_matches_brute_force(attention, text):
    """make_inputs gives V (and new_output O) V's head dim in the shape's layout, and the fp32 reference equals the
    definition (scale 1/sqrt(D), Q's head dim)."""
    torch = pytest.importorskip("torch")
    shape = parse_shape(text)
    inputs = attention.make_inputs(shape, seed=3, device="cpu")
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    assert v.shape[-1] == shape.dv and k.shape[-1] == q.shape[-1] == shape.head_dim
    assert inputs["scale"] == 1 / math.sqrt(shape.head_dim)
    out = attention.new_output(inputs)
    assert tuple(out.shape) == (shape.batch, shape.heads, shape.seq_q, shape.dv)
    assert (out.stride(1) < out.stride(2)) == (shape.layout == "bshd") and out.dtype == q.dtype
    ref = attention.reference(shape, inputs)
    want = _brute(q, k, v, inputs["scale"], shape.causal, shape.kv_group)
    assert torch.allclose(ref.double(), want, atol=1e-5, rtol=1e-5)


def test_baselines_skip_flash_only(attention):
    """SDPA's flash backend needs one head dim for q, k and v (skipped, said so); cuDNN, efficient and math are
    probed on the GPU (their refusal, if any, found by running them)."""
    shape = parse_shape(MLA)
    assert "one head dim" in attention.baseline_skip_reason("flash", shape)
    assert all(attention.baseline_skip_reason(n, shape) is None for n in ("cudnn", "efficient", "math"))


# ------------------------------------------------------------------ the op on the CPU


def _mla_qkv(b=2, h=4, sq=16, sk=24, d=192, dv=128, dtype=None, layout="bhsd", kv_heads=None, grad=False, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.bfloat16

    def one(s, heads, dim):
        t = (torch.randn(b, s, heads, dim, generator=gen).to(dtype).transpose(1, 2) if layout == "bshd"
             else torch.randn(b, heads, s, dim, generator=gen).to(dtype))
        return t.requires_grad_(grad)

    return one(sq, h, d), one(sk, kv_heads or h, d), one(sk, kv_heads or h, dv)


@pytest.fixture
def fresh_op(monkeypatch):
    """No table, no cached decisions and no notices given (evotune.torch.use_table(None)), before and after."""
    et = pytest.importorskip("evotune.torch")
    monkeypatch.delenv("EVOTUNE_TABLE", raising=False)
    et.use_table(None)
    yield et
    et.use_table(None)


def test_op_coverage_and_shape_of_a_call():
    """A CUDA call with v's head dim 128 beside 192 is covered on sm_90 (its Shape and key carry head_dim_v); other
    pairs are told why."""
    pytest.importorskip("torch")
    from evotune.torch.call import Call, coverage

    def call(d, dv):
        strides = ((8 * 64 * d, 64 * d, d, 1), (8 * 64 * d, 64 * d, d, 1), (8 * 64 * dv, 64 * dv, dv, 1))
        return Call(1, 8, 8, 64, 64, d, dv, "bf16", True, "bhsd", "cuda:0", strides)

    assert coverage(call(192, 128), (9, 0)) is None and coverage(call(128, 64), (9, 0)) is None
    assert call(192, 128).shape().spec == "1,8,64,192:bf16:causal:dv=128"
    assert "value head dim 96" in coverage(call(192, 96), (9, 0))
    assert "dv=128" in call(192, 128).as_dict()["shape"]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fake_output_has_v_head_dim_in_q_layout(layout):
    """The op's fake (meta) output is (B, H, Sq, Dv) with the query's layout, as the real one."""
    torch = pytest.importorskip("torch")
    import evotune.torch  # noqa: F401 (registers the op)
    from evotune.torch.call import output_layout

    q, k, v = (t.to("meta") for t in _mla_qkv(layout=layout))
    out = torch.ops.evotune.attention(q, k, v, True, None, False, "sdpa")
    assert tuple(out.shape) == (2, 4, 16, 128) and out.stride() == output_layout(q, v)[1]
    assert (out.stride(1) < out.stride(2)) == (layout == "bshd")


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"enable_gqa": True, "kv": 2}, {"layout": "bshd"},
                                {"softcap": 30.0}, {"window": (5, 0)}])
def test_op_fallback_on_cpu_matches_the_reference(kw, attention, fresh_op):
    """On CPU tensors the op falls back (told: device cpu) and its output, (B, H, Sq, 128) in q's layout, is within
    the gate of the fp32 reference (SDPA at dv != d; math for a softcap; SDPA with a mask for a window)."""
    torch = pytest.importorskip("torch")
    import evotune.torch as et
    from evotune.problems.attention import TOLERANCE

    kw = dict(kw)
    kv, layout = kw.pop("kv", None), kw.pop("layout", "bhsd")
    q, k, v = _mla_qkv(kv_heads=kv, layout=layout, sq=24)
    with pytest.warns(et.EvotuneFallbackWarning):
        out = et.attention(q, k, v, **kw)
    assert tuple(out.shape) == (2, 4, 24, 128) and (out.stride(1) < out.stride(2)) == (layout == "bshd")
    window = kw.get("window") or (-1, -1)
    shape = Shape(2, 4, 24, 24, 192, "bf16", kw.get("is_causal", False), layout, kv or 0, kw.get("softcap", 0.0),
                  window[0], window[1], head_dim_v=128)
    ref = attention.reference(shape, {"q": q, "k": k, "v": v, "scale": 192 ** -0.5})
    atol, rtol = TOLERANCE["bf16"]
    assert ((out.float() - ref).abs() <= atol * v.float().pow(2).mean().sqrt() + rtol * ref.abs()).all()
    assert "device cpu" in et.explain(q, k, v, **kw).reason


def test_op_with_gradients_takes_differentiable_sdpa(fresh_op):
    """A call that needs gradients runs SDPA with its own autograd (the op's backward is PyTorch's flash backward,
    which takes one head dim), told; its gradients equal SDPA's."""
    torch = pytest.importorskip("torch")
    import evotune.torch as et

    q, k, v = _mla_qkv(grad=True, dtype=torch.float32, sq=24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)
        out = et.attention(q, k, v, is_causal=True)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
    assert all(torch.allclose(g, t.grad, atol=1e-5) for g, t in zip(grads, (q, k, v)))


# ------------------------------------------------------------------ GPU

GPU_CASES = [
    "2,16,197,300,192:dv=128",              # ragged: tails in both tiles, Sq < Sk
    "1,16,1000,192:bf16:causal:dv=128",     # DeepSeek MLA prefill
    "2,16,513,192:bf16:causal:kv4:bshd:dv=128",
    "2,16,300,197,192:bf16:bshd:dv=128",    # Sq > Sk
    "4,20,777,192:causal:kv4:dv=128",       # enough query tiles for the persistent grid
    "2,16,1000,128:bf16:causal:dv=64",
    "1,16,1000,192:bf16:window=100,0:softcap=30:dv=128",
]


def _gate(attention, space, text, cfg):
    from _variant_pairs import assert_gate_passes

    assert_gate_passes(attention, space, text, cfg, skip_spills=True)


@pytest.mark.gpu
@pytest.mark.parametrize("text", GPU_CASES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_hopper_gate_passes(attention, space, text, name):
    """The full gate (NaN poison, perturbed keys, the fp32 reference's tolerance) passes over the kernel's pieces."""
    _gate(attention, space, text, {**HOPPER, **CONFIGS[name]})


@pytest.mark.gpu
@pytest.mark.parametrize("text", ["1,16,1000,192:bf16:causal:dv=128", "2,16,197,300,192:bf16:kv4:bshd:dv=128"])
def test_sdpa_baselines_pass_the_gate_where_they_run(attention, text):
    """SDPA's cuDNN, efficient and math backends, each probed: those that run compute the call within the gate (the
    ones that refuse it are printed, the record of what SDPA takes at dv != d)."""
    torch = pytest.importorskip("torch")
    from evotune.problems.attention import TOLERANCE

    shape = parse_shape(text)
    inputs = attention.make_inputs(shape, seed=1, device="cuda")
    ref = attention.reference(shape, inputs)
    atol, rtol = TOLERANCE[shape.dtype]
    ran = []
    for name in ("cudnn", "efficient", "math"):
        run = attention.baseline_launcher(name, shape, inputs)
        if run is None:
            print(f"{shape.spec}: SDPA {name} refuses dv != d")
            continue
        out = run()
        torch.cuda.synchronize()
        assert tuple(out.shape) == tuple(ref.shape)
        assert ((out.float() - ref).abs() <= atol * inputs["v"].float().pow(2).mean().sqrt() + rtol * ref.abs()).all()
        ran.append(name)
    print(f"{shape.spec}: SDPA backends that ran: {ran}")
    assert "math" in ran


@pytest.fixture
def gpu_h():
    torch = pytest.importorskip("torch")
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        pytest.skip("the kernels are compiled for sm_90a")
    return torch.cuda.get_device_name(0), f"{major}.{minor}"


def _cuda_qkv(shape: Shape, seed=0):
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[shape.dtype]

    def one(seq, heads, dim):
        if shape.layout == "bshd":
            return torch.randn(shape.batch, seq, heads, dim, generator=gen, device="cuda").to(dt).transpose(1, 2)
        return torch.randn(shape.batch, heads, seq, dim, generator=gen, device="cuda").to(dt)

    return (one(shape.seq_q, shape.heads, shape.head_dim), one(shape.seq_k, shape.kv_heads, shape.head_dim),
            one(shape.seq_k, shape.kv_heads, shape.dv))


def _assert_gate(attention, out, q, k, v, shape):
    from evotune.problems.attention import TOLERANCE

    ref = attention.reference(shape, {"q": q, "k": k, "v": v, "scale": shape.head_dim ** -0.5})
    atol, rtol = TOLERANCE[shape.dtype]
    err = (out.float() - ref).abs()
    assert bool((err <= atol * v.float().pow(2).mean().sqrt() + rtol * ref.abs()).all()), err.max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("text, name", [("2,16,1000,192:bf16:causal:dv=128", "onetile"),
                                        ("4,20,777,192:bf16:causal:kv4:bshd:dv=128", "tmastore"),
                                        ("2,16,300,197,128:dv=64", "onetile")])
def test_op_runs_the_kernel_from_a_table_entry(attention, space, gpu_h, text, name, monkeypatch):
    """With a hand-made entry for the call's key, the op runs our kernel (explain: tuned; no notice with
    fallback='error'), first and from its cached route, its output (B, H, Sq, Dv) in q's layout within the gate; the
    same sizes at one head dim are another key (missing)."""
    import torch

    import evotune.torch as et
    from evotune.torch import launcher

    from _tables import entry, table

    monkeypatch.delenv(launcher.ENV, raising=False)
    shape = parse_shape(text)
    cfg = {**_defaults(), **HOPPER, **CONFIGS[name]}
    if space.violations(space.config(cfg), shape_context(shape)):
        pytest.skip("not admitted on this shape")
    et.use_table(table(entry(shape, cfg, gpu=gpu_h)))
    try:
        q, k, v = _cuda_qkv(shape)
        gqa = shape.kv_heads != shape.heads
        info = et.explain(q, k, v, is_causal=shape.causal, enable_gqa=gqa)
        assert (info.route, info.kind) == ("evotune", "tuned"), str(info)
        for _ in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("error", et.EvotuneFallbackWarning)
                out = et.attention(q, k, v, is_causal=shape.causal, enable_gqa=gqa, fallback="error")
            torch.cuda.synchronize()
            assert tuple(out.shape) == (shape.batch, shape.heads, shape.seq_q, shape.dv)
            assert (out.stride(1) < out.stride(2)) == (shape.layout == "bshd")
            _assert_gate(attention, out, q, k, v, shape)
        same = torch.randn(*v.shape[:-1], shape.head_dim, device="cuda", dtype=v.dtype)
        assert et.explain(q, k, same, is_causal=shape.causal, enable_gqa=gqa).kind == "missing"
    finally:
        et.use_table(None)


@pytest.mark.gpu
@pytest.mark.parametrize("text", ["2,16,513,192:bf16:causal:dv=128", "2,16,300,197,192:bf16:kv4:bshd:dv=128"])
def test_op_fallback_on_the_gpu_passes_the_gate(attention, gpu_h, text):
    """Without a table entry the op's fallback (SDPA, dv != d) passes the gate on the GPU."""
    import torch

    import evotune.torch as et

    from _tables import table

    et.use_table(table())
    try:
        shape = parse_shape(text)
        q, k, v = _cuda_qkv(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", et.EvotuneFallbackWarning)
            out = et.attention(q, k, v, is_causal=shape.causal, enable_gqa=shape.kv_heads != shape.heads)
        torch.cuda.synchronize()
        assert tuple(out.shape) == (shape.batch, shape.heads, shape.seq_q, shape.dv)
        _assert_gate(attention, out, q, k, v, shape)
    finally:
        et.use_table(None)
