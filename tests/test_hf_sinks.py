"""evotune.torch.hf with attention sinks (gpt-oss's s_aux) on the CPU: which path a call with sink logits takes and
what reaches the op (prefill with and without a cutting window) and the decode op (decode steps, over the window's
keys), a masked call's math fallback with the sinks, and a tiny random-weight gpt-oss whose logits and greedy tokens
equal transformers' eager attention with every prefill call on the op and every decode step on the decode op."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import evotune.torch as et  # noqa: E402
from evotune.errors import UsageError  # noqa: E402
from evotune.torch import EvotuneFallbackWarning, hf  # noqa: E402
from evotune.torch import decode as D  # noqa: E402

LAYERS = 2
WINDOW = 8  # transformers' sliding_window: keys per query, its own included


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


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def tensors(sq, sk, h=4, kv=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, s, d, generator=gen) for n, s in ((h, sq), (kv, sk), (kv, sk)))
    sinks = torch.randn(h, generator=gen) * 1.5 + 1.0
    return q, k, v, sinks


def brute(q, k, v, sinks, scale, seen):
    """softmax over the scores (hidden where `seen` (Sq, Sk) is False) and one more column, the head's sink logit,
    with that column dropped, @ V; in float64, K/V heads repeated."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~seen, float("-inf"))
    column = sinks.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, column], dim=-1), dim=-1)[..., :-1] @ v


@pytest.fixture
def to_op(monkeypatch):
    """What reaches evotune's ops from the adapter, per call: (which op, keys, is_causal, window, softcap, the sinks
    tensor); "op" is evotune.torch.attention (window and softcap as passed), "decode" decode_attention (neither: None)."""
    seen = []
    real, real_decode = hf.eager_attention, D.decode_attention

    def spy(q, k, v, is_causal, scale, enable_gqa, softcap=0.0, window=None, sinks=None):
        seen.append(("op", k.shape[2], is_causal, window, softcap, sinks))
        return real(q, k, v, is_causal, scale, enable_gqa, softcap=softcap, window=window, sinks=sinks)

    def decode_spy(q, k, v, *, causal=False, scale=None, sinks=None):
        seen.append(("decode", k.shape[2], causal, None, None, sinks))
        return real_decode(q, k, v, causal=causal, scale=scale, sinks=sinks)

    monkeypatch.setattr(hf, "eager_attention", spy)
    monkeypatch.setattr(D, "decode_attention", decode_spy)
    return seen


# --------------------------------------------------------------------------- the adapter's routing


@pytest.mark.parametrize("sq, sk, window, name, op, keys, causal, op_window", [
    (12, 12, None, "s_aux", "op", 12, True, None),             # a full layer's prefill
    (12, 12, WINDOW, "s_aux", "op", 12, False, (WINDOW - 1, 0)),  # a sliding layer's prefill: the window cuts
    (6, 6, WINDOW, "s_aux", "op", 6, True, None),              # a prompt no longer than the window: the dense causal call
    (1, 20, WINDOW, "s_aux", "decode", WINDOW, False, None),   # a sliding layer's decode step: the last W keys
    (1, 5, WINDOW, "s_aux", "decode", 5, False, None),         # ... with fewer keys than the window
    (1, 20, None, "s_aux", "decode", 20, False, None),         # a full layer's decode step: every key
    (1, 20, None, "sinks", "decode", 20, False, None),         # the other spelling of the keyword
    (12, 12, None, "sinks", "op", 12, True, None),
])
def test_sinks_reach_the_op(to_op, sq, sk, window, name, op, keys, causal, op_window):
    """With no mask, a call with sink logits goes with them (the same tensor, not a copy) to the op (a prefill, its
    window as the softcap / window calls pass it) or to the decode op (a decode step, over the window's last W keys as
    the other decode steps); never transformers' sdpa (which drops sinks); the output is the brute force's over the
    keys the query sees."""
    q, k, v, sinks = tensors(sq, sk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EvotuneFallbackWarning)
        out, weights = hf.attention_forward(_Module(), q, k, v, None, scaling=0.25, sliding_window=window,
                                            **{name: sinks})
    assert weights is None and out.shape == (2, sq, 4, 16) and out.is_contiguous()
    ((got_op, got_keys, got_causal, got_window, softcap, got_sinks),) = to_op
    assert (got_op, got_keys, got_causal, got_window) == (op, keys, causal, op_window)
    assert softcap == (0.0 if op == "op" else None)
    assert got_sinks is sinks
    assert hf.stats() == {"evotune": 1} and hf.fallbacks() == {}
    i = torch.arange(sq)[:, None] + (sk - sq)  # queries at the end of the keys (a cache's)
    j = torch.arange(sk)[None, :]
    seen = (j <= i) & ((j > i - window) if window else True)
    want = brute(q, k, v, sinks, 0.25, seen).transpose(1, 2)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


