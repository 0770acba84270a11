"""Variable-length packed batches (varlen) in the attention family: the spelling, the key, the space, the kernel's
compiles (CPU), and on a GPU the kernel against the per-sequence fp32 reference."""

from __future__ import annotations

import math
import random
import warnings

import pytest

from evotune.errors import UsageError
from evotune.problems import varlen as V
from evotune.problems.attention import VARLEN_PARAMS, sees
from evotune.problems.shapes import Shape, parse_shape
from evotune.records.tuning_table import TableKey, _parse_key
from evotune.space.searchspace import load_builtin, shape_context

HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}


@pytest.fixture(scope="module")
def space():
    return load_builtin("attention")


# ------------------------------------------------------------------ the spelling


@pytest.mark.parametrize("text, q, k", [
    ("3,8,100,64:varlen=100/7/1", (100, 7, 1), (100, 7, 1)),
    ("3,8,100,128,64:varlen=100/7/1,128/3/0", (100, 7, 1), (128, 3, 0)),
    ("17,8,4096,128:bf16:causal:kv2:varlen=4096/512*15/1", (4096,) + (512,) * 15 + (1,), None),
    ("2,4,50,64:varlen=50/0,3/4:softcap=30:window=10,0", (50, 0), (3, 4)),
    ("4,8,300,64:varlen=1*3/300", (1, 1, 1, 300), None),
])
def test_spelling_reads_and_round_trips(text, q, k):
    """varlen=L1/L2[,K1/K2] (L*N runs) reads into the lengths; spec and as_dict / from_dict round-trip; packed
    sequences are token-major (bshd, implied)."""
    shape = parse_shape(text)
    assert shape.varlen == q and shape.key_lengths == (k or q) and shape.is_varlen
    assert shape.layout == "bshd" and "bshd" not in shape.spec
    assert parse_shape(shape.spec) == shape and Shape.from_dict(shape.as_dict()) == shape
    assert shape.total_q == sum(q) and shape.total_k == sum(k or q)
    cu_q, cu_k = shape.cu_seqlens()
    assert cu_q[0] == 0 and cu_q[-1] == sum(q) and len(cu_q) == shape.batch + 1 and cu_k[-1] == sum(k or q)


def test_runs_are_spelled_compactly():
    """Runs of one length are written L*N, and equal key lengths are left out."""
    assert parse_shape("5,8,512,64:varlen=512/64/64/64/1").spec == "5,8,512,64:fp16:varlen=512/64*3/1"
    assert parse_shape("2,8,9,64:varlen=9/9,9/9").spec == "2,8,9,64:fp16:varlen=9*2"


def test_dense_shapes_spell_and_key_as_before():
    """Without the flag nothing changes: no varlen in spec, as_dict or the table key."""
    dense = parse_shape("4,8,1024,64:bshd")
    assert not dense.is_varlen and "varlen" not in dense.as_dict() and dense.spec == "4,8,1024,64:fp16:bshd"
    assert "varlen" not in TableKey.for_shape(dense, "H100", "9.0").as_dict()


@pytest.mark.parametrize("text, fragment", [
    ("3,8,99,64:varlen=100/7/1", "write 3,8,100,64"),
    ("2,8,100,64:varlen=100/7/1", "number of sequences"),
    ("3,8,100,64:causal:varlen=100/7/1,100/7/2", "causal varlen needs"),
    ("3,8,100,64:varlen=a/2", "integers >= 0"),
    ("3,8,100,64:varlen=100/7/1:bhsd", "token-major"),
    ("3,8,100,64:varlen=100/7/1,1/2", "3 query and 2 key"),
    ("2,8,100,64:varlen=0/0", "at least one query"),
    ("3,8,100,64:varlen=1/2/3:varlen=1/2/3", "once"),
    ("1,8,1,64:varlen=1*0", "1 to 65535"),
])
def test_bad_spellings_are_usage_errors(text, fragment):
    """A bad varlen flag is one UsageError line naming what to write."""
    with pytest.raises(UsageError, match=fragment) as info:
        parse_shape(text)
    assert "\n" not in str(info.value)


