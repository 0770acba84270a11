"""evotune.torch.hf with packed sequences (flash-attention's cu_seq_lens_q / _k, max_length_q / _k kwargs) on the CPU:
what reaches the varlen op, its output against a per-sequence brute force, what stays off it (told), and a tiny
random-weight Llama run on a packed batch whose logits equal the same sequences run one by one with eager and sdpa."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import evotune.torch as et  # noqa: E402
from evotune.torch import EvotuneFallbackWarning, hf  # noqa: E402
from evotune.torch import varlen as VL  # noqa: E402

LENGTHS = [5, 1, 9, 3]
LAYERS = 2


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """No tuning table, notices and counts forgotten, the adapter registered."""
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "absent.json"))
    et.use_table(None)
    hf.reset_stats()
    hf._CHECKED.clear()
    hf.register()
    yield
    et.use_table(None)
    hf.register()


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2  # transformers' sdpa repeats the K/V heads by it


class _Encoder(torch.nn.Module):
    is_causal = False


@pytest.fixture
def to_varlen(monkeypatch):
    """What reaches the varlen op from the adapter, per call; the dense op may not be called."""
    seen = []
    real = VL.attention_varlen

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, scale=None):
        seen.append({"q": q, "k": k, "v": v, "cu_q": cu_q, "cu_k": cu_k, "max": (max_q, max_k), "causal": is_causal,
                     "scale": scale})
        return real(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal, scale=scale)

    monkeypatch.setattr(VL, "attention_varlen", spy)
    monkeypatch.setattr(hf, "eager_attention", lambda *a, **kw: pytest.fail("a packed call reached the dense op"))
    return seen


def offsets(lengths=LENGTHS):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def packed(lengths=LENGTHS, h=4, kv=2, d=16, seed=0):
    """query (1, H, total, D), key/value (1, Hkv, total, D) in a projection's layout ((1, total, H, D) memory), as a
    transformers layer hands them over."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    return tuple(torch.randn(1, total, n, d, generator=gen).transpose(1, 2) for n in (h, kv, kv))


def flash_kwargs(lengths=LENGTHS, cu_k=None):
    cu = offsets(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone() if cu_k is None else cu_k,
            "max_length_q": max(lengths), "max_length_k": max(lengths)}


def packing_mask(lengths=LENGTHS, causal=True):
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    mask = seq[:, None] == seq[None, :]
    return (mask.tril() if causal else mask)[None, None]


