"""evotune.torch.hf with logit softcap and sliding windows (issue 42), on the CPU: transformers' sliding window against
the op's window (the off-by-one), the mask builder's plain-sliding rule, and tiny random-weight Gemma-2 and Mistral
models whose logits equal transformers' eager / sdpa, with the calls that reach the op (and their softcap and window)
and those that fall back counted."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import evotune.torch as et  # noqa: E402
from evotune.problems.attention import visibility_mask  # noqa: E402
from evotune.problems.shapes import Shape  # noqa: E402
from evotune.torch import EvotuneFallbackWarning, fallback, hf  # noqa: E402

LAYERS = 2
WINDOW = 8  # transformers' sliding_window: keys per query, its own included


def tiny_gemma2(softcap=5.0, window=WINDOW):
    """Gemma-2 with its alternating sliding / full layers; a cap of 5 so the tanh bends the (small) scores."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       sliding_window=window, query_pre_attn_scalar=16, attn_logit_softcapping=softcap)
    return Gemma2ForCausalLM(cfg).eval()


def tiny_mistral(window=WINDOW):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        sliding_window=window)
    return MistralForCausalLM(cfg).eval()


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """No tuning table, notices and counts forgotten, the adapter registered."""
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "absent.json"))
    et.use_table(None)
    hf.reset_stats()
    hf.register()
    yield
    et.use_table(None)
    hf.register()


def ids_of(batch=2, seq=24, seed=1):
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def run_evotune(model, ids, **kw):
    """The evotune model's logits, the op's recorded rows and the fallback notices."""
    with warnings.catch_warnings(record=True) as caught, et.record_shapes() as rec:
        warnings.simplefilter("always")
        out = logits(model, "evotune", ids, **kw)
    return out, rec.shapes, [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)]


# --------------------------------------------------------------------------- the window's spelling


@pytest.mark.parametrize("seq, window", [(12, 1), (12, 4), (24, 8), (9, 9), (7, 20)])
def test_transformers_sliding_window_is_the_ops_window_minus_one(seq, window):
    """transformers' sliding_window W (sliding_window_causal_mask_function: key > query - W, causal) is the mask of
    flash-attention's window_size (W - 1, 0): the op's window=(W - 1, 0), as the fp32 reference and the fallback
    build it (and as transformers' own flash-attention path passes window_size[0] = W - 1)."""
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    theirs = sdpa_mask(batch_size=1, q_length=seq, kv_length=seq, mask_function=sliding_window_causal_mask_function(
        window), allow_is_causal_skip=False)[0, 0]
    ours = visibility_mask(Shape(1, 1, seq, seq, 64, window_left=window - 1, window_right=0))
    assert torch.equal(theirs, ours)
    assert torch.equal(fallback.window_mask(seq, seq, False, (window - 1, 0), "cpu")[0], theirs)


def test_mask_builder_leaves_out_only_the_plain_sliding_mask():
    """sliding_window_mask returns None for the plain sliding-window causal mask of an unpadded prefill, and transformers'
    sdpa mask otherwise: a padded batch, queries past key 0, a chunked mask, a caller's allow_is_causal_skip=False, a
    window other than the config's, a model with other layer kinds."""
    from transformers import MistralConfig
    from transformers.masking_utils import chunked_causal_mask_function, sliding_window_causal_mask_function

    cfg = MistralConfig(sliding_window=4)
    plain = {"batch_size": 2, "q_length": 10, "kv_length": 10, "mask_function": sliding_window_causal_mask_function(4),
             "local_size": 4, "config": cfg}
    assert hf.sliding_window_mask(**plain) is None
    assert hf.sliding_window_mask(**plain, attention_mask=torch.ones(2, 10, dtype=torch.bool)) is None
    padded = torch.ones(2, 10, dtype=torch.bool)
    padded[0, :3] = False
    chunked = chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
    other_layers = SimpleNamespace(sliding_window=4, layer_types=["sliding_attention", "compressed_sparse_attention"])
    for change in ({"attention_mask": padded}, {"q_offset": 2, "kv_length": 12}, {"mask_function": chunked},
                   {"allow_is_causal_skip": False}, {"config": MistralConfig(sliding_window=6)},
                   {"config": other_layers}):
        built = hf.sliding_window_mask(**{**plain, **change})
        assert isinstance(built, torch.Tensor) and built.dtype == torch.bool, change