def test_flops_bytes_and_pairs_count_each_sequence():
    """FLOPs, bytes and visible pairs are the sums over the sequences (causal halved per sequence, as dense)."""
    shape = parse_shape("3,8,100,64:causal:varlen=100/7/1")
    per = [Shape(1, 8, n, n, 64, causal=True) for n in (100, 7, 1)]
    assert shape.flops() == sum(s.flops() for s in per)
    assert shape.min_bytes() == sum(s.min_bytes() for s in per)
    assert shape.visible_pairs() == sum(s.visible_pairs() for s in per)
    empty_keys = parse_shape("2,8,10,64:varlen=10/3,0/5")  # the first sequence has no keys: no work
    assert empty_keys.flops() == Shape(1, 8, 3, 5, 64).flops()


def test_sequence_shape_and_call_shape():
    """A sequence is a dense batch of one; the op's shape from (B, totals, max_seqlen) has representative lengths
    with those facts, and refuses totals that cannot fit."""
    shape = parse_shape("3,8,100,128,64:kv2:varlen=100/7/1,128/3/0")
    assert shape.sequence_shape(1) == Shape(1, 8, 7, 3, 64, layout="bshd", kv_heads=2)
    assert shape.computed_sequences() == [0, 1]
    s = V.call_shape(4, 8, 2, 64, "bf16", False, 300, 250, 128, 200)
    assert s.batch == 4 and s.total_q == 300 and s.total_k == 250 and s.seq_q == 128 and s.seq_k == 200
    assert max(s.varlen) <= 128 and max(s.key_lengths) <= 200
    with pytest.raises(UsageError, match="max_seqlen_q=10: max_seqlen_q is too small"):
        V.call_shape(2, 8, 8, 64, "fp16", False, 30, 30, 10, 20)


# ------------------------------------------------------------------ the table key


def test_table_key_field():
    """A varlen key has varlen: true (written only then), buckets the longest sequence and sequences x heads, and is
    never a dense key's candidate."""
    shape = parse_shape("16,8,4096,128:bf16:causal:kv2:varlen=4096/512*15")
    key = TableKey.for_shape(shape, "H100", "9.0")
    d = key.as_dict()
    assert d["varlen"] is True and d["seq_q_bucket"] == 4096 and d["bh_bucket"] == 128 and d["layout"] == "bshd"
    assert _parse_key(d, "key", shape.as_dict(), "shape") == key
    dense = TableKey.for_shape(Shape(16, 8, 4096, 4096, 128, "bf16", True, "bshd", 2), "H100", "9.0")
    assert dense.group() != key.group() and "varlen" in key.spec()


# ------------------------------------------------------------------ the space and the instantiation


def test_space_admits_varlen_on_the_hopper_one_tile_grid(space):
    """Admitted: wgmma one tile per CTA with the register epilogue (empty_warpgroups = skip too); refused, with the
    constraint's why: mma.sync, persistent, the TMA-store epilogue."""
    ctx = shape_context(parse_shape("3,8,1000,64:varlen=1000/100/1"))
    assert ctx["varlen"] is True
    assert space.violations(space.config(HOPPER), ctx) == []
    assert space.violations(space.config({**HOPPER, "block_m": 192, "compute_warps": 12, "block_n": 64,
                                          "empty_warpgroups": "skip"}), ctx) == []
    for knobs in ({"persistent": True}, {"epilogue": "tma"}, {"mma": "sync"}):
        cfg = {**HOPPER, **knobs} if "mma" not in knobs else {"mma": "sync"}
        why = space.violations(space.config(cfg), ctx)
        assert why and any("varlen" in w or "variable-length" in w for w in why), (knobs, why)


