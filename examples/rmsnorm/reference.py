import torch
import torch.nn.functional as F


def reference(x, w, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    return xf * rstd[:, None] * w.float(), rstd


def torch_rms_norm(x, w, eps):
    """F.rms_norm gives y; the rstd a fused kernel also writes costs torch a second reduction."""
    return F.rms_norm(x, (x.shape[-1],), w, eps), torch.rsqrt(x.float().square().mean(-1) + eps)
