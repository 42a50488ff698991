"""Decoding on the GPU: flashtile's KV-cache attention against the copy bandwidth and SDPA.

Cases (bf16, head dim 128, GQA 32:8 query:KV heads, seqlen_q = 1, random inputs):

1. decode sweep, batch 1..64 × cache length 1k..128k (combos whose K/V exceed 40 GB skipped):
   achieved bandwidth = bytes of K/V read / time, against the device copy bandwidth
   measured in the same run (read + write bytes of a 4 GiB ``copy_``);
2. ragged cache lengths (uniform in 1..Lmax) against SDPA, which needs a padded batch:
   SDPA runs on the padded (batch, nheads_k, Lmax, 128) K/V with a boolean key mask
   (memory-efficient or cuDNN backend with enable_gqa; if neither takes GQA with a mask,
   K/V expanded to 32 heads before timing, which favours SDPA's time);
3. paged vs contiguous cache, page sizes 16 / 64 / 256 from a shuffled pool;
4. tuning data: split counts and block configs on three shapes, next to the heuristic's choice.

Times are ``triton.testing.do_bench`` medians (L2 flushed between runs); the decode sweep
also shows the time replayed from a CUDA graph, which removes Python and launch overhead
(dominant for small caches). Runs in about two minutes on an H200:

    python benchmarks/decode_bench.py --out benchmarks/results/decode_h200.md
"""

from __future__ import annotations

import argparse
import datetime
import math

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench, do_bench_cudagraph

from flashtile._options import AttentionOptions
from flashtile.decode import flash_attn_with_kvcache
from flashtile.triton.launch import kvcache_attention_forward, split_plan

NHEADS, NHEADS_K, HEAD_DIM, DTYPE = 32, 8, 128, torch.bfloat16
MAX_KV_BYTES = 40e9
BATCHES = [1, 4, 16, 64]
CACHE_LENS = [1024, 4096, 16384, 65536, 131072]
RAGGED = [(16, 8192), (16, 32768), (64, 8192), (64, 16384)]  # (batch, Lmax)
TUNE_SHAPES = [(1, 131072), (4, 32768), (16, 8192)]  # (batch, cache length)


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def graph_ms(fn) -> float:
    """Replayed from a CUDA graph: the kernels' time without Python and launch overhead (L2 not flushed)."""
    return do_bench_cudagraph(fn, rep=50, return_mode="median")


def kv_bytes(num_keys: int) -> int:
    return 2 * num_keys * NHEADS_K * HEAD_DIM * torch.finfo(DTYPE).bits // 8  # K and V


def copy_bandwidth() -> float:
    src = torch.randn(2 * 2**30, device="cuda", dtype=DTYPE)  # 4 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)  # read + write


def make_cache(batch, capacity):
    q = torch.randn(batch, 1, NHEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
    k_cache = torch.randn(batch, capacity, NHEADS_K, HEAD_DIM, device="cuda", dtype=DTYPE)
    v_cache = torch.randn_like(k_cache)
    return q, k_cache, v_cache


def heuristic_splits(batch, capacity) -> int:
    return split_plan(batch, 1, NHEADS // NHEADS_K, NHEADS_K, HEAD_DIM, DTYPE, capacity,
                      torch.device("cuda"))[2]


def decode_sweep(copy_bw):
    rows = ["| batch | cache len | splits | time (µs) | K/V GB/s | % of copy | CUDA graph (µs) |",
            "|---:|---:|---:|---:|---:|---:|---:|"]
    for batch in BATCHES:
        for capacity in CACHE_LENS:
            if kv_bytes(batch * capacity) > MAX_KV_BYTES:
                continue
            q, k_cache, v_cache = make_cache(batch, capacity)
            seqlens = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
            def run():
                return flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
            ms = bench_ms(run)
            bw = kv_bytes(batch * capacity) / (ms * 1e-3)
            rows.append(f"| {batch} | {capacity} | {heuristic_splits(batch, capacity)} | {ms * 1e3:.1f} | "
                        f"{bw / 1e9:.0f} | {100 * bw / copy_bw:.0f}% | {graph_ms(run) * 1e3:.1f} |")
            del q, k_cache, v_cache
            torch.cuda.empty_cache()
    return rows


def sdpa_padded(q, k_cache, v_cache, seqlens):
    """Time SDPA on the padded batch with a key mask → (ms, backend label)."""
    lmax = k_cache.shape[1]
    q_t = q.transpose(1, 2)  # [B, H, 1, D]
    k_t, v_t = k_cache.transpose(1, 2), v_cache.transpose(1, 2)  # [B, Hk, Lmax, D]
    mask = (torch.arange(lmax, device="cuda")[None, :] < seqlens[:, None])[:, None, None, :]  # [B, 1, 1, Lmax]
    for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        def run(backend=backend):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q_t, k_t, v_t, attn_mask=mask, enable_gqa=True)
        try:
            run()
        except RuntimeError:
            continue
        return bench_ms(run), f"{backend.name.lower()}, gqa"
    group = NHEADS // NHEADS_K
    k_x, v_x = k_t.repeat_interleave(group, 1), v_t.repeat_interleave(group, 1)

    def run_expanded():
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q_t, k_x, v_x, attn_mask=mask)
    return bench_ms(run_expanded), "efficient_attention, K/V expanded before timing"