def test_varlen_trait_appears_only_on_varlen_shapes(attention, space):
    """A dense shape's source has no VARLEN argument; a varlen one has VARLEN = true (after SOFTCAP, LOCAL, SINKS
    false) and its entry ends with the offsets; the mma.sync kernel refuses varlen."""
    from evotune.build.template import instantiate

    cfg = space.config(HOPPER)
    dense = attention.instantiation(cfg, parse_shape("gpt2"))
    assert "VARLEN" not in dense and "cu_seqlens" not in dense
    assert instantiate(attention, cfg, parse_shape("gpt2")).code.endswith(dense)
    shape = parse_shape("3,8,100,64:varlen=100/7/1")
    code = instantiate(attention, cfg, shape).code
    assert "/* SINKS = */ false,\n    /* VARLEN = */ true" in code and "cu_seqlens_k" in code
    assert attention.entry_params(cfg, shape=shape)[-2:] == VARLEN_PARAMS
    mods = parse_shape("3,8,100,64:softcap=30:sinks:varlen=100/7/1")
    assert attention.entry_params(cfg, shape=mods)[-6:] == (("softcap_scale", "f32"), ("window_left", "i32"),
                                                            ("window_right", "i32"), ("sinks", "ptr")) + VARLEN_PARAMS
    with pytest.raises(UsageError, match="Hopper kernel only"):
        attention.template_args(space.config({"mma": "sync"}), shape)


def test_tensor_maps_span_the_packed_rows(attention, space):
    """The maps are 4-D over the packed tensors as one batch: (D, total, heads, 1), boxes of the dense kernel's."""
    shape = parse_shape("3,8,100,128,64:kv2:varlen=100/7/1,128/3/0")
    strides = {"q": (108 * 8 * 64, 64, 8 * 64, 1), "k": (131 * 2 * 64, 64, 2 * 64, 1),
               "v": (131 * 2 * 64, 64, 2 * 64, 1)}
    args = attention.tensor_map_args(space.config(HOPPER), shape, strides)
    assert args["q"].dims == (64, 108, 8, 1) and args["k"].dims == (64, 131, 2, 1) and args["v"].box == (64, 128, 1, 1)
    geo = attention.geometry(space.config(HOPPER), shape)
    assert tuple(geo.grid) == (1, 8, 3)  # ceil(max_seqlen_q / 128), heads, sequences


# A sample of the Hopper pieces VARLEN meets: producer warpgroup, the consumer's refill (no producer), ping-pong, three
# and four warpgroups, Q in registers, skip, causal_extent = warpgroup, P from shared memory, head dims 96 to 256,
# score mods, and the training variant's log-sum-exp.
KERNEL_CASES = [
    ("3,8,1000,64:varlen=1000/100/1", {}, False),
    ("3,8,1000,128:bf16:causal:kv2:varlen=1000/100/1", {"producer_warps": 0, "stages": 3}, False),
    ("3,8,700,64:varlen=700/1/64", {"pingpong": True}, False),
    ("3,8,700,64:bf16:varlen=700/1/64", {"block_m": 192, "compute_warps": 12, "block_n": 64,
                                         "empty_warpgroups": "skip"}, False),
    ("3,8,700,64:causal:varlen=700/1/64", {"block_m": 256, "compute_warps": 16, "block_n": 64,
                                           "causal_extent": "warpgroup"}, False),
    ("3,8,700,64:varlen=700/1/64", {"q_in_regs": True, "block_n": 64, "p_operand": "smem", "rescale": "lazy",
                                    "softmax_overlap": True, "lean_addressing": True}, False),
    ("3,8,700,96:bf16:varlen=700/1/64", {}, False),
    ("3,8,700,256:bf16:causal:varlen=700/1/64", {"block_n": 64}, False),
    ("2,8,700,64:softcap=30:window=100,0:sinks:varlen=700/9", {"pdl": True}, False),
    ("3,8,1000,128:bf16:causal:varlen=1000/100/1", {}, True),
]


