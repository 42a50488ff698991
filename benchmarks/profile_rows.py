"""One forward and one backward of flashtile and of SDPA cuDNN per case, inside a CUDA profiler range,
for Nsight Compute to read the hardware counters of each kernel: the profiles behind NOTES.md's
explanation of the bar rows still short.

    ncu --clock-control none --profile-from-start off --set detailed --csv --page raw \
        python3 benchmarks/profile_rows.py [--cases d128-16384,d64c-2048] > rows.csv

A case is ``d<head dim>[c]-<seqlen>`` (``c``: causal) on the standard shapes: bf16,
batch·seqlen = 16384, nheads·head dim = 2048. Everything before the range (allocation, compilation,
warm-up calls) is left out of the profile.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtile import flash_attn_func

DEFAULT_CASES = "d128-16384,d128c-16384,d64-16384,d64c-16384,d128c-1024,d64-1024,d64c-2048"


def parse_case(case: str) -> tuple[int, bool, int]:
    dims, seqlen = case.split("-")
    return int(dims[1:].rstrip("c")), dims.endswith("c"), int(seqlen)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=DEFAULT_CASES)
    args = parser.parse_args(argv)
    for case in args.cases.split(","):
        head_dim, causal, seqlen = parse_case(case)
        batch, nheads = max(1, 16384 // seqlen), 2048 // head_dim
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        doutt = dout.transpose(1, 2)
        scale = 1 / math.sqrt(head_dim)

        def flashtile_step():
            flash_attn_func(q, k, v, softmax_scale=scale, causal=causal).backward(dout)

        def cudnn_step():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(qt, kt, vt, scale=scale, is_causal=causal).backward(doutt)

        for step in (flashtile_step, cudnn_step):
            for _ in range(3):  # compile and warm up outside the profiled range
                step()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push(f"{step.__name__.removesuffix('_step')} {case}")
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            torch.cuda.nvtx.range_pop()
        print(f"profiled {case}", flush=True)


if __name__ == "__main__":
    main()
