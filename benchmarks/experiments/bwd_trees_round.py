"""The fused backward (fwd+bwd − fwd, kernels in CUDA graphs, medians), cuDNN in the same run, for one tree.
Run per tree with PYTHONPATH=<tree>/src."""
import argparse, json, torch, triton, triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
import flashtile
p = argparse.ArgumentParser(); p.add_argument("--label"); p.add_argument("--out"); p.add_argument("--rep", type=int, default=30)
p.add_argument("--seqlens", default="1024,2048,8192"); p.add_argument("--headdims", default="128")
args = p.parse_args()
def t(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=args.rep, return_mode="median")
rows = []
print(f"{args.label}: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}")
for d in map(int, args.headdims.split(",")):
    for causal in (False, True):
        for n in map(int, args.seqlens.split(",")):
            B, H = 16384 // n, 2048 // d
            g = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, do = (torch.randn(B, n, H, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            q.requires_grad_(); k.requires_grad_(); v.requires_grad_()
            qt, kt, vt, dot = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v, do))
            flops = 2.5 * 4 * B * H * n * n * d * (0.5 if causal else 1)
            def fwd():
                with torch.no_grad():
                    flashtile.flash_attn_func(q, k, v, causal=causal)
            fb = lambda: torch.autograd.grad(flashtile.flash_attn_func(q, k, v, causal=causal), (q, k, v), do)
            def cfwd():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                    torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            def cfb():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                torch.autograd.grad(o, (qt, kt, vt), dot)
            ft = t(fb) - t(fwd); ct = t(cfb) - t(cfwd)
            r = dict(d=d, causal=causal, n=n, bwd_ms=ft, cudnn_bwd_ms=ct, tflops=flops / ft / 1e9, ratio=ct / ft)
            rows.append(r)
            print(f"d{d}{'c' if causal else ' '} N={n:5d}  bwd {r['tflops']:6.1f} TFLOP/s  cuDNN {flops / ct / 1e9:6.1f}  ratio {r['ratio']:.3f}", flush=True)
if args.out:
    json.dump(dict(label=args.label, device=torch.cuda.get_device_name(), rows=rows), open(args.out, "w"), indent=1)
