"""The transformers adapter's decode route (evotune.torch.hf.decode_call) on the CPU: which calls go to
evotune.torch.decode.decode_attention, and that they compute what transformers' sdpa does."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from evotune.problems.decode import bottom_right_mask, reference_decode  # noqa: E402
from evotune.torch import decode as D  # noqa: E402
from evotune.torch import hf  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv(D.TABLE_ENV, str(tmp_path / "absent.json"))
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "absent-too.json"))
    D.use_decode_table(None)
    D.clear()
    hf.reset_stats()
    hf.register()
    yield
    D.clear()


def _qkv(sq, sk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 8, sq, 64, generator=gen), torch.randn(2, 2, sk, 64, generator=gen),
            torch.randn(2, 2, sk, 64, generator=gen))


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4  # 8 query heads over 2 K/V heads: what transformers reads to repeat K/V


def _forward(q, k, v, mask):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = hf.attention_forward(_Module(), q, k, v, mask, scaling=0.125)
    return out, " ".join(str(w.message) for w in caught)


@pytest.mark.parametrize("sq", [1, 4])
def test_decode_steps_and_bottom_right_chunks_take_the_decode_op(sq):
    """One query without a mask, or a chunk under exactly the bottom-right causal mask, goes to decode_attention
    (here its SDPA route, told by evotune.torch.decode) and returns (B, Sq, H, D) of the bottom-right answer."""
    q, k, v = _qkv(sq, 40)
    mask = None if sq == 1 else bottom_right_mask(sq, 40, "cpu").expand(2, 1, sq, 40)
    out, told = _forward(q, k, v, mask)
    assert "evotune.torch.decode" in told and hf.stats() == {"evotune": 1} and hf.fallbacks() == {}
    want = reference_decode(q, k, v, 0.125, causal=sq > 1).transpose(1, 2)
    assert out.shape == (2, sq, 8, 64) and torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("case", ["padded chunk", "static cache step"])
def test_other_masks_keep_the_adapters_path(case):
    """A chunk mask with padding, and a StaticCache step's mask over the whole cache, are not decode calls."""
    if case == "padded chunk":
        q, k, v = _qkv(4, 40)
        mask = bottom_right_mask(4, 40, "cpu").expand(2, 1, 4, 40).clone()
        mask[0, :, :, :3] = False  # left padding in the first sequence
    else:
        q, k, v = _qkv(1, 64)
        mask = torch.zeros(2, 1, 1, 64, dtype=torch.bool)
        mask[..., :30] = True  # 30 filled slots of a 64-slot cache
    out, told = _forward(q, k, v, mask)
    assert "evotune.torch.decode" not in told and hf.fallbacks()
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)
    assert torch.allclose(out, ref.transpose(1, 2), atol=1e-5)


def test_decode_step_compiles_without_a_graph_break():
    """torch.compile(fullgraph=True) traces the adapter's decode route as one graph (the op is an opaque node)."""
    q, k, v = _qkv(1, 40)
    step = torch.compile(lambda q, k, v: hf.attention_forward(_Module(), q, k, v, None, scaling=0.125)[0],
                         fullgraph=True, backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = step(q, k, v)
    assert torch.allclose(out, reference_decode(q, k, v, 0.125, causal=False).transpose(1, 2), atol=1e-5)
