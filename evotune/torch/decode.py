"""Decode attention as PyTorch ops: `decode_attention(q, k, v, causal=..., scale=..., sinks=...)` over a dense KV
cache and `paged_decode_attention(q, k_cache, v_cache, block_table, cache_seqlens, ...)` over a paged one.

    from evotune.torch.decode import decode_attention, paged_decode_attention
    out = decode_attention(q, k, v, causal=True)   # q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D): a KV cache
    out = decode_attention(q, k, v, sinks=s_aux)   # gpt-oss: s_aux (Hq,) sink logits join each row's softmax
    out = paged_decode_attention(q, k_cache, v_cache, block_table, cache_seqlens)
        # vLLM / FlashAttention kvcache layout: k_cache, v_cache (num_pages, page_size, Hkv, D), block_table
        # (B, max_pages) int32, cache_seqlens (B,) int32: sequence b's key j in row j % page_size of page
        # block_table[b, j // page_size]; each sequence's own length, causal bottom-right per sequence

Sinks (gpt-oss's `s_aux`, flash-attention's `learnable_sink`): one logit per query head, in the units of the scaled
scores, joins every row's softmax as a column that has no value: O = sum_j exp(s_j) v_j / (exp(sink_h) +
sum_j exp(s_j)). Without a kernel for the call, PyTorch computes it in fp32 math with the sink column (SDPA has no
sinks). A paged call without a kernel gathers its sequences' pages and runs SDPA on them (or the sink math).

A few queries (Sq <= 16) over a KV cache, grouped K/V heads un-repeated, causal bottom-right aligned (query i
sees keys 0 .. Sk - Sq + i, as a cache's mask does; for Sq = 1 causal changes nothing). The call runs the
attention-decode family's kernel (kernels/attention_decode.cu) with the config the decode table holds for its
key, else PyTorch SDPA (enable_gqa, the bottom-right mask as a boolean tensor), and says why once per reason
(EvotuneFallbackWarning): never SDPA reported as ours.

The decode table (a JSON file: $EVOTUNE_DECODE_TABLE, else decode-table.json in evotune's cache root, or one
given to use_decode_table) is built by `build_decode_table` from `evotune bench --out` records of the
attention-decode family (or by `evotune tune --shapes` from a recording of generate()): an entry routes to evotune
only where that bench measured our kernel passing the gate and faster than the fastest SDPA backend beside it. Its
key, exact with no nearest bucket, is records/decode_table.py's.

An entry whose kernel source is no longer the one measured (the template changed) is stale: SDPA, said once.
The op is `torch.ops.evotune.decode_attention` (an opaque node for torch.compile, a fake implementation for
its metadata); eager calls skip the dispatcher. Kernels compile and load on first use, never inside a CUDA
graph capture: call the op once before capturing.
"""

from __future__ import annotations

import json
import math
import os
import threading
import warnings
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import EvotuneError, UsageError
from ..problems import get_problem
from ..problems.decode import (BASE_PARAMS, HEAD_DIMS, MAX_PAGE_SIZE, MAX_ROWS, MAX_SEQ_Q, DecodeShape,
                               attention_math, bottom_right_mask, entry_params, visible_keys)
from ..records.decode_table import (KEY_FIELDS, OPTIONAL_KEY_FIELDS, TABLE_ENV, TABLE_VERSION,  # noqa: F401 (API)
                                    build_decode_table, default_decode_table_path, key_dict, key_of, table_key)
from ..records.tuning_table import seq_bucket
from . import record
from .call import aligned_for_sdpa
from .routing import EvotuneFallbackWarning

PROBLEM = get_problem("attention-decode")
_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}

_LOCK = threading.Lock()
_WARNED: set[str] = set()
_TABLE: dict | None = None          # key tuple -> entry dict, loaded once
_TABLE_PATH: Path | None = None
_TABLE_GIVEN: dict | None = None    # a table handed to use_decode_table as a dict, parsed: clear() keeps it
_KERNELS: dict = {}                 # (config items, code key, device) -> (kernel, digest)
_DECISIONS: dict = {}               # call key -> ("evotune", launch) | ("sdpa", reason)
_COUNTERS: dict = {}                # (device, stream) -> zeroed int32 tensor the kernel leaves zero
_MASKS: dict = {}                   # (Sq, Sk, device) -> bottom-right boolean mask


# --------------------------------------------------------------------------- the table


