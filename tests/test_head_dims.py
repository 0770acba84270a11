"""Head dims 96, 192 and 256 (issue 42): the space's admission, the Hopper tiles' padded width (tile_dim), NVRTC
compiles of both kernels, the op's coverage, and on a GPU the full gate (NaN poison, perturbed keys, the fp32
reference's tolerance) over the Hopper kernel's pieces and the mma.sync kernel at 256."""

from __future__ import annotations

import pytest

from evotune.problems.attention import HEAD_DIMS, tile_dim
from evotune.problems.shapes import parse_shape
from evotune.space.searchspace import shape_context

# A Hopper tile each head dim compiles clean in: two consumer warpgroups and a producer (240 registers after
# setmaxnreg), 64-key K/V tiles (O's tile_dim / 2 accumulators leave room for S's 32 at 256).
HOPPER = {"mma": "wgmma", "block_m": 128, "compute_warps": 8, "producer_warps": 4, "block_n": 64, "stages": 2,
          "q_in_regs": False}
SYNC_256 = {"mma": "sync", "block_m": 64, "block_n": 32, "compute_warps": 4, "producer_warps": 0, "stages": 2,
            "q_in_regs": False}


@pytest.mark.parametrize("dim", [96, 192, 256])
def test_space_admits_the_hopper_kernel_and_sync_only_at_256(space, dim):
    """Each new head dim admits Hopper configs; the mma.sync kernel only at 256 (its loaders cover whole rows of
    head_dim / 8 chunks: 12 and 24 divide no thread count it has); a head dim outside the list admits nothing."""
    context = shape_context(parse_shape(f"1,8,1024,1024,{dim}:causal"))
    assert space.violations(space.config(HOPPER), context) == []
    sync_reasons = space.violations(space.config(SYNC_256), context)
    assert (sync_reasons == []) == (dim == 256)
    other = shape_context(parse_shape("1,8,1024,1024,80"))
    assert any("head dims 64, 96" in why for why in space.violations(space.config(HOPPER), other))


def test_o_accumulators_bound_the_warpgroups(space):
    """Head dim 256 at three consumer warpgroups and a producer (a 128-register launch bound) is refused for its O
    accumulators (ptxas refuses it); 192 there and 256 at two warpgroups are admitted."""
    three = {**HOPPER, "block_m": 192, "compute_warps": 12, "block_n": 32}
    d256, d192 = (shape_context(parse_shape(f"1,8,1024,1024,{d}")) for d in (256, 192))
    assert any("O in registers" in why for why in space.violations(space.config(three), d256))
    assert space.violations(space.config(three), d192) == []
    assert space.violations(space.config(HOPPER), d256) == []


def test_hopper_tiles_hold_whole_regions(attention, space):
    """Head dim 96's Hopper tiles are 128 columns wide (its shared memory that of 128, TMA filling the rest), the
    mma.sync kernel's are the head dim; the tensor maps' extent is the real head dim, so the fill is zeros."""
    d96, d128 = parse_shape("1,8,512,96"), parse_shape("1,8,512,128")
    hopper, sync = space.config(HOPPER), space.config({"mma": "sync"})
    assert tile_dim(hopper, d96) == 128 and tile_dim(sync, parse_shape("1,8,512,256")) == 256
    assert attention.geometry(hopper, d96).dynamic_smem == attention.geometry(hopper, d128).dynamic_smem
    from evotune.problems.attention import _map_args

    strides = (512 * 8 * 96, 512 * 96, 96, 1)
    args = _map_args(space.config({**HOPPER, "epilogue": "tma", "persistent": True}), d96, strides, strides, strides,
                     strides)
    assert [a.dims[0] for a in args] == [96] * 4 and [a.box[0] for a in args] == [64] * 4


@pytest.mark.parametrize("text, knobs", [
    ("1,8,1024,96:causal", {}),
    ("4,16,1024,96:bf16:kv2", {"persistent": True, "epilogue": "tma", "q_in_regs": True}),
    ("1,8,1024,192:causal", {}),
    ("1,8,1024,256:bf16:causal", {}),
    ("1,8,1024,256:causal:window=100,0:softcap=50", {}),  # Gemma-2's local layer
    ("1,8,1024,256", SYNC_256),
])
def test_kernels_compile_clean(attention, space, text, knobs):
    """Sampled configs of each new head dim compile for sm_90a with no spill, no stack frame, within the static gate."""
    from _variant_pairs import assert_compiles_clean

    shape = parse_shape(text)
    cfg = {**HOPPER, **knobs}
    assert space.violations(space.config(cfg), shape_context(shape)) == []
    assert_compiles_clean(attention, space, shape, cfg)


def test_op_covers_the_head_dims():
    """The op's coverage takes every head dim the kernel has, with the same value head dim; others are told why."""
    pytest.importorskip("torch")
    from evotune.torch.call import Call, coverage

    def call(d, dv):
        strides = ((8 * 64 * d, 64 * d, d, 1), (8 * 64 * d, 64 * d, d, 1), (8 * 64 * dv, 64 * dv, dv, 1))
        return Call(1, 8, 8, 64, 64, d, dv, "fp16", False, "bhsd", "cuda:0", strides)

    for d in HEAD_DIMS:
        assert coverage(call(d, d), (9, 0)) is None
    assert "head dim 80" in coverage(call(80, 80), (9, 0))
    assert coverage(call(192, 128), (9, 0)) is None  # DeepSeek MLA (tests/test_mla.py)
    assert "value head dim 96" in coverage(call(128, 96), (9, 0))


# ------------------------------------------------------------------ GPU

# Ragged lengths (tails in both tiles), GQA, bshd, bf16, Sq != Sk both ways; enough query tiles for the persistent grid.
GPU_CASES = [
    "2,16,197,300,96",
    "1,32,1000,96:causal:kv8",         # Phi-3's d96 (GQA here, to cover the group index)
    "2,16,513,96:bf16:causal:bshd",
    "2,16,300,197,192:bf16",
    "2,16,1000,192:causal:kv4:bshd",
    "4,8,777,256:causal:kv4",          # Gemma-2's d256
    "1,16,300,1000,256:bf16",
    "1,8,1000,256:bf16:causal:window=100,0:softcap=50:bshd",  # Gemma-2's local layer
]
GPU_CONFIGS = [{}, {"persistent": True}, {"persistent": True, "epilogue": "tma"}, {"producer_warps": 0, "stages": 3},
               {"pingpong": True}, {"q_in_regs": True}, {"p_operand": "smem"}]
GPU_IDS = ["onetile", "persistent", "tmastore", "noproducer", "pingpong", "qregs", "psmem"]


def _gate(attention, space, text, cfg):
    from _variant_pairs import assert_gate_passes

    assert_gate_passes(attention, space, text, cfg, skip_spills=True)


@pytest.mark.gpu
@pytest.mark.parametrize("text", GPU_CASES)
@pytest.mark.parametrize("knobs", GPU_CONFIGS, ids=GPU_IDS)
def test_hopper_gate_passes(attention, space, text, knobs):
    """The full gate passes on the Hopper kernel for each new head dim, over its pieces."""
    _gate(attention, space, text, {**HOPPER, **knobs})


@pytest.mark.gpu
@pytest.mark.parametrize("text", ["2,8,197,300,256", "1,16,513,256:bf16:causal:kv4:bshd"])
def test_sync_gate_passes_at_256(attention, space, text):
    """The full gate passes on the mma.sync kernel at head dim 256."""
    _gate(attention, space, text, SYNC_256)
