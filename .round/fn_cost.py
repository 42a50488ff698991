import sys; sys.argv=['x']; sys.path.insert(0,'benchmarks')
import host_overhead as h
import torch, flashtile, flashtile.ops as ops
from flashtile._options import AttentionOptions, AttentionTensors
h._disable_launches()
q,k,v,dout = h._tiny_inputs('cpu')
causal, plain = AttentionOptions(0.125, window_right=0), AttentionTensors()
qg,kg,vg = (t.clone().requires_grad_() for t in (q,k,v))
out, lse = ops.call_fwd(q,k,v,plain,causal)
dq,dk,dv = (torch.empty_like(t) for t in (q,k,v))
out_g = flashtile.flash_attn_func(qg,kg,vg,causal=True)
def fwdgrad(): flashtile.flash_attn_func(qg,kg,vg,causal=True)
def train(): torch.autograd.grad(flashtile.flash_attn_func(qg,kg,vg,causal=True),(qg,kg,vg),dout)
def bwd_autograd(): torch.autograd.grad(out_g,(qg,kg,vg),dout,retain_graph=True)
def bwd_op(): ops.call_bwd(dout,q,k,v,out,lse,dq,dk,dv,False,plain,causal)
def fwd_op(): ops.call_fwd(q,k,v,plain,causal)
def public_nograd():
    with torch.no_grad(): flashtile.flash_attn_func(q,k,v,causal=True)
for r in range(3):
    print({n: round(h._per_call_us(f, 1000, 7, lambda: None),1) for n,f in dict(fwd_op=fwd_op, public_nograd=public_nograd, fwdgrad=fwdgrad, bwd_op=bwd_op, bwd_autograd=bwd_autograd, train=train).items()})
import cProfile, pstats
pr = cProfile.Profile(); pr.runcall(lambda: [bwd_autograd() for _ in range(2000)])
st = sorted(pstats.Stats(pr).stats.items(), key=lambda it: -it[1][2])[:30]
for (f, l, fn), (_, nc, own, tot, _) in st: print(f"{own/2000*1e6:7.2f} ({tot/2000*1e6:7.2f}) {nc/2000:5.1f}x {fn} {f.split('/')[-1]}:{l}")