def _parse_table(obj, where: str) -> dict:
    if not isinstance(obj, dict) or obj.get("version") != TABLE_VERSION or obj.get("family") != PROBLEM.family:
        raise UsageError(f"decode table {where}: not a version {TABLE_VERSION} {PROBLEM.family} table")
    table = {}
    for i, e in enumerate(obj.get("entries", [])):
        try:
            key = key_of(e["key"])
            if e["route"] not in ("evotune", "sdpa"):
                raise KeyError("route")
            table[key] = {**e, "config_obj": _space().config(e["config"])}
        except (KeyError, TypeError, UsageError) as exc:
            raise UsageError(f"decode table {where}: entry {i}: missing or bad {exc}") from None
    return table


@lru_cache(maxsize=1)
def _space():
    """The family's built-in space: a table's configs are read, and admitted on a call's shape, by it."""
    from ..space.searchspace import load_builtin

    return load_builtin(PROBLEM.default_space)


def use_decode_table(table=None) -> None:
    """Use this decode table (a path, a table dict, or None: the default path again) from the next call on."""
    global _TABLE, _TABLE_PATH, _TABLE_GIVEN
    with _LOCK:
        if table is None or isinstance(table, (str, os.PathLike)):
            _TABLE, _TABLE_PATH, _TABLE_GIVEN = None, Path(table) if table is not None else None, None
        else:
            _TABLE = _TABLE_GIVEN = _parse_table(table, "(given)")
            _TABLE_PATH = None
        _DECISIONS.clear()
        _WARNED.clear()


def _table() -> dict:
    global _TABLE
    if _TABLE is None:
        path = _TABLE_PATH or default_decode_table_path()
        if not path.is_file():
            _TABLE = {}
        else:
            try:
                obj = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise UsageError(f"decode table {path}: cannot read it: {e}") from None
            _TABLE = _parse_table(obj, str(path))
    return _TABLE


# --------------------------------------------------------------------------- deciding a call


