"""Round 1: (a) the d64 Gluon forward with 2 consumer warpgroups (128-row tiles) against the shipped 3 / Triton,
(b) the backward (fwd+bwd − fwd) of this tree, cuDNN in the same run. Kernels in CUDA graphs, medians.
Run per tree with PYTHONPATH=<tree>/src; prints a table, writes JSON."""
import argparse, json, math, torch, triton, triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
import flashtile
from flashtile.gluon import sm90_fwd
from flashtile.triton import configs, plans

p = argparse.ArgumentParser(); p.add_argument("--label"); p.add_argument("--out"); p.add_argument("--rep", type=int, default=25)
p.add_argument("--seqlens", default="512,1024,2048,4096"); p.add_argument("--fwd-variants", type=int, default=1)
args = p.parse_args()
SHIP_MIN, SHIP_CONS, SHIP_PERS = dict(configs.GLUON_MIN_SEQLEN), dict(sm90_fwd.CONSUMERS), sm90_fwd.persistent

def policy(min_seqlen=None, consumers=None, persistent=None):
    configs.GLUON_MIN_SEQLEN = SHIP_MIN if min_seqlen is None else min_seqlen
    sm90_fwd.CONSUMERS = SHIP_CONS if consumers is None else consumers
    sm90_fwd.persistent = SHIP_PERS if persistent is None else persistent
    plans.clear()

def t(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median")

ALL = {k: 1 for k in SHIP_MIN}
rows = []
print(f"{args.label}: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
for d in (64, 128):
    for causal in (False, True):
        for n in map(int, args.seqlens.split(",")):
            B, H = 16384 // n, 32 if d == 64 else 16
            g = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, do = (torch.randn(B, n, H, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
            qt, kt, vt, dot = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v, do))
            flops = 4 * B * H * n * n * d * (0.5 if causal else 1)
            def fwd():
                with torch.no_grad():
                    return flashtile.flash_attn_func(q, k, v, causal=causal)
            fb = lambda: torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v), do)
            r = {}
            policy()
            r["ship_fwd"] = t(fwd); r["ship_fb"] = t(fb)
            ref = None
            if d == 64 and args.fwd_variants:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
                for name, pol in (("c2_tile", dict(min_seqlen=ALL, consumers={64: 2, 128: 2}, persistent=lambda c, s, h: False)),
                                  ("c2_pers", dict(min_seqlen=ALL, consumers={64: 2, 128: 2}, persistent=lambda c, s, h: s <= 2048)),
                                  ("c3_tile", dict(min_seqlen=ALL, persistent=lambda c, s, h: False)),
                                  ("triton", dict(min_seqlen={}))):
                    policy(**pol)
                    err = (fwd().float() - ref.float()).abs().max().item()
                    r[name] = t(fwd); r[name + "_err"] = err
                policy()
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                def cudnn_fwd():
                    with torch.no_grad():
                        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                r["cudnn_fwd"] = t(cudnn_fwd)
                r["cudnn_fb"] = t(lambda: torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), (qt, kt, vt), dot))
            tf = lambda ms: flops / ms / 1e9
            bwd = lambda fb_, f_: 2.5 * flops / (fb_ - f_) / 1e9
            case = f"d{d}{' causal' if causal else ''} N={n}"
            line = (f"{case:<18} fwd ship {tf(r['ship_fwd']):5.0f} cudnn {tf(r['cudnn_fwd']):5.0f} ({r['cudnn_fwd']/r['ship_fwd']:.3f})"
                    f" | bwd ship {bwd(r['ship_fb'], r['ship_fwd']):5.0f} cudnn {bwd(r['cudnn_fb'], r['cudnn_fwd']):5.0f}"
                    f" ({(r['cudnn_fb']-r['cudnn_fwd'])/(r['ship_fb']-r['ship_fwd']):.3f})")
            if "c2_tile" in r:
                line += " | d64 fwd/cudnn " + " ".join(f"{k}={r['cudnn_fwd']/r[k]:.3f}" for k in ("c2_tile", "c2_pers", "c3_tile", "triton")) \
                        + f" maxerr {max(r[k + '_err'] for k in ('c2_tile', 'c2_pers', 'c3_tile', 'triton')):.2e}"
            print(line, flush=True)
            rows.append(dict(case=case, ms=r))
            del q, k, v, do, qt, kt, vt, dot
if args.out:
    json.dump(dict(label=args.label, device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=rows), open(args.out, "w"), indent=1)
