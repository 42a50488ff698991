import sys; sys.argv=['x']; sys.path.insert(0,'benchmarks')
import host_overhead as h
import torch, flashtile
h._disable_launches()
q,k,v,dout = h._tiny_inputs('cpu')
qg,kg,vg = (t.clone().requires_grad_() for t in (q,k,v))
out_g = flashtile.flash_attn_func(qg,kg,vg,causal=True)
def bwd_autograd(): torch.autograd.grad(out_g,(qg,kg,vg),dout,retain_graph=True)
for _ in range(100): bwd_autograd()
with torch.profiler.profile() as p:
    for _ in range(100): bwd_autograd()
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=25))
