"""CPU tests of the op's training path (evotune.torch.autograd) and its launch packet (evotune.gpu.packet):
the training op's registration (opcheck) and fake implementation, which PyTorch backward takes a call and
the log-sum-exp layout it reads, gradients against SDPA on the CPU route (grouped K/V heads, Sq != Sk,
layouts, dtypes), torch.compile(fullgraph=True) with a backward, the log-sum-exp kernels compiling for
every variant of the family (NVRTC, no GPU), and the parameter packet's bytes against CuPy's arguments."""

from __future__ import annotations


import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.problems import get_problem  # noqa: E402
from evotune.space.searchspace import Config, load_builtin  # noqa: E402
from evotune.torch import autograd  # noqa: E402

import _torch_inputs as _inputs  # noqa: E402
from _torch_inputs import fresh_routing  # noqa: E402,F401 (autouse)

F = torch.nn.functional
TRAIN_OP = torch.ops.evotune.attention_lse.default
quiet = _inputs.quiet
ATTENTION = get_problem("attention")


def qkv(**kwargs):
    """Shared inputs (tests/_torch_inputs.py), fp32 with gradients unless told otherwise."""
    return _inputs.qkv(**{"dtype": torch.float32, "seed": 1, "grad": True, **kwargs})


def test_training_op_is_registered_without_mutation():
    schema = TRAIN_OP._schema
    assert schema.name == "evotune::attention_lse"
    assert [a.name for a in schema.arguments] == ["q", "k", "v", "is_causal", "scale", "enable_gqa", "fallback"]
    assert len(schema.returns) == 2
    assert not any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
def test_training_op_opcheck(layout, causal):
    """opcheck: schema, the registered autograd, fake against real, AOT dispatch."""
    q, k, v = qkv(layout=layout)
    quiet(torch.library.opcheck, TRAIN_OP, (q, k, v, causal, None, False, "sdpa"))


def test_lse_backend_and_layout():
    """The backward is chosen from static facts, and the log-sum-exp has the rows that backward reads."""
    from types import SimpleNamespace

    def cuda(sq, sk, dtype=torch.float16, d=64):  # the facts lse_backend reads (no CUDA build here)
        return (SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(1, 2, sq, d)),
                SimpleNamespace(device=torch.device("cuda", 0), dtype=dtype, shape=(1, 2, sk, d)))

    assert autograd.lse_backend(*cuda(100, 100), is_causal=True) == "flash"
    assert autograd.lse_backend(*cuda(100, 300), is_causal=False) == "flash"
    assert autograd.lse_backend(*cuda(100, 300), is_causal=True) == "efficient"  # flash aligns bottom-right
    assert autograd.lse_backend(*cuda(100, 100, torch.float32), is_causal=False) == "efficient"
    assert autograd.lse_backend(*cuda(100, 100, torch.float64), is_causal=False) is None
    meta_q = torch.empty(1, 2, 100, 64, device="meta")
    assert autograd.new_lse(meta_q, "flash").shape == (1, 2, 100)
    assert autograd.new_lse(meta_q, "efficient").shape == (1, 2, 128)
    assert autograd.new_lse(meta_q, "flash").dtype == torch.float32
    assert autograd.lse_backend(meta_q, meta_q, True) is None
    cpu_q = torch.empty(1, 2, 5, 64)
    assert autograd.lse_backend(cpu_q, cpu_q, True) == "cpu"


@pytest.mark.parametrize("case", [
    dict(), dict(causal=True), dict(causal=True, sq=33, sk=17), dict(layout="bshd", causal=True),
    dict(kv_heads=2, causal=True), dict(kv_heads=1, layout="bshd"), dict(dtype=torch.bfloat16, causal=True),
    dict(scale=0.3, sq=40, sk=40, d=128),
])
def test_gradients_match_sdpa(case):
    """Forward and dQ, dK, dV through the training op equal SDPA's (CPU route: PyTorch's CPU flash kernels,
    grouped K/V heads expanded and their gradients summed back)."""
    causal, scale = case.pop("causal", False), case.pop("scale", None)
    q, k, v = qkv(**case)
    gqa = q.shape[1] != k.shape[1]
    out = quiet(et.attention, q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    grad = torch.randn_like(out)
    out.backward(grad)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, is_causal=causal, scale=scale, enable_gqa=gqa)
    ref.backward(grad)
    tol = dict(atol=2e-2, rtol=2e-2) if q.dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out, ref, **tol)
    assert out.stride() == autograd.new_output(q, v).stride()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **tol)


