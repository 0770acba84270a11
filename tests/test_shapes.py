"""Tests for evotune.problems.shapes: presets, the `--shape` spelling, and the work a shape represents."""

from __future__ import annotations

import pytest

from evotune.errors import UsageError
from evotune.problems.shapes import PRESETS, Shape, parse_shape


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_parses_to_its_shape(name):
    """Each preset name gives exactly the Shape listed in PRESETS."""
    assert parse_shape(name) == PRESETS[name][0]


def test_mission_preset():
    """The mission preset is 1x8 heads x 512 tokens x d64, fp16, not causal, (B,H,S,D) layout."""
    assert parse_shape("mission") == Shape(1, 8, 512, 512, 64, dtype="fp16", causal=False, layout="bhsd")


def test_four_dims_mean_equal_sequences():
    """`B,H,S,D` sets seq_q = seq_k = S and keeps the defaults fp16, not causal, bhsd."""
    assert parse_shape("4,32,4096,128") == Shape(4, 32, 4096, 4096, 128)


def test_five_dims_give_separate_sequences():
    """`B,H,Sq,Sk,D` sets the query and key lengths separately, and spaces around numbers are allowed."""
    assert parse_shape(" 2, 16, 128, 8192, 64 ") == Shape(2, 16, 128, 8192, 64)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,8,512,64:bf16", Shape(1, 8, 512, 512, 64, dtype="bf16")),
        ("1,8,512,64:fp16", Shape(1, 8, 512, 512, 64, dtype="fp16")),
        ("1,8,512,64:causal", Shape(1, 8, 512, 512, 64, causal=True)),
        ("1,8,512,64:bshd", Shape(1, 8, 512, 512, 64, layout="bshd")),
        ("4,32,4096,128:bf16:causal:bshd", Shape(4, 32, 4096, 4096, 128, dtype="bf16", causal=True, layout="bshd")),
        ("1,8,512,64:BF16:Causal", Shape(1, 8, 512, 512, 64, dtype="bf16", causal=True)),
    ],
)
def test_flags(text, expected):
    """The dtype, causal and layout flags set their fields, in any order and letter case."""
    assert parse_shape(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("mission:bf16", Shape(1, 8, 512, 512, 64, dtype="bf16")),
        ("mission:causal:bshd", Shape(1, 8, 512, 512, 64, causal=True, layout="bshd")),
        ("gpt2-causal:bf16", Shape(16, 12, 1024, 1024, 64, dtype="bf16", causal=True)),
        ("llama-4k:bhsd", Shape(4, 32, 4096, 4096, 128)),
    ],
)
def test_preset_with_flags(text, expected):
    """A preset followed by flags keeps the preset's own fields and adds the flags."""
    assert parse_shape(text) == expected


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("nosuch", "unknown preset 'nosuch'; presets: mission"),
        ("", "shape: empty"),
        ("   ", "shape: empty"),
        ("1,8,512", "cannot read '1,8,512'"),
        ("1,8,512,64,64,64", "cannot read"),
        ("1,8,x,64", "cannot read"),
        ("1;8;512;64", "cannot read"),
        ("1,8,-512,64", "cannot read"),
        ("1,8,512.5,64", "cannot read"),
        ("0,8,512,64", "batch must be a positive integer, got 0"),
        ("1,0,512,64", "heads must be a positive integer"),
        ("1,8,0,64", "seq_q must be a positive integer"),
        ("1,8,512,0,64", "seq_k must be a positive integer"),
        ("1,8,512,0", "head_dim must be a positive integer"),
        ("1,8,512,64:fp32", "unknown flag 'fp32'"),
        ("mission:sideways", "unknown flag 'sideways' in 'mission:sideways'"),
    ],
)
def test_bad_shapes(text, fragment):
    """Unknown presets, malformed text, non-positive dimensions and unknown flags raise UsageError saying which."""
    with pytest.raises(UsageError) as info:
        parse_shape(text)
    assert fragment in str(info.value)
    assert info.value.exit_code == 2


def test_shape_rejects_bad_fields_directly():
    """Shape itself refuses a negative dimension, an unknown dtype and an unknown layout."""
    with pytest.raises(UsageError, match="heads must be a positive integer, got -1"):
        Shape(1, -1, 8, 8, 64)
    with pytest.raises(UsageError, match="dtype must be one of fp16, bf16"):
        Shape(1, 1, 8, 8, 64, dtype="fp32")
    with pytest.raises(UsageError, match="layout must be one of bhsd, bshd"):
        Shape(1, 1, 8, 8, 64, layout="sbhd")


@pytest.mark.parametrize(
    "shape, spec",
    [
        (Shape(1, 8, 512, 512, 64), "1,8,512,64:fp16"),
        (Shape(2, 16, 128, 8192, 64, dtype="bf16"), "2,16,128,8192,64:bf16"),
        (Shape(4, 32, 4096, 4096, 128, causal=True, layout="bshd"), "4,32,4096,128:fp16:causal:bshd"),
    ],
)
def test_spec_spelling(shape, spec):
    """spec writes 4 dims when the sequences are equal, 5 when not, then the dtype and any other flags."""
    assert shape.spec == spec


