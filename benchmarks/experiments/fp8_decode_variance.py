"""The float8 decode's spread within one process: the features_round fp8-decode shape (batch 16, 8192 keys,
32:8 heads, d128, e4m3 cache, unit scales) timed on eight fresh pairs of caches, each after a spacer
allocation that moves them, with the cache read rate per trial (K and V bytes / time).

    PYTHONPATH=src python3 benchmarks/experiments/fp8_decode_variance.py
"""
import torch, triton, flashtile
torch.manual_seed(0)
b, cap = 16, 8192
q = torch.randn(b, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
seqlens = torch.full((b,), cap, dtype=torch.int32, device="cuda")
scales = torch.ones(b, 8, device="cuda")
keep = []
for trial in range(8):
    pad = torch.empty(trial * 3 * 2**20 + 4096 * trial, dtype=torch.uint8, device="cuda"); keep.append(pad)
    k8 = torch.randn(b, cap, 8, 128, device="cuda").to(torch.float8_e4m3fn)
    v8 = torch.randn(b, cap, 8, 128, device="cuda").to(torch.float8_e4m3fn)
    with torch.no_grad():
        ms = triton.testing.do_bench(lambda: flashtile.flash_attn_with_kvcache(q, k8, v8, cache_seqlens=seqlens, k_descale=scales, v_descale=scales), rep=200)
    print(f"trial {trial} k@{k8.data_ptr() % 2**21:#x} v@{v8.data_ptr() % 2**21:#x} {ms*1e3:.1f} us  {2*k8.numel()/ms/1e9:.2f} TB/s")
    del k8, v8
