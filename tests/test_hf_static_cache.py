"""evotune.torch.hf with a StaticCache on the CPU: the prefill into the empty cache (no mask, the whole cache as
keys) reaches the op with the keys cropped to the queries, as transformers' sdpa crops them."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import evotune.torch as et  # noqa: E402
from evotune.torch import hf  # noqa: E402


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "absent.json"))
    et.use_table(None)
    hf.reset_stats()
    hf.register("evotune", assume_unpacked=True)
    yield
    et.use_table(None)


def test_static_cache_prefill_reaches_the_op_with_cropped_keys():
    """generate() with a StaticCache: the same tokens as sdpa; the prefill's calls went to the op (one per layer,
    Sq = Sk after the crop), not to transformers' sdpa for "more keys than queries"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0, cache_implementation="static",
              disable_compile=True, attention_mask=torch.ones_like(ids))
    out = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for impl in ("sdpa", "evotune"):
            model.set_attn_implementation(impl)
            with et.record_shapes() as rec:
                out[impl] = model.generate(input_ids=ids, **kw)
    assert torch.equal(out["evotune"], out["sdpa"])
    prefill = [r for r in rec.shapes if r["seq_q"] == 12]
    assert prefill and all(r["seq_k"] == 12 and r["causal"] for r in prefill)
    assert sum(r["calls"] for r in prefill) == cfg.num_hidden_layers
    assert not any("queries over" in why for why in hf.fallbacks())