def brute(q, k, v, lengths, causal, scale):
    """Each sequence on its own, softmax(scale·QKᵀ)·V by the definition in float64, K/V heads repeated; (1, total, H,
    D)."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[0, :, start:start + n].double() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        s = qs @ ks.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out.append(torch.softmax(s, -1) @ vs)
        start += n
    return torch.cat(out, 1).transpose(0, 1)[None]


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EvotuneFallbackWarning)
        return fn(*args, **kw)


# --------------------------------------------------------------------------- the adapter's routing


@pytest.mark.parametrize("module, causal, with_mask", [
    (_Module(), True, False),   # no mask: a cache given, or position_ids that do not restart
    (_Module(), True, True),    # the block-diagonal causal mask transformers builds from restarting position_ids
    (_Encoder(), False, False),  # a non-causal model: each sequence sees all its keys
])
def test_packed_calls_reach_the_varlen_op(to_varlen, module, causal, with_mask):
    """A packed call goes to the varlen op with the packed views (no copy: (total, H, D) of the projection's memory),
    the offsets (under a causal mask one tensor for both, checked equal), the max lengths, the causal flag and the
    scale; the mask, where it is exactly the packing's, is left out; the output is the per-sequence brute force's."""
    q, k, v = packed()
    kw = flash_kwargs()
    mask = packing_mask(causal=causal) if with_mask else None
    out, weights = quiet(hf.attention_forward, module, q, k, v, mask, scaling=0.3, **kw)
    assert weights is None and out.shape == (1, sum(LENGTHS), 4, 16) and out.is_contiguous()
    (call,) = to_varlen
    assert call["q"].shape == (sum(LENGTHS), 4, 16) and call["k"].shape == (sum(LENGTHS), 2, 16)
    assert call["q"].data_ptr() == q.data_ptr() and call["v"].data_ptr() == v.data_ptr()
    assert call["cu_q"] is kw["cu_seq_lens_q"]
    assert call["cu_k"] is (kw["cu_seq_lens_q"] if causal else kw["cu_seq_lens_k"])
    assert call["max"] == (9, 9) and call["causal"] is causal and call["scale"] == 0.3
    assert hf.stats() == {"varlen": 1} and hf.fallbacks() == {}
    torch.testing.assert_close(out.double(), brute(q, k, v, LENGTHS, causal, 0.3), atol=2e-5, rtol=1e-4)


def test_tensor_max_lengths_and_a_window_that_cuts_nothing(to_varlen):
    """max_length as 0-d tensors (transformers' prepare_fa_kwargs_from_position_ids gives them) reach the op as ints;
    a sliding window no shorter than the longest sequence hides no key and stays off the call."""
    q, k, v = packed()
    kw = flash_kwargs()
    kw["max_length_q"] = kw["max_length_k"] = torch.tensor(9)
    quiet(hf.attention_forward, _Module(), q, k, v, None, scaling=0.3, sliding_window=9, **kw)
    assert to_varlen[0]["max"] == (9, 9) and type(to_varlen[0]["max"][0]) is int


def test_the_offsets_are_read_once_per_forward(monkeypatch):
    """Every layer of a forward passes the same offsets and mask: they are read and compared on the host once."""
    q, k, v = packed()
    kw, mask = flash_kwargs(), packing_mask()
    reads = []
    real = hf._packing_fault
    monkeypatch.setattr(hf, "_packing_fault", lambda *a: reads.append(1) or real(*a))
    for _ in range(3):
        quiet(hf.attention_forward, _Module(), q, k, v, mask, scaling=0.3, **kw)
    assert len(reads) == 1 and hf.stats() == {"varlen": 3}
    mask = mask.clone()  # a new mask (the next forward's) is read again
    quiet(hf.attention_forward, _Module(), q, k, v, mask, scaling=0.3, **kw)
    assert len(reads) == 2


def _padded_mask():
    mask = packing_mask().clone()
    mask[..., 0] = False  # the first token padded: not what the offsets describe
    return mask


@pytest.mark.parametrize("mask, extra, runs, fragment", [
    (_padded_mask(), {}, "sdpa", "a mask that is not the offsets' block-diagonal causal one"),
    (packing_mask().float(), {}, "sdpa", "not the packing's"),
    (packing_mask(), {"softcap": 30.0}, "math", "a logit softcap"),
    (None, {"softcap": 30.0}, "evotune", "across the packed sequences"),
    (None, {"sliding_window": 4}, "evotune", "a sliding window of 4 keys shorter than the longest sequence"),
    (None, {"s_aux": torch.zeros(4)}, "evotune", "attention sinks"),
    (packing_mask(), {"cu_seq_lens_k": torch.tensor([0, 4, 6, 15, 18], dtype=torch.int32)}, "sdpa",
     "cu_seq_lens_q != cu_seq_lens_k"),
])
def test_what_the_varlen_op_does_not_take_goes_where_it_went(mask, extra, runs, fragment):
    """A softcap, a window that cuts, sinks, differing offsets under a causal mask or a mask that is not the packing's:
    the call runs as without the kwargs (by its mask: transformers' sdpa or math_attention; with no mask the dense op,
    across the packed sequences as transformers' sdpa computes it), told once naming the packing and the reason."""
    q, k, v = packed()
    kw = {**flash_kwargs(), **extra}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            hf.attention_forward(_Module(), q, k, v, mask, scaling=0.3, **kw)
    told = [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)
            and str(w.message).startswith("evotune.torch.hf")]
    assert len(told) == 1 and "packed sequences (cu_seq_lens_q / _k)" in told[0] and fragment in told[0], told
    assert hf.stats() == {runs: 2}
    assert list(hf.fallbacks().values()) == [2]


def test_a_packed_call_compiles_into_one_graph():
    """torch.compile(fullgraph=True) traces a packed call with no mask onto the varlen op (on the CPU its fallback);
    the answer is eager's."""
    q, k, v = packed()
    kw = flash_kwargs()
    fn = torch.compile(lambda q, k, v: hf.attention_forward(_Module(), q, k, v, None, scaling=0.3, **kw)[0],
                       fullgraph=True, backend="aot_eager")
    try:
        got = quiet(fn, q, k, v)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(got.double(), brute(q, k, v, LENGTHS, True, 0.3), atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------- a tiny Llama on a packed batch


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def sequences():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, 128, (n,), generator=gen).tolist() for n in (7, 3, 12, 1, 5)]


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_llama_equals_one_by_one_with_every_call_on_the_varlen_op(use_cache):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s batch (position_ids restarting per sequence, the
    flash kwargs): every attention call goes to the varlen op (without a cache transformers also builds the packing's
    mask, which the adapter checks and leaves out; with one it builds none), whose route on the CPU is its per-sequence
    fallback; the logits are the sequences' own, run one by one with transformers' eager and sdpa."""
    from transformers import DataCollatorWithFlattening

    model = tiny_llama()
    seqs = sequences()
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in seqs])
    batch.pop("labels")
    refs = {}
    for impl in ("eager", "sdpa"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            refs[impl] = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    model.set_attn_implementation("evotune")
    with warnings.catch_warnings(record=True) as caught, et.record_shapes() as rec, torch.no_grad():
        warnings.simplefilter("always")
        out = model(**batch, use_cache=use_cache).logits[0]
    told = [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    for ref in refs.values():
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert hf.stats() == {"varlen": LAYERS} and hf.fallbacks() == {} and rec.shapes == []
    assert told == ["evotune.torch.attention_varlen: the evotune kernel cannot run this call (device cpu: the kernel "
                    "runs on CUDA GPUs); running PyTorch SDPA per sequence"]
    cu = batch["cu_seq_lens_q"]
    q = torch.zeros(int(cu[-1]), 4, 16)
    k = torch.zeros(int(cu[-1]), 2, 16)
    route = VL.explain_varlen(q, k, k, cu, cu, 12, 12, is_causal=True)
    assert (route.route, route.kind) == ("fallback", "uncovered")


def test_packed_llama_without_the_kwargs_keeps_the_mask():
    """position_ids restarting with no flash kwargs: the packing's mask is all the adapter sees, and the call runs
    transformers' sdpa with it (as before), the logits still the sequences' own."""
    model = tiny_llama()
    seqs = sequences()
    ids = torch.tensor([sum(seqs, [])])
    pos = torch.tensor([[i for s in seqs for i in range(len(s))]])
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = torch.cat([model(input_ids=torch.tensor([s])).logits[0] for s in seqs])
    model.set_attn_implementation("evotune")
    with torch.no_grad():
        out = quiet(model, input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert hf.stats() == {"sdpa": LAYERS}
