"""Attention sinks (issue 42; gpt-oss's s_aux, flash-attention's learnable_sink): the `:sinks` spelling, the table key,
the fp32 reference's sink column, the space's admission, and the Hopper kernel's SINKS trait (CPU: NVRTC; GPU tests
marked)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from evotune.errors import UsageError
from evotune.problems.attention import SCORE_MOD_PARAMS, SINK_PARAMS, check_sinks, visibility_mask
from evotune.problems.shapes import Shape, parse_shape
from evotune.records.tuning_table import TableKey
from evotune.space.searchspace import shape_context

HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 128, "stages": 2,
          "q_in_regs": False}


# ------------------------------------------------------------------ shapes and keys


@pytest.mark.parametrize("text", ["1,2,64,64:sinks", "1,64,2048,64:bf16:kv8:window=127,0:sinks",
                                  "mission:sinks:softcap=30", "1,2,64,96,64:bshd:sinks"])
def test_sinks_read_and_round_trip(text):
    s = parse_shape(text)
    assert s.sinks and "sinks" in s.spec.split(":")
    assert parse_shape(s.spec) == s and Shape.from_dict(s.as_dict()) == s


def test_shapes_without_sinks_spell_and_key_as_before():
    """A shape without sinks names them nowhere: its spelling, record and table key read as before the flag."""
    s = parse_shape("gpt2:bf16:kv4")
    assert not s.sinks and "sinks" not in s.spec and "sinks" not in s.as_dict()
    assert "sinks" not in TableKey.for_shape(s, "NVIDIA H100", "9.0").as_dict()


def test_sinks_given_twice_is_a_usage_error():
    with pytest.raises(UsageError, match="repeats") as info:
        parse_shape("1,2,64,64:sinks:sinks")
    assert "\n" not in str(info.value)


def test_table_key_separates_sinks_and_reads_back(space):
    """A sinks call's key differs from the dense call's (a dense entry never serves it, exactly or as the nearest), and
    an entry's sinks key survives the table's JSON."""
    from _tables import entry, table

    from evotune.records.tuning_table import parse_table, select

    dense, sunk = (TableKey.for_shape(parse_shape(t), "NVIDIA H100", "9.0") for t in ("gpt2", "gpt2:sinks"))
    assert dense != sunk and sunk.sinks and sunk.as_dict()["sinks"] is True
    assert dense.group() != sunk.group()
    shape = parse_shape("gpt2:sinks")
    full = space.config(HOPPER).as_dict()
    written = table(entry(shape, full))
    read = parse_table(json.loads(json.dumps(written.as_dict())))
    assert read.entries[0].key.sinks and Shape.from_dict(read.entries[0].shape).sinks
    dense_only = table(entry(parse_shape("gpt2"), full))
    gpu = read.entries[0].key.gpu, read.entries[0].key.cc
    sunk_here = TableKey.for_shape(shape, *gpu)
    assert select(dense_only, sunk_here, shape, allow_nearest=True).entry is None
    assert select(read, sunk_here, shape).entry is not None


# ------------------------------------------------------------------ the reference


def test_reference_is_softmax_with_a_sink_column(attention):
    """The fp32 reference equals softmax over [scores, sink] without the sink's column, @V (float64 brute force), with
    a window whose leading rows see no key (0: the sink alone takes the mass) and grouped K/V heads."""
    import torch

    shape = parse_shape("2,4,37,23,64:kv2:window=3,2:sinks")
    inputs = attention.make_inputs(shape, 3, device="cpu")
    out = attention.reference(shape, inputs).double().numpy()
    q, k, v = (inputs[n].double().numpy() for n in ("q", "k", "v"))
    sinks = inputs["sinks"].double().numpy()
    seen = visibility_mask(shape).numpy()
    for b in range(2):
        for h in range(4):
            s = q[b, h] @ k[b, h // 2].T * inputs["scale"]
            s = np.where(seen, s, -np.inf)
            top = np.maximum(s.max(axis=1, keepdims=True), sinks[h])
            e = np.exp(s - top)
            p = e / (e.sum(axis=1, keepdims=True) + np.exp(sinks[h] - top))
            np.testing.assert_allclose(out[b, h], p @ v[b, h // 2], atol=1e-5)
    empty = ~seen.any(axis=1)
    assert empty.any() and (out[:, :, empty] == 0).all()
    assert torch.isfinite(attention.reference(shape, inputs)).all()


def test_sinks_change_the_output(attention):
    """The gate's sink logits are large enough to move the rows (a sinks shape is not checked against a dense answer)."""
    shape = parse_shape("1,4,64,64:sinks")
    inputs = attention.make_inputs(shape, 1, device="cpu")
    dense = attention.reference(parse_shape("1,4,64,64"), inputs)
    sunk = attention.reference(shape, inputs)
    assert float((sunk - dense).abs().max()) > 0.05


