"""CPU tests of the decode kernel's variants (kernels/decode/variants.cuh: kv_load bulk, combine acq_rel,
split_chunks even): they compile clean for sm_90a on the device scripts' shapes, the defaults keep
attention_decode.cu's source, the space admits them only where they are valid, and the warm start seeds them."""

from __future__ import annotations

from pathlib import Path

import pytest

from evotune.build.compile import compile_source, static_violations
from evotune.build.template import instantiate, read_template
from evotune.errors import UsageError
from evotune.problems.decode import is_variant
from evotune.space.searchspace import load_builtin

BULK = {"kv_load": "bulk", "combine": "acq_rel", "split_chunks": "even"}

# (shape, config): docs/data/decode/run.sh's and run_variants.sh's shapes (Llama-3-8B at 16k and 2k, batch 8),
# fp16 and bf16, d64 and d128, Sq 4 causal (16 rows), a (B, S, H, D) cache; each variant alone and together.
COMPILE_CASES = [
    ("1,32,8,16416,128:fp16", {"splits": 16, "warps": 8, "vec": 8, "unroll": 4, "stages": 6, **BULK}),
    ("1,32,8,16416,128:bf16", {"splits": 32, "warps": 4, "vec": 8, "unroll": 4, "stages": 8, **BULK}),
    ("1,32,8,2080,128:fp16", {"splits": 16, "warps": 8, "vec": 8, "unroll": 2, "stages": 3, **BULK}),
    ("1,32,8,2080,128:bf16", {"splits": 16, "warps": 8, "vec": 8, "unroll": 2, "stages": 3, "split_chunks": "even"}),
    ("8,32,8,2080,128:fp16", {"splits": 4, "warps": 8, "vec": 8, "unroll": 2, "stages": 4, "kv_load": "bulk"}),
    ("1,32,8,16384,128:bf16", {"splits": 64, "warps": 4, "vec": 8, "unroll": 2, "stages": 3, "combine": "acq_rel"}),
    ("1,32,8,4,2048,128:bf16:causal", {"splits": 8, "warps": 4, "vec": 4, "unroll": 1, "stages": 3, **BULK}),
    ("1,12,12,1024,64:fp16", {"splits": 8, "warps": 4, "vec": 8, "unroll": 2, "stages": 4, **BULK}),
    ("3,8,1,777,64:bf16", {"splits": 4, "warps": 2, "vec": 8, "unroll": 2, "stages": 3, **BULK}),
    ("2,8,1,777,128:bf16:bshd", {"splits": 4, "warps": 4, "vec": 8, "unroll": 1, "stages": 3, **BULK}),
]


@pytest.fixture(scope="module")
def compiled_variants(decode, dspace):
    out = []
    for text, overrides in COMPILE_CASES:
        shape, cfg = decode.parse_shape(text), dspace.config(overrides)
        src = instantiate(decode, cfg, shape)
        out.append((text, shape, cfg, src, compile_source(src.code, src.entry)))
    return out


def test_variants_compile_clean(decode, dspace, compiled_variants):
    """Admitted variant configs compile for sm_90a with no spills or stack and pass the static gate; their source
    carries the variants' header and its traits, and bulk's block has the producer warp."""
    for text, shape, cfg, src, compiled in compiled_variants:
        assert dspace.admitted(cfg, decode.context(shape)), (text, dspace.violations(cfg, decode.context(shape)))
        res = compiled.resources
        assert res.spill_stores == res.spill_loads == res.stack_frame == 0, (text, cfg.key(), res)
        geo = decode.geometry(cfg, shape)
        assert static_violations(res, geo.threads, geo.dynamic_smem) == [], (text, cfg.key())
        assert "// ---- begin decode/variants.cuh" in src.code and "evotune::DecodeVariantTraits<" in src.code
        assert geo.threads == 32 * (cfg["warps"] + (cfg["kv_load"] == "bulk"))


def test_bulk_issues_bulk_copies_on_mbarriers(compiled_variants):
    """The bulk ring's machine code copies with UBLKCP and waits on mbarriers; the acquire-release combine has no
    fence.sc (MEMBAR.SC.GPU), which combine = fenced runs in every thread."""
    pytest.importorskip("evotune.build.sass")
    from evotune.build.sass import disassemble
    from evotune.errors import EvotuneError

    _, _, cfg, _, compiled = compiled_variants[0]
    try:
        sass = disassemble(compiled.cubin_path)
    except EvotuneError as e:
        pytest.skip(str(e))
    assert cfg["kv_load"] == "bulk" and cfg["combine"] == "acq_rel"
    assert "UBLKCP" in sass and "SYNCS.PHASECHK" in sass and "LDGSTS" not in sass
    assert "MEMBAR.SC.GPU" not in sass and "ATOMG" in sass


