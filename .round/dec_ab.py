import sys; sys.argv=['x']; sys.path.insert(0,'benchmarks')
import host_overhead as h
import torch, flashtile
h._disable_launches()
dtype=torch.bfloat16
k_cache, v_cache = (torch.randn(4, 1024, 8, 64, dtype=dtype) for _ in range(2))
q_step = torch.randn(4, 1, 8, 64, dtype=dtype)
cache_seqlens = torch.full((4,), 1000, dtype=torch.int32)
def decoding(): flashtile.flash_attn_with_kvcache(q_step, k_cache, v_cache, cache_seqlens=cache_seqlens, causal=True, num_splits=3)
print(round(h._per_call_us(decoding, 2000, 9, lambda: None), 1))
