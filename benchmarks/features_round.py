"""Timings of the eighth session's features on a GPU, peers in the same run (medians of do_bench).

Each case prints one line and goes into ``--out`` (JSON with date, device and versions):

* sink: flash_attn_func bf16 causal (2, 4096, 32:8 heads, d128) with and without learnable_sink,
  forward and forward+backward (the sink's cost; NOTES.md's prediction);
* mla: flash_attn_func 192/128 (2, 4096, 16 heads) causal, forward and forward+backward, against
  SDPA (the backend it picks for v ≠ q head dims);
* mla-decode: absorbed MLA decoding (q/k head dim 576, v the first 512 channels of the same cache,
  one latent head, 16 query heads), batch 16, 16384 cached keys: the cache's bytes per step against
  a device-to-device copy's bandwidth;
* wide: (1, 524288, 32, 128) bf16 causal forward, flashtile (64-bit offsets) against SDPA's flash
  and cuDNN backends (the issue's case; ~12 GiB of inputs), seconds per call, so timed by events
  (one warm-up, three calls);
* scale: (1, 1048576, 32, 128) queries with 8 KV heads, causal, one forward and one backward timed
  by events after a warm-up, and the peak memory of the forward + backward;
* fp8-decode: flash_attn_with_kvcache, batch 16, 8192 cached keys, 32:8 heads, d128, bf16 cache
  against a float8_e4m3fn one (bytes per step halve);
* paged-prefill: flash_attn_varlen_func over a paged cache (pages of 16, 64, 256; by the forward kernel, which
  the call takes, and by the KV-cache kernel) against the contiguous varlen call, 8 sequences of 1024 new
  queries over 4096 keys, causal, then full attention at pages of 16 and 64;
* mixed-batch: a vLLM-style step, 64 sequences with 4k–12k cached keys (page 16), 58 decoding one
  token and 6 prefilling chunks of 512, as one paged flash_attn_varlen_func call, against SDPA on the
  padded equivalent (every sequence padded to the longest chunk and cache, a boolean mask); the batch
  averages 49 queries a sequence, so it takes the KV-cache kernel (``configs.PAGED_PREFILL_MIN_QUERIES``):
  also timed by each kernel explicitly;
* paged-route: 32 sequences of 4096 paged keys (page 64) with 1 to 64 new queries each, by either kernel
  (``configs.PAGED_PREFILL_MIN_QUERIES``'s measure);

    PYTHONPATH=src python benchmarks/features_round.py --out $OUT/features.json
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashtile
from flashtile.triton import configs, plans

BF16 = torch.bfloat16


class paged_route:
    """Within: packed queries against a paged cache take the forward kernel when they average at least
    ``min_queries`` per sequence (``configs.PAGED_PREFILL_MIN_QUERIES``), else the KV-cache kernel."""

    def __init__(self, min_queries):
        self.min_queries = min_queries

    def __enter__(self):
        self.saved, configs.PAGED_PREFILL_MIN_QUERIES = configs.PAGED_PREFILL_MIN_QUERIES, self.min_queries
        plans.clear()  # plans hold the routing decision

    def __exit__(self, *exc):
        configs.PAGED_PREFILL_MIN_QUERIES = self.saved
        plans.clear()


def rand(*shape, dtype=BF16, grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def fwd_bwd(call):
    def run():
        out = call()
        out.backward(torch.ones_like(out))
    return run


def timed(name, fn, results, flops=None):
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    results[name] = dict(ms=ms, tflops=None if flops is None else flops / ms * 1e-9)
    print(f"{name:48s} {ms * 1e3:10.1f} µs" + ("" if flops is None else f"  {flops / ms * 1e-9:7.1f} TFLOP/s"))


def timed_events(name, fn, results, flops, reps=3):
    """For calls of seconds, where do_bench's estimate loop would cost minutes: one warm-up, then
    ``reps`` calls, each timed by CUDA events; the median and all of them are kept."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    results[name] = dict(ms=ms, all_ms=times, tflops=flops / ms * 1e-9)
    print(f"{name:48s} {ms:10.1f} ms  {flops / ms * 1e-9:7.1f} TFLOP/s  (calls: {', '.join(f'{t:.1f}' for t in times)})")


def copy_bandwidth(t):
    """Bytes per second of a device-to-device copy of ``t`` (read + write)."""
    dst = torch.empty_like(t)
    ms = do_bench(lambda: dst.copy_(t), warmup=25, rep=100, return_mode="median")
    return 2 * t.numel() * t.element_size() / ms * 1e3


