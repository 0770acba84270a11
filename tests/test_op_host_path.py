"""CPU tests of the op's per-call host path (issue 41): the op's registration without custom_op's wrapper layers,
the SDPA route as one SDPA call, and the host-overhead and end-to-end tools' options and records."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import evotune.torch as et  # noqa: E402
from evotune.torch import routing  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
from _torch_inputs import fresh_routing, qkv  # noqa: E402,F401 (fresh_routing: autouse)

F = torch.nn.functional
sys.path.insert(0, str(REPO_ROOT / "tools"))


@pytest.fixture
def counted_sdpa(monkeypatch):
    """F.scaled_dot_product_attention wrapped to count its calls and keep its last result."""
    real = F.scaled_dot_product_attention
    seen = {"calls": 0, "last": None}

    def counting(*args, **kwargs):
        seen["calls"] += 1
        seen["last"] = real(*args, **kwargs)
        return seen["last"]

    monkeypatch.setattr(F, "scaled_dot_product_attention", counting)
    return seen


def test_op_kernels_are_the_body_itself():
    """evotune::attention has one backend kernel (every device) and a meta one, and no autograd kernel of its own:
    a compiled graph's call goes from the dispatcher straight to the op's body (custom_op adds Python layers)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("evotune::attention", "CompositeExplicitAutograd") and has("evotune::attention", "Meta")
    assert not any(has("evotune::attention", key) for key in ("Autograd", "AutogradCPU", "AutogradCUDA"))


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_fallback_route_is_one_sdpa_call(counted_sdpa, layout):
    """After its first call, an SDPA route costs one SDPA call per call, and returns SDPA's own tensor where SDPA's
    layout is the op's (no output allocated, no copy); otherwise the values in the query's layout."""
    q, k, v = qkv(layout=layout, sq=8, sk=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)
        first = et.attention(q, k, v, is_causal=True)
    assert counted_sdpa["calls"] == 1 and len(routing.FAST_ROUTES) == 1
    for n in range(2, 5):
        out = et.attention(q, k, v, is_causal=True)
        assert counted_sdpa["calls"] == n
    torch.testing.assert_close(out, first)
    if counted_sdpa["last"].stride() == out.stride():
        assert out is counted_sdpa["last"]
    assert (out.stride(1) < out.stride(2)) == (layout == "bshd")


def test_dispatcher_call_reuses_the_eager_route(counted_sdpa):
    """torch.ops.evotune.attention (what a compiled graph calls) takes the route cached by an eager call: one SDPA
    call, no second decision."""
    q, k, v = qkv(sq=8, sk=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", et.EvotuneFallbackWarning)
        et.attention(q, k, v)
    route = next(iter(routing.FAST_ROUTES.values()))
    routing.FAST_ROUTES[next(iter(routing.FAST_ROUTES))] = lambda q, k, v: ("cached", route(q, k, v))[1]
    out = torch.ops.evotune.attention.default(q, k, v, False, None, False, "sdpa")
    assert counted_sdpa["calls"] == 2
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("argv, fault", [
    (["--rows", "sdpa,nope"], "bad --rows nope"),
    (["--rounds", "0"], "at least 1"),
])
def test_host_overhead_bad_options_exit_2(argv, fault, capsys):
    """tools/op_host_overhead.py: a bad option is one line and exit status 2, before any tensor is made."""
    import op_host_overhead

    with pytest.raises(SystemExit) as e:
        op_host_overhead.parse_args(argv)
    assert e.value.code == 2 and fault in capsys.readouterr().err


@pytest.mark.parametrize("argv, fault", [
    (["--size", "512", "--table", __file__], "--size takes BxS"),
    (["--table", "/nonexistent/table.json"], "no tuning table at /nonexistent/table.json"),
])
def test_profile_forward_bad_options_exit_2(argv, fault, capsys):
    """tools/profile_forward.py: a bad option is one line and exit status 2, before any model is built."""
    import profile_forward

    with pytest.raises(SystemExit) as e:
        profile_forward.parse_args(argv)
    assert e.value.code == 2 and fault in capsys.readouterr().err


@pytest.mark.parametrize("argv, fault", [
    (["--e2e", "--prefill", "mistral:1x8"], "bad size 'mistral:1x8'"),
    (["--e2e", "--prefill-modes", "eager,fast"], "--prefill-modes of"),
    (["--e2e", "--tune-only"], "--tune-only needs --tune-trials"),
    (["--e2e", "--table", "/nonexistent/table.json"], "no tuning table at /nonexistent/table.json"),
])
def test_model_bench_e2e_bad_options_exit_2(argv, fault, capsys):
    """tools/model_bench.py --e2e: a bad option is one line and exit status 2, before any model is built."""
    import model_bench

    with pytest.raises(SystemExit) as e:
        model_bench.run_e2e(model_bench.parse_args(["--device", "cpu", "--tiny"] + argv))
    assert e.value.code == 2 and fault in capsys.readouterr().err


@pytest.mark.slow
def test_model_bench_e2e_tiny_cpu(tmp_path):
    """--e2e on tiny CPU models: a prefill row in alternating rounds with its ratio and logits check, a generate()
    row with time to first token and decode rates, and every attention call counted (none reached a kernel on
    the CPU)."""
    import model_bench

    args = model_bench.parse_args(["--device", "cpu", "--tiny", "--e2e", "--prefill", "gpt2:1x8", "--generate",
                                   "llama:1x8", "--prefill-modes", "eager,graph", "--generate-modes", "dynamic",
                                   "--rounds", "2", "--reps", "2", "--warmup", "1", "--new-tokens", "6"])
    result = model_bench.run_e2e(args)
    (row,), (gen,) = result["prefill"], result["generate"]
    eager = row["modes"]["eager"]
    assert len(eager["evotune"]["rounds_ms"]) == 2 and eager["ratio"]["min"] <= eager["ratio"]["median"]
    assert row["modes"]["graph"] == {"skipped": "CUDA graphs need a CUDA device"}
    assert row["logits"]["ok"] and not result["failed_checks"]
    assert row["kernel"]["attention_calls"] == 2 and row["kernel"]["kernel_calls"] == 0  # 2 layers, CPU: SDPA
    dyn = gen["modes"]["dynamic"]
    assert "ratio" in dyn["ttft"] and dyn["same_tokens"] == 1.0, dyn
    # Decode rates, unless this (loaded) machine's noise beat the few decode steps, which the row then says.
    assert set(dyn.get("decode_tokens_per_s", {"sdpa_unpacked", "evotune"})) == {"sdpa_unpacked", "evotune"}
    assert "decode_ratio" in dyn or "raise --new-tokens" in dyn["decode_error"]
    assert gen["kernel"]["attention_calls"] == 2 * 4  # the count's run: 2 layers, a prefill and 3 decode steps
    text = model_bench.e2e_markdown(result)
    assert "| gpt2 | 1x8 | eager |" in text and "| llama | 1x8 | dynamic |" in text
    json.dumps(result, default=str)
