"""Training: `evotune::attention_lse`, the forward that also returns the row log-sum-exp, and its backward.

The forward is evotune's kernel built with its log-sum-exp epilogue (the tuned config of the call's key,
`write_lse`: a few stores after the loop, not a knob, compiled only here) where the table routes the key
to evotune, else PyTorch's own attention forward that returns the log-sum-exp. The backward is always
PyTorch's attention backward from (Q, K, V, O, LSE): FlashAttention-2's where it computes the call, the
memory-efficient one where it does not (fp32, or a causal mask with Sq != Sk, which PyTorch's flash
kernel aligns bottom-right and SDPA top-left), and the CPU flash backward on the CPU. Which one is a
function of the call's static facts (`lse_backend`), so the forward writes the log-sum-exp in the layout
that backward reads, and the fake implementation knows its shape:

  flash, cpu   (B, H, Sq) fp32, contiguous
  efficient    (B, H, ceil(Sq / 32) * 32) fp32 (PyTorch's efficient kernels pad rows to 32)

Grouped K/V heads: the forward and the flash backward read them natively; the efficient and CPU
kernels take one K/V head per query head, so K/V are expanded for them and dK, dV summed over each group.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..errors import UsageError
from . import record, routing
from .call import check_args, new_output
from .kernels import launch, load_for

aten = torch.ops.aten
LSE_ALIGN = 32  # rows of PyTorch's memory-efficient kernels' log-sum-exp (kAlignLSE)


def lse_backend(q, k, is_causal: bool) -> str | None:
    """Which PyTorch attention backward takes this call's (O, LSE): "flash", "efficient", "cpu", or None
    where none does (then the op runs SDPA with its own autograd). Static facts only (traceable)."""
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type != "cuda":
        return None
    d = q.shape[-1]
    if q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256 and not (is_causal and q.shape[2] != k.shape[2]):
        return "flash"
    return "efficient" if q.dtype in (torch.float16, torch.bfloat16, torch.float32) else None


def new_lse(q, backend: str) -> torch.Tensor:
    b, h, s = q.shape[0], q.shape[1], q.shape[2]
    rows = -(-s // LSE_ALIGN) * LSE_ALIGN if backend == "efficient" else s
    return q.new_empty((b, h, rows), dtype=torch.float32)


@torch.library.custom_op("evotune::attention_lse", mutates_args=())
def attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                     scale: Optional[float] = None, enable_gqa: bool = False,
                     fallback: str = "sdpa") -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(q, k, v, is_causal, scale, enable_gqa, fallback)


@attention_lse_op.register_fake
def _forward_fake(q, k, v, is_causal=False, scale=None, enable_gqa=False, fallback="sdpa"):
    routing.check_fallback(fallback)
    check_args(q, k, v, enable_gqa)
    backend = lse_backend(q, k, is_causal)
    if backend is None:
        raise UsageError(f"evotune.torch.attention: no attention backward for {q.device.type} tensors")
    return new_output(q, v), new_lse(q, backend)


def _forward_impl(q, k, v, is_causal, scale, enable_gqa, fallback):
    routing.check_fallback(fallback)
    check_args(q, k, v, enable_gqa)
    backend = lse_backend(q, k, is_causal)
    if backend is None:
        raise UsageError(f"evotune.torch.attention: no attention backward for {q.device.type} tensors")
    decision = routing.decide_for(q, k, v, is_causal)
    record.observe(decision)
    if decision.route == "evotune":
        return _run_kernel(decision, q, k, v, scale, backend)
    routing.notify(decision, fallback)
    return _run_pytorch(q, k, v, is_causal, scale, backend)


def _run_kernel(decision, q, k, v, scale, backend):
    index = decision.call.device_index
    with torch.cuda.device(index):
        loaded = load_for(decision, write_lse=True)
        out, lse = new_output(q, v), new_lse(q, backend)
        launch(loaded, decision.shape, q, k, v, out, scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]),
               lse=lse)
    return out, lse


def _expand_kv(q, k, v):
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def _run_pytorch(q, k, v, is_causal, scale, backend):
    """PyTorch's attention forward with the log-sum-exp the backward `backend` reads."""
    if backend == "flash":
        o, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[:2]
    elif backend == "efficient":
        ke, ve = _expand_kv(q, k, v)
        o, lse = aten._scaled_dot_product_efficient_attention(q, ke, ve, None, True, 0.0, is_causal, scale=scale)[:2]
    else:
        ke, ve = _expand_kv(q, k, v)
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, ke, ve, 0.0, is_causal, scale=scale)
    out = new_output(q, v)
    out.copy_(o)
    want = new_lse(q, backend)
    if lse.shape != want.shape:
        raise UsageError(f"evotune.torch.attention: PyTorch's {backend} attention returned a log-sum-exp of shape "
                         f"{tuple(lse.shape)}, expected {tuple(want.shape)} (torch {torch.__version__})")
    want.copy_(lse)
    return out, want


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, scale, _enable_gqa, _fallback = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad_out, _grad_lse):
    """dQ, dK, dV from PyTorch's attention backward (the LSE output is internal: attention() returns O only)."""
    q, k, v, out, lse = ctx.saved_tensors
    grads = attention_backward(grad_out, q, k, v, out, lse, ctx.is_causal, ctx.scale)
    return grads + (None, None, None, None)


def attention_backward(grad_out, q, k, v, out, lse, is_causal: bool, scale):
    """(dQ, dK, dV) of softmax(scale QK^T [+ top-left causal mask]) V from O and its log-sum-exp."""
    backend = lse_backend(q, k, is_causal)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if backend == "flash":
        seed, offset = _philox_placeholders(q)
        return tuple(aten._scaled_dot_product_flash_attention_backward(
            grad_out, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, is_causal, seed, offset,
            scale=scale))
    ke, ve = _expand_kv(q, k, v)
    if backend == "efficient":
        seed, offset = _philox_placeholders(q)
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            _bshd(grad_out), q, ke, ve, None, _bshd(out), lse, seed, offset, 0.0, [True, True, True, False], is_causal,
            scale=scale)
    elif backend == "cpu":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, ke, ve, out, lse, 0.0, is_causal, scale=scale)
    else:
        raise UsageError(f"evotune.torch.attention: no attention backward for {q.device.type} tensors")
    return dq, _sum_groups(dk, k), _sum_groups(dv, v)


def _bshd(t):
    """`t` with (B, S, H, D) memory, the layout PyTorch's efficient forward writes O in. Its backward reads O
    and dO as if they had it: given (B, H, S, D)-contiguous ones, it returned a wrong dQ on the H100 (torch
    2.11; a causal 1x8x100x160 d64 fp16 case: max error 4.1 against 2e-4), without an error."""
    return t if t.transpose(1, 2).is_contiguous() else t.transpose(1, 2).contiguous().transpose(1, 2)


def _sum_groups(grad, kv):
    """A gradient of expanded K or V (one head per query head) summed back onto kv's heads."""
    b, hk, s, d = kv.shape
    if grad.shape[1] == hk:
        return grad
    return grad.reshape(b, hk, grad.shape[1] // hk, s, d).sum(dim=2)


def _philox_placeholders(q):
    """The dropout RNG state arguments of PyTorch's attention backwards; unread at dropout 0."""
    return (torch.zeros(2, dtype=torch.int64, device=q.device), torch.zeros((), dtype=torch.int64, device=q.device))


attention_lse_op.register_autograd(_backward, setup_context=_setup_context)