def sink_cases(results):
    q, k, v = rand(2, 4096, 32, 128, grad=True), rand(2, 4096, 8, 128, grad=True), rand(2, 4096, 8, 128, grad=True)
    sink = torch.zeros(32, device="cuda", requires_grad=True)
    flops = 4 * 2 * 32 * 4096 * 4096 * 128 * 0.5
    for label, kwargs in (("no sink", {}), ("sink", dict(learnable_sink=sink))):
        with torch.no_grad():
            timed(f"sink: fwd {label}", lambda: flashtile.flash_attn_func(q, k, v, causal=True, **kwargs), results,
                  flops)
        timed(f"sink: fwd+bwd {label}", fwd_bwd(lambda: flashtile.flash_attn_func(q, k, v, causal=True, **kwargs)),
              results, 3.5 * flops)


def mla_cases(results):
    q, k = rand(2, 4096, 16, 192, grad=True), rand(2, 4096, 16, 192, grad=True)
    v = rand(2, 4096, 16, 128, grad=True)
    flops = 2 * 2 * 16 * 4096 * 4096 * (192 + 128) * 0.5
    with torch.no_grad():
        timed("mla 192/128: fwd flashtile", lambda: flashtile.flash_attn_func(q, k, v, causal=True), results, flops)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        timed("mla 192/128: fwd sdpa", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), results,
              flops)
    timed("mla 192/128: fwd+bwd flashtile", fwd_bwd(lambda: flashtile.flash_attn_func(q, k, v, causal=True)),
          results, 3.5 * flops)
    timed("mla 192/128: fwd+bwd sdpa", fwd_bwd(lambda: F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)), results, 3.5 * flops)


def wide_cases(results):
    q, k, v = (rand(1, 524288, 32, 128) for _ in range(3))
    flops = 4 * 32 * 524288 * 524288 * 128 * 0.5
    with torch.no_grad():
        timed_events("wide (1, 524288, 32, 128): fwd flashtile",
                     lambda: flashtile.flash_attn_func(q, k, v, causal=True), results, flops)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                with sdpa_kernel(backend):
                    timed_events(f"wide (1, 524288, 32, 128): fwd sdpa {backend.name}",
                                 lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), results, flops)
            except RuntimeError as error:
                results[f"wide: sdpa {backend.name}"] = dict(error=str(error)[:200])


def scale_cases(results):
    seqlen = 1048576
    q = rand(1, seqlen, 32, 128, grad=True)
    k, v = rand(1, seqlen, 8, 128, grad=True), rand(1, seqlen, 8, 128, grad=True)
    dout = torch.randn_like(q)
    flops = 4 * 32 * seqlen * seqlen * 128 * 0.5
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    inputs = torch.cuda.memory_allocated()
    start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    for attempt in ("warm-up", "timed"):
        start.record()
        out = flashtile.flash_attn_func(q, k, v, causal=True)
        middle.record()
        out.backward(dout)
        end.record()
        torch.cuda.synchronize()
        q.grad = k.grad = v.grad = None
        del out
    fwd_ms, bwd_ms = start.elapsed_time(middle), middle.elapsed_time(end)
    peak = torch.cuda.max_memory_allocated()
    results["scale (1, 1048576, 32:8, 128) causal"] = dict(
        fwd_ms=fwd_ms, bwd_ms=bwd_ms, fwd_tflops=flops / fwd_ms * 1e-9, bwd_tflops=2.5 * flops / bwd_ms * 1e-9,
        inputs_gib=inputs / 2**30, peak_gib=peak / 2**30)
    print(f"scale (1, 1048576, 32:8, 128) causal: fwd {fwd_ms / 1e3:.2f} s ({flops / fwd_ms * 1e-9:.1f} TFLOP/s), "
          f"bwd {bwd_ms / 1e3:.2f} s ({2.5 * flops / bwd_ms * 1e-9:.1f} TFLOP/s), peak {peak / 2**30:.1f} GiB "
          f"(q, k, v, dO: {inputs / 2**30:.1f} GiB)")


def mla_decode_cases(results):
    batch, capacity, nheads = 16, 16384, 16
    q = rand(batch, 1, nheads, 576)
    cache = rand(batch, capacity, 1, 576)
    seqlens = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
    with torch.no_grad():
        timed("mla-decode 576/512: flashtile", lambda: flashtile.flash_attn_with_kvcache(
            q, cache, cache[..., :512], cache_seqlens=seqlens, softmax_scale=192 ** -0.5), results)
    name = "mla-decode 576/512: flashtile"
    bandwidth = cache.numel() * cache.element_size() / results[name]["ms"] * 1e3
    copy = copy_bandwidth(cache)
    results[name].update(cache_bytes_per_s=bandwidth, copy_bytes_per_s=copy, fraction_of_copy=bandwidth / copy)
    print(f"{'':48s} cache read at {bandwidth / 1e12:.2f} TB/s; copy {copy / 1e12:.2f} TB/s: {bandwidth / copy:.2f}")


