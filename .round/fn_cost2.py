import sys, gc; sys.argv=['x']; sys.path.insert(0,'benchmarks')
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
def bwd_autograd(): torch.autograd.grad(out_g,(qg,kg,vg),dout,retain_graph=True)
def bwd_op(): ops.call_bwd(dout,q,k,v,out,lse,dq,dk,dv,False,plain,causal)
def train(): torch.autograd.grad(flashtile.flash_attn_func(qg,kg,vg,causal=True),(qg,kg,vg),dout)
for r in range(4):
    gc.enable() if r % 2 == 0 else gc.disable()
    print("gc", gc.isenabled(), {n: round(h._per_call_us(f, 1000, 7, lambda: None),1) for n,f in dict(bwd_op=bwd_op, bwd_autograd=bwd_autograd, train=train).items()})
fn = out_g.grad_fn
print(type(fn), fn.next_functions)
def bwd_direct(): fn.apply(dout, None)
x = torch.randn(4, requires_grad=True); g4 = torch.randn(4); y = x * 2
def cpp_node(): torch.autograd.grad(y, (x,), g4, retain_graph=True)
def grad_3leaf():
    pass
for r in range(3):
    print({n: round(h._per_call_us(f, 1000, 7, lambda: None),1) for n,f in dict(bwd_op=bwd_op, bwd_direct=bwd_direct, bwd_autograd=bwd_autograd, cpp_node=cpp_node).items()})
import cProfile, pstats
pr = cProfile.Profile(); pr.runcall(lambda: [bwd_direct() for _ in range(2000)])
st = sorted(pstats.Stats(pr).stats.items(), key=lambda it: -it[1][2])[:14]
for (f, l, fn_), (_, nc, own, tot, _) in st: print(f"{own/2000*1e6:7.2f} ({tot/2000*1e6:7.2f}) {nc/2000:5.1f}x {fn_} {f.split('/')[-1]}:{l}")