def uncovered_reason(q, k, v, causal: bool) -> str | None:
    """Why the decode kernel does not compute this call (None where it does): checked on the tensors' metadata."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D (B, H, S, D)"
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype} / {k.dtype} / {v.dtype}: the kernel takes fp16 or bf16, the same for q, k, v"
    if not q.is_cuda or k.device != q.device or v.device != q.device:
        return "tensors not all on one CUDA device"
    (b, hq, sq, d), (bk, hk, sk, dk) = q.shape, k.shape
    if tuple(v.shape) != (bk, hk, sk, dk) or bk != b or dk != d:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not agree (v's head dim must be q's)"
    if d not in HEAD_DIMS:
        return f"head_dim {d} (the kernel takes {', '.join(map(str, HEAD_DIMS))})"
    if hk == 0 or hq % hk:
        return f"{hq} query heads over {hk} K/V heads"
    if sq > MAX_SEQ_Q or sq > sk:
        return f"{sq} queries over {sk} keys (the kernel takes 1 to {MAX_SEQ_Q} queries, no more than the keys)"
    if (hq // hk) * sq > MAX_ROWS:
        return f"{hq // hk} query heads per K/V head x {sq} queries > {MAX_ROWS} rows"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            return f"{name} has strides {tuple(t.stride())} (the kernel needs 16-byte aligned rows, unit last stride)"
    return None


def _device_name(index: int) -> tuple[str, str]:
    props = torch.cuda.get_device_properties(index)
    return props.name, f"{props.major}.{props.minor}"


def _decide(q, k, v, causal: bool, sinks: bool = False):
    """("evotune", DecodeLaunch) or ("sdpa", reason) for this call and every later one of its key (_call_key: the
    cache length as its bucket). The config's admission is checked at this call's length: within a bucket the
    kernel is correct at any length (a split may come out empty; the space's split rule only prunes the search)."""
    why = uncovered_reason(q, k, v, causal)
    if why is not None:
        return "sdpa", why
    b, hq, sq, d = q.shape
    shape = DecodeShape(b, hq, k.shape[1], sq, k.shape[2], d, _DTYPES[q.dtype], causal=bool(causal and sq > 1),
                        sinks=bool(sinks))
    return _route(shape, q.device.index)


def _route(shape: DecodeShape, device_index: int):
    """The table's decision for a covered call's shape: ("evotune", DecodeLaunch) or ("sdpa", reason)."""
    q_device_index = device_index
    gpu, cc = _device_name(q_device_index)
    key = table_key(gpu, cc, shape)
    entry = _table().get(key)
    if entry is None:
        return "sdpa", (f"untuned decode key {key_dict(key)}: record the calls "
                        f"(evotune.torch.record_shapes) and tune them with `evotune tune --shapes FILE`, or "
                        f"`evotune search --family attention-decode --shape {shape.spec}` and build_decode_table")
    if entry["route"] != "evotune":
        return "sdpa", f"the decode table routes {shape.spec} to SDPA: {entry.get('reason', '')}"
    cfg = entry["config_obj"]
    space = _space()
    if not space.admitted(cfg, PROBLEM.context(shape)):
        return "sdpa", f"the tuned config is not admitted on {shape.spec}: {'; '.join(space.violations(cfg, PROBLEM.context(shape)))}"
    try:
        kernel = _load(cfg, shape, q_device_index, entry["source_digest"])
    except EvotuneError as e:
        return "sdpa", str(e)
    return "evotune", DecodeLaunch(kernel, cfg, shape)


def _load(cfg, shape: DecodeShape, device_index: int, digest: str):
    """The loaded kernel of `cfg` on `shape`'s code key, compiled and loaded once per device; EvotuneError where
    today's source is not the measured one or the kernel breaks the launch's limits."""
    code_key = (cfg.items, shape.dtype, shape.head_dim, shape.group, shape.seq_q, shape.causal, shape.sinks,
                shape.page_size, device_index)
    found = _KERNELS.get(code_key)
    if found is not None:
        return found
    from ..build.compile import compile_source, launch_violations, load_kernel
    from ..build.template import instantiate

    source = instantiate(PROBLEM, cfg, shape)
    if source.digest != digest:
        raise EvotuneError(f"stale decode table entry: kernel source {source.digest} is not the measured {digest} "
                           f"(the template changed): re-bench it")
    if torch.cuda.is_current_stream_capturing():
        raise EvotuneError(f"the decode kernel for {shape.spec} is not loaded yet and a CUDA graph is being "
                           f"captured: call decode_attention once before capture")
    compiled = compile_source(source.code, source.entry)
    geometry = PROBLEM.geometry(cfg, shape)
    why = launch_violations(compiled.resources, geometry)
    if why:
        raise EvotuneError(f"decode config {cfg.key()} on {shape.spec}: {'; '.join(why)}")
    import cupy

    with cupy.cuda.Device(device_index):
        kernel = load_kernel(compiled, geometry.dynamic_smem)
    with _LOCK:
        _KERNELS[code_key] = kernel
    return kernel


# The entry point's parameters in order (DecodeProblem.instantiation), as a ParamPacket reads them: a dense shape's
# without sinks; problems.decode.entry_params adds a sinks and a paged shape's.
ENTRY_PARAMS = BASE_PARAMS


class DecodeLaunch:
    """One decision's launch: grid, block, shared memory and workspace sizes worked out once (none depends on the
    cache length, which each call passes); per thread a ParamPacket (evotune.gpu.packet: the parameters as C
    values, rewritten per call and launched through cuLaunchKernel, without CuPy's per-argument conversion); per
    call the pointers, the cache's strides and length, and a workspace: fp32 slices from torch's allocator and the
    counters (which the kernel leaves zero) kept per stream, or, inside a CUDA graph capture, the graph's own."""

    def __init__(self, kernel, cfg, shape: DecodeShape):
        self.kernel, self.cfg, self.shape = kernel, cfg, shape
        geo = PROBLEM.geometry(cfg, shape)
        self.grid, self.block, self.smem = geo.grid, geo.block, geo.dynamic_smem
        self.n_o, self.n_ml, self.n_count = PROBLEM.workspace_elems(cfg, shape)
        self.function = kernel.kernel.ptr
        self.params = entry_params(shape)
        self._local = threading.local()

    def _packet(self):
        packet = getattr(self._local, "packet", None)
        if packet is None:
            from ..gpu.packet import ParamPacket

            packet = self._local.packet = ParamPacket(self.params, {name: 0 for name, _ in self.params})
            packet.slots = [packet.slot(name) for name, _ in self.params]
        return packet

    def __call__(self, q, k, v, scale: float, sinks=None, paged=None):
        """Launch on q and the cache k, v (B, Hkv, Sk, D); with sinks, their (Hq,) contiguous fp32 logits; paged:
        (block_table, cache_seqlens) and k, v the caches viewed as (num_pages, Hkv, page, D)."""
        from ..gpu.packet import launch_packet

        out = torch.empty_like(q)  # allocating on q's device also makes its context current for the launch
        index = q.device.index
        handle = _raw_stream(index)
        workspace = (0, 0, 0)
        if self.n_count:
            keep = (torch.empty(self.n_o, dtype=torch.float32, device=q.device),
                    torch.empty(self.n_ml, dtype=torch.float32, device=q.device),
                    _counters(q.device, handle, self.n_count))
            workspace = tuple(t.data_ptr() for t in keep)
        seq_k = paged[0].shape[1] * k.shape[2] if paged is not None else k.shape[2]
        values = ((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
                  + tuple(x for t in (q, k, v, out) for x in t.stride()[:3])
                  + (seq_k, scale * _LOG2E) + workspace)
        if sinks is not None:
            values += (sinks.data_ptr(),)
        if paged is not None:
            values += (paged[0].data_ptr(), paged[0].stride(0), paged[1].data_ptr())
        packet = self._packet()
        for slot, value in zip(packet.slots, values):
            slot.value = value
        launch_packet(self.function, self.grid, self.block, self.smem, handle, packet)
        return out


_LOG2E = math.log2(math.e)


def _raw_stream(index: int) -> int:
    """The current CUDA stream's handle on device `index` (torch._C's raw getter where torch has it: a C call)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def _counters(device, stream: int, n: int):
    """A zeroed int32 buffer of at least n counters for launches on stream handle `stream`: launches on one stream
    run in order and each leaves its counters zero, so they share it; another stream gets its own. Inside a CUDA
    graph capture a fresh one (its zeroing captured too): the graph owns it, so two graphs' replays never share."""
    if torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device.index, stream)
    found = _COUNTERS.get(key)
    if found is None or found.numel() < n:
        found = _COUNTERS[key] = torch.zeros(max(n, 64), dtype=torch.int32, device=device)
    return found


def _sdpa(q, k, v, causal: bool, scale):
    q, k, v = aligned_for_sdpa(q, k, v)  # SDPA does not check alignment (call.aligned_for_sdpa)
    gqa = {"enable_gqa": True} if q.dim() == 4 and k.dim() == 4 and q.shape[1] != k.shape[1] else {}
    mask = None
    if causal and q.shape[-2] > 1:
        key = (q.shape[-2], k.shape[-2], q.device)
        mask = _MASKS.get(key)
        if mask is None:
            mask = _MASKS[key] = bottom_right_mask(q.shape[-2], k.shape[-2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)


def _tell(reason: str, what: str = "PyTorch SDPA") -> None:
    told = f"{what}: {reason}"
    with _LOCK:
        if told in _WARNED:
            return
        _WARNED.add(told)
    warnings.warn(f"evotune.torch.decode: running {told}", EvotuneFallbackWarning, stacklevel=4)


# What runs where our kernel does not: SDPA, which has no sinks, or with sinks PyTorch's fp32 math.
_SINK_FALLBACK = "PyTorch fp32 math with the sink column (SDPA has no attention sinks)"


def _fallback_name(sinks, paged: bool = False) -> str:
    if paged:
        return ("PyTorch: the pages gathered, then " + (_SINK_FALLBACK if sinks is not None else "SDPA"))
    return _SINK_FALLBACK if sinks is not None else "PyTorch SDPA"


def _call_key(q, k, v, causal, scale, sinks=None):
    """What a decision depends on: everything but the cache length, which enters as its table bucket (a decode
    step grows the cache by one key: the bucket's decision, kernel and launch serve the next step too)."""
    # Every decode step of every layer builds this key: sizes read once, the bucket as seq_bucket computes it (its
    # check of the argument is for table files; a tensor's size is a positive int). K's and V's dtype and device are
    # in it: the decision checked them (uncovered_reason), so a cache of another dtype or device must not reuse it.
    ks, vs = k.shape, v.shape
    four = len(ks) == 4
    sk = ks[2] if four else 0
    return (q.shape, q.stride(), ks[:2] if four else ks, ks[-1], vs[:2] if len(vs) == 4 else vs,
            1 << (sk - 1).bit_length() if sk else 0, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
            bool(causal), scale, sinks is not None)


def _per_call_fault(q, k, v) -> str | None:
    """What the bucket's decision cannot know of this call (None where nothing): the cache's length against the
    queries, and its rows' alignment (a cache's strides change with its length; q's are in the decision's key)."""
    if q.shape[2] > k.shape[2]:
        return f"{q.shape[2]} queries over {k.shape[2]} keys (a query would see no key)"
    for t in (k, v):
        if t.data_ptr() % 16 or t.stride(0) % 8 or t.stride(1) % 8 or t.stride(2) % 8 or t.stride(3) != 1:
            return f"a K/V cache with strides {tuple(t.stride())} (the kernel needs 16-byte aligned rows)"
    return None


def _decode_body(q, k, v, causal=False, scale=None, sinks=None):
    """The op's implementation: the call key's cached decision, then our kernel or SDPA (told once); with sinks,
    our kernel or PyTorch's fp32 math with the sink column (told once)."""
    sinks = _sink_logits(sinks, q)
    key = _call_key(q, k, v, causal, scale, sinks)
    decision = _DECISIONS.get(key)
    if decision is None:
        decision = _DECISIONS[key] = _decide(q, k, v, causal, sinks is not None)
    if record._ACTIVE:
        _observe(q, k, v, causal, decision, sinks is not None)
    route, what = decision
    if route == "evotune":
        why = _per_call_fault(q, k, v)
        if why is None:
            return what(q, k, v, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), sinks)
        what = why
    _tell(what, _fallback_name(sinks))
    if sinks is not None:
        return _sink_math(q, k, v, causal, scale, sinks)
    return _sdpa(q, k, v, causal, scale)


def _sink_logits(sinks, q):
    """The (Hq,) sink logits as the kernel reads them: contiguous fp32 on q's device (cast where needed), or None;
    one UsageError line for anything else."""
    if sinks is None:
        return None
    hq = q.shape[1] if q.dim() == 4 else None
    if not isinstance(sinks, torch.Tensor) or sinks.dim() != 1 or sinks.shape[0] != hq or \
            not sinks.is_floating_point():
        raise UsageError(f"decode_attention: sinks must be a ({hq},) floating-point tensor (one logit per query "
                         f"head), got {tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}"
                         + (f" {sinks.dtype}" if isinstance(sinks, torch.Tensor) else ""))
    if sinks.device != q.device:
        raise UsageError(f"decode_attention: sinks are on {sinks.device}, q on {q.device}")
    if sinks.dtype != torch.float32 or not sinks.is_contiguous():
        sinks = sinks.to(torch.float32).contiguous()
    return sinks


def _sink_math(q, k, v, causal: bool, scale, sinks):
    """The sinks fallback on a dense cache: attention_math (fp32, the sink column), bottom-right causal."""
    sq, sk = q.shape[-2], k.shape[-2]
    visible = bottom_right_mask(sq, sk, q.device) if causal and sq > 1 else None
    return attention_math(q, k, v, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]), visible, sinks)