def test_a_masked_call_runs_math_with_its_sinks():
    """A mask tensor (padding) is not the op's: the call runs math_attention with the mask and the sinks (not
    transformers' sdpa, which would drop them), told once naming the reason; the answer is the brute force's, a row
    whose every key is masked 0."""
    q, k, v, sinks = tensors(10, 10)
    seen = torch.ones(10, 10, dtype=torch.bool).tril()
    seen[:, :3] = False  # three padded keys: rows 0-2 see none
    mask = seen[None, None].expand(2, 1, 10, 10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, _ = hf.attention_forward(_Module(), q, k, v, mask, scaling=0.25, s_aux=sinks)
        hf.attention_forward(_Module(), q, k, v, mask, scaling=0.25, s_aux=sinks)
    told = [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    assert len(told) == 1 and "math_attention" in told[0] and "attention mask" in told[0]
    assert hf.stats() == {"math": 2}
    assert (out[:, :3] == 0).all()
    torch.testing.assert_close(out[:, 3:].double(), brute(q, k, v, sinks, 0.25, seen).transpose(1, 2)[:, 3:],
                               atol=2e-5, rtol=1e-4)


def test_sinks_beside_a_position_bias_are_refused():
    """Sinks beside a position bias (or a paged cache) are one UsageError line: neither evotune's fallback nor
    transformers' sdpa (which would drop the sinks) computes the two."""
    q, k, v, sinks = tensors(6, 6)
    with pytest.raises(UsageError) as info:
        hf.attention_forward(_Module(), q, k, v, None, scaling=0.25, s_aux=sinks, position_bias=torch.zeros(1, 4, 6, 6))
    said = str(info.value)
    assert said.startswith("evotune.torch.hf: attention sinks beside an additive position bias") and "\n" not in said


def test_a_sinks_call_compiles_without_a_graph_break():
    """torch.compile(fullgraph=True) traces a sliding prefill and a decode step with s_aux as one graph each (on the
    CPU the op's fallback, plain PyTorch); their answers are eager's."""
    q, k, v, sinks = tensors(12, 12)
    step_q = q[:, :, -1:].clone()
    fn = torch.compile(lambda q, k, v, s: hf.attention_forward(_Module(), q, k, v, None, scaling=0.25,
                                                               sliding_window=WINDOW, s_aux=s)[0],
                       fullgraph=True, backend="aot_eager")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = [fn(q, k, v, sinks), fn(step_q, k, v, sinks)]
            want = [hf.attention_forward(_Module(), x, k, v, None, scaling=0.25, sliding_window=WINDOW,
                                         s_aux=sinks)[0] for x in (q, step_q)]
    finally:
        torch._dynamo.reset()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- a tiny gpt-oss


def tiny_gpt_oss():
    """gpt-oss's attention at a tiny size: a sliding (layer 0) and a full (layer 1) layer, 4 query heads on 2, each
    with its sinks Parameter, set well away from 0 so the sink takes a real share of each row."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=LAYERS,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                       sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2,
                       layer_types=["sliding_attention", "full_attention"], pad_token_id=0)
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4, generator=torch.Generator().manual_seed(3)) * 1.5 + 1.0)
    return model


def ids_of(batch=2, seq=24, seed=1):
    return torch.randint(1, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def logits(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, **kw).logits


def test_gpt_oss_eager_is_our_semantics():
    """transformers' eager gpt-oss attention (its sink column, concatenated, softmaxed, dropped) is the op's
    semantics: one layer's eager output is the brute force's with that layer's sinks Parameter."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = tiny_gpt_oss().model.layers[0].self_attn
    q, k, v, _ = tensors(10, 10)
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, 10, 10).masked_fill(~causal, torch.finfo(torch.float32).min)
    with torch.no_grad():
        theirs, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EvotuneFallbackWarning)
        ours, _ = hf.attention_forward(module, q, k, v, None, scaling=0.25, s_aux=module.sinks.detach())
    torch.testing.assert_close(theirs.double(), brute(q, k, v, module.sinks.detach(), 0.25, causal).transpose(1, 2),
                               atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("use_cache", [False, True])
def test_gpt_oss_logits_equal_eager_and_every_call_reaches_the_op(use_cache):
    """gpt-oss's every attention call reaches the op with its sinks, the sliding layer with window=(W - 1, 0) and no
    causal flag, the full one causal; the logits are eager's (and not what dropping the sinks gives). On the CPU the
    op runs its math fallback with the sink column, told once."""
    model = tiny_gpt_oss()
    ids = ids_of()
    ref = logits(model, "eager", ids, use_cache=use_cache)
    with warnings.catch_warnings(record=True) as caught, et.record_shapes() as rec:
        warnings.simplefilter("always")
        out = logits(model, "evotune", ids, use_cache=use_cache)
    told = [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert hf.stats() == {"evotune": LAYERS} and hf.fallbacks() == {}
    assert [(r.get("sinks"), r.get("window"), r["causal"], r["calls"]) for r in rec.shapes] == [
        (True, [WINDOW - 1, 0], False, 1), (True, None, True, 1)]
    assert all(r["route"] == "sdpa" and "device cpu" in r["reason"] for r in rec.shapes)
    assert len(told) == 1 and told[0].endswith("running PyTorch math attention in fp32 with a sink column (SDPA has "
                                               "no attention sinks)")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that takes nothing: softmax without it
    assert (logits(model, "evotune", ids, use_cache=use_cache) - out).abs().max() > 1e-2


def test_padded_gpt_oss_runs_math_with_its_mask():
    """A padded batch's masks are tensors: the adapter runs math_attention with the mask and the sinks, told once;
    the logits at the real tokens are eager's."""
    model = tiny_gpt_oss()
    ids = ids_of()
    mask = torch.ones(2, 24, dtype=torch.long)
    mask[0, :5] = 0
    ref = logits(model, "eager", ids, attention_mask=mask, use_cache=False)
    with warnings.catch_warnings(record=True) as caught, et.record_shapes() as rec:
        warnings.simplefilter("always")
        out = logits(model, "evotune", ids, attention_mask=mask, use_cache=False)
    told = [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
    assert rec.shapes == [] and hf.stats() == {"math": LAYERS}
    assert len(told) == 1 and "math_attention" in told[0] and "attention mask" in told[0]


def test_gpt_oss_generate_matches_eager_with_every_step_on_the_decode_op(to_op):
    """Greedy generation past the window: each layer's prefill reaches the op with its sinks, and every decode step of
    both layers the decode op with the layer's sinks Parameter itself (none transformers' sdpa, none the op), the
    sliding layer's over at most W keys; the tokens and per-step logits are eager's."""
    model = tiny_gpt_oss()
    ids = ids_of(batch=1, seq=5)
    new = 10
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "output_logits": True,
          "return_dict_in_generate": True, "attention_mask": torch.ones_like(ids)}
    model.set_attn_implementation("eager")
    with torch.no_grad():
        want = model.generate(ids, **kw)
    model.set_attn_implementation("evotune")
    to_op.clear()
    with warnings.catch_warnings(), et.record_shapes() as rec, torch.no_grad():
        warnings.simplefilter("ignore")
        got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), rtol=1e-5, atol=1e-5)
    assert hf.fallbacks() == {} and hf.stats() == {"evotune": LAYERS * new}
    sinks = [layer.self_attn.sinks for layer in model.model.layers]
    prefill, steps = to_op[:LAYERS], to_op[LAYERS:]
    assert [(op, keys, causal, window) for op, keys, causal, window, _, _ in prefill] == [
        ("op", 5, True, None), ("op", 5, True, None)]  # a 5-token prompt: the window cuts nothing
    assert len(steps) == LAYERS * (new - 1) and all(op == "decode" and not causal for op, _, causal, *_ in steps)
    assert all(call[5] is sinks[i % LAYERS] for i, call in enumerate(to_op))
    keys = sorted(call[1] for call in steps)
    want_keys = sorted([*range(6, 5 + new), *(min(5 + t, WINDOW) for t in range(1, new))])
    assert keys == want_keys
    # The recorder: the prefill rows the op's (with sinks), the steps' the decode op's.
    assert [r.get("family", "attention") for r in rec.shapes][:1] == ["attention"] and rec.shapes[0].get("sinks")
    assert sum(r["calls"] for r in rec.shapes if r.get("family") == "attention-decode") == LAYERS * (new - 1)
