"""The Gluon forward at head dims 192 and 256 against the Triton forward (the same call with the Gluon thresholds
off), cuDNN and SDPA flash: bf16, batch·seqlen 16384, 16 heads, seqlen 1024 / 4096 / 16384, full and causal;
``triton.testing.do_bench`` medians, TFLOP/s, and the two forwards' largest output difference. GPU only.

    PYTHONPATH=src python3 benchmarks/experiments/wide_head_fwd.py    (round 24: results/round24_2026-12-07/call1)
"""
import torch
import triton
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
import flashtile
from flashtile.triton import configs, plans
SHIPPED = dict(configs.GLUON_MIN_SEQLEN)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
rows = []
for hd in (192, 256):
    for causal in (False, True):
        for n in (1024, 4096, 16384):
            b = 16384 // n
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(b, n, 16, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            flops = 4 * b * 16 * n * n * hd * (0.5 if causal else 1)
            res = {}
            outs = {}
            for name, table in (("gluon", SHIPPED), ("triton", {})):
                configs.GLUON_MIN_SEQLEN = table; plans.clear()
                fn = lambda: flashtile.flash_attn_func(q, k, v, causal=causal)
                outs[name] = fn()
                res[name] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            configs.GLUON_MIN_SEQLEN = SHIPPED; plans.clear()
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                        ref = fn()
                        res[name] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                except Exception as e:
                    res[name] = float("nan")
            diff = (outs["gluon"].float() - outs["triton"].float()).abs().max().item()
            tf = {k_: flops / t / 1e9 for k_, t in res.items()}
            line = (f"d{hd}{'c' if causal else ' '} N={n:<6} gluon {tf['gluon']:6.0f} triton {tf['triton']:6.0f} cudnn {tf['cudnn']:6.0f} "
                    f"flash {tf['flash']:6.0f}  gluon/triton {res['triton']/res['gluon']:.2f} gluon/cudnn {res['cudnn']/res['gluon']:.2f} "
                    f"max|gluon-triton| {diff:.2e}")
            print(line, flush=True)
