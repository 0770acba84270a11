"""evotune.torch.hf's sliding layers' decode steps on the CPU: the mask builder leaves out a cached step's plain
window, and the step runs over the window's last keys (the decode op, or the op for Gemma-2's softcap), the cache
under or past the window, with transformers' tokens; padding in the window, a StaticCache, overlays keep the mask."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import evotune.torch as et  # noqa: E402
from evotune.problems.decode import reference_decode  # noqa: E402
from evotune.torch import decode as D  # noqa: E402
from evotune.torch import hf  # noqa: E402

LAYERS = 2
WINDOW = 8   # transformers' sliding_window: keys per query, its own included
PROMPT = 5   # the first steps see fewer keys than the window, the later ones the window's (or more, a whole cache)
NEW = 10


def tiny_mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                        sliding_window=WINDOW, pad_token_id=0)
    return MistralForCausalLM(cfg).eval()


def tiny_gemma2(softcap=5.0):
    """Gemma-2's sliding (layer 0) and full (layer 1) layers; a cap of 5 so the tanh bends the (small) scores."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=softcap,
                       pad_token_id=0)
    return Gemma2ForCausalLM(cfg).eval()


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """No tuning or decode table, notices and counts forgotten, the adapter registered."""
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "absent.json"))
    monkeypatch.setenv(D.TABLE_ENV, str(tmp_path / "absent-decode.json"))
    et.use_table(None)
    D.use_decode_table(None)
    D.clear()
    hf.reset_stats()
    hf.register()
    yield
    et.use_table(None)
    D.clear()
    hf.register()


def ids_of(batch=2, seq=PROMPT, seed=1):
    return torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def generate(model, impl, ids, cache="sliding", mask=None, **kw):
    """Greedy generate() with `impl`: its output (sequences and per-step logits), the recorded rows and the
    notices. cache "sliding": generate()'s own DynamicCache (the config's sliding layers keep the last W - 1 keys);
    "whole": a DynamicCache() without the config, whose layers keep every key (the steps see more than the window)."""
    from transformers import DynamicCache

    model.set_attn_implementation(impl)
    if cache == "whole":
        kw["past_key_values"] = DynamicCache()
    with warnings.catch_warnings(record=True) as caught, et.record_shapes() as rec, torch.no_grad():
        warnings.simplefilter("always")
        out = model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                             max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kw)
    return out, rec.shapes, [str(w.message) for w in caught if issubclass(w.category, et.EvotuneFallbackWarning)]


def same_generation(got, want):
    """The same tokens, and the same logits at each step up to fp32 rounding: the decode op's CPU fallback (SDPA over
    the window's keys, no mask) and transformers' sdpa (a boolean mask over the cache) differ in the last bit."""
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=0, atol=1e-6)


def decode_rows(rows):
    return [r for r in rows if r.get("family") == "attention-decode"]


def calls(rows):
    """(family, queries, keys, calls) of each recorded row: the decode op's rows and the op's spell them apart."""
    return [(r["family"], r["q"][2], r["k"][2], r["calls"]) if r.get("family") == "attention-decode"
            else ("attention", r["seq_q"], r["seq_k"], r["calls"]) for r in rows]


# --------------------------------------------------------------------------- the mask builder


def _step(cum: int, whole: bool) -> dict:
    """create_sliding_window_causal_mask's arguments for a decode step after `cum` tokens: a DynamicCache layer's
    sizes (a whole layer: every key from 0; a sliding layer: the last W - 1 keys and the new one)."""
    from transformers import MistralConfig
    from transformers.masking_utils import sliding_window_causal_mask_function

    kv_offset = 0 if whole else max(cum - WINDOW + 1, 0)
    kv_length = cum + 1 if whole else min(cum, WINDOW - 1) + 1
    return {"batch_size": 2, "q_length": 1, "kv_length": kv_length, "q_offset": cum, "kv_offset": kv_offset,
            "mask_function": sliding_window_causal_mask_function(WINDOW), "local_size": WINDOW,
            "config": MistralConfig(sliding_window=WINDOW)}