def _observe(q, k, v, causal: bool, decision, sinks: bool = False) -> None:
    """Tell the active shape recorders (evotune.torch.record_shapes) of this call: one row per shape, cache length
    included, with the decode family's `--shape` spelling (None where the kernel has no such shape), its table
    key (None off a GPU) and the route its bucket's decision took."""
    ident = ("attention-decode", tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, bool(causal),
             bool(sinks))

    _record(ident, lambda: _shape_of(q, k, v, causal, sinks), q, k, causal, decision, sinks)


def _record(ident: tuple, shape_of, q, k, causal: bool, decision, sinks: bool = False) -> None:
    """One row per distinct call `ident` in every active recorder: the call's decode shape (`shape_of()`, None where
    the kernel has no such shape), its `--shape` spelling and table key, the route its decision took, and `sinks`
    where the call has them (a row whose shape is None still says so, as the attention op's rows do)."""
    def row() -> dict:
        shape = shape_of()
        key = None
        if shape is not None and q.is_cuda:
            key = key_dict(table_key(*_device_name(q.device.index), shape))
        route, what = decision
        return {"family": PROBLEM.family, "shape": shape.spec if shape is not None else None, "key": key,
                "q": list(q.shape), "k": list(k.shape), "dtype": str(q.dtype).replace("torch.", ""),
                "causal": bool(causal), "device": str(q.device), "route": route,
                "reason": None if route == "evotune" else what, **({"sinks": True} if sinks else {})}

    for recorder in list(record._ACTIVE):
        recorder.add_row(ident, row)


