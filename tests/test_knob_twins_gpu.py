"""Every knob of search_spaces/attention.yaml against its twin: the same config with that knob at its default.

A knob that is not meant to change the arithmetic (where operands are loaded from or stored to, which warps issue what,
when barriers wait, how the grid walks its tiles, how the launch overlaps the previous kernel) must give on the GPU the
output bit for bit its twin's, on identical random inputs: that, not a byte-for-byte pin of the source, is what says
"a knob at its default changes nothing" and "a variant computes what the kernel computed before it" (issue 39).
A knob that changes the order or the form of the arithmetic (the tile shape, the split of a row's keys across warps or
CTAs, the exp2 polynomial, the lazy rescale, the instruction set) is held to the correctness gate's tolerance between
the two outputs instead (evotune.gpu.evaluate.output_errors with the family's atol x |V| and rtol): each case says
which, and why.

CPU: the cases cover every knob of attention.yaml; each case's config and twin are both admitted on at least one of its
shapes (so the GPU test cannot skip every shape) and instantiate to different sources (so a bitwise pass is not one
kernel compared with itself). GPU (marked): on each shape that admits both, both compile clean (no stack frame, within
the static gate; a pair where either spills is skipped, as the static gate prunes it), run once each on the same
inputs into NaN-filled outputs, write every element, and agree bit for bit, or within the gate's tolerance where the
case says so. Where a knob is admitted, how its traits read it and its SASS are the knob's own module's business
(tests/test_<knob>.py); this file is the one table of twins."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
from _variant_pairs import assert_compiles_clean, compile_config, run_configs

from evotune.build.template import instantiate
from evotune.problems.shapes import parse_shape

BITWISE = "bitwise"  # the output bit for bit the twin's
GATE = "gate"  # within the gate's tolerance of the twin's output


@dataclass(frozen=True)
class Twin:
    """A knob set to `value` over `base` (knobs over the space's defaults), compared with the same config at the
    knob's default (plus `twin_fix`: knobs the default value cannot run with, changed with it), on `shapes`."""

    knob: str
    value: object
    base: dict
    mode: str
    shapes: tuple
    why: str
    twin_fix: dict = field(default_factory=dict)


# mma.sync at the space's defaults (64 x 64 tile, 4 compute warps, 2 stages, swizzled, Q in registers): the base of the
# mma.sync knobs. The wgmma base: two consumer warpgroups and a producer warpgroup on a 128 x 128 tile, Q in shared
# memory; its causal form takes 64-key tiles, so a warpgroup's diagonal can end a K/V tile early (causal_extent).
SYNC: dict = {}
WG = dict(mma="wgmma", block_m=128, block_n=128, compute_warps=8, producer_warps=4, stages=2, q_in_regs=False)
WG_CAUSAL = dict(WG, block_n=64)
WG_WIDE = dict(WG, block_m=192, compute_warps=12)  # three consumer warpgroups: a ragged last tile leaves one empty
WG_STRIPES = dict(WG_CAUSAL, persistent=True, causal_extent="warpgroup")

# d64 and d128, fp16 and bf16, ragged and Sq != Sk, causal, BSHD, grouped K/V heads. The pdl constraint admits pdl only
# up to 2^32 multiply-adds per Q K^T, and persistent only with more query tiles than SMs: their cases name their own.
SYNC_SHAPES = ("mission", "2,3,200,333,64:bf16", "1,4,300,128:causal:bshd")
WG_SHAPES = ("gpt2", "2,3,200,333,64:bf16:causal", "1,2,300,128:causal:kv1")
CAUSAL_SHAPES = ("gpt2-causal", "2,3,200,333,64:bf16:causal", "1,2,300,128:causal")
SMALL_SHAPES = ("mission", "2,8,1024,64:causal", "1,4,300,128:bf16")
MANY_TILES = ("gpt2", "2,16,1088,1024,64:causal", "2,32,1000,128:bf16:kv8")
MANY_CAUSAL_TILES = ("gpt2-causal", "2,16,1088,1024,64:causal", "1,70,600,700,64:bf16:causal")
RAGGED = ("1,4,1000,64:bf16:causal", "gpt2", "2,4,257,64:bshd")  # seq_q % 192: 40, 64, 65

_TILE = "the tile shape changes how a row's keys are grouped into online-softmax steps, or the registers and unrolling "
_LOADS = "only how Q, K and V reach shared memory changes; every product reads the same values"

CASES = [
    # The instruction set and the tile: the arithmetic itself changes.
    Twin("mma", "wgmma", WG, GATE, WG_SHAPES, "wgmma and mma.sync are different instructions, tiles and softmax code",
         twin_fix=dict(producer_warps=0)),
    Twin("block_m", 128, SYNC, GATE, SYNC_SHAPES, _TILE + "of a row's warp: not designed to be bitwise"),
    Twin("block_m", 192, WG_WIDE, GATE, WG_SHAPES[:2] + ("2,4,257,64:bshd",),  # three d128 warpgroups spill
         _TILE + "of a row's warpgroup: not designed to be bitwise",
         twin_fix=dict(compute_warps=4)),
    Twin("block_n", 128, SYNC, GATE, SYNC_SHAPES, _TILE + "(a different sum order)"),
    Twin("compute_warps", 8, dict(block_m=128), GATE, SYNC_SHAPES, _TILE + "(rows per warp)"),
    Twin("kv_splits", 2, SYNC, GATE, SYNC_SHAPES, "each split sums its share of the keys, then the partials merge"),
    Twin("warp_key_groups", 2, dict(block_m=128, compute_warps=8), GATE, SYNC_SHAPES,
         "each key group sums its share of every tile's keys, then the partials merge"),
    Twin("key_merge", "split", dict(block_m=128, compute_warps=8, warp_key_groups=2), GATE, SYNC_SHAPES,
         "the same terms in the same order, but ptxas contracts a different product of each a * w0 + w1 * b into the "
         "FMA (tests/test_split_merge.py holds it to two units in the last place)"),
    Twin("exp2_fma", 1, SYNC, GATE, SYNC_SHAPES, "a degree-3 polynomial instead of ex2.approx for an eighth of exp2"),
    Twin("exp2_fma", 2, SYNC, GATE, SYNC_SHAPES, "a degree-3 polynomial instead of ex2.approx for two eighths"),
    Twin("rescale", "lazy", WG, GATE, WG_SHAPES, "a row keeps a stale max up to 2^8 below the true one"),
    # Knobs that move data, issue or wait differently: the same arithmetic, bit for bit.
    Twin("producer_warps", 2, SYNC, BITWISE, SYNC_SHAPES, "producer warps only issue the K/V copies"),
    Twin("producer_warps", 4, dict(WG, producer_warps=0), BITWISE, WG_SHAPES,
         "the producer warpgroup only issues TMA (and hands its registers over)"),
    Twin("stages", 3, SYNC, BITWISE, SYNC_SHAPES, "a deeper K/V ring: the same tiles, loaded further ahead"),
    Twin("stages", 4, WG, BITWISE, WG_SHAPES, "a deeper K/V ring: the same tiles, loaded further ahead"),
    Twin("smem_layout", "pad", SYNC, BITWISE, SYNC_SHAPES, "padded rows: other addresses, the same values"),
    Twin("smem_layout", "plain", SYNC, BITWISE, SYNC_SHAPES, "unpadded rows: other addresses, the same values"),
    Twin("q_in_regs", False, SYNC, BITWISE, SYNC_SHAPES, "Q's fragments re-read from shared memory each k-step"),
    Twin("q_in_regs", False, WG, BITWISE, WG_SHAPES, "Q K^T's A operand from a descriptor instead of registers"),
    Twin("pingpong", True, WG, BITWISE, WG_SHAPES, "the warpgroups take turns issuing: the same products"),
    Twin("persistent", True, WG, BITWISE, MANY_TILES, "a CTA loops over query tiles, each computed as before"),
    Twin("pdl", True, SYNC, BITWISE, SMALL_SHAPES, "griddepcontrol and the launch attribute only"),
    Twin("pdl", True, WG, BITWISE, SMALL_SHAPES, "griddepcontrol and the launch attribute only"),
    Twin("epilogue", "tma", WG, BITWISE, WG_SHAPES, "O staged in shared memory and stored by TMA: the same values"),
    Twin("kv_load", "tma", SYNC, BITWISE, SYNC_SHAPES, _LOADS),
    Twin("kv_load", "tma_split", SYNC, BITWISE, SYNC_SHAPES, _LOADS + " (K and V on barriers of their own)"),
    Twin("kv_cluster", 2, dict(kv_load="tma"), BITWISE, SYNC_SHAPES, _LOADS + " (multicast across the cluster)"),
    Twin("rescale", "new_max", WG, BITWISE, WG_SHAPES, "O's multiply by exactly 1 skipped where no row took a new max"),
    Twin("softmax_overlap", True, WG, BITWISE, WG_SHAPES, "the loop rotated: the same instructions in the same order"),
    Twin("lean_addressing", True, WG, BITWISE, WG_SHAPES, "the same descriptors and slots from cheaper arithmetic"),
    Twin("p_operand", "smem", WG, BITWISE, WG_SHAPES, "P V reads P from shared memory instead of registers"),
    Twin("empty_warpgroups", "skip", WG_WIDE, BITWISE, RAGGED, "a warpgroup with padding rows only skips them"),
    Twin("causal_extent", "warpgroup", WG_CAUSAL, BITWISE, CAUSAL_SHAPES,
         "the tiles a warpgroup no longer computes are masked whole for its rows: they add exactly nothing"),
    Twin("stripe_order", "mirrored", WG_STRIPES, BITWISE, MANY_CAUSAL_TILES,
         "each 64-row stripe computed as before, by another warpgroup on odd tiles"),
]


def _id(case: Twin) -> str:
    return f"{case.knob}={case.value}" + ("-wgmma" if case.base.get("mma") == "wgmma" and case.knob != "mma" else "")


def _pair(space, case: Twin) -> tuple[dict, dict]:
    """(config, twin) of a case as dicts of knobs over the space's defaults."""
    default = space.default_config().as_dict()[case.knob]
    return dict(case.base, **{case.knob: case.value}), dict(case.base, **{case.knob: default}, **case.twin_fix)


def _admitted(attention, space, cfg: dict, shape) -> bool:
    return space.admitted(space.config(cfg), attention.context(shape))


# ------------------------------------------------------------------ CPU: the table itself


def test_every_knob_has_a_twin(space):
    """Each knob of attention.yaml has at least one case, and every case names a knob, a value other than its default
    and a mode."""
    assert {c.knob for c in CASES} == set(space.param_names())
    defaults = space.default_config().as_dict()
    for case in CASES:
        assert case.value != defaults[case.knob] and case.mode in (BITWISE, GATE) and case.why, case


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_each_twin_pair_is_admitted_and_differs(attention, space, case):
    """The config and its twin are both admitted on at least one of the case's shapes, and there they instantiate to
    different sources (the knob reaches the code)."""
    cfg, twin = _pair(space, case)
    shapes = [s for s in map(parse_shape, case.shapes)
              if _admitted(attention, space, cfg, s) and _admitted(attention, space, twin, s)]
    assert shapes, f"{_id(case)}: neither config nor twin admitted together on any of {case.shapes}"
    shape = shapes[0]
    assert (instantiate(attention, space.config(cfg), shape).digest
            != instantiate(attention, space.config(twin), shape).digest)


# ------------------------------------------------------------------ GPU: the outputs


def _items():
    return [pytest.param(case, shape, id=f"{_id(case)}-{shape}") for case in CASES for shape in case.shapes]


@pytest.fixture(scope="module")
def compiled_twins(attention, space):
    """Compile every admitted config and twin of the table, on every shape, in parallel, into the session's compile
    cache (conftest's EVOTUNE_CACHE, inherited by the pool's processes), so each test below reads its two cubins."""
    from evotune.build.compile import CompileError, compile_pool, compile_source

    sources = {}
    for case in CASES:
        for text in case.shapes:
            shape = parse_shape(text)
            for c in _pair(space, case):
                if _admitted(attention, space, c, shape):
                    src = instantiate(attention, space.config(c), shape)
                    sources[src.digest] = (src.code, src.entry)
    with compile_pool(os.cpu_count() or 1) as pool:
        futures = [pool.submit(compile_source, code, entry) for code, entry in sources.values()]
        for f in futures:
            try:
                f.result()
            except CompileError:  # the test of that config reports it
                pass
    return len(sources)


@pytest.mark.gpu
@pytest.mark.parametrize("case, shape_text", _items())
def test_knob_output_matches_its_twin(attention, space, compiled_twins, case, shape_text):
    """The config and its twin (the knob at its default), where both are admitted: both compile clean, both write every
    element, finite, and the outputs are equal bit for bit, or within the gate's tolerance where the case's knob changes
    the arithmetic (the case's `mode` and `why`)."""
    import torch

    from evotune.gpu.evaluate import output_errors

    shape = parse_shape(shape_text)
    cfg, twin = _pair(space, case)
    if not (_admitted(attention, space, cfg, shape) and _admitted(attention, space, twin, shape)):
        pytest.skip("the config or its twin is not admitted on this shape")
    for which, c in (("config", cfg), ("twin", twin)):
        if compile_config(attention, space, shape, c)[2].resources.spill_stores:
            pytest.skip(f"the {which} spills: the static gate prunes it")
    for c in (cfg, twin):
        assert_compiles_clean(attention, space, shape, c)
    (out, twin_out), _, inputs = run_configs(attention, space, shape, (cfg, twin), seed=7)
    assert torch.isfinite(out.float()).all() and torch.isfinite(twin_out.float()).all()
    if case.mode == BITWISE:
        differ = int((out.view(torch.int16) != twin_out.view(torch.int16)).sum())
        assert differ == 0, (f"{differ} elements differ from the twin's, max "
                             f"{float((out.float() - twin_out.float()).abs().max()):.3g} ({case.why})")
    else:
        atol, rtol = attention.tolerance(shape)
        ratio = output_errors(out, twin_out.float(), atol * attention.error_scale(inputs), rtol)[3]
        assert ratio < 1.0, f"{ratio:.3g} of the gate's tolerance from the twin's output ({case.why})"
