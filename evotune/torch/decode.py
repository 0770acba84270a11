"""Decode attention as a PyTorch op: `decode_attention(q, k, v, causal=..., scale=...)`.

    from evotune.torch.decode import decode_attention
    out = decode_attention(q, k, v, causal=True)   # q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D): a KV cache

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
from ..problems.decode import HEAD_DIMS, MAX_ROWS, MAX_SEQ_Q, DecodeShape, bottom_right_mask
from ..records.decode_table import (KEY_FIELDS, TABLE_ENV, TABLE_VERSION, build_decode_table,  # noqa: F401 (API)
                                    default_decode_table_path, table_key)
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
            key = tuple(e["key"][f] for f in KEY_FIELDS)
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


def _decide(q, k, v, causal: bool):
    """("evotune", DecodeLaunch) or ("sdpa", reason) for this call and every later one of its key (_call_key: the
    cache length as its bucket). The config's admission is checked at this call's length: within a bucket the
    kernel is correct at any length (a split may come out empty; the space's split rule only prunes the search)."""
    why = uncovered_reason(q, k, v, causal)
    if why is not None:
        return "sdpa", why
    b, hq, sq, d = q.shape
    shape = DecodeShape(b, hq, k.shape[1], sq, k.shape[2], d, _DTYPES[q.dtype], causal=bool(causal and sq > 1))
    gpu, cc = _device_name(q.device.index)
    key = table_key(gpu, cc, shape)
    entry = _table().get(key)
    if entry is None:
        return "sdpa", (f"untuned decode key {dict(zip(KEY_FIELDS, key))}: record the calls "
                        f"(evotune.torch.record_shapes) and tune them with `evotune tune --shapes FILE`, or "
                        f"`evotune search --family attention-decode --shape {shape.spec}` and build_decode_table")
    if entry["route"] != "evotune":
        return "sdpa", f"the decode table routes {shape.spec} to SDPA: {entry.get('reason', '')}"
    cfg = entry["config_obj"]
    space = _space()
    if not space.admitted(cfg, PROBLEM.context(shape)):
        return "sdpa", f"the tuned config is not admitted on {shape.spec}: {'; '.join(space.violations(cfg, PROBLEM.context(shape)))}"
    try:
        kernel = _load(cfg, shape, q.device.index, entry["source_digest"])
    except EvotuneError as e:
        return "sdpa", str(e)
    return "evotune", DecodeLaunch(kernel, cfg, shape)


def _load(cfg, shape: DecodeShape, device_index: int, digest: str):
    """The loaded kernel of `cfg` on `shape`'s code key, compiled and loaded once per device; EvotuneError where
    today's source is not the measured one or the kernel breaks the launch's limits."""
    code_key = (cfg.items, shape.dtype, shape.head_dim, shape.group, shape.seq_q, shape.causal, device_index)
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


# The entry point's parameters in order (DecodeProblem.instantiation), as a ParamPacket reads them.
ENTRY_PARAMS = ((("q", "ptr"), ("k", "ptr"), ("v", "ptr"), ("o", "ptr"))
                + tuple((f"{t}_s{d}", "i64") for t in "qkvo" for d in "bhs")
                + (("seq_k", "i32"), ("scale_log2", "f32"), ("ws_o", "ptr"), ("ws_ml", "ptr"), ("ws_count", "ptr")))


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
        self._local = threading.local()

    def _packet(self):
        packet = getattr(self._local, "packet", None)
        if packet is None:
            from ..gpu.packet import ParamPacket

            packet = self._local.packet = ParamPacket(ENTRY_PARAMS, {name: 0 for name, _ in ENTRY_PARAMS})
            packet.slots = [packet.slot(name) for name, _ in ENTRY_PARAMS]
        return packet

    def __call__(self, q, k, v, scale: float):
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
        values = ((q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr())
                  + tuple(x for t in (q, k, v, out) for x in t.stride()[:3])
                  + (k.shape[2], scale * _LOG2E) + workspace)
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


def _tell(reason: str) -> None:
    with _LOCK:
        if reason in _WARNED:
            return
        _WARNED.add(reason)
    warnings.warn(f"evotune.torch.decode: running PyTorch SDPA: {reason}", EvotuneFallbackWarning, stacklevel=4)


def _call_key(q, k, v, causal, scale):
    """What a decision depends on: everything but the cache length, which enters as its table bucket (a decode
    step grows the cache by one key: the bucket's decision, kernel and launch serve the next step too)."""
    sk = k.shape[-2] if k.dim() == 4 else 0
    return (q.shape, q.stride(), k.shape[:-2] if k.dim() == 4 else k.shape, k.shape[-1], v.shape[:-2] if v.dim() == 4
            else v.shape, seq_bucket(sk) if sk else 0, q.dtype, q.device, bool(causal), scale)


def _per_call_fault(q, k, v) -> str | None:
    """What the bucket's decision cannot know of this call (None where nothing): the cache's length against the
    queries, and its rows' alignment (a cache's strides change with its length; q's are in the decision's key)."""
    if q.shape[2] > k.shape[2]:
        return f"{q.shape[2]} queries over {k.shape[2]} keys (a query would see no key)"
    for t in (k, v):
        if t.data_ptr() % 16 or t.stride(0) % 8 or t.stride(1) % 8 or t.stride(2) % 8 or t.stride(3) != 1:
            return f"a K/V cache with strides {tuple(t.stride())} (the kernel needs 16-byte aligned rows)"
    return None


def _decode_body(q, k, v, causal=False, scale=None):
    """The op's implementation: the call key's cached decision, then our kernel or SDPA (told once)."""
    key = _call_key(q, k, v, causal, scale)
    decision = _DECISIONS.get(key)
    if decision is None:
        decision = _DECISIONS[key] = _decide(q, k, v, causal)
    if record._ACTIVE:
        _observe(q, k, v, causal, decision)
    route, what = decision
    if route == "evotune":
        why = _per_call_fault(q, k, v)
        if why is None:
            return what(q, k, v, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
        what = why
    _tell(what)
    return _sdpa(q, k, v, causal, scale)


def _observe(q, k, v, causal: bool, decision) -> None:
    """Tell the active shape recorders (evotune.torch.record_shapes) of this call: one row per shape, cache length
    included, with the decode family's `--shape` spelling (None where the kernel has no such shape), its table
    key (None off a GPU) and the route its bucket's decision took."""
    ident = ("attention-decode", tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, q.device, bool(causal))

    def row() -> dict:
        shape = _shape_of(q, k, v, causal)
        key = None
        if shape is not None and q.is_cuda:
            key = dict(zip(KEY_FIELDS, table_key(*_device_name(q.device.index), shape)))
        route, what = decision
        return {"family": PROBLEM.family, "shape": shape.spec if shape is not None else None, "key": key,
                "q": list(q.shape), "k": list(k.shape), "dtype": str(q.dtype).replace("torch.", ""),
                "causal": bool(causal), "device": str(q.device), "route": route,
                "reason": None if route == "evotune" else what}

    for recorder in list(record._ACTIVE):
        recorder.add_row(ident, row)


def _shape_of(q, k, v, causal: bool) -> DecodeShape | None:
    """The call's DecodeShape where the kernel has one for its sizes and dtype (its device aside), else None."""
    if q.dim() != 4 or k.dim() != 4 or q.dtype not in _DTYPES or tuple(k.shape) != tuple(v.shape):
        return None
    b, hq, sq, d = q.shape
    try:
        shape = DecodeShape(b, hq, k.shape[1], sq, k.shape[2], d, _DTYPES[q.dtype], causal=bool(causal and sq > 1))
        PROBLEM.check_shape(shape)
    except (UsageError, ValueError, ZeroDivisionError):
        return None
    return shape


def decode_route(q, k, v, causal: bool = False) -> str:
    """"evotune" or "sdpa: <reason>" for this call, as decode_attention would take it (explain, tests)."""
    key = _call_key(q, k, v, causal, None)
    decision = _DECISIONS.get(key) or _decide(q, k, v, causal)
    return "evotune" if decision[0] == "evotune" else f"sdpa: {decision[1]}"


# An opaque node for torch.compile (the decision is made at run time on the real tensors), its body registered
# straight to the CPU and CUDA keys as evotune::attention's is (evotune.torch.op says why not custom_op).
_LIB = torch.library.Library("evotune", "FRAGMENT")
_LIB.define("decode_attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None) -> Tensor")
for _dispatch_key in ("CPU", "CUDA"):
    _LIB.impl("decode_attention", _decode_body, _dispatch_key)


@torch.library.register_fake("evotune::decode_attention", lib=_LIB)
def _decode_fake(q, k, v, causal=False, scale=None):
    return torch.empty_like(q)


decode_op = torch.ops.evotune.decode_attention


def decode_attention(q, k, v, *, causal: bool = False, scale: float | None = None):
    """softmax(scale·QKᵀ + mask)·V for q (B, Hq, Sq, D) over a KV cache k, v (B, Hkv, Sk, D), Hkv dividing Hq;
    causal is bottom-right aligned. Our tuned kernel where the decode table routes the call's key to it, else
    SDPA, said once per reason. The output has q's shape and layout."""
    if torch.compiler.is_compiling():
        return decode_op(q, k, v, causal, scale)
    return _decode_body(q, k, v, causal, scale)


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