def _shape_of(q, k, v, causal: bool, sinks: bool = False) -> DecodeShape | None:
    """The call's DecodeShape where the kernel has one for its sizes and dtype (its device aside), else None."""
    if q.dim() != 4 or k.dim() != 4 or q.dtype not in _DTYPES or tuple(k.shape) != tuple(v.shape):
        return None
    b, hq, sq, d = q.shape
    try:
        shape = DecodeShape(b, hq, k.shape[1], sq, k.shape[2], d, _DTYPES[q.dtype], causal=bool(causal and sq > 1),
                            sinks=bool(sinks))
        PROBLEM.check_shape(shape)
    except (UsageError, ValueError, ZeroDivisionError):
        return None
    return shape


def decode_route(q, k, v, causal: bool = False, sinks=None) -> str:
    """"evotune" or "sdpa: <reason>" for this call, as decode_attention would take it (explain, tests)."""
    sinks = _sink_logits(sinks, q)
    key = _call_key(q, k, v, causal, None, sinks)
    decision = _DECISIONS.get(key) or _decide(q, k, v, causal, sinks is not None)
    return "evotune" if decision[0] == "evotune" else f"sdpa: {decision[1]}"


# An opaque node for torch.compile (the decision is made at run time on the real tensors), its body registered
# straight to the CPU and CUDA keys as evotune::attention's is (evotune.torch.op says why not custom_op).
_LIB = torch.library.Library("evotune", "FRAGMENT")
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, "
            "Tensor? sinks=None) -> Tensor")
