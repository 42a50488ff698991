"""Sweep the block configurations of flashtile's kernels on the GPU (a tuning aid, not the benchmark).

For each case (bf16, batch·seqlen = 16384, nheads·headdim = 2048, as the standard sweep) it times the
forward launcher and the backward launcher alone (``triton.testing.do_bench`` medians) for each
candidate (BLOCK_M, BLOCK_N, num_warps, num_stages), with the launchers' config tables patched and the
Gluon kernels switched off (the Triton ones are what the tables configure), and
prints TFLOP/s per candidate with the current default marked (for the two backward kernels, the
time of the whole backward with the other kernel at its default).
(A before/after of two trees is ``flashtile bench --compare``.)

    python benchmarks/tune_configs.py --seqlen 8192 --out tune.json [--defaults-only]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing

import torch
import triton

from flashtile._options import AttentionOptions, AttentionTensors
from flashtile.triton import configs, launch, plans
from flashtile.cli.bench import environment

# (BLOCK_M, BLOCK_N, num_warps, num_stages) candidates by head-dim class: tiles wider than 128
# need smaller blocks and fewer stages to fit in shared memory. The backward's two kernels are
# swept one at a time, the other keeping its default (their times add up).
FWD_CANDIDATES = {
    128: [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 4),
          (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3)],
    256: [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (64, 64, 8, 2), (128, 64, 8, 1), (64, 32, 4, 3)],
}
DKDV_CANDIDATES = {
    128: [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 4, 2), (32, 128, 8, 3), (64, 128, 8, 2),
          (64, 128, 8, 3), (128, 128, 8, 2), (16, 128, 4, 3)],
    256: [(32, 32, 4, 1), (32, 64, 4, 1), (64, 32, 4, 1), (64, 64, 8, 1), (32, 32, 4, 2), (64, 64, 4, 1),
          (16, 64, 4, 2), (32, 64, 8, 2), (16, 64, 4, 3), (16, 128, 4, 2), (16, 64, 8, 2), (16, 32, 4, 2),
          (32, 64, 4, 2)],
}
DQ_CANDIDATES = {
    128: [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3), (128, 64, 4, 2),
          (128, 128, 8, 2), (64, 128, 4, 2)],
    256: [(32, 32, 4, 1), (64, 32, 4, 1), (64, 64, 8, 1), (32, 64, 4, 1), (64, 32, 4, 2), (128, 32, 8, 1),
          (64, 16, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2), (128, 32, 8, 2), (32, 32, 4, 2)],
}


def _config(c):
    return dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3])


def _inputs(seqlen, head_dim, causal):
    batch, nheads = max(1, 16384 // seqlen), 2048 // head_dim
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    flops = 4 * batch * nheads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return q, k, v, do, flops


def _time(fn, warmup, rep):
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _sweeps(head_dim, causal, seqlen, defaults_only):
    """(mode, candidate, is_default, config patch) for every launch to time in one case."""
    padded = configs.block_d(head_dim)
    size = 128 if padded <= 128 else 256
    tma = seqlen >= configs.TMA_MIN_SEQLEN  # the standard shapes are unpacked, aligned, Nq = Nk
    fwd = tuple(configs.fwd_config(padded, torch.bfloat16, causal, tma=tma).values())
    dkdv, dq = (tuple(c.values()) for c in configs.bwd_configs(head_dim, head_dim, torch.bfloat16))
    plans = (
        ("fwd", fwd, FWD_CANDIDATES[size], lambda c: ("fwd_config", _config(c))),
        ("dkdv", dkdv, DKDV_CANDIDATES[size], lambda c: ("bwd_configs", (_config(c), _config(dq)))),
        ("dq", dq, DQ_CANDIDATES[size], lambda c: ("bwd_configs", (_config(dkdv), _config(c)))),
    )
    for mode, current, candidates, patch in plans:
        for cand in [current] if defaults_only else [current] + [c for c in candidates if c != current]:
            yield mode, cand, cand == current, patch(cand)


def _launch(mode, patch, q, k, v, do, out, lse, options):
    """A function running one launcher with its config table patched to one candidate."""
    name, cfg = patch
    grads = [torch.empty_like(t) for t in (q, k, v)]
    # the launchers replay the launch plan recorded at a call key's first call, without asking the config
    # tables again: without this every candidate would time the first one's kernels
    plans.clear()

    def run():
        default, gluon_thresholds = getattr(configs, name), configs.GLUON_MIN_SEQLEN
        setattr(configs, name, lambda *_, **__: cfg)
        # the Triton kernels whose tables are patched: not the Gluon forward, nor the fused backward
        # (``deterministic`` takes the Triton one)
        configs.GLUON_MIN_SEQLEN = {}
        try:
            if mode == "fwd":
                launch.attention_forward(q, k, v, options, AttentionTensors())
            else:
                launch.attention_backward(do, q, k, v, out, lse, options._replace(deterministic=True),
                                          AttentionTensors(), *grads)
        finally:
            setattr(configs, name, default)
            configs.GLUON_MIN_SEQLEN = gluon_thresholds

    return run


def _options(head_dim, causal):
    return AttentionOptions(1 / math.sqrt(head_dim), window_right=0 if causal else -1)


def _compile_case(head_dim, causal, seqlen, defaults_only):
    """Compile every candidate of one case at a short seqlen (the same specialisation as the timed
    shape), so that the timing pass finds them in Triton's cache; run in worker processes."""
    # the forward's load path depends on the seqlen: compile at the smallest one that takes the same path
    q, k, v, do, _ = _inputs(configs.TMA_MIN_SEQLEN if seqlen >= configs.TMA_MIN_SEQLEN else 256, head_dim, causal)
    options = _options(head_dim, causal)
    out, lse = launch.attention_forward(q, k, v, options, AttentionTensors())
    for mode, _, _, patch in _sweeps(head_dim, causal, seqlen, defaults_only):
        try:
            _launch(mode, patch, q, k, v, do, out, lse, options)()
        except Exception:  # reported by the timing pass
            pass


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--headdims", default="64,128")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rep", type=int, default=40)
    parser.add_argument("--jobs", type=int, default=1, help="compile the candidates in this many processes first")
    parser.add_argument("--defaults-only", action="store_true",
                        help="time only the current default configs")
    parser.add_argument("--out", help="write every measurement as JSON here")
    args = parser.parse_args(argv)
    cases = [(int(d), causal) for d in args.headdims.split(",") for causal in (False, True)]
    if args.jobs > 1:
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_compile_case, *zip(*cases), [args.seqlen] * len(cases), [args.defaults_only] * len(cases)))
    records = []
    for head_dim, causal in cases:
        q, k, v, do, flops = _inputs(args.seqlen, head_dim, causal)
        options = _options(head_dim, causal)
        out, lse = launch.attention_forward(q, k, v, options, AttentionTensors())
        case = f"d{head_dim} {'causal' if causal else 'full'} N={args.seqlen}"
        rows = []
        for mode, cand, is_default, patch in _sweeps(head_dim, causal, args.seqlen, args.defaults_only):
            try:
                ms = _time(_launch(mode, patch, q, k, v, do, out, lse, options), args.warmup, args.rep)
                tflops = flops * (1.0 if mode == "fwd" else 2.5) / ms / 1e9
            except Exception as error:  # out of shared memory / registers for this shape
                ms, tflops = float("nan"), float("nan")
                print(f"{case} {mode} {cand}: {type(error).__name__}: {str(error)[:120]}")
            rows.append((mode, cand, ms, tflops, is_default))
            records.append(dict(case=case, mode=mode, config=cand, ms=ms, tflops=tflops, default=is_default))
        print(f"\n{case}")
        for mode, cand, ms, tflops, is_default in rows:
            print(f"  {mode:>4} {str(cand):>18} {ms:8.3f} ms {tflops:7.1f} TFLOP/s{'  <- default' if is_default else ''}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(environment=environment("cuda"), records=records), f, indent=1)


if __name__ == "__main__":
    main()
