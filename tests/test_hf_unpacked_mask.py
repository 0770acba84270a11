"""register(assume_unpacked=True)'s mask builder leaves out only a mask transformers lets it skip: where
create_causal_mask overlays something on the causal mask it turns allow_is_causal_skip off, and the mask is then built
as sdpa_mask builds it, so a model whose mask is not plain causal (Gemma-3's bidirectional image tokens, packed
sequences) is never run causal. Before, the builder ignored the flag and returned no mask."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from transformers.masking_utils import causal_mask_function, or_masks, sdpa_mask  # noqa: E402

from evotune.torch.hf import unpacked_causal_mask  # noqa: E402


def bidirectional_block(b, h, q, k):  # an overlay: positions 2-4 see each other both ways, as image tokens do
    return (q >= 2) & (q <= 4) & (k >= 2) & (k <= 4)


def test_plain_causal_prefill_gets_no_mask():
    assert unpacked_causal_mask(1, 8, 8, mask_function=causal_mask_function) is None
    assert unpacked_causal_mask(1, 8, 8) is None


@pytest.mark.parametrize("case", ["skip off", "overlay"])
def test_a_mask_that_is_not_plain_causal_is_built(case):
    if case == "skip off":
        kw = {"mask_function": causal_mask_function, "allow_is_causal_skip": False}
    else:
        kw = {"mask_function": or_masks(causal_mask_function, bidirectional_block), "allow_is_causal_skip": False}
    got = unpacked_causal_mask(1, 8, 8, **kw)
    want = sdpa_mask(1, 8, 8, **kw)
    assert got is not None and want is not None and torch.equal(got, want)
    if case == "overlay":
        assert bool(got[0, 0, 2, 4])  # the overlay's bidirectional cell survives: the call is not run causal