def test_check_sinks_refuses_what_the_kernel_cannot_read():
    import torch

    shape = parse_shape("1,4,64,64:sinks")
    good = torch.zeros(4)
    assert check_sinks(good, shape, good.device) is good
    for bad in (None, torch.zeros(3), torch.zeros(4, dtype=torch.float16), torch.zeros(8)[::2]):
        with pytest.raises(UsageError, match="sinks") as info:
            check_sinks(bad, shape, good.device)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------ the space and the kernel (NVRTC for sm_90a)


def test_space_admits_sinks_on_the_hopper_kernel_only(space):
    ctx = shape_context(parse_shape("1,8,512,64:sinks"))
    assert space.violations(space.config(HOPPER), ctx) == []
    assert space.violations(space.config({"mma": "sync"}), ctx)


def test_traits_and_parameter_only_on_sinks_shapes(attention, space):
    """A shape without sinks instantiates no SINKS argument and takes no sinks pointer; a sinks shape gets both, its
    entry's parameters ending with the score mods' and then the pointer."""
    from evotune.build.template import instantiate

    cfg = space.config(HOPPER)
    for text in ("gpt2", "gpt2:window=128,0", "gpt2:softcap=30"):
        code = instantiate(attention, cfg, parse_shape(text)).code
        assert "/* SINKS = */" not in code and "const float* __restrict__ sinks)" not in code
        assert attention.entry_params(cfg, shape=parse_shape(text))[-1] != SINK_PARAMS[0]
    shape = parse_shape("gpt2:sinks")
    code = instantiate(attention, cfg, shape).code
    assert "/* SINKS = */ true" in code and "const float* __restrict__ sinks" in code
    assert attention.entry_params(cfg, shape=shape)[-4:] == SCORE_MOD_PARAMS + SINK_PARAMS
    with pytest.raises(UsageError, match="Hopper kernel only"):
        attention.template_args(space.config({"mma": "sync"}), shape)


KERNEL_CASES = [
    ("2,4,1000,1200,64:sinks", {}),
    ("4,8,1000,128:bf16:causal:sinks:softcap=30", {"persistent": True}),
    ("1,64,2048,64:bf16:kv8:window=127,0:sinks", {"persistent": True, "epilogue": "tma"}),
    ("2,4,777,900,64:window=64,64:sinks", {"producer_warps": 0, "pingpong": True}),
    ("2,4,700,64:bf16:sinks", {"block_m": 192, "compute_warps": 12, "block_n": 64}),
]


@pytest.mark.parametrize("text, knobs", KERNEL_CASES)
def test_hopper_kernel_compiles_clean(attention, space, text, knobs):
    """Sampled sinks configs compile for sm_90a with no spill and no stack frame (the sink is one load and an ex2 per
    row in the epilogue)."""
    from _variant_pairs import assert_compiles_clean

    shape = parse_shape(text)
    cfg = {**HOPPER, **knobs}
    assert space.violations(space.config(cfg), shape_context(shape)) == []
    assert_compiles_clean(attention, space, shape, cfg)


