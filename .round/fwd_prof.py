import sys; sys.argv=['x']; sys.path.insert(0,'benchmarks')
import host_overhead as h
import torch, flashtile
h._disable_launches()
q,k,v,dout = h._tiny_inputs('cpu')
qg,kg,vg = (t.clone().requires_grad_() for t in (q,k,v))
def train(): torch.autograd.grad(flashtile.flash_attn_func(qg,kg,vg,causal=True),(qg,kg,vg),dout)
for _ in range(100): train()
with torch.profiler.profile() as p:
    for _ in range(100): train()
print(p.key_averages().table(sort_by="cpu_time_total", row_limit=30))