_LIB.define("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
            "Tensor cache_seqlens, bool causal=True, float? scale=None, Tensor? sinks=None, int? max_seqlen=None) "
            "-> Tensor")
for _dispatch_key in ("CPU", "CUDA"):
    _LIB.impl("decode_attention", _decode_body, _dispatch_key)
    _LIB.impl("paged_decode_attention", lambda *a: _paged_body(*a), _dispatch_key)


@torch.library.register_fake("evotune::decode_attention", lib=_LIB)
def _decode_fake(q, k, v, causal=False, scale=None, sinks=None):
    return torch.empty_like(q)


@torch.library.register_fake("evotune::paged_decode_attention", lib=_LIB)
def _paged_fake(q, k_cache, v_cache, block_table, cache_seqlens, causal=True, scale=None, sinks=None, max_seqlen=None):
    return torch.empty_like(q)


decode_op = torch.ops.evotune.decode_attention
paged_decode_op = torch.ops.evotune.paged_decode_attention


def decode_attention(q, k, v, *, causal: bool = False, scale: float | None = None, sinks=None):
    """softmax(scale·QKᵀ + mask)·V for q (B, Hq, Sq, D) over a KV cache k, v (B, Hkv, Sk, D), Hkv dividing Hq;
    causal is bottom-right aligned. `sinks`: an (Hq,) tensor of attention-sink logits (gpt-oss's s_aux; cast to
    contiguous fp32), each joining its head's rows' softmax as a column with no value. Our tuned kernel where the
    decode table routes the call's key to it, else SDPA (with sinks: PyTorch fp32 math), said once per reason. The
    output has q's shape and layout."""
    if torch.compiler.is_compiling():
        return decode_op(q, k, v, causal, scale, sinks)
    return _decode_body(q, k, v, causal, scale, sinks)


# --------------------------------------------------------------------------- the paged op


def _check_paged_args(q, k_cache, v_cache, block_table, cache_seqlens, max_seqlen) -> None:
    """The paged op's arguments agree with each other (whatever runs them); one UsageError line otherwise."""
    def shape_of(t):
        return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__

    where = "paged_decode_attention"
    if not all(isinstance(t, torch.Tensor) for t in (q, k_cache, v_cache, block_table, cache_seqlens)):
        raise UsageError(f"{where}: q, k_cache, v_cache, block_table and cache_seqlens must be tensors")
    if q.dim() != 4 or k_cache.dim() != 4 or tuple(v_cache.shape) != tuple(k_cache.shape):
        raise UsageError(f"{where}: q must be (B, Hq, Sq, D) and k_cache, v_cache (num_pages, page_size, Hkv, D), "
                         f"the same; got q {shape_of(q)}, k_cache {shape_of(k_cache)}, v_cache {shape_of(v_cache)}")
    b, hq, sq, d = q.shape
    _, page, hk, dk = k_cache.shape
    if dk != d or hk == 0 or hq % hk or page == 0:
        raise UsageError(f"{where}: q {shape_of(q)} and k_cache {shape_of(k_cache)} do not agree: the head dims must "
                         f"match and the K/V heads divide the query heads")
    if block_table.dim() != 2 or block_table.shape[0] != b or block_table.dtype != torch.int32:
        raise UsageError(f"{where}: block_table must be ({b}, max_pages) int32, got {shape_of(block_table)} "
                         f"{block_table.dtype}")
    if tuple(cache_seqlens.shape) != (b,) or cache_seqlens.dtype != torch.int32:
        raise UsageError(f"{where}: cache_seqlens must be ({b},) int32, got {shape_of(cache_seqlens)} "
                         f"{cache_seqlens.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise UsageError(f"{where}: q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    if any(t.device != q.device for t in (k_cache, v_cache, block_table, cache_seqlens)):
        raise UsageError(f"{where}: q, k_cache, v_cache, block_table and cache_seqlens must be on one device")
    if max_seqlen is not None and (not isinstance(max_seqlen, int) or max_seqlen < 0):
        raise UsageError(f"{where}: max_seqlen must be a whole number of keys, got {max_seqlen!r}")


def paged_uncovered_reason(q, k_cache, v_cache, block_table, cache_seqlens) -> str | None:
    """Why the decode kernel does not compute this paged call (None where it does): checked on metadata."""
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype}: the kernel takes fp16 or bf16"
    if not q.is_cuda:
        return "tensors not on a CUDA device"
    b, hq, sq, d = q.shape
    page, hk = k_cache.shape[1], k_cache.shape[2]
    if d not in HEAD_DIMS:
        return f"head_dim {d} (the kernel takes {', '.join(map(str, HEAD_DIMS))})"
    if sq > MAX_SEQ_Q or (hq // hk) * sq > MAX_ROWS:
        return f"{sq} queries x {hq // hk} query heads per K/V head (the kernel takes 1 to {MAX_SEQ_Q} queries, " \
               f"at most {MAX_ROWS} rows)"
    if page > MAX_PAGE_SIZE:
        return f"page size {page} (the kernel takes 1 to {MAX_PAGE_SIZE} keys a page)"
    if block_table.shape[1] * page >= 2**31:
        return f"{block_table.shape[1]} pages of {page} keys a sequence: past the kernel's 32-bit key index"
    why = _paged_fault(q, k_cache, v_cache, block_table, cache_seqlens)
    return why


def _paged_fault(q, k_cache, v_cache, block_table, cache_seqlens) -> str | None:
    """The alignment and stride rules of a paged launch (None where they hold): rows 16-byte aligned, unit strides
    where the kernel steps by one."""
    if q.stride(-1) != 1 or any(s % 8 for s in q.stride()[:-1]) or q.data_ptr() % 16:
        return f"q has strides {tuple(q.stride())} (the kernel needs 16-byte aligned rows, unit last stride)"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]) or t.data_ptr() % 16:
            return f"{name} has strides {tuple(t.stride())} (the kernel needs 16-byte aligned rows, unit last stride)"
    if block_table.stride(1) != 1 or not cache_seqlens.is_contiguous():
        return "block_table's rows and cache_seqlens must be contiguous"
    return None