@pytest.mark.parametrize(
    "shape",
    [p for p, _ in PRESETS.values()]
    + [
        Shape(2, 16, 128, 8192, 64, dtype="bf16", causal=True, layout="bshd"),
        Shape(3, 5, 777, 777, 128, layout="bshd"),
        Shape(1, 1, 1, 1, 64, dtype="bf16"),
    ],
    ids=lambda s: s.spec,
)
def test_spec_round_trips(shape):
    """parse_shape(shape.spec) gives back the same shape."""
    assert parse_shape(shape.spec) == shape


def test_dict_round_trip():
    """Shape.from_dict(shape.as_dict()) gives back the same shape."""
    shape = Shape(2, 16, 128, 8192, 128, dtype="bf16", causal=True, layout="bshd")
    assert Shape.from_dict(shape.as_dict()) == shape


def test_mission_flops_and_bytes():
    """The mission shape does 4*B*H*S*S*D matmul FLOPs and moves Q, K, V and O once in 2-byte elements."""
    shape = parse_shape("mission")
    assert shape.flops() == 4 * 1 * 8 * 512 * 512 * 64 == 536_870_912
    assert shape.min_bytes() == (2 * 8 * 512 * 64 + 2 * 8 * 512 * 64) * 2 == 2_097_152
    assert shape.dtype_bytes == 2


def test_causal_halves_flops_and_keeps_bytes():
    """A causal mask halves the counted FLOPs but not the bytes moved."""
    plain, causal = parse_shape("mission"), parse_shape("mission:causal")
    assert causal.flops() == plain.flops() / 2
    assert causal.min_bytes() == plain.min_bytes()


def test_unequal_sequences_flops_and_bytes():
    """With seq_q != seq_k, FLOPs scale with Sq*Sk and bytes count Q, O at Sq and K, V at Sk."""
    shape = parse_shape("1,2,128,1024,64")
    assert shape.flops() == 4 * 1 * 2 * 128 * 1024 * 64
    assert shape.min_bytes() == (2 * 2 * 128 * 64 + 2 * 2 * 1024 * 64) * 2


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("mission:fp16:bf16", "flag 'bf16' conflicts with 'fp16' in 'mission:fp16:bf16'"),
        ("1,8,512,64:bf16:fp16", "flag 'fp16' conflicts with 'bf16'"),
        ("1,8,512,64:causal:causal", "flag 'causal' repeats 'causal'"),
        ("gpt2:bshd:bhsd", "flag 'bhsd' conflicts with 'bshd'"),
        ("1,8,512,64:bf16:BF16", "flag 'bf16' repeats 'bf16'"),
    ],
)
def test_conflicting_or_repeated_flags(text, fragment):
    """Two flags of one kind (dtype, causal, layout) are a UsageError, not a silent last-one-wins."""
    with pytest.raises(UsageError) as info:
        parse_shape(text)
    assert fragment in str(info.value) and info.value.exit_code == 2


def test_preset_flags_override_the_preset_once():
    """A flag after a preset overrides the preset's own field (that is not a conflict)."""
    assert parse_shape("gpt2-causal:bf16:bshd") == Shape(16, 12, 1024, 1024, 64, dtype="bf16", causal=True,
                                                         layout="bshd")
    assert parse_shape("gpt2-causal:causal").causal is True


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("1,8,4294967296,64",
         "seq_q 4294967296 is too large: at most 1073741824 (the kernel indexes rows with 32-bit int)"),
        ("1,8,512,2147483648,64", "seq_k 2147483648 is too large: at most 1073741824"),
        ("1,65536,512,64", "heads 65536 is too large: at most 65535 (CUDA's grid y limit)"),
        ("65536,8,512,64", "batch 65536 is too large: at most 65535 (CUDA's grid z limit)"),
        ("1,8,512," + "9" * 5000, "head_dim has 5000 digits: too large"),
        ("1,8," + "9" * 5000 + ",64", "seq_q has 5000 digits: too large: at most 1073741824"),
    ],
    ids=["seq-2^32", "seq_k-2^31", "heads", "batch", "5000-digit-d", "5000-digit-seq"],
)
def test_dimensions_are_bounded(text, fragment):
    """Every dimension is bounded so the kernel's int indices and CUDA's grid limits hold; the message says which
    bound and why, and stays short even for a 5000-digit number."""
    with pytest.raises(UsageError) as info:
        parse_shape(text)
    assert fragment in str(info.value) and len(str(info.value)) < 200


def test_largest_dimensions_are_accepted():
    """The bounds themselves are allowed, and leading zeros do not count as digits."""
    shape = parse_shape("65535,65535,1073741824,1073741824,128")
    assert (shape.batch, shape.heads, shape.seq_q) == (65535, 65535, 2**30)
    assert parse_shape("1,8,0000000000000000000512,64").seq_q == 512


def test_long_text_is_cut_in_messages():
    """A long unreadable --shape is quoted cut short, so the error stays one short line."""
    with pytest.raises(UsageError) as info:
        parse_shape("x" * 3000 + ",1")
    assert "(3002 characters)" in str(info.value) and len(str(info.value)) < 250
