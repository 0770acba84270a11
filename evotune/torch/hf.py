"""evotune's attention op as a HuggingFace transformers attention implementation.

    import evotune.torch.hf
    evotune.torch.hf.register()                       # once; idempotent
    model = AutoModelForCausalLM.from_config(config, attn_implementation="evotune")

register() adds "evotune" to transformers' AttentionInterface (the attention function) and to its
AttentionMaskInterface (with transformers' sdpa mask builder, so an unpadded causal prefill reaches
the adapter as attention_mask=None plus is_causal, exactly as sdpa sees it; an unregistered mask name
would make transformers drop padding masks altogether). For the adapter, that mask builder also returns
no mask for transformers' plain sliding-window causal mask of an unpadded prefill or cached decode step
(sliding_window_mask):
the layer passes its `sliding_window` to the attention function (Mistral, Qwen2, Gemma-2 do), which the
adapter hands to the op as the window.

The adapter computes what evotune.torch.attention covers, SDPA's semantics with no mask tensor, no
dropout, no position bias/paged cache, and a causal mask only where the query and key
lengths agree, plus Gemma-2's logit softcap (the `softcap` keyword: the op's softcap), a sliding
window (`sliding_window` W, transformers' window of W keys, the query's own included: the op's
window=(W - 1, 0), flash-attention's spelling, with no causal flag, as transformers' flash-attention
path passes it) and gpt-oss's attention sinks (the `s_aux` keyword, the layer's (H,) `sinks` parameter: the
op's sinks), by calling evotune.torch.attention (which then routes each key to the tuned kernel or
to its fallback by the tuning table, and says so). Grouped K/V heads go in un-repeated with
enable_gqa=True. Every other call runs transformers' own sdpa_attention_forward (with a softcap or sinks, which
transformers' sdpa refuses or ignores, evotune.torch.fallback.math_attention with the call's mask: the order of
Gemma-2's and gpt-oss's eager attention) and says why once per reason (EvotuneFallbackWarning) in eager code; while
torch.compile traces, a warning would break the graph, so the reason is only counted (fallbacks()).
stats() counts every path. A decode step (one query, decode_call) under a window that cuts keys runs over the last W
keys (views of the cache), where its mask builder left the mask out: a sliding layer's cached step with no padding
among the window's keys (the plain sliding mask, like the prefill's). A decode step with sinks goes to the decode op
with them (its kernel has SINKS), the window handled the same way. A decode step with a softcap is not the decode
kernel's (it has none): it takes the adapter's own path (the op; over the window's keys where a window cuts).

Packed sequences (transformers' padding-free batches: batch 1, the sequences one after another, with flash-attention's
kwargs cu_seq_lens_q / _k and max_length_q / _k, as DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives
them) go to evotune.torch.varlen.attention_varlen, per-sequence causal (or not, as the model is), where nothing else
rides on the call (packed_call says what; the rest goes where it would without the kwargs, told once).

This module imports transformers; `import evotune` and `import evotune.torch` do not import it.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections import Counter

import torch

from . import decode as _decode  # its ops read through the module at call time (what a test's spy replaces)
from .fallback import math_attention
from .op import attention, eager_attention
from .routing import EvotuneFallbackWarning

NAME = "evotune"

_LOCK = threading.Lock()
_WARNED: set[str] = set()
_STATS: Counter = Counter()        # "sdpa" / "math" / "varlen": adapter calls sent to transformers' sdpa /
                                   # math_attention / evotune.torch.varlen.attention_varlen (eager code only)
_CALLS = [0]                       # adapter calls that reached evotune.torch.attention (eager code only)
_FALLBACKS: Counter = Counter()    # reason -> calls sent to transformers' sdpa or math_attention (eager code only)
_TRACED_FALLBACKS: dict = {}       # reason -> True, noted while torch.compile traced a fallback


def register(name: str = NAME, *, assume_unpacked: bool = False, attention_function=None) -> str:
    """Register `name` (default "evotune") with transformers' attention and mask interfaces; idempotent.
    Returns the name to pass as attn_implementation.

    While torch.compile traces or a CUDA graph captures, transformers cannot read position_ids to rule out
    packed sequences, so its sdpa mask builder then materialises the causal mask and every call reaches the
    adapter with a mask tensor (run by transformers' sdpa). assume_unpacked=True registers a mask builder
    that returns no mask (is_causal instead) where no padding mask was given and the queries start at key 0
    with as many keys as queries, without reading position_ids: right for causal LMs whose mask is plain
    causal (Llama, GPT-2, ...) fed unpacked sequences, wrong for sequences packed through position_ids and, while
    tracing, for a causal mask with an overlay (Gemma-3's image tokens; in eager code the overlay is seen and kept).
    attention_function: register another function under `name` (e.g. transformers' sdpa_attention_forward,
    to compare sdpa under the same mask policy); default the evotune adapter. Only with the adapter does the mask
    builder leave out a plain sliding-window mask (sliding_window_mask): another function would not apply the window
    it no longer sees."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_function or attention_forward)
    if attention_function is None:
        mask = unpacked_sliding_window_mask if assume_unpacked else sliding_window_mask
    else:
        mask = unpacked_causal_mask if assume_unpacked else sdpa_mask
    AttentionMaskInterface.register(name, mask)
    return name


def unpacked_causal_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                         attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers' sdpa_mask, but None (is_causal) for an unpadded prefill even while tracing (see register), where
    the mask asked for may be skipped. In eager code that is transformers' allow_is_causal_skip: create_causal_mask
    turns it off where it overlays a mask on the causal one (Gemma-3's bidirectional image tokens, packed sequences it
    found, block ids; sdpa_mask then builds the mask). While tracing, transformers turns it off for every call without
    a cache (it cannot rule out packed sequences there), which is what assume_unpacked promises away, and an overlay
    cannot be told apart from that: a traced model with an overlaid causal mask must not use assume_unpacked."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = ((allow_is_causal_skip or torch.compiler.is_compiling()) and attention_mask is None and local_size is None and isinstance(q_offset, int) and q_offset == 0
             and isinstance(kv_offset, int) and kv_offset == 0 and isinstance(q_length, int) and q_length == kv_length
             and not kwargs.get("allow_is_bidirectional_skip"))
    if plain:
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     mask_function=_or_causal(mask_function, causal_mask_function), attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def sliding_window_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                        attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers' sdpa_mask, but None for its plain sliding-window causal mask of an unpadded prefill or cached
    decode step (plain_sliding_window): the layer's attention call carries `sliding_window`, which the adapter passes
    to the op (a prefill) or applies by taking the last W keys (a decode step)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if plain_sliding_window(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size,
                            allow_is_causal_skip, kwargs):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     mask_function=_or_causal(mask_function, causal_mask_function), attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def unpacked_sliding_window_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                                 attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs):
    """unpacked_causal_mask (register's assume_unpacked), with sliding_window_mask's plain sliding-window rule."""
    if plain_sliding_window(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size,
                            allow_is_causal_skip, kwargs):
        return None
    return unpacked_causal_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                                local_size, allow_is_causal_skip, **kwargs)


