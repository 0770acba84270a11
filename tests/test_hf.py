"""evotune.torch.hf: attn_implementation="evotune" in tiny transformers models on the CPU, and tools/model_bench.py."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import evotune.torch as et  # noqa: E402
from evotune.torch import EvotuneFallbackWarning, hf  # noqa: E402

from _paths import REPO_ROOT  # noqa: E402


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=128, n_embd=64, n_head=4, n_layer=2, n_positions=128, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """No tuning table, notices and counts forgotten, the adapter registered."""
    monkeypatch.setenv("EVOTUNE_TABLE", str(tmp_path / "absent.json"))
    et.use_table(None)
    hf.reset_stats()
    hf.register()
    yield
    et.use_table(None)


def logits(model, impl, ids, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **kw).logits


def test_importing_evotune_does_not_import_transformers():
    """`import evotune` and `import evotune.torch` leave transformers unimported."""
    code = "import sys, evotune, evotune.torch; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_register_is_idempotent():
    """register() twice leaves one "evotune" entry pointing at the adapter."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert hf.register() == hf.register() == "evotune"
    assert AttentionInterface._global_mapping["evotune"] is hf.attention_forward
    assert "evotune" in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama-gqa", "gpt2"])
def test_logits_equal_sdpa_and_the_op_was_called(make):
    """The evotune model's logits equal sdpa's; every layer called the op, which warned once per key."""
    model = make()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = logits(model, "sdpa", ids)
    with warnings.catch_warnings(record=True) as caught, et.record_shapes() as rec:
        warnings.simplefilter("always")
        out = logits(model, "evotune", ids)
        again = logits(model, "evotune", ids)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(again, ref, rtol=0, atol=1e-6)
    layers = model.config.num_hidden_layers
    assert hf.stats() == {"evotune": 2 * layers}
    rows = rec.shapes
    assert sum(r["calls"] for r in rows) == 2 * layers and all(r["causal"] for r in rows)
    assert all(r["route"] == "sdpa" and "device cpu" in r["reason"] for r in rows)
    if make is tiny_llama:
        assert {(r["heads"], r["kv_heads"]) for r in rows} == {(4, 2)}  # K/V passed un-repeated
    notices = [w for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    assert len(notices) == 1 and "device cpu" in str(notices[0].message)


def test_padding_mask_goes_to_transformers_sdpa_with_reason():
    """A padded batch runs transformers' sdpa path, told once with the reason, and matches sdpa."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[0, :5] = 0
    ref = logits(model, "sdpa", ids, attention_mask=mask)
    with warnings.catch_warnings(record=True) as caught, et.record_shapes() as rec:
        warnings.simplefilter("always")
        out = logits(model, "evotune", ids, attention_mask=mask)
        logits(model, "evotune", ids, attention_mask=mask)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert rec.shapes == []  # the op was never called
    assert hf.stats() == {"sdpa": 4}
    (reason,) = hf.fallbacks()
    assert "attention mask" in reason
    told = [str(w.message) for w in caught if issubclass(w.category, EvotuneFallbackWarning)]
    assert told == [f"evotune.torch.hf: this call runs transformers' sdpa attention, not evotune.torch.attention: "
                    f"{reason}"]


def test_dropout_goes_to_sdpa_path():
    """Attention dropout is not the op's: the adapter sends it to transformers' sdpa."""
    q = torch.randn(1, 2, 8, 16)
    module = torch.nn.Module()
    with pytest.warns(EvotuneFallbackWarning, match="dropout"):
        out, _ = hf.attention_forward(module, q, q, q, None, dropout=0.5, is_causal=True)
    assert out.shape == (1, 8, 2, 16)


@pytest.mark.slow
@pytest.mark.parametrize("unpacked", [False, True])
def test_compile_fullgraph(unpacked):
    """torch.compile(fullgraph=True) traces the evotune model with no break; with assume_unpacked the compiled
    graph calls the op (transformers' own mask policy materialises the causal mask while tracing)."""
    hf.register(assume_unpacked=unpacked)
    try:
        model = tiny_llama()
        ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
        ref = logits(model, "sdpa", ids)
        model.set_attn_implementation("evotune")
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        with warnings.catch_warnings(), et.record_shapes() as rec, torch.no_grad():
            warnings.simplefilter("ignore")
            out = compiled(input_ids=ids, use_cache=False).logits
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        calls = sum(r["calls"] for r in rec.shapes)
        if unpacked:
            assert calls == model.config.num_hidden_layers
        else:
            assert calls == 0 and any("attention mask" in r for r in hf.fallbacks())
    finally:
        torch._dynamo.reset()
        hf.register()


@pytest.mark.slow
def test_model_bench_tiny_cpu(tmp_path):
    """tools/model_bench.py --device cpu --tiny runs end to end, checks pass, and the table is honest. One size runs
    under torch.compile as well (the other's compiles cost CI ~40% of this test and take the same code path; a tiny
    Llama compiled with fullgraph is test_compile_fullgraph's), the other says it was skipped."""
    out, md = tmp_path / "mb.json", tmp_path / "mb.md"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "model_bench.py"), "--device", "cpu", "--tiny",
                           "--sizes", "llama:1x16,gpt2:2x16", "--compile-sizes", "llama:1x16", "--reps", "2",
                           "--warmup", "1", "--compile-backend", "aot_eager", "--out", str(out), "--md", str(md)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "CHECKS: ok" in proc.stdout
    result = json.loads(out.read_text())
    assert result["env"]["device"].startswith("CPU") and not result["failed_checks"]
    for row in result["rows"]:
        assert row["check"]["evotune_vs_sdpa"]["ok"]
        assert row["route"].startswith("SDPA") and "device cpu" in row["route"]
        assert row["timings"]["evotune"]["graph"] == {"skipped": "CUDA graphs need a CUDA device"}
        for impl in ("sdpa_unpacked", "evotune"):
            compiled = row["timings"][impl]["compile"]
            if row["model"] == "llama":
                assert "median_ms" in compiled, compiled
            else:
                assert compiled == {"skipped": "not in --compile-sizes"}, compiled
    assert all(t["ok"] for t in result["train"].values())
    text = md.read_text()
    assert "no performance claim" in text and "| llama | 1x16 | evotune |" in text
