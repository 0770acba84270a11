"""tools/model_families.py on the CPU (issue 42): tiny Gemma-2, Mistral, Phi-3, gpt-oss and Qwen2 models through
attn_implementation="evotune", their logits beside sdpa/eager, every attention call counted and each fallback's
reason told, the recorded shapes files, and bad options refused before any model is built."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import evotune.torch as et  # noqa: E402
from _paths import load_tool  # noqa: E402
from evotune.torch import hf  # noqa: E402
from evotune.torch.decode import use_decode_table  # noqa: E402

LAYERS, SEQ, NEW = 2, 12, 3


@pytest.fixture(scope="module")
def families():
    return load_tool("model_families")


@pytest.fixture(scope="module")
def report(families, tmp_path_factory):
    """One run of the tool over all five tiny families (module-scoped: the suite's time is tight)."""
    out = tmp_path_factory.mktemp("families")
    mp = pytest.MonkeyPatch()
    mp.setenv("EVOTUNE_TABLE", str(out / "absent.json"))
    mp.setenv("EVOTUNE_DECODE_TABLE", str(out / "absent.decode.json"))
    et.use_table(None)
    use_decode_table(None)
    try:
        rc = families.main(["--device", "cpu", "--tiny", "--seq", str(SEQ), "--new-tokens", str(NEW),
                            "--layers", str(LAYERS), "--json", str(out / "r.json"), "--record", str(out / "shapes")])
    finally:
        mp.undo()
        et.use_table(None)
        use_decode_table(None)
        hf.reset_stats()
        hf.register()
    return rc, json.loads((out / "r.json").read_text()), out


def test_every_family_runs_and_its_logits_agree(report, capsys):
    """All five families run with "evotune"; logits equal the family's reference within tol; tokens agree."""
    rc, r, _ = report
    assert rc == 0 and r["failed_checks"] == [], r["failed_checks"]
    assert [row["family"] for row in r["rows"]] == ["gemma2", "mistral", "phi3", "gptoss", "qwen2"]
    refs = {row["family"]: row["reference"] for row in r["rows"]}
    assert refs == {"gemma2": "eager", "mistral": "sdpa", "phi3": "sdpa", "gptoss": "eager", "qwen2": "sdpa"}
    for row in r["rows"]:
        main = row["logits"][f"evotune_vs_{row['reference']}"]
        assert main["ok"] and main["rel"] <= r["tol"] == 1e-4, (row["family"], main)
        assert row["generate"]["ok"] and row["generate"][f"evotune_vs_{row['reference']}"] is None
        assert len(row["generate"]["tokens"]) == NEW
    assert "eager_vs_sdpa" in next(row for row in r["rows"] if row["family"] == "qwen2")["logits"]
    # Gemma-2's other reference, sdpa: measured where transformers runs it (5.17), else (5.24 refuses it for the
    # softcap) said as an error of that reference, not a failure.
    gemma = r["rows"][0]
    assert "prefill sdpa" in gemma["errors"] or "evotune_vs_sdpa" in gemma["logits"], (gemma["errors"], gemma["logits"])
    models = r["models"]
    assert all(f in models["gemma2"] for f in ("head dim 256", "softcap 50", "layers sliding/full"))
    assert "head dim 96" in models["phi3"] and "longrope" in models["phi3"]
    assert all(f in models["gptoss"] for f in ("head dim 64", "sinks", "8 q heads on 1 kv heads"))
    assert "7 q heads on 1 kv heads" in models["qwen2"] and f"window {SEQ // 2}" in models["mistral"]


def test_every_call_is_counted_and_each_fallback_says_why(report):
    """On the CPU no call reaches a kernel: every call is counted, and the reasons' counts add up to the calls."""
    _, r, _ = report
    for row in r["rows"]:
        for phase, calls in (("prefill_calls", LAYERS), ("generate_calls", LAYERS * NEW)):
            c = row[phase]
            assert c["attention_calls"] == calls and c["kernel_calls"] == 0 and c["share"] == 0.0, (row["family"], c)
            assert sum(c["fallbacks"].values()) == calls, (row["family"], phase, c["fallbacks"])
            assert all(reason.split(": ")[0] in ("adapter", "op", "decode") for reason in c["fallbacks"])
        assert any("device cpu" in reason for reason in row["prefill_calls"]["fallbacks"])


def test_record_writes_each_familys_shapes_file(report):
    """--record DIR: one evotune.torch.record_shapes file per family, with its softcap and window where it has them."""
    _, r, out = report
    for family in ("gemma2", "mistral", "phi3", "gptoss", "qwen2"):
        shapes = json.loads((out / "shapes" / f"{family}.shapes.json").read_text())
        assert shapes["kind"] == "evotune-attention-shapes" and shapes["shapes"], family
    gemma = json.loads((out / "shapes" / "gemma2.shapes.json").read_text())["shapes"]
    assert {row["head_dim"] for row in gemma} == {256} and all(row.get("softcap") == 50.0 for row in gemma
                                                               if row.get("family", "attention") == "attention")
    assert any(row.get("window") == [SEQ // 2 - 1, 0] for row in gemma)
    oss = json.loads((out / "shapes" / "gptoss.shapes.json").read_text())["shapes"]
    assert all(row.get("sinks") or ":sinks" in (row.get("shape") or "") for row in oss)  # prefill and decode rows
    assert {row.get("head_dim", 64) for row in oss} == {64}


@pytest.mark.parametrize("argv, fault", [
    (["--families", "llama"], "--families: unknown llama"),
    (["--seq", "0"], "--seq '0'"),
    (["--seq", "x"], "--seq 'x'"),
    (["--new-tokens", "-1"], "--new-tokens"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--table", "/nonexistent/t.json"], "--table /nonexistent/t.json: no such file"),
    (["--decode-table", "/nonexistent/d.json"], "--decode-table /nonexistent/d.json: no such file"),
    (["--json", "/nonexistent/dir/out.json"], "does not exist"),
    (["--record", "FILE"], "not a folder"),
])
def test_bad_options_exit_2_in_one_line(families, argv, fault, capsys, tmp_path):
    """A bad option is one line on stderr and exit status 2, before torch builds anything."""
    if argv == ["--record", "FILE"]:
        (tmp_path / "f").write_text("")
        argv = ["--record", str(tmp_path / "f")]
    with pytest.raises(SystemExit) as e:
        families.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and fault in err and err.count("\n") == 1, err