def _paged_shape(q, k_cache, block_table, causal: bool, sinks: bool, max_seqlen) -> DecodeShape:
    """The DecodeShape a paged call is keyed by: its sequences' length is `max_seqlen` where given (the longest; a
    host int, as flash-attention's varlen takes it), else the block table's pages x the page size."""
    b, hq, sq, d = q.shape
    page, hk = k_cache.shape[1], k_cache.shape[2]
    capacity = block_table.shape[1] * page
    seq_k = max(sq, min(capacity, max_seqlen) if max_seqlen is not None else capacity, 1)
    return DecodeShape(b, hq, hk, sq, seq_k, d, _DTYPES.get(q.dtype, "fp16"), causal=bool(causal and sq > 1),
                       sinks=bool(sinks), page_size=page)


def _paged_key(q, k_cache, block_table, causal, scale, sinks, max_seqlen):
    capacity = block_table.shape[1] * k_cache.shape[1]
    length = min(capacity, max_seqlen) if max_seqlen is not None else capacity
    return ("paged", q.shape, q.stride(), tuple(k_cache.shape[1:]), block_table.shape[0],
            seq_bucket(max(length, 1)), q.dtype, q.device, bool(causal), scale, sinks is not None)


def _decide_paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, sinks, max_seqlen):
    why = paged_uncovered_reason(q, k_cache, v_cache, block_table, cache_seqlens)
    if why is not None:
        return "sdpa", why
    return _route(_paged_shape(q, k_cache, block_table, causal, sinks is not None, max_seqlen), q.device.index)


def _paged_body(q, k_cache, v_cache, block_table, cache_seqlens, causal=True, scale=None, sinks=None,
                max_seqlen=None):
    """The paged op's implementation: the call key's cached decision, then our kernel or the pages gathered and
    SDPA (with sinks: the fp32 sink math), told once."""
    _check_paged_args(q, k_cache, v_cache, block_table, cache_seqlens, max_seqlen)
    sinks = _sink_logits(sinks, q)
    key = _paged_key(q, k_cache, block_table, causal, scale, sinks, max_seqlen)
    decision = _DECISIONS.get(key)
    if decision is None:
        decision = _DECISIONS[key] = _decide_paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, sinks,
                                                   max_seqlen)
    if record._ACTIVE:
        _observe_paged(q, k_cache, block_table, causal, sinks is not None, max_seqlen, decision)
    route, what = decision
    scale_ = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if route == "evotune":
        why = _paged_fault(q, k_cache, v_cache, block_table, cache_seqlens)
        if why is None:
            return what(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), scale_, sinks,
                        (block_table, cache_seqlens))
        what = why
    _tell(what, _fallback_name(sinks, paged=True))
    return paged_fallback(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale_, sinks, max_seqlen)


