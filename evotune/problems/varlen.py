"""Variable-length packed batches (flash-attention's varlen) in the attention family: the pieces of the problem that
differ from a dense batch, used by evotune.problems.attention (and the op, evotune.torch.varlen).

A varlen Shape (`:varlen=L1/L2/...`, evotune.problems.shapes) holds B sequences packed one after another: Q as
(total_q, H, D), K and V as (total_k, Hkv, D), and the (B + 1,) int32 prefix sums cu_seqlens_q / cu_seqlens_k. The
kernel (HopperTraits' VARLEN, kernels/hopper/varlen.cuh) reads the packed tensors as one batch of all their rows, so
the family hands them around as (1, H, total, D) views of that memory (`packed_view`): the gate, the launch, the
reference and the baselines then see 4-D tensors as for a dense shape, in the token-major (bshd) layout.

The fp32 reference is the dense reference of each sequence (`reference`); FlexAttention's baseline is the packed
tensors with a document mask (`flex_launcher`); SDPA's are the dense batch the packed tensors are where every
sequence has one length (`dense_equivalent`, `sdpa_view`), and are skipped otherwise.
"""

from __future__ import annotations

from ..errors import UsageError
from . import sink_logits
from .shapes import Shape


def packed_view(t):
    """A packed (total, H, D) tensor as the (1, H, total, D) view the family's launches read (no copy)."""
    return t.unsqueeze(0).transpose(1, 2)


def unpacked(t):
    """The (total, H, D) tensor a (1, H, total, D) packed view shows (no copy)."""
    return t[0].transpose(0, 1)


def cu_seqlens_tensors(shape: Shape, device):
    """(cu_seqlens_q, cu_seqlens_k) of a varlen shape as int32 tensors on `device`."""
    import torch

    cu_q, cu_k = shape.cu_seqlens()
    return (torch.tensor(cu_q, dtype=torch.int32, device=device), torch.tensor(cu_k, dtype=torch.int32, device=device))


def check_cu_seqlens(cu_seqlens, shape: Shape, device) -> tuple:
    """The (cu_seqlens_q, cu_seqlens_k) pair a varlen launch reads: contiguous (B + 1,) int32 tensors on `device`
    (the kernel reads B + 1 ints from each pointer); UsageError otherwise. Their values are not read here (that would
    wait for the GPU): the caller's contract, as flash-attention's."""
    import torch

    if not isinstance(cu_seqlens, (tuple, list)) or len(cu_seqlens) != 2:
        raise UsageError(f"attention: {shape.spec}: a varlen launch needs (cu_seqlens_q, cu_seqlens_k)")
    for name, t in zip(("cu_seqlens_q", "cu_seqlens_k"), cu_seqlens):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (shape.batch + 1,)
                or not t.is_contiguous() or t.device != device):
            got = (f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__)
            raise UsageError(f"attention: {shape.spec}: {name} must be a contiguous ({shape.batch + 1},) int32 tensor "
                             f"on {device}, got {got}")
    return tuple(cu_seqlens)


def dense_stand_in(shape: Shape) -> Shape:
    """The dense shape whose inputs are a varlen shape's packed tensors: one batch of total_q queries and total_k keys
    in the token-major layout, no mask and no score mods (make_inputs draws the tensors from it)."""
    return Shape(1, shape.heads, shape.total_q, shape.total_k, shape.head_dim, shape.dtype, layout="bshd",
                 kv_heads=shape.kv_heads)


def make_inputs(problem, shape: Shape, seed: int, device, pattern: str) -> dict:
    """A varlen shape's gate inputs: the packed tensors (as packed_view's views) drawn like a dense batch of one
    (the input patterns span the packed rows), the offsets, and a sinks shape's logits (problems.sink_logits)."""
    import torch

    inputs = problem.make_inputs(dense_stand_in(shape), seed, device, pattern)
    inputs["cu_seqlens_q"], inputs["cu_seqlens_k"] = cu_seqlens_tensors(shape, device)
    if shape.sinks:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed + 1)
        inputs["sinks"] = sink_logits(shape, gen, device)
    return inputs


def sequence_inputs(shape: Shape, inputs: dict, b: int) -> dict:
    """The inputs of sequence b alone, as a dense batch of one (views of the packed tensors)."""
    cu_q, cu_k = shape.cu_seqlens()
    one = {"q": inputs["q"][:, :, cu_q[b]:cu_q[b + 1]], "k": inputs["k"][:, :, cu_k[b]:cu_k[b + 1]],
           "v": inputs["v"][:, :, cu_k[b]:cu_k[b + 1]], "scale": inputs["scale"]}
    if "sinks" in inputs:
        one["sinks"] = inputs["sinks"]
    return one