def test_another_attention_function_keeps_sdpas_masks():
    """register(attention_function=...) keeps transformers' sdpa mask builder (that function would not apply a window
    left out of the mask): Mistral under it computes sdpa's logits."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    hf.register("evotune-sdpa", attention_function=sdpa_attention_forward)
    assert AttentionMaskInterface._global_mapping["evotune-sdpa"] is sdpa_mask
    assert AttentionMaskInterface._global_mapping["evotune"] is hf.sliding_window_mask
    model = tiny_mistral()
    torch.testing.assert_close(logits(model, "evotune-sdpa", ids_of(), use_cache=False),
                               logits(model, "sdpa", ids_of(), use_cache=False), rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("use_cache", [False, True])
def test_gemma2_logits_equal_eager_and_every_call_reaches_the_op(use_cache):
    """Gemma-2's every attention call reaches the op with its softcap, the sliding layers with window=(W - 1, 0) and no
    causal flag, the full ones causal; the logits are eager's (transformers' sdpa refuses a softcap). On the CPU the
    op runs its math fallback, told once."""
    model = tiny_gemma2()
    ids = ids_of()
    ref = logits(model, "eager", ids, use_cache=use_cache)
    out, rows, told = run_evotune(model, ids, use_cache=use_cache)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert hf.stats() == {"evotune": LAYERS} and hf.fallbacks() == {}
    assert [(r.get("softcap"), r.get("window"), r["causal"], r["calls"]) for r in rows] == [
        (5.0, [WINDOW - 1, 0], False, 1), (5.0, None, True, 1)]
    assert all(r["route"] == "sdpa" and "device cpu" in r["reason"] for r in rows)
    assert len(told) == 1 and "running PyTorch math attention" in told[0]


def test_gemma2_without_softcap_or_a_cut_window():
    """A config without attn_logit_softcapping passes no cap; a prompt no longer than the window passes no window
    (transformers' mask builder leaves it out itself, and the op gets the dense causal key)."""
    model = tiny_gemma2(softcap=None)
    ids = ids_of(seq=WINDOW)
    out, rows, _ = run_evotune(model, ids, use_cache=False)
    torch.testing.assert_close(out, logits(model, "eager", ids, use_cache=False), rtol=1e-5, atol=1e-5)
    assert [(r.get("softcap"), r.get("window"), r["causal"], r["calls"]) for r in rows] == [(None, None, True, 2)]


def test_mistral_logits_equal_sdpa_with_the_window_on_every_layer():
    """Mistral's layers all slide: each call reaches the op with window=(W - 1, 0); the logits are sdpa's and eager's."""
    model = tiny_mistral()
    ids = ids_of()
    ref = logits(model, "sdpa", ids, use_cache=False)
    torch.testing.assert_close(logits(model, "eager", ids, use_cache=False), ref, rtol=1e-5, atol=1e-5)
    out, rows, told = run_evotune(model, ids, use_cache=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert hf.stats() == {"evotune": LAYERS}
    assert [(r.get("softcap"), r.get("window"), r["causal"], r["calls"]) for r in rows] == [
        (None, [WINDOW - 1, 0], False, LAYERS)]
    assert len(told) == 1 and "SDPA with a boolean window mask" in told[0]


def test_padded_gemma2_runs_math_with_its_mask():
    """A padded batch's masks are tensors: the adapter does not take them; with a softcap (which transformers' sdpa
    refuses) evotune's math fallback computes with the mask, told once; logits equal eager's."""
    model = tiny_gemma2()
    ids = ids_of()
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    ref = logits(model, "eager", ids, attention_mask=mask, use_cache=False)
    out, rows, told = run_evotune(model, ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert rows == [] and hf.stats() == {"math": LAYERS}
    assert len(told) == 1 and "math_attention" in told[0] and "attention mask" in told[0]


def test_padded_mistral_goes_to_transformers_sdpa():
    """A padded Mistral batch keeps going to transformers' sdpa with the built sliding mask, told; sdpa's logits."""
    model = tiny_mistral()
    ids = ids_of()
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[1, :7] = 0
    out, rows, told = run_evotune(model, ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(out, logits(model, "sdpa", ids, attention_mask=mask, use_cache=False), rtol=0,
                               atol=1e-6)
    assert rows == [] and hf.stats() == {"sdpa": LAYERS} and len(told) == 1


@pytest.mark.parametrize("make", [tiny_gemma2, tiny_mistral], ids=["gemma2", "mistral"])
def test_generate_matches_eager(make):
    """Greedy generation past the window (decode steps with a cache: their masks are built, the decode kernel takes
    no softcap) gives eager's tokens."""
    model = make()
    ids = ids_of(batch=1, seq=10)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=8, do_sample=False)
    model.set_attn_implementation("evotune")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        got = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.slow
def test_compile_fullgraph_with_a_cache_takes_the_window():
    """torch.compile(fullgraph=True) of Mistral with a cache: the mask builder leaves the sliding mask out while
    tracing too, and the compiled graph calls the op with the window; without a cache transformers cannot rule out
    packed sequences while tracing, so the mask is built and the call goes to transformers' sdpa (counted)."""
    model = tiny_mistral()
    ids = ids_of(batch=1)
    ref = logits(model, "sdpa", ids, use_cache=False)
    model.set_attn_implementation("evotune")
    try:
        for use_cache in (True, False):
            torch._dynamo.reset()
            hf.reset_stats()
            compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
            with warnings.catch_warnings(), et.record_shapes() as rec, torch.no_grad():
                warnings.simplefilter("ignore")
                out = compiled(input_ids=ids, use_cache=use_cache).logits
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            rows = [(r.get("window"), r["calls"]) for r in rec.shapes]
            if use_cache:
                assert rows == [([WINDOW - 1, 0], LAYERS)]
            else:
                assert rows == [] and any("attention mask" in r for r in hf.fallbacks())
    finally:
        torch._dynamo.reset()