def paged_fallback(q, k_cache, v_cache, block_table, cache_seqlens, causal: bool, scale: float, sinks=None,
                   max_seqlen=None):
    """PyTorch's answer for a paged call: each sequence's pages gathered (up to `max_seqlen` keys where given, else
    the longest length, read from the device outside a CUDA graph capture, else the whole table) into a dense
    (B, Hkv, width, D) cache whose rows past a sequence's length are zero (a cache's unused slots may hold NaN), then
    SDPA with the (B, 1, Sq, width) mask of each sequence's length and causal edge (bottom-right), or with sinks the
    fp32 sink math. A row that sees no key is 0."""
    b, hq, sq, d = q.shape
    num_pages, page, hk, _ = k_cache.shape
    capacity = block_table.shape[1] * page
    if max_seqlen is not None:
        width = min(capacity, max_seqlen)
    elif not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        width = min(capacity, int(cache_seqlens.max().item()) if b else 0)
    else:
        width = capacity
    width = max(width, 1)
    pages = -(-width // page)
    table = block_table[:, :pages].long().clamp(0, num_pages - 1)
    keep = torch.arange(width, device=q.device)[None, :] < cache_seqlens.to(torch.long)[:, None]  # (B, width)

    def gather(cache):
        rows = cache[table].reshape(b, pages * page, hk, d)[:, :width]
        return torch.where(keep[:, :, None, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device)
                           ).transpose(1, 2)

    k, v = gather(k_cache), gather(v_cache)
    visible = visible_keys(cache_seqlens, sq, width, causal, q.device)  # (B, 1, Sq, width)
    if sinks is not None:
        return attention_math(q, k, v, scale, visible, sinks)
    gqa = {"enable_gqa": True} if hq != hk else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, **gqa)
    return torch.where(visible.any(dim=-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))


def _observe_paged(q, k_cache, block_table, causal: bool, sinks: bool, max_seqlen, decision) -> None:
    """Tell the active shape recorders of this paged call: its `--shape` spelling (`:paged=P`, Sk its max_seqlen or
    table capacity) and table key."""
    ident = ("attention-decode-paged", tuple(q.shape), tuple(k_cache.shape), tuple(block_table.shape), q.dtype,
             q.device, bool(causal), bool(sinks), max_seqlen)

    def shape_of():
        try:
            shape = _paged_shape(q, k_cache, block_table, causal, sinks, max_seqlen)
            PROBLEM.check_shape(shape)
            return shape
        except (UsageError, ValueError, ZeroDivisionError):
            return None

    _record(ident, shape_of, q, k_cache, causal, decision, sinks)


def paged_decode_route(q, k_cache, v_cache, block_table, cache_seqlens, causal: bool = True, sinks=None,
                       max_seqlen=None) -> str:
    """"evotune" or "sdpa: <reason>" for this paged call, as paged_decode_attention would take it."""
    _check_paged_args(q, k_cache, v_cache, block_table, cache_seqlens, max_seqlen)
    sinks = _sink_logits(sinks, q)
    key = _paged_key(q, k_cache, block_table, causal, None, sinks, max_seqlen)
    decision = _DECISIONS.get(key) or _decide_paged(q, k_cache, v_cache, block_table, cache_seqlens, causal, sinks,
                                                    max_seqlen)
    return "evotune" if decision[0] == "evotune" else f"sdpa: {decision[1]}"


def paged_decode_attention(q, k_cache, v_cache, block_table, cache_seqlens, *, causal: bool = True,
                           scale: float | None = None, sinks=None, max_seqlen: int | None = None):
    """Decode attention over a paged KV cache (vLLM's, FlashAttention's flash_attn_with_kvcache layout):
    q (B, Hq, Sq, D) with Sq <= 16 (a decode step, or a few speculative / chunked queries); k_cache, v_cache
    (num_pages, page_size, Hkv, D), Hkv dividing Hq, any page size; block_table (B, max_pages) int32: sequence b's
    key j is row j % page_size of page block_table[b, j // page_size]; cache_seqlens (B,) int32: each sequence's
    length (they may differ). causal (default) is bottom-right per sequence: query i of sequence b sees keys
    0 .. cache_seqlens[b] - Sq + i; a row that sees no key is 0. `sinks`: (Hq,) attention-sink logits as in
    decode_attention. `max_seqlen`: the longest length (a host int, as flash-attention's varlen max_seqlen_k), which
    keys the decode table; without it the key takes the table's pages x page size.

    Our tuned kernel where the decode table holds the call's key (with its page size), else PyTorch on the gathered
    pages (SDPA, or the sink math), said once per reason. The output has q's shape and layout."""
    if torch.compiler.is_compiling():
        return paged_decode_op(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, sinks, max_seqlen)
    return _paged_body(q, k_cache, v_cache, block_table, cache_seqlens, causal, scale, sinks, max_seqlen)


def clear() -> None:
    """Forget decisions, loaded kernels, counters, masks and the reasons already told (a table file is reloaded; a
    table given as a dict stays in use)."""
    global _TABLE
    with _LOCK:
        _DECISIONS.clear()
        _KERNELS.clear()
        _COUNTERS.clear()
        _MASKS.clear()
        _WARNED.clear()
        _TABLE = _TABLE_GIVEN