def plain_sliding_window(q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask, local_size,
                         allow_is_causal_skip, kwargs) -> bool:
    """Whether a mask asked of the mask interface is transformers' sliding-window causal mask of `local_size` keys
    (create_sliding_window_causal_mask's, nothing overlaid: its allow_is_causal_skip, which packed sequences, block
    ids, custom overlays, a compileable cache's decode step and a caller's own False turn off), with no padding among
    the keys the window shows (a padding mask is read only in eager code, as sdpa_mask reads it), in a model whose
    layers are full or sliding attention only (a DeepSeek-V4 layer, say, adds keys to a sliding mask after it is
    built), over either
      - a prefill: queries that start at key 0 with as many keys (the adapter passes the window to the op), or
      - a cached decode step: one query that is the last of the mask's keys (q_offset = kv_offset + kv_length - 1, a
        DynamicCache's sizes, whole or sliding layer), which sees exactly the last min(W, kv_length) keys, bottom-right
        aligned: the adapter runs it over those keys (decode_call), the window cutting older ones or none.
    Which mask function it is: in eager code from its closure (exactly sliding_window_causal_mask_function(local_size));
    while torch.compile traces (dynamo cannot read a closure) or a CUDA graph captures (reading the padding would sync),
    from the config's sliding_window and no chunk size, and only without a padding mask. assume_unpacked does not widen
    this: while tracing a call without a cache, transformers turns allow_is_causal_skip off for the packed sequences it
    cannot rule out, and Doge turns it off to add to the mask, which cannot be told apart here, so such a sliding mask
    stays built (the call goes to transformers' sdpa, told)."""
    if not (allow_is_causal_skip and isinstance(local_size, int) and not kwargs.get("allow_is_bidirectional_skip")
            and _ints(q_length, kv_length, q_offset, kv_offset) and _sliding_config(kwargs.get("config"), local_size)):
        return False
    prefill = q_offset == 0 and kv_offset == 0 and q_length == kv_length
    step = q_length == 1 and kv_length >= 1 and q_offset == kv_offset + kv_length - 1
    if not (prefill or step):
        return False
    if torch.compiler.is_compiling() or _capturing(attention_mask):
        return attention_mask is None
    if _sliding_window_of(mask_function) != local_size:
        return False
    if attention_mask is None:
        return True
    from transformers.masking_utils import fast_all, prepare_padding_mask

    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if step:  # only the keys the window shows: padding the window has already cut changes nothing
        padding = padding[:, max(kv_offset, q_offset - local_size + 1):q_offset + 1]
    return bool(fast_all(padding))


