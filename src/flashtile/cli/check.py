"""``python -m flashtile check``: verify flashtile on this machine's device and show its memory.

1. Accuracy: forward and backward of ``flash_attn_func`` against the float64 standard
   reference, next to PyTorch's own error in the same dtype (flash-attn's rule: ≤ 2× for
   the output, ≤ 3× for gradients, plus a float32-ulp floor).
2. Memory: peak extra memory of forward+backward, flashtile vs standard attention, as the
   sequence grows (CUDA: the caching allocator's peak; CPU: the peak resident set of a
   fresh process, Linux).
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from .. import reference
from ..accuracy import error_bound, max_error
from ..interface import flash_attn_func
from ..ops import uses_triton

ACCURACY_CASES = [
    # (dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim, causal)
    (torch.float16, 2, 257, 257, 4, 4, 64, False),
    (torch.float16, 2, 257, 257, 4, 4, 64, True),
    (torch.bfloat16, 2, 193, 311, 8, 2, 128, True),
    (torch.bfloat16, 1, 311, 193, 4, 1, 96, False),
    (torch.float32, 1, 129, 129, 4, 4, 40, True),
    (torch.bfloat16, 1, 65, 65, 2, 2, 256, True),
]


def accuracy_row(device, dtype, batch, seqlen_q, seqlen_k, nheads_q, nheads_k, head_dim, causal, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, nheads_q, head_dim, generator=g)
    k = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g)
    v = torch.randn(batch, seqlen_k, nheads_k, head_dim, generator=g)
    do = torch.randn(batch, seqlen_q, nheads_q, head_dim, generator=g)
    ours = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*ours, causal=causal)
    got = [out, *torch.autograd.grad(out, ours, do.to(device, dtype))]
    refs = {}
    for ref_dtype in (torch.float64, dtype):
        ts = [t.to(device, ref_dtype).transpose(1, 2).requires_grad_() for t in (q, k, v)]
        ref_out, _, _ = reference.attention_forward(*ts, causal=causal)
        grads = torch.autograd.grad(ref_out, ts, do.to(device, ref_dtype).transpose(1, 2))
        refs[ref_dtype] = [t.transpose(1, 2) for t in (ref_out, *grads)]
    row = {"dtype": str(dtype).replace("torch.", ""), "shape": f"{batch}x{seqlen_q}x{seqlen_k} h{nheads_q}:{nheads_k} d{head_dim}",
           "causal": causal, "ok": True}
    for name, ours_t, r64, rlow, factor in zip(("out", "dq", "dk", "dv"), got, refs[torch.float64], refs[dtype],
                                               (2, 3, 3, 3)):
        row[name] = max_error(ours_t, r64)
        row[f"torch_{name}"] = max_error(rlow, r64)
        row["ok"] &= row[name] <= error_bound(r64, rlow, factor)
    return row


_MEMORY_SNIPPET = """
import json, sys, torch
from flashtile import flash_attn_func, reference
def status_bytes(field):  # VmRSS (now) or VmHWM (peak since the last reset), Linux
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
impl, n, heads, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def step(n):
    q, k, v, do = (torch.randn(1, n, heads, d) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    before = status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak to the current resident set
    if impl == "flashtile":
        out = flash_attn_func(q, k, v, causal=True)
    else:
        out = reference.attention_forward(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)[0].transpose(1, 2)
    out.backward(do)
    return before
step(64)  # load the math libraries and start autograd first: their memory is not ours
before = step(n)
print(json.dumps(status_bytes("VmHWM") - before))
"""


def peak_memory_bytes(device, impl, seqlen, nheads, head_dim):
    """Peak extra bytes of one causal forward+backward (inputs excluded)."""
    if device == "cpu":
        env_cmd = [sys.executable, "-c", _MEMORY_SNIPPET, impl, str(seqlen), str(nheads), str(head_dim)]
        return json.loads(subprocess.run(env_cmd, check=True, capture_output=True, text=True).stdout)
    dtype = torch.bfloat16
    q, k, v, do = (torch.randn(1, seqlen, nheads, head_dim, device=device, dtype=dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    if impl == "flashtile":
        out = flash_attn_func(q, k, v, causal=True)
    else:
        out = reference.attention_forward(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)[0].transpose(1, 2)
    out.backward(do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del out, q, k, v, do
    torch.cuda.empty_cache()
    return peak


def run_check() -> bool:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    path = "Triton kernels" if uses_triton(torch.empty(0, device=device)) else "PyTorch tiled path"
    print(f"flashtile check on {name} ({path}); torch {torch.__version__}")
    print("\nAccuracy: max |error| vs float64 reference; in brackets PyTorch's own error in that dtype")
    header = f"{'dtype':9} {'shape':28} {'causal':6} " + " ".join(f"{n:>21}" for n in ("out", "dq", "dk", "dv")) + "  verdict"
    print(header)
    all_ok = True
    for case in ACCURACY_CASES:
        row = accuracy_row(device, *case)
        all_ok &= row["ok"]
        cells = " ".join(f"{row[n]:9.2e} [{row['torch_' + n]:9.2e}]" for n in ("out", "dq", "dk", "dv"))
        print(f"{row['dtype']:9} {row['shape']:28} {str(row['causal']):6} {cells}  {'ok' if row['ok'] else 'FAIL'}")

    seqlens = [1024, 2048, 4096, 8192, 16384] if device == "cuda" else [512, 1024, 2048, 4096]
    nheads, head_dim = (16, 128) if device == "cuda" else (4, 64)
    print(f"\nMemory: peak extra bytes of causal forward+backward, batch 1, {nheads} heads, head dim {head_dim}"
          f"{' (bf16)' if device == 'cuda' else ' (fp32)'}")
    print(f"{'seqlen':>7} {'flashtile':>12} {'standard':>12} {'ratio':>7}")
    for n in seqlens:
        ours = peak_memory_bytes(device, "flashtile", n, nheads, head_dim)
        standard = peak_memory_bytes(device, "standard", n, nheads, head_dim)
        print(f"{n:>7} {ours / 2**20:10.1f}MB {standard / 2**20:10.1f}MB {standard / max(ours, 1):6.1f}x")
    print("\nall checks passed" if all_ok else "\nSOME CHECKS FAILED")
    return all_ok
