"""Forward with descriptor (TMA) loads against pointer loads at each seqlen, in one run: the data
for ``flashtile.triton.configs.TMA_MIN_SEQLEN`` (benchmarks/NOTES.md, v0.4).

Each load path runs with its own configs (the launcher picks them). The Triton forward is timed
throughout: the Gluon forward, which the launcher would take at head dim 128 and at 64 from
``configs.GLUON_MIN_SEQLEN``, is switched off for the run. The standard shapes: bf16,
batch·seqlen = 16384, nheads·headdim = 2048; launchers alone; do_bench medians.

    PYTHONPATH=src python3 benchmarks/tma_threshold.py [--seqlens 512,1024,...] [--out tma.json]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import triton

from flashtile._options import AttentionOptions, AttentionTensors
from flashtile.triton import configs, launch
from flashtile.cli.bench import environment

ALWAYS, NEVER = 1, 1 << 62  # TMA_MIN_SEQLEN values that force each path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--rep", type=int, default=50)
    parser.add_argument("--out", help="write every measurement as JSON here")
    args = parser.parse_args(argv)
    default = configs.TMA_MIN_SEQLEN
    configs.GLUON_MIN_SEQLEN = {}  # the Triton kernel at every shape: its two load paths are what is compared
    records = []
    for head_dim in (int(d) for d in args.headdims.split(",")):
        for causal in (False, True):
            print(f"\nhdim {head_dim} {'causal' if causal else 'non-causal'}: forward TFLOP/s, pointers / descriptors")
            for seqlen in (int(n) for n in args.seqlens.split(",")):
                batch, nheads = max(1, 16384 // seqlen), 2048 // head_dim
                q, k, v = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                flops = 4 * batch * nheads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
                options = AttentionOptions(1 / math.sqrt(head_dim), window_right=0 if causal else -1)
                tflops = {}
                for path, threshold in (("pointers", NEVER), ("descriptors", ALWAYS)):
                    configs.TMA_MIN_SEQLEN = threshold
                    try:
                        ms = triton.testing.do_bench(
                            lambda: launch.attention_forward(q, k, v, options, AttentionTensors()),
                            rep=args.rep, return_mode="median")
                    finally:
                        configs.TMA_MIN_SEQLEN = default
                    tflops[path] = flops / ms / 1e9
                    records.append(dict(head_dim=head_dim, causal=causal, seqlen=seqlen, path=path, ms=ms,
                                        tflops=tflops[path]))
                print(f"  N={seqlen:>6}  {tflops['pointers']:6.1f} / {tflops['descriptors']:6.1f}"
                      f"  ({tflops['descriptors'] / tflops['pointers']:.2f}x)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment("cuda"), records=records), f, indent=1)


if __name__ == "__main__":
    main()