def fp8_decode_cases(results):
    batch, capacity = 16, 8192
    q = rand(batch, 1, 32, 128)
    cache, v_cache = rand(batch, capacity, 8, 128), rand(batch, capacity, 8, 128)
    seqlens = torch.full((batch,), capacity, dtype=torch.int32, device="cuda")
    scales = torch.ones(batch, 8, device="cuda")
    cache8, v_cache8 = cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    with torch.no_grad():
        timed("fp8-decode: bf16 cache", lambda: flashtile.flash_attn_with_kvcache(q, cache, v_cache,
                                                                                    cache_seqlens=seqlens), results)
        timed("fp8-decode: float8_e4m3fn cache", lambda: flashtile.flash_attn_with_kvcache(
            q, cache8, v_cache8, cache_seqlens=seqlens, k_descale=scales, v_descale=scales), results)
    for name, c in (("fp8-decode: bf16 cache", cache), ("fp8-decode: float8_e4m3fn cache", cache8)):
        # k and v are tensors of their own (one tensor for both read V from L2 in the ninth session): twice
        # the bytes of one per step
        bandwidth = 2 * c.numel() * c.element_size() / results[name]["ms"] * 1e3
        copy = copy_bandwidth(c)
        results[name].update(cache_bytes_per_s=bandwidth, copy_bytes_per_s=copy, fraction_of_copy=bandwidth / copy)
        print(f"{name:48s} cache read at {bandwidth / 1e12:.2f} TB/s; copy {copy / 1e12:.2f} TB/s: {bandwidth / copy:.2f}")


def paged_prefill_cases(results):
    batch, new, keys = 8, 1024, 4096
    q = rand(batch * new, 32, 128)
    k, v = rand(batch * keys, 8, 128), rand(batch * keys, 8, 128)
    cu_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * new
    cu_k = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * keys
    flops = 4 * batch * 32 * new * keys * 128 * 0.5  # causal: roughly half of the rectangle's work

    def paged(page):
        """k and v as caches of ``page``-key pages, and a block table that shuffles them."""
        pages = keys // page
        table = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
        return k.view(batch * pages, page, 8, 128), v.view(batch * pages, page, 8, 128), table

    with torch.no_grad():
        timed("paged-prefill: contiguous varlen", lambda: flashtile.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, new, keys, causal=True), results, flops)
        for page in (16, 64, 256):
            k_cache, v_cache, table = paged(page)
            timed(f"paged-prefill: paged (page {page})", lambda: flashtile.flash_attn_varlen_func(
                q, k_cache, v_cache, cu_q, cu_k, new, keys, causal=True, block_table=table), results, flops)
            with paged_route(2**31):
                timed(f"paged-prefill: paged (page {page}), KV-cache kernel", lambda: flashtile.flash_attn_varlen_func(
                    q, k_cache, v_cache, cu_q, cu_k, new, keys, causal=True, block_table=table), results, flops)
        # full attention (a cascade's shared-prefix call) takes 128-key blocks at head dim 128: pages of 16 span
        # 8 pages a block, the case configs.paged_fwd_config narrows to 4 pages
        timed("paged-prefill: contiguous varlen (full)", lambda: flashtile.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, new, keys), results, 2 * flops)
        for page in (16, 64):
            k_cache, v_cache, table = paged(page)
            timed(f"paged-prefill: paged (page {page}, full)", lambda: flashtile.flash_attn_varlen_func(
                q, k_cache, v_cache, cu_q, cu_k, new, keys, block_table=table), results, 2 * flops)