def _or_causal(mask_function, causal_mask_function):
    """The mask function asked for, else the causal one. `is None`, not `or`: torch 2.11's dynamo cannot take the truth
    of a closure (transformers' mask functions are), a graph break under fullgraph=True (H200 run of 2026-11-28)."""
    return causal_mask_function if mask_function is None else mask_function


def _capturing(tensor) -> bool:
    return tensor is not None and tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _ints(*values) -> bool:
    return all(type(v) is int for v in values)


def _sliding_config(config, local_size: int) -> bool:
    """A config whose sliding window is `local_size`, with no chunked attention, whose layers (where it names them)
    are full or sliding attention."""
    layers = getattr(config, "layer_types", None) or ()
    return (getattr(config, "sliding_window", None) == local_size
            and getattr(config, "attention_chunk_size", None) is None
            and all(t in ("full_attention", "sliding_attention") for t in layers))


def _sliding_window_of(mask_function) -> int | None:
    """W where `mask_function` is transformers' sliding_window_causal_mask_function(W) (and_masks of its
    sliding_window_overlay(W) and causal_mask_function), else None. Reads closures: eager code only."""
    from transformers.masking_utils import causal_mask_function

    def cells(fn) -> dict:
        code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        return dict(zip(code.co_freevars, (c.cell_contents for c in closure))) if code else {}

    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = cells(mask_function).get("mask_functions") or ()
    if len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    if getattr(parts[0], "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = cells(parts[0]).get("sliding_window")
    return window if type(window) is int else None


def stats() -> dict:
    """Adapter calls made in eager code so far: {"evotune": n, "varlen": n, "sdpa": n, "math": n}, those with calls
    ("evotune": the dense or decode op; "varlen": packed sequences to attention_varlen). The ops' own routing, kernel
    or fallback, is told by the ops: evotune.torch.record_shapes / explain, varlen.explain_varlen."""
    out = {"evotune": _CALLS[0]} if _CALLS[0] else {}
    out.update(_STATS)
    return out


def fallbacks() -> dict:
    """Why calls went to transformers' sdpa (or math_attention), or, for packed sequences, past the varlen op:
    {reason: calls} from eager code, plus reasons met while tracing under torch.compile (counted as 0 calls: the
    compiled graph's runs are not counted)."""
    out = {reason: 0 for reason in _TRACED_FALLBACKS}
    out.update(_FALLBACKS)
    return out


def reset_stats() -> None:
    """Forget the counts and the reasons already told."""
    with _LOCK:
        _STATS.clear()
        _CALLS[0] = 0
        _FALLBACKS.clear()
        _TRACED_FALLBACKS.clear()
        _WARNED.clear()


def uncovered_reason(module, query, key, value, attention_mask, dropout, is_causal, kwargs) -> str | None:
    """Why this call is not one evotune.torch.attention computes with SDPA's semantics (None where it is)."""
    if attention_mask is not None:
        return ("an attention mask tensor (padding, packed sequences, a sliding window past a cache or a custom mask); "
                "the op takes is_causal and a window only")
    if dropout:
        return f"attention dropout {dropout}; the op has no dropout"
    window = kwargs.get("sliding_window")
    if _cuts(window, key.shape[2]) and not (is_causal and query.shape[2] == key.shape[2]):
        return (f"a sliding window of {window} keys with no mask over {query.shape[2]} queries and {key.shape[2]} keys "
                f"(the adapter takes the window for a causal prefill, as many queries as keys, or a single query)")
    if kwargs.get("position_bias") is not None:
        return "an additive position bias"
    if kwargs.get("cache") is not None:
        return "a paged KV cache"
    if kwargs.get("output_attentions"):
        return "output_attentions=True"
    if is_causal and query.shape[2] != key.shape[2]:
        return (f"a causal mask with {query.shape[2]} queries over {key.shape[2]} keys (more queries than keys; "
                f"the op's causal mask is top-left aligned)")
    return None


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, H, Sq, D), key/value (B, Hk, Sk, D); returns
    ((B, Sq, H, D) contiguous, None), like sdpa_attention_forward."""
    # Every layer of every forward comes here: each size read once, the covered case checked in one expression
    # before the reasons are spelled (uncovered_reason, only for a call that is not).
    _, heads, sq, _ = query.shape
    _, kv_heads, sk, _ = key.shape
    packed_why = None
    if kwargs and kwargs.get("cu_seq_lens_q") is not None:  # packed sequences: the varlen op, where it takes them
        packed, packed_why = packed_call(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                         kwargs)
        if packed is not None:
            return packed
    if sq < sk:  # a decode step or a cached chunk (decode_call), else a prefill into an empty StaticCache
        decoded = decode_call(query, key, value, attention_mask, dropout, scaling, kwargs)
        if decoded is not None:
            if packed_why:
                _fallback(packed_why, None)
            return decoded
    # The causal flag as sdpa_attention_forward derives it (a single query attends to every key).
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    causal = bool(sq > 1) and attention_mask is None and bool(is_causal)
    get = kwargs.get
    # Gemma-2 passes softcap=None where the config has none, and every sliding layer its sliding_window; gpt-oss
    # passes its layer's sink logits as s_aux.
    softcap, window = (get("softcap"), get("sliding_window")) if kwargs else (None, None)
    sinks = _sinks_of(kwargs) if kwargs else None
    cuts = attention_mask is None and _cuts(window, sk)  # without a mask: the mask builder left the window to us
    if cuts and sq == 1:  # a decode step the decode kernel does not take (a softcap): the op over the window
        key, value, sk = _window_keys(key, value, window)
        cuts = False
    if causal and sk > sq and not cuts:
        # A prefill into an empty StaticCache (no mask, the whole cache as keys): with the top-left causal mask
        # SDPA and the op share, no query sees a key past the queries, so the keys are cropped to them, as
        # sdpa_attention_forward crops them (views of the cache: nothing copied).
        key, value, sk = key[:, :, :sq], value[:, :, :sq], sq
    if (attention_mask is not None or dropout or (causal and sq != sk) or (cuts and not (causal and sq == sk))
            or (kwargs and (get("position_bias") is not None or get("cache") is not None
                            or get("output_attentions")))):
        return _uncovered(module, query, key, value, attention_mask, dropout, scaling, is_causal, causal, kwargs,
                          packed_why)
    if packed_why:
        _fallback(packed_why, None)
    # A window that cuts keys: transformers' sliding_window W (sliding_window_overlay: key > query - W, W keys with
    # the query's own) is flash-attention's window_size (W - 1, 0), causal by itself; no causal flag beside it.
    mods = {"softcap": softcap or 0.0, "window": (window - 1, 0) if cuts else None, "sinks": sinks}
    if cuts:
        causal = False
    if torch.compiler.is_compiling():
        out = attention(query, key, value, is_causal=causal, scale=scaling, enable_gqa=heads != kv_heads, **mods)
    else:
        _CALLS[0] += 1  # a plain count (no lock: a diagnostic that two threads at once may undercount)
        out = eager_attention(query, key, value, causal, scaling, heads != kv_heads, **mods)
    # The op returns the query's layout: a projection's (B, S, H, D) memory seen as (B, H, S, D), so this
    # transpose is already contiguous and .contiguous() copies nothing.
    return out.transpose(1, 2).contiguous(), None


# Packed sequences (transformers' padding-free batches: DataCollatorWithFlattening(return_flash_attn_kwargs=True), or a
# caller's own): batch 1, the sequences one after another, and flash-attention's varlen kwargs beside them.
_PACKED_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# Offsets (and the mask beside them) already read and checked, per offsets tensor: every layer of a forward gets the
# same tensors, so they are read on the host once per forward, not once per layer. Keyed by id, with weak references
# that tell a reused id apart (nothing kept alive; a tensor's == is elementwise, so no WeakKeyDictionary); bounded.
_CHECKED: dict = {}
_MAX_CHECKED = 64


def packed_call(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """A packed call (the kwargs cu_seq_lens_q / _k, max_length_q / _k, as transformers' flash-attention path reads
    them) run by evotune.torch.varlen.attention_varlen: ((output (1, total, H, D), None), None). Else (None, why): the call goes where it went
    before (the dense op, decode_call, transformers' sdpa or math_attention, by its mask), `why` told once.

    Taken: batch 1, as many keys as queries (no earlier keys in a cache), no dropout, softcap, sinks, position bias,
    paged cache or output_attentions, a sliding window (if any) no shorter than the longest sequence (it cuts
    nothing), causal (the adapter's is_causal, else the module's) with cu_seq_lens_q equal to cu_seq_lens_k, or
    non-causal. The mask beside it must be None or exactly the packing's, which is then redundant: transformers'
    create_causal_mask builds, from position_ids that restart per sequence (find_packed_sequence_indices, with no cache
    and no padding mask), the block-diagonal causal mask of those sequences; the offsets describe the same blocks only
    where position_ids restart exactly at them, so the mask is compared with the offsets' (in eager code, once per mask
    tensor and offsets), not assumed. With no mask (a cache given, or position_ids that do not restart) the offsets
    alone say where the sequences are, as in transformers' flash-attention path."""
    get = kwargs.get
    cu_q, cu_k, max_q, max_k = (get(name) for name in _PACKED_KWARGS)
    what = _packed_reason(module, query, key, value, dropout, kwargs, cu_q, cu_k, max_q, max_k)
    if what:
        return None, _packed_told(what, attention_mask)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    tracing = torch.compiler.is_compiling()
    if tracing:
        if attention_mask is not None:
            return None, _packed_told("a mask tensor beside them while torch.compile traces (the adapter compares "
                                      "it with the offsets' in eager code only)", attention_mask)
        if not (_ints(max_q, max_k)):
            return None, _packed_told("max_length_q / _k as tensors while torch.compile traces (the varlen op takes "
                                      "Python ints)", attention_mask)
    else:
        max_q, max_k = int(max_q), int(max_k)
        why = _check_packing(cu_q, cu_k, query.shape[2], causal, attention_mask)
        if why:
            return None, _packed_told(why, attention_mask)
        if causal:
            cu_k = cu_q  # checked equal: one tensor, which the op takes as given (no second compare)
    window = get("sliding_window")
    if window is not None and window < max_k:
        return None, _packed_told(f"a sliding window of {window} keys shorter than the longest sequence "
                                  f"({max_k}): the varlen op takes no window", attention_mask)
    from .varlen import attention_varlen

    # The adapter's (1, H, total, D) is a projection's (1, total, H, D) memory: [0].transpose(0, 1) is the varlen
    # op's (total, H, D) as a view, nothing copied.
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    if not tracing:
        with _LOCK:
            _STATS["varlen"] += 1
    out = attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal, scale=scaling)
    return (out.unsqueeze(0), None), None  # the attention function's (output, weights), no reason