# ------------------------------------------------------------------ GPU (the gate: NaN poison, perturbations, tolerance)

GPU_CASES = [
    "4,20,197,300,64:sinks",
    "2,40,1000,64:bf16:causal:sinks:kv8",
    "2,16,513,64:window=128,0:kv4:sinks",      # gpt-oss's sliding layers (window 128), ragged, GQA
    "4,20,300,197,64:window=1,1:sinks",        # Sq > Sk: rows that see no key (the sink alone: 0)
    "1,24,1000,128:bf16:causal:softcap=30:sinks:bshd",
    "1,16,555,96:sinks",
]
GPU_CONFIGS = [{}, {"persistent": True}, {"producer_warps": 0, "stages": 3}, {"pingpong": True},
               {"persistent": True, "epilogue": "tma"}]


@pytest.mark.gpu
@pytest.mark.parametrize("text", GPU_CASES)
@pytest.mark.parametrize("knobs", GPU_CONFIGS, ids=["onetile", "persistent", "noproducer", "pingpong", "tmastore"])
def test_gate_passes(attention, space, text, knobs):
    """The full gate (fresh inputs with fresh sink logits, NaN-poisoned output, perturbed keys, the fp32 reference's
    tolerance) passes."""
    from _variant_pairs import assert_gate_passes

    assert_gate_passes(attention, space, text, {**HOPPER, **knobs})


@pytest.mark.gpu
@pytest.mark.parametrize("text", ["2,4,300,197,64:window=1,1:sinks", "1,4,700,64:bf16:softcap=30:sinks",
                                  "1,4,256,64:sinks"])
def test_output_and_lse_against_the_reference(attention, space, text):
    """O within the gate's tolerance of the fp32 reference; the log-sum-exp is that of the row's scores and its sink
    (a row that sees no key: the sink itself), finite everywhere."""
    import torch

    from _variant_pairs import run_configs

    shape = parse_shape(text)
    (out,), (lse,), inputs = run_configs(attention, space, shape, (HOPPER,), lse=True)
    ref = attention.reference(shape, inputs)
    atol, rtol = attention.tolerance(shape)
    assert torch.isfinite(out.float()).all()
    assert ((out.float() - ref).abs() <= atol + rtol * ref.abs()).all(), float((out.float() - ref).abs().max())
    q, k = inputs["q"].float(), inputs["k"].float().repeat_interleave(shape.kv_group, dim=1)
    s = q @ k.transpose(-1, -2) * inputs["scale"]
    if shape.has_softcap:
        s = shape.softcap * torch.tanh(s / shape.softcap)
    mask = visibility_mask(shape, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    sink = inputs["sinks"].view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    want = torch.logsumexp(torch.cat([s, sink], dim=-1), dim=-1)
    assert torch.isfinite(lse).all()
    torch.testing.assert_close(lse, want, atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
def test_a_sink_far_above_the_scores_keeps_the_log_sum_exp_finite(attention, space):
    """A sink 200 above every score (its exp overflows fp32 against the row's shift): O is 0 to within the tolerance
    and the log-sum-exp is the sink's, not +inf."""
    import torch

    from evotune.build.compile import compile_source, load_kernel
    from evotune.build.template import instantiate

    shape = parse_shape("1,2,128,64:sinks")
    config = space.config(HOPPER)
    inputs = attention.make_inputs(shape, 7)
    inputs["sinks"] = torch.full((2,), 200.0, device="cuda")
    src = instantiate(attention, config, shape, write_lse=True)
    kernel = load_kernel(compile_source(src.code, src.entry), attention.launch_plan(config, shape).dynamic_smem)
    out = attention.new_output(inputs).fill_(math.nan)
    lse = torch.full((1, 2, 128), math.nan, device="cuda")
    attention.launcher(kernel, config, shape, inputs, out, lse)()
    torch.cuda.synchronize()
    assert out.abs().max().item() < 1e-6
    torch.testing.assert_close(lse, torch.full_like(lse, 200.0), atol=1e-3, rtol=0)
