import torch


def reference(x, w, eps):
    rstd = torch.rsqrt(x.float().square().mean(-1) + eps)
    return x.float() * rstd[:, None] * w.float(), rstd


def torch_rms_norm(x, w, eps):  # F.rms_norm gives y; the rstd a fused kernel also writes costs torch a second pass
    return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, eps), torch.rsqrt(x.float().square().mean(-1) + eps)
