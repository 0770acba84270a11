"""The compiled launcher (evotune.torch.launcher, on by default) on the GPU: its launches write the same bytes as the
Python route's on every variant (pointers, TMA maps re-encoded for new addresses, the persistent grid's counters,
split-KV workspace), eager calls reach it through its Python entry (attention() and the transformers adapter's
eager_attention), CUDA-graph capture and torch.compile run through it, and what it has no route for (a view off a
16-byte boundary) comes back to Python; an SDPA route runs SDPA from C++. In a fresh process the first calls run
Python while the library builds in the background, and a call after the build loads it."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.problems.shapes import Shape  # noqa: E402
from evotune.space.searchspace import load_builtin  # noqa: E402
from evotune.torch import launcher  # noqa: E402
from evotune.torch.routing import FAST_ROUTES  # noqa: E402

from _tables import entry, table  # noqa: E402
from test_torch_gpu import assert_close, make_qkv, use_variant  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cpp():
    """The launcher built and loaded; afterwards no new route registers with it (later tests' calls that reach its
    CUDA kernel miss and run the Python body, as without it)."""
    name = torch.cuda.get_device_name(0)
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        pytest.skip(f"the kernels are compiled for sm_90a; this GPU is {name} ({major}.{minor})")
    mp = pytest.MonkeyPatch()
    mp.delenv(launcher.ENV, raising=False)
    if not launcher.load(wait=True):
        pytest.fail(f"the compiled launcher did not load: {launcher.why_not()}")
    yield name, f"{major}.{minor}"
    launcher.clear()
    launcher._STATE["loaded"] = launcher.ACTIVE[0] = False
    launcher.CALL[0] = None
    mp.undo()
    et.use_table(None)


def python_route(q, k, v, causal):
    """The cached route's Python launch for these facts (what the launcher's route must match byte for byte)."""
    fast = FAST_ROUTES[(q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                        q.device, k.device, v.device, causal, None, False, "sdpa", 0.0, -1, -1)]
    assert hasattr(fast, "python"), "the route did not register with the compiled launcher"
    return fast.python(q, k, v)


SHAPE = Shape(2, 8, 384, 384, 64, "fp16", True, "bshd")


@pytest.mark.parametrize("variant", ["sync", "split", "wgmma", "persistent"])
def test_launches_match_the_python_route_bitwise(cpp, variant):
    """Each variant's launch through the launcher writes what the Python route writes, on the first inputs and on
    fresh buffers (new addresses: the TMA maps re-encoded), and passes the gate."""
    shape = SHAPE if variant != "persistent" else Shape(2, 16, 1024, 1024, 64, "bf16", True)
    use_variant(cpp, variant, [shape])
    q, k, v = make_qkv(shape, seed=1)
    first = et.attention(q, k, v, is_causal=True, fallback="sdpa")  # decides, registers the route
    before = launcher.counts()
    assert before["routes"] == 1
    for seed in (1, 2):
        q, k, v = make_qkv(shape, seed=seed)
        ours = et.attention(q, k, v, is_causal=True)
        theirs = python_route(q, k, v, True)
        torch.cuda.synchronize()
        assert torch.equal(ours, theirs) and ours.stride() == theirs.stride()
        assert_close(ours, q, k, v, shape)
    assert torch.equal(first, et.attention(*make_qkv(shape, seed=1), is_causal=True))
    after = launcher.counts()
    assert after["launches"] == before["launches"] + 3 and after["direct"] == before["direct"] + 3


def test_the_adapters_eager_calls_reach_the_launcher(cpp):
    """The transformers adapter's per-layer entry (eager_attention) serves a plain call from the library's Python
    entry, with the bytes of the Python route."""
    from evotune.torch.op import eager_attention

    use_variant(cpp, "wgmma", [SHAPE])
    q, k, v = make_qkv(SHAPE, seed=12)
    et.attention(q, k, v, is_causal=True)
    before = launcher.counts()
    ours = eager_attention(q, k, v, True, None, False)
    after = launcher.counts()
    assert after["direct"] == before["direct"] + 1 and after["launches"] == before["launches"] + 1
    assert torch.equal(ours, python_route(q, k, v, True))


def test_dispatcher_and_compile_reach_the_launcher(cpp):
    """torch.ops.evotune.attention and a torch.compile(fullgraph=True) graph launch through the C++ kernel."""
    use_variant(cpp, "wgmma", [SHAPE])
    q, k, v = make_qkv(SHAPE, seed=3)
    eager = et.attention(q, k, v, is_causal=True)
    start = launcher.counts()["launches"]
    direct = torch.ops.evotune.attention.default(q, k, v, True, None, False, "sdpa")
    compiled = torch.compile(lambda q, k, v: et.attention(q, k, v, is_causal=True) * 1, fullgraph=True)
    out = compiled(q, k, v)
    out = compiled(q, k, v)
    torch.cuda.synchronize()
    assert torch.equal(direct, eager) and torch.equal(out, eager)
    assert launcher.counts()["launches"] >= start + 3


def test_graph_capture_through_the_launcher(cpp):
    """A CUDA graph captured through the launcher replays the kernel on new inputs copied into its buffers."""
    use_variant(cpp, "wgmma", [SHAPE])
    q, k, v = make_qkv(SHAPE, seed=5)
    et.attention(q, k, v, is_causal=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        et.attention(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    start = launcher.counts()["launches"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = et.attention(q, k, v, is_causal=True)
    assert launcher.counts()["launches"] == start + 1
    for seed in (6, 7):
        for dst, src in zip((q, k, v), make_qkv(SHAPE, seed=seed)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, python_route(q, k, v, True))


def test_misaligned_view_comes_back_to_python(cpp):
    """A view 8 bytes past a 16-byte boundary (same sizes and strides) is handed back, not launched, and computed."""
    use_variant(cpp, "sync", [Shape(1, 2, 64, 64, 64, "fp16", False, "bhsd")])
    q, k, v = (t.contiguous() for t in make_qkv(Shape(1, 2, 64, 64, 64, "fp16", False, "bhsd"), seed=8))
    et.attention(q, k, v)
    base = torch.empty(q.numel() + 4, dtype=q.dtype, device=q.device)
    odd = base[4:].view_as(q)
    odd.copy_(q)
    assert odd.data_ptr() % 16 == 8 and odd.stride() == q.stride()
    counts = launcher.counts()
    out = et.attention(odd, k, v)  # the Python entry declines it: the route's Python launch, which checks it too
    after = launcher.counts()
    assert after["launches"] == counts["launches"] and after["direct"] == counts["direct"]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=2e-3, rtol=2e-3)
    out = torch.ops.evotune.attention.default(odd, k, v, False, None, False, "sdpa")  # the dispatcher hands it back
    again = launcher.counts()
    assert again["misses"] == after["misses"] + 1 and again["launches"] == after["launches"]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_sdpa_route_runs_from_cpp(cpp, layout):
    """A key the table lacks: the launcher's SDPA route returns SDPA's values in the op's layout (the query's), eager
    and through the dispatcher, without handing the call back."""
    et.use_table(None)
    shape = Shape(1, 4, 128, 128, 64, "fp16", True, layout)
    q, k, v = make_qkv(shape, seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)  # the missing key, told once
        et.attention(q, k, v, is_causal=True)
    counts = launcher.counts()
    out = et.attention(q, k, v, is_causal=True)
    direct = torch.ops.evotune.attention.default(q, k, v, True, None, False, "sdpa")
    after = launcher.counts()
    assert after["sdpa"] == counts["sdpa"] + 2 and after["misses"] == counts["misses"]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, ref) and torch.equal(direct, ref)
    assert (out.stride(1) < out.stride(2)) == (layout == "bshd")


def test_softcap_and_window_calls_come_back_to_python(cpp):
    """With a dense route registered for the same facts, a window + softcap call through the op is handed back
    unread (launcher.cpp's key has no mods; the op registers none for them) and runs its own kernel route from Python,
    passing the gate; the dense call still launches from C++."""
    dense = Shape(2, 8, 256, 256, 64, "bf16")
    capped = Shape(2, 8, 256, 256, 64, "bf16", softcap=30.0, window_left=31, window_right=0)
    hopper = {**load_builtin("attention").default_config().as_dict(), "mma": "wgmma", "block_m": 128,
              "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2, "q_in_regs": False}
    et.use_table(table(entry(dense, hopper, gpu=cpp), entry(capped, hopper, gpu=cpp)))
    q, k, v = make_qkv(dense, seed=10)
    et.attention(q, k, v)
    routes = launcher.counts()["routes"]
    for _ in range(2):
        counts = launcher.counts()
        out = torch.ops.evotune.attention.default(q, k, v, False, None, False, "error", 30.0, 31, 0)
        after = launcher.counts()
        assert after["misses"] == counts["misses"] + 1 and after["launches"] == counts["launches"]
    assert launcher.counts()["routes"] == routes
    torch.cuda.synchronize()
    assert_close(out, q, k, v, capped)
    counts = launcher.counts()
    et.attention(q, k, v)
    assert launcher.counts()["launches"] == counts["launches"] + 1


def test_sinks_calls_come_back_to_python(cpp):
    """With a dense route registered for the same facts, a sinks call through the op is handed back unread
    (launcher.cpp's key has no sinks; the op registers none for them) and runs its own kernel route from Python,
    passing the gate against the reference's sink column; the dense call still launches from C++."""
    from evotune.problems import get_problem
    from evotune.problems.attention import TOLERANCE

    dense = Shape(2, 8, 256, 256, 64, "bf16")
    sunk = Shape(2, 8, 256, 256, 64, "bf16", sinks=True)
    hopper = {**load_builtin("attention").default_config().as_dict(), "mma": "wgmma", "block_m": 128,
              "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2, "q_in_regs": False}
    et.use_table(table(entry(dense, hopper, gpu=cpp), entry(sunk, hopper, gpu=cpp)))
    q, k, v = make_qkv(dense, seed=11)
    sinks = (torch.randn(8, device="cuda") * 2 + 6).to(torch.bfloat16)
    et.attention(q, k, v)
    routes = launcher.counts()["routes"]
    for _ in range(2):
        counts = launcher.counts()
        out = torch.ops.evotune.attention.default(q, k, v, False, None, False, "error", 0.0, -1, -1, sinks)
        after = launcher.counts()
        assert after["misses"] == counts["misses"] + 1 and after["launches"] == counts["launches"]
    assert launcher.counts()["routes"] == routes
    torch.cuda.synchronize()
    ref = get_problem("attention").reference(sunk, {"q": q, "k": k, "v": v, "scale": 0.125, "sinks": sinks.float()})
    atol, rtol = TOLERANCE["bf16"]
    assert bool(((out.float() - ref).abs() <= atol * v.float().pow(2).mean().sqrt() + rtol * ref.abs()).all())
    counts = launcher.counts()
    et.attention(q, k, v)
    assert launcher.counts()["launches"] == counts["launches"] + 1


_FRESH_PROCESS = """
import sys, time, warnings
sys.path.insert(0, "tests")
import torch
import evotune.torch as et
from evotune.problems.shapes import Shape
from evotune.torch import launcher
from test_torch_gpu import make_qkv, use_variant

warnings.simplefilter("ignore")
shape = Shape(2, 8, 384, 384, 64, "fp16", True, "bshd")
gpu = (torch.cuda.get_device_name(0), "%d.%d" % torch.cuda.get_device_capability(0))
use_variant(gpu, "wgmma", [shape])
q, k, v = make_qkv(shape, seed=13)
first = et.attention(q, k, v, is_causal=True)   # works the route out: the build starts in the background
assert launcher.ACTIVE == [False] and launcher._STATE["build"] is not None
start = time.time()
while launcher._STATE["build"].is_alive() and time.time() - start < 400:
    assert torch.equal(et.attention(q, k, v, is_causal=True), first)   # meanwhile: the Python route
    time.sleep(0.5)
assert launcher.PENDING == [True], launcher._STATE
assert torch.equal(et.attention(q, k, v, is_causal=True), first)        # loads it, forgets the Python routes
assert launcher.ACTIVE == [True], launcher.why_not()
assert torch.equal(et.attention(q, k, v, is_causal=True), first)        # the route registers with the library
before = launcher.counts()
out = et.attention(q, k, v, is_causal=True)
after = launcher.counts()
torch.cuda.synchronize()
assert torch.equal(out, first) and after["direct"] == before["direct"] + 1, (before, after)
print("ok", round(time.time() - start, 1))
"""


def test_a_fresh_process_builds_in_the_background_and_loads_it(tmp_path):
    """The product's default in a new process with an empty cache: the first calls run Python while the library
    builds, the call after the build loads it, and later calls are served from its Python entry, same bytes."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("the kernels are compiled for sm_90a")
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != launcher.ENV}
    env.update(EVOTUNE_CACHE=str(tmp_path), PYTHONPATH=str(root))
    done = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, env=env, cwd=root,
                          timeout=540)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout[-2000:] + done.stderr[-4000:]
