"""Block configurations of the KV-cache kernel where decoding is short of the copy bandwidth (a tuning aid).

The ninth session's round read a float8 cache at 0.48 of the copy bandwidth (no faster than bf16,
which reads twice the bytes at 0.95) and absorbed MLA (576/512) at 0.56. Both use the bf16 table of
``configs.decode_config``: a float8 tile of 64 keys is half the bytes in flight per stage, and the
MLA blocks were never tuned on a GPU. This times each candidate (BLOCK_N, num_warps, num_stages; BLOCK_M
as the table has it) for each case, the split count by the heuristic, and prints the cache's read
bandwidth against a copy of the same bytes in the same run. (The tenth session's run read K and V
from one tensor; V is now a tensor of its own except for MLA, whose V is part of the latent.)

    python benchmarks/decode_tune.py --out tune_decode.json [--cases "float8_e4m3fn d128"] [--splits 0,4,8]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

from flashtile._options import AttentionOptions
from flashtile.cli.bench import environment
from flashtile.triton import configs
from flashtile.triton.launch import kvcache_attention_forward

# (name, batch, cached keys, query heads, KV heads, head dim of q/k, of v, cache dtype)
CASES = [
    ("bf16 d128", 16, 8192, 32, 8, 128, 128, torch.bfloat16),
    ("float8_e4m3fn d128", 16, 8192, 32, 8, 128, 128, torch.float8_e4m3fn),
    ("MLA 576/512 bf16", 16, 16384, 128, 1, 576, 512, torch.bfloat16),
]
BLOCK_N, NUM_WARPS, NUM_STAGES = (32, 64, 128, 256), (4, 8), (2, 3, 4)


def _copy_bandwidth(t: torch.Tensor) -> float:
    dst = torch.empty_like(t)
    ms = do_bench(lambda: dst.copy_(t), warmup=5, rep=40)
    return 2 * t.numel() * t.element_size() / ms * 1e3


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--cases", nargs="*", default=[case[0] for case in CASES], help="names as in CASES")
    parser.add_argument("--splits", default="0", help="split counts to try, comma-separated (0: the heuristic's)")
    args = parser.parse_args(argv)
    split_counts = [int(s) for s in args.splits.split(",")]
    records = []
    for name, batch, keys, nheads, nheads_k, head_dim, head_dim_v, dtype in CASES:
        if name not in args.cases:
            continue
        q = torch.randn(batch, 1, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
        k_cache = torch.randn(batch, keys, nheads_k, head_dim, device="cuda").to(dtype)
        # absorbed MLA: V is the first 512 channels of the latent (one tensor, as engines store it);
        # otherwise a V of its own, so that the step reads both from DRAM
        v_cache = (k_cache[..., :head_dim_v] if head_dim_v < head_dim
                   else torch.randn(batch, keys, nheads_k, head_dim_v, device="cuda").to(dtype))
        seqlens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        scales = torch.ones(batch, nheads_k, device="cuda") if dtype != torch.bfloat16 else None
        options = AttentionOptions(head_dim ** -0.5)
        cache_bytes = k_cache.numel() * k_cache.element_size() * (1 if head_dim_v < head_dim else 2)
        copy = _copy_bandwidth(k_cache)
        default = configs.decode_config(max(head_dim, head_dim_v), q.dtype, nheads // nheads_k)
        print(f"{name}: cache {cache_bytes / 1e9:.2f} GB per step, copy {copy / 1e12:.2f} TB/s, default {default}")
        for block_n, warps, stages, splits in itertools.product(BLOCK_N, NUM_WARPS, NUM_STAGES, split_counts):
            config = dict(default, BLOCK_N=block_n, num_warps=warps, num_stages=stages)

            def step():
                kvcache_attention_forward(q, k_cache, v_cache, seqlens, None, None, options, config=config,
                                          k_descale=scales, v_descale=scales, num_splits=splits)
            try:
                ms = do_bench(step, warmup=5, rep=30)
            except OutOfResources:
                continue
            fraction = cache_bytes / ms * 1e3 / copy
            is_default = splits == 0 and all(config[key] == default[key] for key in config)
            records.append(dict(case=name, config=config, splits=splits, us=ms * 1e3, fraction_of_copy=fraction,
                                default=is_default))
            print(f"  BLOCK_N {block_n:3d} warps {warps} stages {stages} splits {splits or 'heuristic'}: {ms * 1e3:8.1f} µs  "
                  f"{fraction:.2f} of copy{'  (default)' if is_default else ''}")
        best = max((r for r in records if r["case"] == name), key=lambda r: r["fraction_of_copy"])
        print(f"  best: {best['config']} splits {best['splits'] or 'heuristic'}: {best['us']:.1f} µs, "
              f"{best['fraction_of_copy']:.2f} of copy")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment("cuda"), records=records), f, indent=1)


if __name__ == "__main__":
    main()