def _packed_reason(module, query, key, value, dropout, kwargs, cu_q, cu_k, max_q, max_k) -> str | None:
    """What keeps a call with packed-sequence kwargs from the varlen op, read from sizes and kwargs alone (no values)."""
    get = kwargs.get
    if any(x is None for x in (cu_k, max_q, max_k)):
        return f"only some of {', '.join(_PACKED_KWARGS)} given"
    if query.shape[0] != 1:
        return f"a batch of {query.shape[0]} (packed sequences come as a batch of 1)"
    if key.shape[2] != query.shape[2]:
        return f"{query.shape[2]} queries over {key.shape[2]} keys (earlier keys in a cache)"
    if dropout:
        return f"attention dropout {dropout}"
    for name in ("softcap", "position_bias", "cache"):
        if get(name) is not None:
            return {"softcap": "a logit softcap", "position_bias": "an additive position bias",
                    "cache": "a paged KV cache"}[name]
    if _sinks_of(kwargs) is not None:
        return "attention sinks"
    if get("output_attentions"):
        return "output_attentions=True"
    for name, t in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.int32 or t.device != query.device:
            return f"{name} not a 1-D int32 tensor on the queries' device"
    return None


def _packed_told(what: str, attention_mask=None) -> str:
    """The reason a packed call is kept from the varlen op, saying what computes it instead."""
    where = ("by its mask" if attention_mask is not None else
             "with no mask: across the packed sequences, as transformers' sdpa and eager attention compute it")
    return f"packed sequences (cu_seq_lens_q / _k) with {what}: the call runs {where}"


