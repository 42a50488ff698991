"""The ring machinery's per-step overhead: ring attention on a world of one GPU vs plain flashtile.

    python benchmarks/ring_overhead.py --out benchmarks/results/ring_overhead_h200.md

A single-process NCCL group (world size 1) runs ``ring_flash_attn_func`` with its whole
machinery except the messages and the merges, which need a second rank: the stacked K/V,
the float32 accumulators of out, dQ and dK/dV and their casts, the per-block slicing and
the autograd Function. The difference to ``flash_attn_func`` on the same inputs is what
every ring step pays on top of its attention. (Zigzag causal is the diagonal block alone
at W = 1, so it is timed too.)

Cases: bf16, head dim 128, 16 heads (nheads·hdim = 2048), batch·seqlen = 16384 tokens
(batch 1 from 16k), seqlen 4k / 16k / 32k, causal (zigzag) and not. Forward and
forward+backward times are ``triton.testing.do_bench`` medians on random inputs, both
implementations timed in the same run; TFLOP/s = 4·B·H·N²·D (×0.5 causal; backward ×2.5);
peak memory is the caching allocator's peak over one forward+backward beyond the inputs.
Runs in about a minute on an H200.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile

import torch
import torch.distributed as dist
import triton
from triton.testing import do_bench

import flashtile
from flashtile.distributed import ring_flash_attn_func

NHEADS, HEAD_DIM, DTYPE, TOKENS = 16, 128, torch.bfloat16, 16384
SEQLENS = [4096, 16384, 32768]


def bench_ms(fn, grad_to_none=None) -> float:
    return do_bench(fn, warmup=10, rep=50, grad_to_none=grad_to_none, return_mode="median")


def tflops(batch: int, seqlen: int, causal: bool, ms: float, backward: bool) -> float:
    flops = 4 * batch * NHEADS * seqlen * seqlen * HEAD_DIM * (0.5 if causal else 1.0) * (3.5 if backward else 1.0)
    return flops / ms * 1e-9


def implementations(causal: bool):
    return {
        "flashtile": lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal),
        "ring": lambda q, k, v: ring_flash_attn_func(q, k, v, causal=causal, layout="zigzag"),
    }


def measure(batch: int, seqlen: int, causal: bool, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seqlen)
    q, k, v, dout = (torch.randn(batch, seqlen, NHEADS, HEAD_DIM, generator=g, device=device, dtype=DTYPE)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    row = {}
    for name, attend in implementations(causal).items():
        def forward():
            with torch.no_grad():
                attend(q, k, v)

        def forward_backward():
            attend(q, k, v).backward(dout)

        q.grad = k.grad = v.grad = None
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        forward_backward()
        torch.cuda.synchronize(device)
        row[name] = {
            "fwd_ms": bench_ms(forward),
            "fwd_bwd_ms": bench_ms(forward_backward, grad_to_none=[q, k, v]),
            "peak_mib": (torch.cuda.max_memory_allocated(device) - baseline) / 2**20,
        }
    return row


def table(rows) -> str:
    lines = [
        "| seqlen | batch | causal | fwd ms flashtile / ring | fwd+bwd ms flashtile / ring | fwd+bwd overhead "
        "| fwd+bwd TFLOP/s flashtile / ring | peak MiB flashtile / ring |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (batch, seqlen, causal), row in rows:
        plain, ring = row["flashtile"], row["ring"]
        overhead = ring["fwd_bwd_ms"] / plain["fwd_bwd_ms"] - 1
        lines.append(
            f"| {seqlen} | {batch} | {'zigzag' if causal else 'no'} "
            f"| {plain['fwd_ms']:.3f} / {ring['fwd_ms']:.3f} "
            f"| {plain['fwd_bwd_ms']:.3f} / {ring['fwd_bwd_ms']:.3f} | {overhead:+.1%} "
            f"| {tflops(batch, seqlen, causal, plain['fwd_bwd_ms'], True):.0f} / "
            f"{tflops(batch, seqlen, causal, ring['fwd_bwd_ms'], True):.0f} "
            f"| {plain['peak_mib']:.0f} / {ring['peak_mib']:.0f} |"
        )
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the markdown report to this path")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            rows = []
            for seqlen in SEQLENS:
                for causal in (False, True):
                    batch = max(1, TOKENS // seqlen)
                    rows.append(((batch, seqlen, causal), measure(batch, seqlen, causal, device)))
                    print(f"seqlen {seqlen} causal {causal}: done", flush=True)
        finally:
            dist.destroy_process_group()
    report = "\n".join([
        "# Ring attention overhead at world size 1 (one GPU, NCCL group of one)",
        "",
        f"{datetime.date.today()} · {torch.cuda.get_device_name(device)} · torch {torch.__version__} · "
        f"triton {triton.__version__} · bf16, hdim {HEAD_DIM}, {NHEADS} heads, do_bench medians",
        "",
        table(rows),
        "",
    ])
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