def test_no_grad_calls_take_the_forward_op():
    """Without grad the forward-only path runs (no log-sum-exp is made)."""
    q, k, v = qkv()
    with torch.no_grad():
        out = quiet(et.attention, q, k, v)
    assert out.grad_fn is None


def test_torch_compile_fullgraph_with_backward():
    """torch.compile(fullgraph=True) traces the training op and its backward with no graph break."""
    torch._dynamo.reset()
    q, k, v = qkv(layout="bshd", kv_heads=2)
    fn = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal=True, enable_gqa=True).square().sum(),
                       fullgraph=True, backend="aot_eager")
    quiet(fn, q, k, v).backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=True).square().sum().backward()
    for got, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# --------------------------------------------------------------------------- the log-sum-exp kernels


LSE_VARIANTS = {  # every code path of the epilogue: plain, key groups, split-KV, Hopper
    "plain": ("attention", {}),
    "key_groups": ("attention", {"block_m": 32, "block_n": 64, "compute_warps": 4, "warp_key_groups": 2}),
    "kv_splits": ("attention", {"kv_splits": 2}),
    "wgmma": ("attention-hopper", {}),
}


@pytest.mark.parametrize("variant", sorted(LSE_VARIANTS))
@pytest.mark.parametrize("spec", ["1,8,512,64", "1,32,300,500,128:bf16:causal:bshd:kv8"])
def test_lse_kernels_compile(variant, spec):
    """Each variant compiles with write_lse (NVRTC, no GPU), takes lse, lse_sb, lse_sh last, and costs no
    spill; the searched kernel's source (the table's digest) is unchanged by the option."""
    from evotune.build.compile import compile_source
    from evotune.problems.shapes import parse_shape
    from evotune.build.template import instantiate

    space, knobs = LSE_VARIANTS[variant]
    base = load_builtin(space).default_config()
    config = Config.from_dict({**base.as_dict(), **knobs})
    shape = parse_shape(spec)
    plain, with_lse = instantiate(ATTENTION, config, shape), instantiate(ATTENTION, config, shape, write_lse=True)
    assert plain.code == instantiate(ATTENTION, config, shape).code and plain.code != with_lse.code
    assert "float* __restrict__ lse, long long lse_sb, long long lse_sh" in with_lse.code
    assert "lse_sb" not in plain.code.split("evotune instantiation")[-1]
    compiled = compile_source(with_lse.code, with_lse.entry)
    assert compiled.resources.spill_stores == 0 and compiled.resources.stack_frame == 0
    names = [n for n, _ in ATTENTION.entry_params(config, write_lse=True)]
    assert names[-3:] == ["lse", "lse_sb", "lse_sh"] and names[:-3] == [n for n, _ in ATTENTION.entry_params(config)]


# --------------------------------------------------------------------------- the launch packet


def test_packet_holds_the_values_cupy_would_pass():
    """Every parameter's bytes in the packet equal the numpy value CuPy's launcher passes, and a patched
    address changes only its own slot."""
    import numpy as np

    from evotune.gpu.packet import ParamPacket
    from evotune.problems.attention import as_kernel_arg

    params = ATTENTION.entry_params(load_builtin("attention").default_config(), write_lse=True)
    values = {name: (i + 1) * 1024 if kind in ("ptr", "i64") else i + 1 for i, (name, kind) in enumerate(params)}
    values["scale_log2"] = 0.125 * 1.4426950408889634
    packet = ParamPacket(params, values)
    for name, kind in params:
        assert packet.as_bytes(name) == np.asarray(as_kernel_arg(kind, values[name])).tobytes(), name
    packet.slot("q").value = 0xDEAD0000
    assert packet.as_bytes("q") == np.uint64(0xDEAD0000).tobytes() and packet.as_bytes("k") == np.uint64(2048).tobytes()
    record = np.frombuffer(bytes(range(128)), dtype=np.dtype((np.void, 128)))
    map_packet = ParamPacket((("q_map", "map"), ("o", "ptr")), {"q_map": record, "o": 16})
    assert map_packet.as_bytes("q_map") == bytes(range(128))
    map_packet.set_map("q_map", np.frombuffer(bytes(128), dtype=np.dtype((np.void, 128))))
    assert map_packet.as_bytes("q_map") == bytes(128)
    with pytest.raises(ValueError, match="unknown kind"):
        ParamPacket((("x", "f64"),), {"x": 1.0})