@pytest.mark.parametrize("text, knobs, lse", KERNEL_CASES)
def test_hopper_kernel_compiles_clean(attention, space, text, knobs, lse):
    """Sampled varlen configs compile for sm_90a with no spill and no stack frame, within the static gate (the
    training variant's too)."""
    from _variant_pairs import assert_compiles_clean

    from evotune.build.compile import compile_source
    from evotune.build.template import instantiate

    shape = parse_shape(text)
    cfg = {**HOPPER, **knobs}
    assert space.violations(space.config(cfg), shape_context(shape)) == []
    if lse:
        src = instantiate(attention, space.config(cfg), shape, write_lse=True)
        res = compile_source(src.code, src.entry).resources
        assert res.stack_frame == 0 and res.spill_stores == 0, res
        return
    _, compiled, _ = assert_compiles_clean(attention, space, shape, cfg)
    assert 0 < compiled.resources.registers <= 255


# ------------------------------------------------------------------ the reference, inputs, perturbation (CPU)


def _brute_force(shape, inputs):
    """Attention by the definition, in float64, over the packed rows: query i sees key j iff they are in one sequence
    and the sequence's own mask, window and cap allow it."""
    import torch

    q, k, v = (inputs[n][0].transpose(0, 1).double() for n in "qkv")  # (total, H, D)
    cu_q, cu_k = shape.cu_seqlens()
    out = torch.zeros_like(q)
    group = shape.kv_group
    for b in range(shape.batch):
        lq, lk = shape.varlen[b], shape.key_lengths[b]
        for i in range(lq):
            lo, hi = shape.sequence_shape(b).key_range(i) if lk else (0, -1)
            if hi < lo:
                continue
            for h in range(shape.heads):
                keys = k[cu_k[b] + lo:cu_k[b] + hi + 1, h // group]
                s = keys @ q[cu_q[b] + i, h] * inputs["scale"]
                if shape.has_softcap:
                    s = shape.softcap * torch.tanh(s / shape.softcap)
                if shape.sinks:
                    s = torch.cat([s, inputs["sinks"][h:h + 1].double()])
                p = torch.softmax(s, 0)[:hi - lo + 1]
                out[cu_q[b] + i, h] = p @ v[cu_k[b] + lo:cu_k[b] + hi + 1, h // group]
    return out


@pytest.mark.parametrize("text", [
    "3,4,40,64:varlen=40/1/17",
    "3,4,40,50,64:kv2:varlen=40/1/17,50/0/3",
    "3,4,40,64:bf16:causal:varlen=40/1/17",
    "2,4,30,64:softcap=20:window=5,2:sinks:varlen=30/9,12/30",
])
def test_reference_is_per_sequence_attention(attention, text):
    """The fp32 reference equals attention by the definition over the packed rows (nothing crosses a sequence; a
    sequence without keys gives 0)."""
    shape = parse_shape(text)
    inputs = attention.make_inputs(shape, 7, device="cpu")
    assert tuple(inputs["q"].shape) == (1, shape.heads, shape.total_q, shape.head_dim)
    assert inputs["q"].stride(1) < inputs["q"].stride(2)  # token-major memory
    assert inputs["cu_seqlens_q"].tolist() == list(shape.cu_seqlens()[0])
    ref = attention.reference(shape, inputs)[0].transpose(0, 1)
    assert float((ref.double() - _brute_force(shape, inputs)).abs().max()) < 1e-5


@pytest.mark.parametrize("text", ["4,4,40,64:kv2:varlen=40/1/17/9", "3,4,40,64:causal:varlen=40/1/17",
                                  "2,4,30,64:window=5,0:varlen=30/9,12/30"])
def test_perturbation_moves_one_sequence_only(attention, text):
    """The rows the perturbation marks are the ones the reference moves: all in one sequence, none elsewhere."""
    shape = parse_shape(text)
    inputs = attention.make_inputs(shape, 3, device="cpu")
    ref = attention.reference(shape, inputs)
    for seed in range(4):
        changed, must = attention.perturb(shape, inputs, random.Random(seed))
        moved = (attention.reference(shape, changed) - ref).abs().amax(-1) > 1e-4
        assert not (moved & ~must).any() and moved.any()
        rows = must[0].any(0).nonzero().flatten().tolist()
        cu_q = shape.cu_seqlens()[0]
        assert len({next(b for b in range(shape.batch) if cu_q[b] <= r < cu_q[b + 1]) for r in rows}) == 1


def test_sanitize_shape_is_a_small_varlen_shape(attention):
    """The sanitizer's shape keeps the class (varlen, mask, grouping) with a one-row sequence."""
    small = attention.sanitize_shape(parse_shape("16,32,4096,128:bf16:causal:kv8:varlen=4096/512*15"))
    assert small.is_varlen and small.causal and small.kv_group == 4 and 1 in small.varlen and small.total_q < 300


def test_baselines(attention):
    """FlexAttention for every varlen shape; SDPA only where the lengths are uniform, on the dense batch they are
    (its output, as the packed view, equals the reference); FlexAttention's document mask (eager, CPU) too."""
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    ragged, uniform = parse_shape("3,4,40,64:varlen=40/1/17"), parse_shape("3,4,24,64:causal:kv2:varlen=24*3")
    assert "flex" in attention.baselines_for(ragged)
    assert "lengths differ" in attention.baseline_skip_reason("cudnn", ragged)
    assert attention.baseline_skip_reason("flex", ragged) is None
    assert attention.baseline_skip_reason("math", uniform) is None
    assert V.dense_equivalent(uniform) == Shape(3, 4, 24, 24, 64, causal=True, layout="bshd", kv_heads=2)
    inputs = attention.make_inputs(uniform, 5, device="cpu")
    inputs = {n: t.float() if n in "qkv" else t for n, t in inputs.items()}
    ref = attention.reference(uniform, inputs)
    out = V.sdpa_launcher(attention, "math", uniform, inputs, probe=False)()
    assert out.shape == ref.shape and float((out - ref).abs().max()) < 1e-5
    for shape in (ragged, uniform):
        inputs = attention.make_inputs(shape, 5, device="cpu")
        inputs = {n: t.float() if n in "qkv" else t for n, t in inputs.items()}
        ref = attention.reference(shape, inputs)
        with warnings.catch_warnings():  # eager flex_attention says (once) it is unfused
            warnings.simplefilter("ignore")
            out = flex_attention(inputs["q"], inputs["k"], inputs["v"], scale=inputs["scale"],
                                 enable_gqa=shape.kv_group > 1, **V.flex_mods(shape, "cpu", sees))
            # the mask matters: without it the rows attend across sequences
            crossed = flex_attention(inputs["q"], inputs["k"], inputs["v"], scale=inputs["scale"],
                                     enable_gqa=shape.kv_group > 1)
        assert float((out - ref).abs().max()) < 1e-5 and float((crossed - ref).abs().max()) > 1e-2


# ------------------------------------------------------------------ GPU (the gate, the reference, the guard rows)

GPU_CASES = [
    "5,16,1000,64:varlen=1000/1/129/64/700",                # ragged, one of one row, a 128-row tile + 1
    "5,16,1000,64:causal:varlen=1000/1/129/64/700",
    "4,16,777,900,128:bf16:kv4:varlen=777/5/0/300,900/1/33/0",  # keys of other lengths, a sequence without keys
    "17,16,2048,128:bf16:causal:kv8:varlen=2048/100*15/1",  # one long, many short, GQA
    "3,8,500,96:bf16:causal:varlen=500/63/65",
    "3,8,500,64:softcap=30:window=64,0:varlen=500/63/200",
]
GPU_CONFIGS = [{}, {"producer_warps": 0, "stages": 3}, {"pingpong": True},
               {"block_m": 192, "compute_warps": 12, "block_n": 64, "empty_warpgroups": "skip"}]
CONFIG_IDS = ["producer", "noproducer", "pingpong", "wg3skip"]


@pytest.mark.gpu
@pytest.mark.parametrize("text", GPU_CASES)
@pytest.mark.parametrize("knobs", GPU_CONFIGS, ids=CONFIG_IDS)
def test_gate_passes(attention, space, text, knobs):
    """The full gate (fresh inputs, NaN-poisoned output, repeat launches bitwise equal, a perturbed key of one sequence
    moving only that sequence's rows, the fp32 reference's tolerance) passes."""
    from _variant_pairs import assert_gate_passes

    assert_gate_passes(attention, space, text, {**HOPPER, **knobs})


@pytest.mark.gpu
@pytest.mark.parametrize("text", GPU_CASES[:4])
def test_rows_against_the_reference_and_guard_rows(attention, space, text):
    """Into a NaN-poisoned output with guard rows before and after the packed rows (a sentinel): every row of every
    sequence is written and within the gate's tolerance of its own sequence's reference, rows of a sequence without
    keys are exactly 0, and no guard row is touched (no write crosses the packed tensor's ends); the training variant's
    log-sum-exp is finite where a row sees a key."""
    import torch

    from evotune.build.compile import compile_source, load_kernel
    from evotune.build.template import instantiate

    shape = parse_shape(text)
    inputs = attention.make_inputs(shape, 9)
    ref = attention.reference(shape, inputs)
    atol, rtol = attention.tolerance(shape)
    atol *= attention.error_scale(inputs)
    guard = 300
    cfg = space.config(HOPPER)
    for lse_wanted in (False, True):
        src = instantiate(attention, cfg, shape, write_lse=lse_wanted)
        kernel = load_kernel(compile_source(src.code, src.entry), attention.launch_plan(cfg, shape).dynamic_smem)
        big = torch.full((shape.total_q + 2 * guard, shape.heads, shape.head_dim), math.nan, dtype=inputs["q"].dtype,
                         device="cuda")
        big[:guard] = 7.0
        big[-guard:] = 7.0
        out = V.packed_view(big[guard:guard + shape.total_q])
        lse = torch.full((1, shape.heads, shape.total_q), math.nan, device="cuda") if lse_wanted else None
        attention.launcher(kernel, cfg, shape, inputs, out, lse)()
        torch.cuda.synchronize()
        assert (big[:guard] == 7.0).all() and (big[-guard:] == 7.0).all()
        assert torch.isfinite(out).all()
        err = (out.float() - ref).abs()
        assert (err <= atol + rtol * ref.abs()).all(), float(err.max())
        cu_q, _ = shape.cu_seqlens()
        for b in range(shape.batch):
            if shape.varlen[b] and not shape.key_lengths[b]:
                assert (out[:, :, cu_q[b]:cu_q[b + 1]] == 0).all()
        if lse_wanted:
            seen = torch.zeros(shape.total_q, dtype=torch.bool)
            for b in shape.computed_sequences():
                seen[cu_q[b]:cu_q[b + 1]] = True
            assert torch.isfinite(lse[:, :, seen.cuda()]).all()


@pytest.mark.gpu
def test_packed_batch_equals_the_dense_kernel(attention, space):
    """Uniform lengths: the varlen kernel's output on the packed tensors equals, bit for bit, the dense kernel's on the
    same memory seen as (B, H, L, D) (same config, same tiles, the same arithmetic)."""
    import torch

    from _variant_pairs import run_configs

    shape = parse_shape("4,16,777,128:bf16:causal:kv4:varlen=777*4")
    dense = V.dense_equivalent(shape)
    (out,), _, inputs = run_configs(attention, space, shape, (HOPPER,))
    from evotune.build.compile import compile_source, load_kernel
    from evotune.build.template import instantiate

    cfg = space.config(HOPPER)
    src = instantiate(attention, cfg, dense)
    kernel = load_kernel(compile_source(src.code, src.entry), attention.launch_plan(cfg, dense).dynamic_smem)
    views = {n: V.sdpa_view(shape, inputs[n], 777) for n in "qkv"}
    views["scale"] = inputs["scale"]
    dense_out = torch.full_like(views["q"], math.nan)
    attention.launcher(kernel, cfg, dense, views, dense_out)()
    torch.cuda.synchronize()
    assert torch.equal(V.from_dense(dense_out), out)
