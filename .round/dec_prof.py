import sys; sys.argv=['x']; sys.path.insert(0,'benchmarks')
import host_overhead as h
import torch, flashtile
h._disable_launches()
dtype=torch.bfloat16; device='cpu'
k_cache, v_cache = (torch.randn(4, 1024, 8, 64, device=device, dtype=dtype) for _ in range(2))
q_step = torch.randn(4, 1, 8, 64, device=device, dtype=dtype)
cache_seqlens = torch.full((4,), 1000, dtype=torch.int32, device=device)
def decoding(): flashtile.flash_attn_with_kvcache(q_step, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True)
for _ in range(100): decoding()
with torch.profiler.profile() as p:
    for _ in range(100): decoding()
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=30))