def _check_packing(cu_q, cu_k, total: int, causal: bool, attention_mask) -> str | None:
    """In eager code: why the offsets (and the mask beside them) are not a packing the varlen op computes as given, or
    None. Reads the offsets on the host and compares the mask with theirs: once per offsets tensor, mask and causal
    flag (_CHECKED; a tensor changed in place, by its version counter, is read again)."""
    token = (id(cu_k), cu_q._version, cu_k._version, total, causal,
             None if attention_mask is None else (id(attention_mask), attention_mask._version))
    seen = _CHECKED.get(id(cu_q))
    if (seen is not None and seen[0]() is cu_q and seen[1] == token and seen[2]() is cu_k
            and (attention_mask is None or seen[3]() is attention_mask)):
        return seen[4]
    why = _packing_fault(cu_q, cu_k, total, causal, attention_mask)
    if len(_CHECKED) >= _MAX_CHECKED:
        _CHECKED.clear()
    _CHECKED[id(cu_q)] = (weakref.ref(cu_q), token, weakref.ref(cu_k),
                          weakref.ref(attention_mask) if attention_mask is not None else None, why)
    return why


def _packing_fault(cu_q, cu_k, total: int, causal: bool, attention_mask) -> str | None:
    offsets = cu_q.tolist()
    if offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        return _packed_told(f"offsets {offsets[:8]}{'...' if len(offsets) > 8 else ''} that do not split the call's "
                            f"{total} tokens", attention_mask)
    if causal and cu_k is not cu_q and not torch.equal(cu_q, cu_k):
        return _packed_told("cu_seq_lens_q != cu_seq_lens_k under a causal mask (the varlen op's causal mask is "
                            "per-sequence self-attention)", attention_mask)
    if attention_mask is None:
        return None
    if attention_mask.dtype != torch.bool or tuple(attention_mask.shape) != (1, 1, total, total):
        return _packed_told(f"a {attention_mask.dtype} mask of shape {tuple(attention_mask.shape)}, not the "
                            f"packing's (1, 1, {total}, {total}) boolean mask", attention_mask)
    lengths = torch.tensor([b - a for a, b in zip(offsets, offsets[1:])], device=attention_mask.device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=attention_mask.device), lengths)
    want = seq[:, None] == seq[None, :]
    if causal:
        want = want.tril()
    if not torch.equal(attention_mask[0, 0], want):
        return _packed_told("a mask that is not the offsets' block-diagonal" + (" causal" if causal else "")
                            + " one (padding, a window or another overlay)", attention_mask)
    return None


