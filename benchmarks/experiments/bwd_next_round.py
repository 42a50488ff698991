"""One device round for the experimental fused backwards of ``benchmarks/experiments/sm90_bwd_next.py``.

    PYTHONPATH=src python3 benchmarks/experiments/bwd_next_round.py --out $OUT

on one H100/H200 (torch ≥ 2.11, Triton 3.6); about 2–3 minutes, compiling included. Two parts:

1. **Correctness**, bf16, head dims 64 and 128, full and causal (bottom-right alignment), at
   (B, Nq, Nk, Hq, Hk) = (1, 17, 113, 4, 4), (2, 1000, 128, 4, 4) (its first 872 causal rows see no
   key), (2, 128, 1000, 4, 4), (2, 257, 300, 8, 2) (GQA 8:2), (1, 512, 512, 4, 4). The backward's
   inputs O and LSE come from a float64 PyTorch reference (so that only the backward is judged);
   each of dQ, dK, dV of the shipped kernel (``current``) and of every variant is compared with the
   float64 gradients by flash-attn's rule: max error ≤ 2 × PyTorch's own bf16 error (the same math
   run in bf16, softmax in float32) + 2 × the bf16 rounding at the gradient's magnitude. PASS/FAIL
   per case, and each variant's largest difference from ``current``.
2. **Backward-only timings**: ``triton.testing.do_bench`` median, p20, p80 (ms) at 16384 tokens,
   (B, N, H, D) = (8, 2048, 16, 128), (2, 8192, 16, 128), (1, 16384, 16, 128) and the same with
   H = 32, D = 64, full and causal, for ``current``, each variant where it applies, and SDPA's cuDNN
   backend (``sdpa_kernel(SDPBackend.CUDNN_ATTENTION)``, ``autograd.grad`` of one retained forward).
   Ours include the preprocess and the dQ conversion, as ``flashtile``'s backward does.
   TFLOP/s = 4·B·H·N²·D·2.5 (× 0.5 causal) / time; ratio = cuDNN's time / ours.

Every number goes to ``$OUT/bwd_next_round.json`` (rewritten after each part) and the table to
stdout. A kernel that deadlocks hangs the process: run it under ``timeout`` (the device tool's limit).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CORRECTNESS_CASES = [(1, 17, 113, 4, 4), (2, 1000, 128, 4, 4), (2, 128, 1000, 4, 4), (2, 257, 300, 8, 2),
                     (1, 512, 512, 4, 4)]
TIMING_SHAPES = {128: [(8, 2048, 16), (2, 8192, 16), (1, 16384, 16)], 64: [(8, 2048, 32), (2, 8192, 32), (1, 16384, 32)]}


def reference(q, k, v, do, causal, scale, dtype):
    """(out, lse, dq, dk, dv) of softmax(scale·QKᵀ)V in ``dtype`` (softmax in float32 at least),
    [B, N, H, D] tensors, GQA by head repetition, bottom-right causal alignment; a row that sees no
    key gets out 0, LSE −inf and zero gradients."""
    q, k, v, do = (t.detach().to(dtype).transpose(1, 2).requires_grad_() for t in (q, k, v, do))
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q * scale) @ kk.transpose(-1, -2)  # [B, H, Nq, Nk]
    nq, nk = s.shape[-2:]
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    s = s.to(soft)
    empty = torch.zeros(nq, 1, dtype=torch.bool, device=q.device)  # rows that see no key
    if causal:
        visible = (torch.arange(nk, device=q.device)[None, :]
                   <= torch.arange(nq, device=q.device)[:, None] + nk - nq)
        s = s.masked_fill(~visible, float("-inf"))
        empty = ~visible.any(-1, keepdim=True)
    lse = torch.logsumexp(s.detach(), dim=-1, keepdim=True)  # −inf on empty rows
    # softmax over a zeroed row, then zeroed: no NaN reaches the gradients of the empty rows
    p = (torch.softmax(s.masked_fill(empty, 0.0), dim=-1) * ~empty).to(dtype)
    out = p @ vv
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    back = lambda t: t.transpose(1, 2).contiguous()  # noqa: E731
    return back(out.detach()), lse.squeeze(-1).float().detach(), back(dq), back(dk), back(dv)


def rounding(t):
    """flash-attn's floor: the bf16 rounding error at the tensor's magnitude."""
    t = t.float()
    return ((t + 0.3 - 0.3) - t).abs().max().item()


def shipped_forward(q, k, v, scale, causal):
    """(out, lse) through the shipped launcher."""
    from flashtile._options import AttentionOptions, AttentionTensors
    from flashtile.triton import launch
    options = AttentionOptions(scale, window_right=0 if causal else -1)
    return launch.attention_forward(q, k, v, options, AttentionTensors())


def shipped_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal):
    """dq, dk, dv written through the shipped launcher, which takes the fused Gluon backward here."""
    from flashtile._options import AttentionOptions, AttentionTensors
    from flashtile.triton import launch
    options = AttentionOptions(scale, window_right=0 if causal else -1)
    launch.attention_backward(dout, q, k, v, out, lse, options, AttentionTensors(), dq, dk, dv)


def run_backward(name, dout, q, k, v, out, lse, scale, causal):
    """dq, dk, dv from the shipped kernel (``current``) or a variant of sm90_bwd_next."""
    import sm90_bwd_next
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if name == "current":
        shipped_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, causal)
    else:
        sm90_bwd_next.flash_attn_backward_sm90(dout, q, k, v, out, lse, dq, dk, dv, scale, causal=causal, variant=name)
    return dq, dk, dv


def providers(head_dim):
    import sm90_bwd_next
    chosen = os.environ.get("VARIANTS", "").split(",") if os.environ.get("VARIANTS") else sm90_bwd_next.VARIANTS
    return ["current"] + [name for name, dims in sm90_bwd_next.VARIANTS.items() if head_dim in dims and name in chosen]


def correctness(results, head_dims):
    print("== correctness (bf16; err = max |x − float64|, bound = 2·PyTorch bf16 err + 2·rounding)", flush=True)
    all_pass = True
    for head_dim in head_dims:
        for causal in (False, True):
            for batch, nq, nk, hq, hk in CORRECTNESS_CASES:
                g = torch.Generator(device="cuda").manual_seed(batch * 1000 + nq + nk + head_dim + causal)
                make = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
                q, k, v = make(batch, nq, hq, head_dim), make(batch, nk, hk, head_dim), make(batch, nk, hk, head_dim)
                do = make(batch, nq, hq, head_dim)
                scale = 1 / math.sqrt(head_dim)
                out64, lse64, *grads64 = reference(q, k, v, do, causal, scale, torch.float64)
                _, _, *grads_pt = reference(q, k, v, do, causal, scale, torch.bfloat16)
                out = out64.to(torch.bfloat16)
                lse = lse64.contiguous()  # [B, Hq, Nq] float32
                bounds = [2 * (pt.double() - ref).abs().max().item() + 2 * rounding(ref)
                          for pt, ref in zip(grads_pt, grads64)]
                got = {}
                label = f"d{head_dim} {'causal' if causal else 'full'} B{batch} Nq{nq} Nk{nk} H{hq}:{hk}"
                for name in providers(head_dim):
                    try:
                        got[name] = run_backward(name, do, q, k, v, out, lse, scale, causal)
                        torch.cuda.synchronize()
                    except Exception as error:  # noqa: BLE001 - a variant that fails to compile or launch is a FAIL
                        print(f"  FAIL {name:8s} {label}: {type(error).__name__}: {str(error)[:300]}", flush=True)
                        results["correctness"].append(dict(case=label, provider=name, passed=False,
                                                           error=f"{type(error).__name__}: {str(error)[:2000]}"))
                        all_pass = False
                        continue
                    errs = [(x.double() - ref).abs().max().item() for x, ref in zip(got[name], grads64)]
                    ok = all(e <= b for e, b in zip(errs, bounds)) and all(torch.isfinite(x).all() for x in got[name])
                    vs_current = ([(x.float() - c.float()).abs().max().item() for x, c in zip(got[name], got["current"])]
                                  if name != "current" and "current" in got else None)
                    all_pass &= ok
                    print(f"  {'PASS' if ok else 'FAIL'} {name:8s} {label:40s} err dq/dk/dv "
                          + " ".join(f"{e:.2e}/{b:.2e}" for e, b in zip(errs, bounds))
                          + (f"  |Δ current| {max(vs_current):.2e}" if vs_current else ""), flush=True)
                    results["correctness"].append(dict(case=label, provider=name, passed=ok, errors=errs, bounds=bounds,
                                                       diff_vs_current=vs_current))
    return all_pass


def flops(batch, seqlen, heads, head_dim, causal):
    return 4 * batch * heads * seqlen * seqlen * head_dim * 2.5 * (0.5 if causal else 1.0)


def timings(results, warmup, rep, head_dims):
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print(f"== backward-only timings (do_bench median ms [p20, p80], warmup {warmup} rep {rep} ms; TFLOP/s; "
          "ratio = cuDNN time / ours)", flush=True)
    rows = []
    for head_dim in sorted(head_dims, reverse=True):
        for causal in (False, True):
            for batch, seqlen, heads in TIMING_SHAPES[head_dim]:
                g = torch.Generator(device="cuda").manual_seed(seqlen + head_dim)
                make = lambda: torch.randn(batch, seqlen, heads, head_dim, generator=g,  # noqa: E731
                                           device="cuda").to(torch.bfloat16)
                q, k, v, do = make(), make(), make(), make()
                scale = 1 / math.sqrt(head_dim)
                out, lse = shipped_forward(q, k, v, scale, causal)
                dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
                calls = {}
                import sm90_bwd_next
                for name in providers(head_dim):
                    if name == "current":
                        calls[name] = lambda: shipped_backward(do, q, k, v, out, lse, dq, dk, dv, scale, causal)
                    else:
                        calls[name] = (lambda name=name: sm90_bwd_next.flash_attn_backward_sm90(
                            do, q, k, v, out, lse, dq, dk, dv, scale, causal=causal, variant=name))
                qs, ks, vs = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
                sdpa_out = None
                try:
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        sdpa_out = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=causal,
                                                                                    scale=scale)
                    do_s = do.transpose(1, 2)
                    calls["cudnn"] = lambda: torch.autograd.grad(sdpa_out, (qs, ks, vs), do_s, retain_graph=True)
                except RuntimeError as error:
                    print(f"  cuDNN refused: {str(error)[:200]}", flush=True)
                row = dict(head_dim=head_dim, causal=causal, batch=batch, seqlen=seqlen, heads=heads, ms={}, tflops={})
                for name, call in calls.items():
                    try:
                        call()
                        torch.cuda.synchronize()
                        median, p20, p80 = triton.testing.do_bench(call, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
                    except Exception as error:  # noqa: BLE001
                        print(f"  {name} failed: {type(error).__name__}: {str(error)[:200]}", flush=True)
                        continue
                    row["ms"][name] = [median, p20, p80]
                    row["tflops"][name] = flops(batch, seqlen, heads, head_dim, causal) / (median * 1e-3) / 1e12
                if "cudnn" in row["ms"]:
                    row["ratio_vs_cudnn"] = {name: row["ms"]["cudnn"][0] / ms[0] for name, ms in row["ms"].items()
                                             if name != "cudnn"}
                if "current" in row["ms"]:
                    row["ratio_vs_current"] = {name: row["ms"]["current"][0] / ms[0] for name, ms in row["ms"].items()
                                               if name not in ("current", "cudnn")}
                rows.append(row)
                results["timings"] = rows
                shape = f"d{head_dim} {'causal' if causal else 'full  '} ({batch},{seqlen},{heads})"
                cells = []
                for name in row["ms"]:
                    median, p20, p80 = row["ms"][name]
                    ratio = row.get("ratio_vs_cudnn", {}).get(name)
                    cells.append(f"{name} {median:.3f} [{p20:.3f},{p80:.3f}] {row['tflops'][name]:.0f}T"
                                 + (f" x{ratio:.3f}" if ratio is not None else ""))
                print(f"  {shape:28s} " + " | ".join(cells), flush=True)
                del q, k, v, do, out, lse, dq, dk, dv, qs, ks, vs, calls, sdpa_out
                torch.cuda.empty_cache()
    # the short table: TFLOP/s and × cuDNN per provider
    names = sorted({name for row in rows for name in row["ms"]}, key=lambda n: (n == "cudnn", n != "current", n))
    print("\n== summary: TFLOP/s (× cuDNN)", flush=True)
    print(f"  {'shape':30s} " + " ".join(f"{n:>16s}" for n in names))
    for row in rows:
        shape = f"d{row['head_dim']} {'causal' if row['causal'] else 'full'} ({row['batch']},{row['seqlen']},{row['heads']})"
        cells = []
        for n in names:
            if n not in row["tflops"]:
                cells.append(f"{'-':>16s}")
            elif n == "cudnn":
                cells.append(f"{row['tflops'][n]:16.0f}")
            else:
                cells.append(f"{row['tflops'][n]:8.0f} ({row.get('ratio_vs_cudnn', {}).get(n, float('nan')):.3f})")
        print(f"  {shape:30s} " + " ".join(cells))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for bwd_next_round.json")
    parser.add_argument("--warmup", type=int, default=25)
    parser.add_argument("--rep", type=int, default=150)
    parser.add_argument("--skip-correctness", action="store_true")
    parser.add_argument("--skip-timings", action="store_true")
    parser.add_argument("--head-dims", default="64,128", help="comma-separated subset of 64,128")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        sys.exit("bwd_next_round.py needs an sm_90 GPU (H100/H200): the Gluon kernels run nowhere else. "
                 "On a CPU, `TRITON_INTERPRET=0 PYTHONPATH=src python benchmarks/experiments/sm90_bwd_next.py` "
                 "compiles them for sm_90a and prints ptxas's registers and spills.")
    head_dims = [int(d) for d in args.head_dims.split(",")]
    import triton
    import sm90_bwd_next  # noqa: F401 - fail early, before any timing, if the variants' file does not import
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bwd_next_round.json")
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   started=time.strftime("%Y-%m-%d %H:%M:%S"), correctness=[], timings=[])
    print(results["device"], "torch", torch.__version__, "triton", triton.__version__, flush=True)
    begin = time.time()
    if not args.skip_correctness:
        results["all_pass"] = correctness(results, head_dims)
        print(f"  correctness: {'ALL PASS' if results['all_pass'] else 'SOME FAIL'} ({time.time() - begin:.0f} s)",
              flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    if not args.skip_timings:
        timings(results, args.warmup, args.rep, head_dims)
    results["seconds"] = time.time() - begin
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {path} ({results['seconds']:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
