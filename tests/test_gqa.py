"""CPU tests of grouped-query attention (kvN shapes): the spelling, real NVRTC compiles of both variants with
the head-group index, the K/V tensor maps, the launch arguments, the fp32 reference and perturbation against a
naive expanded computation, SDPA's enable_gqa baseline, the byte count and the tuning-table key."""

from __future__ import annotations

import json

import pytest

from evotune.build.compile import compile_source
from evotune.errors import UsageError
from evotune.problems import get_problem
from evotune.problems.shapes import Shape, parse_shape
from evotune.space.searchspace import load_builtin
from evotune.build.template import instantiate
from evotune.records.tuning_table import TableKey, load_table, parse_table, save_table

from _tables import H100, entry, table  # noqa: E402

ATTENTION = get_problem("attention")
SYNC = {"block_m": 64, "block_n": 64, "compute_warps": 4, "producer_warps": 0, "stages": 2,
        "smem_layout": "swizzle", "q_in_regs": True}
SPLIT = {**SYNC, "block_m": 32, "compute_warps": 2, "producer_warps": 1, "kv_splits": 4}
KEYGROUPS = {**SYNC, "block_m": 16, "warp_key_groups": 4}
HOPPER = {"mma": "wgmma", "block_m": 128, "block_n": 128, "compute_warps": 8, "producer_warps": 4, "stages": 2,
          "q_in_regs": True, "pingpong": True}


def config(cfg: dict):
    space = load_builtin("attention-hopper" if cfg.get("mma") == "wgmma" else "attention")
    return space.config({**space.default_config().as_dict(), **cfg})


# --------------------------------------------------------------------------- the shape


