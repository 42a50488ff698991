"""Where the GPU host's forward+backward time goes (diagnostic; not part of the package)."""
import gc, statistics, time, sys
import torch, torch.nn.functional as F
sys.path.insert(0, "benchmarks")
import flashtile
from host_overhead import _per_call_us
sync = torch.cuda.synchronize
q, k, v, dout = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
qt, kt, vt = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
doutt = dout.transpose(1, 2)
def ours(): torch.autograd.grad(flashtile.flash_attn_func(qg, kg, vg, causal=True), (qg, kg, vg), dout)
def sdpa(): torch.autograd.grad(F.scaled_dot_product_attention(qt, kt, vt, is_causal=True), (qt, kt, vt), doutt)
out_g = flashtile.flash_attn_func(qg, kg, vg, causal=True)
out_s = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
def ours_bwd(): torch.autograd.grad(out_g, (qg, kg, vg), dout, retain_graph=True)
def sdpa_bwd(): torch.autograd.grad(out_s, (qt, kt, vt), doutt, retain_graph=True)
def ours_fwd(): flashtile.flash_attn_func(qg, kg, vg, causal=True)
def sdpa_fwd(): F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
cases = dict(ours=ours, sdpa=sdpa, ours_bwd=ours_bwd, sdpa_bwd=sdpa_bwd, ours_fwd=ours_fwd, sdpa_fwd=sdpa_fwd)
for setting in ("default", "no engine threads", "gc off", "default again"):
    torch.autograd.set_multithreading_enabled(setting != "no engine threads")
    if setting == "gc off": gc.disable()
    else: gc.enable()
    print(setting, {n: round(_per_call_us(f, 300, 7, sync), 1) for n, f in cases.items()}, flush=True)
torch.autograd.set_multithreading_enabled(True)
# GPU time of one fwd+bwd (is the GPU keeping up?)
for n, f in (("ours", ours), ("sdpa", sdpa)):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(20): f()
        sync()
    total = sum(e.self_device_time_total for e in p.key_averages()) / 20
    print(n, "GPU µs per call", round(total, 1), [(e.key[:40], round(e.self_device_time_total / 20, 1)) for e in p.key_averages()][:8])
