"""Kernel times of one backward (torch.profiler), flashtile against cuDNN, at the short rows."""
import torch, flashtile
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity
for d, causal, n in ((128, False, 512), (128, True, 1024), (64, False, 512), (128, False, 8192)):
    B, H = 16384 // n, 32 if d == 64 else 16
    q, k, v, do = (torch.randn(B, n, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
    qt, kt, vt, dot = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v, do))
    for name, f in (("flashtile", lambda: torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v), do)),
                    ("cudnn", lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), (qt, kt, vt), dot))):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(3): f()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10): f()
                torch.cuda.synchronize()
        print(f"== d{d} causal={causal} N={n} {name}: per call, µs")
        tot = 0
        for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
            if e.device_time_total <= 0: continue
            us = e.device_time_total / 10; tot += us
            print(f"   {us:8.1f}  x{e.count // 10}  {e.key[:90]}")
        print(f"   {tot:8.1f}  total")