@pytest.mark.parametrize("cum", [WINDOW - 1, WINDOW, 3 * WINDOW])
@pytest.mark.parametrize("whole", [False, True], ids=["sliding-layer", "whole-layer"])
def test_mask_builder_leaves_out_a_decode_steps_plain_window(cum, whole):
    """One query at the end of the cached keys under the plain sliding mask (transformers builds it once the keys
    reach the window: all true over a sliding layer's keys, the window cutting a whole layer's older ones) is left
    out, without a padding mask or with one that is all true over the window's keys (padding the window has cut,
    too); it is built, as transformers' sdpa_mask builds it, where padding falls in the window, the query is not the
    last key, a compileable cache's step or an overlay turns allow_is_causal_skip off, the mask function is not the
    config's window, or the query offset is a tensor (a StaticCache's)."""
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    step = _step(cum, whole)
    seen = cum + 1
    assert hf.sliding_window_mask(**step) is None
    assert hf.sliding_window_mask(**step, attention_mask=torch.ones(2, seen, dtype=torch.bool)) is None
    if seen > WINDOW:
        cut = torch.ones(2, seen, dtype=torch.bool)
        cut[0, :seen - WINDOW] = False  # left padding up to the newest key the window has cut
        assert hf.sliding_window_mask(**step, attention_mask=cut) is None
    in_window = torch.ones(2, seen, dtype=torch.bool)
    in_window[1, seen - WINDOW] = False  # the oldest key the window shows
    for change in ({"attention_mask": in_window}, {"q_offset": cum - 1}, {"allow_is_causal_skip": False},
                   {"mask_function": sliding_window_causal_mask_function(WINDOW - 1)},
                   {"mask_function": chunked_causal_mask_function(WINDOW, torch.zeros(2, dtype=torch.long))},
                   {"q_offset": torch.tensor(cum)}):
        args = {**step, **change}
        built = hf.sliding_window_mask(**args)
        assert isinstance(built, torch.Tensor) and built.dtype == torch.bool, change
        assert torch.equal(built, sdpa_mask(**args)), change


# --------------------------------------------------------------------------- the adapter's decode call


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 4


def test_a_sliding_step_runs_the_decode_op_over_the_windows_keys():
    """One query, no mask and a sliding_window: decode_attention over the last min(W, Sk) keys, views of the cache
    (the recorded call has W keys where the window cuts), the window's answer; with fewer keys than the window, and
    past it."""
    for sk in (WINDOW - 3, WINDOW, 3 * WINDOW + 5):
        hf.reset_stats()
        gen = torch.Generator().manual_seed(sk)
        q, k, v = (torch.randn(2, h, s, 64, generator=gen) for h, s in ((8, 1), (2, sk), (2, sk)))
        with warnings.catch_warnings(), et.record_shapes() as rec:
            warnings.simplefilter("ignore")
            out, _ = hf.attention_forward(_Module(), q, k, v, None, scaling=0.125, sliding_window=WINDOW)
        seen = min(WINDOW, sk)
        want = reference_decode(q, k[:, :, -seen:], v[:, :, -seen:], 0.125, causal=False).transpose(1, 2)
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
        assert hf.stats() == {"evotune": 1} and hf.fallbacks() == {}, sk
        assert [(r["family"], r["k"]) for r in rec.shapes] == [("attention-decode", [2, 2, seen, 64])]


