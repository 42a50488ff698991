"""The attention kernels alone at the standard shapes, N = 512–16384: the Gluon forward (with its shipped grid
policy and, where this tree has ``sm90_fwd.persistent``, always and never persistent; since ``sm90_fwd.consumers``
the two grids also differ at head dim 64 in their consumers, two persistent and three per tile) and the fused
backward, the Triton forward, and SDPA's cuDNN backend, each timed in a CUDA graph
(``triton.testing.do_bench_cudagraph``) so that the host's time per call stays out of the figures (at
N = 512 a call's Python is about as long as its kernels). The backward is (forward + backward) − forward,
each timed so.

Run once per tree (``PYTHONPATH=<tree>/src``) to compare trees: cuDNN is timed in each run, so the
ratios compare across runs; the absolute figures only within one. Prints a table, writes JSON with
``--out``.
"""

import argparse
import json
import math

import torch
import triton
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.gluon import sm90_fwd
from flashtile.triton import configs, plans

SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
TOKENS = 16384  # batch · seqlen, as `flashtile bench`'s sweep
NHEADS = {64: 32, 128: 16}


def _rate(ms: float, batch: int, nheads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    flops = 4 * batch * nheads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    return flops / ms / 1e9  # TFLOP/s


def _time(fn, rep: int) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def _configure(gluon_min_seqlen, persistent):
    """The launchers' policy for the next timings: the Gluon forward's thresholds and grid policy."""
    configs.GLUON_MIN_SEQLEN = gluon_min_seqlen
    if persistent is not None:
        sm90_fwd.persistent = persistent
    plans.clear()


def _flashtile(q, k, v, do, causal):
    """(forward, forward + backward) of flashtile."""
    def forward():
        with torch.no_grad():
            flashtile.flash_attn_func(q, k, v, causal=causal)

    return forward, lambda: torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v), do)


def _sdpa(q, k, v, do, causal):
    def forward():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return forward, lambda: torch.autograd.grad(
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), do)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="tree")
    parser.add_argument("--rep", type=int, default=40, help="ms of repeats per figure")
    parser.add_argument("--seqlens", default=",".join(map(str, SEQLENS)))
    parser.add_argument("--out")
    args = parser.parse_args()
    shipped_thresholds = dict(configs.GLUON_MIN_SEQLEN)
    gluon_everywhere = {key: 1 for key in shipped_thresholds}
    shipped_policy = getattr(sm90_fwd, "persistent", None)
    rows = []
    print(f"{args.label}: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("TFLOP/s fwd / bwd (kernels in CUDA graphs, medians)")
    print(f"{'case':<20}{'gluon':>12}{'persistent':>12}{'tile':>12}{'triton':>8}{'cudnn':>12}  gluon/cudnn"
          "  triton/cudnn")
    for head_dim in (64, 128):
        for causal in (False, True):
            for seqlen in map(int, args.seqlens.split(",")):
                batch, nheads = TOKENS // seqlen, NHEADS[head_dim]
                g = torch.Generator(device="cuda").manual_seed(seqlen + head_dim)
                q, k, v, do = (torch.randn(batch, seqlen, nheads, head_dim, device="cuda", generator=g,
                                           dtype=torch.bfloat16) for _ in range(4))
                q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
                qt, kt, vt, dot = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v, do))
                forward, forward_backward = _flashtile(q, k, v, do, causal)
                policies = {"gluon": (gluon_everywhere, shipped_policy)}
                if shipped_policy is not None:  # the kernel on a persistent grid, and on a CTA per tile
                    policies["persistent"] = (gluon_everywhere, lambda seqlen_k, *_: True)
                    policies["tile"] = (gluon_everywhere, lambda seqlen_k, *_: False)
                figures = {}
                for name, policy in policies.items():
                    _configure(*policy)
                    figures[name] = (_time(forward, args.rep), _time(forward_backward, args.rep))
                _configure({}, shipped_policy)  # the Triton forward
                figures["triton"] = (_time(forward, args.rep), None)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    forward, forward_backward = _sdpa(qt, kt, vt, dot, causal)
                    figures["cudnn"] = (_time(forward, args.rep), _time(forward_backward, args.rep))
                _configure(shipped_thresholds, shipped_policy)
                fwd_rates, bwd_rates = {}, {}
                for name, (fwd_ms, fwd_bwd_ms) in figures.items():
                    fwd_rates[name] = _rate(fwd_ms, batch, nheads, seqlen, head_dim, causal)
                    if fwd_bwd_ms is not None:
                        bwd_rates[name] = 2.5 * _rate(fwd_bwd_ms - fwd_ms, batch, nheads, seqlen, head_dim, causal)
                case = f"d{head_dim}{' causal' if causal else ''} N={seqlen}"
                rows.append(dict(case=case, ms=figures, fwd_tflops=fwd_rates, bwd_tflops=bwd_rates))

                def cell(name, width=12):
                    if name not in fwd_rates:
                        return f"{'—':>{width}}"
                    text = f"{fwd_rates[name]:.0f}" + (f" / {bwd_rates[name]:.0f}" if name in bwd_rates else "")
                    return f"{text:>{width}}"

                print(f"{case:<20}{cell('gluon')}{cell('persistent')}{cell('tile')}{cell('triton', 8)}{cell('cudnn')}"
                      f"  {fwd_rates['gluon'] / fwd_rates['cudnn']:.3f}/{bwd_rates['gluon'] / bwd_rates['cudnn']:.3f}"
                      f"  {fwd_rates['triton'] / fwd_rates['cudnn']:12.3f}")
    for direction in ("fwd", "bwd"):
        ratios = [r[f"{direction}_tflops"]["gluon"] / r[f"{direction}_tflops"]["cudnn"] for r in rows]
        print(f"geometric mean gluon/cudnn {direction} {math.exp(sum(map(math.log, ratios)) / len(ratios)):.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(label=args.label, device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=triton.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
