import torch, torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
torch.manual_seed(8)
for shape, causal in [((1, 2, 64, 64), False), ((1, 8, 512, 64), True), ((2, 4, 256, 128), False)]:
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.float16) for _ in range(3))
    base = torch.empty(q.numel() + 4, dtype=q.dtype, device="cuda")
    odd = base[4:].view_as(q); odd.copy_(q)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    rows = []
    for name, be in [("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]:
        for label, qq in (("aligned", q), ("odd", odd)):
            try:
                if be is None:
                    o = F.scaled_dot_product_attention(qq, k, v, is_causal=causal)
                else:
                    with sdpa_kernel(be):
                        o = F.scaled_dot_product_attention(qq, k, v, is_causal=causal)
                torch.cuda.synchronize()
                rows.append(f"{name}/{label}: {float((o.float() - ref).abs().max()):.3g}")
            except Exception as e:
                rows.append(f"{name}/{label}: refused ({str(e).splitlines()[0][:60]})")
    print(shape, causal, "odd ptr %16 =", odd.data_ptr() % 16, "|", "; ".join(rows))
