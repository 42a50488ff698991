"""Two things the twenty-fourth session could not run for want of device time (benchmarks/NOTES.md):

* the Triton backward at head dim 192 with its own tiles (``configs._BWD_16BIT_TWO_CHUNKS``, after) and the 256
  class's (before), alternating twice, beside cuDNN and SDPA flash (bf16, seqlen 4096, batch 4, 16 heads);
* one query against one key at head dims 64-256: dq's largest value (the exact one is 0) after the Gluon forward
  with either backward, and after the Triton forward, which tells whether the one-key failure at 192/256 is the
  backward's (it was: the Triton backward's D, fixed in the twenty-fifth session;
  ``tests/test_flash_attn.py::test_one_query_against_one_key``). GPU only.

    PYTHONPATH=src python3 benchmarks/experiments/wide_head_bwd.py
"""
import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import sdpa_kernel, SDPBackend
import flashtile
from flashtile.triton import configs, plans
SHIPPED = dict(configs._BWD_16BIT_TWO_CHUNKS)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)

def bwd_ms(fn, q, k, v, do):
    out = fn(q, k, v)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), warmup=25, rep=100,
                                   return_mode="median")

for hd in (192,):
    for causal in (False, True):
        n, b = 4096, 4
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(b, n, 16, hd, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        for t in (q, k, v): t.requires_grad_()
        flops = 2.5 * 4 * b * 16 * n * n * hd * (0.5 if causal else 1)
        ft = lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=causal)
        res = {"before": [], "after": []}
        for _ in range(2):
            for name, table in (("before", {}), ("after", SHIPPED)):
                configs._BWD_16BIT_TWO_CHUNKS = table; plans.clear()
                res[name].append(bwd_ms(ft, q, k, v, do))
        configs._BWD_16BIT_TWO_CHUNKS = SHIPPED; plans.clear()
        peers = {}
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel(be):
                sd = lambda q, k, v: F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                                    is_causal=causal).transpose(1, 2)
                peers[name] = bwd_ms(sd, q, k, v, do)
        tf = lambda ms: flops / ms / 1e9
        after = min(res["after"]); before = min(res["before"])
        print(f"bwd d{hd}{'c' if causal else ' '} before {' '.join(f'{tf(t):.0f}' for t in res['before'])} after "
              f"{' '.join(f'{tf(t):.0f}' for t in res['after'])} TFLOP/s  after/before {before/after:.3f}  cudnn {tf(peers['cudnn']):.0f} "
              f"flash {tf(peers['flash']):.0f}  after/cudnn {peers['cudnn']/after:.2f} after/flash {peers['flash']/after:.2f}", flush=True)

# seqlen 1: the gradients' largest error where the exact dq is 0 (one key: P = 1, dS = 0)
SHIPPED_MIN = dict(configs.GLUON_MIN_SEQLEN)
for hd in (64, 128, 192, 256):
    for mode in ("gluon-fwd", "gluon-fwd-det", "triton-fwd-det"):
        configs.GLUON_MIN_SEQLEN = {} if mode.startswith("triton") else {key: 1 for key in SHIPPED_MIN}; plans.clear()
        det = mode.endswith("det")
        g = torch.Generator().manual_seed(11)
        q, k, v, do = (torch.randn(2, 1, 4, hd, generator=g).to("cuda", torch.bfloat16) for _ in range(4))
        for t in (q, k, v): t.requires_grad_()
        out, lse, _ = flashtile.flash_attn_func(q, k, v, deterministic=det, return_attn_probs=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        s_ = (q.double() * k.double()).sum(-1).transpose(1, 2) * hd ** -0.5  # [B, H, 1]
        print(f"q1-k1 d{hd} {mode:15s}: max|dq| {dq.abs().max().item():.3e} (the rule's floor 9.5e-7) max|dk| {dk.abs().max().item():.3e} "
              f"max|out - v| {(out.float() - v.float()).abs().max().item():.3e} max|lse - s| {(lse.double() - s_).abs().max().item():.3e}",
              flush=True)
configs.GLUON_MIN_SEQLEN = SHIPPED_MIN
