"""The fused sm_90 backward's wide schedule (``flashtile.gluon.sm90_bwd``, head dims 192 and 256), written in the
twenty-sixth session without a GPU and not routed yet (``sm90_bwd.ROUTED_HEAD_DIMS``), against the Triton backward
that the launcher runs there today, SDPA cuDNN and SDPA flash: bf16, 16 heads, batch · seqlen = 16384 tokens at
seqlen 2048 / 4096 / 8192, full and causal. Each case first compares the two flashtile backwards' gradients (max
|difference| over the largest gradient, printed), then times both routes twice, alternating, beside the peers
(do_bench medians; TFLOP/s as 2.5 · 4 · B · H · N² · D, halved under causal masking). GPU only:

    PYTHONPATH=src python3 benchmarks/experiments/sm90_bwd_wide.py [--head-dims 192,256] [--seqlens 2048,4096,8192]
"""
import argparse

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.gluon import sm90_bwd
from flashtile.triton import plans

SHIPPED = sm90_bwd.ROUTED_HEAD_DIMS
WIDE = SHIPPED + (192, 256)


def backward_ms(attention, q, k, v, do) -> float:
    out = attention(q, k, v)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), warmup=25,
                                   rep=100, return_mode="median")


def gradients(attention, q, k, v, do):
    return torch.autograd.grad(attention(q, k, v), (q, k, v), do)


def route(head_dims) -> None:
    sm90_bwd.ROUTED_HEAD_DIMS = head_dims
    plans.clear()  # a call key's plan remembers its route


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="192,256")
    parser.add_argument("--seqlens", default="2048,4096,8192")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for head_dim in map(int, args.head_dims.split(",")):
        for seqlen in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                batch, heads = 16384 // seqlen, 16
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                                           generator=g) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                flashtile_attention = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal)
                route(WIDE)
                fused = gradients(flashtile_attention, q, k, v, do)
                route(SHIPPED)
                portable = gradients(flashtile_attention, q, k, v, do)
                gaps = " ".join(f"{name} {((a.float() - b.float()).abs().max() / b.float().abs().max()).item():.1e}"
                                for name, a, b in zip(("dq", "dk", "dv"), fused, portable))
                times = {"fused": [], "triton": []}
                for _ in range(2):
                    for name, head_dims in (("fused", WIDE), ("triton", SHIPPED)):
                        route(head_dims)
                        times[name].append(backward_ms(flashtile_attention, q, k, v, do))
                route(SHIPPED)
                for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    with sdpa_kernel(backend):
                        sdpa = lambda q, k, v: F.scaled_dot_product_attention(
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
                        times[name] = [backward_ms(sdpa, q, k, v, do)]
                flops = 2.5 * 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1)
                tflops = {name: [flops / ms / 1e9 for ms in runs] for name, runs in times.items()}
                best = {name: min(runs) for name, runs in times.items()}
                print(f"d{head_dim} N{seqlen} {'causal' if causal else 'full  '} |grad gap| {gaps}  TFLOP/s "
                      + " ".join(f"{name} {'/'.join(f'{x:.0f}' for x in runs)}" for name, runs in tflops.items())
                      + f"  fused÷triton {best['triton'] / best['fused']:.2f} ÷cudnn {best['cudnn'] / best['fused']:.2f}"
                      f" ÷flash {best['flash'] / best['fused']:.2f}", flush=True)


if __name__ == "__main__":
    main()