def test_a_sliding_step_compiles_without_a_graph_break():
    """torch.compile(fullgraph=True) traces the windowed decode step as one graph: the slice, then the opaque op."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, s, 64, generator=gen) for h, s in ((8, 1), (2, 30), (2, 30)))
    step = torch.compile(lambda q, k, v: hf.attention_forward(_Module(), q, k, v, None, scaling=0.125,
                                                              sliding_window=WINDOW)[0],
                         fullgraph=True, backend="aot_eager")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = step(q, k, v)
    finally:
        torch._dynamo.reset()
    want = reference_decode(q, k[:, :, -WINDOW:], v[:, :, -WINDOW:], 0.125, causal=False).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
    assert hf.fallbacks() == {}


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("cache", ["sliding", "whole"])
def test_mistral_every_decode_step_reaches_the_decode_op(cache):
    """Mistral's layers all slide: with the cache under the window and past it (a sliding layer's W keys, a whole
    layer's every key), every decode step of every layer reaches the decode op over at most W keys, none goes to
    transformers' sdpa; the tokens and logits are sdpa's."""
    model = tiny_mistral()
    ids = ids_of()
    want, _, _ = generate(model, "sdpa", ids, cache)
    hf.reset_stats()
    got, rows, _ = generate(model, "evotune", ids, cache)
    same_generation(got, want)
    steps = decode_rows(rows)
    assert sum(r["calls"] for r in steps) == LAYERS * (NEW - 1)
    assert sorted({r["k"][2] for r in steps}) == list(range(PROMPT + 1, WINDOW + 1))
    assert hf.fallbacks() == {} and hf.stats() == {"evotune": LAYERS * NEW}


@pytest.mark.parametrize("cache", ["sliding", "whole"])
def test_gemma2_sliding_steps_reach_evotune(cache):
    """Gemma-2 without a softcap: its sliding layer's steps reach the decode op over at most W keys, like its full
    layer's over all of them. With its softcap (the decode kernel has none) every step takes the op, the sliding
    layer's over at most W keys; nothing goes to transformers' sdpa or math_attention. Tokens and logits are eager's."""
    for softcap in (None, 5.0):
        model = tiny_gemma2(softcap)
        ids = ids_of()
        want, _, _ = generate(model, "eager", ids, cache)
        hf.reset_stats()
        got, rows, _ = generate(model, "evotune", ids, cache)
        same_generation(got, want)
        assert hf.fallbacks() == {} and hf.stats() == {"evotune": LAYERS * NEW}, softcap
        steps = [c for c in calls(rows) if c[1] == 1]
        assert sum(n for *_, n in steps) == LAYERS * (NEW - 1)
        assert {family for family, *_ in steps} == {"attention-decode" if softcap is None else "attention"}
        # the full layer's steps see every key (PROMPT + 1 .. PROMPT + NEW - 1); the sliding layer's at most W
        keys = [sk for _, _, sk, n in steps for _ in range(n)]
        want_keys = [*range(PROMPT + 1, PROMPT + NEW), *(min(PROMPT + t, WINDOW) for t in range(1, NEW))]
        assert sorted(keys) == sorted(want_keys), softcap
        hf.reset_stats()


def test_padding_in_the_window_keeps_transformers_sdpa():
    """A left-padded batch: the steps whose window shows a padded key keep the built mask and go to transformers'
    sdpa, told with the reason; once the window has moved past the padding (a whole cache), the steps reach the
    decode op again. Tokens and logits are sdpa's."""
    model = tiny_mistral()
    ids = ids_of()
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ids[0, :2] = 0
    want, _, _ = generate(model, "sdpa", ids, "whole", mask)
    hf.reset_stats()
    got, rows, told = generate(model, "evotune", ids, "whole", mask)
    same_generation(got, want)
    # Step t (1..NEW-1) has PROMPT + t keys; its window shows the padded keys 0 and 1 while PROMPT + t - W <= 1.
    padded_steps = sum(1 for t in range(1, NEW) if PROMPT + t - WINDOW <= 1)
    assert 0 < padded_steps < NEW - 1
    assert hf.fallbacks() == {next(iter(hf.fallbacks())): LAYERS * (padded_steps + 1)}  # the prefill's mask too
    assert "attention mask" in next(iter(hf.fallbacks()))
    assert sum("attention mask" in t for t in told) == 1
    assert sum(r["calls"] for r in decode_rows(rows)) == LAYERS * (NEW - 1 - padded_steps)


def test_a_static_caches_steps_stay_on_sdpa_told_once():
    """With a StaticCache (compileable: transformers turns allow_is_causal_skip off for its steps, its mask spans the
    whole cache, its query offset is a tensor) the sliding masks stay built and go to transformers' sdpa, told once;
    the same model's DynamicCache steps reach the decode op. Both give sdpa's tokens."""
    model = tiny_mistral()
    ids = ids_of(batch=1)
    static = dict(cache_implementation="static", disable_compile=True)
    want, _, _ = generate(model, "sdpa", ids, **static)
    hf.reset_stats()
    got, rows, told = generate(model, "evotune", ids, **static)
    assert torch.equal(got.sequences, want.sequences)
    assert decode_rows(rows) == []
    # the prefill's calls too: a StaticCache's query offset is a tensor, so its sliding mask is built as well
    assert hf.stats() == {"sdpa": LAYERS * NEW} and sum("attention mask" in t for t in told) == 1
    hf.reset_stats()
    got, rows, _ = generate(model, "evotune", ids)
    assert torch.equal(got.sequences, want.sequences) and hf.fallbacks() == {}
    assert sum(r["calls"] for r in decode_rows(rows)) == LAYERS * (NEW - 1)