def test_defaults_keep_the_template_source(decode, dspace):
    """A config at the variant knobs' defaults is attention_decode.cu's kernel as before them: the template's text,
    no variants header, DecodeTraits' ten arguments, and the source (digest) of the same config read from the
    cp-async profile, whose configs do not name the variant knobs (a run recorded before they existed)."""
    _, template = read_template(decode.kernel_file)
    before = load_builtin("attention-decode:cp-async")
    for text in ("1,32,8,16416,128:fp16", "1,32,8,2080,128:bf16", "2,8,1,4,300,64:causal:bshd"):
        shape = decode.parse_shape(text)
        for overrides in ({"splits": 16, "warps": 8, "vec": 8, "unroll": 4, "stages": 2}, {}):
            old = before.config(overrides)
            assert "kv_load" not in old.as_dict()
            new = dspace.config(overrides)
            assert not is_variant(new) and new["kv_load"] == "cp_async"
            src = instantiate(decode, new, shape)
            assert src.code.startswith(template) and "variants.cuh" not in src.code
            assert "DecodeVariantTraits" not in src.code and "/* CAUSAL = */" in src.code.split("using")[-1]
            assert src.code == instantiate(decode, old, shape).code


@pytest.mark.parametrize("overrides, words", [
    ({"splits": 1, "combine": "acq_rel"}, "nothing to chunk or combine"),
    ({"splits": 1, "split_chunks": "even"}, "nothing to chunk or combine"),
    ({"splits": 128, "split_chunks": "even", "warps": 8, "unroll": 4}, "at least one key"),
    ({"splits": 16, "warps": 8, "vec": 8, "unroll": 8, "stages": 8, "kv_load": "bulk"}, "shared memory"),
])
def test_constraints_reject_the_invalid(decode, dspace, overrides, words):
    """The space refuses variant configs that are wrong or idle, saying why: a combine or chunking knob without
    splits, more splits than tiles, a ring past the shared memory."""
    shape = decode.parse_shape("1,32,8,2080,128:fp16")
    why = "; ".join(dspace.violations(dspace.config(overrides), decode.context(shape)))
    assert words in why


def test_bulk_producer_warp_counts_against_the_registers(decode, dspace):
    """bulk's ninth warp puts three warps on a sub-partition, so ptxas gives 168 registers a thread, not 256: a config
    of 8 rows at vec 8 that fits 8 warps is refused with the producer, and admitted at 4 consumer warps."""
    shape = decode.parse_shape("2,32,4,5001,128:bf16")  # group 8: 8 rows
    base = {"splits": 8, "warps": 8, "vec": 8, "unroll": 2, "stages": 3}
    assert dspace.admitted(dspace.config(base), decode.context(shape))
    why = dspace.violations(dspace.config({**base, "kv_load": "bulk"}), decode.context(shape))
    assert any("sub-partitions" in w for w in why)
    assert dspace.admitted(dspace.config({**base, "warps": 4, "kv_load": "bulk"}), decode.context(shape))


def test_bulk_needs_16_byte_aligned_caches(decode, dspace):
    """bulk copies whole rows, whose global addresses must be 16-byte aligned: a K view 8 bytes off is refused for it,
    while the cp.async ring's 8-byte vectors (vec 4) take it."""
    import torch

    shape = decode.parse_shape("1,8,1,64,128")
    q, o = torch.zeros(1, 8, 1, 128, dtype=torch.half), torch.zeros(1, 8, 1, 128, dtype=torch.half)
    k = torch.zeros(1, 1, 64 * 128 + 4, dtype=torch.half)[..., 4:].view(1, 1, 64, 128)
    cfg = {"splits": 1, "warps": 4, "vec": 4, "unroll": 1, "stages": 2}
    decode.launch_args(dspace.config(cfg), shape, q, k, k, o, 0.1)
    with pytest.raises(UsageError, match="16-byte"):
        decode.launch_args(dspace.config({**cfg, "kv_load": "bulk"}), shape, q, k, k, o, 0.1)


def test_profiles_seed_the_variants(decode, dspace):
    """The cp-async profile is the space before the variants (its configs name none of them), so a search warm-started
    from its runs asks each of its fastest configs again at every variant value; the variants profile pins all three."""
    from evotune.search.warmstart import admitted, with_new_knobs

    shape = decode.parse_shape("1,32,8,16416,128:fp16")
    ctx = decode.context(shape)
    before = load_builtin("attention-decode:cp-async")
    assert len(before.admitted_configs(ctx)) == 880  # the space the H200's exhaustive search measured
    best = {"splits": 16, "warps": 8, "vec": 8, "unroll": 4, "stages": 2}
    asked, _ = admitted(dspace, ctx, with_new_knobs(dspace, ctx, [best]))
    values = {(c["kv_load"], c["combine"], c["split_chunks"]) for c in asked}
    assert {("bulk", "fenced", "ceil"), ("cp_async", "acq_rel", "ceil"), ("cp_async", "fenced", "even"),
            ("bulk", "acq_rel", "even")} <= values
    firsts = load_builtin("attention-decode:variants").admitted_configs(ctx)
    assert firsts and all(c["kv_load"] == "bulk" and c["combine"] == "acq_rel" for c in firsts)


def test_gpu_variant_cases_are_admitted(decode, dspace):
    """The GPU suite's variant cases are configs the space admits on their shapes (checked without a GPU)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gpu_decode_variants import CASES

    for text, overrides in CASES:
        shape = decode.parse_shape(text)
        assert dspace.admitted(dspace.config(overrides), decode.context(shape)), (text, overrides)
