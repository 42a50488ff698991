import sys; sys.argv=['x']; sys.path.insert(0,'benchmarks')
import host_overhead as h
import torch, flashtile, flashtile.autograd as fa
h._disable_launches()
q,k,v,dout = h._tiny_inputs('cpu')
qg,kg,vg = (t.clone().requires_grad_() for t in (q,k,v))
out_g = flashtile.flash_attn_func(qg,kg,vg,causal=True)
def bwd_autograd(): torch.autograd.grad(out_g,(qg,kg,vg),dout,retain_graph=True)
real = fa.call_bwd
for r in range(3):
    fa.call_bwd = real
    a = h._per_call_us(bwd_autograd, 2000, 7, lambda: None)
    fa.call_bwd = lambda *args: (None, None)
    b = h._per_call_us(bwd_autograd, 2000, 7, lambda: None)
    print("real", round(a,1), "call_bwd no-op", round(b,1))