def mixed_batch_cases(results):
    g = torch.Generator().manual_seed(0)
    batch, page, nheads, nheads_k, head_dim = 64, 16, 32, 8, 128
    new = torch.tensor([512 if b % 11 == 0 else 1 for b in range(batch)])  # 6 prefill chunks, 58 decode rows
    used = torch.randint(4096, 12289, (batch,), generator=g)  # keys per sequence, the new ones included
    pages = (used + page - 1) // page
    q = rand(int(new.sum()), nheads, head_dim)
    k_cache, v_cache = rand(int(pages.sum()), page, nheads_k, head_dim), rand(int(pages.sum()), page, nheads_k, head_dim)
    table = torch.zeros(batch, int(pages.max()), dtype=torch.int32)
    order = torch.randperm(int(pages.sum()), generator=g).to(torch.int32)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), pages.cumsum(0)])
    for b in range(batch):
        table[b, : pages[b]] = order[starts[b]: starts[b + 1]]
    table = table.cuda()
    cu_q = torch.cat([torch.zeros(1, dtype=torch.long), new.cumsum(0)]).to("cuda", torch.int32)
    seqused = used.to("cuda", torch.int32)
    # the padded equivalent: q [B, H, max_new, D], k/v [B, H, max_used, D] gathered from the pages
    max_new, max_used = int(new.max()), int(used.max())
    qp = torch.zeros(batch, max_new, nheads, head_dim, dtype=BF16, device="cuda")
    kp = torch.zeros(batch, max_used, nheads_k, head_dim, dtype=BF16, device="cuda")
    vp = torch.zeros_like(kp)
    mask = torch.zeros(batch, 1, max_new, max_used, dtype=torch.bool, device="cuda")
    for b in range(batch):
        n, u = int(new[b]), int(used[b])
        qp[b, :n] = q[int(cu_q[b]): int(cu_q[b]) + n]
        slots = table[b, : pages[b]].long()
        kp[b, :u] = k_cache[slots].flatten(0, 1)[:u]
        vp[b, :u] = v_cache[slots].flatten(0, 1)[:u]
        rows = torch.arange(max_new, device="cuda")[:, None]
        cols = torch.arange(max_used, device="cuda")[None, :]
        mask[b, 0] = (cols <= rows + u - n) & (cols < u) & (rows < n)  # bottom-right causal per sequence
    mask[:, :, :, 0] |= ~mask.any(-1)  # padded query rows: one visible key, so SDPA gives no NaN
    qt = qp.transpose(1, 2)
    kt, vt = (t.transpose(1, 2).repeat_interleave(nheads // nheads_k, dim=1) for t in (kp, vp))
    with torch.no_grad():
        timed("mixed-batch: flashtile paged varlen", lambda: flashtile.flash_attn_varlen_func(
            q, k_cache, v_cache, cu_q, None, max_new, max_used, causal=True, block_table=table,
            seqused_k=seqused), results)
        for route, min_queries in (("forward kernel", 1), ("KV-cache kernel", 2**31)):
            with paged_route(min_queries):
                timed(f"mixed-batch: flashtile paged varlen, {route}", lambda: flashtile.flash_attn_varlen_func(
                    q, k_cache, v_cache, cu_q, None, max_new, max_used, causal=True, block_table=table,
                    seqused_k=seqused), results)
        timed("mixed-batch: sdpa padded", lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask),
              results)
    ours = flashtile.flash_attn_varlen_func(q, k_cache, v_cache, cu_q, None, max_new, max_used, causal=True,
                                            block_table=table, seqused_k=seqused)
    theirs = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask).transpose(1, 2)
    error = max((ours[int(cu_q[b]): int(cu_q[b + 1])].float() - theirs[b, : int(new[b])].float()).abs().max().item()
                for b in range(batch))
    results["mixed-batch: max |flashtile - sdpa|"] = error
    print(f"{'mixed-batch: max |flashtile - sdpa|':48s} {error:.2e}")


def paged_route_cases(results):
    batch, keys, page = 32, 4096, 64
    k_cache, v_cache = rand(batch * keys // page, page, 8, 128), rand(batch * keys // page, page, 8, 128)
    table = torch.randperm(batch * keys // page, device="cuda").to(torch.int32).view(batch, keys // page)
    seqused = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    for new in (1, 4, 8, 16, 32, 64):
        q = rand(batch * new, 32, 128)
        cu_q = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * new
        for route, min_queries in (("forward kernel", 1), ("KV-cache kernel", 2**31)):
            with paged_route(min_queries), torch.no_grad():
                timed(f"paged-route: {new:2d} queries a sequence, {route}", lambda: flashtile.flash_attn_varlen_func(
                    q, k_cache, v_cache, cu_q, None, new, keys, causal=True, block_table=table, seqused_k=seqused),
                    results)


CASES = {"sink": sink_cases, "mla": mla_cases, "mla-decode": mla_decode_cases, "fp8-decode": fp8_decode_cases,
         "paged-prefill": paged_prefill_cases, "mixed-batch": mixed_batch_cases, "paged-route": paged_route_cases, "wide": wide_cases,
         "scale": scale_cases}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = dict(date=datetime.date.today().isoformat(), device=torch.cuda.get_device_name(),
                   torch=torch.__version__, triton=triton.__version__)
    for case in args.cases:
        CASES[case](results)
        torch.cuda.empty_cache()
        if args.out:  # after each case: a run cut short keeps what it measured
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