def reference(problem, shape: Shape, inputs: dict):
    """The fp32 reference of a varlen shape: each sequence's dense reference (its own mask, window and score mods) in
    its packed rows; a sequence with queries and no keys is 0 (flash-attention's)."""
    import torch

    q = inputs["q"]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu_q, _ = shape.cu_seqlens()
    for b in shape.computed_sequences():
        out[:, :, cu_q[b]:cu_q[b + 1]] = problem.reference(shape.sequence_shape(b), sequence_inputs(shape, inputs, b))
    return out


def perturb(problem, shape: Shape, inputs: dict, rng, visibility_mask) -> tuple[dict, object]:
    """Inputs with one key/value row of one sequence changed, and the (1, H, total_q) mask of the output rows that
    must change: that sequence's rows of the K/V head's query heads that see the key (no other sequence's row may
    move). The sequence and row are drawn from `rng`; without one, the last sequence that has queries and keys.
    `visibility_mask`: attention's (a sequence's mask)."""
    import torch

    seqs = shape.computed_sequences()
    b = seqs[-1] if rng is None else seqs[rng.randrange(len(seqs))]
    sub = shape.sequence_shape(b)
    lo, hi = 0, (min(sub.seq_q, sub.seq_k) if sub.causal else sub.seq_k) - 1
    if sub.has_window:
        lo, hi = sub.key_range(0)[0], sub.key_range(sub.seq_q - 1)[1]
    if hi < lo:  # no row of this sequence sees any key: perturb its first key; nothing may change
        lo = hi = 0
    if rng is None:
        kvh, j = shape.kv_heads - 1, (lo + hi + 1) // 2
    else:
        kvh, j = rng.randrange(shape.kv_heads), rng.randint(lo, hi)
    cu_q, cu_k = shape.cu_seqlens()
    device = inputs["k"].device
    must_change = torch.zeros(1, shape.heads, shape.total_q, dtype=torch.bool, device=device)
    group = slice(kvh * shape.kv_group, (kvh + 1) * shape.kv_group)
    mask = visibility_mask(sub, device)
    rows = mask[:, j] if mask is not None else torch.ones(sub.seq_q, dtype=torch.bool, device=device)
    must_change[0, group, cu_q[b]:cu_q[b + 1]] = rows
    seen = must_change[0].nonzero().tolist()
    if not seen:
        k, v = inputs["k"].clone(), inputs["v"].clone()
        k[0, kvh, cu_k[b] + j] += 1
        return {**inputs, "k": k, "v": v}, must_change
    from . import aim_key

    head, row = seen[rng.randrange(len(seen))] if rng is not None else seen[-1]
    k, v = aim_key(inputs, 0, kvh, cu_k[b] + j, head, row)
    return {**inputs, "k": k, "v": v}, must_change


def sanitize_shape(shape: Shape) -> Shape:
    """A small varlen shape of the same class: three sequences (one of one row, one of a ragged last tile), two K/V
    heads where grouped, keys of other lengths where not causal."""
    from dataclasses import replace

    grouped = shape.kv_heads != shape.heads
    return replace(shape, batch=3, heads=2 * shape.kv_group if grouped else 2, kv_heads=2 if grouped else 0,
                   seq_q=197, seq_k=197 if shape.causal else 300, varlen=(1, 197, 64),
                   varlen_k=() if shape.causal else (300, 5, 64))


# --------------------------------------------------------------------------- baselines


def uniform_lengths(shape: Shape) -> tuple[int, int] | None:
    """(Lq, Lk) where every sequence has Lq queries and Lk keys (the packed tensors are then a dense batch); else
    None."""
    q, k = set(shape.varlen), set(shape.key_lengths)
    return (q.pop(), k.pop()) if len(q) == 1 and len(k) == 1 and min(shape.varlen) and min(shape.key_lengths) else None


def dense_equivalent(shape: Shape) -> Shape | None:
    """The dense (B, H, Lq, Lk) shape a varlen shape of uniform lengths is, in the token-major layout; else None."""
    lengths = uniform_lengths(shape)
    if lengths is None:
        return None
    return Shape(shape.batch, shape.heads, lengths[0], lengths[1], shape.head_dim, shape.dtype, shape.causal, "bshd",
                 shape.kv_heads, shape.softcap, shape.window_left, shape.window_right, shape.sinks)


def sdpa_view(shape: Shape, t, lengths: int):
    """A packed (1, H, total, D) view of `shape`'s uniform-length sequences as the dense (B, H, L, D) batch it is
    (no copy)."""
    return unpacked(t).unflatten(0, (shape.batch, lengths)).transpose(1, 2)


def from_dense(o):
    """A dense (B, H, L, D) output as the packed (1, H, B L, D) view (a copy only where its memory is not
    token-major)."""
    b, h, length, d = o.shape
    return packed_view(o.transpose(1, 2).reshape(b * length, h, d))


def skip_reason(name: str, shape: Shape) -> str | None:
    """Why baseline `name` does not run a varlen shape (FlexAttention always does); None where it does."""
    if name == "flex":
        return None
    if dense_equivalent(shape) is None:
        return "skipped: SDPA has no variable-length batches (the sequences' lengths differ)"
    return None