def _sinks_of(kwargs):
    """The sink logits a layer passes (gpt-oss: s_aux=self.sinks, a (H,) Parameter in the model's dtype; `sinks` the
    same under another name), or None."""
    sinks = kwargs.get("s_aux")
    return kwargs.get("sinks") if sinks is None else sinks


def _cuts(window, seq_k) -> bool:
    """Whether transformers' sliding window of `window` keys (None: none) hides a key from some query of a call with
    `seq_k` keys, queries at its end: the last query sees keys seq_k - window onwards."""
    return window is not None and seq_k > window


def _window_keys(key, value, window: int):
    """The last `window` keys and values (views: nothing copied), which are all that one query at the end of the keys
    sees under transformers' sliding window of `window` keys (key > query - window), with no mask beside it; and
    their count."""
    return key[:, :, -window:], value[:, :, -window:], window


def _uncovered(module, query, key, value, attention_mask, dropout, scaling, is_causal, causal, kwargs, why=None):
    """A call the op does not take: transformers' sdpa_attention_forward, or with a softcap (which transformers'
    sdpa refuses) or sinks (which it would drop) math_attention with the call's mask and dropout, told once per
    reason (`why`, else uncovered_reason's). Sinks beside a position bias or a paged cache are refused in one line:
    neither path computes the two."""
    why = why or uncovered_reason(module, query, key, value, attention_mask, dropout, causal, kwargs)
    get = kwargs.get
    sinks = _sinks_of(kwargs)
    if sinks is not None and (get("position_bias") is not None or get("cache") is not None):
        from ..errors import UsageError

        raise UsageError(f"evotune.torch.hf: attention sinks beside {why}: evotune's fallback takes neither, and "
                         f"transformers' sdpa would drop the sinks; use attn_implementation='eager'")
    if (get("softcap") is not None or sinks is not None) and all(get(n) is None for n in ("position_bias", "cache")):
        _fallback(why, "math")
        softcap = get("softcap")
        out = math_attention(query, key, value, is_causal=causal, scale=scaling,
                             softcap=0.0 if softcap is None else float(softcap), mask=attention_mask,
                             dropout=dropout, sinks=sinks)
        return out.transpose(1, 2).contiguous(), None
    _fallback(why)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def decode_call(query, key, value, attention_mask, dropout, scaling, kwargs) -> tuple[torch.Tensor, None] | None:
    """A decode step or a cached chunk, run by evotune.torch.decode.decode_attention (which routes by the decode
    table, else runs SDPA and says so): Sq < Sk with either one query and no mask (a DynamicCache decode step:
    transformers' sdpa mask builder drops its all-True mask, and the adapter's builder a sliding layer's plain
    window: with a `sliding_window` W that cuts keys the step runs over the last W keys, views of the cache) or a
    boolean mask that is exactly the bottom-right causal one (a cached prefill chunk). Checking that mask reads it on
    the host (a sync), so only in eager code. Attention sinks (gpt-oss's s_aux) go with the step: the decode kernel
    has SINKS. Every other call gets None (the adapter's own path): a softcap (the decode kernel has none: the op
    takes such a step, over the window's last W keys where one cuts), and a StaticCache's mask, which spans the whole cache with padding past the filled
    length, which the kernel cannot take without reading that length on the host."""
    sq, sk = query.shape[2], key.shape[2]
    if sq >= sk:  # a prefill, the adapter's own path
        return None
    get = kwargs.get  # (the decode module is imported with this one: an import statement here cost every step 2.7 us)
    if (not 1 <= sq <= min(_decode.MAX_SEQ_Q, sk - 1) or dropout or get("softcap") is not None
            or get("position_bias") is not None or get("cache") is not None or get("output_attentions")):
        return None  # the decode kernel has no softcap (the op's path takes it: its kernel or fallback)
    window = get("sliding_window")
    if attention_mask is None and _cuts(window, sk):
        if sq > 1:
            return None  # a window no mask carries over several queries: the decode kernel has none
        key, value, sk = _window_keys(key, value, window)
    if attention_mask is not None:
        if (sq == 1 or attention_mask.dtype != torch.bool or attention_mask.dim() != 4
                or tuple(attention_mask.shape[1:]) != (1, sq, sk) or torch.compiler.is_compiling()
                or (attention_mask.is_cuda and torch.cuda.is_current_stream_capturing())):
            return None
        expected = torch.ones(sq, sk, dtype=torch.bool, device=attention_mask.device).tril(diagonal=sk - sq)
        if not torch.equal(attention_mask, expected.expand_as(attention_mask)):
            return None
    elif sq > 1:
        return None  # no mask with several queries: sdpa's is_causal would be top-left; the adapter's path keeps it
    if not torch.compiler.is_compiling():
        _CALLS[0] += 1
    # gpt-oss's s_aux (the layer's (H,) sinks Parameter) goes in as it is: decode_attention casts it to the
    # contiguous fp32 its kernel's SINKS reads, and its fallback is the sink math.
    out = _decode.decode_attention(query, key, value, causal=sq > 1, scale=scaling, sinks=_sinks_of(kwargs))
    return out.transpose(1, 2).contiguous(), None


_RUNS = {"sdpa": "transformers' sdpa attention",
         "math": "evotune.torch.fallback.math_attention (transformers' sdpa has no softcap and no attention sinks)"}


def _fallback(why: str, runs: str | None = "sdpa") -> None:
    """Count and tell (once per reason) a call kept from evotune's op. runs=None: a packed call kept from the varlen
    op that still reaches evotune's dense or decode op (counted there, under "evotune"; its reason here)."""
    if torch.compiler.is_compiling():
        _TRACED_FALLBACKS[why] = True
        return
    with _LOCK:
        if runs is not None:
            _STATS[runs] += 1
        _FALLBACKS[why] += 1
        if why in _WARNED:
            return
        _WARNED.add(why)
    if runs is None:
        said = f"evotune.torch.hf: this call runs evotune's dense op, not evotune.torch.varlen.attention_varlen: {why}"
    else:
        said = f"evotune.torch.hf: this call runs {_RUNS[runs]}, not evotune.torch.attention: {why}"
    warnings.warn(said, EvotuneFallbackWarning, stacklevel=4)