@pytest.mark.parametrize("text, heads, kv, spec", [
    ("4,32,4096,128:bf16:causal:kv8", 32, 8, "4,32,4096,128:bf16:causal:kv8"),
    ("4,32,4096,128:kv8:bf16", 32, 8, "4,32,4096,128:bf16:kv8"),
    ("2,8,100,300,64:KV1:bshd", 8, 1, "2,8,100,300,64:fp16:bshd:kv1"),
    ("1,8,512,64:kv8", 8, 8, "1,8,512,64:fp16"),     # as many K/V heads as query heads: no flag
    ("mission:kv2", 8, 2, "1,8,512,64:fp16:kv2"),
])
def test_kv_flag_parses_and_round_trips(text, heads, kv, spec):
    """`kvN` sets the K/V heads; spec, as_dict and the family's shape_from_dict round-trip it, leaving it out when N = H."""
    shape = parse_shape(text)
    assert (shape.heads, shape.kv_heads, shape.kv_group, shape.spec) == (heads, kv, heads // kv, spec)
    assert parse_shape(shape.spec) == shape
    assert ATTENTION.shape_from_dict(json.loads(json.dumps(shape.as_dict()))) == shape
    assert ("kv_heads" in shape.as_dict()) == (kv != heads)


def test_ungrouped_shapes_are_unchanged():
    """Without the flag a shape equals, hashes and spells as before, whether kv_heads is left out or given as heads."""
    old = {"batch": 1, "heads": 8, "seq_q": 512, "seq_k": 512, "head_dim": 64, "dtype": "fp16", "causal": False,
           "layout": "bhsd"}
    shape = Shape.from_dict(old)
    assert shape.as_dict() == old and shape.spec == "1,8,512,64:fp16" and shape == parse_shape("mission")
    assert Shape(1, 8, 512, 512, 64, kv_heads=8) == shape and hash(Shape(1, 8, 512, 512, 64, kv_heads=8)) == hash(shape)
    assert shape.kv_heads == 8 and shape.kv_group == 1


@pytest.mark.parametrize("text, fault", [
    ("1,8,512,64:kv3", "3 K/V heads for 8 query heads"),
    ("1,8,512,64:kv16", "16 K/V heads for 8 query heads"),
    ("1,8,512,64:kv0", "at least one K/V head"),
    ("1,8,512,64:kv2:kv4", "flag 'kv4' conflicts with 'kv2'"),
    ("1,8,512,64:kv2:kv2", "flag 'kv2' repeats 'kv2'"),
    ("1,8,512,64:kv", "unknown flag 'kv'"),
    ("1,8,512,64:kv-2", "unknown flag 'kv-2'"),
    ("1,8,512,64:kv" + "9" * 40, "too large"),
])
def test_bad_kv_flags_are_one_line(text, fault):
    """A K/V head count that does not divide the heads, a repeated or malformed flag: one-line UsageErrors."""
    with pytest.raises(UsageError, match=fault) as info:
        parse_shape(text)
    assert "\n" not in str(info.value)


def test_bad_kv_heads_field():
    """Shape(kv_heads=...) is validated like the flag."""
    for bad in (-1, 3, 16, True, 2.0):
        with pytest.raises(UsageError):
            Shape(1, 8, 16, 16, 64, kv_heads=bad)


def test_bytes_count_kv_once_per_kv_head():
    """min_bytes counts K and V once per K/V head; FLOPs do not change with the grouping."""
    from evotune.gpu.bench import flops_and_bytes

    full, grouped = parse_shape("4,32,4096,128"), parse_shape("4,32,4096,128:kv8")
    q_and_o = 2 * 4 * 32 * 4096 * 128 * 2
    assert full.min_bytes() == 2 * q_and_o
    assert grouped.min_bytes() == q_and_o + q_and_o // 4
    assert flops_and_bytes(grouped) == (full.flops(), grouped.min_bytes())


def test_problem_side_of_a_grouped_shape():
    """Context, description, warm-start similarity and the sanitizer's small shape keep the grouping."""
    shape = parse_shape("2,32,1000,64:causal:kv8")
    assert ATTENTION.context(shape)["kv_heads"] == 8 and ATTENTION.context(parse_shape("mission"))["kv_heads"] == 8
    assert "KV=8" in ATTENTION.describe_shape(shape) and "KV" not in ATTENTION.describe_shape(parse_shape("mission"))
    small = ATTENTION.sanitize_shape(shape)
    assert (small.heads, small.kv_heads, small.kv_group, small.causal) == (8, 2, 4, True)
    assert ATTENTION.sanitize_shape(parse_shape("mission")).kv_heads == 2 == ATTENTION.sanitize_shape(
        parse_shape("mission")).heads
    assert ATTENTION.similar_shapes(shape.as_dict(), parse_shape("4,16,4096,64:causal").as_dict())


# --------------------------------------------------------------------------- the kernels


@pytest.mark.parametrize("cfg", [SYNC, SPLIT, KEYGROUPS, HOPPER], ids=["sync", "split", "keygroups", "wgmma"])
def test_grouped_source_compiles_with_the_head_group_index(cfg):
    """Both variants take kv_magic and index K/V by kv_head_of(head); the source (so the cubin) is the ungrouped one."""
    c = config(cfg)
    grouped = instantiate(ATTENTION, c, parse_shape("1,8,300,197,128:bf16:causal:kv2"))
    plain = instantiate(ATTENTION, c, parse_shape("1,8,300,197,128:bf16:causal"))
    assert grouped.digest == plain.digest
    assert "unsigned kv_magic)" in grouped.code and "const int kv_head = kv_head_of(head, kv_magic);" in grouped.code
    compiled = compile_source(grouped.code, grouped.entry)
    res = compiled.resources
    assert res.spill_stores == 0 and res.spill_loads == 0 and 0 < res.registers <= 255
    assert "kv_magic" in ATTENTION.signature(c)


def test_hopper_kv_maps_span_the_kv_heads():
    """The K and V tensor maps describe kv_heads heads (the kernel's head coordinate is head / kv_group); Q's all heads."""
    shape = parse_shape("2,8,300,197,64:bshd:kv2")
    q_strides = (300 * 8 * 64, 64, 8 * 64, 1)       # (B, S, H, D) memory
    kv_strides = (197 * 2 * 64, 64, 2 * 64, 1)
    maps = ATTENTION.tensor_map_args(config(HOPPER), shape, {"q": q_strides, "k": kv_strides, "v": kv_strides})
    assert maps["q"].dims == (64, 300, 8, 2)
    assert maps["k"].dims == maps["v"].dims == (64, 197, 2, 2)
    assert maps["k"].strides == (2 * 64 * 2, 64 * 2, 197 * 2 * 64 * 2)


@pytest.mark.parametrize("cfg", [SYNC, SPLIT, HOPPER], ids=["sync", "split", "wgmma"])
def test_launch_plan_carries_the_group_size(cfg):
    """The grid spans the query heads; the plan passes the group's magic (0 without grouping)."""
    c = config(cfg)
    grouped = ATTENTION.launch_plan(c, parse_shape("2,8,300,64:kv2"))
    assert grouped.grid[1] == 8 and int(grouped.kv_magic) == 1 << 30 and grouped.kv_magic.dtype.name == "uint32"
    assert int(ATTENTION.launch_plan(c, parse_shape("2,8,300,64")).kv_magic) == 0
    assert ATTENTION.workspace_elems(c, parse_shape("2,8,300,64:kv2")) == ATTENTION.workspace_elems(
        c, parse_shape("2,8,300,64"))


def test_kv_head_magic_divides_exactly():
    """__umulhi(head, kv_head_magic(g)) == head // g for every head below 2^16 (all of them for g <= 64, edges above)."""
    from evotune.problems.attention import kv_head_magic

    assert kv_head_magic(1) == 0
    for g in range(2, 65536):
        m = kv_head_magic(g)
        assert 0 < m < 1 << 32
        heads = range(65536) if g <= 64 else {0, 1, g - 1, g, g + 1, 65535, 65535 // g * g, 65535 // g * g - 1}
        assert all((h * m) >> 32 == h // g for h in heads), g
    for bad in (0, 1 << 16):
        with pytest.raises(UsageError):
            kv_head_magic(bad)


def test_launcher_refuses_tensors_of_other_head_counts():
    """K/V with query-head counts (a per-head copy) or any other count than the shape's are refused before launch."""
    torch = pytest.importorskip("torch")
    shape = parse_shape("1,8,64,64:kv2")
    inputs = ATTENTION.make_inputs(shape, 0, device="cpu")
    expanded = {**inputs, "k": inputs["k"].repeat_interleave(4, 1), "v": inputs["v"].repeat_interleave(4, 1)}
    with pytest.raises(UsageError, match="8 query and 2 K/V heads"):
        ATTENTION.launcher(None, config(SYNC), shape, expanded, torch.empty_like(inputs["q"]))


# --------------------------------------------------------------------------- inputs, reference, perturbation


def naive(q, k, v, scale, causal, group):
    """Attention with K/V expanded per query head, in fp64."""
    import torch

    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("text", ["2,8,33,47,64:kv2", "1,8,40,64:bf16:causal:bshd:kv1", "2,4,17,70,128:causal:kv2"])
@pytest.mark.parametrize("pattern", ATTENTION.PATTERNS)
def test_inputs_and_reference_against_naive_expansion(text, pattern):
    """make_inputs builds K/V with kv_heads heads in the shape's layout; the reference equals the expanded computation."""
    torch = pytest.importorskip("torch")
    shape = parse_shape(text)
    inputs = ATTENTION.make_inputs(shape, 3, device="cpu", pattern=pattern)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    assert q.shape == (shape.batch, shape.heads, shape.seq_q, shape.head_dim)
    assert k.shape == v.shape == (shape.batch, shape.kv_heads, shape.seq_k, shape.head_dim)
    assert (q.stride(1) < q.stride(2)) == (shape.layout == "bshd")
    if shape.kv_heads > 1:  # one K/V head: both layouts are the same memory (and torch may keep either stride)
        assert (k.stride(1) < k.stride(2)) == (shape.layout == "bshd")
    ref = ATTENTION.reference(shape, inputs)
    want = naive(q, k, v, inputs["scale"], shape.causal, shape.kv_group)
    # fp32 rounding against fp64 (scores near -240 or |V| x30 lose a few more digits); a wrong head is off by O(1).
    assert torch.allclose(ref.double(), want, atol=1e-4 * max(1.0, want.abs().max().item()), rtol=1e-4)


def test_ungrouped_inputs_are_the_same_draws():
    """kv_heads == heads draws exactly the inputs it drew before grouping existed (same generator calls)."""
    torch = pytest.importorskip("torch")
    shape = parse_shape("1,4,32,64")
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 4, 32, 64, generator=gen) for _ in range(3))
    got = ATTENTION.make_inputs(shape, 5, device="cpu")
    assert all(torch.equal(a.half(), b) for a, b in zip((q, k, v), (got["q"], got["k"], got["v"])))


@pytest.mark.parametrize("text", ["1,8,40,64:kv2", "2,8,40,64:causal:kv4", "1,4,30,50,64:kv1"])
def test_perturbation_moves_exactly_the_last_group(text):
    """Perturbing one row of the last K/V head changes the reference in, and only in, its group's query heads."""
    torch = pytest.importorskip("torch")
    shape = parse_shape(text)
    inputs = ATTENTION.make_inputs(shape, 1, device="cpu")
    changed, must_change = ATTENTION.perturb(shape, inputs)
    moved = (ATTENTION.reference(shape, changed) - ATTENTION.reference(shape, inputs)).abs().amax(-1) > 1e-3
    assert torch.equal(moved, must_change)
    assert must_change[-1, shape.heads - shape.kv_group:].any() and not must_change[:, :shape.heads - shape.kv_group].any()


def test_sdpa_baseline_reads_grouped_kv():
    """The SDPA baseline is called with enable_gqa on un-repeated K/V and agrees with the reference (CPU math backend)."""
    torch = pytest.importorskip("torch")
    from evotune.problems.attention import sdpa_has_gqa

    shape = parse_shape("1,8,48,64:causal:kv2")
    inputs = ATTENTION.make_inputs(shape, 2, device="cpu")
    inputs = {**inputs, **{n: inputs[n].float() for n in ("q", "k", "v")}}
    if not sdpa_has_gqa():
        assert "enable_gqa" in ATTENTION.baseline_skip_reason("math", shape)
        pytest.skip(f"torch {torch.__version__} has no enable_gqa")
    assert ATTENTION.baseline_skip_reason("math", shape) is None
    out = ATTENTION.baseline_launcher("math", shape, inputs, probe=False)()
    assert torch.allclose(out, ATTENTION.reference(shape, inputs), atol=1e-5, rtol=1e-5)


def test_missing_enable_gqa_is_a_skip_reason(monkeypatch):
    """On a torch without enable_gqa a grouped shape's baselines are skipped with the reason; ungrouped ones are not."""
    import evotune.problems.attention as mod

    monkeypatch.setattr(mod, "sdpa_has_gqa", lambda: False)
    assert "no enable_gqa" in ATTENTION.baseline_skip_reason("cudnn", parse_shape("mission:kv2"))
    assert ATTENTION.baseline_skip_reason("cudnn", parse_shape("mission")) is None


# --------------------------------------------------------------------------- the tuning-table key


def test_table_key_holds_the_group_size(tmp_path):
    """The key's kv_group is the group size, written only above 1, and a saved table round-trips it."""
    plain, grouped = parse_shape("2,32,1024,64"), parse_shape("2,32,1024,64:kv8")
    k_plain, k_grouped = (TableKey.for_shape(s, *H100) for s in (plain, grouped))
    assert k_plain.kv_group == 1 and "kv_group" not in k_plain.as_dict()
    assert k_grouped.kv_group == 4 and k_grouped.as_dict()["kv_group"] == 4 and "kv-group 4" in k_grouped.spec()
    assert k_plain != k_grouped and k_plain.group() != k_grouped.group()
    # the group size, not the K/V head count (16 here, 8 above; batch x heads is the same 64)
    assert TableKey.for_shape(parse_shape("1,64,1024,64:kv16"), *H100) == k_grouped
    path = save_table(table(entry(plain), entry(grouped)), tmp_path / "t.json")
    loaded = load_table(path)
    assert {e.key for e in loaded.entries} == {k_plain, k_grouped}
    raw = json.loads(path.read_text())
    assert raw["version"] == 1
    assert sorted("kv_group" in e["key"] for e in raw["entries"]) == [False, True]


def test_version_1_tables_without_kv_group_load(tmp_path):
    """A table written before the field (no kv_group) loads as group 1; a bad kv_group is one line naming the path."""
    obj = table(entry(parse_shape("mission"))).as_dict()
    assert "kv_group" not in obj["entries"][0]["key"]
    assert parse_table(obj).entries[0].key.kv_group == 1
    obj["entries"][0]["key"]["kv_group"] = 1  # explicit 1 is the same key
    assert parse_table(obj).entries[0].key == TableKey.for_shape(parse_shape("mission"), *H100)
    for bad, fault in ((0, "not positive"), ("4", "expected an integer"), (2, "is not the key of the measured shape")):
        obj["entries"][0]["key"]["kv_group"] = bad
        with pytest.raises(UsageError, match=fault):
            parse_table(obj)



@pytest.mark.parametrize("text", ["1,8,1,8192,128:bf16", "1,8,4,4096,64:kv2", "1,8,512,64:causal", "1,4,64,2048,64:kv1"])
def test_dependency_perturbation_clearly_moves_a_row_with_few_queries(text):
    """The dependency check needs a row the fp32 reference moves beyond the tolerance: with one query over 8192 keys a
    key nudged by a constant moved none (the check then calls every kernel too weak); the aimed key always does."""
    import random

    torch = pytest.importorskip("torch")
    from evotune.gpu.evaluate import _error_scale

    shape = parse_shape(text)
    inputs = ATTENTION.make_inputs(shape, 11, device="cpu")
    before = ATTENTION.reference(shape, inputs)
    atol, rtol = ATTENTION.tolerance(shape)
    atol *= _error_scale(ATTENTION, inputs)
    rng = random.Random(5)
    for _ in range(5):
        changed, must = ATTENTION.perturb(shape, inputs, rng)
        after = ATTENTION.reference(shape, changed)
        clearly = ((after - before).abs() > atol + rtol * before.abs()).any(dim=-1)
        assert bool((clearly & must).any()) and not bool(((after != before).any(dim=-1) & ~must).any())
        assert torch.equal(changed["q"], inputs["q"])