def sdpa_launcher(problem, name: str, shape: Shape, inputs: dict, probe: bool):
    """SDPA's backend `name` on the dense batch a uniform-length varlen shape is, its output as the packed view."""
    dense = dense_equivalent(shape)
    lq, lk = uniform_lengths(shape)
    views = {"q": sdpa_view(shape, inputs["q"], lq), "k": sdpa_view(shape, inputs["k"], lk),
             "v": sdpa_view(shape, inputs["v"], lk), "scale": inputs["scale"]}
    if "sinks" in inputs:
        views["sinks"] = inputs["sinks"]
    why = problem.baseline_skip_reason(name, dense)
    if why:
        return None
    run = problem.baseline_launcher(name, dense, views, probe=probe)
    if run is None:
        return None
    return lambda: from_dense(run())


# FlexAttention with a document mask, per varlen shape (its lengths, mask and cap): built once, as the dense
# baseline's mods are (torch.compile guards on the mods' identity).
_FLEX_DOCS: dict = {}


def flex_mods(shape: Shape, device, sees) -> dict:
    """FlexAttention's block mask (and score_mod) of a varlen shape: a document mask over the packed rows (query i
    and key j see each other only inside one sequence), and inside a sequence the causal mask and window by
    attention.sees (`sees`) with that sequence's lengths; the cap as the dense baseline's."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    key = (shape.varlen, shape.key_lengths, shape.causal, shape.window_left, shape.window_right, shape.softcap,
           str(device))
    if key in _FLEX_DOCS:
        return _FLEX_DOCS[key]
    cu_q, cu_k = (torch.tensor(c, dtype=torch.int64, device=device) for c in shape.cu_seqlens())
    lengths_q, lengths_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    doc_q = torch.repeat_interleave(torch.arange(shape.batch, device=device), lengths_q)
    doc_k = torch.repeat_interleave(torch.arange(shape.batch, device=device), lengths_k)
    causal, left, right, cap = shape.causal, shape.window_left, shape.window_right, shape.softcap

    def mask_mod(b, h, qi, kj):
        dq, dk = doc_q[qi], doc_k[kj]
        inside = sees(qi - cu_q[dq], kj - cu_k[dk], lengths_q[dq], lengths_k[dq], causal, left, right)
        return (dq == dk) & inside

    def score_mod(s, b, h, qi, kj):
        return cap * torch.tanh(s / cap)

    mods = {"block_mask": create_block_mask(mask_mod, None, None, shape.total_q, shape.total_k, device=device)}
    if shape.has_softcap:
        mods["score_mod"] = score_mod
    _FLEX_DOCS[key] = mods
    return mods


def flex_launcher(shape: Shape, inputs: dict, fns: dict, sees):
    """FlexAttention (compiled: `fns`, attention's "fn" and "sink_fn") on the packed tensors with the document mask
    (flex_mods); with sinks through its log-sum-exp, as the dense baseline."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    kw = dict(flex_mods(shape, q.device, sees))
    kw.update(scale=inputs["scale"], enable_gqa=shape.kv_heads != shape.heads)
    if shape.sinks:
        fn, sinks = fns["sink_fn"], inputs["sinks"]
        return lambda: fn(q, k, v, sinks, **kw)
    fn = fns["fn"]
    return lambda: fn(q, k, v, **kw)


# --------------------------------------------------------------------------- a call's shape (the op)


def call_shape(batch: int, heads: int, kv_heads: int, head_dim: int, dtype: str, causal: bool, total_q: int,
               total_k: int, max_q: int, max_k: int) -> Shape:
    """The Shape of a varlen call whose lengths live on the GPU (cu_seqlens): what the op knows without reading them,
    the number of sequences, the tokens in all and max_seqlen_q / _k, with representative lengths (as many sequences
    of the longest length as the tokens fill, the rest in one, then empty ones). Everything the op derives from it,
    the table key, the space's admission, the kernel's source and the launch (grid, tensor maps), depends on those
    facts only, never on the representative lengths. UsageError where the facts cannot hold together (more tokens
    than batch x max_seqlen)."""
    lengths = []
    for total, longest, what in ((total_q, max_q, "q"), (total_k, max_k, "k")):
        if total > batch * longest:
            raise UsageError(f"evotune.torch.attention_varlen: {total} {'queries' if what == 'q' else 'keys'} in "
                             f"{batch} sequences of at most max_seqlen_{what}={longest}: max_seqlen_{what} is "
                             f"too small")
        full, rest = divmod(total, longest)
        lens = [longest] * full + ([rest] if rest else [])
        lengths.append(tuple(lens + [0] * (batch - len(lens))))
    return Shape(batch, heads, max_q, max_k, head_dim, dtype, causal, "bshd", kv_heads, varlen=lengths[0],
                 varlen_k=lengths[1])