def ragged_vs_sdpa():
    rows = ["| batch | Lmax | real/padded keys | flashtile (µs) | SDPA padded (µs) | speed-up | SDPA backend |",
            "|---:|---:|---:|---:|---:|---:|---|"]
    g = torch.Generator().manual_seed(0)
    for batch, lmax in RAGGED:
        lengths = torch.randint(1, lmax + 1, (batch,), generator=g)
        lengths[0] = lmax  # the padded length is the longest sequence's
        seqlens = lengths.to("cuda", torch.int32)
        q, k_cache, v_cache = make_cache(batch, lmax)
        ours = bench_ms(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens))
        theirs, label = sdpa_padded(q, k_cache, v_cache, seqlens)
        real = lengths.sum().item() / (batch * lmax)
        rows.append(f"| {batch} | {lmax} | {real:.2f} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | "
                    f"{theirs / ours:.2f}x | {label} |")
        del q, k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


def paged_vs_contiguous(copy_bw, batch=16, capacity=16384):
    rows = ["| layout | time (µs) | K/V GB/s | % of copy |", "|---|---:|---:|---:|"]
    q, k_cache, v_cache = make_cache(batch, capacity)
    seqlens = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
    g = torch.Generator().manual_seed(1)
    layouts = [("contiguous", k_cache, v_cache, None)]
    for page_size in (16, 64, 256):
        pages_per_seq = capacity // page_size
        order = torch.randperm(batch * pages_per_seq, generator=g).to("cuda")
        # page p of the pool holds the keys that the block table maps to it
        k_pages = torch.empty_like(k_cache).view(-1, page_size, NHEADS_K, HEAD_DIM)
        v_pages = torch.empty_like(k_pages)
        k_pages[order] = k_cache.reshape(-1, page_size, NHEADS_K, HEAD_DIM)
        v_pages[order] = v_cache.reshape(-1, page_size, NHEADS_K, HEAD_DIM)
        table = order.view(batch, pages_per_seq).to(torch.int32)
        layouts.append((f"paged, page size {page_size}", k_pages, v_pages, table))
    expected = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens)
    for name, k_c, v_c, table in layouts:
        def run(k_c=k_c, v_c=v_c, table=table):
            return flash_attn_with_kvcache(q, k_c, v_c, cache_seqlens=seqlens, block_table=table)
        torch.testing.assert_close(run(), expected)  # the same keys in the same order
        ms = bench_ms(run)
        bw = kv_bytes(batch * capacity) / (ms * 1e-3)
        rows.append(f"| {name} | {ms * 1e3:.1f} | {bw / 1e9:.0f} | {100 * bw / copy_bw:.0f}% |")
    return [f"batch {batch}, cache length {capacity}", "", *rows]


def tuning(copy_bw):
    rows = ["| batch | cache len | BLOCK_N | warps | stages | splits | time (µs) | % of copy |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    scale = 1 / math.sqrt(HEAD_DIM)
    for batch, capacity in TUNE_SHAPES:
        q, k_cache, v_cache = make_cache(batch, capacity)
        seqlens = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
        default = heuristic_splits(batch, capacity)
        results = []
        for block_n in (32, 64, 128):
            for num_warps in (4, 8):
                for num_stages in (2, 3, 4):
                    config = dict(BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
                    for splits in sorted({1, default, 2 * default, max(1, default // 2)}):
                        def run(config=config, splits=splits):
                            return kvcache_attention_forward(q, k_cache, v_cache, seqlens, None, None,
                                                             AttentionOptions(scale), num_splits=splits, config=config)
                        try:
                            results.append((bench_ms(run), block_n, num_warps, num_stages, splits))
                        except OutOfResources:
                            continue
        results.sort()
        for ms, block_n, num_warps, num_stages, splits in results[:3]:
            bw = kv_bytes(batch * capacity) / (ms * 1e-3)
            rows.append(f"| {batch} | {capacity} | {block_n} | {num_warps} | {num_stages} | {splits} | "
                        f"{ms * 1e3:.1f} | {100 * bw / copy_bw:.0f}% |")
        del q, k_cache, v_cache
        torch.cuda.empty_cache()
    return ["The three fastest (BLOCK_N, warps, stages, splits) per shape; splits tried: 1 and the "
            "heuristic's choice ×½, ×1, ×2.", "", *rows]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="also write the markdown report to this path")
    parser.add_argument("--skip-tuning", action="store_true", help="skip the block-config/split sweep")
    parser.add_argument("--paged-only", action="store_true", help="only the paged-against-contiguous table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_bench needs a CUDA device")
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_bandwidth()
    lines = [
        f"# flashtile decoding on {props.name}, {datetime.date.today()}",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}, {props.multi_processor_count} SMs. "
        f"bf16, head dim {HEAD_DIM}, {NHEADS}:{NHEADS_K} GQA, seqlen_q 1; do_bench medians.",
        f"Copy bandwidth (4 GiB `copy_`, read + write): **{copy_bw / 1e9:.0f} GB/s**.",
        "",
    ]
    if not args.paged_only:
        lines += ["## Decode: K/V bandwidth", "", *decode_sweep(copy_bw), "",
                  "## Ragged cache lengths vs SDPA on the padded batch", "", *ragged_vs_sdpa(), ""]
    lines += ["## Paged vs contiguous cache", "", *paged_vs_contiguous(copy_bw), ""]
    if not args.skip_tuning and not args.paged_only:
        lines += ["## Tuning data", "", *tuning(copy_bw), ""]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
